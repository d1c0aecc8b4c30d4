// The AVX-512F path (SimdPath::avx512): the traits of adamw_avx512.h without byte permutes.
#include "adamw_avx512.h"

namespace hytrain {
namespace kernels {
bool adamw_range_avx512(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  return detail::adamw_range<detail::VecAvx512<false>>(t, s, begin, end);
}
}  // namespace kernels
}  // namespace hytrain
