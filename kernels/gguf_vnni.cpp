// gguf-int8's Q4_K and Q6_K products on CPUs with AVX-512 VNNI, from weights repacked at load so a
// verification's extra rows cost little (the model is gguf_int8.cpp's: the same int8 activations and
// integer sums per sub-block; only the fp32 sums of the super-blocks run in another order).
//
// Why a second layout: gguf_int8.cpp reads a block as GGUF stores it (one output's 256 values in
// a row), so every activation row pays a load, two multiply-adds and a horizontal sum per 32
// weights. Here a panel holds 16 outputs side by side, 4 consecutive values each per 32-bit lane:
// one vpdpbusd multiplies all 16 outputs by 4 values of a row broadcast from memory, and the lanes
// are the outputs, so nothing is summed across lanes. Per row that is ~1.4 instructions per 64
// weights against ~8, while unpacking the 4-bit codes (shared by the rows) stays as it was: up to
// ~5 rows cost about what the memory traffic of one costs.
//
// Panel layout, per 256-value super-block, for outputs c = 0..15 of the panel:
//   Q4_K (2368 bytes): codes[8 sub-blocks j][4 vectors u][16 c][4 bytes e]: value 32j + 4u + e in
//     the low nibble, value 32j + 16 + 4u + e in the high one; scales[8][16] u8;
//     mins[4 pairs i][16 c][2] u8 (sub-blocks 2i, 2i + 1); d[16], dmin[16] fp16.
//   Q6_K (3360 bytes): per 32 values g: low nibbles as Q4_K's (4 vectors), then 2 vectors of the
//     codes' high 2 bits (vector h, bits 2t..2t+1: the value group 4h + t); scales[8 pairs][16 c][2]
//     i8 (sub-blocks of 16 values); d[16] fp16.
// Outputs past n (a partial last panel) are zero blocks, never stored.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Kind : int64_t { Q4_K = 12, Q6_K = 14 };
constexpr int LANES = 16;
constexpr int64_t Q4K_PANEL = 2048 + 128 + 128 + 64, Q6K_PANEL = 3072 + 256 + 32;  // bytes a super-block
constexpr int64_t Q4K_BLOCK = 144, Q6K_BLOCK = 210;

int64_t panel_bytes(int64_t kind) { return kind == Q4_K ? Q4K_PANEL : Q6K_PANEL; }

// a GGUF super-block's 256 codes (0..15 or 0..63) and sub-block scales, in value order
void q4k_codes(const uint8_t* b, uint8_t* q, int* scale, int* min) {
  for (int j = 0; j < 8; ++j) gguf::scale_min_k4(j, b + 4, scale[j], min[j]);
  for (int v = 0; v < 256; ++v) {
    const int within = v % 64;
    const uint8_t byte = b[16 + 32 * (v / 64) + within % 32];
    q[v] = within < 32 ? byte & 0xF : byte >> 4;
  }
}

void q6k_codes(const uint8_t* b, uint8_t* q) {
  for (int v = 0; v < 256; ++v) {
    const int half = v / 128, quarter = (v % 128) / 32, l = v % 32;
    const uint8_t low = b[64 * half + l + 32 * (quarter % 2)], high = b[128 + 32 * half + l];
    q[v] = (quarter < 2 ? low & 0xF : low >> 4) | (((high >> (2 * quarter)) & 3) << 4);
  }
}

// low nibbles of the value groups 0..3 of 32 values, the high nibbles groups 4..7 (group t: 4t..4t+3)
void put_nibbles(const uint8_t* q32, int lane, uint8_t* out) {
  for (int u = 0; u < 4; ++u)
    for (int e = 0; e < 4; ++e) out[64 * u + 4 * lane + e] = (q32[4 * u + e] & 0xF) | ((q32[16 + 4 * u + e] & 0xF) << 4);
}

void repack_panel(const uint8_t* blocks, int64_t row_bytes, int64_t kind, int64_t outputs, int64_t super_blocks,
                  uint8_t* panel) {
  uint8_t q[256];
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += panel_bytes(kind)) {
    for (int c = 0; c < outputs; ++c) {
      const uint8_t* b = blocks + c * row_bytes + sb * (kind == Q4_K ? Q4K_BLOCK : Q6K_BLOCK);
      if (kind == Q4_K) {
        int scale[8], min[8];
        q4k_codes(b, q, scale, min);
        for (int j = 0; j < 8; ++j) {
          put_nibbles(q + 32 * j, c, panel + 256 * j);
          panel[2048 + 16 * j + c] = scale[j];
          panel[2176 + 32 * (j / 2) + 2 * c + j % 2] = min[j];
        }
        std::memcpy(panel + 2304 + 2 * c, b, 2);
        std::memcpy(panel + 2336 + 2 * c, b + 2, 2);
      } else {
        q6k_codes(b, q);
        for (int g = 0; g < 8; ++g) {
          uint8_t* group = panel + 384 * g;
          put_nibbles(q + 32 * g, c, group);
          for (int t = 0; t < 8; ++t)
            for (int e = 0; e < 4; ++e) group[256 + 64 * (t / 4) + 4 * c + e] |= (q[32 * g + 4 * t + e] >> 4) << (2 * (t % 4));
          for (int i = 0; i < 2; ++i) panel[3072 + 32 * g + 2 * c + i] = b[192 + 2 * g + i];
        }
        std::memcpy(panel + 3328 + 2 * c, b + 208, 2);
      }
    }
  }
}

at::Tensor pack_int8(const at::Tensor& blocks, int64_t kind, int64_t k) {
  TORCH_CHECK(kind == Q4_K || kind == Q6_K, "GGUF block type ", kind, " has no packed int8 layout");
  const int64_t block_bytes = kind == Q4_K ? Q4K_BLOCK : Q6K_BLOCK, super_blocks = k / 256;
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && k % 256 == 0 &&
              blocks.size(1) == super_blocks * block_bytes, "blocks must be contiguous uint8 [n, ", super_blocks * block_bytes, "]");
  const int64_t n = blocks.size(0), panels = (n + LANES - 1) / LANES;
  at::Tensor packed = at::zeros({panels, super_blocks * panel_bytes(kind)}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      repack_panel(src + p * LANES * blocks.size(1), blocks.size(1), kind, std::min<int64_t>(LANES, n - p * LANES),
                   super_blocks, dst + p * packed.size(1));
  });
  return packed;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int ROWS_PER_PASS = 6;  // a row's two accumulators, the 8 unpacked vectors and scales: 32 registers
#define ALWAYS_INLINE inline __attribute__((always_inline))

// a row's int8 codes, its scale per 256 values, and its code sums in int16 pairs: per 32 values
// (sub-blocks of 16, Q6_K) and per 64 (sub-blocks of 32, Q4_K), the pair's first sum in the low half
struct ActRow {
  const int8_t* q;
  const float* d;
  const int32_t* pairs16;
  const int32_t* pairs32;
};

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

ALWAYS_INLINE void nibbles(const uint8_t* p, __m512i* w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int u = 0; u < 4; ++u) {
    const __m512i z = _mm512_loadu_si512(p + 64 * u);
    w[u] = _mm512_and_si512(z, low);
    w[u + 4] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
  }
}

template <int ROWS>
void q4k_pass(const uint8_t* panel, int64_t super_blocks, const ActRow* rows, __m512* out) {
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q4K_PANEL) {
    __m512i sums[ROWS];
    for (int r = 0; r < ROWS; ++r) sums[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i w[8];
      nibbles(panel + 256 * j, w);
      const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + 2048 + 16 * j)));
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* a = rows[r].q + 256 * sb + 32 * j;
        const __m512i dot = _mm512_add_epi32(dot16(w, a), dot16(w + 4, a + 16));
        sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(dot, scale));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 2304)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 2336)));
    for (int r = 0; r < ROWS; ++r) {
      __m512i mins = _mm512_setzero_si512();  // Σ_j m_j Σ codes of sub-block j, by pairs of sub-blocks
      for (int i = 0; i < 4; ++i) {
        const __m512i m = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 2176 + 32 * i)));
        mins = _mm512_dpwssd_epi32(mins, m, _mm512_set1_epi32(rows[r].pairs32[4 * sb + i]));
      }
      const __m512 da = _mm512_set1_ps(rows[r].d[sb]);
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, da), out[r]);
      out[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, da), out[r]);
    }
  }
}

template <int ROWS>
void q6k_pass(const uint8_t* panel, int64_t super_blocks, const ActRow* rows, __m512* out) {
  const __m512i two_bits = _mm512_set1_epi8(0x30);
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q6K_PANEL) {
    __m512i sums[ROWS], offsets[ROWS];  // Σ sc Σ q a with codes 0..63, and Σ sc Σ a for their -32
    for (int r = 0; r < ROWS; ++r) sums[r] = offsets[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const uint8_t* group = panel + 384 * g;
      __m512i w[8];
      nibbles(group, w);
      const __m512i h0 = _mm512_loadu_si512(group + 256), h1 = _mm512_loadu_si512(group + 320);
      for (int half = 0; half < 2; ++half) {  // group 4 * half + t's 2 bits (bits 2t..2t+1) moved to bits 4..5
        const __m512i h = half ? h1 : h0;
        w[4 * half + 0] = _mm512_or_si512(w[4 * half + 0], _mm512_and_si512(_mm512_slli_epi16(h, 4), two_bits));
        w[4 * half + 1] = _mm512_or_si512(w[4 * half + 1], _mm512_and_si512(_mm512_slli_epi16(h, 2), two_bits));
        w[4 * half + 2] = _mm512_or_si512(w[4 * half + 2], _mm512_and_si512(h, two_bits));
        w[4 * half + 3] = _mm512_or_si512(w[4 * half + 3], _mm512_and_si512(_mm512_srli_epi16(h, 2), two_bits));
      }
      const __m512i pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 3072 + 32 * g)));
      const __m512i scale0 = _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16), scale1 = _mm512_srai_epi32(pair, 16);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* a = rows[r].q + 256 * sb + 32 * g;
        sums[r] = _mm512_add_epi32(sums[r], _mm512_add_epi32(_mm512_mullo_epi32(dot16(w, a), scale0),
                                                             _mm512_mullo_epi32(dot16(w + 4, a + 16), scale1)));
        offsets[r] = _mm512_dpwssd_epi32(offsets[r], pair, _mm512_set1_epi32(rows[r].pairs16[8 * sb + g]));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 3328)));
    for (int r = 0; r < ROWS; ++r) {
      const __m512i total = _mm512_sub_epi32(sums[r], _mm512_slli_epi32(offsets[r], 5));
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(rows[r].d[sb])), out[r]);
    }
  }
}

template <int ROWS>
void panel_rows(int64_t kind, const uint8_t* panel, int64_t super_blocks, const ActRow* rows, float* out, int64_t n,
                int64_t first_output) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  if (kind == Q4_K) q4k_pass<ROWS>(panel, super_blocks, rows, acc);
  else q6k_pass<ROWS>(panel, super_blocks, rows, acc);
  const __mmask16 live = n - first_output >= LANES ? 0xFFFF : (1u << (n - first_output)) - 1;
  for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(out + r * n + first_output, live, acc[r]);
}

at::Tensor linear_int8_packed(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t k, int64_t n) {
  TORCH_CHECK(kind == Q4_K || kind == Q6_K, "GGUF block type ", kind, " has no packed int8 layout");
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == k, "x must be fp32 [rows, ", k, "]");
  const int64_t super_blocks = k / 256, panels = (n + LANES - 1) / LANES;
  TORCH_CHECK(packed.dtype() == at::kByte && packed.is_contiguous() && packed.dim() == 2 && packed.size(0) == panels &&
              packed.size(1) == super_blocks * panel_bytes(kind), "packed weights do not hold [", n, ", ", k, "]");
  const at::Tensor xs = x.contiguous();
  const int64_t m = xs.size(0);
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * super_blocks);
  std::vector<int32_t> sum16(m * (k / 16)), pairs16(m * (k / 32)), pairs32(m * (k / 64));
  std::vector<ActRow> rows(m);
  for (int64_t r = 0; r < m; ++r) {
    int32_t* s16 = sum16.data() + r * (k / 16);
    gguf::quantize_row(xs.data_ptr<float>() + r * k, k, 256, q.data() + r * k, d.data() + r * super_blocks, s16);
    for (int64_t i = 0; i < k / 32; ++i) pairs16[r * (k / 32) + i] = int16_pair(s16[2 * i], s16[2 * i + 1]);
    for (int64_t i = 0; i < k / 64; ++i)
      pairs32[r * (k / 64) + i] = int16_pair(s16[4 * i] + s16[4 * i + 1], s16[4 * i + 2] + s16[4 * i + 3]);
    rows[r] = {q.data() + r * k, d.data() + r * super_blocks, pairs16.data() + r * (k / 32), pairs32.data() + r * (k / 64)};
  }
  at::Tensor out = at::empty({m, n}, x.options());
  float* y = out.data_ptr<float>();
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = weights + p * packed.size(1);
      for (int64_t r = 0; r < m; r += ROWS_PER_PASS) {  // later passes find the panel in L2
        const ActRow* pass = rows.data() + r;
        float* o = y + r * n;
        switch (std::min<int64_t>(ROWS_PER_PASS, m - r)) {
          case 1: panel_rows<1>(kind, panel, super_blocks, pass, o, n, p * LANES); break;
          case 2: panel_rows<2>(kind, panel, super_blocks, pass, o, n, p * LANES); break;
          case 3: panel_rows<3>(kind, panel, super_blocks, pass, o, n, p * LANES); break;
          case 4: panel_rows<4>(kind, panel, super_blocks, pass, o, n, p * LANES); break;
          case 5: panel_rows<5>(kind, panel, super_blocks, pass, o, n, p * LANES); break;
          default: panel_rows<ROWS_PER_PASS>(kind, panel, super_blocks, pass, o, n, p * LANES); break;
        }
      }
    }
  });
  return out;
}

bool packed_int8_available() { return true; }
#else
at::Tensor linear_int8_packed(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the packed int8 GGUF kernels need AVX-512 VNNI, which this CPU lacks");
}

bool packed_int8_available() { return false; }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(ssd_engine_gguf, m) {
  m.def("packed_int8_available() -> bool", &packed_int8_available);
  m.def("pack_int8(Tensor blocks, int kind, int k) -> Tensor");
  m.def("linear_int8_packed(Tensor x, Tensor packed, int kind, int k, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CPU, m) {
  m.impl("pack_int8", &pack_int8);
  m.impl("linear_int8_packed", &linear_int8_packed);
}
