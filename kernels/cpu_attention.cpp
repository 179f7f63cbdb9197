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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace cpu_vec;

constexpr int64_t MAX_GROUP = 16;  // query heads a task walks together (larger GQA groups: several tasks)

#if defined(__AVX512F__)
constexpr int64_t VALUE_REGISTERS = 24;  // of the 32 vector registers, for the accumulators
static_assert(MAX_GROUP <= VALUE_REGISTERS, "a group's accumulators of one 16-wide column must fit the registers");

// Columns [d, d + 16 B) of out[h] for every head of the group: B x group accumulators in registers
// for the whole walk, each value vector loaded once for the group.
template <int B, typename T>
void accumulate_block(const float* p, int64_t keys, int64_t group, const T* v_cache, const int64_t* read,
                      int64_t n, int64_t dim, int64_t d, float* out) {
  __m512 acc[VALUE_REGISTERS / B][B];
  for (int64_t h = 0; h < group; ++h)
    for (int b = 0; b < B; ++b) acc[h][b] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512 value[B];
    for (int b = 0; b < B; ++b) value[b] = load16(v_cache + read[i] + d + b * LANES);
    for (int64_t h = 0; h < VALUE_REGISTERS / B; ++h) {
      if (h >= group) break;
      const __m512 weight = _mm512_set1_ps(p[h * keys + i]);
      for (int b = 0; b < B; ++b) acc[h][b] = _mm512_fmadd_ps(weight, value[b], acc[h][b]);
    }
  }
  for (int64_t h = 0; h < group; ++h)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + h * dim + d + b * LANES, acc[h][b]);
}
#endif

// out[h][d] = sum over i of p[h][i] v_i[d], each sum a chain of multiply-adds from 0 in key order
// (how the order is walked around it does not change a sum's bits). On AVX-512 the output stays in
// registers, a block of columns at a time, and each value vector is loaded once for the group.
template <typename T>
void accumulate_values(const float* p, int64_t keys, int64_t group, const T* v_cache, const int64_t* read,
                       int64_t n, int64_t dim, float* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const int64_t width = std::min<int64_t>(VALUE_REGISTERS / group, 8);  // group <= MAX_GROUP: width >= 1
  for (; d + LANES <= dim;) {
    const int64_t block = std::min(width, (dim - d) / LANES);  // group x block <= VALUE_REGISTERS
    switch (block) {
      case 8: accumulate_block<8>(p, keys, group, v_cache, read, n, dim, d, out); break;
      case 7: accumulate_block<7>(p, keys, group, v_cache, read, n, dim, d, out); break;
      case 6: accumulate_block<6>(p, keys, group, v_cache, read, n, dim, d, out); break;
      case 5: accumulate_block<5>(p, keys, group, v_cache, read, n, dim, d, out); break;
      case 4: accumulate_block<4>(p, keys, group, v_cache, read, n, dim, d, out); break;
      case 3: accumulate_block<3>(p, keys, group, v_cache, read, n, dim, d, out); break;
      case 2: accumulate_block<2>(p, keys, group, v_cache, read, n, dim, d, out); break;
      default: accumulate_block<1>(p, keys, group, v_cache, read, n, dim, d, out); break;
    }
    d += block * LANES;
  }
#endif
  for (; d < dim; ++d)
    for (int64_t h = 0; h < group; ++h) {
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) sum = std::fma(p[h * keys + i], as_float(v_cache[read[i] + d]), sum);
      out[h * dim + d] = sum;
    }
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

#if defined(__AVX512F__)
// Scores of HB heads (dim 16 C) over the keys: the heads' queries held in registers, each key's vector
// loaded once for them; each score is dot()'s own chain (from 0, the C chunks in order, one fixed fold
// of the lanes, plus dot()'s tail of 0), so its bits are dot()'s.
template <int C, int HB, typename T>
void score_block(const float* q, const T* k_cache, const int64_t* read, int64_t n, float scale, float* scores,
                 int64_t keys, float* top) {
  __m512 query[HB][C];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C; ++c) query[h][c] = _mm512_loadu_ps(q + h * C * LANES + c * LANES);
  for (int64_t i = 0; i < n; ++i) {
    const T* key = k_cache + read[i];
    __m512 acc[HB];
    for (int h = 0; h < HB; ++h) acc[h] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const __m512 chunk = load16(key + c * LANES);
      for (int h = 0; h < HB; ++h) acc[h] = _mm512_fmadd_ps(query[h][c], chunk, acc[h]);
    }
    const float no_tail = 0.f;
    for (int h = 0; h < HB; ++h) {
      const float score = (_mm512_reduce_add_ps(acc[h]) + no_tail) * scale;
      scores[h * keys + i] = score;
      top[h] = std::max(top[h], score);
    }
  }
}
#endif

// The `group` query heads of one KV head for one query (group 1: one head alone): each head's scores,
// softmax and values in key order, with each key and value loaded once for the group. A head's
// arithmetic is the same whatever its group: the same operations on the same values in the same order,
// so a (query, head) has its bits however the heads are grouped. scores: [group, keys].
template <typename T>
void attend_group(const float* q, int64_t group, const T* k_cache, const T* v_cache, const int64_t* slots,
                  const bool* allowed, int64_t keys, int64_t kv_stride, int64_t dim, float scale, float* scores,
                  int64_t* read, float* out) {
  int64_t n = 0;
  for (int64_t j = 0; j < keys; ++j)
    if (allowed[j]) read[n++] = slots[j] * kv_stride;
  float top[MAX_GROUP], inverse[MAX_GROUP];
  for (int64_t h = 0; h < group; ++h) top[h] = -std::numeric_limits<float>::infinity();
  int64_t h = 0;
#if defined(__AVX512F__)
  // blocks of heads whose queries fit 24 registers: 3 heads of dim 128, 6 of dim 64
  for (int64_t block; (dim == 128 || dim == 64) && h < group; h += block) {
    block = std::min<int64_t>(group - h, dim == 128 ? 3 : 6);
    auto run = [&](auto chunks, auto heads) {
      score_block<decltype(chunks)::value, decltype(heads)::value>(q + h * dim, k_cache, read, n, scale,
                                                                  scores + h * keys, keys, top + h);
    };
    using std::integral_constant;
    if (dim == 128) {
      if (block == 3) run(integral_constant<int, 8>(), integral_constant<int, 3>());
      else if (block == 2) run(integral_constant<int, 8>(), integral_constant<int, 2>());
      else run(integral_constant<int, 8>(), integral_constant<int, 1>());
    } else {
      switch (block) {
        case 6: run(integral_constant<int, 4>(), integral_constant<int, 6>()); break;
        case 5: run(integral_constant<int, 4>(), integral_constant<int, 5>()); break;
        case 4: run(integral_constant<int, 4>(), integral_constant<int, 4>()); break;
        case 3: run(integral_constant<int, 4>(), integral_constant<int, 3>()); break;
        case 2: run(integral_constant<int, 4>(), integral_constant<int, 2>()); break;
        default: run(integral_constant<int, 4>(), integral_constant<int, 1>()); break;
      }
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) {  // the heads no block took
    const T* key = k_cache + read[i];
    for (int64_t g = h; g < group; ++g) {
      const float score = dot(q + g * dim, key, dim) * scale;
      scores[g * keys + i] = score;
      top[g] = std::max(top[g], score);
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* own = scores + h * keys;
    for (int64_t i = 0; i < n; ++i) own[i] = exp_nonpositive(own[i] - top[h]);
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) total += own[i];
    inverse[h] = 1.f / total;
  }
  accumulate_values(scores, keys, group, v_cache, read, n, dim, out);
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
  // A task is a query's whole group of heads (each key and value read once for them) where that gives
  // every thread a task; else a task is one head, so a small decode step still spreads over the threads
  const int64_t task_group = group <= MAX_GROUP && tokens * kv_heads >= at::get_num_threads() ? group : 1;
  const int64_t tasks_per_query = heads / task_group;
  // Each thread takes a contiguous share of the tasks, and in a causal chunk a later query reads more
  // keys: tasks visit the queries first, last, second, second to last, ... so every share holds about
  // as much work (in query order, a 2048-token prefill's second half is three quarters of its work)
  auto query_of = [tokens](int64_t x) { return x % 2 == 0 ? x / 2 : tokens - 1 - x / 2; };
  auto run = [&](auto* k_base, auto* v_base) {
    at::parallel_for(0, tokens * tasks_per_query, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(task_group * keys);
      std::vector<int64_t> read(keys);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = query_of(task / tasks_per_query), first_head = (task % tasks_per_query) * task_group;
        const int64_t cell = cell_ptr[t], row = cell / lq, head_offset = (first_head / group) * dim;
        const int64_t first = t * heads + first_head;  // the task's first (query, head) in q and out
        attend_group(q_ptr + first * dim, task_group, k_base + head_offset, v_base + head_offset,
                     slot_ptr + row * keys, mask_ptr + cell * keys, keys, kv_stride, dim, static_cast<float>(scale),
                     scores.data(), read.data(), out_ptr + first * dim);
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
