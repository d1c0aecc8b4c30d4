// The AVX-512 VBMI path (SimdPath::avx512vbmi): adamw_avx512.h's traits with 8-bit states decoded 64
// codes at a time through byte permutes and encoded a block at a time (AVX-512BW, DQ and VBMI: Ice
// Lake and Zen 4 on), and bf16 weight copies rounded by vcvtneps2bf16 where the CPU has AVX512_BF16
// (built with -mavx512bf16 where the compiler knows it; those instructions run only after
// cpu_has_avx512bf16() said yes).
#include <pmmintrin.h>  // MXCSR: _MM_DENORMALS_ZERO_ON

#include "adamw_avx512.h"
#include "hytrain/cpu_features.h"

namespace hytrain {
namespace kernels {
bool adamw_range_avx512vbmi(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
#ifdef HYTRAIN_HAVE_AVX512BF16
  static const bool bf16 = cpu_has_avx512bf16();
  // Under MXCSR.DAZ (torch.set_flush_denormal(True), this thread's) fpclass sees denormals as zeros:
  // the portable rounding then, as on every other path.
  if (bf16 && (_mm_getcsr() & _MM_DENORMALS_ZERO_ON) == 0) {
    return detail::adamw_range<detail::VecAvx512<true, true>>(t, s, begin, end);
  }
#endif
  return detail::adamw_range<detail::VecAvx512<true>>(t, s, begin, end);
}
void q8_encode_avx512vbmi(const Q8Map& map, const float* in, float inv, uint8_t* codes, int64_t n) {
  const Q8Encoder enc = q8_encoder();
  for (int64_t k = 0; k < n; k += kQ8Block) detail::VecAvx512<true>::encode_q8_block(map, in + k, inv, codes + k, enc);
}
}  // namespace kernels
}  // namespace hytrain
