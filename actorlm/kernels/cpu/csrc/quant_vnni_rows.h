// Weight rows dequantized with AVX-512 (quant_panel.h's panels), value for value as
// quant_blocks.h's dequantize_block computes them, rounded once to T (fp32, or bf16 bits to
// nearest even).
#pragma once
#include "dtype.h"
#include "quant_vnni.h"
#ifdef ACTORLM_QUANT_VNNI

namespace actorlm::quant::vnni {

// 16 values stored in T
template <typename T>
inline void store16(__m512 v, T* to) {
  if constexpr (sizeof(T) == 4) {
    _mm512_storeu_ps(to, v);
  } else {
#ifdef __AVX512BF16__
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), (__m256i)_mm512_cvtneps_pbh(v));
#else
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    for (int i = 0; i < 16; ++i) to[i] = to_bf16(f[i]);
#endif
  }
}

// A row of 32-value blocks dequantized into out: d (q - o), Q4_1 d q + m
template <int Type, typename T>
void dequantize_row32(const uint8_t* w, int64_t blocks, T* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  constexpr int kOffset = Type == kQ4_0 ? 8 : Type == kQ5_0 ? 16 : 0;
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool two = b + 1 < blocks;
    const uint8_t* b0 = w + b * kBytes;
    const __m512i raw = two ? load_pair<Type, true>(b0) : load_pair<Type, false>(b0);
    __m512i q = two ? pair_weights<Type, true>(raw, b0) : pair_weights<Type, false>(raw, b0);
    if constexpr (Type == kQ8_0) q = _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));  // int8
    for (int quarter = 0; quarter < (two ? 4 : 2); ++quarter) {  // 16 values of block quarter / 2
      const __m128i part = quarter == 0 ? _mm512_castsi512_si128(q)
                         : quarter == 1 ? _mm512_extracti32x4_epi32(q, 1)
                         : quarter == 2 ? _mm512_extracti32x4_epi32(q, 2)
                                        : _mm512_extracti32x4_epi32(q, 3);
      const __m512i ints = Type == kQ8_0 ? _mm512_cvtepi8_epi32(part)
                                         : _mm512_sub_epi32(_mm512_cvtepu8_epi32(part),
                                                            _mm512_set1_epi32(kOffset));
      const uint8_t* block = b0 + quarter / 2 * kBytes;
      const __m512 d = _mm512_set1_ps(f16_at(block));
      const __m512 v = Type == kQ4_1
                           ? _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(ints),
                                             _mm512_set1_ps(f16_at(block + q4_1::kM)))
                           : _mm512_mul_ps(d, _mm512_cvtepi32_ps(ints));
      store16(v, out + b * 32 + quarter * 16);
    }
  }
}

// 16 unsigned q8 as dequantize_block rounds them, scale q - shift (fma: scale q is exact)
template <typename T>
inline void store16(__m128i q8, float scale, float shift, T* to) {
  store16(_mm512_fmsub_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q8)),
                          _mm512_set1_ps(shift)),
          to);
}

// A row of K superblocks dequantized into out, value for value as dequantize_block does
template <int Type, typename T>
void dequantize_row_k(const uint8_t* w, int64_t blocks, T* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * kBytes;
    T* to = out + b * 256;
    if constexpr (Type == kQ6_K) {
      const float d = f16_at(block + q6_k::kD);
      for (int j = 0; j < 16; ++j) {  // 16-run j: values 16 j + [0, 16), r within their half
        const int half = j / 8, r = 16 * j % 128;
        const __m128i ql = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(block + q6_k::kQl + 64 * half + r % 64));
        const __m128i qh = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(block + q6_k::kQh + 32 * half + r % 32));
        const __m128i low = _mm_and_si128(_mm_srl_epi16(ql, _mm_cvtsi32_si128(4 * (r / 64))), low4);
        const __m128i high = _mm_and_si128(_mm_srl_epi16(qh, _mm_cvtsi32_si128(2 * (r / 32))),
                                           _mm_set1_epi8(3));
        const float ds = d * float(int8_t(block[q6_k::kScales + j]));
        store16(_mm_or_si128(low, _mm_slli_epi16(high, 4)), ds, 32.f * ds, to + 16 * j);
      }
    } else {
      const float d = f16_at(block + q4_k::kD), dmin = f16_at(block + q4_k::kDmin);
      const uint8_t* qs = block + (Type == kQ5_K ? q5_k::kQs : q4_k::kQs);
      for (int j = 0; j < 8; ++j) {  // 32-run j: nibble j % 2 of qs [32 (j / 2), +32)
        int scale, min;
        scale_min_k4(block + q4_k::kScales, j, &scale, &min);
        const float ds = d * float(scale), dm = dmin * float(min);
        for (int h = 0; h < 2; ++h) {
          const __m128i packed =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * (j / 2) + 16 * h));
          __m128i q = _mm_and_si128(j % 2 ? _mm_srli_epi16(packed, 4) : packed, low4);
          if constexpr (Type == kQ5_K) {  // bit j of qh[l] as 16
            const __m128i qh = _mm_loadu_si128(
                reinterpret_cast<const __m128i*>(block + q5_k::kQh + 16 * h));
            q = _mm_or_si128(q, _mm_slli_epi16(_mm_and_si128(
                                    _mm_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm_set1_epi8(1)), 4));
          }
          store16(q, ds, dm, to + 32 * j + 16 * h);
        }
      }
    }
  }
}

}  // namespace actorlm::quant::vnni

#endif
