// Entry points of the codec ops over flat arrays of blocks, framework-free (raw pointers).
// The CPU versions run on a range of blocks so the caller may split the work across
// threads; the CUDA versions enqueue on the given stream and return a cudaError_t value.
//
// Layout for all of them: `x`/`y` hold n_blocks * BLOCK float32 values in element order;
// codes hold the packed codes (BLOCK/2 bytes per FP4 block, BLOCK bytes per FP8 block);
// scales hold one byte per block.
#pragma once

#include <cstdint>

#include "dsv41/formats.h"

namespace dsv41 {

enum class Codec : int { kNvfp4 = 0, kMxfp4 = 1, kFp8Swa = 2 };

// Values per scale block and code bytes per block, per codec.
DSV41_HD constexpr int codec_block(Codec c) {
  return c == Codec::kNvfp4 ? fmt::kNvfp4Block : fmt::kMxfp4Block;
}
DSV41_HD constexpr int codec_code_bytes(Codec c) {
  return c == Codec::kFp8Swa ? codec_block(c) : codec_block(c) / 2;
}

// FP8 V4 main-KV entries (formats.h): x holds n_entries rows of nope + rope float32
// values, out n_entries rows of fp8_v4_entry_bytes(nope, rope) bytes. nope is a multiple
// of 64; `floor` is the amax floor of the scale rule (fmt::kFp8V4AmaxFloor for V4).
struct Fp8V4Shape {
  int nope;
  int rope;
};

namespace cpu {
void fp8_v4_quantize(const float* x, int64_t n_entries, Fp8V4Shape shape, float floor,
                     uint8_t* out);
void fp8_v4_dequantize(const uint8_t* entries, int64_t n_entries, Fp8V4Shape shape, float* y);
void quantize(Codec codec, const float* x, int64_t n_blocks, uint8_t* codes, uint8_t* scales);
void dequantize(Codec codec, const uint8_t* codes, const uint8_t* scales, int64_t n_blocks,
                float* y);
}  // namespace cpu

namespace cuda {
// `stream` is a cudaStream_t; kept as void* so this header needs no CUDA headers.
int fp8_v4_quantize(const float* x, int64_t n_entries, Fp8V4Shape shape, float floor,
                    uint8_t* out, void* stream);
int fp8_v4_dequantize(const uint8_t* entries, int64_t n_entries, Fp8V4Shape shape, float* y,
                      void* stream);
int quantize(Codec codec, const float* x, int64_t n_blocks, uint8_t* codes, uint8_t* scales,
             void* stream);
int dequantize(Codec codec, const uint8_t* codes, const uint8_t* scales, int64_t n_blocks,
               float* y, void* stream);
}  // namespace cuda

}  // namespace dsv41
