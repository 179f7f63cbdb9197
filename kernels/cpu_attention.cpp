// Attention over the paged KV cache for one query at a time, in an order that depends on nothing but
// that query's own keys: what a target whose rows must keep their bits at every batch shape needs
// (layers/attention.py `row_independent_attention`).
//
// torch's CPU SDPA gives a query other bits when its block of queries or keys changes shape, so the
// torch path pads every step to fixed blocks (4 queries, 512 keys), and a one-row decode step pays
// for 4 x 512. Here each (query, head) walks its unmasked keys in key order: scores from a dot product
// summed in 16 fixed lanes, a softmax in key order, values accumulated in key order. Masked keys are
// skipped, not zero-weighted, so padding and the other rows never enter a query's arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace cpu_vec;

// out[d] += p v[d]
template <typename T>
inline void add_scaled(float* out, float p, const T* v, int64_t dim) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 weight = _mm512_set1_ps(p);
  for (; d + LANES <= dim; d += LANES) _mm512_storeu_ps(out + d, _mm512_fmadd_ps(weight, load16(v + d), _mm512_loadu_ps(out + d)));
#endif
  for (; d < dim; ++d) out[d] += p * as_float(v[d]);
}

// e^x for x <= 0 (Cephes' expf: about 1 ulp), as plain arithmetic the compiler vectorizes; the same
// bits for an x wherever it sits in the array
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// one (query, head): its allowed keys gathered in key order, then scores, softmax and values over them
template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* slots, const bool* allowed,
            int64_t keys, int64_t kv_stride, int64_t dim, float scale, float* scores, int64_t* read, float* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < keys; ++j)
    if (allowed[j]) read[n++] = slots[j] * kv_stride;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = dot(q, k_cache + read[i], dim) * scale;
    top = std::max(top, scores[i]);
  }
  for (int64_t i = 0; i < n; ++i) scores[i] = exp_nonpositive(scores[i] - top);
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += scores[i];
  std::memset(out, 0, sizeof(float) * dim);
  for (int64_t i = 0; i < n; ++i) {
    add_scaled(out, scores[i], v_cache + read[i], dim);
  }
  const float inverse = 1.f / total;
  for (int64_t d = 0; d < dim; ++d) out[d] *= inverse;
}

// The `group` query heads of one KV head for one query: each head's scores, softmax and values exactly
// as attend() computes them alone (the same operations on the same values in the same key order), with
// each key and value loaded once for the group rather than once a head. scores: [group, keys].
template <typename T>
void attend_group(const float* q, int64_t group, const T* k_cache, const T* v_cache, const int64_t* slots,
                  const bool* allowed, int64_t keys, int64_t kv_stride, int64_t dim, float scale, float* scores,
                  int64_t* read, float* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < keys; ++j)
    if (allowed[j]) read[n++] = slots[j] * kv_stride;
  std::vector<float> top(group, -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; ++i) {
    const T* key = k_cache + read[i];
    for (int64_t h = 0; h < group; ++h) {
      const float score = dot(q + h * dim, key, dim) * scale;
      scores[h * keys + i] = score;
      top[h] = std::max(top[h], score);
    }
  }
  std::vector<float> inverse(group);
  for (int64_t h = 0; h < group; ++h) {
    float* own = scores + h * keys;
    for (int64_t i = 0; i < n; ++i) own[i] = exp_nonpositive(own[i] - top[h]);
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) total += own[i];
    inverse[h] = 1.f / total;
  }
  std::memset(out, 0, sizeof(float) * group * dim);
  for (int64_t i = 0; i < n; ++i) {
    const T* value = v_cache + read[i];
    for (int64_t h = 0; h < group; ++h) add_scaled(out + h * dim, scores[h * keys + i], value, dim);
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] *= inverse[h];
}

// q [T, Hq, D] fp32; k_cache, v_cache [S, Hk, D] (fp32 or bf16); gather_slots [R, L] int64 cache slot
// of each key a row may read; mask [R, Lq, L] bool; query_cell [T] int64: the (row, query) cell r * Lq + i
// of each query. -> [T, Hq, D] fp32. Every query must be allowed at least one key.
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& gather_slots, const at::Tensor& mask, const at::Tensor& query_cell,
                         double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "row_attention: q must be fp32 [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "row_attention: k_cache and v_cache must be contiguous [S, Hk, D] of one dtype");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16,
              "row_attention: the cache must be fp32 or bf16");
  TORCH_CHECK(gather_slots.dim() == 2 && gather_slots.scalar_type() == at::kLong && gather_slots.is_contiguous(),
              "row_attention: gather_slots must be int64 [R, L]");
  TORCH_CHECK(mask.dim() == 3 && mask.scalar_type() == at::kBool && mask.is_contiguous() &&
                  mask.size(0) == gather_slots.size(0) && mask.size(2) == gather_slots.size(1),
              "row_attention: mask must be bool [R, Lq, L] over gather_slots");
  TORCH_CHECK(query_cell.dim() == 1 && query_cell.scalar_type() == at::kLong && query_cell.size(0) == q.size(0),
              "row_attention: query_cell must be int64 [T]");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && heads % kv_heads == 0, "row_attention: head shapes disagree");
  const int64_t keys = gather_slots.size(1), lq = mask.size(1), group = heads / kv_heads;
  auto out = at::empty({tokens, heads, dim}, q.options());
  const float* q_ptr = q.data_ptr<float>();
  const int64_t* slot_ptr = gather_slots.data_ptr<int64_t>();
  const bool* mask_ptr = mask.data_ptr<bool>();
  const int64_t* cell_ptr = query_cell.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t kv_stride = kv_heads * dim;
  // Long steps (prefill chunks) walk a KV head's keys once for its query heads: the same bits, less memory
  // traffic; short ones keep a task per head, so a decode step still spreads over the threads.
  const bool grouped = group > 1 && tokens * kv_heads >= 4 * at::get_num_threads();
  // Each thread takes a contiguous share of the tasks, and in a causal chunk a later query reads more
  // keys: tasks visit the queries first, last, second, second to last, ... so every share holds about
  // as much work (in query order, a 2048-token prefill's second half is three quarters of its work)
  auto query_of = [tokens](int64_t x) { return x % 2 == 0 ? x / 2 : tokens - 1 - x / 2; };
  auto run = [&](auto* k_base, auto* v_base) {
    if (grouped) {
      at::parallel_for(0, tokens * kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(group * keys);
        std::vector<int64_t> read(keys);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t t = query_of(task / kv_heads), kv = task % kv_heads, cell = cell_ptr[t], row = cell / lq;
          const int64_t first = t * heads + kv * group;  // its group's first (query, head) in q and out
          attend_group(q_ptr + first * dim, group, k_base + kv * dim, v_base + kv * dim, slot_ptr + row * keys,
                       mask_ptr + cell * keys, keys, kv_stride, dim, static_cast<float>(scale), scores.data(),
                       read.data(), out_ptr + first * dim);
        }
      });
      return;
    }
    at::parallel_for(0, tokens * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(keys);
      std::vector<int64_t> read(keys);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = query_of(task / heads), h = task % heads, cell = cell_ptr[t], row = cell / lq;
        const int64_t head_offset = (h / group) * dim;  // this head's kv head within a slot
        attend(q_ptr + (t * heads + h) * dim, k_base + head_offset, v_base + head_offset, slot_ptr + row * keys,
               mask_ptr + cell * keys, keys, kv_stride, dim, static_cast<float>(scale), scores.data(),
               read.data(), out_ptr + (t * heads + h) * dim);
      }
    });
  };
  if (k_cache.scalar_type() == at::kFloat) run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ssd_engine_gguf, m) {
  m.def("row_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor gather_slots, Tensor mask, "
        "Tensor query_cell, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CPU, m) { m.impl("row_attention", &row_attention); }
