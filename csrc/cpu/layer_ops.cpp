// CPU loops of include/dsv41/layer_ops.h.
#include "dsv41/layer_ops.h"

#include <cmath>
#include <cstring>

namespace dsv41 {
namespace cpu {
namespace {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays a quiet NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float load(const void* x, bool bf16, int64_t i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i]) : static_cast<const float*>(x)[i];
}

inline void store(void* y, bool bf16, int64_t i, float v) {
  if (bf16)
    static_cast<uint16_t*>(y)[i] = float_to_bf16(v);
  else
    static_cast<float*>(y)[i] = v;
}

}  // namespace

void rms_norm(const void* x, bool x_bf16, const float* w, void* y, bool y_bf16, int64_t rows,
              int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * cols;
    double ss = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const double v = load(x, x_bf16, base + c);
      ss += v * v;
    }
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(cols) + eps));
    for (int64_t c = 0; c < cols; ++c) {
      const float v = load(x, x_bf16, base + c) * inv;
      store(y, y_bf16, base + c, w ? v * w[c] : v);
    }
  }
}

void rope(const void* x, bool x_bf16, const float* cos, const float* sin, void* y, bool y_bf16,
          int64_t rows, int64_t heads, int64_t dim, int64_t pairs, bool inverse) {
  const int64_t keep = dim - 2 * pairs;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * pairs;
    const float* s = sin + r * pairs;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (r * heads + h) * dim;
      for (int64_t i = 0; i < keep; ++i) store(y, y_bf16, base + i, load(x, x_bf16, base + i));
      for (int64_t i = 0; i < pairs; ++i) {
        const float a = load(x, x_bf16, base + keep + 2 * i);
        const float b = load(x, x_bf16, base + keep + 2 * i + 1);
        const float sn = inverse ? -s[i] : s[i];
        store(y, y_bf16, base + keep + 2 * i, a * c[i] - b * sn);
        store(y, y_bf16, base + keep + 2 * i + 1, a * sn + b * c[i]);
      }
    }
  }
}

void hc_weights(const float* mix, const float* base, const float* scale, float* pre, float* post,
                float* comb, int64_t rows, int64_t n, int64_t iters, float eps) {
  const int64_t width = (2 + n) * n;
  for (int64_t r = 0; r < rows; ++r) {
    const float* m = mix + r * width;
    for (int64_t i = 0; i < n; ++i) {
      pre[r * n + i] = 1.0f / (1.0f + std::exp(-(m[i] * scale[0] + base[i]))) + eps;
      post[r * n + i] = 2.0f / (1.0f + std::exp(-(m[n + i] * scale[1] + base[n + i])));
    }
    float* c = comb + r * n * n;
    for (int64_t i = 0; i < n; ++i) {  // softmax over each row, + eps
      float* row = c + i * n;
      float top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        row[j] = m[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j];
        top = std::fmax(top, row[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        row[j] = std::exp(row[j] - top);
        sum += row[j];
      }
      for (int64_t j = 0; j < n; ++j) row[j] = row[j] / sum + eps;
    }
    for (int64_t it = 0; it < iters; ++it) {
      if (it > 0) {  // rows
        for (int64_t i = 0; i < n; ++i) {
          float sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) sum += c[i * n + j];
          sum += eps;
          for (int64_t j = 0; j < n; ++j) c[i * n + j] /= sum;
        }
      }
      for (int64_t j = 0; j < n; ++j) {  // columns
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += c[i * n + j];
        sum += eps;
        for (int64_t i = 0; i < n; ++i) c[i * n + j] /= sum;
      }
    }
  }
}

void hc_collapse(const float* h, const float* pre, float* x, int64_t rows, int64_t n, int64_t hidden) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = pre + r * n;
    const float* hr = h + r * n * hidden;
    float* xr = x + r * hidden;
    for (int64_t d = 0; d < hidden; ++d) xr[d] = p[0] * hr[d];
    for (int64_t j = 1; j < n; ++j)
      for (int64_t d = 0; d < hidden; ++d) xr[d] += p[j] * hr[j * hidden + d];
  }
}

void hc_expand(const float* h, const void* out, bool out_bf16, const float* post, const float* comb,
               float* y, int64_t rows, int64_t n, int64_t hidden) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* hr = h + r * n * hidden;
    const float* c = comb + r * n * n;
    for (int64_t i = 0; i < n; ++i) {
      float* yr = y + (r * n + i) * hidden;
      const float p = post[r * n + i];
      for (int64_t d = 0; d < hidden; ++d) yr[d] = p * load(out, out_bf16, r * hidden + d);
      for (int64_t j = 0; j < n; ++j) {
        const float w = c[j * n + i];
        for (int64_t d = 0; d < hidden; ++d) yr[d] += w * hr[j * hidden + d];
      }
    }
  }
}

}  // namespace cpu
}  // namespace dsv41
