// What both GGUF kernels read from a block: fp16 scales and Q4_K / Q5_K's packed 6-bit scales.
#pragma once

#include <c10/util/Half.h>

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

}  // namespace gguf
