// A decoder layer's elementwise work on CPU, one op where eager torch dispatches many
// (cpu_layer_ops.py says why; kernels/fused_layer_ops.py is the GPU's Triton twin, same semantics).
//
//   add_rms_norm(x[T, N], residual[T, N], weight[N], eps) -> (norm(x + residual) * weight, x + residual)
//   rope_cache_write(qkv[T, (Hq + 2 Hk) D], cos[T, 1, D], sin_signed[T, 1, D], slots[T], k_cache[S, Hk, D],
//                    v_cache[S, Hk, D], Hq, Hk, q_norm?[D], k_norm?[D], eps) -> rotated q [T, Hq, D]
//
// Each computes in fp32 and rounds to the activations' dtype where the torch ops round (the residual
// sum, a normed head). RoPE's two products are rounded before their sum, as torch's x * cos + r * sin
// rounds them: fp32 results are torch's bits, hence `fp-contract=off` (no fused multiply-add there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace cpu_vec;

template <typename scalar_t>
void add_rms_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       double eps, at::Tensor& out, at::Tensor& total) {
  const int64_t rows = x.size(0), n = x.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* rp = residual.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  scalar_t* tp = total.data_ptr<scalar_t>();
  const int64_t sx = x.stride(0), sr = residual.stride(0), so = out.stride(0), st = total.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> v(n);
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t sum = static_cast<scalar_t>(static_cast<float>(xp[row * sx + i]) +
                                                   static_cast<float>(rp[row * sr + i]));
        tp[row * st + i] = sum;
        v[i] = static_cast<float>(sum);
      }
      const float scale = 1.f / std::sqrt(dot(v.data(), v.data(), n) / static_cast<float>(n) + static_cast<float>(eps));
      for (int64_t i = 0; i < n; ++i)
        op[row * so + i] = static_cast<scalar_t>(v[i] * scale * static_cast<float>(wp[i]));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "add_rms_norm: x must be [T, N] with contiguous rows");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm: weight must be [N]");
  at::Tensor w = weight.scalar_type() == x.scalar_type() ? weight : weight.to(x.scalar_type());
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor total = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm",
                                  [&] { add_rms_norm_rows<scalar_t>(x, residual, w, eps, out, total); });
  return {out, total};
}

// one head: optionally RMS-normed (Qwen3's q / k norms, rounded as the norm's output is), then rotated
template <typename scalar_t>
__attribute__((optimize("fp-contract=off")))
void rotate_head(const scalar_t* src, const scalar_t* cos, const scalar_t* sin, const scalar_t* norm, float eps,
                 int64_t d, float* work, scalar_t* dst) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) work[i] = static_cast<float>(src[i]);
  if (norm) {
    const float scale = 1.f / std::sqrt(dot(work, work, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i)
      work[i] = static_cast<float>(static_cast<scalar_t>(work[i] * scale * static_cast<float>(norm[i])));
  }
  for (int64_t i = 0; i < d; ++i) {
    const int64_t partner = i < half ? i + half : i - half;  // x.roll(D / 2): the halves swapped
    const float straight = work[i] * static_cast<float>(cos[i]);
    const float swapped = work[partner] * static_cast<float>(sin[i]);
    dst[i] = static_cast<scalar_t>(straight + swapped);
  }
}

template <typename scalar_t>
void rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
               at::Tensor& k_cache, at::Tensor& v_cache, int64_t hq, int64_t hk, const scalar_t* q_norm,
               const scalar_t* k_norm, double eps, at::Tensor& q) {
  const int64_t tokens = qkv.size(0), d = k_cache.size(2);
  const scalar_t* src = qkv.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = v_cache.data_ptr<scalar_t>();
  scalar_t* qp = q.data_ptr<scalar_t>();
  const int64_t s_qkv = qkv.stride(0), s_cos = cos.stride(0), s_sin = sin.stride(0);
  const int64_t s_kc = k_cache.stride(0), s_kh = k_cache.stride(1), s_vc = v_cache.stride(0), s_vh = v_cache.stride(1);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> work(d);
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* row = src + t * s_qkv;
      const scalar_t* c = cp + t * s_cos;
      const scalar_t* s = sp + t * s_sin;
      for (int64_t h = 0; h < hq; ++h)
        rotate_head(row + h * d, c, s, q_norm, static_cast<float>(eps), d, work.data(), qp + (t * hq + h) * d);
      for (int64_t h = 0; h < hk; ++h) {
        rotate_head(row + (hq + h) * d, c, s, k_norm, static_cast<float>(eps), d, work.data(),
                    kc + slot[t] * s_kc + h * s_kh);
        std::copy_n(row + (hq + hk + h) * d, d, vc + slot[t] * s_vc + h * s_vh);
      }
    }
  });
}

at::Tensor rope_cache_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                            const at::Tensor& slots, at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads,
                            int64_t num_kv_heads, const std::optional<at::Tensor>& q_norm,
                            const std::optional<at::Tensor>& k_norm, double eps) {
  const int64_t d = k_cache.size(-1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d,
              "rope_cache_write: qkv must be [T, (Hq + 2 Hk) * D] with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k_cache.size(1) == num_kv_heads,
              "rope_cache_write: the caches must be [S, Hk, D] with contiguous heads");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type() &&
              cos.scalar_type() == qkv.scalar_type() && sin_signed.scalar_type() == qkv.scalar_type(),
              "rope_cache_write: qkv, the tables and the caches must share a dtype");
  TORCH_CHECK(cos.stride(-1) == 1 && sin_signed.stride(-1) == 1 && cos.size(-1) == d, "rope_cache_write: tables [T, 1, D]");
  TORCH_CHECK(d % 2 == 0, "rope_cache_write: an odd head dim has no halves to rotate");
  at::Tensor slot64 = slots.to(at::kLong).contiguous();
  at::Tensor q = at::empty({qkv.size(0), num_heads, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_cache_write", [&] {
    at::Tensor qn = q_norm ? q_norm->to(qkv.scalar_type()).contiguous() : at::Tensor();
    at::Tensor kn = k_norm ? k_norm->to(qkv.scalar_type()).contiguous() : at::Tensor();
    rope_rows<scalar_t>(qkv, cos, sin_signed, slot64, k_cache, v_cache, num_heads, num_kv_heads,
                        q_norm ? qn.data_ptr<scalar_t>() : nullptr, k_norm ? kn.data_ptr<scalar_t>() : nullptr,
                        eps, q);
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ssd_engine_gguf, m) {
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_cache_write(Tensor qkv, Tensor cos, Tensor sin_signed, Tensor slots, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int num_heads, int num_kv_heads, Tensor? q_norm, Tensor? k_norm, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(ssd_engine_gguf, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_cache_write", &rope_cache_write);
}
