// The AVX-512 VBMI path (SimdPath::avx512vbmi): adamw_avx512.h's traits with 8-bit states coded a
// block at a time through byte permutes (AVX-512BW and VBMI, Ice Lake and Zen 4 on).
#include "adamw_avx512.h"

namespace hytrain {
namespace kernels {
bool adamw_range_avx512vbmi(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  return detail::adamw_range<detail::VecAvx512<true>>(t, s, begin, end);
}
}  // namespace kernels
}  // namespace hytrain
