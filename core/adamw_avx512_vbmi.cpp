// The AVX-512 VBMI path (SimdPath::avx512vbmi): adamw_avx512.h's traits with 8-bit states coded a
// block at a time through byte permutes (AVX-512BW, DQ and VBMI, Ice Lake and Zen 4 on), and bf16 weight
// copies rounded by vcvtneps2bf16 where the CPU has AVX512_BF16 (built with -mavx512bf16; those
// instructions run only after cpu_has_avx512bf16() said yes).
#include "adamw_avx512.h"
#include "hytrain/cpu_features.h"

namespace hytrain {
namespace kernels {
bool adamw_range_avx512vbmi(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  static const bool bf16 = cpu_has_avx512bf16();
  return bf16 ? detail::adamw_range<detail::VecAvx512<true, true>>(t, s, begin, end)
              : detail::adamw_range<detail::VecAvx512<true>>(t, s, begin, end);
}
void q8_encode_avx512vbmi(const Q8Map& map, const float* in, float inv, uint8_t* codes, int64_t n) {
  const Q8Encoder enc = q8_encoder();
  for (int64_t k = 0; k < n; k += kQ8Block) detail::VecAvx512<true>::encode_q8_block(map, in + k, inv, codes + k, enc);
}
}  // namespace kernels
}  // namespace hytrain
