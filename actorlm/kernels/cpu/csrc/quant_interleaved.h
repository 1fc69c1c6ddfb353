// Q4_0, Q4_1, Q5_0 and Q8_0 weights with 16 rows interleaved, and their dot products with
// AVX-512 VNNI: a 512-bit dpbusd then multiplies four values of 16 weight rows at once by the
// same four values of x, so the integer sum of a block builds up in one register per x row,
// lane i for weight row i, and the block's scales are applied once per 16 rows (the file's
// layout spends a shuffle, a conversion and a scale permute on every pair of blocks of every
// row). One row of x runs about 1.4x the file's layout on one Zen 4 core, and two cores read
// the weights at the memory's speed.
//
// The layout, per group of 16 rows and per block b of 32 values, its bytes the file's (the
// rows' blocks moved, none changed but Q5_0's high bits): the 16 rows' f16 d, Q4_1's 16 f16
// m, Q5_0's high bits as eight 64-bit masks (mask s: the bits of vector s's bytes below, its
// low nibbles' for s < 4, its high nibbles' beyond), then the quants as 64-byte vectors, row
// i's 4 bytes at 4 i. Q4 and Q5_0: vector t (t < 4) holds bytes 4t..4t+3 of the rows' 16,
// whose low nibbles are values 4t..4t+3 and high nibbles values 16 + 4t..; Q8_0: vector t
// holds values 4t..4t+3 (8 vectors). Groups follow one another, each with all of its blocks,
// so a run of groups is one stream. Sums as quant_vnni.h's: (q_w - o) q_x summed as
// sum q_w q_x - o sum q_x (Q5_0 o = 16; Q8_0 as q + 128, o = 128), in fp32
// d_w (d_x sum - o dsum_x).
#pragma once
#include "quant_vnni.h"
#ifdef ACTORLM_QUANT_VNNI

#include <cstring>

namespace actorlm::quant::interleaved {

constexpr int kRows = 16;

constexpr bool kept(int type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ8_0;
}

// Bytes of one group's block: 16 blocks of the format
template <int Type>
constexpr int kGroupBlockBytes = kRows * kFormats[type_index(Type)].bytes;
// Where a group's block keeps its quants: after its f16 fields (and Q5_0's masks)
constexpr int quants_at(int type) { return type == kQ4_1 ? 64 : type == kQ5_0 ? 96 : 32; }
constexpr int num_vectors(int type) { return type == kQ8_0 ? 8 : 4; }

// Q5_0: which mask (vector) and which bit of it hold value j's high bit in row i
inline int high_mask(int j) { return j < 16 ? j / 4 : 4 + (j - 16) / 4; }
inline int high_bit(int i, int j) { return 4 * i + j % 4; }

template <int Type>
void interleave(const uint8_t* src, int64_t rows, int64_t blocks, uint8_t* dst) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  constexpr int kScales = Type == kQ4_1 ? 2 : 1;  // f16 fields
  constexpr int kQs = Type == kQ5_0 ? q5_0::kQs : 2 * kScales;
  for (int64_t g = 0; g < rows / kRows; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* out = dst + (g * blocks + b) * kGroupBlockBytes<Type>;
      uint64_t masks[8] = {};
      for (int r = 0; r < kRows; ++r) {
        const uint8_t* block = src + ((g * kRows + r) * blocks + b) * kBytes;
        for (int s = 0; s < kScales; ++s) std::memcpy(out + 32 * s + 2 * r, block + 2 * s, 2);
        for (int t = 0; t < num_vectors(Type); ++t)
          std::memcpy(out + quants_at(Type) + 64 * t + 4 * r, block + kQs + 4 * t, 4);
        if constexpr (Type == kQ5_0) {
          const uint32_t qh = load_u32(block + q5_0::kQh);
          for (int j = 0; j < 32; ++j)
            masks[high_mask(j)] |= uint64_t(qh >> j & 1) << high_bit(r, j);
        }
      }
      if constexpr (Type == kQ5_0) std::memcpy(out + 32, masks, sizeof masks);
    }
}

// Q5_0: row i's qh from its group block's masks
inline uint32_t high_bits(const uint8_t* group_block, int i) {
  uint64_t masks[8];
  std::memcpy(masks, group_block + 32, sizeof masks);
  uint32_t qh = 0;
  for (int j = 0; j < 32; ++j) qh |= uint32_t(masks[high_mask(j)] >> high_bit(i, j) & 1) << j;
  return qh;
}

// Row r's block b back in the file's layout, into block (the format's bytes): an embedding
// lookup's few rows of a weight a tied LM head keeps interleaved
inline void file_block(int type, const uint8_t* w, int64_t blocks, int64_t r, int64_t b,
                       uint8_t* block) {
  const int scales = type == kQ4_1 ? 2 : 1;
  const int qs = type == kQ5_0 ? q5_0::kQs : 2 * scales;
  const int64_t group_block = kRows * kFormats[type_index(type)].bytes;
  const uint8_t* from = w + ((r / kRows) * blocks + b) * group_block;
  const int i = r % kRows;
  for (int s = 0; s < scales; ++s) std::memcpy(block + 2 * s, from + 32 * s + 2 * i, 2);
  for (int t = 0; t < num_vectors(type); ++t)
    std::memcpy(block + qs + 4 * t, from + quants_at(type) + 64 * t + 4 * i, 4);
  if (type == kQ5_0) {
    const uint32_t qh = high_bits(from, i);
    std::memcpy(block + q5_0::kQh, &qh, 4);
  }
}

// Group g's 16 rows back in the file's layout, into out (16 rows of blocks x the format's
// bytes): each 64-byte vector of quants holds 4 bytes of each row, so four (Q8_0: two fours) of
// them are a 4 x 16 matrix of 4-byte pieces, transposed 4 x 4 within each 128-bit lane
template <int Type>
void file_rows(const uint8_t* w, int64_t g, int64_t blocks, uint8_t* out) {
  constexpr int kBytes = kFormats[type_index(Type)].bytes;
  constexpr int kScales = Type == kQ4_1 ? 2 : 1, kVectors = num_vectors(Type);
  constexpr int kQs = Type == kQ5_0 ? q5_0::kQs : 2 * kScales;
  const int64_t row_bytes = blocks * kBytes;
  const uint8_t* group = w + g * blocks * kGroupBlockBytes<Type>;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* from = group + b * kGroupBlockBytes<Type>;
    uint8_t* block = out + b * kBytes;  // row r's at block + r row_bytes
    for (int r = 0; r < kRows; ++r) {
      for (int s = 0; s < kScales; ++s)
        std::memcpy(block + r * row_bytes + 2 * s, from + 32 * s + 2 * r, 2);
      if constexpr (Type == kQ5_0) {
        const uint32_t qh = high_bits(from, r);
        std::memcpy(block + r * row_bytes + q5_0::kQh, &qh, 4);
      }
    }
    for (int four = 0; four < kVectors / 4; ++four) {  // quants bytes [16 four, 16 four + 16)
      const uint8_t* v = from + quants_at(Type) + 256 * four;
      const __m512i v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + 64),
                    v2 = _mm512_loadu_si512(v + 128), v3 = _mm512_loadu_si512(v + 192);
      const __m512i t0 = _mm512_unpacklo_epi32(v0, v1), t1 = _mm512_unpackhi_epi32(v0, v1),
                    t2 = _mm512_unpacklo_epi32(v2, v3), t3 = _mm512_unpackhi_epi32(v2, v3);
      // r[i], 128-bit lane j: row 4 j + i's 16 bytes
      const __m512i r[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                            _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
      alignas(64) uint8_t lanes[4][64];
      for (int i = 0; i < 4; ++i) _mm512_store_si512(lanes[i], r[i]);
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i)
          std::memcpy(block + (4 * j + i) * row_bytes + kQs + 16 * four,
                      lanes[i] + 16 * j, 16);
    }
  }
}

// out[i R + t] = weight row 16 g + i . x row row0 + t, for the groups [0, num_groups) at w
template <int Type, int R>
void dot16(const uint8_t* w, int64_t num_groups, int64_t blocks, const Activations& x,
           int64_t row0, float* out) {
  constexpr float kOffset = Type == kQ4_0 ? 8.f : Type == kQ5_0 ? 16.f : Type == kQ8_0 ? 128.f
                                                                                  : 0.f;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* qs[R];
  const float *d[R], *dsum[R];
  for (int t = 0; t < R; ++t)
    qs[t] = x.qs_of(row0 + t), d[t] = x.d_of(row0 + t), dsum[t] = x.dsum_of(row0 + t);
  for (int64_t g = 0; g < num_groups; ++g) {
    const uint8_t* group = w + g * blocks * kGroupBlockBytes<Type>;
    __m512 acc[R], acc_min[R];
    for (int t = 0; t < R; ++t) acc[t] = acc_min[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = group + b * kGroupBlockBytes<Type>;
      const uint8_t* quants = block + quants_at(Type);
      __m512i q[8];  // the 8 steps of 4 values, unsigned
      if constexpr (Type == kQ8_0) {
        for (int s = 0; s < 8; ++s)
          q[s] = _mm512_xor_si512(_mm512_loadu_si512(quants + 64 * s), _mm512_set1_epi8(char(0x80)));
      } else {
        for (int s = 0; s < 4; ++s) {
          const __m512i v = _mm512_loadu_si512(quants + 64 * s);
          q[s] = _mm512_and_si512(v, low);
          q[s + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        if constexpr (Type == kQ5_0) {  // 16 more where a value's high bit is set
          uint64_t masks[8];
          std::memcpy(masks, block + 32, sizeof masks);
          for (int s = 0; s < 8; ++s)
            q[s] = _mm512_mask_add_epi8(q[s], _cvtu64_mask64(masks[s]), q[s],
                                        _mm512_set1_epi8(16));
        }
      }
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
      const __m512 mw = Type == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(block + 32)))
                                      : _mm512_setzero_ps();
      for (int t = 0; t < R; ++t) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(qs[t] + b * 32);
        __m512i sum = _mm512_setzero_si512();
        for (int s = 0; s < 8; ++s) {  // x's values 4s..4s+3 (Q4's high nibbles: 16 + 4(s - 4)..)
          int32_t four;
          std::memcpy(&four, xq + s, 4);
          sum = _mm512_dpbusd_epi32(sum, q[s], _mm512_set1_epi32(four));
        }
        const __m512 scaled = kOffset != 0.f
            ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d[t][b]),
                              _mm512_set1_ps(-kOffset * dsum[t][b]))
            : _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d[t][b]));
        acc[t] = _mm512_fmadd_ps(scaled, dw, acc[t]);
        if constexpr (Type == kQ4_1)
          acc_min[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dsum[t][b]), acc_min[t]);
      }
    }
    for (int t = 0; t < R; ++t) {
      alignas(64) float lanes[kRows];
      _mm512_store_ps(lanes, Type == kQ4_1 ? _mm512_add_ps(acc[t], acc_min[t]) : acc[t]);
      for (int i = 0; i < kRows; ++i) out[(g * kRows + i) * R + t] = lanes[i];
    }
  }
}

}  // namespace actorlm::quant::interleaved

#endif
