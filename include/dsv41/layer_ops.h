// Per-row layer math of the model's production path, framework-free: RMSNorm, the
// interleaved rotary embedding and mHC's hyper-connection weights and stream mixing. The CPU build runs these loops; the CUDA build of the
// torch ops (csrc/bindings/layer_ops.cpp) uses ATen's fused kernels for the same math.
#pragma once

#include <cstdint>

namespace dsv41 {
namespace cpu {

// Values are float32, or bfloat16 bit patterns where a `*_bf16` flag says so (an output
// in bf16 is the float32 result rounded to nearest even, as torch's conversion does).

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (w may be null: no weight), for `rows` rows
// of `cols` values. The sum of squares is accumulated in double, so the result does not
// depend on how the loop is vectorized.
void rms_norm(const void* x, bool x_bf16, const float* w, void* y, bool y_bf16, int64_t rows,
              int64_t cols, float eps);

// y = x with the last 2 * pairs values of each of `heads` head vectors of every row
// rotated pairwise (values 2i and 2i + 1 of that tail turn by the row's angle i):
// a' = a c - b s, b' = a s + b c with (c, s) = (cos[r, i], sin[r, i]), s negated when
// `inverse`. x and y [rows, heads, dim] (the first dim - 2 * pairs values are copied).
void rope(const void* x, bool x_bf16, const float* cos, const float* sin, void* y, bool y_bf16,
          int64_t rows, int64_t heads, int64_t dim, int64_t pairs, bool inverse);

// mHC weights from the site's logits mix [rows, (2 + n) n] (float32), base [(2 + n) n]
// and scale [3]: pre [rows, n] = sigmoid(mix * scale0 + base) + eps, post [rows, n] =
// 2 sigmoid(mix * scale1 + base), comb [rows, n, n] = softmax over each row of
// mix * scale2 + base, + eps, divided by its column sums (+ eps), then iters - 1 Sinkhorn
// iterations (rows, then columns, each sum + eps). Float32 arithmetic throughout.
void hc_weights(const float* mix, const float* base, const float* scale, float* pre, float* post,
                float* comb, int64_t rows, int64_t n, int64_t iters, float eps);

// x [rows, hidden] = sum_j pre[r, j] h[r, j] over the n streams of h [rows, n, hidden]
// (streams added in order j = 0 .. n - 1).
void hc_collapse(const float* h, const float* pre, float* x, int64_t rows, int64_t n, int64_t hidden);

// y [rows, n, hidden] = post[r, i] out[r] + sum_j comb[r, j, i] h[r, j] (out float32 or
// bf16 [rows, hidden]; streams added in order j = 0 .. n - 1 after the post term).
void hc_expand(const float* h, const void* out, bool out_bf16, const float* post, const float* comb,
               float* y, int64_t rows, int64_t n, int64_t hidden);

}  // namespace cpu
}  // namespace dsv41
