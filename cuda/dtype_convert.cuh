// Element conversions on the device, bit-compatible with core/include/hytrain/dtype.h: bf16 rounds
// to nearest even with every NaN becoming 0x7FC0, fp16 goes through __float2half_rn.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "hytrain/dtype.h"

namespace hytrain {
namespace cuda {

template <DType D>
__device__ __forceinline__ float widen(uint16_t h) {
  if constexpr (D == DType::bf16) {
    return __uint_as_float(static_cast<uint32_t>(h) << 16);
  } else {
    return __half2float(__ushort_as_half(h));
  }
}

template <DType D>
__device__ __forceinline__ uint16_t narrow(float x) {
  if constexpr (D == DType::bf16) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
}

}  // namespace cuda
}  // namespace hytrain
