// fp32 and bf16 (carried as its 16 bits) for the CPU kernels: reads widen to fp32, writes round
// to nearest even as torch does; rounded() is a value as torch would hold it in that dtype.
#pragma once
#include <cstdint>
#include <cstring>

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

}  // namespace actorlm
