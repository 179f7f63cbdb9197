// target_dtype "gguf" (the checkpoint's exact values, fp32 activations) from Q4_K / Q6_K panels
// (gguf_panels.h) on CPUs with AVX-512.
//
// Each value of a panel is dequantized once for its 16 outputs, exactly as gguf's dequantizer
// computes it (Q4_K: d·sc·q is exact in fp32, so one fused d·sc·q − dmin·m rounds once, as its
// two steps do; Q6_K: (d·sc)·(q − 32), one rounding), then multiplied into every row of the pass
// with one FMA against the row's value broadcast from memory. A row costs one FMA per 16 weights;
// the unpacking (about four instructions per 16 weights) is shared by the rows of a pass.
//
// A row sums its values in column order into two accumulators (even and odd columns, so one
// row's FMA latency does not serialise it), added at the end: the same order at any row count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_panels.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace gguf_panels;

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int ROWS_PER_PASS = 6;  // two accumulators a row beside the 8 code vectors: 32 registers

template <int E>  // byte E of every lane: value 4t + E of each output, from code vector t (one instruction)
ALWAYS_INLINE __m512i byte_of(__m512i v) {
  if constexpr (E == 3) return _mm512_srli_epi32(v, 24);
  else if constexpr (E == 0) return _mm512_and_si512(v, _mm512_set1_epi32(0xFF));
  else return _mm512_shuffle_epi8(v, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(0x80808000u | E)),
                                                      _mm512_set4_epi32(12, 8, 4, 0)));  // in each 128-bit lane
}

// the rows' FMAs for one column k of the panel, whose 16 weights are w
template <int ROWS, int PARITY>
ALWAYS_INLINE void columns(__m512 w, const float* const* x, int64_t k, __m512 (*acc)[2]) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r][PARITY] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r][k]), acc[r][PARITY]);
}

// 32 columns from k0: code vectors w[0..7], each value dequantized by `weight(codes, t)`
template <int ROWS, typename Weight>
ALWAYS_INLINE void group(const __m512i* w, const Weight& weight, const float* const* x, int64_t k0, __m512 (*acc)[2]) {
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    columns<ROWS, 0>(weight(byte_of<0>(w[t]), t), x, k0 + 4 * t, acc);
    columns<ROWS, 1>(weight(byte_of<1>(w[t]), t), x, k0 + 4 * t + 1, acc);
    columns<ROWS, 0>(weight(byte_of<2>(w[t]), t), x, k0 + 4 * t + 2, acc);
    columns<ROWS, 1>(weight(byte_of<3>(w[t]), t), x, k0 + 4 * t + 3, acc);
  }
}

template <int ROWS>
void q4k_rows(const uint8_t* panel, int64_t super_blocks, const float* const* x, __m512 (*acc)[2]) {
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q4K_PANEL) {
    const __m512 d = halves(panel + Q4K_D), dmin = halves(panel + Q4K_DMIN);
    for (int j = 0; j < 8; ++j) {
      __m512i w[8];
      nibbles(panel + 256 * j, w);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + Q4K_SCALES + 16 * j));
      const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
      const __m512i mins = byte_pairs(panel + Q4K_MINS + 32 * (j / 2), false);
      const __m512i m = j % 2 ? _mm512_srli_epi32(mins, 16) : _mm512_and_si512(mins, _mm512_set1_epi32(0xFFFF));
      const __m512 min = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
      group<ROWS>(w, [&](__m512i codes, int) { return _mm512_fmsub_ps(_mm512_cvtepi32_ps(codes), scale, min); },
                  x, 256 * sb + 32 * j, acc);
    }
  }
}

template <int ROWS>
void q6k_rows(const uint8_t* panel, int64_t super_blocks, const float* const* x, __m512 (*acc)[2]) {
  const __m512i offset = _mm512_set1_epi32(32);
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q6K_PANEL) {
    const __m512 d = halves(panel + Q6K_D);
    for (int g = 0; g < 8; ++g) {
      __m512i w[8];
      q6k_codes(panel + Q6K_GROUP * g, w);
      const __m512i pair = byte_pairs(panel + Q6K_SCALES + 32 * g, true);
      const __m512 scale0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16)));
      const __m512 scale1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(pair, 16)));
      group<ROWS>(w, [&](__m512i codes, int t) {
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(codes, offset)), t < 4 ? scale0 : scale1);
      }, x, 256 * sb + 32 * g, acc);
    }
  }
}

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t kind, int64_t k, int64_t n) {
  check_panels(x, panels, kind, k, n);
  const int64_t super_blocks = k / 256;
  const at::Tensor xs = x.contiguous();
  const int64_t m = xs.size(0);
  std::vector<const float*> rows(m);
  for (int64_t r = 0; r < m; ++r) rows[r] = xs.data_ptr<float>() + r * k;
  at::Tensor out = at::empty({m, n}, x.options());
  float* y = out.data_ptr<float>();
  each_pass<ROWS_PER_PASS>(panels.size(0), m, [&](auto rows_here, int64_t p, int64_t r) {
    constexpr int ROWS = decltype(rows_here)::value;
    const uint8_t* panel = panels.data_ptr<uint8_t>() + p * panels.size(1);
    __m512 acc[ROWS][2], sum[ROWS];
    for (int i = 0; i < ROWS; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    if (kind == Q4_K) q4k_rows<ROWS>(panel, super_blocks, rows.data() + r, acc);
    else q6k_rows<ROWS>(panel, super_blocks, rows.data() + r, acc);
    for (int i = 0; i < ROWS; ++i) sum[i] = _mm512_add_ps(acc[i][0], acc[i][1]);
    store_lanes<ROWS>(sum, y + r * n, n, p * LANES);
  });
  return out;
}
#else
at::Tensor linear_panels(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the GGUF panel kernels need AVX-512, which this CPU lacks");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(ssd_engine_gguf, m) { m.def("linear_panels(Tensor x, Tensor panels, int kind, int k, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CPU, m) { m.impl("linear_panels", &linear_panels); }
