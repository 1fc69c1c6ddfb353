// The dot products of quant_scalar.h with AVX-512 VNNI, 32-value formats (the K formats:
// quant_vnni_k.h): a weight row's blocks unpacked once into 64 unsigned bytes per pair of
// blocks and multiplied into each of the R rows of x.
//
// A pair is read with one load and spread with one byte permute (VBMI; without it, two
// broadcasts) and a bit-matrix affine map that picks the nibbles (GFNI). dpbusd (u8 weights x
// s8 x, 4 products a 32-bit lane) starts from the lane's offset term (quant_act.h), so the
// integer sum is exact; each lane then adds float(sum) * d_w d_x to an fp32 accumulator (two,
// to hide the FMA's latency), and the lanes are summed at the row's end. Q8_0's int8 weights
// enter as q + 128 (unsigned), whose offset 128 takes it back.
//
// What limits it on Zen 4 (measured, one core): a 512-bit op issues at one a cycle per kind
// (FMA-pipe ops: dpbusd, FMA, GFNI; conversions; shuffles), and an f16 -> fp32 conversion
// costs two. So four pairs' eight f16 scales (and Q4_1's mins) are gathered by word permutes
// and converted at once, multiplied by x's eight block scales in one op and spread per pair
// with one permute; Q4_1's min term, m_w d_x sum q_x, is one FMA per eight blocks. About 6
// cycles a pair (64 weights) for one row, 4 more for each further row.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define ACTORLM_QUANT_VNNI 1
#include <immintrin.h>

#include <cstdint>

#include "quant_act.h"
#include "quant_blocks.h"

namespace actorlm::quant::vnni {

inline __mmask64 first_bytes(int n) { return n >= 64 ? ~0ull : (1ull << n) - 1; }

// The permutes of a pair of 32-value blocks (their bytes from the first block's start): bytes,
// each block's 16 nibble bytes twice (Q8_0: its 32 bytes, the second block's from a second
// register); words, the first block's d 8 times then the second's.
struct alignas(64) PairIndex {
  uint8_t bytes[64];
  uint16_t words[32];
};
template <int Type>
constexpr PairIndex pair_index() {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  constexpr int kQs = Type == kQ4_1 ? q4_1::kQs : Type == kQ5_0 ? q5_0::kQs : q4_0::kQs;
  PairIndex p{};
  for (int i = 0; i < 64; ++i)
    p.bytes[i] = uint8_t(Type == kQ8_0 ? (i < 32 ? q8_0::kQs + i : 64 + i - 32)
                                       : i / 32 * kBytes + kQs + i % 16);
  for (int i = 0; i < 16; ++i) p.words[i] = uint16_t(i / 8 * kBytes / 2);
  return p;
}
template <int Type>
inline constexpr PairIndex kPairIndex = pair_index<Type>();

// Which of quant_act.h's offset terms starts a lane's sum (-1: none)
template <int Type>
constexpr int kOffsetOf = Type == kQ4_0 ? 0 : Type == kQ5_0 ? 1 : Type == kQ8_0 ? 2 : -1;

// The low nibbles of 128-bit lanes 0 and 2, the high of 1 and 3, as bytes (GFNI: one affine
// map per 64 bits, its bit matrix picking the nibble)
inline __m512i low_high_nibbles(__m512i v) {
#ifdef __GFNI__
  constexpr long long kLow = 0x0102040800000000, kHigh = 0x1020408000000000;
  return _mm512_gf2p8affine_epi64_epi8(
      v, _mm512_set_epi64(kHigh, kHigh, kLow, kLow, kHigh, kHigh, kLow, kLow), 0);
#else
  return _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)),
                          _mm512_set1_epi8(0x0F));
#endif
}

// The high nibble of each byte
inline __m512i high_nibbles(__m512i v) {
#ifdef __GFNI__
  return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000), 0);
#else
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
#endif
}

// Row r of a tile's x, where the 32-value kernels read it
struct Rows32 {
  const int8_t* qs;
  const float *d, *dsum;  // per block
  const int32_t* offset;  // per lane
};

// The bytes of a pair of blocks (or of one), none past them read
template <int Type, bool kTwo>
inline __m512i load_pair(const uint8_t* b0) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  return _mm512_maskz_loadu_epi8(first_bytes(kTwo ? 2 * kBytes : kBytes), b0);
}

// The integers of the pair whose bytes `raw` start at b0
template <int Type, bool kTwo>
inline __m512i pair_weights(__m512i raw, const uint8_t* b0) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  const PairIndex& index = kPairIndex<Type>;
  if constexpr (Type == kQ8_0) {
    const __m512i second =
        kTwo ? _mm512_castsi256_si512(_mm256_loadu_si256(
                   reinterpret_cast<const __m256i*>(b0 + kBytes + q8_0::kQs)))
             : _mm512_setzero_si512();
#ifdef __AVX512VBMI__
    const __m512i q = _mm512_permutex2var_epi8(raw, _mm512_load_si512(index.bytes), second);
#else
    const __m512i q = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
        _mm512_castsi512_si256(second), 1);
#endif
    return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
  } else {
#ifdef __AVX512VBMI__
    const __m512i twice = _mm512_permutexvar_epi8(_mm512_load_si512(index.bytes), raw);
#else
    const __m128i* qs = reinterpret_cast<const __m128i*>(b0 + index.bytes[0]);
    __m512i twice = _mm512_broadcast_i32x4(_mm_loadu_si128(qs));
    twice = kTwo ? _mm512_mask_broadcast_i32x4(
                       twice, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                          reinterpret_cast<const uint8_t*>(qs) + kBytes)))
                 : _mm512_maskz_mov_epi32(0x00FF, twice);
#endif
    // 128-bit lanes 1 and 3 take the high nibbles: values 16-31 of each block
    __m512i w = low_high_nibbles(twice);
    if constexpr (Type == kQ5_0) {  // bit i of qh: 16 more for value i
      const uint64_t high = load_u32(b0 + q5_0::kQh) |
                            (kTwo ? uint64_t(load_u32(b0 + kBytes + q5_0::kQh)) << 32 : 0);
      w = _mm512_mask_add_epi8(w, _cvtu64_mask64(high), w, _mm512_set1_epi8(16));
    }
    return w;
  }
}

// Four pairs' scales at once (a conversion is a pair's dearest step): their 8 d (and m)
// gathered into one vector by word permutes and converted together
struct alignas(64) QuadIndex {
  uint16_t pairs[32], quad[32];
};
template <int Type>
constexpr QuadIndex quad_index() {
  constexpr int kHalf = kFormats[type_index(Type)].bytes / 2;  // the second block's d, in words
  QuadIndex q{};
  for (int i = 0; i < 32; ++i) {  // [d a0, d a1, d b0, d b1, m a0, m a1, m b0, m b1] of pairs a, b
    const int j = i % 8, m = j / 4, pair = j % 4 / 2, second = j % 2;
    q.pairs[i] = uint16_t(32 * pair + kHalf * second + m);
    // then [the 4 d of ab, the 4 d of cd, the 4 m of ab, the 4 m of cd]
    const int of_cd = i % 8 / 4, within = i % 4 + 4 * (i / 8 % 2);
    q.quad[i] = uint16_t(i < 16 ? 32 * of_cd + within : 0);
  }
  return q;
}
template <int Type>
inline constexpr QuadIndex kQuadIndex = quad_index<Type>();

// lanes 0-7: the 8 blocks' d of pairs raw[0..3]; 8-15: their m
template <int Type>
inline __m512 quad_scales(const __m512i* raw) {
  const QuadIndex& index = kQuadIndex<Type>;
  const __m512i pairs = _mm512_load_si512(index.pairs);
  const __m512i ab = _mm512_permutex2var_epi16(raw[0], pairs, raw[1]);
  const __m512i cd = _mm512_permutex2var_epi16(raw[2], pairs, raw[3]);
  return _mm512_cvtph_ps(_mm512_castsi512_si256(
      _mm512_permutex2var_epi16(ab, _mm512_load_si512(index.quad), cd)));
}

// lanes 0-7 the scale at a, 8-15 the one at a + 1
inline __m512 spread(const float* a) {
  return _mm512_mask_broadcastss_ps(_mm512_set1_ps(a[0]), 0xFF00, _mm_load_ss(a + 1));
}

// A pair's integer sums for row r of x, started at the lanes' offset terms
template <int Type>
inline __m512i pair_sum(__m512i w, int64_t b, const Rows32& row) {
  __m512i sum = _mm512_setzero_si512();
  if constexpr (kOffsetOf<Type> >= 0) sum = _mm512_load_si512(row.offset + b * 8);
  return _mm512_dpbusd_epi32(sum, w, _mm512_load_si512(row.qs + b * 32));
}

template <int Type, int R>
void dot32(const uint8_t* w, int64_t blocks, const Activations& x, int64_t row0, float* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  Rows32 rows[R];
  for (int r = 0; r < R; ++r)
    rows[r] = {x.qs_of(row0 + r), x.d_of(row0 + r), x.dsum_of(row0 + r),
               kOffsetOf<Type> >= 0 ? x.lane_offset_of(kOffsetOf<Type>, row0 + r) : nullptr};
  __m512 even[R], odd[R];  // the even and odd pairs' sums: two chains of FMAs, not one
  __m256 acc_min[R];       // Q4_1: m_b d_x sum q_x, per block of 8
  for (int r = 0; r < R; ++r)
    even[r] = odd[r] = _mm512_setzero_ps(), acc_min[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 7 < blocks; b += 8) {  // 4 pairs, their scales together
    __m512i raw[4];
    for (int j = 0; j < 4; ++j) raw[j] = load_pair<Type, true>(w + (b + 2 * j) * kBytes);
    const __m512 dm = quad_scales<Type>(raw);
    __m512 scales[R];  // lanes 0-7: d_w d_x of the 8 blocks
    for (int r = 0; r < R; ++r) {
      scales[r] = _mm512_castps256_ps512(
          _mm256_mul_ps(_mm512_castps512_ps256(dm), _mm256_loadu_ps(rows[r].d + b)));
      if constexpr (Type == kQ4_1)
        acc_min[r] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(dm, 1),
                                     _mm256_loadu_ps(rows[r].dsum + b), acc_min[r]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i q = pair_weights<Type, true>(raw[j], w + (b + 2 * j) * kBytes);
      const __m512i lanes = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                             2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j,
                                             2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j);
      __m512* acc = j % 2 ? odd : even;
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sum<Type>(q, b + 2 * j, rows[r])),
                                 _mm512_permutexvar_ps(lanes, scales[r]), acc[r]);
    }
  }
  float tail_min[R] = {};
  for (; b < blocks; b += 2) {  // the last pairs, with their own scales (and a last block)
    const bool two = b + 1 < blocks;
    const uint8_t* b0 = w + b * kBytes;
    const __m512i raw = two ? load_pair<Type, true>(b0) : load_pair<Type, false>(b0);
    const __m512i q = two ? pair_weights<Type, true>(raw, b0) : pair_weights<Type, false>(raw, b0);
    const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(
        _mm512_permutexvar_epi16(_mm512_load_si512(kPairIndex<Type>.words), raw)));
    for (int r = 0; r < R; ++r) {
      const float dx[2] = {rows[r].d[b], two ? rows[r].d[b + 1] : 0.f};
      even[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_sum<Type>(q, b, rows[r])),
                                _mm512_mul_ps(dw, spread(dx)), even[r]);
      if constexpr (Type == kQ4_1)
        for (int i = 0; i < (two ? 2 : 1); ++i)
          tail_min[r] += f16_at(b0 + i * kBytes + q4_1::kM) * rows[r].dsum[b + i];
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 m = acc_min[r];
    const __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 m2 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) +
             _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2))) + tail_min[r];
  }
}

}  // namespace actorlm::quant::vnni

#endif
