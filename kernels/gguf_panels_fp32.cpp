// target_dtype "gguf" (the checkpoint's exact values, fp32 activations) from Q4_K / Q6_K panels
// (gguf_panels.h) on CPUs with AVX-512.
//
// The weights are the checkpoint's values, w = d·sc·q − dmin·m (Q4_K) or d·sc·(q − 32) (Q6_K),
// applied factored: per sub-block a row sums q·x (or (q − 32)·x) in fp32, then adds that sum times
// d·sc and subtracts dmin·m times its sum of x. d·sc and dmin·m are exact in fp32 and q is a small
// integer, so this is a dot product of the same values in another order, with fewer roundings than
// dequantizing each weight first (about 3x nearer the float64 product on random rows), and it
// leaves a row one FMA per 16 weights with nothing else per weight but turning a code into a float.
// A code becomes a float in one permute: a lane's low 4 bits index the table 0..15, so a 32-bit
// lane holding 8 codes gives each of them after a shift, with no masking or conversion.
//
// A row sums each sub-block into two accumulators (low and high nibbles, so one row's FMA latency
// does not serialise it), then into its total: the same order at any row count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_panels.h"

#include <cstdint>
#include <numeric>
#include <vector>

namespace {

using namespace gguf_panels;

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int ROWS_PER_PASS = 6;  // a row's two chains and total beside the 8 code vectors: 32 registers

template <int ROWS>
ALWAYS_INLINE void zero(__m512 (*s)[2]) {
  for (int r = 0; r < ROWS; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
}

// the rows' FMAs for one column k of the panel, whose 16 codes (as floats) are q
template <int ROWS>
ALWAYS_INLINE void column(__m512 q, const float* const* x, int64_t k, int chain, __m512 (*s)[2]) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) s[r][chain] = _mm512_fmadd_ps(q, _mm512_set1_ps(x[r][k]), s[r][chain]);
}

// 16 columns from k0 whose codes are the 8 nibbles of 2 code vectors' lanes (gguf_panels.h:
// nibble 2e of vector u is value 4u + e, nibble 2e + 1 is value 16 + 4u + e), as floats of `table`
template <int ROWS>
ALWAYS_INLINE void nibble_columns(const uint8_t* codes, int u0, __m512 table, const float* const* x, int64_t k0,
                                  __m512 (*s)[2]) {
#pragma GCC unroll 2
  for (int u = u0; u < u0 + 2; ++u) {
    const __m512i z = _mm512_loadu_si512(codes + 64 * u);
#pragma GCC unroll 8
    for (int e = 0; e < 8; ++e)
      column<ROWS>(_mm512_permutexvar_ps(e == 0 ? z : _mm512_srli_epi32(z, 4 * e), table), x,
                   k0 + 4 * u + e / 2 + (e % 2) * 16, e % 2, s);
  }
}

// acc[r] += scale · (the row's two chains): one sub-block's sum scaled once
template <int ROWS>
ALWAYS_INLINE void add_scaled(__m512 scale, __m512 (*s)[2], __m512* acc) {
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(scale, _mm512_add_ps(s[r][0], s[r][1]), acc[r]);
}

template <int ROWS>
void q4k_rows(const uint8_t* panel, int64_t super_blocks, const float* const* x, const float* const* x_sums,
              __m512* acc) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q4K_PANEL) {
    const __m512 d = halves(panel + Q4K_D), dmin = halves(panel + Q4K_DMIN);
    for (int j = 0; j < 8; ++j) {
      prefetch_eighth<Q4K_PANEL>(panel, j);
      const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(q4k_scales(panel, j)));
      const __m512i mins = byte_pairs(panel + Q4K_MINS + 32 * (j / 2), false);
      const __m512i m = j % 2 ? _mm512_srli_epi32(mins, 16) : _mm512_and_si512(mins, _mm512_set1_epi32(0xFFFF));
      const __m512 min = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
      const int64_t k0 = 256 * sb + 32 * j;
      __m512 s[ROWS][2];
      zero<ROWS>(s);
      nibble_columns<ROWS>(panel + 256 * j, 0, table, x, k0, s);
      nibble_columns<ROWS>(panel + 256 * j, 2, table, x, k0, s);
      add_scaled<ROWS>(scale, s, acc);
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_fnmadd_ps(min, _mm512_set1_ps(x_sums[r][k0 / 32]), acc[r]);
    }
  }
}

template <int E>  // byte E of every lane: value 4t + E of each output, from code vector t (one instruction)
ALWAYS_INLINE __m512i byte_of(__m512i v) {
  if constexpr (E == 3) return _mm512_srli_epi32(v, 24);
  else if constexpr (E == 0) return _mm512_and_si512(v, _mm512_set1_epi32(0xFF));
  else return _mm512_shuffle_epi8(v, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(0x80808000u | E)),
                                                      _mm512_set4_epi32(12, 8, 4, 0)));  // in each 128-bit lane
}

template <int ROWS>
void q6k_rows(const uint8_t* panel, int64_t super_blocks, const float* const* x, __m512* acc) {
  const __m512i offset = _mm512_set1_epi32(32);
  const auto code = [&](__m512i c) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(c, offset)); };
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q6K_PANEL) {
    const __m512 d = halves(panel + Q6K_D);
    for (int g = 0; g < 8; ++g) {
      prefetch_eighth<Q6K_PANEL>(panel, g);
      __m512i w[8];
      q6k_codes(panel + Q6K_GROUP * g, w);
      const __m512i pair = byte_pairs(panel + Q6K_SCALES + 32 * g, true);
      __m512i pair_scale[2];
      pair_scales(pair, pair_scale);
      const __m512 scale0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(pair_scale[0]));
      const __m512 scale1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(pair_scale[1]));
      for (int half = 0; half < 2; ++half) {  // a sub-block of 16 values: code vectors 4 half .. 4 half + 3
        const int64_t k0 = 256 * sb + 32 * g + 16 * half;
        __m512 s[ROWS][2];
        zero<ROWS>(s);
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const __m512i v = w[4 * half + t];
          column<ROWS>(code(byte_of<0>(v)), x, k0 + 4 * t, 0, s);
          column<ROWS>(code(byte_of<1>(v)), x, k0 + 4 * t + 1, 1, s);
          column<ROWS>(code(byte_of<2>(v)), x, k0 + 4 * t + 2, 0, s);
          column<ROWS>(code(byte_of<3>(v)), x, k0 + 4 * t + 3, 1, s);
        }
        add_scaled<ROWS>(half ? scale1 : scale0, s, acc);
      }
    }
  }
}

at::Tensor linear_panels(const at::Tensor& x, const at::Tensor& panels, int64_t kind, int64_t k, int64_t n) {
  check_panels(x, panels, kind, k, n);
  const int64_t super_blocks = k / 256;
  const at::Tensor xs = x.contiguous();
  const int64_t m = xs.size(0);
  std::vector<const float*> rows(m), sums(m);
  std::vector<float> x_sums(kind == Q4_K ? m * (k / 32) : 0);  // a row's sum over each 32-value sub-block, for dmin·m
  for (int64_t r = 0; r < m; ++r) {
    rows[r] = xs.data_ptr<float>() + r * k;
    if (kind != Q4_K) continue;
    sums[r] = x_sums.data() + r * (k / 32);
    for (int64_t j = 0; j < k / 32; ++j) x_sums[r * (k / 32) + j] = std::accumulate(rows[r] + 32 * j, rows[r] + 32 * j + 32, 0.f);
  }
  at::Tensor out = at::empty({m, n}, x.options());
  float* y = out.data_ptr<float>();
  each_pass<ROWS_PER_PASS>(panels.size(0), m, [&](auto rows_here, int64_t p, int64_t r) {
    constexpr int ROWS = decltype(rows_here)::value;
    const uint8_t* panel = panels.data_ptr<uint8_t>() + p * panels.size(1);
    __m512 acc[ROWS];
    for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
    if (kind == Q4_K) q4k_rows<ROWS>(panel, super_blocks, rows.data() + r, sums.data() + r, acc);
    else q6k_rows<ROWS>(panel, super_blocks, rows.data() + r, acc);
    store_lanes<ROWS>(acc, y + r * n, n, p * LANES);
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
