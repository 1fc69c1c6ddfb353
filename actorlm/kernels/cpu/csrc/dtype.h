// fp32 and bf16 (carried as its 16 bits) for the CPU kernels: reads widen to fp32, writes round
// to nearest even as torch does; rounded() is a value as torch would hold it in that dtype.
// And the FP8 formats of a KV cache (--kv-cache-dtype): E4M3 (no infinities, 448 its largest)
// and E5M2, written as vLLM converts with a scale of one (to the nearest, ties to even,
// saturating at the largest finite value), read back exactly.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace actorlm {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline uint16_t to_bf16(float x) {  // finite values
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}
inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) { *out = to_bf16(x); }
inline float rounded(float x, const float*) { return x; }
inline float rounded(float x, const uint16_t*) { return to_float(to_bf16(x)); }

// An FP8 format with kMantissa bits of mantissa and exponent bias kBias, kLargestBits the bits
// of its largest finite value (one byte: its sign, then exponent and mantissa as one 7-bit
// number, "em").
template <int kMantissa, int kBias, int kLargestBits>
struct Fp8 {
  uint8_t bits;
  static constexpr int kMinNormalEm = 1 << kMantissa;  // em of the smallest normal value
};
using E4M3 = Fp8<3, 7, 0x7E>;  // 448
using E5M2 = Fp8<2, 15, 0x7B>;  // 57344

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

template <int M, int B, int L>
inline float to_float(Fp8<M, B, L> x) {
  const uint32_t em = x.bits & 0x7F, sign = uint32_t(x.bits & 0x80) << 24;
  if (em >= Fp8<M, B, L>::kMinNormalEm)  // normal: em is fp32's exponent (rebiased) and mantissa
    return float_of(sign | ((em << (23 - M)) + (uint32_t(127 - B) << 23)));
  // subnormal: em units of the smallest one, 2^(1 - B - M)
  return float_of(sign | bits_of(float(em) * std::ldexp(1.f, 1 - B - M)));
}

template <int M, int B, int L>
inline void store(float x, Fp8<M, B, L>* out) {
  const uint32_t sign = (bits_of(x) >> 24) & 0x80;
  const float largest = to_float(Fp8<M, B, L>{uint8_t(L)});
  const float a = std::min(std::fabs(x), largest);  // saturated
  uint32_t em;
  if (a < std::ldexp(1.f, 1 - B)) {  // the subnormals' range: in units of the smallest one
    em = uint32_t(std::nearbyint(a * std::ldexp(1.f, B + M - 1)));  // (exact products)
  } else {  // fp32's mantissa cut to M bits, to the nearest even (a carry bumps the exponent)
    uint32_t b = bits_of(a);
    b += (1u << (22 - M)) - 1 + ((b >> (23 - M)) & 1);
    em = (b >> (23 - M)) - (uint32_t(127 - B) << M);
  }
  out->bits = uint8_t(sign | em);
}

#ifdef __AVX512F__
// Sixteen FP8 values widened to fp32, exactly: E5M2 is fp16's upper byte; E4M3's exponent and
// mantissa shift into fp32's and are rebiased (its subnormals, em < 8, are em units of 2^-9).
inline __m512 widen16(const E5M2* x) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}
inline __m512 widen16(const E4M3* x) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m512i em = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(0x1p-9f));
  const __m512 size = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(em, _mm512_set1_epi32(8)),
                                           subnormal, normal);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(size), sign));
}
#endif

}  // namespace actorlm
