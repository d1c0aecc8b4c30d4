#include "hytrain/fingerprint.h"

#include <cstring>

#include "hytrain/error.h"

namespace hytrain {

uint64_t fingerprint(const void* data, int64_t bytes) {
  HYTRAIN_CHECK(bytes >= 0, "bytes must be >= 0");
  HYTRAIN_CHECK(bytes == 0 || data != nullptr, "data must be non-null");
  const auto* p = static_cast<const unsigned char*>(data);
  const int64_t words = bytes / 2;
  uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static) if (words > (int64_t{1} << 21))
  for (int64_t i = 0; i < words; ++i) {
    uint16_t w;
    std::memcpy(&w, p + 2 * i, 2);  // unaligned spans too
    sum += fingerprint_mix(static_cast<uint64_t>(i), w);
  }
  if (bytes % 2) sum += fingerprint_mix(static_cast<uint64_t>(words), p[bytes - 1]);
  return sum;
}

}  // namespace hytrain
