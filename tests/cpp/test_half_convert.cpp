// fp32 -> bf16/fp16 rounding checked against an independent reference: the nearest of the two
// neighbouring representable values, computed in double, ties to the even code.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "check.h"
#include "hytrain/dtype.h"

using namespace hytrain;

namespace {

uint16_t ref_bf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t u = f32_bits(x);
  const uint16_t sign = static_cast<uint16_t>(u >> 16) & 0x8000;
  const double a = std::fabs(static_cast<double>(x));
  const uint16_t lo = static_cast<uint16_t>((u & 0x7FFFFFFF) >> 16);  // truncated magnitude code
  if (std::isinf(x)) return sign | 0x7F80;
  const double vlo = bf16_to_f32(lo);
  const double vhi = lo + 1 == 0x7F80 ? std::ldexp(1.0, 128) : bf16_to_f32(lo + 1);
  const double dlo = a - vlo, dhi = vhi - a;
  uint16_t code = dlo < dhi ? lo : dhi < dlo ? lo + 1 : ((lo & 1) ? lo + 1 : lo);
  return sign | code;
}

double f16_value(uint16_t code) {  // non-negative finite codes
  const int exp = (code >> 10) & 0x1F, mant = code & 0x3FF;
  return exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
}

uint16_t ref_f16(float x, const std::vector<double>& table) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0x7E00;
  const double a = std::fabs(static_cast<double>(x));
  if (std::isinf(x)) return sign | 0x7C00;
  // table[k] is the value of code k for k < 0x7C00; 65536 stands for "rounds to infinity".
  auto it = std::upper_bound(table.begin(), table.end(), a);
  const size_t hi = static_cast<size_t>(it - table.begin());
  const size_t lo = hi - 1;
  if (hi == table.size()) return sign | 0x7C00;
  const double dlo = a - table[lo], dhi = table[hi] - a;
  size_t code = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return sign | static_cast<uint16_t>(code);  // code 0x7C00 is infinity
}

std::vector<float> test_values(size_t n) {
  std::mt19937 rng(12345);
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 5.96e-8f,
                          2.98e-8f, 6.1e-5f, 3.0e38f, 3.4028235e38f, INFINITY, -INFINITY, NAN};
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> exp(-30.0f, 20.0f);
  for (size_t i = 0; i < n; ++i) {
    v.push_back(bits_f32(bits(rng)));                                   // every class, any exponent
    v.push_back(std::ldexp(1.0f + (bits(rng) & 0xFFFF) / 65536.0f, static_cast<int>(exp(rng))));
    // Exact ties for bf16 and fp16: low bits exactly half an ulp.
    v.push_back(bits_f32((bits(rng) & 0xFFFF0000u) | 0x8000u));
    v.push_back(bits_f32(((bits(rng) & 0x0FFFE000u) + 0x38800000u) | 0x1000u));
  }
  return v;
}

}  // namespace

TEST(bf16_round_nearest_even) {
  int bad = 0;
  for (float x : test_values(200000)) {
    const uint16_t got = f32_to_bf16(x), want = ref_bf16(x);
    if (got != want && bad++ < 5) std::printf("  x=%a got %04x want %04x\n", x, got, want);
  }
  CHECK_MSG(bad == 0, "%d mismatches", bad);
}

TEST(f16_round_nearest_even) {
  std::vector<double> table;
  for (uint16_t c = 0; c < 0x7C00; ++c) table.push_back(f16_value(c));
  table.push_back(65536.0);
  int bad = 0;
  for (float x : test_values(200000)) {
    const uint16_t got = f32_to_f16(x), want = ref_f16(x, table);
    const bool both_nan = std::isnan(x) && (got & 0x7C00) == 0x7C00 && (got & 0x3FF);
    if (got != want && !both_nan && bad++ < 5) std::printf("  x=%a got %04x want %04x\n", x, got, want);
  }
  CHECK_MSG(bad == 0, "%d mismatches", bad);
}

TEST(f16_and_bf16_widen_exactly) {
  for (uint32_t c = 0; c < 0x10000; ++c) {
    const uint16_t h = static_cast<uint16_t>(c);
    const int exp = (h >> 10) & 0x1F;
    if (exp != 31) {
      const double mag = f16_value(h & 0x7FFF);
      CHECK(static_cast<double>(f16_to_f32(h)) == ((h & 0x8000) ? -mag : mag));
      CHECK(f32_to_f16(f16_to_f32(h)) == h);  // round trip
    }
    const float b = bf16_to_f32(h);
    if (!std::isnan(b)) CHECK(f32_to_bf16(b) == h);
  }
}

HYTEST_MAIN()
