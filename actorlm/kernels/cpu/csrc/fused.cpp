// Elementwise work of a decoder layer fused into one pass each, on torch's OpenMP pool (see
// decode_attention.cpp for how this library is built and linked).
//
// Each follows the rounding of the torch ops it replaces (HF's order): in bf16 the residual
// sum is rounded to bf16; an RMS norm normalises in fp32 and, scaled by its weight, rounds the
// normed value before the weight multiplies it (a unit-offset norm multiplies by 1 + weight in
// fp32 and rounds once), a LayerNorm rounds once; act(gate) is rounded before it multiplies
// up. Only the order of the
// fp32 sum of squares differs from torch's, which moves the last bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "actorlm_abi.h"
#include "dtype.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using actorlm::rounded;
using actorlm::store;
using actorlm::to_float;

constexpr int kMaxRopeDim = 512;  // head sizes the RoPE kernel takes
// the order of kernels.backend.ACTIVATIONS
enum Activation { kSilu = 0, kGeluTanh = 1, kRelu = 2, kRelu2 = 3, kGelu = 4, kSwigluOai = 5 };
// GPT-OSS's clamped SwiGLU (kernels.backend.SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
constexpr float kSwigluAlpha = 1.702f, kSwigluLimit = 7.f;
// Values from which a pass is split over the team: a decode step's few rows take a
// microsecond or two alone, about what waking the team and joining it again cost
constexpr int64_t kParallelFrom = 8192;

template <typename T>
inline float inverse_rms(const T* x, int dim, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int d = 0; d < dim; ++d) sum_sq += to_float(x[d]) * to_float(x[d]);
  return 1.f / std::sqrt(sum_sq / dim + eps);
}

// out = x * inv_rms, scaled by weight (or by 1 + weight); out may be x
template <typename T>
inline void scale_row(const T* x, float inv_rms, const T* weight, bool unit_offset, int dim,
                      T* out) {
  if (unit_offset) {
#pragma omp simd
    for (int d = 0; d < dim; ++d)
      store(to_float(x[d]) * inv_rms * (1.f + to_float(weight[d])), out + d);
  } else {
#pragma omp simd
    for (int d = 0; d < dim; ++d)
      store(rounded(to_float(x[d]) * inv_rms, out) * to_float(weight[d]), out + d);
  }
}

template <typename T>
void rms_norm(const T* x, int64_t x_stride, T* out, const T* weight, int64_t rows, int dim,
              float eps, int unit_offset) {
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelFrom)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * x_stride;
    scale_row(row, inverse_rms(row, dim, eps), weight, unit_offset, dim, out + r * dim);
  }
}

// residual += x; x = norm(residual)   (rows of `dim`, both contiguous)
template <typename T>
void add_rms_norm(T* x, T* residual, const T* weight, int64_t rows, int dim, float eps,
                  int unit_offset) {
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelFrom)
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
    scale_row(res, 1.f / std::sqrt(sum_sq / dim + eps), weight, unit_offset, dim, xr);
  }
}

// out = (x - mean) / sqrt(var + eps) * weight (+ bias), in fp32, rounded once, as torch's
// layer_norm (whose moments come from a Welford pass: the last bits differ); out may be x
template <typename T>
void layer_norm(const T* x, int64_t x_stride, T* out, const T* weight, const T* bias,
                int64_t rows, int dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelFrom)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * x_stride;
    T* o = out + r * dim;
    float sum = 0.f, sum_sq = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < dim; ++d) sum += to_float(row[d]);
    const float mean = sum / dim;
#pragma omp simd reduction(+ : sum_sq)
    for (int d = 0; d < dim; ++d) {
      const float centred = to_float(row[d]) - mean;
      sum_sq += centred * centred;
    }
    const float inv = 1.f / std::sqrt(sum_sq / dim + eps);
#pragma omp simd
    for (int d = 0; d < dim; ++d)
      store((to_float(row[d]) - mean) * inv * to_float(weight[d]) +
                (bias ? to_float(bias[d]) : 0.f), o + d);
  }
}

// Each q head and k head of the fused projection's rows normed in place, by its own weight.
template <typename T>
void head_rms_norm(T* qkv, int64_t row_stride, int64_t rows, int num_heads, int num_kv_heads,
                   int head_dim, const T* q_weight, const T* k_weight, float eps,
                   int unit_offset) {
#pragma omp parallel for schedule(static) collapse(2) \
    if (rows * row_stride >= kParallelFrom)
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < num_heads + num_kv_heads; ++h) {
      T* x = qkv + r * row_stride + int64_t(h) * head_dim;
      scale_row(x, inverse_rms(x, head_dim, eps), h < num_heads ? q_weight : k_weight,
                unit_offset, head_dim, x);
    }
  }
}

inline float silu(float g) { return g / (1.f + expf(-g)); }

// torch's exact gelu, 0.5 g (1 + erf(g / sqrt(2))): GPT-NeoX's
inline float gelu(float g) {
  constexpr float kInverseSqrt2 = 0.7071067811865476f;
  return 0.5f * g * (1.f + erff(g * kInverseSqrt2));
}

// torch's square(relu(g)): Nemotron's and Arcee's
inline float relu2(float g) {
  const float r = std::max(g, 0.f);
  return r * r;
}

// torch's gelu(approximate="tanh")
inline float gelu_tanh(float g) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * g * (1.f + tanhf(kBeta * (g + 0.044715f * g * g * g)));
}

// out[r] = act(gate[r]) * up[r], where row r of gate_up is [gate | up]
template <typename T>
void act_and_mul(const T* gate_up, T* out, int64_t rows, int dim, int activation) {
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelFrom)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * dim;
    const T* up = gate + dim;
    T* o = out + r * dim;
    if (activation == kSilu) {
#pragma omp simd
      for (int d = 0; d < dim; ++d)
        store(rounded(silu(to_float(gate[d])), o) * to_float(up[d]), o + d);
    } else if (activation == kRelu) {
#pragma omp simd
      for (int d = 0; d < dim; ++d)
        store(std::max(to_float(gate[d]), 0.f) * to_float(up[d]), o + d);
    } else if (activation == kRelu2) {
#pragma omp simd
      for (int d = 0; d < dim; ++d)
        store(rounded(relu2(to_float(gate[d])), o) * to_float(up[d]), o + d);
    } else if (activation == kGelu) {
#pragma omp simd
      for (int d = 0; d < dim; ++d)
        store(rounded(gelu(to_float(gate[d])), o) * to_float(up[d]), o + d);
    } else if (activation == kSwigluOai) {
      // transformers' ops, each rounded: g * sigmoid(g * alpha) of g = min(gate, limit), times
      // clamp(up, -limit, limit) + 1
#pragma omp simd
      for (int d = 0; d < dim; ++d) {
        const float g = std::min(to_float(gate[d]), kSwigluLimit);
        const float u = std::min(std::max(to_float(up[d]), -kSwigluLimit), kSwigluLimit);
        const float s = rounded(1.f / (1.f + std::exp(-rounded(g * kSwigluAlpha, o))), o);
        store(rounded(u + 1.f, o) * rounded(g * s, o), o + d);
      }
    } else {  // kGeluTanh
#pragma omp simd
      for (int d = 0; d < dim; ++d)
        store(rounded(gelu_tanh(to_float(gate[d])), o) * to_float(up[d]), o + d);
    }
  }
}

// out = act(x), rounded (an ungated MLP's)
template <typename T>
void act(const T* x, T* out, int64_t rows, int dim, int activation) {
#pragma omp parallel for schedule(static) if (rows * dim >= kParallelFrom)
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * dim;
    T* o = out + r * dim;
    if (activation == kSilu) {
#pragma omp simd
      for (int d = 0; d < dim; ++d) store(silu(to_float(in[d])), o + d);
    } else if (activation == kRelu) {
#pragma omp simd
      for (int d = 0; d < dim; ++d) store(std::max(to_float(in[d]), 0.f), o + d);
    } else if (activation == kRelu2) {
#pragma omp simd
      for (int d = 0; d < dim; ++d) store(relu2(to_float(in[d])), o + d);
    } else if (activation == kGelu) {
#pragma omp simd
      for (int d = 0; d < dim; ++d) store(gelu(to_float(in[d])), o + d);
    } else {
#pragma omp simd
      for (int d = 0; d < dim; ++d) store(gelu_tanh(to_float(in[d])), o + d);
    }
  }
}

// n values of x into a cache row: copied, or rounded into an FP8 cache's format
template <typename T, typename C>
inline void cache_row(const T* x, C* out, int64_t n) {
  if constexpr (std::is_same_v<T, C>) {
    std::memcpy(out, x, n * sizeof(T));
  } else {
    for (int64_t i = 0; i < n; ++i) store(to_float(x[i]), out + i);
  }
}

// out [n] = an FP8 cache's values x [n], widened exactly (the torch path's prefill reads a
// gathered context so: torch's own conversion takes ~2.5 ns a value)
template <typename C, typename T>
void widen(const C* x, T* out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelFrom)
  for (int64_t i = 0; i < n; i += 16) {
#ifdef __AVX512F__
    if (i + 16 <= n) {
      const __m512 v = actorlm::widen16(x + i);
      if constexpr (sizeof(T) == 4) {
        _mm512_storeu_ps(reinterpret_cast<float*>(out + i), v);
      } else {  // (exact in bf16: FP8's mantissa is shorter)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
      }
      continue;
    }
#endif
    for (int64_t j = i; j < std::min(n, i + 16); ++j) store(to_float(x[j]), out + j);
  }
}

// For each token row of a fused qkv projection ([q heads | k heads | v heads], rows
// `row_stride` apart): q and k rotated in place by HF's RoPE, x * cos + rotate_half(x) * sin
// (sin_signed has its first half negated, so rotate_half is a roll by half; in bf16 both
// products and their sum are rounded, as torch's three ops round them), then the row's k and v
// heads written into the paged cache at its slot (rounded, where the cache is FP8). cos and
// sin_signed: [rows, head_dim].
template <typename T, typename C>
void rope_write_kv(T* qkv, int64_t row_stride, const T* cos, const T* sin_signed, C* k_cache,
                   C* v_cache, const int64_t* slots, int64_t rows, int num_heads,
                   int num_kv_heads, int head_dim) {
  const int half = head_dim / 2;
  const int64_t kv_size = int64_t(num_kv_heads) * head_dim;
#pragma omp parallel for schedule(static) if (rows * row_stride >= kParallelFrom)
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
    cache_row(k, k_cache + slots[r] * kv_size, kv_size);
    cache_row(k + kv_size, v_cache + slots[r] * kv_size, kv_size);
  }
}

}  // namespace

extern "C" {

#define ACTORLM_FUSED(S, T)                                                                      \
  void actorlm_rms_norm_##S(const T* x, int64_t x_stride, T* out, const T* weight,             \
                            int64_t rows, int dim, float eps, int unit_offset) {               \
    rms_norm(x, x_stride, out, weight, rows, dim, eps, unit_offset);                            \
  }                                                                                             \
  void actorlm_add_rms_norm_##S(T* x, T* residual, const T* weight, int64_t rows, int dim,     \
                                float eps, int unit_offset) {                                  \
    add_rms_norm(x, residual, weight, rows, dim, eps, unit_offset);                             \
  }                                                                                             \
  void actorlm_layer_norm_##S(const T* x, int64_t x_stride, T* out, const T* weight,           \
                              const T* bias, int64_t rows, int dim, float eps) {               \
    layer_norm(x, x_stride, out, weight, bias, rows, dim, eps);                                 \
  }                                                                                             \
  void actorlm_act_##S(const T* x, T* out, int64_t rows, int dim, int activation) {            \
    act(x, out, rows, dim, activation);                                                         \
  }                                                                                             \
  void actorlm_head_rms_norm_##S(T* qkv, int64_t row_stride, int64_t rows, int num_heads,      \
                                 int num_kv_heads, int head_dim, const T* q_weight,            \
                                 const T* k_weight, float eps, int unit_offset) {              \
    head_rms_norm(qkv, row_stride, rows, num_heads, num_kv_heads, head_dim, q_weight, k_weight, \
                  eps, unit_offset);                                                            \
  }                                                                                             \
  void actorlm_act_and_mul_##S(const T* gate_up, T* out, int64_t rows, int dim,                \
                               int activation) {                                               \
    act_and_mul(gate_up, out, rows, dim, activation);                                           \
  }                                                                                             \
  ACTORLM_ROPE_WRITE_KV(actorlm_rope_write_kv_##S, T, T, T)                                    \
  ACTORLM_ROPE_WRITE_KV(actorlm_rope_write_kv_##S##_e4m3, T, uint8_t, actorlm::E4M3)           \
  ACTORLM_ROPE_WRITE_KV(actorlm_rope_write_kv_##S##_e5m2, T, uint8_t, actorlm::E5M2)           \
  ACTORLM_WIDEN(actorlm_widen_##S##_e4m3, T, actorlm::E4M3)                                     \
  ACTORLM_WIDEN(actorlm_widen_##S##_e5m2, T, actorlm::E5M2)
// the caches' values as the ABI passes them (STORED: an FP8 cache's bytes) and as written (C)
#define ACTORLM_WIDEN(NAME, T, C)                                                                \
  void NAME(const uint8_t* x, T* out, int64_t n) { widen(reinterpret_cast<const C*>(x), out, n); }
#define ACTORLM_ROPE_WRITE_KV(NAME, T, STORED, C)                                                \
  void NAME(T* qkv, int64_t row_stride, const T* cos, const T* sin_signed, STORED* k_cache,     \
            STORED* v_cache, const int64_t* slots, int64_t rows, int num_heads,                 \
            int num_kv_heads, int head_dim) {                                                   \
    rope_write_kv(qkv, row_stride, cos, sin_signed, reinterpret_cast<C*>(k_cache),              \
                  reinterpret_cast<C*>(v_cache), slots, rows, num_heads, num_kv_heads,          \
                  head_dim);                                                                    \
  }
ACTORLM_FUSED(f32, float)
ACTORLM_FUSED(bf16, uint16_t)

int actorlm_rope_max_head_dim() { return kMaxRopeDim; }

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
