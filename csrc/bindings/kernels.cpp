// Torch bindings of the hot-path kernels (include/dsv41/kernels.h).
//
// * The attention and indexer ops (sparse_attention, indexer_scores, indexer_scores_at,
//   topk_visible, candidate_blocks) are defined by the model in Python
//   (python/dsv41/ops/attention.py, torch.library.custom_op, whose default implementation
//   is the float64 torch reference). Here they only get CUDA kernels: a backend kernel
//   registered for the CUDA key takes precedence over the custom op's default for CUDA
//   tensors, whether it is registered before or after the Python definition. The Python
//   argument checks do not run on that path, so every wrapper below checks its inputs.
// * The cache ops (copy_blocks, quantize_*_scatter) and the decoder self-check
//   (_dequant_tricks) are defined here, with CPU and CUDA kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "dsv41/kernels.h"

#ifdef DSV41_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace dsv41 {
namespace {

bool is_ue8m0(c10::ScalarType t) { return t == at::kByte || t == at::kFloat8_e8m0fnu; }

// Last dim contiguous (a copy only if it is not).
at::Tensor rows_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  return (end && *end == '\0') ? x : fallback;
}

const uint8_t* bytes(const at::Tensor& t) { return static_cast<const uint8_t*>(t.const_data_ptr()); }
uint8_t* mbytes(at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

#ifdef DSV41_WITH_CUDA
void check_launch(int err, const char* op) {
  if (err == 0) return;
  if (err == kInvalidValue && last_launch_error()[0]) TORCH_CHECK(false, op, ": ", last_launch_error());
  TORCH_CHECK(false, op, ": CUDA error: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// ---- sparse_attention --------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> sparse_attention_cuda(
    const at::Tensor& q_in, const at::Tensor& swa_values_in, const at::Tensor& swa_scales_in,
    const at::Tensor& swa_idx_in, const at::Tensor& kv_codes_in, const at::Tensor& kv_scales_in,
    const at::Tensor& kv_idx_in, const at::Tensor& sink_in, double softmax_scale) {
  const char* op = "sparse_attention";
  TORCH_CHECK(q_in.dim() == 3 && (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16), op,
              ": q must be float32 or bfloat16 [T,H,D], got ", q_in.scalar_type(), " ", q_in.sizes());
  // bf16 q: widened to float32 once here and the output rounded to bf16 at the end (lse
  // stays float32), so the kernels keep one q/out type; the kernels round q to bf16 for the
  // tensor cores anyway, so the widening loses nothing. Reading bf16 q and writing bf16 out
  // inside the kernels would save these two small passes (docs/kernels.md).
  const bool bf16_io = q_in.scalar_type() == at::kBFloat16;
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2);
  TORCH_CHECK(D % 32 == 0, op, ": head dim ", D, " must be a multiple of 32");
  TORCH_CHECK(swa_values_in.dim() == 2 && swa_values_in.scalar_type() == at::kFloat8_e4m3fn &&
                  swa_values_in.size(1) == D,
              op, ": swa_values must be float8_e4m3fn [Ns,", D, "], got ", swa_values_in.scalar_type(), " ",
              swa_values_in.sizes());
  TORCH_CHECK(swa_scales_in.dim() == 2 && is_ue8m0(swa_scales_in.scalar_type()) &&
                  swa_scales_in.size(0) == swa_values_in.size(0) && swa_scales_in.size(1) == D / 32,
              op, ": swa_scales must be UE8M0 (uint8) [Ns,", D / 32, "], got ", swa_scales_in.sizes());
  TORCH_CHECK(kv_codes_in.dim() == 2 && kv_codes_in.scalar_type() == at::kByte && kv_codes_in.size(1) == D / 2,
              op, ": kv_codes must be uint8 [Ng,", D / 2, "], got ", kv_codes_in.sizes());
  TORCH_CHECK(kv_scales_in.dim() == 2 && kv_scales_in.scalar_type() == at::kFloat8_e4m3fn &&
                  kv_scales_in.size(0) == kv_codes_in.size(0) && kv_scales_in.size(1) == D / 16,
              op, ": kv_scales must be float8_e4m3fn [Ng,", D / 16, "], got ", kv_scales_in.sizes());
  TORCH_CHECK(swa_idx_in.dim() == 2 && swa_idx_in.scalar_type() == at::kInt && swa_idx_in.size(0) == T, op,
              ": swa_idx must be int32 [T,W], got ", swa_idx_in.scalar_type(), " ", swa_idx_in.sizes());
  TORCH_CHECK(kv_idx_in.dim() == 2 && kv_idx_in.scalar_type() == at::kInt && kv_idx_in.size(0) == T, op,
              ": kv_idx must be int32 [T,K], got ", kv_idx_in.scalar_type(), " ", kv_idx_in.sizes());
  TORCH_CHECK(sink_in.dim() == 1 && sink_in.scalar_type() == at::kFloat && sink_in.size(0) == H, op,
              ": sink must be float32 [", H, "]");
  for (const at::Tensor* t : {&swa_values_in, &swa_scales_in, &swa_idx_in, &kv_codes_in, &kv_scales_in, &kv_idx_in, &sink_in})
    TORCH_CHECK(t->device() == q_in.device(), op, ": all tensors must be on ", q_in.device(), ", found one on ",
                t->device());
  TORCH_CHECK(swa_idx_in.size(1) + kv_idx_in.size(1) < (int64_t{1} << 30), op, ": too many keys per query");

  c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor q = bf16_io ? q_in.to(at::kFloat).contiguous() : q_in.contiguous();
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
  TORCH_CHECK(T < (int64_t{1} << 31) && H < (int64_t{1} << 31), op, ": T or H too large");
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  p.D = static_cast<int>(D);
  p.out = out.data_ptr<float>();
  p.out_stride_t = H * D;
  p.out_stride_h = D;
  p.lse = lse.data_ptr<float>();
  p.lse_stride_t = H;

  // Knobs (no code change needed to use the kernels; these are for tests and tuning):
  // DSV41_ATTENTION_SPLITS=n fixes the key splits (0 = automatic; 1 makes every query's
  // bits independent of the batch size), DSV41_ATTENTION_IMPL=generic picks the fp32 kernel,
  // =wgmma the wgmma kernel (sm_90a; not yet the default: docs/kernels.md), =mma or unset the
  // mma.sync kernel where it applies.
  const int splits = static_cast<int>(env_int("DSV41_ATTENTION_SPLITS", 0));
  const char* impl = std::getenv("DSV41_ATTENTION_IMPL");
  const std::string impl_name = impl ? impl : "";
  TORCH_CHECK(impl_name.empty() || impl_name == "mma" || impl_name == "generic" || impl_name == "wgmma", op,
              ": DSV41_ATTENTION_IMPL must be mma, wgmma or generic (or unset), got '", impl_name, "'");
  const int which = impl_name == "generic" ? cuda::kAttentionGeneric
                    : impl_name == "wgmma" ? cuda::kAttentionWgmma : cuda::kAttentionAuto;
  cuda::AttentionPlan plan;
  check_launch(cuda::sparse_attention_plan(p, splits, which, q.get_device(), &plan), op);
  at::Tensor ws;
  if (plan.workspace_floats > 0) ws = at::empty({plan.workspace_floats}, q.options());
  check_launch(cuda::sparse_attention(p, plan, ws.defined() ? ws.data_ptr<float>() : nullptr, current_stream()), op);
  if (bf16_io) return {out.to(at::kBFloat16), lse};
  return {out, lse};
}

// ---- indexer -------------------------------------------------------------------------------

cuda::IndexerParams indexer_params(const char* op, const at::Tensor& q_codes, const at::Tensor& q_scales,
                                   const at::Tensor& weights, const at::Tensor& k_codes,
                                   const at::Tensor& k_scales) {
  TORCH_CHECK(q_codes.dim() == 3 && q_codes.scalar_type() == at::kByte, op, ": q_codes must be uint8 [T,Hi,Di/2]");
  const int64_t T = q_codes.size(0), Hi = q_codes.size(1), Di = 2 * q_codes.size(2);
  TORCH_CHECK(Di % 32 == 0, op, ": Di=", Di, " must be a multiple of 32");
  TORCH_CHECK(q_scales.dim() == 3 && is_ue8m0(q_scales.scalar_type()) && q_scales.size(0) == T &&
                  q_scales.size(1) == Hi && q_scales.size(2) == Di / 32,
              op, ": q_scales must be UE8M0 [", T, ",", Hi, ",", Di / 32, "], got ", q_scales.sizes());
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kFloat && weights.size(0) == T && weights.size(1) == Hi,
              op, ": weights must be float32 [", T, ",", Hi, "]");
  TORCH_CHECK(k_codes.dim() == 2 && k_codes.scalar_type() == at::kByte && k_codes.size(1) == Di / 2, op,
              ": k_codes must be uint8 [N,", Di / 2, "]");
  TORCH_CHECK(k_scales.dim() == 2 && is_ue8m0(k_scales.scalar_type()) && k_scales.size(0) == k_codes.size(0) &&
                  k_scales.size(1) == Di / 32,
              op, ": k_scales must be UE8M0 [N,", Di / 32, "]");
  for (const at::Tensor* t : {&q_scales, &weights, &k_codes, &k_scales})
    TORCH_CHECK(t->device() == q_codes.device(), op, ": all tensors must be on ", q_codes.device());
  TORCH_CHECK(T < (int64_t{1} << 31) && Hi < 65536 && Di < 65536, op, ": sizes too large");
  cuda::IndexerParams p;
  p.T = static_cast<int>(T);
  p.Hi = static_cast<int>(Hi);
  p.Di = static_cast<int>(Di);
  p.N = k_codes.size(0);
  return p;
}

at::Tensor indexer_scores_impl(const char* op, const at::Tensor& q_codes_in, const at::Tensor& q_scales_in,
                               const at::Tensor& weights_in, const at::Tensor& k_codes_in,
                               const at::Tensor& k_scales_in, const at::Tensor* idx_in) {
  cuda::IndexerParams p = indexer_params(op, q_codes_in, q_scales_in, weights_in, k_codes_in, k_scales_in);
  c10::cuda::CUDAGuard guard(q_codes_in.device());
  const at::Tensor q_codes = q_codes_in.contiguous(), q_scales = q_scales_in.contiguous();
  const at::Tensor weights = weights_in.contiguous();
  const at::Tensor k_codes = rows_contiguous(k_codes_in), k_scales = rows_contiguous(k_scales_in);
  at::Tensor idx;
  int64_t cols = p.N;
  if (idx_in) {
    TORCH_CHECK(idx_in->dim() == 2 && idx_in->scalar_type() == at::kInt && idx_in->size(0) == p.T, op,
                ": idx must be int32 [T,C]");
    TORCH_CHECK(idx_in->device() == q_codes_in.device(), op, ": idx must be on ", q_codes_in.device());
    idx = rows_contiguous(*idx_in);
    p.idx = idx.const_data_ptr<int32_t>();
    p.idx_stride = idx.stride(0);
    p.C = idx.size(1);
    cols = p.C;
  }
  at::Tensor scores = at::empty({p.T, cols}, weights.options());
  if (idx_in && p.N == 0) return scores.fill_(-INFINITY);  // nothing to gather: all -inf
  p.q_codes = bytes(q_codes);
  p.q_scales = bytes(q_scales);
  p.weights = weights.const_data_ptr<float>();
  p.k_codes = bytes(k_codes);
  p.k_scales = bytes(k_scales);
  p.k_codes_stride = k_codes.stride(0);
  p.k_scales_stride = k_scales.stride(0);
  p.scores = scores.data_ptr<float>();
  p.scores_stride = cols;
  check_launch(cuda::indexer_scores(p, current_stream()), op);
  return scores;
}

at::Tensor indexer_scores_cuda(const at::Tensor& q_codes, const at::Tensor& q_scales, const at::Tensor& weights,
                               const at::Tensor& k_codes, const at::Tensor& k_scales) {
  return indexer_scores_impl("indexer_scores", q_codes, q_scales, weights, k_codes, k_scales, nullptr);
}

at::Tensor indexer_scores_at_cuda(const at::Tensor& q_codes, const at::Tensor& q_scales, const at::Tensor& weights,
                                  const at::Tensor& k_codes, const at::Tensor& k_scales, const at::Tensor& idx) {
  return indexer_scores_impl("indexer_scores_at", q_codes, q_scales, weights, k_codes, k_scales, &idx);
}

// ---- top-k ---------------------------------------------------------------------------------

at::Tensor topk_impl(const char* op, const at::Tensor& scores_in, const at::Tensor& visible_in, int64_t k,
                     int64_t block) {
  TORCH_CHECK(scores_in.dim() == 2 && scores_in.scalar_type() == at::kFloat, op, ": scores must be float32 [T,N]");
  TORCH_CHECK(visible_in.dim() == 1 && (visible_in.scalar_type() == at::kInt || visible_in.scalar_type() == at::kLong) &&
                  visible_in.size(0) == scores_in.size(0),
              op, ": visible must be int32/int64 [T]");
  TORCH_CHECK(visible_in.device() == scores_in.device(), op, ": visible must be on ", scores_in.device());
  TORCH_CHECK(k >= 0 && k < (int64_t{1} << 31), op, ": k must be in [0, 2^31), got ", k);
  TORCH_CHECK(block >= 1 && k * block < (int64_t{1} << 31), op, ": bad block size ", block);
  c10::cuda::CUDAGuard guard(scores_in.device());
  const at::Tensor scores = rows_contiguous(scores_in);
  // Positions < 2^31 (the kernel clamps to [0, N]); int64 inputs are clamped there too.
  const at::Tensor visible = visible_in.scalar_type() == at::kInt
                                 ? visible_in.contiguous()
                                 : visible_in.clamp(-1, scores.size(1)).to(at::kInt).contiguous();
  const int64_t T = scores.size(0);
  at::Tensor out = at::empty({T, k * block}, scores.options().dtype(at::kInt));
  cuda::TopkParams p;
  p.scores = scores.const_data_ptr<float>();
  p.scores_stride = scores.stride(0);
  p.N = scores.size(1);
  p.visible = visible.const_data_ptr<int32_t>();
  TORCH_CHECK(T < (int64_t{1} << 31), op, ": too many rows");
  p.T = static_cast<int>(T);
  p.k = static_cast<int>(k);
  p.block = static_cast<int>(block);
  p.out = out.data_ptr<int32_t>();
  p.out_stride = k * block;
  check_launch(cuda::topk(p, current_stream()), op);
  return out;
}

at::Tensor topk_visible_cuda(const at::Tensor& scores, const at::Tensor& visible, int64_t k) {
  return topk_impl("topk_visible", scores, visible, k, 1);
}

at::Tensor candidate_blocks_cuda(const at::Tensor& scores, const at::Tensor& visible, int64_t block,
                                 int64_t n_blocks) {
  TORCH_CHECK(block > 0, "candidate_blocks: block must be positive, got ", block);
  TORCH_CHECK(n_blocks >= 0, "candidate_blocks: n_blocks must be >= 0, got ", n_blocks);
  return topk_impl("candidate_blocks", scores, visible, n_blocks, block);
}
#endif  // DSV41_WITH_CUDA

// ---- cache ops (CPU and CUDA) ---------------------------------------------------------------

struct FormatInfo {
  KvFormat f;
  const char* name;
  int block;
  int values_per_code;
  c10::ScalarType code_type;
  bool scale_ue8m0;  // else E4M3 (float8_e4m3fn)
};
constexpr FormatInfo kNvfp4{KvFormat::kNvfp4, "nvfp4", 16, 2, at::kByte, false};
constexpr FormatInfo kMxfp4{KvFormat::kMxfp4, "mxfp4", 32, 2, at::kByte, true};
constexpr FormatInfo kFp8Swa{KvFormat::kFp8Swa, "fp8_swa", 32, 1, at::kFloat8_e4m3fn, true};

at::Tensor index_as_long(const at::Tensor& idx, const c10::Device& device, const char* op, const char* name) {
  TORCH_CHECK(idx.dim() == 1 && (idx.scalar_type() == at::kLong || idx.scalar_type() == at::kInt), op, ": ", name,
              " must be a 1-D int64/int32 tensor");
  return idx.to(device, at::kLong).contiguous();
}

// Range check of indices that live on the CPU (device indices are checked by the kernels,
// which skip out-of-range entries rather than read or write out of bounds).
void check_range(const at::Tensor& idx, int64_t lo, int64_t hi, const char* op, const char* name) {
  if (!idx.is_cpu() || idx.numel() == 0) return;
  const at::Tensor l = idx.to(at::kLong);
  const int64_t* v = l.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < l.numel(); ++i)
    TORCH_CHECK(v[i] >= lo && v[i] < hi, op, ": ", name, "[", i, "] = ", v[i], " is outside [", lo, ", ", hi, ")");
}

void quantize_scatter(const FormatInfo& fi, const at::Tensor& x_in, at::Tensor codes, at::Tensor scales,
                      const at::Tensor& rows_in) {
  std::string opname = std::string("quantize_") + fi.name + "_scatter";
  const char* op = opname.c_str();
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, op, ": x must be float32 [..., D]");
  const int64_t D = x_in.size(-1);
  TORCH_CHECK(D % fi.block == 0, op, ": D=", D, " must be a multiple of ", fi.block);
  const int64_t n = D ? x_in.numel() / D : 0;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == fi.code_type && codes.size(1) == D / fi.values_per_code, op,
              ": codes must be ", fi.code_type, " [rows,", D / fi.values_per_code, "], got ", codes.scalar_type(), " ",
              codes.sizes());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == codes.size(0) && scales.size(1) == D / fi.block &&
                  (fi.scale_ue8m0 ? is_ue8m0(scales.scalar_type()) : scales.scalar_type() == at::kFloat8_e4m3fn),
              op, ": scales must be ", (fi.scale_ue8m0 ? "UE8M0 (uint8)" : "float8_e4m3fn"), " [rows,", D / fi.block,
              "], got ", scales.sizes());
  TORCH_CHECK(codes.stride(1) == 1 && scales.stride(1) == 1, op, ": codes and scales rows must be contiguous");
  TORCH_CHECK(codes.device() == x_in.device() && scales.device() == x_in.device(), op,
              ": x, codes and scales must be on one device");
  TORCH_CHECK(rows_in.dim() == 1 && rows_in.size(0) == n, op, ": rows must be [", n, "] (one per row of x)");
  check_range(rows_in, -1, codes.size(0), op, "rows");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor rows = index_as_long(rows_in, x.device(), op, "rows");
  if (n == 0) return;
  if (x.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor xa = reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 ? x.clone() : x;
    // Rows out of [0, pool) are skipped by the kernel: pass the pool size through -1 rows.
    at::Tensor r = rows.clone();
    r.masked_fill_(r.ge(codes.size(0)), -1);
    check_launch(cuda::quantize_scatter(fi.f, xa.const_data_ptr<float>(), n, D, r.const_data_ptr<int64_t>(),
                                        mbytes(codes), codes.stride(0), mbytes(scales), scales.stride(0),
                                        current_stream()),
                 op);
    return;
#else
    TORCH_CHECK(false, op, ": dsv41 was built without CUDA");
#endif
  }
  cpu::quantize_scatter(fi.f, x.const_data_ptr<float>(), n, D, rows.const_data_ptr<int64_t>(), mbytes(codes),
                        codes.stride(0), mbytes(scales), scales.stride(0));
}

#define DSV41_SCATTER_OP(NAME, INFO)                                                                   \
  void quantize_##NAME##_scatter(const at::Tensor& x, at::Tensor codes, at::Tensor scales,          \
                                 const at::Tensor& rows) {                                           \
    quantize_scatter(INFO, x, codes, scales, rows);                                                  \
  }
DSV41_SCATTER_OP(nvfp4, kNvfp4)
DSV41_SCATTER_OP(mxfp4, kMxfp4)
DSV41_SCATTER_OP(fp8_swa, kFp8Swa)
#undef DSV41_SCATTER_OP

// engine: "kernel" (one SM kernel for all pairs), "copy_engine" (cudaMemcpyBatchAsync of
// the merged runs; needs CPU indices) or "auto" (the copy engines for blocks of 1 MiB and
// more when the indices are on the CPU, the kernel otherwise). Which is faster for which
// block size has not been measured yet: bench/bench_copy.py times both.
void copy_blocks(const at::Tensor& src, const at::Tensor& src_idx_in, at::Tensor dst, const at::Tensor& dst_idx_in,
                 c10::string_view engine_in) {
  const char* op = "copy_blocks";
  const std::string engine(engine_in.data(), engine_in.size());
  TORCH_CHECK(engine == "auto" || engine == "kernel" || engine == "copy_engine", op,
              ": engine must be 'auto', 'kernel' or 'copy_engine', got '", engine, "'");
  TORCH_CHECK(src.dim() == 2 && dst.dim() == 2, op, ": src and dst must be 2-D pools [n_blocks, block]");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), op, ": src and dst dtypes differ");
  TORCH_CHECK(src.size(1) == dst.size(1), op, ": block sizes differ (", src.size(1), " vs ", dst.size(1), ")");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), op, ": pools must be contiguous");
  TORCH_CHECK(src_idx_in.dim() == 1 && dst_idx_in.dim() == 1 && src_idx_in.size(0) == dst_idx_in.size(0), op,
              ": src_idx and dst_idx must be 1-D of one length");
  check_range(src_idx_in, 0, src.size(0), op, "src_idx");
  check_range(dst_idx_in, 0, dst.size(0), op, "dst_idx");
  const int64_t n = src_idx_in.size(0), block_bytes = src.size(1) * src.element_size();
  if (src.is_cpu() && dst.is_cpu()) {
    const at::Tensor si = index_as_long(src_idx_in, src.device(), op, "src_idx");
    const at::Tensor di = index_as_long(dst_idx_in, src.device(), op, "dst_idx");
    cpu::copy_blocks(bytes(src), si.const_data_ptr<int64_t>(), mbytes(dst), di.const_data_ptr<int64_t>(), n,
                     block_bytes);
    return;
  }
#ifdef DSV41_WITH_CUDA
  const at::Tensor& gpu = src.is_cuda() ? src : dst;
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&src, &dst})
    TORCH_CHECK(t->is_cuda() ? t->device() == gpu.device() : t->is_pinned(), op,
                ": each pool must be on ", gpu.device(), " or in pinned host memory (pin_memory())");
  c10::cuda::CUDAGuard guard(gpu.device());
  const bool host_idx = src_idx_in.is_cpu() && dst_idx_in.is_cpu();
  TORCH_CHECK(engine != "copy_engine" || host_idx, op, ": engine='copy_engine' needs the indices on the CPU");
  if (engine == "copy_engine" || (engine == "auto" && host_idx && block_bytes >= (int64_t{1} << 20))) {
    const at::Tensor si = index_as_long(src_idx_in, src_idx_in.device(), op, "src_idx");
    const at::Tensor di = index_as_long(dst_idx_in, dst_idx_in.device(), op, "dst_idx");
    check_launch(cuda::copy_blocks_engine(bytes(src), si.const_data_ptr<int64_t>(), mbytes(dst),
                                          di.const_data_ptr<int64_t>(), n, block_bytes, current_stream()),
                 op);
    return;
  }
  at::Tensor si = index_as_long(src_idx_in, gpu.device(), op, "src_idx");
  at::Tensor di = index_as_long(dst_idx_in, gpu.device(), op, "dst_idx");
  if (!src_idx_in.is_cpu() || !dst_idx_in.is_cpu()) {
    // Device indices were not range-checked: turn out-of-range pairs into no-ops.
    const at::Tensor bad = si.lt(0).logical_or(si.ge(src.size(0))).logical_or(di.lt(0)).logical_or(di.ge(dst.size(0)));
    si = si.masked_fill(bad, -1);
    di = di.masked_fill(bad, -1);
  }
  if (n == 0 || block_bytes == 0) return;
  check_launch(cuda::copy_blocks(bytes(src), si.const_data_ptr<int64_t>(), mbytes(dst), di.const_data_ptr<int64_t>(),
                                 n, block_bytes, current_stream()),
               op);
#else
  TORCH_CHECK(false, op, ": dsv41 was built without CUDA");
#endif
}

at::Tensor dequant_tricks(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t fmt) {
  const char* op = "_dequant_tricks";
  TORCH_CHECK(fmt >= 0 && fmt <= 2, op, ": fmt must be 0 (nvfp4), 1 (mxfp4) or 2 (fp8_swa)");
  const FormatInfo& fi = fmt == 0 ? kNvfp4 : fmt == 1 ? kMxfp4 : kFp8Swa;
  TORCH_CHECK(codes_in.dim() == 2 && scales_in.dim() == 2 && codes_in.size(0) == scales_in.size(0), op,
              ": codes and scales must be 2-D with one row per vector");
  TORCH_CHECK(codes_in.element_size() == 1 && scales_in.element_size() == 1, op, ": byte tensors expected");
  const int64_t D = codes_in.size(1) * fi.values_per_code;
  TORCH_CHECK(D % 32 == 0 && scales_in.size(1) * fi.block == D, op, ": shapes do not match format ", fi.name);
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  at::Tensor y = at::empty({codes.size(0), D}, codes.options().dtype(at::kFloat));
  if (codes.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    c10::cuda::CUDAGuard guard(codes.device());
    check_launch(cuda::dequant_tricks(fi.f, bytes(codes), bytes(scales), codes.size(0), D, y.data_ptr<float>(),
                                      current_stream()),
                 op);
    return y;
#else
    TORCH_CHECK(false, op, ": dsv41 was built without CUDA");
#endif
  }
  cpu::dequant_tricks(fi.f, bytes(codes), bytes(scales), codes.size(0), D, y.data_ptr<float>());
  return y;
}

}  // namespace
}  // namespace dsv41

TORCH_LIBRARY_FRAGMENT(dsv41, m) {
  m.def("copy_blocks(Tensor src, Tensor src_idx, Tensor(a!) dst, Tensor dst_idx, str engine=\"auto\") -> ()");
  m.def("quantize_nvfp4_scatter(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor rows) -> ()");
  m.def("quantize_mxfp4_scatter(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor rows) -> ()");
  m.def("quantize_fp8_swa_scatter(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor rows) -> ()");
  m.def("_dequant_tricks(Tensor codes, Tensor scales, int fmt) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) {
  m.impl("copy_blocks", &dsv41::copy_blocks);
  m.impl("quantize_nvfp4_scatter", &dsv41::quantize_nvfp4_scatter);
  m.impl("quantize_mxfp4_scatter", &dsv41::quantize_mxfp4_scatter);
  m.impl("quantize_fp8_swa_scatter", &dsv41::quantize_fp8_swa_scatter);
  m.impl("_dequant_tricks", &dsv41::dequant_tricks);
}

#ifdef DSV41_WITH_CUDA
TORCH_LIBRARY_IMPL(dsv41, CUDA, m) {
  m.impl("copy_blocks", &dsv41::copy_blocks);
  m.impl("quantize_nvfp4_scatter", &dsv41::quantize_nvfp4_scatter);
  m.impl("quantize_mxfp4_scatter", &dsv41::quantize_mxfp4_scatter);
  m.impl("quantize_fp8_swa_scatter", &dsv41::quantize_fp8_swa_scatter);
  m.impl("_dequant_tricks", &dsv41::dequant_tricks);
  // The model's ops (schemas defined in python/dsv41/ops/attention.py).
  m.impl("sparse_attention", &dsv41::sparse_attention_cuda);
  m.impl("indexer_scores", &dsv41::indexer_scores_cuda);
  m.impl("indexer_scores_at", &dsv41::indexer_scores_at_cuda);
  m.impl("topk_visible", &dsv41::topk_visible_cuda);
  m.impl("candidate_blocks", &dsv41::candidate_blocks_cuda);
}
#endif
