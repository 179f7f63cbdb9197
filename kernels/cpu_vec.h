// The dot product the CPU kernels share (cpu_attention.cpp, cpu_layer_ops.cpp): 16 lanes folded in
// one fixed order, so a row's bits depend on its own values only.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace cpu_vec {

constexpr int LANES = 16;

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// sum_d q[d] k[d] in LANES partial sums folded in one fixed order (the vector unit's, or the same
// lanes written out where there is none)
template <typename T>
inline float dot(const float* q, const T* k, int64_t dim) {
  int64_t d = 0;
  float tail = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + LANES <= dim; d += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  for (; d < dim; ++d) tail += q[d] * as_float(k[d]);
  return _mm512_reduce_add_ps(acc) + tail;
#else
  float lane[LANES] = {};
  for (; d + LANES <= dim; d += LANES)
    for (int l = 0; l < LANES; ++l) lane[l] += q[d + l] * as_float(k[d + l]);
  for (; d < dim; ++d) tail += q[d] * as_float(k[d]);
  for (int width = LANES / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0] + tail;
#endif
}

}  // namespace cpu_vec
