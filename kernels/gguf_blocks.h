// What the GGUF kernels share: a block's fp16 scales and Q4_K / Q5_K's packed 6-bit scales, and the
// int8 rounding of an activation row (gguf-int8's model: gguf_int8.cpp and gguf_vnni.cpp both read it).
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace gguf {

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// the 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K super-block
inline void scale_min_k4(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// one row of x as int8 codes: scale d per `block` values, and the codes' sums per 16 values
struct QuantizedRow {
  const int8_t* q;
  const float* d;
  const int32_t* sum16;
};

constexpr int64_t QUANTIZE_GRAIN = 8;  // rows a thread rounds at least (each row alone: any split gives the same codes)

inline void quantize_row(const float* x, int64_t k, int block, int8_t* q, float* d, int32_t* sum16) {
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    int8_t* qb = q + b * block;
#if defined(__AVX512F__)
    // the scalar loop's values: max is exact in any order, and a product rounded to nearest (even)
    // is what nearbyint gives in the default rounding mode; a NaN is skipped as std::max skips it
    __m512 amax16 = _mm512_setzero_ps();
    for (int i = 0; i < block; i += 16) amax16 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + i)), amax16);
    const float amax = _mm512_reduce_max_ps(amax16);
#else
    float amax = 0.f;
    for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = scale;
#if defined(__AVX512F__)
    const __m512 by = _mm512_set1_ps(inverse);
    for (int i = 0; i < block; i += 16) {
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), by));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i), _mm512_cvtsepi32_epi8(codes));
      sum16[(b * block + i) / 16] = _mm512_reduce_add_epi32(codes);
    }
  }
#else
    for (int i = 0; i < block; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inverse));
  }
  for (int64_t g = 0; g < k / 16; ++g) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += q[g * 16 + i];
    sum16[g] = s;
  }
#endif
}

}  // namespace gguf
