// y = x @ W^T with W kept in its GGUF quantized blocks (llama.cpp's block layouts), x in fp32.
//
// Why a kernel of our own: no torch or oneDNN op reads these blocks, and dequantizing a layer per
// call writes 4 bytes a weight where the blocks hold ~0.6. Here each block is dequantized into
// registers / L1 (exactly the checkpoint's values: every product below is exact in fp32, so
// contraction into FMAs cannot change a weight) and multiplied into up to ROWS_PER_PASS rows at
// once, so a K + 1 row verification reads the weights once, as a one-row decode does.
//
// Every row is accumulated in the same order whatever the row count (16 lanes, then a fixed
// lane sum), so a row's output bits never depend on the rows beside it: SD's verification rows
// equal AR's one-row decode, bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "gguf_blocks.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// rows sharing one pass over the weights: their 2 accumulators each must fit the vector registers
#if defined(__AVX512F__)
constexpr int ROWS_PER_PASS = 8;
#else
constexpr int ROWS_PER_PASS = 4;
#endif
// the per-16-values callbacks must inline, or each row's accumulator lives in memory
#define ALWAYS_INLINE __attribute__((always_inline))

// 16 lanes in one value: GCC lowers it to one AVX-512 register or two AVX2 ones
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint8_t u16v __attribute__((vector_size(16)));

using gguf::half_at;
using gguf::scale_min_k4;

inline u16v bytes_at(const uint8_t* p) {
  u16v v;
  std::memcpy(&v, p, 16);
  return v;
}

inline f16v floats_at(const float* p) {
  f16v v;
  std::memcpy(&v, p, 64);
  return v;
}

// bytes to int32 lanes by the ISA's own widening loads: GCC's generic conversion of 16 bytes to
// 16 ints is scalarised (one movzbl a byte), which alone costs most of a row's time
template <bool SIGNED>
inline i16v widen_bytes(u16v v) {
#if defined(__AVX512F__)
  const __m512i wide = SIGNED ? _mm512_cvtepi8_epi32((__m128i)v) : _mm512_cvtepu8_epi32((__m128i)v);
  return (i16v)wide;
#elif defined(__AVX2__)
  const __m128i bytes = (__m128i)v, upper = _mm_srli_si128(bytes, 8);
  const __m256i low = SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  const __m256i high = SIGNED ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
  i16v out;
  std::memcpy(&out, &low, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &high, 32);
  return out;
#else
  i16v out;
  for (int l = 0; l < 16; ++l) out[l] = SIGNED ? static_cast<int8_t>(v[l]) : v[l];
  return out;
#endif
}

inline i16v widen(u16v v) { return widen_bytes<false>(v); }
inline f16v to_float(i16v v) { return __builtin_convertvector(v, f16v); }

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// GGML type ids (ggml.h). Each Block<KIND> hands a block's values to
// `use(offset_a, 16 values, offset_b, 16 values)`, thirty-two at a time, dequantized exactly as
// llama.cpp's dequantize_row_* does.
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

template <int K>
struct Block;

// the fifth bits of a Q5_0 / Q5_1 block's 32 values, as 0 or 16: lanes 0-15 and 16-31
inline void high_bits_q5(uint32_t qh, i16v& low, i16v& high) {
  for (int j = 0; j < 16; ++j) {
    low[j] = ((qh >> j) << 4) & 0x10;
    high[j] = (qh >> (j + 12)) & 0x10;
  }
}

template <> struct Block<Q4_0> {
  static constexpr int values = 32, bytes = 18;
  template <typename F> ALWAYS_INLINE static void each(const uint8_t* b, F&& use) {
    const float d = half_at(b);
    const i16v q = widen(bytes_at(b + 2));
    use(0, to_float((q & 0x0F) - 8) * d, 16, to_float((q >> 4) - 8) * d);
  }
};

template <> struct Block<Q4_1> {
  static constexpr int values = 32, bytes = 20;
  template <typename F> ALWAYS_INLINE static void each(const uint8_t* b, F&& use) {
    const float d = half_at(b), m = half_at(b + 2);
    const i16v q = widen(bytes_at(b + 4));
    use(0, to_float(q & 0x0F) * d + m, 16, to_float(q >> 4) * d + m);
  }
};

template <> struct Block<Q5_0> {
  static constexpr int values = 32, bytes = 22;
  template <typename F> ALWAYS_INLINE static void each(const uint8_t* b, F&& use) {
    const float d = half_at(b);
    i16v high0, high1;
    high_bits_q5(u32_at(b + 2), high0, high1);
    const i16v q = widen(bytes_at(b + 6));
    use(0, to_float(((q & 0x0F) | high0) - 16) * d, 16, to_float(((q >> 4) | high1) - 16) * d);
  }
};

template <> struct Block<Q5_1> {
  static constexpr int values = 32, bytes = 24;
  template <typename F> ALWAYS_INLINE static void each(const uint8_t* b, F&& use) {
    const float d = half_at(b), m = half_at(b + 2);
    i16v high0, high1;
    high_bits_q5(u32_at(b + 4), high0, high1);
    const i16v q = widen(bytes_at(b + 8));
    use(0, to_float((q & 0x0F) | high0) * d + m, 16, to_float((q >> 4) | high1) * d + m);
  }
};

template <> struct Block<Q8_0> {
  static constexpr int values = 32, bytes = 34;
  template <typename F> ALWAYS_INLINE static void each(const uint8_t* b, F&& use) {
    const float d = half_at(b);
    use(0, to_float(widen_bytes<true>(bytes_at(b + 2))) * d, 16, to_float(widen_bytes<true>(bytes_at(b + 18))) * d);
  }
};


// the scale and minimum, in floats, of the sub-block pair 2j, 2j + 1 of a Q4_K / Q5_K super-block:
// the two 32-value runs one 32-byte stretch of codes holds (low nibbles, then high)
inline void pair_scales(int j, float d, float dmin, const uint8_t* scales, float& d0, float& min0, float& d1,
                        float& min1) {
  int s0, m0, s1, m1;
  scale_min_k4(2 * j, scales, s0, m0);
  scale_min_k4(2 * j + 1, scales, s1, m1);
  d0 = d * s0, min0 = dmin * m0, d1 = d * s1, min1 = dmin * m1;
}

template <> struct Block<Q4_K> {
  static constexpr int values = 256, bytes = 144;
  template <typename F> ALWAYS_INLINE static void each(const uint8_t* b, F&& use) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0; j < 4; ++j, q += 32) {
      float d0, min0, d1, min1;
      pair_scales(j, d, dmin, scales, d0, min0, d1, min1);
      for (int l = 0; l < 32; l += 16) {
        const i16v v = widen(bytes_at(q + l));
        use(64 * j + l, d0 * to_float(v & 0xF) - min0, 64 * j + 32 + l, d1 * to_float(v >> 4) - min1);
      }
    }
  }
};

template <> struct Block<Q5_K> {
  static constexpr int values = 256, bytes = 176;
  template <typename F> ALWAYS_INLINE static void each(const uint8_t* b, F&& use) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* ql = b + 48;
    for (int j = 0; j < 4; ++j, ql += 32) {
      float d0, min0, d1, min1;
      pair_scales(j, d, dmin, scales, d0, min0, d1, min1);
      for (int l = 0; l < 32; l += 16) {
        const i16v low = widen(bytes_at(ql + l)), high = widen(bytes_at(qh + l));
        // bit 2j of qh is value j*64 + l's fifth bit, bit 2j+1 the one 32 values on
        use(64 * j + l, d0 * to_float((low & 0xF) + (((high >> (2 * j)) & 1) << 4)) - min0,
            64 * j + 32 + l, d1 * to_float((low >> 4) + (((high >> (2 * j + 1)) & 1) << 4)) - min1);
      }
    }
  }
};

template <> struct Block<Q6_K> {
  static constexpr int values = 256, bytes = 210;
  template <typename F> ALWAYS_INLINE static void each(const uint8_t* b, F&& use) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; l += 16) {
        const int is = l / 16;
        const i16v low0 = widen(bytes_at(ql + l)), low1 = widen(bytes_at(ql + l + 32)), high = widen(bytes_at(qh + l));
        const int base = 128 * half + l;
        use(base, (d * sc[is]) * to_float(((low0 & 0xF) | (((high >> 0) & 3) << 4)) - 32),
            base + 32, (d * sc[is + 2]) * to_float(((low1 & 0xF) | (((high >> 2) & 3) << 4)) - 32));
        use(base + 64, (d * sc[is + 4]) * to_float(((low0 >> 4) | (((high >> 4) & 3) << 4)) - 32),
            base + 96, (d * sc[is + 6]) * to_float(((low1 >> 4) | (((high >> 6) & 3) << 4)) - 32));
      }
    }
  }
};

// ROWS rows of x (row stride k) times output rows [n0, n1) of W; out row stride n. Each row sums
// into two accumulators (the two vectors of each `use`), so its consecutive FMAs need not wait on
// each other; their indices are fixed at compile time, so every accumulator stays in a register.
template <int KIND, int ROWS>
void rows_pass(const float* x, int64_t k, const uint8_t* blocks, int64_t row_bytes, int64_t n0, int64_t n1,
               float* out, int64_t n) {
  using B = Block<KIND>;
  for (int64_t o = n0; o < n1; ++o) {
    f16v acc_a[ROWS], acc_b[ROWS];
    for (int r = 0; r < ROWS; ++r) acc_a[r] = acc_b[r] = f16v{};
    const uint8_t* row = blocks + o * row_bytes;
    for (int64_t c = 0; c < k; c += B::values, row += B::bytes) {
      B::each(row, [&](int offset_a, f16v wa, int offset_b, f16v wb) ALWAYS_INLINE {
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
          acc_a[r] += floats_at(x + r * k + c + offset_a) * wa;
          acc_b[r] += floats_at(x + r * k + c + offset_b) * wb;
        }
      });
    }
    for (int r = 0; r < ROWS; ++r) {
      const f16v lanes = acc_a[r] + acc_b[r];  // then a fixed pairwise order: the same bits at any row count
      float sum[16];
      std::memcpy(sum, &lanes, 64);
      for (int width = 8; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) sum[l] += sum[l + width];
      out[r * n + o] = sum[0];
    }
  }
}

template <int KIND>
void linear_kind(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t row_bytes, int64_t n,
                 float* out) {
  // output rows split over threads; each thread runs every pass of rows, so it reads its
  // share of the weights once per ROWS_PER_PASS rows
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < m; r += ROWS_PER_PASS) {
      const float* xr = x + r * k;
      float* outr = out + r * n;
      switch (std::min<int64_t>(ROWS_PER_PASS, m - r)) {
        case 1: rows_pass<KIND, 1>(xr, k, blocks, row_bytes, n0, n1, outr, n); break;
        case 2: rows_pass<KIND, 2>(xr, k, blocks, row_bytes, n0, n1, outr, n); break;
        case 3: rows_pass<KIND, 3>(xr, k, blocks, row_bytes, n0, n1, outr, n); break;
        case 4: rows_pass<KIND, 4>(xr, k, blocks, row_bytes, n0, n1, outr, n); break;
#if defined(__AVX512F__)
        case 5: rows_pass<KIND, 5>(xr, k, blocks, row_bytes, n0, n1, outr, n); break;
        case 6: rows_pass<KIND, 6>(xr, k, blocks, row_bytes, n0, n1, outr, n); break;
        case 7: rows_pass<KIND, 7>(xr, k, blocks, row_bytes, n0, n1, outr, n); break;
#endif
        default: rows_pass<KIND, ROWS_PER_PASS>(xr, k, blocks, row_bytes, n0, n1, outr, n); break;
      }
    }
  });
}

template <int KIND>
void dequantize_kind(const uint8_t* blocks, int64_t row_bytes, int64_t n, int64_t k, float* out) {
  using B = Block<KIND>;
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t o = n0; o < n1; ++o)
      for (int64_t c = 0; c < k; c += B::values)
        B::each(blocks + o * row_bytes + c / B::values * B::bytes, [&](int offset_a, f16v wa, int offset_b, f16v wb) {
          std::memcpy(out + o * k + c + offset_a, &wa, 64);
          std::memcpy(out + o * k + c + offset_b, &wb, 64);
        });
  });
}

template <typename F>
void dispatch(int64_t kind, F&& f) {
  switch (kind) {
    case Q4_0: f(std::integral_constant<int, Q4_0>{}); break;
    case Q4_1: f(std::integral_constant<int, Q4_1>{}); break;
    case Q5_0: f(std::integral_constant<int, Q5_0>{}); break;
    case Q5_1: f(std::integral_constant<int, Q5_1>{}); break;
    case Q8_0: f(std::integral_constant<int, Q8_0>{}); break;
    case Q4_K: f(std::integral_constant<int, Q4_K>{}); break;
    case Q5_K: f(std::integral_constant<int, Q5_K>{}); break;
    case Q6_K: f(std::integral_constant<int, Q6_K>{}); break;
    default: TORCH_CHECK(false, "GGUF block type ", kind, " has no kernel");
  }
}

void check_blocks(const at::Tensor& blocks, int64_t kind, int64_t k) {
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous 2-D uint8 tensor");
  dispatch(kind, [&](auto c) {
    using B = Block<decltype(c)::value>;
    TORCH_CHECK(k % B::values == 0 && blocks.size(1) == k / B::values * B::bytes,
                "blocks of ", blocks.size(1), " bytes a row do not hold ", k, " values of type ", kind);
  });
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind, int64_t k) {
  check_blocks(blocks, kind, k);
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == k, "x must be fp32 [rows, ", k, "]");
  const at::Tensor rows = x.contiguous();
  const int64_t n = blocks.size(0);
  at::Tensor out = at::empty({rows.size(0), n}, x.options());
  dispatch(kind, [&](auto c) {
    linear_kind<decltype(c)::value>(rows.data_ptr<float>(), rows.size(0), k, blocks.data_ptr<uint8_t>(),
                                    blocks.size(1), n, out.data_ptr<float>());
  });
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t kind, int64_t k) {
  check_blocks(blocks, kind, k);
  at::Tensor out = at::empty({blocks.size(0), k}, blocks.options().dtype(at::kFloat));
  dispatch(kind, [&](auto c) {
    dequantize_kind<decltype(c)::value>(blocks.data_ptr<uint8_t>(), blocks.size(1), blocks.size(0), k,
                                        out.data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(ssd_engine_gguf, m) {
  m.def("linear(Tensor x, Tensor blocks, int kind, int k) -> Tensor");
  m.def("dequantize(Tensor blocks, int kind, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CPU, m) {
  m.impl("linear", &gguf_linear);
  m.impl("dequantize", &gguf_dequantize);
}
