// Torch ops dsv41::rms_norm and dsv41::rope: the per-row math of the production path as one
// op each (a step of the paged runtime calls them ~8 times per layer; as separate torch ops
// they would be 6 and 14 launches). CPU: the loops of include/dsv41/layer_ops.h. CUDA:
// ATen's fused RMSNorm, and a copy plus one complex multiply for the rotation.
// dsv41::hc_weights, hc_collapse and hc_expand (CPU only): mHC's per-site math, which as
// torch ops is ~150 tiny launches per site (the Sinkhorn iterations); GPUs keep the torch
// expressions (model/mhc.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "dsv41/layer_ops.h"

namespace dsv41 {
namespace {

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must be [..., D] with D > 0");
}

at::ScalarType out_type(const std::optional<at::ScalarType>& dtype, const char* op) {
  const at::ScalarType t = dtype.value_or(at::kFloat);
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, op, ": out dtype must be float32 or bfloat16, got ", t);
  return t;
}

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
                    std::optional<at::ScalarType> dtype) {
  const char* op = "dsv41::rms_norm";
  check_x(x, op);
  const int64_t D = x.size(-1);
  if (weight.has_value()) {
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->dim() == 1 && weight->size(0) == D, op,
                ": weight must be float32 [", D, "]");
    TORCH_CHECK(weight->device() == x.device(), op, ": weight and x must be on one device");
  }
  const at::ScalarType out = out_type(dtype, op);
  if (x.is_cuda()) {
    return at::rms_norm(x.to(at::kFloat), {D}, weight, eps).to(out);
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out));
  const at::Tensor w = weight.has_value() ? weight->contiguous() : at::Tensor();
  cpu::rms_norm(xc.const_data_ptr(), x.scalar_type() == at::kBFloat16,
                w.defined() ? w.const_data_ptr<float>() : nullptr, y.mutable_data_ptr(), out == at::kBFloat16,
                D ? x.numel() / D : 0, D, static_cast<float>(eps));
  return y;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool inverse,
                std::optional<at::ScalarType> dtype) {
  const char* op = "dsv41::rope";
  check_x(x, op);
  TORCH_CHECK(x.dim() >= 2, op, ": x must be [R, ..., D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.sizes() == sin.sizes(),
              op, ": cos and sin must be float32 [R, pairs] of one shape");
  const int64_t R = x.size(0), D = x.size(-1), pairs = cos.size(1);
  TORCH_CHECK(cos.size(0) == R, op, ": cos/sin have ", cos.size(0), " rows, x has ", R);
  TORCH_CHECK(2 * pairs <= D, op, ": ", pairs, " pairs do not fit head dim ", D);
  TORCH_CHECK(cos.device() == x.device() && sin.device() == x.device(), op, ": cos, sin and x must be on one device");
  const int64_t heads = R ? x.numel() / (R * D) : 0;
  const at::ScalarType out = out_type(dtype, op);
  if (x.is_cuda()) {
    at::Tensor y = x.to(at::kFloat).clone(at::MemoryFormat::Contiguous);
    at::Tensor tail = y.view({R, heads, D}).narrow(-1, D - 2 * pairs, 2 * pairs).unflatten(-1, {pairs, 2});
    at::Tensor angle = at::complex(cos, inverse ? -sin : sin).unsqueeze(1);
    at::Tensor c = at::view_as_complex(tail);
    c.mul_(angle);
    return y.to(out);
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out));
  cpu::rope(xc.const_data_ptr(), x.scalar_type() == at::kBFloat16, cos.contiguous().const_data_ptr<float>(),
            sin.contiguous().const_data_ptr<float>(), y.mutable_data_ptr(), out == at::kBFloat16, R, heads, D,
            pairs, inverse);
  return y;
}

void check_f32(const at::Tensor& t, const char* op, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == dim && t.device().is_cpu(), op, ": ", name,
              " must be a float32 CPU tensor with ", dim, " dims, got ", t.scalar_type(), " ", t.sizes(),
              " on ", t.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_weights(const at::Tensor& mix, const at::Tensor& base,
                                                          const at::Tensor& scale, int64_t n, int64_t iters,
                                                          double eps) {
  const char* op = "dsv41::hc_weights";
  check_f32(mix, op, "mix", 2);
  check_f32(base, op, "base", 1);
  check_f32(scale, op, "scale", 1);
  TORCH_CHECK(n >= 1 && iters >= 1, op, ": n and iters must be >= 1, got ", n, " and ", iters);
  TORCH_CHECK(mix.size(1) == (2 + n) * n && base.size(0) == (2 + n) * n && scale.size(0) == 3, op,
              ": mix [T, ", (2 + n) * n, "], base [", (2 + n) * n, "] and scale [3] expected, got ",
              mix.sizes(), ", ", base.sizes(), ", ", scale.sizes());
  const int64_t T = mix.size(0);
  at::Tensor pre = at::empty({T, n}, mix.options());
  at::Tensor post = at::empty({T, n}, mix.options());
  at::Tensor comb = at::empty({T, n, n}, mix.options());
  const at::Tensor mc = mix.contiguous(), bc = base.contiguous(), sc = scale.contiguous();
  cpu::hc_weights(mc.const_data_ptr<float>(), bc.const_data_ptr<float>(), sc.const_data_ptr<float>(),
                  pre.mutable_data_ptr<float>(), post.mutable_data_ptr<float>(), comb.mutable_data_ptr<float>(), T,
                  n, iters, static_cast<float>(eps));
  return {pre, post, comb};
}

at::Tensor hc_collapse(const at::Tensor& h, const at::Tensor& pre) {
  const char* op = "dsv41::hc_collapse";
  check_f32(h, op, "h", 3);
  check_f32(pre, op, "pre", 2);
  const int64_t T = h.size(0), n = h.size(1), D = h.size(2);
  TORCH_CHECK(pre.size(0) == T && pre.size(1) == n, op, ": pre must be [", T, ", ", n, "], got ", pre.sizes());
  at::Tensor x = at::empty({T, D}, h.options());
  const at::Tensor hc = h.contiguous(), pc = pre.contiguous();
  cpu::hc_collapse(hc.const_data_ptr<float>(), pc.const_data_ptr<float>(), x.mutable_data_ptr<float>(), T, n, D);
  return x;
}

at::Tensor hc_expand(const at::Tensor& h, const at::Tensor& out, const at::Tensor& post, const at::Tensor& comb) {
  const char* op = "dsv41::hc_expand";
  check_f32(h, op, "h", 3);
  check_f32(post, op, "post", 2);
  check_f32(comb, op, "comb", 3);
  const int64_t T = h.size(0), n = h.size(1), D = h.size(2);
  TORCH_CHECK((out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.dim() == 2 &&
                  out.size(0) == T && out.size(1) == D && out.device().is_cpu(),
              op, ": out must be float32 or bfloat16 [", T, ", ", D, "] on the CPU, got ", out.scalar_type(), " ",
              out.sizes());
  TORCH_CHECK(post.size(0) == T && post.size(1) == n && comb.size(0) == T && comb.size(1) == n && comb.size(2) == n,
              op, ": post [", T, ", ", n, "] and comb [", T, ", ", n, ", ", n, "] expected, got ", post.sizes(),
              " and ", comb.sizes());
  at::Tensor y = at::empty({T, n, D}, h.options());
  const at::Tensor hc = h.contiguous(), oc = out.contiguous(), pc = post.contiguous(), cc = comb.contiguous();
  cpu::hc_expand(hc.const_data_ptr<float>(), oc.const_data_ptr(), out.scalar_type() == at::kBFloat16,
                 pc.const_data_ptr<float>(), cc.const_data_ptr<float>(), y.mutable_data_ptr<float>(), T, n, D);
  return y;
}

}  // namespace
}  // namespace dsv41

TORCH_LIBRARY_FRAGMENT(dsv41, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, ScalarType? dtype=None) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse, ScalarType? dtype=None) -> Tensor");
  m.def("hc_weights(Tensor mix, Tensor base, Tensor scale, int n, int iters, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("hc_collapse(Tensor h, Tensor pre) -> Tensor");
  m.def("hc_expand(Tensor h, Tensor out, Tensor post, Tensor comb) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) {
  m.impl("rms_norm", &dsv41::rms_norm);
  m.impl("rope", &dsv41::rope);
  m.impl("hc_weights", &dsv41::hc_weights);
  m.impl("hc_collapse", &dsv41::hc_collapse);
  m.impl("hc_expand", &dsv41::hc_expand);
}

#ifdef DSV41_WITH_CUDA
TORCH_LIBRARY_IMPL(dsv41, CUDA, m) {
  m.impl("rms_norm", &dsv41::rms_norm);
  m.impl("rope", &dsv41::rope);
}
#endif
