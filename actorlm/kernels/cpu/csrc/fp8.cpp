// A linear layer's input rounded to FP8 (e4m3) and back, as an FP8 checkpoint's math asks
// (kernels.ActivationQuant; portable.round_to_fp8 computes the same bits in torch): the scale
// is the checkpoint's static one, or the largest magnitude over 448 of each row or group of
// `group` features (at least 1 / (448 * 512), as vLLM's); each value times the scale's
// reciprocal, clamped to +-448, rounded to the nearest e4m3 value (ties to even), times the
// scale, rounded to T.
//
// The values are multiplied by the scale's reciprocal, taken once, as vLLM's FP8 kernels do,
// and the largest magnitude by 448's reciprocal (fast math, which this library is built
// with, would make a division by the constant that product anyway); the products by powers of
// two below are exact, so fast math may reorder them without changing a bit, and the loops
// vectorize.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "actorlm_abi.h"
#include "dtype.h"

namespace {

using actorlm::store;
using actorlm::to_float;

constexpr float kMax = 448.f;  // e4m3's largest value
constexpr float kInverseMax = 1.f / kMax;
constexpr float kMinScale = 1.f / (kMax * 512.f);  // vLLM's floor: a row of zeros stays zeros
constexpr int64_t kParallelFrom = 8192;  // values from which rows are split over the team

// The e4m3 value nearest y, |y| <= 448: in the binade [2^e, 2^(e + 1)) the values are 2^(e - 3)
// apart, below 2^-6 (the subnormals) 2^-9 apart: y over that step rounded to an integer
inline float nearest_e4m3(float y) {
  const float a = std::fabs(y);
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  const int32_t e = std::max(int32_t(bits >> 23) - 127, int32_t(-6));
  const uint32_t step_bits = uint32_t(e + 124) << 23, inverse_bits = uint32_t(130 - e) << 23;
  float step, inverse;  // 2^(e - 3), 2^(3 - e)
  std::memcpy(&step, &step_bits, sizeof step);
  std::memcpy(&inverse, &inverse_bits, sizeof inverse);
  return std::copysign(std::nearbyint(a * inverse) * step, y);
}

template <typename T>
void round_to_fp8(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t k, int32_t group,
                  float static_scale) {
  const int64_t width = group > 0 ? group : k;
#pragma omp parallel for schedule(static) if (rows * k >= kParallelFrom)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < k; g += width) {
      const T* in = x + r * x_stride + g;
      T* o = out + r * k + g;
      float scale = static_scale;
      if (scale == 0.f) {
        float largest = 0.f;
#pragma omp simd reduction(max : largest)
        for (int64_t i = 0; i < width; ++i)
          largest = std::max(largest, std::fabs(to_float(in[i])));
        scale = std::max(largest * kInverseMax, kMinScale);
      }
      const float inverse = 1.f / scale;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i)
        store(nearest_e4m3(std::clamp(to_float(in[i]) * inverse, -kMax, kMax)) * scale, o + i);
    }
  }
}

}  // namespace

extern "C" {

#define ACTORLM_FP8(S, T)                                                                   \
  void actorlm_round_to_fp8_##S(const T* x, int64_t x_stride, T* out, int64_t rows,       \
                                int64_t k, int32_t group, float scale) {                  \
    round_to_fp8(x, x_stride, out, rows, k, group, scale);                                \
  }
ACTORLM_FP8(f32, float)
ACTORLM_FP8(bf16, uint16_t)

}  // extern "C"
