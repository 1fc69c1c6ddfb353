// The activations of a quantized linear layer, quantized once per call to int8, as ggml does
// (its Q8_0 and Q8_K): the integer dot products of the kernels then take the weights' integers
// straight from their blocks.
//
// Per block of x, d = max |x| / 127 and q = round(x / d), so |x - d q| <= d / 2. The 32-value
// weight formats pair with 32-value blocks of x, each with its d and d times the sum of its q
// (Q4_1's min: m d_x sum q_x). Their kernels sum 4 products per 32-bit lane (VNNI's dpbusd,
// AVX2's maddubs + madd), and a weight offset o (Q4_0 8, Q5_0 16, Q8_0 as q + 128: 128) enters
// each lane's integer sum as its start, sum (q_w - o) q_x = sum q_w q_x - o sum q_x: those
// starts are laid out per lane, ready to load. The K formats pair with 256-value blocks of x
// and the sums of its 16-value runs (their sub-blocks' mins and offsets), ggml's Q8_K. Their q
// are stored in the order the AVX-512 kernel unpacks a Q4_K superblock's nibbles, 64 bytes of
// them at a time: of each 128 values, the 32-runs 0, 2, 1, 3 (the low nibbles of 64 bytes are
// runs 0 and 2). With AVX-512 a block is quantized in registers, 16 values an op.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "dtype.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace actorlm::quant {

constexpr int64_t kAlign = 64;
constexpr int kOffsets[3] = {8, 16, 128};  // the weights' offsets: Q4_0, Q5_0, Q8_0 (as q + 128)
constexpr int kRunOrder[4] = {0, 2, 1, 3};   // where each 32-run of 128 K values is stored

// Where value i of a K superblock's x is stored
inline int k_position(int i) { return i / 128 * 128 + kRunOrder[i / 32 % 4] * 32 + i % 32; }

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// x [rows, k] quantized; each array's rows 64-byte aligned, zero past k (a pair of 32-blocks
// read past an odd last block multiplies zeros)
struct Activations {
  int64_t rows = 0, k = 0, k64 = 0;  // k64: k rounded up to 64, a row of qs
  // 32-value blocks
  int8_t* qs = nullptr;        // [rows][k64]
  float* d = nullptr;          // [rows][k64 / 32]: each block's d
  float* dsum = nullptr;       // [rows][k64 / 32]: d times the sum of the block's q
  int32_t* lane_offset[3] = {};  // [offset][rows][k64 / 4]: -o times the sum of each 4 q, o
                                 // kOffsets[offset]
  // 256-value blocks
  int8_t* qs_k = nullptr;      // [rows][k64], in kRunOrder
  float* d_k = nullptr;        // [rows][k64 / 256 + 1]
  int16_t* sums_k = nullptr;   // [rows][k64 / 16]: the sum of each 16 values' q

  const int8_t* qs_of(int64_t r) const { return qs + r * k64; }
  const float* d_of(int64_t r) const { return d + r * (k64 / 32); }
  const float* dsum_of(int64_t r) const { return dsum + r * (k64 / 32); }
  const int32_t* lane_offset_of(int offset, int64_t r) const {
    return lane_offset[offset] + r * (k64 / 4);
  }
  const int8_t* qs_k_of(int64_t r) const { return qs_k + r * k64; }
  const float* d_k_of(int64_t r) const { return d_k + r * (k64 / 256 + 1); }
  const int16_t* sums_k_of(int64_t r) const { return sums_k + r * (k64 / 16); }
};

// The bytes Activations of rows x k take, and the arrays laid out in `memory` (64-aligned)
inline int64_t activations_bytes(int64_t rows, int64_t k) {
  const int64_t k64 = round_up(k, 64);
  return rows * (5 * k64 + k64 / 4 + k64 / 8 + (k64 / 256 + 1) * 4) + 10 * kAlign;
}
inline Activations lay_out(char* memory, int64_t rows, int64_t k) {
  Activations a;
  a.rows = rows, a.k = k, a.k64 = round_up(k, 64);
  char* p = memory;
  auto take = [&](int64_t bytes) {
    char* at = p;
    p += round_up(bytes, kAlign);
    return at;
  };
  a.qs = reinterpret_cast<int8_t*>(take(rows * a.k64));
  a.d = reinterpret_cast<float*>(take(rows * a.k64 / 8));
  a.dsum = reinterpret_cast<float*>(take(rows * a.k64 / 8));
  for (int32_t*& offset : a.lane_offset) offset = reinterpret_cast<int32_t*>(take(rows * a.k64));
  a.qs_k = reinterpret_cast<int8_t*>(take(rows * a.k64));
  a.d_k = reinterpret_cast<float*>(take(rows * (a.k64 / 256 + 1) * 4));
  a.sums_k = reinterpret_cast<int16_t*>(take(rows * a.k64 / 8));
  return a;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ACTORLM_QUANT_X_AVX512 1
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {  // bf16 bits: the high half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
#endif

// d and q of n values (n a multiple of 16, <= 256): q[i] = round(x[i] / d) (to nearest even,
// as x[i] * (127 / max |x|) in fp32), |q| <= 127
template <typename T>
inline float quantize_block(const T* x, int n, int8_t* q) {
#ifdef ACTORLM_QUANT_X_AVX512
  __m512 largest = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(load16(x + i)));
  const float amax = _mm512_reduce_max_ps(largest);
  const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  for (int i = 0; i < n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(
        _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + i), inverse))));
#else
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < n; ++i) q[i] = int8_t(std::nearbyint(to_float(x[i]) * inverse));
#endif
  return amax / 127.f;
}

// row r of x (k values) into the 32-value arrays; k a multiple of 32
template <typename T>
void quantize_row_32(const T* x, const Activations& a, int64_t r) {
  int8_t* qs = a.qs + r * a.k64;
  float* d = a.d + r * (a.k64 / 32);
  float* dsum = a.dsum + r * (a.k64 / 32);
  int32_t* offsets[3];
  for (int o = 0; o < 3; ++o) offsets[o] = a.lane_offset[o] + r * (a.k64 / 4);
  const int64_t blocks = a.k / 32, pad = a.k64 / 32 - blocks;  // (int8 stores alias a.k)
  for (int64_t b = 0; b < blocks; ++b) {
#ifdef ACTORLM_QUANT_X_AVX512
    // the q kept in a register for their sums (reloading them from the two 16-byte stores
    // quantize_block makes would wait on those stores)
    const __m512 v0 = load16(x + b * 32), v1 = load16(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const float scale = amax / 127.f;
    const __m256i q32 = _mm256_set_m128i(
        _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inverse))),
        _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inverse))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * 32), q32);
#else
    const float scale = quantize_block(x + b * 32, 32, qs + b * 32);
#endif
    d[b] = scale;
#ifdef ACTORLM_QUANT_X_AVX512
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q32),
                                           _mm256_set1_epi16(1));  // of each 4 q
    const __m256i negative = _mm256_sub_epi32(_mm256_setzero_si256(), sums);
    const __m256i terms[3] = {_mm256_slli_epi32(negative, 3), _mm256_slli_epi32(negative, 4),
                              _mm256_slli_epi32(negative, 7)};  // kOffsets: 8, 16, 128
    for (int o = 0; o < 3; ++o)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(offsets[o] + b * 8), terms[o]);
    const __m128i half =
        _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
    const int block_sum = _mm_cvtsi128_si32(quarter) + _mm_extract_epi32(quarter, 1);
#else
    int block_sum = 0;
    for (int l = 0; l < 8; ++l) {
      const int8_t* q = qs + b * 32 + l * 4;
      const int32_t sum = q[0] + q[1] + q[2] + q[3];
      block_sum += sum;
      for (int o = 0; o < 3; ++o) offsets[o][b * 8 + l] = -kOffsets[o] * sum;
    }
#endif
    dsum[b] = scale * float(block_sum);
  }
  std::memset(qs + blocks * 32, 0, (a.k64 - blocks * 32));
  std::memset(d + blocks, 0, pad * sizeof(float));
  std::memset(dsum + blocks, 0, pad * sizeof(float));
  for (int32_t* offset : offsets) std::memset(offset + blocks * 8, 0, pad * 8 * sizeof(int32_t));
}

// row r of x into the 256-value arrays; k a multiple of 256
template <typename T>
void quantize_row_256(const T* x, const Activations& a, int64_t r) {
  int8_t* qs = a.qs_k + r * a.k64;
  float* d = a.d_k + r * (a.k64 / 256 + 1);
  int16_t* sums = a.sums_k + r * (a.k64 / 16);
  alignas(64) int8_t q[256];
  for (int64_t b = 0; b < a.k / 256; ++b) {
    d[b] = quantize_block(x + b * 256, 256, q);
    for (int j = 0; j < 16; ++j) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += q[j * 16 + i];
      sums[b * 16 + j] = int16_t(sum);
    }
    for (int run = 0; run < 8; ++run)
      std::memcpy(qs + b * 256 + k_position(run * 32), q + run * 32, 32);
  }
}

}  // namespace actorlm::quant
