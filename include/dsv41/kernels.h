// Launchers of the hot-path kernels (attention, indexer, top-k, cache writes and copies).
//
// Framework-free and free of CUDA headers, so the torch binding layer (and anything else)
// can include it. Every CUDA launcher enqueues on the given stream (a cudaStream_t passed
// as void*) and returns a cudaError_t value as int: 0 on success; kInvalidValue
// (= cudaErrorInvalidValue) when a host-side check fails, with the reason readable through
// last_launch_error() on the same thread. The CPU functions in namespace cpu are the
// reference loops for the ops that also run on the CPU (copies, scatter-quantize, the
// decoder self-check); the attention/indexer/top-k CPU paths are the Python references.
#pragma once

#include <cstdint>

#include "dsv41/attention/params.h"

namespace dsv41 {

constexpr int kInvalidValue = 1;  // == cudaErrorInvalidValue (checked in csrc/cuda)

// Why the last launcher on this thread returned kInvalidValue ("" if it did not).
const char* last_launch_error();
// Records a printf-style reason and returns kInvalidValue (for the launchers).
int launch_fail(const char* fmt, ...);
void clear_launch_error();

// Formats of the scatter-quantize and decoder-check entry points.
enum class KvFormat : int { kNvfp4 = 0, kMxfp4 = 1, kFp8Swa = 2 };

namespace cpu {
// dst[dst_idx[i]] = src[src_idx[i]] for n block pairs of block_bytes each (plain memcpy).
// Indices must be in range (the binding checks).
void copy_blocks(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx,
                 int64_t n, int64_t block_bytes);

// Quantizes row i of x [n, D] into row rows[i] of the pool (codes and scales rows of
// code_stride / scale_stride bytes); rows[i] < 0 skips the row. Same bits as quantize_*.
void quantize_scatter(KvFormat f, const float* x, int64_t n, int64_t D, const int64_t* rows,
                      uint8_t* codes, int64_t code_stride, uint8_t* scales, int64_t scale_stride);

// Decoder self-check: decodes n rows of D values with the fast bf16 decoders of
// dsv41/dequant.h (bit tricks, permuted pairs, folded scale) and writes them back as
// float32 in natural order with the folded constant removed. Must equal dequantize_*.
void dequant_tricks(KvFormat f, const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t D,
                    float* y);
}  // namespace cpu

namespace cuda {

// ---- Sparse attention ------------------------------------------------------------------
// Kernels: kAttentionGeneric = fp32, any H, D % 32 == 0 up to 1024; kAttentionMma = mma.sync
// (sm_80+, D in {64, 128, 512}, any H, W + K <= 4096, 16-byte aligned pool rows);
// kAttentionWgmma = wgmma (sm_90a machine code, D = 512, H % 64 == 0, same key and
// alignment limits). kAttentionAuto asks the plan to choose.
enum AttentionKernel : int { kAttentionAuto = 0, kAttentionGeneric = 1, kAttentionMma = 2, kAttentionWgmma = 3 };

// What a caller keeps for a batch shape (one per CUDA-graph bucket, say): decided once by
// sparse_attention_plan, then passed to every sparse_attention call of that shape. Running
// with a plan queries no device attribute, allocates nothing (the caller owns the
// workspace) and never synchronizes, so it can be captured in a CUDA graph.
struct AttentionPlan {
  int max_queries = 0, H = 0, D = 0;  // the shape planned for: calls take T <= max_queries
  int kernel = kAttentionGeneric;     // never kAttentionAuto
  int num_splits = 1;                 // key splits per query (1: no combine step)
  int64_t workspace_floats = 0;       // partial O and lse of max_queries queries when num_splits > 1
  // Why the plan runs the generic kernel although a tensor-core kernel was wanted ("" when
  // it does not, or when the generic kernel was asked for): a static string.
  const char* fallback = "";
};

// What a plan needs to know of a device: SM count, compute capability major, and why the
// wgmma kernel cannot run there ("" if it can; a static string).
struct AttentionDevice {
  int sms = 0, major = 0;
  const char* wgmma_unavailable = "";
};

// The plan's decision alone, for a described device (pure host code: no CUDA call, so it
// is tested without a GPU). sparse_attention_plan = the device's facts + this + setting the
// chosen kernel's shared-memory attributes.
int plan_for_device(int max_queries, int H, int D, int W, int K, int requested_kernel, int requested_splits,
                    const AttentionDevice& dev, AttentionPlan* plan);

// Chooses the kernel and split count for up to max_queries queries of H heads of dim D,
// with at most W SWA and K global keys each. requested_kernel: an AttentionKernel (a named
// tensor-core kernel that cannot take the shape is an error, never a fallback);
// requested_splits: 0 = automatic (split the keys when the queries alone cannot fill the
// GPU), n > 0 = exactly n (clamped to the tile count). Auto picks, from the first GPU
// run's numbers (docs/kernels.md): wgmma where it applies and the batch has two CTAs or
// more, mma.sync for the other tensor-core shapes, the generic kernel for the rest (with
// `fallback` saying why). Sets the kernels' shared-memory attributes on `device`.
int sparse_attention_plan(int max_queries, int H, int D, int W, int K, int requested_kernel, int requested_splits,
                          int device, AttentionPlan* plan);
// Runs p with a plan's kernel and split count on the current device (T at most the
// planned max_queries: the workspace must hold workspace_floats >= T x splits x H x (D + 1)
// floats when num_splits > 1; it may be null otherwise). What only the tensors tell (row
// alignment, W + K) is checked here: when the planned tensor-core kernel cannot take them
// the generic kernel runs instead, and *fallback (if not null) says why ("" otherwise). A
// tensor-core kernel on a shape it has no code for is an error.
int sparse_attention(const attn::SparseAttentionParams& p, int kernel, int num_splits, float* workspace,
                     int64_t workspace_floats, void* stream, const char** fallback);

// ---- Indexer scores ----------------------------------------------------------------------
// scores[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) for j < N, MXFP4 q and k.
// q_codes [T, Hi, Di/2], q_scales [T, Hi, Di/32], weights [T, Hi] f32 (all contiguous);
// k_codes [N, Di/2], k_scales [N, Di/32] (rows contiguous, strides in bytes);
// scores [T, N] f32 with row stride scores_stride (elements).
struct IndexerParams {
  const uint8_t* q_codes = nullptr;
  const uint8_t* q_scales = nullptr;
  const float* weights = nullptr;
  const uint8_t* k_codes = nullptr;
  const uint8_t* k_scales = nullptr;
  int64_t k_codes_stride = 0, k_scales_stride = 0;
  int64_t N = 0;
  int T = 0, Hi = 0, Di = 0;
  // Gathered form (indexer_scores_at): idx [T, C] int32 rows of k (-1 or out of range ->
  // -inf), else null.
  const int32_t* idx = nullptr;
  int64_t idx_stride = 0;
  int64_t C = 0;
  float* scores = nullptr;
  int64_t scores_stride = 0;
};
// *fallback (if not null): why the fp32 kernel ran instead of the tensor-core one ("" if
// it did not).
int indexer_scores(const IndexerParams& p, void* stream, const char** fallback = nullptr);

// ---- Top-k selection -----------------------------------------------------------------------
// For each row t: the k largest of scores[t, :visible[t]] (visible clamped to [0, N]), ties
// toward the lower index, written as ascending indices then -1 padding: out [T, k] int32.
// Block mode (block > 1): selection over the block maxima of `block` consecutive positions
// (positions >= visible excluded, the newest block forced to +inf), k = n_blocks, and the
// output row is the selected blocks expanded to positions: out [T, k * block], -1 past
// visible and for unused blocks (candidate_blocks).
struct TopkParams {
  const float* scores = nullptr;
  int64_t scores_stride = 0;
  int64_t N = 0;
  const int32_t* visible = nullptr;  // [T]
  int T = 0;
  int k = 0;
  int block = 1;
  int32_t* out = nullptr;
  int64_t out_stride = 0;
};
int topk(const TopkParams& p, void* stream);

// ---- Cache writes and copies ----------------------------------------------------------------
// Same contract as cpu::quantize_scatter; x [n, D] contiguous f32, rows [n] int64 on the device.
int quantize_scatter(KvFormat f, const float* x, int64_t n, int64_t D, const int64_t* rows,
                     uint8_t* codes, int64_t code_stride, uint8_t* scales, int64_t scale_stride,
                     void* stream);

// Batched block copy; src and dst are device pointers or pinned host pointers (translated
// with cudaHostGetDevicePointer); src_idx/dst_idx [n] int64 in device memory. One kernel
// moves all pairs (16-byte vectors when block_bytes and both bases allow it).
int copy_blocks(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx,
                int64_t n, int64_t block_bytes, void* stream);

// The same copies on the copy engines: consecutive pairs that are contiguous on both sides
// are merged into one copy, and the copies go out in one cudaMemcpyBatchAsync (one
// cudaMemcpyAsync each on the legacy default stream, which the batch API refuses).
// src_idx/dst_idx are host arrays (validated by the caller).
int copy_blocks_engine(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx,
                       int64_t n, int64_t block_bytes, void* stream);

// Device twin of cpu::dequant_tricks (runs the same header functions on the GPU).
int dequant_tricks(KvFormat f, const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t D,
                   float* y, void* stream);

}  // namespace cuda
}  // namespace dsv41
