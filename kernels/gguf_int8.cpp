// y = x @ W^T with W in GGUF blocks and x quantized to int8 first (target_dtype="gguf-int8"):
// llama.cpp's arithmetic. Each row of x becomes int8 codes with one fp32 scale per block of
// ACT_BLOCK(kind) values (256 for the K-quants, 32 for the others) and the dot products run in
// integers (AVX2 maddubs / madd: 32 byte products per instruction where fp32 FMAs do 8 or 16),
// so a verification's extra rows cost a fraction of the weights' one pass.
//
// This changes the model (activations rounded to ~8 bits), like the re-quantized target formats;
// what holds is exactness against itself: every row is quantized and summed alone, in the same
// order at any row count, so SD's verification rows equal AR's lone decode row bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX2__)
#if defined(__AVX512F__) && defined(__AVX512VL__)
constexpr int ROWS_PER_PASS = 8;  // 32 vector registers: two a row, plus the weights
#else
constexpr int ROWS_PER_PASS = 4;
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

using gguf::half_at;
using gguf::QuantizedRow;
using gguf::quantize_row;
using gguf::scale_min_k4;

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline float hsum(__m256 v) {  // a fixed order: the same bits whatever the row count
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

template <int KIND> struct Int8Block;

// Each `dot(block, rows, c, acc)` adds the block's products with the rows' codes at column c into
// each row's fp32 lanes; the weights are unpacked once for all rows.
template <> struct Int8Block<Q4_K> {
  static constexpr int values = 256, bytes = 144, act_block = 256;
  template <int ROWS>
  ALWAYS_INLINE static void dot(const uint8_t* b, const QuantizedRow* rows, int64_t c, __m256* acc) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qs = b + 16;
    int sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(j, scales, sc[j], mn[j]);
    const __m256i low_mask = _mm256_set1_epi8(0x0F);
    __m256i isum[ROWS];
    for (int r = 0; r < ROWS; ++r) isum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i q = load32(qs + 32 * j);
      const __m256i lo = _mm256_and_si256(q, low_mask), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low_mask);
      const __m256i s0 = _mm256_set1_epi16(sc[2 * j]), s1 = _mm256_set1_epi16(sc[2 * j + 1]);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* a = rows[r].q + c + 64 * j;
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(a)), s0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(a + 32)), s1);
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p0, p1));
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const int32_t* sum16 = rows[r].sum16 + c / 16;
      int32_t mins = 0;
      for (int j = 0; j < 8; ++j) mins += mn[j] * (sum16[2 * j] + sum16[2 * j + 1]);
      const float da = rows[r].d[c / act_block];
      // d * Σ sc q a - dmin * Σ m a, in the row's scale; the min term lands in lane 0
      const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * da));
      acc[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(scaled, _mm256_setr_ps(dmin * da * mins, 0, 0, 0, 0, 0, 0, 0)));
    }
  }
};

template <> struct Int8Block<Q6_K> {
  static constexpr int values = 256, bytes = 210, act_block = 256;
  template <int ROWS>
  ALWAYS_INLINE static void dot(const uint8_t* b, const QuantizedRow* rows, int64_t c, __m256* acc) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    const __m256i low_mask = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(3);
    __m256i isum[ROWS];
    for (int r = 0; r < ROWS; ++r) isum[r] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8) {
      const __m256i l0 = load32(ql), l1 = load32(ql + 32), h = load32(qh);
      // the four 32-value groups of this half, one at a time (an array of all four spills once
      // several rows share the pass): 6-bit codes 0..63, the -32 applied through the sums
      auto group = [&](auto g) __attribute__((always_inline)) {
        constexpr int G = decltype(g)::value;
        const __m256i low = G % 2 ? l1 : l0;
        const __m256i nibble = G < 2 ? _mm256_and_si256(low, low_mask)
                                     : _mm256_and_si256(_mm256_srli_epi16(low, 4), low_mask);
        const __m256i q = _mm256_or_si256(nibble, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * G), two_bits), 4));
        // 16 values a scale: the first 8 lanes of maddubs' pairs take sc[2G], the last 8 sc[2G+1]
        const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[2 * G + 1]), _mm_set1_epi16(sc[2 * G]));
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* a = rows[r].q + c + 128 * half + 32 * G;
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, load32(a)), s));
        }
      };
      group(std::integral_constant<int, 0>{});
      group(std::integral_constant<int, 1>{});
      group(std::integral_constant<int, 2>{});
      group(std::integral_constant<int, 3>{});
    }
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int r = 0; r < ROWS; ++r) {
      const int32_t* sum16 = rows[r].sum16 + c / 16;
      int32_t offset = 0;
      for (int h16 = 0; h16 < 16; ++h16) offset += scales[h16] * sum16[h16];
      const float da = rows[r].d[c / act_block];
      const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * da));
      acc[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(scaled, _mm256_setr_ps(32.f * d * da * offset, 0, 0, 0, 0, 0, 0, 0)));
    }
  }
};

// the 32-value types: Σ w a over a block, w = d * (q - offset) or d * q + m
template <int KIND> struct Small;
template <> struct Small<Q4_0> { static constexpr int bytes = 18; };
template <> struct Small<Q4_1> { static constexpr int bytes = 20; };
template <> struct Small<Q8_0> { static constexpr int bytes = 34; };

template <int KIND> struct Int8SmallBlock {
  static constexpr int values = 32, bytes = Small<KIND>::bytes, act_block = 32;
  template <int ROWS>
  ALWAYS_INLINE static void dot(const uint8_t* b, const QuantizedRow* rows, int64_t c, __m256* acc) {
    const float d = half_at(b);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i w;
    if constexpr (KIND == Q8_0) {
      w = load32(b + 2);
    } else {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (KIND == Q4_1 ? 4 : 2)));
      const __m128i mask = _mm_set1_epi8(0x0F);
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask), _mm_and_si128(packed, mask));
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256i a = load32(rows[r].q + c);
      __m256i products;
      if constexpr (KIND == Q8_0) {  // maddubs takes one unsigned operand: |w|, and w's sign moved onto a
        products = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
      } else {
        products = _mm256_maddubs_epi16(w, a);
      }
      const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, ones));
      const float da = rows[r].d[c / 32];
      const int32_t codes = rows[r].sum16[c / 16] + rows[r].sum16[c / 16 + 1];
      float shift = 0.f;  // the offset or minimum times Σ a, in lane 0
      if constexpr (KIND == Q4_0) shift = -8.f * d * da * codes;
      if constexpr (KIND == Q4_1) shift = half_at(b + 2) * da * codes;
      acc[r] = _mm256_add_ps(acc[r], _mm256_add_ps(_mm256_mul_ps(isum, _mm256_set1_ps(d * da)),
                                                   _mm256_setr_ps(shift, 0, 0, 0, 0, 0, 0, 0)));
    }
  }
};

// Output rows [o0, o1) over columns [c0, c1) for ROWS rows, each output's lanes carried in acc
// (ROWS a output). Columns come in chunks so the rows' codes stay in L1 across the outputs (a
// 8960-column row is 9 KB: five of them overflow it); a row still sums its blocks in column order.
template <typename B, int ROWS>
void rows_pass(const QuantizedRow* rows, const uint8_t* blocks, int64_t row_bytes, int64_t o0, int64_t o1,
               int64_t c0, int64_t c1, __m256* acc) {
  for (int64_t o = o0; o < o1; ++o, acc += ROWS) {
    __m256 lanes[ROWS];
    for (int r = 0; r < ROWS; ++r) lanes[r] = acc[r];
    const uint8_t* row = blocks + o * row_bytes + c0 / B::values * B::bytes;
    for (int64_t c = c0; c < c1; c += B::values, row += B::bytes) B::template dot<ROWS>(row, rows, c, lanes);
    for (int r = 0; r < ROWS; ++r) acc[r] = lanes[r];
  }
}

constexpr int64_t OUTPUT_TILE = 16;    // outputs whose weights (at most ~120 KB) stay in L2 across passes of rows
constexpr int64_t COLUMN_CHUNK = 2048;  // codes of up to 8 rows: 16 KB
constexpr int64_t L1_CODES = 24 * 1024;  // rows' codes that stay in a 32 KB L1 beside the weights

template <typename B, int ROWS>
void tile(const QuantizedRow* rows, int64_t k, const uint8_t* blocks, int64_t row_bytes, int64_t o0, int64_t o1,
          float* out, int64_t n) {
  __m256 acc[OUTPUT_TILE * ROWS];
  for (auto& lanes : acc) lanes = _mm256_setzero_ps();
  // a lone row streams each weight row whole (what the prefetchers follow best); several rows take
  // chunks only when their codes would overflow L1. Either way a row sums in column order.
  const int64_t chunk = ROWS * k <= L1_CODES ? k : std::max<int64_t>(B::values, COLUMN_CHUNK / B::values * B::values);
  for (int64_t c0 = 0; c0 < k; c0 += chunk) rows_pass<B, ROWS>(rows, blocks, row_bytes, o0, o1, c0, std::min(k, c0 + chunk), acc);
  for (int64_t o = o0; o < o1; ++o)
    for (int r = 0; r < ROWS; ++r) out[r * n + o] = hsum(acc[(o - o0) * ROWS + r]);
}

template <typename B>
void linear_blocks(const float* x, int64_t m, int64_t k, const uint8_t* blocks, int64_t row_bytes, int64_t n,
                   float* out) {
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * (k / B::act_block));
  std::vector<int32_t> sum16(m * (k / 16));
  std::vector<QuantizedRow> rows(m);
  at::parallel_for(0, m, gguf::QUANTIZE_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      quantize_row(x + r * k, k, B::act_block, q.data() + r * k, d.data() + r * (k / B::act_block),
                   sum16.data() + r * (k / 16));
      rows[r] = {q.data() + r * k, d.data() + r * (k / B::act_block), sum16.data() + r * (k / 16)};
    }
  });
  at::parallel_for(0, n, OUTPUT_TILE, [&](int64_t n0, int64_t n1) {
    for (int64_t o0 = n0; o0 < n1; o0 += OUTPUT_TILE) {
      const int64_t o1 = std::min(n1, o0 + OUTPUT_TILE);
      for (int64_t r = 0; r < m; r += ROWS_PER_PASS) {
        const QuantizedRow* pass = rows.data() + r;
        float* outr = out + r * n;
        switch (std::min<int64_t>(ROWS_PER_PASS, m - r)) {
          case 1: tile<B, 1>(pass, k, blocks, row_bytes, o0, o1, outr, n); break;
          case 2: tile<B, 2>(pass, k, blocks, row_bytes, o0, o1, outr, n); break;
          case 3: tile<B, 3>(pass, k, blocks, row_bytes, o0, o1, outr, n); break;
#if defined(__AVX512F__) && defined(__AVX512VL__)
          case 4: tile<B, 4>(pass, k, blocks, row_bytes, o0, o1, outr, n); break;
          case 5: tile<B, 5>(pass, k, blocks, row_bytes, o0, o1, outr, n); break;
          case 6: tile<B, 6>(pass, k, blocks, row_bytes, o0, o1, outr, n); break;
          case 7: tile<B, 7>(pass, k, blocks, row_bytes, o0, o1, outr, n); break;
#endif
          default: tile<B, ROWS_PER_PASS>(pass, k, blocks, row_bytes, o0, o1, outr, n); break;
        }
      }
    }
  });
}

at::Tensor gguf_linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t kind, int64_t k) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == k, "x must be fp32 [rows, ", k, "]");
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous 2-D uint8 tensor");
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({rows.size(0), blocks.size(0)}, x.options());
  auto run = [&](auto block) {
    using B = decltype(block);
    TORCH_CHECK(k % B::values == 0 && blocks.size(1) == k / B::values * B::bytes,
                "blocks of ", blocks.size(1), " bytes a row do not hold ", k, " values of type ", kind);
    linear_blocks<B>(rows.data_ptr<float>(), rows.size(0), k, blocks.data_ptr<uint8_t>(), blocks.size(1),
                     blocks.size(0), out.data_ptr<float>());
  };
  switch (kind) {
    case Q4_0: run(Int8SmallBlock<Q4_0>{}); break;
    case Q4_1: run(Int8SmallBlock<Q4_1>{}); break;
    case Q8_0: run(Int8SmallBlock<Q8_0>{}); break;
    case Q4_K: run(Int8Block<Q4_K>{}); break;
    case Q6_K: run(Int8Block<Q6_K>{}); break;
    default: TORCH_CHECK(false, "GGUF block type ", kind, " has no int8 kernel");
  }
  return out;
}
#else
at::Tensor gguf_linear_int8(const at::Tensor&, const at::Tensor&, int64_t, int64_t) {
  TORCH_CHECK(false, "the int8 GGUF kernels need AVX2, which this CPU lacks");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(ssd_engine_gguf, m) { m.def("linear_int8(Tensor x, Tensor blocks, int kind, int k) -> Tensor"); }

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CPU, m) { m.impl("linear_int8", &gguf_linear_int8); }
