// CPU loops of the FP8 V4 main-KV codec: every entry goes through the shared
// __host__ __device__ entry codec of formats.h, the code the CUDA kernel's lanes also run.
#include "dsv41/codec_ops.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace cpu {

void fp8_v4_quantize(const float* x, int64_t n_entries, Fp8V4Shape shape, float floor,
                     uint8_t* out) {
  const int64_t in_stride = shape.nope + shape.rope;
  const int64_t out_stride = fmt::fp8_v4_entry_bytes(shape.nope, shape.rope);
  for (int64_t e = 0; e < n_entries; ++e)
    fmt::fp8_v4_encode_entry(x + e * in_stride, shape.nope, shape.rope, floor,
                             out + e * out_stride);
}

void fp8_v4_dequantize(const uint8_t* entries, int64_t n_entries, Fp8V4Shape shape, float* y) {
  const int64_t out_stride = shape.nope + shape.rope;
  const int64_t in_stride = fmt::fp8_v4_entry_bytes(shape.nope, shape.rope);
  for (int64_t e = 0; e < n_entries; ++e)
    fmt::fp8_v4_decode_entry(entries + e * in_stride, shape.nope, shape.rope, y + e * out_stride);
}

}  // namespace cpu
}  // namespace dsv41
