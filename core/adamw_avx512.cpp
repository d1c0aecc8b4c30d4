// The AVX-512F path (SimdPath::avx512): the traits of adamw_avx512.h without byte permutes.
#include "adamw_avx512.h"

namespace hytrain {
namespace kernels {
bool adamw_range_avx512(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  return detail::adamw_range<detail::VecAvx512<false>>(t, s, begin, end);
}
void q8_encode_avx512(const Q8Map& map, const float* in, float inv, uint8_t* codes, int64_t n) {
  using V = detail::VecAvx512<false>;
  for (int64_t k = 0; k < n; k += V::W) V::store_q8(codes + k, _mm512_mul_ps(_mm512_loadu_ps(in + k), _mm512_set1_ps(inv)), map);
}
}  // namespace kernels
}  // namespace hytrain
