// Elementwise work of a decoder layer fused into one pass each, on torch's OpenMP pool (see
// cpu_paged_decode.cpp for how this library is built and linked).
//
// Each follows the rounding of the torch ops it replaces (HF's order): in bf16 the residual
// sum is rounded to bf16, the normalisation runs in fp32 and is rounded before the weight
// multiplies it; silu(gate) is rounded before it multiplies up. Only the order of the fp32
// sum of squares differs from torch's, which moves the last bits.
#include <cmath>
#include <cstdint>

#include "dtype.h"

namespace {

using actorlm::rounded;
using actorlm::store;
using actorlm::to_float;

// residual += x; x = weight * rms_norm(residual)   (rows of `dim`, both contiguous)
template <typename T>
void add_rms_norm(T* x, T* residual, const T* weight, int64_t rows, int dim, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * dim;
    T* res = residual + r * dim;
    float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
    for (int d = 0; d < dim; ++d) {
      const float sum = rounded(to_float(xr[d]) + to_float(res[d]), xr);
      store(sum, res + d);
      sum_sq += sum * sum;
    }
    const float inv_rms = 1.f / std::sqrt(sum_sq / dim + eps);
#pragma omp simd
    for (int d = 0; d < dim; ++d) {
      const float normed = rounded(to_float(res[d]) * inv_rms, xr);
      store(normed * to_float(weight[d]), xr + d);
    }
  }
}

// out[r] = silu(gate[r]) * up[r], where row r of gate_up is [gate | up]
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int dim) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * dim;
    const T* up = gate + dim;
    T* o = out + r * dim;
#pragma omp simd
    for (int d = 0; d < dim; ++d) {
      const float g = to_float(gate[d]);
      store(rounded(g / (1.f + expf(-g)), o) * to_float(up[d]), o + d);
    }
  }
}

}  // namespace

extern "C" {

void actorlm_add_rms_norm_f32(float* x, float* residual, const float* weight, int64_t rows,
                              int dim, float eps) {
  add_rms_norm(x, residual, weight, rows, dim, eps);
}
void actorlm_add_rms_norm_bf16(uint16_t* x, uint16_t* residual, const uint16_t* weight,
                               int64_t rows, int dim, float eps) {
  add_rms_norm(x, residual, weight, rows, dim, eps);
}
void actorlm_silu_and_mul_f32(const float* gate_up, float* out, int64_t rows, int dim) {
  silu_and_mul(gate_up, out, rows, dim);
}
void actorlm_silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int dim) {
  silu_and_mul(gate_up, out, rows, dim);
}

// out[r] = the first index of the largest of row r's n values (fp32 logits, no NaN)
void actorlm_argmax_f32(const float* x, int64_t* out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    float best = row[0];
#pragma omp simd reduction(max : best)
    for (int64_t i = 0; i < n; ++i) best = row[i] > best ? row[i] : best;
    int64_t index = 0;
    while (row[index] != best) ++index;
    out[r] = index;
  }
}

}  // extern "C"
