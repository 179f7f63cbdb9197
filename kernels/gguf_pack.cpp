// Repacks GGUF Q4_K / Q6_K blocks into gguf_panels.h's panels (once, while a model loads), and
// says which panel kernels this build has.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "gguf_panels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using namespace gguf_panels;
constexpr int64_t Q4K_BLOCK = 144, Q6K_BLOCK = 210;

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
          panel[Q4K_SCALES + 16 * j + c] = scale[j];
          panel[Q4K_MINS + 32 * (j / 2) + 2 * c + j % 2] = min[j];
        }
        std::memcpy(panel + Q4K_D + 2 * c, b, 2);
        std::memcpy(panel + Q4K_DMIN + 2 * c, b + 2, 2);
      } else {
        q6k_codes(b, q);
        for (int g = 0; g < 8; ++g) {
          uint8_t* group = panel + Q6K_GROUP * g;
          put_nibbles(q + 32 * g, c, group);
          for (int t = 0; t < 8; ++t)
            for (int e = 0; e < 4; ++e) group[Q6K_HIGH + 64 * (t / 4) + 4 * c + e] |= (q[32 * g + 4 * t + e] >> 4) << (2 * (t % 4));
          for (int i = 0; i < 2; ++i) panel[Q6K_SCALES + 32 * g + 2 * c + i] = b[192 + 2 * g + i];
        }
        std::memcpy(panel + Q6K_D + 2 * c, b + 208, 2);
      }
    }
  }
}

at::Tensor pack_panels(const at::Tensor& blocks, int64_t kind, int64_t k) {
  TORCH_CHECK(kind == Q4_K || kind == Q6_K, "GGUF block type ", kind, " has no panel layout");
  const int64_t block_bytes = kind == Q4_K ? Q4K_BLOCK : Q6K_BLOCK, super_blocks = k / 256;
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() && k % 256 == 0 &&
              blocks.size(1) == super_blocks * block_bytes, "blocks must be contiguous uint8 [n, ", super_blocks * block_bytes, "]");
  const int64_t n = blocks.size(0), count = (n + LANES - 1) / LANES;
  at::Tensor panels = at::zeros({count, super_blocks * panel_bytes(kind)}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = panels.data_ptr<uint8_t>();
  at::parallel_for(0, count, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      repack_panel(src + p * LANES * blocks.size(1), blocks.size(1), kind, std::min<int64_t>(LANES, n - p * LANES),
                   super_blocks, dst + p * panels.size(1));
  });
  return panels;
}

bool panels_fp32_available() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

bool panels_int8_available() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ssd_engine_gguf, m) {
  m.def("panels_fp32_available() -> bool", &panels_fp32_available);
  m.def("panels_int8_available() -> bool", &panels_int8_available);
  m.def("pack_panels(Tensor blocks, int kind, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CPU, m) { m.impl("pack_panels", &pack_panels); }
