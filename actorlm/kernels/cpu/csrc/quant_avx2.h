// The dot products of quant_scalar.h with AVX2: 32 values a step, maddubs (pairs of u8 x s8
// into int16) then madd (pairs of int16 into int32, times 1 or the K sub-block's scale), so a
// 32-bit lane holds 4 products as VNNI's dpbusd does and starts from quant_act.h's per-lane
// offset terms.
// maddubs saturates past 32767: the unsigned weights stay below 64, and Q8_0's int8 weights
// enter as |q| against x with q's sign (2 * 128 * 127 fits).
#pragma once
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ACTORLM_QUANT_AVX2 1
#include <immintrin.h>

#include <cstdint>

#include "quant_act.h"
#include "quant_blocks.h"

namespace actorlm::quant::avx2 {

inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 16 bytes of nibbles (low: values 0-15, high: 16-31) as 32 bytes in value order
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

// 16 for each set bit of `bits`, byte i for bit i
inline __m256i sixteens(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i <- byte i / 8 of bits
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(16));
}

// int32 lanes of 4 products each: u8 w x s8 x
inline __m256i dot4(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

template <int Type, int R>
void dot32(const uint8_t* w, int64_t blocks, const Activations& x, int64_t row0, float* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  constexpr int kOffset = Type == kQ4_0 ? 0 : Type == kQ5_0 ? 1 : -1;  // in kOffsets
  __m256 acc[R];
  float acc_min[R] = {};  // Q4_1: sum_b m_b d_x sum q_x
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * kBytes;
    const float d = f16_at(block);
    __m256i q;
    if constexpr (Type == kQ8_0) q = load256(block + q8_0::kQs);  // signed
    else if constexpr (Type == kQ5_0)
      q = _mm256_or_si256(nibbles(block + q5_0::kQs), sixteens(load_u32(block + q5_0::kQh)));
    else q = nibbles(block + (Type == kQ4_1 ? q4_1::kQs : q4_0::kQs));
    const __m256i magnitude = Type == kQ8_0 ? _mm256_sign_epi8(q, q) : q;
    for (int r = 0; r < R; ++r) {
      __m256i xq = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.qs_of(row0 + r) + b * 32));
      if constexpr (Type == kQ8_0) xq = _mm256_sign_epi8(xq, q);
      __m256i sum = dot4(magnitude, xq);
      if constexpr (kOffset >= 0)
        sum = _mm256_add_epi32(sum, _mm256_load_si256(reinterpret_cast<const __m256i*>(
                                        x.lane_offset_of(kOffset, row0 + r) + b * 8)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * x.d_of(row0 + r)[b]),
                               acc[r]);
      if constexpr (Type == kQ4_1) acc_min[r] += f16_at(block + q4_1::kM) * x.dsum_of(row0 + r)[b];
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    out[r] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t))) + acc_min[r];
  }
}

// bits `from` and `from + 1` of each byte moved to bits 4-5 (the rest zero)
inline __m256i bits_to_4(__m256i v, int from) {
  const __m256i moved = from <= 4 ? _mm256_slli_epi16(v, 4 - from) : _mm256_srli_epi16(v, from - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
}

template <int Type, int R>
void dot_k(const uint8_t* w, int64_t blocks, const Activations& x, int64_t row0, float* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * kBytes;
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    // the integer sums of 32 values q against x [32 at], times the scales of their two 16-runs
    auto add = [&](__m256i q, int at, __m256i scales) {
      for (int r = 0; r < R; ++r) {
        const __m256i xq = load256(x.qs_k_of(row0 + r) + b * 256 + k_position(at));
        sums[r] = _mm256_add_epi32(
            sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xq), scales));
      }
    };
    float d, dmin = 0.f;
    int scales[16], mins[8] = {};
    if constexpr (Type == kQ6_K) {
      d = f16_at(block + q6_k::kD);
      for (int j = 0; j < 16; ++j) scales[j] = int8_t(block[q6_k::kScales + j]);
      for (int part = 0; part < 8; ++part) {  // values [32 part, +32)
        const int half = part / 4, nibble = (part / 2) % 2, second = part % 2;
        const __m256i ql = load256(block + q6_k::kQl + 64 * half + 32 * second);
        const __m256i qh = load256(block + q6_k::kQh + 32 * half);
        const __m256i q = _mm256_or_si256(
            _mm256_and_si256(nibble ? _mm256_srli_epi16(ql, 4) : ql, low4),
            bits_to_4(qh, 2 * (2 * nibble + second)));
        add(q, 32 * part, _mm256_set_m128i(_mm_set1_epi16(short(scales[2 * part + 1])),
                                           _mm_set1_epi16(short(scales[2 * part]))));
      }
      const __m256i scales16 = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + q6_k::kScales)));
      for (int r = 0; r < R; ++r) {  // less 32 sum_j scale_j sum q_x
        const __m256i offset = _mm256_madd_epi16(scales16, load256(x.sums_k_of(row0 + r) + b * 16));
        sums[r] = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(offset, 5));
      }
    } else {
      d = f16_at(block + q4_k::kD), dmin = f16_at(block + q4_k::kDmin);
      for (int j = 0; j < 8; ++j) scale_min_k4(block + q4_k::kScales, j, &scales[j], &mins[j]);
      const uint8_t* qs = block + (Type == kQ5_K ? q5_k::kQs : q4_k::kQs);
      const __m256i qh = Type == kQ5_K ? load256(block + q5_k::kQh) : _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {  // sub-block j: nibble j % 2 of qs [32 (j / 2), +32)
        const __m256i packed = load256(qs + 32 * (j / 2));
        __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(packed, 4) : packed, low4);
        if constexpr (Type == kQ5_K)  // bit j of qh[l] as 16
          q = _mm256_or_si256(q, _mm256_and_si256(bits_to_4(qh, j), _mm256_set1_epi8(16)));
        add(q, 32 * j, _mm256_set1_epi16(short(scales[j])));
      }
    }
    __m256i mins16 = _mm256_setzero_si256();  // each min twice: per 16-value sum of x
    if constexpr (Type != kQ6_K)
      mins16 = _mm256_set_epi16(short(mins[7]), short(mins[7]), short(mins[6]), short(mins[6]),
                                short(mins[5]), short(mins[5]), short(mins[4]), short(mins[4]),
                                short(mins[3]), short(mins[3]), short(mins[2]), short(mins[2]),
                                short(mins[1]), short(mins[1]), short(mins[0]), short(mins[0]));
    for (int r = 0; r < R; ++r) {
      const float dx = x.d_k_of(row0 + r)[b];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(d * dx), acc[r]);
      if constexpr (Type != kQ6_K) {
        const __m256i min_sums = _mm256_madd_epi16(mins16, load256(x.sums_k_of(row0 + r) + b * 16));
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(min_sums), _mm256_set1_ps(dmin * dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    out[r] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
}

}  // namespace actorlm::quant::avx2

#endif
