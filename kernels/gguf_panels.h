// GGUF Q4_K / Q6_K blocks repacked into panels of 16 outputs (gguf_pack.cpp), read by the fp32
// kernel (gguf_panels_fp32.cpp, target_dtype "gguf") and the int8 one (gguf_vnni.cpp, "gguf-int8").
//
// Why panels: a GGUF block holds one output's 256 values in a row, so a kernel reading it sums
// each activation row across vector lanes and pays a horizontal sum per output. A panel lays 16
// outputs side by side, 4 consecutive values each per 32-bit lane: a vector instruction takes
// one (broadcast) value or 4 values of a row against 16 outputs, the lanes are the outputs, and
// unpacking the codes is shared by every row of a pass. The values and scales are the blocks',
// unchanged.
//
// Panel layout, per 256-value super-block, for outputs c = 0..15 of the panel:
//   Q4_K (2368 bytes): codes[8 sub-blocks j][4 vectors u][16 c][4 bytes e]: value 32j + 4u + e in
//     the low nibble, value 32j + 16 + 4u + e in the high one; scales[8][16] u8;
//     mins[4 pairs i][16 c][2] u8 (sub-blocks 2i, 2i + 1); d[16], dmin[16] fp16.
//   Q6_K (3360 bytes): per 32 values g: low nibbles as Q4_K's (4 vectors), then 2 vectors of the
//     codes' high 2 bits (vector h, bits 2t..2t+1: the value group 4h + t); scales[8 pairs][16 c][2]
//     i8 (sub-blocks of 16 values); d[16] fp16.
// Outputs past n (a partial last panel) are zero blocks, never stored.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace gguf_panels {

enum Kind : int64_t { Q4_K = 12, Q6_K = 14 };
constexpr int LANES = 16;
constexpr int64_t Q4K_PANEL = 2048 + 128 + 128 + 64, Q6K_PANEL = 3072 + 256 + 32;  // bytes a super-block
// where a super-block's parts lie in its panel
constexpr int64_t Q4K_SCALES = 2048, Q4K_MINS = 2176, Q4K_D = 2304, Q4K_DMIN = 2336;
constexpr int64_t Q6K_GROUP = 384, Q6K_HIGH = 256, Q6K_SCALES = 3072, Q6K_D = 3328;

inline int64_t panel_bytes(int64_t kind) { return kind == Q4_K ? Q4K_PANEL : Q6K_PANEL; }

// a panel kernel's arguments: fp32 rows x [m, k] and the panels of an [n, k] weight of `kind`
inline void check_panels(const at::Tensor& x, const at::Tensor& panels, int64_t kind, int64_t k, int64_t n) {
  TORCH_CHECK(kind == Q4_K || kind == Q6_K, "GGUF block type ", kind, " has no panel layout");
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == k, "x must be fp32 [rows, ", k, "]");
  TORCH_CHECK(panels.dtype() == at::kByte && panels.is_contiguous() && panels.dim() == 2 && k % 256 == 0 &&
              panels.size(0) == (n + LANES - 1) / LANES && panels.size(1) == k / 256 * panel_bytes(kind),
              "panels do not hold [", n, ", ", k, "]");
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ALWAYS_INLINE inline __attribute__((always_inline))

// the 8 vectors of 32 values' codes: vector t holds values 4t..4t+3 of each output, a byte each
ALWAYS_INLINE void nibbles(const uint8_t* p, __m512i* w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int u = 0; u < 4; ++u) {
    const __m512i z = _mm512_loadu_si512(p + 64 * u);
    w[u] = _mm512_and_si512(z, low);
    w[u + 4] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
  }
}

// Q6_K: the nibbles of a 32-value group and their high 2 bits, codes 0..63
ALWAYS_INLINE void q6k_codes(const uint8_t* group, __m512i* w) {
  const __m512i two_bits = _mm512_set1_epi8(0x30);
  nibbles(group, w);
  for (int half = 0; half < 2; ++half) {  // group 4 * half + t's 2 bits (bits 2t..2t+1) moved to bits 4..5
    const __m512i h = _mm512_loadu_si512(group + Q6K_HIGH + 64 * half);
    w[4 * half + 0] = _mm512_or_si512(w[4 * half + 0], _mm512_and_si512(_mm512_slli_epi16(h, 4), two_bits));
    w[4 * half + 1] = _mm512_or_si512(w[4 * half + 1], _mm512_and_si512(_mm512_slli_epi16(h, 2), two_bits));
    w[4 * half + 2] = _mm512_or_si512(w[4 * half + 2], _mm512_and_si512(h, two_bits));
    w[4 * half + 3] = _mm512_or_si512(w[4 * half + 3], _mm512_and_si512(_mm512_srli_epi16(h, 2), two_bits));
  }
}

ALWAYS_INLINE __m512 halves(const uint8_t* p) {  // 16 fp16 values
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Asks for the bytes PREFETCH_AHEAD past an eighth of a super-block's panel (the eighth a kernel is
// about to read). With the weights streaming from memory, a pass of two or more rows otherwise
// outruns the hardware prefetcher and waits on each load (2 rows cost about twice one row from
// memory, where from cache they cost a third more); asking ahead brings both close to the cached cost.
constexpr int64_t PREFETCH_AHEAD = 4096;
template <int64_t PANEL_BYTES>
ALWAYS_INLINE void prefetch_eighth(const uint8_t* panel, int eighth) {
  const char* p = reinterpret_cast<const char*>(panel + PREFETCH_AHEAD + eighth * (PANEL_BYTES / 8));
  for (int64_t line = 0; line < (PANEL_BYTES / 8 + 63) / 64; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T0);
}

// 16 byte pairs [output][2] as int32 lanes, the pair's first in the low 16 bits
ALWAYS_INLINE __m512i byte_pairs(const uint8_t* p, bool is_signed) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return is_signed ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes);
}

// Q4_K: the 16 outputs' 6-bit scales of sub-block j, one int32 lane each
ALWAYS_INLINE __m512i q4k_scales(const uint8_t* super_block, int j) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super_block + Q4K_SCALES + 16 * j)));
}

// Q6_K: a signed byte_pairs vector of scales as int32 lanes, the pair's first (sub-block 2g) in
// scales[0], its second (2g + 1) in scales[1]
ALWAYS_INLINE void pair_scales(__m512i pair, __m512i* scales) {
  scales[0] = _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
  scales[1] = _mm512_srai_epi32(pair, 16);
}

// Calls pass(std::integral_constant<int, ROWS>, panel, first row) for every panel (panels split
// over the threads) and every pass of up to MAX_ROWS rows; a panel's later passes find it in L2.
// Each row is computed alone in its lanes, so its bits never depend on the pass it falls in.
template <int MAX_ROWS, typename Pass>
void each_pass(int64_t panels, int64_t rows, const Pass& pass) {
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < rows; r += MAX_ROWS) {
        switch (std::min<int64_t>(MAX_ROWS, rows - r)) {
          case 1: pass(std::integral_constant<int, 1>{}, p, r); break;
          case 2: pass(std::integral_constant<int, 2>{}, p, r); break;
          case 3: pass(std::integral_constant<int, 3>{}, p, r); break;
          case 4: pass(std::integral_constant<int, 4>{}, p, r); break;
          case 5: pass(std::integral_constant<int, 5>{}, p, r); break;
          default: pass(std::integral_constant<int, MAX_ROWS>{}, p, r); break;
        }
      }
  });
}

// a pass's 16 outputs of each row, the lanes past n left unwritten
template <int ROWS>
ALWAYS_INLINE void store_lanes(const __m512* acc, float* out, int64_t n, int64_t first_output) {
  const __mmask16 live = n - first_output >= LANES ? 0xFFFF : (1u << (n - first_output)) - 1;
  for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(out + r * n + first_output, live, acc[r]);
}
#endif

}  // namespace gguf_panels
