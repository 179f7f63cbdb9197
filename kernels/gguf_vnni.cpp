// gguf-int8's Q4_K and Q6_K products from panels (gguf_panels.h) on CPUs with AVX-512 VNNI. The
// model is gguf_int8.cpp's: the same int8 activations and integer sums per sub-block; only the
// fp32 sums of the super-blocks run in another order.
//
// One vpdpbusd multiplies 16 outputs by 4 values of a row broadcast from memory, so a row costs
// ~1.4 instructions per 64 weights against gguf_int8.cpp's ~8, while unpacking the 4-bit codes
// (shared by the rows of a pass) stays as it was. Where the CPU has AMX, rows in tiles of 16 take
// gguf_amx.cpp's tile multiplies instead: the same integer sums, so the same bits at any row count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_int8_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace gguf_int8;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int ROWS_PER_PASS = 6;  // a row's two accumulators, the 8 unpacked vectors and scales: 32 registers

int32_t int16_pair(int32_t low, int32_t high) {  // both fit int16: at most 32 codes of |127|
  return static_cast<int32_t>((static_cast<uint32_t>(low) & 0xFFFF) | (static_cast<uint32_t>(high) << 16));
}

ALWAYS_INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Σ over 16 values (4 groups from w) of one row's codes, per lane, as two chains so one row's
// latency does not serialise them
ALWAYS_INLINE __m512i dot16(const __m512i* w, const int8_t* a) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w[0], bcast4(a)), w[1], bcast4(a + 4));
  const __m512i q = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w[2], bcast4(a + 8)), w[3], bcast4(a + 12));
  return _mm512_add_epi32(p, q);
}

template <int ROWS>
void q4k_pass(const uint8_t* panel, int64_t super_blocks, const ActRow* rows, __m512* out) {
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q4K_PANEL) {
    __m512i sums[ROWS];
    for (int r = 0; r < ROWS; ++r) sums[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      prefetch_eighth<Q4K_PANEL>(panel, j);
      __m512i w[8];
      nibbles(panel + 256 * j, w);
      const __m512i scale = q4k_scales(panel, j);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* a = rows[r].q + 256 * sb + 32 * j;
        const __m512i dot = _mm512_add_epi32(dot16(w, a), dot16(w + 4, a + 16));
        sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(dot, scale));
      }
    }
    q4k_finish<ROWS>(panel, sb, rows, sums, out);
  }
}

template <int ROWS>
void q6k_pass(const uint8_t* panel, int64_t super_blocks, const ActRow* rows, __m512* out) {
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q6K_PANEL) {
    __m512i sums[ROWS], offsets[ROWS];  // Σ sc Σ q a with codes 0..63, and Σ sc Σ a for their -32
    for (int r = 0; r < ROWS; ++r) sums[r] = offsets[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      prefetch_eighth<Q6K_PANEL>(panel, g);
      __m512i w[8];
      q6k_codes(panel + Q6K_GROUP * g, w);
      const __m512i pair = byte_pairs(panel + Q6K_SCALES + 32 * g, true);
      __m512i scale[2];
      pair_scales(pair, scale);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* a = rows[r].q + 256 * sb + 32 * g;
        sums[r] = _mm512_add_epi32(sums[r], _mm512_add_epi32(_mm512_mullo_epi32(dot16(w, a), scale[0]),
                                                             _mm512_mullo_epi32(dot16(w + 4, a + 16), scale[1])));
        offsets[r] = _mm512_dpwssd_epi32(offsets[r], pair, _mm512_set1_epi32(rows[r].pairs16[8 * sb + g]));
      }
    }
    q6k_finish<ROWS>(panel, sb, rows, sums, offsets, out);
  }
}

at::Tensor linear_int8_panels(const at::Tensor& x, const at::Tensor& panels, int64_t kind, int64_t k, int64_t n) {
  check_panels(x, panels, kind, k, n);
  const int64_t super_blocks = k / 256;
  const at::Tensor xs = x.contiguous();
  const int64_t m = xs.size(0);
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * super_blocks);
  std::vector<int32_t> sum16(m * (k / 16)), pairs16(m * (k / 32)), pairs32(m * (k / 64));
  std::vector<ActRow> rows(m);
  at::parallel_for(0, m, gguf::QUANTIZE_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int32_t* s16 = sum16.data() + r * (k / 16);
      gguf::quantize_row(xs.data_ptr<float>() + r * k, k, 256, q.data() + r * k, d.data() + r * super_blocks, s16);
      for (int64_t i = 0; i < k / 32; ++i) pairs16[r * (k / 32) + i] = int16_pair(s16[2 * i], s16[2 * i + 1]);
      for (int64_t i = 0; i < k / 64; ++i)
        pairs32[r * (k / 64) + i] = int16_pair(s16[4 * i] + s16[4 * i + 1], s16[4 * i + 2] + s16[4 * i + 3]);
      rows[r] = {q.data() + r * k, d.data() + r * super_blocks, pairs16.data() + r * (k / 32), pairs32.data() + r * (k / 64)};
    }
  });
  at::Tensor out = at::empty({m, n}, x.options());
  float* y = out.data_ptr<float>();
  const int64_t tiled = tiled_rows(m, kind);
  if (tiled > 0) tile_passes(panels, kind, k, n, rows.data(), tiled, y);
  each_pass<ROWS_PER_PASS>(panels.size(0), m - tiled, [&](auto rows_here, int64_t p, int64_t rest) {
    constexpr int ROWS = decltype(rows_here)::value;
    const int64_t r = tiled + rest;
    const uint8_t* panel = panels.data_ptr<uint8_t>() + p * panels.size(1);
    __m512 acc[ROWS];
    for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
    if (kind == Q4_K) q4k_pass<ROWS>(panel, super_blocks, rows.data() + r, acc);
    else q6k_pass<ROWS>(panel, super_blocks, rows.data() + r, acc);
    store_lanes<ROWS>(acc, y + r * n, n, p * LANES);
  });
  return out;
}

#else
at::Tensor linear_int8_panels(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the int8 GGUF panel kernels need AVX-512 VNNI, which this CPU lacks");
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(ssd_engine_gguf, m) {
  m.def("linear_int8_panels(Tensor x, Tensor panels, int kind, int k, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CPU, m) {
  m.impl("linear_int8_panels", &linear_int8_panels);
}
