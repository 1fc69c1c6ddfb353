// The portable dot products of a weight row in blocks with R rows of quantized x: what a CPU
// without AVX2 runs (the compiler vectorises the inner loops as far as its flags allow), and
// the plainest statement of the arithmetic the AVX2 and AVX-512 kernels share.
//
// Per 32-value block: the integer sum of q_w q_x, less the weight's offset times the sum of
// q_x, times d_w d_x, summed in fp32 (Q4_1 adds m d_x sum q_x). Per K superblock: the sub-blocks'
// integer sums times their integer scales, summed as integers, times d_w d_x; less the mins'
// d_min d_x sum_j m_j sum q_x (Q4_K, Q5_K), or the offset 32's (Q6_K, as integers).
#pragma once
#include <cstdint>

#include "quant_act.h"
#include "quant_blocks.h"

namespace actorlm::quant::scalar {

inline int dot_ints(const uint8_t* w, const int8_t* x, int n) {
  int sum = 0;
  for (int i = 0; i < n; ++i) sum += int(w[i]) * int(x[i]);
  return sum;
}

// A 32-value block as unsigned integers (Q8_0's as their int8 bits), its offset, d and m
struct Block32 {
  uint8_t q[32];
  int offset;
  float d, m;
};

template <int Type>
inline void unpack32(const uint8_t* b, Block32* u) {
  u->m = 0.f;
  if constexpr (Type == kQ8_0) {
    u->d = f16_at(b + q8_0::kD);
    for (int i = 0; i < 32; ++i) u->q[i] = uint8_t(int8_t(b[q8_0::kQs + i]) + 128);
    u->offset = 128;  // q + 128 is unsigned; the offset takes it back
  } else if constexpr (Type == kQ5_0) {
    u->d = f16_at(b + q5_0::kD);
    const uint32_t qh = load_u32(b + q5_0::kQh);
    for (int i = 0; i < 32; ++i)
      u->q[i] = uint8_t(nibble_value(b + q5_0::kQs, i) | ((qh >> i & 1) << 4));
    u->offset = 16;
  } else {
    const int qs = Type == kQ4_1 ? q4_1::kQs : q4_0::kQs;
    u->d = f16_at(b);
    if (Type == kQ4_1) u->m = f16_at(b + q4_1::kM);
    for (int i = 0; i < 32; ++i) u->q[i] = uint8_t(nibble_value(b + qs, i));
    u->offset = Type == kQ4_1 ? 0 : 8;
  }
}

template <int Type, int R>
void dot32(const uint8_t* w, int64_t blocks, const Activations& x, int64_t row0, float* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  float acc[R] = {};
  Block32 u;
  for (int64_t b = 0; b < blocks; ++b) {
    unpack32<Type>(w + b * kBytes, &u);
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.qs_of(row0 + r) + b * 32;
      int sum_x = 0;
      for (int i = 0; i < 32; ++i) sum_x += xq[i];
      const float dx = x.d_of(row0 + r)[b];
      acc[r] += u.d * dx * float(dot_ints(u.q, xq, 32) - u.offset * sum_x);
      if constexpr (Type == kQ4_1) acc[r] += u.m * x.dsum_of(row0 + r)[b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

template <int Type, int R>
void dot_k(const uint8_t* w, int64_t blocks, const Activations& x, int64_t row0, float* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  float acc[R] = {};
  uint8_t q[256];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * kBytes;
    int scales[16], mins[8] = {};
    float d, dmin = 0.f;
    if constexpr (Type == kQ6_K) {
      d = f16_at(block + q6_k::kD);
      for (int i = 0; i < 256; ++i) q[i] = uint8_t(q6_k_value(block, i));
      for (int j = 0; j < 16; ++j) scales[j] = int8_t(block[q6_k::kScales + j]);
    } else {
      d = f16_at(block + q4_k::kD), dmin = f16_at(block + q4_k::kDmin);
      const uint8_t* qs = block + (Type == kQ5_K ? q5_k::kQs : q4_k::kQs);
      for (int j = 0; j < 8; ++j) {
        scale_min_k4(block + q4_k::kScales, j, &scales[j], &mins[j]);
        for (int l = 0; l < 32; ++l) {
          int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
          if (Type == kQ5_K) v |= ((block[q5_k::kQh + l] >> j) & 1) << 4;
          q[32 * j + l] = uint8_t(v);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.qs_k_of(row0 + r) + b * 256;
      const int16_t* sums = x.sums_k_of(row0 + r) + b * 16;
      const float dx = x.d_k_of(row0 + r)[b];
      int sum = 0, min_sum = 0;
      if constexpr (Type == kQ6_K) {
        for (int j = 0; j < 16; ++j)
          sum += scales[j] * (dot_ints(q + 16 * j, xq + k_position(16 * j), 16) - 32 * sums[j]);
      } else {
        for (int j = 0; j < 8; ++j) {
          sum += scales[j] * dot_ints(q + 32 * j, xq + k_position(32 * j), 32);
          min_sum += mins[j] * (sums[2 * j] + sums[2 * j + 1]);
        }
      }
      acc[r] += d * dx * float(sum) - dmin * dx * float(min_sum);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

}  // namespace actorlm::quant::scalar
