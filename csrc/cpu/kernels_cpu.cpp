// CPU versions of the cache-write, copy and decoder-check entry points of kernels.h. They
// run the same formats.h / dequant.h code as the CUDA kernels, so the CPU test suite checks
// the logic the GPU runs.
#include <cstring>

#include "dsv41/dequant.h"
#include "dsv41/formats.h"
#include "dsv41/kernels.h"

namespace dsv41 {
namespace cpu {

void copy_blocks(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx,
                 int64_t n, int64_t block_bytes) {
  for (int64_t i = 0; i < n; ++i)
    std::memmove(dst + dst_idx[i] * block_bytes, src + src_idx[i] * block_bytes,
                 static_cast<size_t>(block_bytes));
}

void quantize_scatter(KvFormat f, const float* x, int64_t n, int64_t D, const int64_t* rows,
                      uint8_t* codes, int64_t code_stride, uint8_t* scales, int64_t scale_stride) {
  for (int64_t i = 0; i < n; ++i) {
    if (rows[i] < 0) continue;
    const float* xr = x + i * D;
    uint8_t* c = codes + rows[i] * code_stride;
    uint8_t* s = scales + rows[i] * scale_stride;
    switch (f) {
      case KvFormat::kNvfp4:
        for (int64_t b = 0; b < D / fmt::kNvfp4Block; ++b)
          fmt::nvfp4_encode_block(xr + b * fmt::kNvfp4Block, c + b * fmt::kNvfp4Block / 2, s + b);
        break;
      case KvFormat::kMxfp4:
        for (int64_t b = 0; b < D / fmt::kMxfp4Block; ++b)
          fmt::mxfp4_encode_block(xr + b * fmt::kMxfp4Block, c + b * fmt::kMxfp4Block / 2, s + b);
        break;
      case KvFormat::kFp8Swa:
        for (int64_t b = 0; b < D / fmt::kFp8SwaBlock; ++b)
          fmt::fp8_swa_encode_block(xr + b * fmt::kFp8SwaBlock, c + b * fmt::kFp8SwaBlock, s + b);
        break;
    }
  }
}

void dequant_tricks(KvFormat f, const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t D,
                    float* y) {
  const int fi = static_cast<int>(f);
  const int64_t code_bytes = f == KvFormat::kFp8Swa ? D : D / 2;
  const int64_t scale_bytes = D / (f == KvFormat::kNvfp4 ? fmt::kNvfp4Block : fmt::kMxfp4Block);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < D / 8; ++g)
      dq::decode_group_natural(fi, codes + r * code_bytes, scales + r * scale_bytes, static_cast<int>(g),
                               y + r * D + 8 * g);
}

}  // namespace cpu
}  // namespace dsv41
