// What gguf-int8's panel kernels share (gguf_vnni.cpp: VNNI passes; gguf_amx.cpp: AMX tiles): an
// activation row rounded to int8, and how a super-block's exact integer sums become fp32 outputs.
// Both kernels reach the same integer sums, and this one fp32 order makes them the same bits.
#pragma once

#include "gguf_panels.h"

#include <cstdint>

namespace gguf_int8 {

using namespace gguf_panels;

// a row's int8 codes, its scale per 256 values, and its code sums in int16 pairs: per 32 values
// (sub-blocks of 16, Q6_K) and per 64 (sub-blocks of 32, Q4_K), the pair's first sum in the low half
struct ActRow {
  const int8_t* q;
  const float* d;
  const int32_t* pairs16;
  const int32_t* pairs32;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// a super-block's share of each row's outputs, from its integer sums Σ_j sc_j (codes . row) of each output
template <int ROWS>
ALWAYS_INLINE void q4k_finish(const uint8_t* panel, int64_t sb, const ActRow* rows, const __m512i* sums, __m512* out) {
  const __m512 d = halves(panel + Q4K_D);
  const __m512 dmin = halves(panel + Q4K_DMIN);
  for (int r = 0; r < ROWS; ++r) {
    __m512i mins = _mm512_setzero_si512();  // Σ_j m_j Σ codes of sub-block j, by pairs of sub-blocks
    for (int i = 0; i < 4; ++i) {
      const __m512i m = byte_pairs(panel + Q4K_MINS + 32 * i, false);
      mins = _mm512_dpwssd_epi32(mins, m, _mm512_set1_epi32(rows[r].pairs32[4 * sb + i]));
    }
    const __m512 da = _mm512_set1_ps(rows[r].d[sb]);
    out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, da), out[r]);
    out[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, da), out[r]);
  }
}

template <int ROWS>
ALWAYS_INLINE void q6k_finish(const uint8_t* panel, int64_t sb, const ActRow* rows, const __m512i* sums,
                              const __m512i* offsets, __m512* out) {
  const __m512 d = halves(panel + Q6K_D);
  for (int r = 0; r < ROWS; ++r) {
    const __m512i total = _mm512_sub_epi32(sums[r], _mm512_slli_epi32(offsets[r], 5));
    out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(rows[r].d[sb])), out[r]);
  }
}
#endif

// AMX tiles (gguf_amx.cpp): how many leading rows of m tiles take (0 where the CPU or the build has
// no AMX, or m is too few to pay), and those rows' outputs of every panel into y [m, n]
int64_t tiled_rows(int64_t m, int64_t kind);
void tile_passes(const at::Tensor& panels, int64_t kind, int64_t k, int64_t n, const ActRow* rows, int64_t tiled,
                 float* y);

}  // namespace gguf_int8
