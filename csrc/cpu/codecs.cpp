// CPU codec loops: every block goes through the shared __host__ __device__ block codecs
// of formats.h, so these produce the same bits as the CUDA kernels.
#include "dsv41/codec_ops.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace cpu {
namespace {

// One loop per codec (the codec is a template argument, so the block calls inline).
template <Codec C>
void quantize_blocks(const float* x, int64_t n_blocks, uint8_t* codes, uint8_t* scales) {
  constexpr int kBlock = codec_block(C), kCodeBytes = codec_code_bytes(C);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* xb = x + b * kBlock;
    uint8_t* cb = codes + b * kCodeBytes;
    if constexpr (C == Codec::kNvfp4) fmt::nvfp4_encode_block(xb, cb, scales + b);
    if constexpr (C == Codec::kMxfp4) fmt::mxfp4_encode_block(xb, cb, scales + b);
    if constexpr (C == Codec::kFp8Swa) fmt::fp8_swa_encode_block(xb, cb, scales + b);
  }
}

template <Codec C>
void dequantize_blocks(const uint8_t* codes, const uint8_t* scales, int64_t n_blocks, float* y) {
  constexpr int kBlock = codec_block(C), kCodeBytes = codec_code_bytes(C);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const uint8_t* cb = codes + b * kCodeBytes;
    float* yb = y + b * kBlock;
    if constexpr (C == Codec::kNvfp4) fmt::nvfp4_decode_block(cb, scales[b], yb);
    if constexpr (C == Codec::kMxfp4) fmt::mxfp4_decode_block(cb, scales[b], yb);
    if constexpr (C == Codec::kFp8Swa) fmt::fp8_swa_decode_block(cb, scales[b], yb);
  }
}

}  // namespace

void quantize(Codec codec, const float* x, int64_t n_blocks, uint8_t* codes, uint8_t* scales) {
  switch (codec) {
    case Codec::kNvfp4: return quantize_blocks<Codec::kNvfp4>(x, n_blocks, codes, scales);
    case Codec::kMxfp4: return quantize_blocks<Codec::kMxfp4>(x, n_blocks, codes, scales);
    case Codec::kFp8Swa: return quantize_blocks<Codec::kFp8Swa>(x, n_blocks, codes, scales);
  }
}

void dequantize(Codec codec, const uint8_t* codes, const uint8_t* scales, int64_t n_blocks,
                float* y) {
  switch (codec) {
    case Codec::kNvfp4: return dequantize_blocks<Codec::kNvfp4>(codes, scales, n_blocks, y);
    case Codec::kMxfp4: return dequantize_blocks<Codec::kMxfp4>(codes, scales, n_blocks, y);
    case Codec::kFp8Swa: return dequantize_blocks<Codec::kFp8Swa>(codes, scales, n_blocks, y);
  }
}

}  // namespace cpu
}  // namespace dsv41
