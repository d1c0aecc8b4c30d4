// The AVX-512 VBMI path (SimdPath::avx512vbmi): adamw_avx512.h's traits with 8-bit states coded a
// block at a time through byte permutes (AVX-512BW and VBMI, Ice Lake and Zen 4 on).
#include "adamw_avx512.h"

namespace hytrain {
namespace kernels {
bool adamw_range_avx512vbmi(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  return detail::adamw_range<detail::VecAvx512<true>>(t, s, begin, end);
}
void q8_encode_avx512vbmi(const Q8Map& map, const float* in, float inv, uint8_t* codes, int64_t n) {
  const Q8Encoder enc = q8_encoder();
  for (int64_t k = 0; k < n; k += kQ8Block) detail::VecAvx512<true>::encode_q8_block(map, in + k, inv, codes + k, enc);
}
}  // namespace kernels
}  // namespace hytrain
