// The dot products of quant_scalar.h with AVX-512 VNNI, K formats: 64 values a step,
// maddubs (pairs of u8 x s8 into int16: 2 * 63 * 127 never saturates) then dpwssd times the
// sub-blocks' integer scales, summed as int32 over the whole superblock; fp32 only once a
// superblock. The 64 bytes of a Q4_K half-superblock are two steps: their low nibbles are
// 32-runs 0 and 2, the high 1 and 3, and quant_act.h stores x in that order. Two
// FMA-pipe ops per 64 products a row: about 3.5 cycles for each row beyond the first.
#pragma once
#include "quant_vnni.h"
#ifdef ACTORLM_QUANT_VNNI

namespace actorlm::quant::vnni {

// Q4_K / Q5_K: the 8 scales (bytes 0-7) and 8 mins (8-15) of the 12 packed bytes at s, as
// scale_min_k4 reads them (reads 16 bytes: the block goes on past them)
inline __m128i scales_mins_k4(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));  // dwords a, b, c
  const __m128i acbc = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));
  const __m128i aabb = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(acbc, _mm_set_epi32(4, 0, 0, 0)),
                                    _mm_set_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F));
  const __m128i high = _mm_and_si128(_mm_srli_epi32(aabb, 2),
                                     _mm_set_epi32(0x30303030, 0, 0x30303030, 0));
  return _mm_or_si128(low, high);
}

// int16 lane i of a step: the scale of the sub-block of its pair of values, the step's four
// quarters (of 16 values) in sub-blocks `s[0..3]` (a 16-run's index for Q6_K, a 32-run's,
// each twice, for Q4_K / Q5_K)
struct alignas(64) ScaleIndex {
  int16_t lanes[32];
};
constexpr ScaleIndex scale_index(int a, int b, int c, int d) {
  ScaleIndex s{};
  const int quarter[4] = {a, b, c, d};
  for (int i = 0; i < 32; ++i) s.lanes[i] = int16_t(quarter[i / 8]);
  return s;
}
// [half][vector]: Q4_K / Q5_K low nibbles (32-runs 4 half, 4 half + 2), high (+1, +3);
// Q6_K's two vectors of a half (16-runs 8 half + {0, 1, 4, 5}, + {2, 3, 6, 7})
inline constexpr ScaleIndex kScalesK4[2][2] = {
    {scale_index(0, 0, 2, 2), scale_index(1, 1, 3, 3)},
    {scale_index(4, 4, 6, 6), scale_index(5, 5, 7, 7)}};
inline constexpr ScaleIndex kScalesK6[2][2] = {
    {scale_index(0, 1, 4, 5), scale_index(2, 3, 6, 7)},
    {scale_index(8, 9, 12, 13), scale_index(10, 11, 14, 15)}};

template <int Type, int R>
void dot_k(const uint8_t* w, int64_t blocks, const Activations& x, int64_t row0, float* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  __m256 acc_min[R];  // dmin d_x sum_j m_j sum q_x, subtracted at the end
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), acc_min[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * kBytes;
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    // the two 64-value vectors q of half h, the 16-bit scales of their pairs, into the sums
    auto add = [&](int h, const __m512i* q, const __m512i* scales) {
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.qs_k_of(row0 + r) + b * 256 + 128 * h;
        for (int v = 0; v < 2; ++v)
          sums[r] = _mm512_dpwssd_epi32(
              sums[r], _mm512_maddubs_epi16(q[v], _mm512_load_si512(xq + 64 * v)), scales[v]);
      }
    };
    float d;
    if constexpr (Type == kQ6_K) {
      d = f16_at(block + q6_k::kD);
      const __m256i scales16 = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + q6_k::kScales)));
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(block + q6_k::kQl + 64 * h);
        const __m512i low = _mm512_and_si512(ql, low4);
        const __m512i high = high_nibbles(ql);
        const __m512i qh = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + q6_k::kQh + 32 * h)));
        // vector 0: values 0-31 and 64-95 of the half, whose 2 high bits are bits 0-1 and 4-5
        // of qh[l]; vector 1: 32-63, 96-127, bits 2-3, 6-7. Rotated to bits 4-5 of their byte.
        const __m512i turns[2] = {_mm512_set_epi64(0, 0, 0, 0, 4, 4, 4, 4),
                                  _mm512_set_epi64(62, 62, 62, 62, 2, 2, 2, 2)};
        __m512i q[2] = {_mm512_shuffle_i64x2(low, high, 0x44),
                        _mm512_shuffle_i64x2(low, high, 0xEE)};
        __m512i scales[2];
        for (int v = 0; v < 2; ++v) {
          q[v] = _mm512_ternarylogic_epi64(q[v], _mm512_rolv_epi64(qh, turns[v]),
                                           _mm512_set1_epi8(0x30), 0xF8);  // a | (b & c)
          scales[v] = _mm512_permutexvar_epi16(_mm512_load_si512(kScalesK6[h][v].lanes),
                                               _mm512_castsi256_si512(scales16));
        }
        add(h, q, scales);
      }
      for (int r = 0; r < R; ++r) {  // less 32 sum_j scale_j sum q_x over the 16 sub-blocks
        const __m256i x_sums = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.sums_k_of(row0 + r) + b * 16));
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(scales16, x_sums), 5);
        sums[r] = _mm512_sub_epi32(sums[r], _mm512_zextsi256_si512(offset));
      }
    } else {
      d = f16_at(block + q4_k::kD);
      const __m128i scales_mins = scales_mins_k4(block + q4_k::kScales);
      const __m512i scales16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scales_mins));
      const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(  // each min twice
          scales_mins, _mm_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8)));
      const uint8_t* qs = block + (Type == kQ5_K ? q5_k::kQs : q4_k::kQs);
      __m512i qh = _mm512_setzero_si512();
      if constexpr (Type == kQ5_K)
        qh = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + q5_k::kQh)));
      for (int h = 0; h < 2; ++h) {
        const __m512i packed = _mm512_loadu_si512(qs + 64 * h);
        __m512i q[2] = {_mm512_and_si512(packed, low4),
                        high_nibbles(packed)};
        __m512i scales[2];
        for (int v = 0; v < 2; ++v) {
          if constexpr (Type == kQ5_K) {  // 32-run j's fifth bit: bit j of qh[l]
            const int j = 4 * h + v;
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << j)),
                                                   _mm256_set1_epi8(char(1 << (j + 2))), 1);
            q[v] = _mm512_mask_add_epi8(q[v], _mm512_test_epi8_mask(qh, bit), q[v],
                                        _mm512_set1_epi8(16));
          }
          scales[v] = _mm512_permutexvar_epi16(_mm512_load_si512(kScalesK4[h][v].lanes),
                                               scales16);
        }
        add(h, q, scales);
      }
      const __m256 dmin = _mm256_set1_ps(f16_at(block + q4_k::kDmin));
      for (int r = 0; r < R; ++r) {
        const __m256i x_sums = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.sums_k_of(row0 + r) + b * 16));
        const __m256 min_sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins16, x_sums));
        acc_min[r] = _mm256_fmadd_ps(
            min_sums, _mm256_mul_ps(dmin, _mm256_set1_ps(x.d_k_of(row0 + r)[b])), acc_min[r]);
      }
    }
    const __m512 dw = _mm512_set1_ps(d);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]),
                               _mm512_mul_ps(dw, _mm512_set1_ps(x.d_k_of(row0 + r)[b])), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    const __m256 m = acc_min[r];
    const __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 m2 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
    out[r] = _mm512_reduce_add_ps(acc[r]) - _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
  }
}

}  // namespace actorlm::quant::vnni

#endif
