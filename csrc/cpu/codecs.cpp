// CPU codec loops: every block goes through the shared __host__ __device__ block codecs
// of formats.h, so these produce the same bits as the CUDA kernels.
#include "dsv41/codec_ops.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace cpu {

void quantize(Codec codec, const float* x, int64_t n_blocks, uint8_t* codes, uint8_t* scales) {
  const int block = codec_block(codec);
  const int code_bytes = codec_code_bytes(codec);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* xb = x + b * block;
    uint8_t* cb = codes + b * code_bytes;
    switch (codec) {
      case Codec::kNvfp4: fmt::nvfp4_encode_block(xb, cb, scales + b); break;
      case Codec::kMxfp4: fmt::mxfp4_encode_block(xb, cb, scales + b); break;
      case Codec::kFp8Swa: fmt::fp8_swa_encode_block(xb, cb, scales + b); break;
    }
  }
}

void dequantize(Codec codec, const uint8_t* codes, const uint8_t* scales, int64_t n_blocks,
                float* y) {
  const int block = codec_block(codec);
  const int code_bytes = codec_code_bytes(codec);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* cb = codes + b * code_bytes;
    float* yb = y + b * block;
    switch (codec) {
      case Codec::kNvfp4: fmt::nvfp4_decode_block(cb, scales[b], yb); break;
      case Codec::kMxfp4: fmt::mxfp4_decode_block(cb, scales[b], yb); break;
      case Codec::kFp8Swa: fmt::fp8_swa_decode_block(cb, scales[b], yb); break;
    }
  }
}

}  // namespace cpu
}  // namespace dsv41
