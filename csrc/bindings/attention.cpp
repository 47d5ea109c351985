// Python face of the attention, indexer and top-k kernels: the submodule dsv41._C.kernels.
//
// These are not torch ops. The ops (schemas, argument checks, CPU reference, fake kernels)
// are defined once, in python/dsv41/ops/attention.py and ops/selection.py; their CUDA
// implementations call the functions below after python/dsv41/ops/_checks.py has checked
// dtypes, shapes and devices. So nothing here repeats the op contract: a function takes
// tensors that satisfy it, turns them into launcher parameters (include/dsv41/kernels.h) and
// launches on the current stream. What the launchers check (a plan that fits the call,
// alignment, sizes the grid can hold) comes back as a RuntimeError.
//
// attention_config(D) is here too (with or without CUDA): the compile-time tile constants
// of include/dsv41/attention/config.h, which the CPU emulators of the kernels read.
#include <torch/extension.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

#include "bindings.h"
#include "dsv41/attention/config.h"
#include "dsv41/kernels.h"

#ifdef DSV41_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

namespace dsv41 {
namespace {

template <int kD>
py::dict mma_config() {
  using C = attn::MmaTile<kD>;
  py::dict d;
#define DSV41_PUT(NAME) d[#NAME] = C::NAME
  DSV41_PUT(kHeadDim); DSV41_PUT(kRowBytes); DSV41_PUT(kQBytes); DSV41_PUT(kKBytes);
  DSV41_PUT(kFp8Chunks); DSV41_PUT(kFp8Swz); DSV41_PUT(kFp8ScaleBytes); DSV41_PUT(kFp8ScaleStride);
  DSV41_PUT(kNvfp4Chunks); DSV41_PUT(kNvfp4Swz); DSV41_PUT(kNvfp4ScaleBytes); DSV41_PUT(kNvfp4ScalePiece);
  DSV41_PUT(kNvfp4ScaleStride); DSV41_PUT(kRawFp8Values); DSV41_PUT(kRawFp8Bytes); DSV41_PUT(kRawNvfp4Codes);
  DSV41_PUT(kRawNvfp4Bytes); DSV41_PUT(kRawBytes); DSV41_PUT(kDqUnits); DSV41_PUT(kPvHeadGroups);
  DSV41_PUT(kPvDimGroups); DSV41_PUT(kODims); DSV41_PUT(kOMt); DSV41_PUT(kONt); DSV41_PUT(kOffQ);
  DSV41_PUT(kOffK); DSV41_PUT(kOffRaw0); DSV41_PUT(kOffRaw1); DSV41_PUT(kOffP); DSV41_PUT(kOffStats);
  DSV41_PUT(kOffIdx); DSV41_PUT(kOffMisc); DSV41_PUT(kSmemBytes); DSV41_PUT(kMinCtasPerSm);
#undef DSV41_PUT
  return d;
}

// Every constant of config.h a kernel's index arithmetic uses, by its C++ name.
py::dict attention_config(int head_dim) {
  py::dict d;
  switch (head_dim) {
    case 64: d = mma_config<64>(); break;
    case 128: d = mma_config<128>(); break;
    case 512: d = mma_config<512>(); break;
    default: throw py::value_error("attention_config: no tensor-core kernel for head dim " + std::to_string(head_dim));
  }
#define DSV41_PUT(NAME) d[#NAME] = attn::NAME
  DSV41_PUT(kHeadsPerCta); DSV41_PUT(kTileKeys); DSV41_PUT(kThreads); DSV41_PUT(kWarps); DSV41_PUT(kMaxKeys);
  DSV41_PUT(kPBytes); DSV41_PUT(kStatFloats); DSV41_PUT(kMiscInts); DSV41_PUT(kMinTilesPerSplit);
  DSV41_PUT(kMaxSplits); DSV41_PUT(kSRows); DSV41_PUT(kSKeys);
  if (head_dim == attn::kHeadDim) {  // the wgmma kernel's layout (D = 512 only)
    DSV41_PUT(kWgConsumerThreads); DSV41_PUT(kWgProducerThreads); DSV41_PUT(kWgThreads);
    DSV41_PUT(kWgBlockBytes); DSV41_PUT(kWgStageOff); DSV41_PUT(kWgScaleBytes); DSV41_PUT(kWgOffQ);
    DSV41_PUT(kWgOffK0); DSV41_PUT(kWgOffK1); DSV41_PUT(kWgOffP); DSV41_PUT(kWgOffScales0);
    DSV41_PUT(kWgOffStats); DSV41_PUT(kWgOffIdx); DSV41_PUT(kWgOffMisc); DSV41_PUT(kWgSmemBytes);
  }
#undef DSV41_PUT
  return d;
}

#ifdef DSV41_WITH_CUDA
[[noreturn]] void fail(const char* op, int err) {
  if (err == kInvalidValue && last_launch_error()[0]) throw std::runtime_error(std::string(op) + ": " + last_launch_error());
  throw std::runtime_error(std::string(op) + ": CUDA error: " + cudaGetErrorString(static_cast<cudaError_t>(err)));
}
void check(int err, const char* op) {
  if (err) fail(op, err);
}

void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
at::Tensor rows_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }
const uint8_t* bytes(const at::Tensor& t) { return static_cast<const uint8_t*>(t.const_data_ptr()); }

// (kernel, num_splits, workspace_floats, fallback) for up to T queries of this shape.
py::tuple attention_plan(int64_t T, int64_t H, int64_t D, int64_t W, int64_t K, int kernel, int splits, int device) {
  const int64_t lim = int64_t{1} << 30;
  if (T < 0 || H <= 0 || D <= 0 || W < 0 || K < 0 || T >= lim || H >= lim || D >= lim || W >= lim || K >= lim)
    throw py::value_error("attention_plan: sizes out of range");
  cuda::AttentionPlan plan;
  check(cuda::sparse_attention_plan(static_cast<int>(T), static_cast<int>(H), static_cast<int>(D), static_cast<int>(W),
                                    static_cast<int>(K), kernel, splits, device, &plan),
        "attention_plan");
  return py::make_tuple(plan.kernel, plan.num_splits, plan.workspace_floats, std::string(plan.fallback));
}

// The plan's decision for a described device (no GPU needed): what tests check the
// choice with. Same tuple as attention_plan.
py::tuple plan_for_device(int64_t T, int64_t H, int64_t D, int64_t W, int64_t K, int kernel, int splits, int sms,
                          int major, const std::string& wgmma_unavailable) {
  const int64_t lim = int64_t{1} << 30;
  if (T < 0 || H <= 0 || D <= 0 || W < 0 || K < 0 || T >= lim || H >= lim || D >= lim || W >= lim || K >= lim)
    throw py::value_error("plan_for_device: sizes out of range");
  static const std::string kReasons[] = {"", "wgmma needs compute capability 9.0 (sm_90a)"};
  cuda::AttentionDevice dev;
  dev.sms = sms;
  dev.major = major;
  dev.wgmma_unavailable = wgmma_unavailable.empty() ? "" : kReasons[1].c_str();
  cuda::AttentionPlan plan;
  check(cuda::plan_for_device(static_cast<int>(T), static_cast<int>(H), static_cast<int>(D), static_cast<int>(W),
                              static_cast<int>(K), kernel, splits, dev, &plan),
        "plan_for_device");
  return py::make_tuple(plan.kernel, plan.num_splits, plan.workspace_floats, std::string(plan.fallback));
}

// kernel = cuda::kAttentionAuto plans this call alone (and allocates its workspace);
// otherwise (kernel, splits, workspace) are a plan's.
std::tuple<at::Tensor, at::Tensor, std::string> sparse_attention(
    const at::Tensor& q_in, const at::Tensor& swa_values_in, const at::Tensor& swa_scales_in,
    const at::Tensor& swa_idx_in, const at::Tensor& kv_codes_in, const at::Tensor& kv_scales_in,
    const at::Tensor& kv_idx_in, const at::Tensor& sink_in, double softmax_scale,
    const std::optional<at::Tensor>& workspace_in, int kernel, int splits) {
  // bf16 q: widened to float32 once here and the output rounded to bf16 at the end (lse
  // stays float32), so the kernels keep one q/out type; the kernels round q to bf16 for the
  // tensor cores anyway, so the widening loses nothing.
  const bool bf16_io = q_in.scalar_type() == at::kBFloat16;
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  if (T >= (int64_t{1} << 31) || H >= (int64_t{1} << 31) || swa_idx_in.size(1) + kv_idx_in.size(1) >= (int64_t{1} << 30))
    throw py::value_error("sparse_attention: sizes out of range");
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = bf16_io ? q_in.to(at::kFloat).contiguous() : q_in.contiguous();
  const at::Tensor swa_values = rows_contiguous(swa_values_in), swa_scales = rows_contiguous(swa_scales_in);
  const at::Tensor kv_codes = rows_contiguous(kv_codes_in), kv_scales = rows_contiguous(kv_scales_in);
  const at::Tensor swa_idx = rows_contiguous(swa_idx_in), kv_idx = rows_contiguous(kv_idx_in);
  const at::Tensor sink = sink_in.contiguous();
  at::Tensor out = at::empty({T, H, D}, q.options());
  at::Tensor lse = at::empty({T, H}, q.options());

  attn::SparseAttentionParams p;
  p.q = q.const_data_ptr<float>();
  p.q_stride_t = H * D;
  p.q_stride_h = D;
  p.swa_values = bytes(swa_values);
  p.swa_scales = bytes(swa_scales);
  p.swa_values_stride = swa_values.stride(0);
  p.swa_scales_stride = swa_scales.stride(0);
  p.n_swa_rows = swa_values.size(0);
  p.swa_idx = swa_idx.const_data_ptr<int32_t>();
  p.swa_idx_stride = swa_idx.stride(0);
  p.W = static_cast<int>(swa_idx.size(1));
  p.kv_codes = bytes(kv_codes);
  p.kv_scales = bytes(kv_scales);
  p.kv_codes_stride = kv_codes.stride(0);
  p.kv_scales_stride = kv_scales.stride(0);
  p.n_kv_rows = kv_codes.size(0);
  p.kv_idx = kv_idx.const_data_ptr<int32_t>();
  p.kv_idx_stride = kv_idx.stride(0);
  p.K = static_cast<int>(kv_idx.size(1));
  p.sink = sink.const_data_ptr<float>();
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.D = static_cast<int>(D);
  p.out = out.data_ptr<float>();
  p.out_stride_t = H * D;
  p.out_stride_h = D;
  p.lse = lse.data_ptr<float>();
  p.lse_stride_t = H;

  at::Tensor ws = workspace_in.has_value() ? *workspace_in : at::Tensor();
  const char* planned_fallback = "";
  if (kernel == cuda::kAttentionAuto) {
    cuda::AttentionPlan plan;
    check(cuda::sparse_attention_plan(p.T, p.H, p.D, p.W, p.K, kernel, splits, q.get_device(), &plan),
          "sparse_attention");
    kernel = plan.kernel;
    splits = plan.num_splits;
    planned_fallback = plan.fallback;
    if (plan.workspace_floats > 0) ws = at::empty({plan.workspace_floats}, q.options());
  }
  const char* fallback = "";
  check(cuda::sparse_attention(p, kernel, splits, ws.defined() ? ws.data_ptr<float>() : nullptr,
                               ws.defined() ? ws.numel() : 0, current_stream(), &fallback),
        "sparse_attention");
  if (!fallback[0]) fallback = planned_fallback;
  return {bf16_io ? out.to(at::kBFloat16) : out, lse, std::string(fallback)};
}

// scores [T, N] (idx absent) or [T, C] (gathered through idx); and why the fp32 kernel ran.
std::tuple<at::Tensor, std::string> indexer_scores(const at::Tensor& q_codes_in, const at::Tensor& q_scales_in,
                                                   const at::Tensor& weights_in, const at::Tensor& k_codes_in,
                                                   const at::Tensor& k_scales_in,
                                                   const std::optional<at::Tensor>& idx_in) {
  const char* op = idx_in ? "indexer_scores_at" : "indexer_scores";
  c10::cuda::CUDAGuard guard(q_codes_in.device());
  const at::Tensor q_codes = q_codes_in.contiguous(), q_scales = q_scales_in.contiguous();
  const at::Tensor weights = weights_in.contiguous();
  const at::Tensor k_codes = rows_contiguous(k_codes_in), k_scales = rows_contiguous(k_scales_in);
  if (q_codes.size(0) >= (int64_t{1} << 31) || q_codes.size(1) >= 65536 || q_codes.size(2) >= 32768)
    throw py::value_error(std::string(op) + ": sizes out of range");
  cuda::IndexerParams p;
  p.T = static_cast<int>(q_codes.size(0));
  p.Hi = static_cast<int>(q_codes.size(1));
  p.Di = static_cast<int>(2 * q_codes.size(2));
  p.N = k_codes.size(0);
  at::Tensor idx;
  int64_t cols = p.N;
  if (idx_in) {
    idx = rows_contiguous(*idx_in);
    p.idx = idx.const_data_ptr<int32_t>();
    p.idx_stride = idx.stride(0);
    p.C = idx.size(1);
    cols = p.C;
  }
  at::Tensor scores = at::empty({p.T, cols}, weights.options());
  if (idx_in && p.N == 0) return {scores.fill_(-INFINITY), ""};  // nothing to gather: all -inf
  p.q_codes = bytes(q_codes);
  p.q_scales = bytes(q_scales);
  p.weights = weights.const_data_ptr<float>();
  p.k_codes = bytes(k_codes);
  p.k_scales = bytes(k_scales);
  p.k_codes_stride = k_codes.stride(0);
  p.k_scales_stride = k_scales.stride(0);
  p.scores = scores.data_ptr<float>();
  p.scores_stride = cols;
  const char* fallback = "";
  check(cuda::indexer_scores(p, current_stream(), &fallback), op);
  return {scores, std::string(fallback)};
}

// The k best of each row's visible scores (block = 1), or the n_blocks best blocks of
// `block` positions expanded to positions (candidate_blocks).
at::Tensor topk(const at::Tensor& scores_in, const at::Tensor& visible_in, int64_t k, int64_t block) {
  const char* op = block == 1 ? "topk_visible" : "candidate_blocks";
  if (k < 0 || block < 1 || k * block >= (int64_t{1} << 31)) throw py::value_error(std::string(op) + ": k or block out of range");
  c10::cuda::CUDAGuard guard(scores_in.device());
  const at::Tensor scores = rows_contiguous(scores_in);
  // Positions < 2^31 (the kernel clamps to [0, N]); int64 inputs are clamped there too.
  const at::Tensor visible = visible_in.scalar_type() == at::kInt
                                 ? visible_in.contiguous()
                                 : visible_in.clamp(-1, scores.size(1)).to(at::kInt).contiguous();
  const int64_t T = scores.size(0);
  if (T >= (int64_t{1} << 31)) throw py::value_error(std::string(op) + ": too many rows");
  at::Tensor out = at::empty({T, k * block}, scores.options().dtype(at::kInt));
  cuda::TopkParams p;
  p.scores = scores.const_data_ptr<float>();
  p.scores_stride = scores.stride(0);
  p.N = scores.size(1);
  p.visible = visible.const_data_ptr<int32_t>();
  p.T = static_cast<int>(T);
  p.k = static_cast<int>(k);
  p.block = static_cast<int>(block);
  p.out = out.data_ptr<int32_t>();
  p.out_stride = k * block;
  check(cuda::topk(p, current_stream()), op);
  return out;
}
#endif  // DSV41_WITH_CUDA

}  // namespace

void bind_kernels(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "kernels", "dsv41's attention, indexer and top-k kernels (called by the ops in dsv41.ops after their checks)");
  m.def("attention_config", &attention_config, py::arg("head_dim"));
  m.attr("AUTO") = static_cast<int>(cuda::kAttentionAuto);
  m.attr("GENERIC") = static_cast<int>(cuda::kAttentionGeneric);
  m.attr("MMA") = static_cast<int>(cuda::kAttentionMma);
  m.attr("WGMMA") = static_cast<int>(cuda::kAttentionWgmma);
#ifdef DSV41_WITH_CUDA
  m.def("attention_plan", &attention_plan, py::arg("num_queries"), py::arg("num_heads"), py::arg("head_dim"),
        py::arg("swa_width"), py::arg("topk"), py::arg("kernel"), py::arg("splits"), py::arg("device"));
  m.def("plan_for_device", &plan_for_device, py::arg("num_queries"), py::arg("num_heads"), py::arg("head_dim"),
        py::arg("swa_width"), py::arg("topk"), py::arg("kernel"), py::arg("splits"), py::arg("sms"),
        py::arg("major"), py::arg("wgmma_unavailable") = "");
  m.def("sparse_attention", &sparse_attention);
  m.def("indexer_scores", &indexer_scores);
  m.def("topk", &topk);
#endif
}

}  // namespace dsv41
