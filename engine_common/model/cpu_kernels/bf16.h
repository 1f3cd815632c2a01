// bf16 <-> float32 for the engine's C++ CPU kernels, shared by every kernel source
// (native_build puts this directory on the include path and hashes its headers into each
// library's build key, so a change here rebuilds every kernel).
//
// Owns only the two conversions, exactly as torch does them; each kernel keeps its own
// vector code.

#pragma once

#include <cstdint>
#include <cstring>

namespace tandem {

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch rounds float32 to bf16 (NaN stays a quiet NaN); written
// without branches so that loops over it vectorize.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  uint32_t nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace tandem
