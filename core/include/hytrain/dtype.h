// Element types that cross the native boundary, and the exact fp32 <-> bf16/fp16 conversions that
// every SIMD path must agree with bit for bit (round to nearest even; NaN stays NaN).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Functions also compiled for the device by the CUDA kernels (pure integer arithmetic).
#ifdef __CUDACC__
#define HYTRAIN_HOST_DEVICE __host__ __device__
#else
#define HYTRAIN_HOST_DEVICE
#endif

namespace hytrain {

// q8: 8-bit blockwise-quantised optimizer state (quant8.h), never a weight or gradient dtype.
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2, q8 = 3 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::q8: return "8-bit blockwise";
  }
  return "unknown";
}

inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; every NaN becomes the canonical quiet NaN 0x7FC0 (what PyTorch writes).
inline uint16_t f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_f32(sign | 0x7F800000u | (mant << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even, overflow to infinity, NaN stays NaN (quiet, sign kept).
inline uint16_t f32_to_f16(float x) {
  const uint32_t u = f32_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // |x| >= 65520 rounds to infinity
  if (a < 0x38800000u) {                         // below 2^-14: subnormal or zero
    // |x| * 2^24 is exact; rounding it to an integer under the default (nearest-even) mode gives
    // the subnormal's mantissa, and 1024 encodes the smallest normal correctly.
    const float scaled = bits_f32(a) * 16777216.0f;
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  a += 0xFFFu + ((a >> 13) & 1u);
  return sign | static_cast<uint16_t>((a >> 13) - (112u << 10));
}

// Stochastic rounding of optimizer state to bf16 (compact states). The random bits of element i of
// a tensor at a step come from a counter-based hash, so every path -- each SIMD width, any split
// into threads or slices, the CUDA kernel -- rounds every element the same way, and an update done
// again (a speculative pass redone) gives the same bits:
//   key = sr_mix(seed ^ sr_mix(step))          once per tensor and step
//   r   = sr_mix(uint32(i) + key)              per element; m takes its low 16 bits, v its high 16
//   bf16 = (bits(x) + r16) >> 16               NaN becomes 0x7FC0
// Rounding up with probability equal to the discarded fraction makes the rounding unbiased, so v's
// slow decay (beta2 = 0.999 moves it by less than half a bf16 ulp) is kept on average instead of
// being rounded away every step.
HYTRAIN_HOST_DEVICE inline uint32_t sr_mix(uint32_t x) {  // a 32-bit integer hash (two multiplies, three shifts)
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

inline uint32_t sr_key(uint32_t seed, int64_t step) { return sr_mix(seed ^ sr_mix(static_cast<uint32_t>(step))); }

inline uint16_t f32_to_bf16_sr(float x, uint32_t r16) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + (r16 & 0xFFFFu)) >> 16);
}

}  // namespace hytrain
