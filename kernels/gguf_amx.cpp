// gguf-int8's Q4_K and Q6_K products on AMX tiles: 16 rows at a time in tile multiplies, for
// Linears of enough rows (prefill chunks, large batches); gguf_vnni.cpp's passes take the rest.
// Integer sums are exact in any order, and gguf_int8_rows.h's one fp32 order turns them into outputs,
// so each row gets the bits it gets in the passes, at any row count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gguf_int8_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include <sys/syscall.h>
#include <unistd.h>

namespace gguf_int8 {

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
namespace {

constexpr int TILE_ROWS = 16;

bool tiles_permitted() {  // Linux hands a process the tile state only when asked (arch_prctl)
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes. Tile 0 (and 7, Q4_K's second 16 rows): 16 rows' codes of 64 values;
// 1 and 2: the panel's codes of them as scaled below (16 rows of 16 outputs x 4 bytes); 3-7: the sums
// over a super-block, one a code plane (Q4_K: 3-4, and 5-6 for its second 16 rows).
void configure_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) config.rows[tile] = TILE_ROWS, config.colsb[tile] = 64;
  _tile_loadconfig(&config);
}

// A panel's codes one byte each, in planes of 4 KB a super-block, read once a panel, then by every
// 16 rows. A sub-block's scale is multiplied into its codes in small digits, each product fitting its
// byte (so one 32-bit multiply scales a lane's 4 codes) and the super-block's integer sum of sc_j
// (codes_j . row) is a few full tile multiplies into a sum per plane, recombined exactly:
// Q4_K: sc (0..63) = lo + 8 hi, planes codes x lo and codes x hi (at most 15 x 7);
// Q6_K: sc (-128..127) + 128 = d0 + 4 d1 + 16 d2 + 64 d3, planes codes, codes x d0..d3 (at most 63 x 3).
constexpr int64_t PLANE = 4096;
constexpr int PLANES[2] = {2, 5};  // Q4_K, Q6_K

void unpack_codes(const uint8_t* panel, int64_t kind, int64_t super_blocks, uint8_t* codes) {
  const bool q6k = kind == Q6_K;
  for (int64_t sb = 0; sb < super_blocks; ++sb)
    for (int j = 0; j < 8; ++j) {  // 32 values: a Q4_K sub-block, two of Q6_K
      const uint8_t* super_block = panel + sb * (q6k ? Q6K_PANEL : Q4K_PANEL);
      __m512i w[8], digits[2][4];
      if (q6k) {
        q6k_codes(super_block + Q6K_GROUP * j, w);
        __m512i scales[2];
        pair_scales(byte_pairs(super_block + Q6K_SCALES + 32 * j, true), scales);
        for (int h = 0; h < 2; ++h) {
          const __m512i biased = _mm512_add_epi32(scales[h], _mm512_set1_epi32(128));
          for (int d = 0; d < 4; ++d) digits[h][d] = _mm512_and_si512(_mm512_srli_epi32(biased, 2 * d), _mm512_set1_epi32(3));
        }
      } else {
        nibbles(super_block + 256 * j, w);
        const __m512i sc = q4k_scales(super_block, j);
        digits[0][0] = digits[1][0] = _mm512_and_si512(sc, _mm512_set1_epi32(7));
        digits[0][1] = digits[1][1] = _mm512_srli_epi32(sc, 3);
      }
      uint8_t* at = codes + PLANES[q6k] * PLANE * sb + 512 * j;
      for (int v = 0; v < 8; ++v) {
        const __m512i* digit = digits[v / 4];  // Q6_K: vectors 0-3 are the first sub-block of 16
        if (q6k) {
          _mm512_store_si512(at + 64 * v, w[v]);
          for (int d = 0; d < 4; ++d) _mm512_store_si512(at + PLANE * (d + 1) + 64 * v, _mm512_mullo_epi32(w[v], digit[d]));
        } else {
          for (int d = 0; d < 2; ++d) _mm512_store_si512(at + PLANE * d + 64 * v, _mm512_mullo_epi32(w[v], digit[d]));
        }
      }
    }
}

// BLOCKS (1 or 2) blocks of 16 rows: two keep four sums in flight (a tile multiply's latency is
// several of its issue intervals) and share each load of the panel's planes
template <int BLOCKS>
void q4k_tiles(const uint8_t* panel, const uint8_t* codes, int64_t super_blocks, const ActRow* rows, int64_t k,
               __m512* out) {
  alignas(64) int32_t dots[2 * BLOCKS][TILE_ROWS * LANES];
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q4K_PANEL, codes += 2 * PLANE) {
    _tile_zero(3);
    _tile_zero(4);
    if constexpr (BLOCKS == 2) {
      _tile_zero(5);
      _tile_zero(6);
    }
    for (int t = 0; t < 4; ++t) {  // sub-blocks 2t and 2t + 1
      _tile_loadd(1, codes + 1024 * t, 64);
      _tile_loadd(2, codes + PLANE + 1024 * t, 64);
      _tile_loadd(0, rows[0].q + 256 * sb + 64 * t, k);
      _tile_dpbsud(3, 0, 1);
      _tile_dpbsud(4, 0, 2);
      if constexpr (BLOCKS == 2) {
        _tile_loadd(7, rows[TILE_ROWS].q + 256 * sb + 64 * t, k);
        _tile_dpbsud(5, 7, 1);
        _tile_dpbsud(6, 7, 2);
      }
    }
    _tile_stored(3, dots[0], 64);
    _tile_stored(4, dots[1], 64);
    if constexpr (BLOCKS == 2) {
      _tile_stored(5, dots[2], 64);
      _tile_stored(6, dots[3], 64);
    }
    for (int block = 0; block < BLOCKS; ++block) {
      __m512i sums[TILE_ROWS];
      for (int r = 0; r < TILE_ROWS; ++r)
        sums[r] = _mm512_add_epi32(_mm512_load_si512(dots[2 * block] + LANES * r),
                                   _mm512_slli_epi32(_mm512_load_si512(dots[2 * block + 1] + LANES * r), 3));
      q4k_finish<TILE_ROWS>(panel, sb, rows + TILE_ROWS * block, sums, out + TILE_ROWS * block);
    }
  }
}

void q6k_tiles(const uint8_t* panel, const uint8_t* codes, int64_t super_blocks, const ActRow* rows, int64_t k,
               __m512* out) {
  alignas(64) int32_t dots[5][TILE_ROWS * LANES];
  for (int64_t sb = 0; sb < super_blocks; ++sb, panel += Q6K_PANEL, codes += 5 * PLANE) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int t = 0; t < 4; ++t) {  // 64 values: 4 sub-blocks
      _tile_loadd(0, rows[0].q + 256 * sb + 64 * t, k);
      const uint8_t* plane = codes + 1024 * t;
      _tile_loadd(1, plane, 64);
      _tile_loadd(2, plane + PLANE, 64);
      _tile_dpbsud(3, 0, 1);
      _tile_dpbsud(4, 0, 2);
      _tile_loadd(1, plane + 2 * PLANE, 64);
      _tile_loadd(2, plane + 3 * PLANE, 64);
      _tile_dpbsud(5, 0, 1);
      _tile_dpbsud(6, 0, 2);
      _tile_loadd(1, plane + 4 * PLANE, 64);
      _tile_dpbsud(7, 0, 1);
    }
    _tile_stored(3, dots[0], 64);
    _tile_stored(4, dots[1], 64);
    _tile_stored(5, dots[2], 64);
    _tile_stored(6, dots[3], 64);
    _tile_stored(7, dots[4], 64);
    __m512i sums[TILE_ROWS], offsets[TILE_ROWS], pairs[8];
    for (int g = 0; g < 8; ++g) pairs[g] = byte_pairs(panel + Q6K_SCALES + 32 * g, true);
    for (int r = 0; r < TILE_ROWS; ++r) {
      const auto plane = [&](int i) { return _mm512_load_si512(dots[i] + LANES * r); };
      const __m512i digits = _mm512_add_epi32(_mm512_add_epi32(plane(1), _mm512_slli_epi32(plane(2), 2)),
                                              _mm512_add_epi32(_mm512_slli_epi32(plane(3), 4), _mm512_slli_epi32(plane(4), 6)));
      sums[r] = _mm512_sub_epi32(digits, _mm512_slli_epi32(plane(0), 7));
      offsets[r] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g)
        offsets[r] = _mm512_dpwssd_epi32(offsets[r], pairs[g], _mm512_set1_epi32(rows[r].pairs16[8 * sb + g]));
    }
    q6k_finish<TILE_ROWS>(panel, sb, rows, sums, offsets, out);
  }
}

// Rows [first, last) of every panel, 32 at a time where they can be (Q4_K). A task takes a group of
// panels, their planes unpacked together, and walks the rows once for the group: each row's outputs
// of the group are then written side by side (one panel at a time over hundreds of rows wrote 64
// bytes a page and missed the TLB on every store, 1.4x slower past ~200 rows of 8960 outputs).
constexpr int64_t GROUP_BYTES = 1 << 20;  // a group's planes, kept in L2

void tile_chunk(const at::Tensor& panels, int64_t kind, int64_t k, int64_t n, const ActRow* rows, int64_t first,
                int64_t last, float* y) {
  const int64_t plane_bytes = k / 256 * PLANES[kind == Q6_K] * PLANE, count = panels.size(0);
  const int64_t group = std::clamp<int64_t>(GROUP_BYTES / plane_bytes, 1,
                                            (count + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads()));
  at::parallel_for(0, (count + group - 1) / group, 1, [&](int64_t g0, int64_t g1) {
    configure_tiles();  // per thread, each call: other libraries (oneDNN) configure tiles too
    uint8_t* codes = static_cast<uint8_t*>(std::aligned_alloc(64, group * plane_bytes));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * group, p1 = std::min(count, p0 + group);
      for (int64_t p = p0; p < p1; ++p)
        unpack_codes(panels.data_ptr<uint8_t>() + p * panels.size(1), kind, k / 256, codes + (p - p0) * plane_bytes);
      for (int64_t r = first; r < last;) {
        const int blocks = kind == Q4_K && last - r >= 2 * TILE_ROWS ? 2 : 1;
        for (int64_t p = p0; p < p1; ++p) {
          const uint8_t* panel = panels.data_ptr<uint8_t>() + p * panels.size(1);
          const uint8_t* planes = codes + (p - p0) * plane_bytes;
          __m512 acc[2 * TILE_ROWS];
          for (int i = 0; i < 2 * TILE_ROWS; ++i) acc[i] = _mm512_setzero_ps();
          if (blocks == 2) q4k_tiles<2>(panel, planes, k / 256, rows + r, k, acc);
          else if (kind == Q4_K) q4k_tiles<1>(panel, planes, k / 256, rows + r, k, acc);
          else q6k_tiles(panel, planes, k / 256, rows + r, k, acc);
          if (blocks == 2) store_lanes<2 * TILE_ROWS>(acc, y + r * n, n, p * LANES);
          else store_lanes<TILE_ROWS>(acc, y + r * n, n, p * LANES);
        }
        r += blocks * TILE_ROWS;
      }
    }
    std::free(codes);
    _tile_release();
  });
}

}  // namespace

// Rows [0, tiled) of every panel run in tiles of 16 rows, the caller's passes take the rest. A panel's
// planes cost the same at any row count, so below a few tiles the passes are faster (the thresholds
// are measured ones: docs/CPU.md, "Prefill on AMX").
int64_t tiled_rows(int64_t m, int64_t kind) {
  const int64_t fewest = kind == Q4_K ? 32 : 48;
  return tiles_permitted() && m >= fewest ? m / TILE_ROWS * TILE_ROWS : 0;
}

// Rows [0, tiled) in chunks whose int8 codes stay in L2 while a group of panels reads them: ~1 MB a
// chunk, at least 64 rows, so a panel's planes serve many rows
constexpr int64_t CHUNK_BYTES = 1 << 20;

void tile_passes(const at::Tensor& panels, int64_t kind, int64_t k, int64_t n, const ActRow* rows, int64_t tiled,
                 float* y) {
  const int64_t chunk = std::max<int64_t>(64, CHUNK_BYTES / k / (2 * TILE_ROWS) * (2 * TILE_ROWS));
  for (int64_t first = 0; first < tiled; first += chunk)
    tile_chunk(panels, kind, k, n, rows, first, std::min(tiled, first + chunk), y);
}

#else
namespace {
bool tiles_permitted() { return false; }
}  // namespace

int64_t tiled_rows(int64_t, int64_t) { return 0; }
void tile_passes(const at::Tensor&, int64_t, int64_t, int64_t, const ActRow*, int64_t, float*) {}
#endif

}  // namespace gguf_int8

TORCH_LIBRARY_FRAGMENT(ssd_engine_gguf, m) {
  m.def("int8_panel_tiles() -> bool");  // whether linear_int8_panels runs 16-row tiles on AMX here
}

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CompositeExplicitAutograd, m) {
  m.impl("int8_panel_tiles", &gguf_int8::tiles_permitted);
}
