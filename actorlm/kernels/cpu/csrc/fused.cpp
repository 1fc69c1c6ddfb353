// Elementwise work of a decoder layer fused into one pass each, on torch's OpenMP pool (see
// decode_attention.cpp for how this library is built and linked).
//
// Each follows the rounding of the torch ops it replaces (HF's order): in bf16 the residual
// sum is rounded to bf16, the normalisation runs in fp32 and is rounded before the weight
// multiplies it; silu(gate) is rounded before it multiplies up. Only the order of the fp32
// sum of squares differs from torch's, which moves the last bits.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtype.h"

namespace {

using actorlm::rounded;
using actorlm::store;
using actorlm::to_float;

constexpr int kMaxRopeDim = 512;  // head sizes the RoPE kernel takes

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

// For each token row of a fused qkv projection ([q heads | k heads | v heads], rows
// `row_stride` apart): q and k rotated in place by HF's RoPE, x * cos + rotate_half(x) * sin
// (sin_signed has its first half negated, so rotate_half is a roll by half; in bf16 both
// products and their sum are rounded, as torch's three ops round them), then the row's k and v
// heads copied into the paged cache at its slot. cos and sin_signed: [rows, head_dim].
template <typename T>
void rope_write_kv(T* qkv, int64_t row_stride, const T* cos, const T* sin_signed, T* k_cache,
                   T* v_cache, const int64_t* slots, int64_t rows, int num_heads,
                   int num_kv_heads, int head_dim) {
  const int half = head_dim / 2;
  const int64_t kv_size = int64_t(num_kv_heads) * head_dim;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* row = qkv + r * row_stride;
    const T* c = cos + r * head_dim;
    const T* s = sin_signed + r * head_dim;
    for (int h = 0; h < num_heads + num_kv_heads; ++h) {
      T* x = row + int64_t(h) * head_dim;
      float rotated[kMaxRopeDim];
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) {
        const float partner = to_float(x[d < half ? d + half : d - half]);
        rotated[d] = rounded(rounded(to_float(x[d]) * to_float(c[d]), x) +
                                 rounded(partner * to_float(s[d]), x), x);
      }
      for (int d = 0; d < head_dim; ++d) store(rotated[d], x + d);
    }
    const T* k = row + int64_t(num_heads) * head_dim;
    std::memcpy(k_cache + slots[r] * kv_size, k, kv_size * sizeof(T));
    std::memcpy(v_cache + slots[r] * kv_size, k + kv_size, kv_size * sizeof(T));
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

int actorlm_rope_max_head_dim() { return kMaxRopeDim; }
void actorlm_rope_write_kv_f32(float* qkv, int64_t row_stride, const float* cos,
                               const float* sin_signed, float* k_cache, float* v_cache,
                               const int64_t* slots, int64_t rows, int num_heads,
                               int num_kv_heads, int head_dim) {
  rope_write_kv(qkv, row_stride, cos, sin_signed, k_cache, v_cache, slots, rows, num_heads,
                num_kv_heads, head_dim);
}
void actorlm_rope_write_kv_bf16(uint16_t* qkv, int64_t row_stride, const uint16_t* cos,
                                const uint16_t* sin_signed, uint16_t* k_cache,
                                uint16_t* v_cache, const int64_t* slots, int64_t rows,
                                int num_heads, int num_kv_heads, int head_dim) {
  rope_write_kv(qkv, row_stride, cos, sin_signed, k_cache, v_cache, slots, rows, num_heads,
                num_kv_heads, head_dim);
}

}  // extern "C"
