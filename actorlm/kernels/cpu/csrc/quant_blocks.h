// GGML's block formats, byte for byte as a GGUF file stores them (gguf.quants is the reference
// the tests hold them to), and the scalar dequantization of one block.
//
// A weight row of in_features values is in_features / block_values blocks, back to back. The
// 32-value formats keep one f16 scale per block (Q4_1 a min too); the K formats ("k-quants")
// keep a 256-value superblock with an f16 scale, and small integer scales per sub-block of 32
// (Q4_K, Q5_K: 6-bit scale and min, packed 12 bytes for 8 sub-blocks) or 16 (Q6_K: int8).
//
// Every dequantized value is computed as gguf.quants computes it, in fp32, in the same order:
// d * q is exact in fp32 for all of them (an 11-bit scale times an integer of at most 13 bits),
// so only Q4_1's "+ m" and the K formats' "- dmin * m" round, once, as numpy's do.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace actorlm::quant {

// ggml_type ids of the formats with kernels
enum Type : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
                      kQ6_K = 14 };
constexpr int kNumTypes = 7;
constexpr int32_t kTypes[kNumTypes] = {kQ4_0, kQ4_1, kQ5_0, kQ8_0, kQ4_K, kQ5_K, kQ6_K};

struct Format {
  int values;  // per block
  int bytes;   // per block
};

// The format of a type, by its index in kTypes (-1: not a kept type)
constexpr int type_index(int32_t type) {
  for (int i = 0; i < kNumTypes; ++i)
    if (kTypes[i] == type) return i;
  return -1;
}
constexpr Format kFormats[kNumTypes] = {{32, 18}, {32, 20}, {32, 22}, {32, 34},
                                        {256, 144}, {256, 176}, {256, 210}};

// Byte offsets inside the blocks (gguf.quants' np.hsplit points)
namespace q4_0 { constexpr int kD = 0, kQs = 2; }
namespace q4_1 { constexpr int kD = 0, kM = 2, kQs = 4; }
namespace q5_0 { constexpr int kD = 0, kQh = 2, kQs = 6; }
namespace q8_0 { constexpr int kD = 0, kQs = 2; }
namespace q4_k { constexpr int kD = 0, kDmin = 2, kScales = 4, kQs = 16; }
namespace q5_k { constexpr int kD = 0, kDmin = 2, kScales = 4, kQh = 16, kQs = 48; }
namespace q6_k { constexpr int kQl = 0, kQh = 128, kScales = 192, kD = 208; }

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// IEEE half -> float, exactly (every half is a float)
inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu,
                 mantissa = h & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = float(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 0x1F ? sign | 0x7F800000u | (mantissa << 13)
                                         : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}
inline float f16_at(const uint8_t* p) { return f16_to_f32(load_u16(p)); }

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes
inline void scale_min_k4(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The unsigned integer of value i of a Q6_K superblock (0..63; the value is d * sc * (q - 32)):
// of each 128 values, the low nibbles of 64 ql bytes give values 0-63, their high nibbles
// 64-127; 32 qh bytes hold 2 more bits of each, value r in bits 2 * (r / 32) of byte r % 32.
inline int q6_k_value(const uint8_t* block, int i) {
  const int half = i / 128, r = i % 128;
  const int low = (block[q6_k::kQl + half * 64 + r % 64] >> (4 * (r / 64))) & 0xF;
  const int high = (block[q6_k::kQh + half * 32 + r % 32] >> (2 * (r / 32))) & 3;
  return low | (high << 4);
}

// The 32 values of a Q4_0 / Q4_1 / Q5_0 block as unsigned integers (value i: low nibble of qs[i]
// for i < 16, high nibble of qs[i - 16] beyond; Q5_0 adds bit i of qh as 16)
inline int nibble_value(const uint8_t* qs, int i) {
  return i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4;
}

// out[0, values) = one block of `type` (an index into kTypes) dequantized
inline void dequantize_block(int type, const uint8_t* b, float* out) {
  switch (kTypes[type]) {
    case kQ4_0: {
      const float d = f16_at(b + q4_0::kD);
      for (int i = 0; i < 32; ++i) out[i] = d * float(nibble_value(b + q4_0::kQs, i) - 8);
      break;
    }
    case kQ4_1: {
      const float d = f16_at(b + q4_1::kD), m = f16_at(b + q4_1::kM);
      for (int i = 0; i < 32; ++i) out[i] = d * float(nibble_value(b + q4_1::kQs, i)) + m;
      break;
    }
    case kQ5_0: {
      const float d = f16_at(b + q5_0::kD);
      const uint32_t qh = load_u32(b + q5_0::kQh);
      for (int i = 0; i < 32; ++i)
        out[i] = d * float((nibble_value(b + q5_0::kQs, i) | int((qh >> i & 1) << 4)) - 16);
      break;
    }
    case kQ8_0: {
      const float d = f16_at(b + q8_0::kD);
      for (int i = 0; i < 32; ++i) out[i] = float(int8_t(b[q8_0::kQs + i])) * d;
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool five = kTypes[type] == kQ5_K;
      const float d = f16_at(b), dmin = f16_at(b + 2);
      const uint8_t* qs = b + (five ? q5_k::kQs : q4_k::kQs);
      for (int j = 0; j < 8; ++j) {  // sub-block j: nibble j % 2 of qs bytes [32 (j / 2), +32)
        int scale, min;
        scale_min_k4(b + q4_k::kScales, j, &scale, &min);
        const float ds = d * float(scale), dm = dmin * float(min);
        for (int l = 0; l < 32; ++l) {
          int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
          if (five) q |= ((b[q5_k::kQh + l] >> j) & 1) << 4;
          out[32 * j + l] = ds * float(q) - dm;
        }
      }
      break;
    }
    case kQ6_K: {
      const float d = f16_at(b + q6_k::kD);
      for (int i = 0; i < 256; ++i) {
        const float ds = d * float(int8_t(b[q6_k::kScales + i / 16]));
        out[i] = ds * float(q6_k_value(b, i) - 32);
      }
      break;
    }
  }
}

}  // namespace actorlm::quant
