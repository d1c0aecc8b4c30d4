// The host fingerprint against a one-word-at-a-time reference written from the definition in
// fingerprint.h (a 64-bit-wide avalanche recomputed here, not the library's mix), on fresh random
// bytes of many lengths and offsets; one changed word always changes it.
#include <cstdint>
#include <random>
#include <vector>

#include "check.h"
#include "hytrain/fingerprint.h"

namespace {

uint64_t mix_ref(uint64_t index, uint64_t word) {
  // The same 32-bit arithmetic, written with 64-bit values masked after each step.
  const uint64_t m = 0xFFFFFFFFull;
  uint64_t x = ((index & m) * 0x9E3779B1ull + ((word + 1) & m) * 0x85EBCA77ull) & m;
  x ^= x >> 15;
  x = (x * 0x2C1B3C6Dull) & m;
  x ^= x >> 12;
  x = (x * 0x297A2D39ull) & m;
  x ^= x >> 15;
  return x;
}

uint64_t reference(const unsigned char* p, int64_t bytes) {
  uint64_t sum = 0;
  int64_t i = 0;
  for (; 2 * i + 1 < bytes; ++i) sum += mix_ref(i, p[2 * i] | (uint64_t{p[2 * i + 1]} << 8));
  if (bytes % 2) sum += mix_ref(i, p[bytes - 1]);
  return sum;
}

}  // namespace

TEST(fingerprint_matches_reference) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<unsigned char> buf(1 << 23);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const int64_t sizes[] = {0, 1, 2, 3, 17, 4096, 4097, 65537, (1 << 22) + 3, (1 << 23) - 5};
  for (int64_t n : sizes) {
    for (int64_t off : {0, 1, 2, 3}) {
      if (off + n > static_cast<int64_t>(buf.size())) continue;
      CHECK(hytrain::fingerprint(buf.data() + off, n) == reference(buf.data() + off, n));
    }
  }
}

TEST(fingerprint_sees_any_one_word) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<uint16_t> w(100000);
  for (auto& x : w) x = static_cast<uint16_t>(rng());
  const uint64_t before = hytrain::fingerprint(w.data(), 2 * w.size());
  for (int t = 0; t < 2000; ++t) {
    const size_t i = rng() % w.size();
    const uint16_t old = w[i];
    w[i] = static_cast<uint16_t>(old + 1 + rng() % 65535);  // any other value
    CHECK(hytrain::fingerprint(w.data(), 2 * w.size()) != before);
    w[i] = old;
  }
  CHECK(hytrain::fingerprint(w.data(), 2 * w.size()) == before);
  std::swap(w[0], w[1]);  // a permutation moves values to other indices: seen
  if (w[0] != w[1]) CHECK(hytrain::fingerprint(w.data(), 2 * w.size()) != before);
}

HYTEST_MAIN()
