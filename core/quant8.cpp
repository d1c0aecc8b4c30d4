// The two 8-bit maps of quant8.h and the CPU encoder's bucket tables, built once.
#include "hytrain/quant8.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "hytrain/error.h"

namespace hytrain {

namespace {

Q8Map build(bool is_signed) {
  Q8Map m{};
  m.is_signed = is_signed;
  // Magnitudes: 0; group L = 0..6 (decade 10^-(6-L), parts = 2^L signed or 2^(L+1) unsigned), part
  // j at fmaf(j, step_L, base_L); 1 (group 7: base 1, step 0).
  for (int L = 0; L < 8; ++L) {
    const double scale = std::pow(10.0, L - 6), parts = std::ldexp(1.0, is_signed ? L : L + 1);
    m.group[L] = L < 7 ? static_cast<float>(scale * (0.1 + 0.45 / parts)) : 1.0f;  // base
    m.group[8 + L] = L < 7 ? static_cast<float>(scale * 0.9 / parts) : 0.0f;      // step
  }
  std::vector<float> mags{0.0f};
  for (int L = 0; L < 8; ++L) {
    const int parts = L < 7 ? 1 << (is_signed ? L : L + 1) : 1;
    for (int j = 0; j < parts; ++j) mags.push_back(std::fma(static_cast<float>(j), m.group[8 + L], m.group[L]));
  }
  const std::vector<float>& a = mags;
  m.magnitudes = static_cast<int>(a.size());
  HYTRAIN_CHECK(m.magnitudes == (is_signed ? 129 : 256), "q8 map: wrong number of magnitudes");
  HYTRAIN_CHECK(std::adjacent_find(a.begin(), a.end(), std::greater_equal<float>()) == a.end(),
                "q8 map: magnitudes not increasing");
  for (int i = 0; i < 256; ++i) {
    m.mid[i] = i + 1 < m.magnitudes ? (a[i] + a[i + 1]) * 0.5f : std::numeric_limits<float>::infinity();
  }
  for (int c = 0; c < 256; ++c) {
    if (!is_signed || c <= 128) {
      m.value[c] = c < m.magnitudes ? a[c] : 0.0f;
    } else {
      m.value[c] = -a[c - 128];
    }
  }
  for (int c = 0; c < 256; ++c) {
    for (int q = 0; q < 4; ++q) {
      m.plane[q][c] = static_cast<uint8_t>(f32_bits(m.value[c]) >> (8 * q));
      m.mid_plane[q][c] = static_cast<uint8_t>(f32_bits(m.mid[c]) >> (8 * q));
    }
  }
  // The arithmetic encoder: per group, 1 / step and first - base / step (in double, rounded once);
  // per binade [2^(e-127), 2^(e-126)) of a >= 2^-24, its power of ten (the next group's start) if it
  // holds one, and the group below. Group 0 serves everything under 10^-6 (its estimate is 0 there).
  for (int L = 0; L < 16; ++L) m.inv_step[L] = m.offset[L] = 0.0f;
  for (int L = 0; L < 7; ++L) {
    const int first = is_signed ? 1 << L : (1 << (L + 1)) - 1;
    const double step = m.group[8 + L], base = m.group[L];
    m.inv_step[L] = static_cast<float>(1.0 / step);
    m.offset[L] = static_cast<float>(first - base / step);
  }
  for (int e = 0; e < 32; ++e) {
    m.cut[e] = std::numeric_limits<float>::infinity();
    m.lower[e] = 0;
  }
  for (int e = 127 - 24; e <= 127; ++e) {
    const double lo = std::ldexp(1.0, e - 127), hi = 2 * lo;
    int L = 0;
    while (L < 6 && std::pow(10.0, L - 6) <= lo) ++L;  // groups L' <= L start at or below lo
    m.lower[e & 31] = L;
    const float ten = static_cast<float>(std::pow(10.0, L - 6));  // group L + 1's start
    if (L < 6 && ten < hi) m.cut[e & 31] = ten;
  }
  // Buckets: count the midpoints below each bucket's smallest float; check that no bucket holds two.
  int j = 0;
  for (int32_t b = 0; b < kQ8Buckets; ++b) {
    const uint32_t lo_bits = static_cast<uint32_t>(b + kQ8BucketLo) << kQ8BucketShift;
    const float lo = bits_f32(lo_bits);
    const float hi = bits_f32(static_cast<uint32_t>(b + 1 + kQ8BucketLo) << kQ8BucketShift);
    while (m.mid[j] < lo) ++j;
    HYTRAIN_CHECK(b > 0 || j == 0, "q8 map: a midpoint below the lowest bucket");
    int inside = 0;
    for (int k = j; k < 256 && m.mid[k] < hi; ++k) ++inside;
    HYTRAIN_CHECK(inside <= 1 && (inside == 0 || (b > 0 && b < kQ8Buckets - 1)),
                  "q8 map: a bucket holds two midpoints, or an end bucket one");
    // The midpoint's low bits, or 0x7FFF where none: no float of the bucket has greater ones.
    const uint32_t t = inside ? f32_bits(m.mid[j]) & 0x7FFFu : 0x7FFFu;
    m.enc[b] = (static_cast<uint32_t>(j) << kQ8BucketShift) + 0x7FFFu - t - lo_bits;
  }
  return m;
}

}  // namespace

namespace {
std::atomic<int> g_encoder{-1};  // -1: not chosen yet

int default_encoder() {
  if (const char* env = std::getenv("HYTRAIN_Q8_ENCODER")) {
    const std::string name(env);
    if (name == "table") return static_cast<int>(Q8Encoder::table);
    if (name == "arithmetic") return static_cast<int>(Q8Encoder::arithmetic);
    HYTRAIN_THROW("HYTRAIN_Q8_ENCODER must be 'table' or 'arithmetic', got '" + name + "'");
  }
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_is("amd")) return static_cast<int>(Q8Encoder::arithmetic);
#endif
  return static_cast<int>(Q8Encoder::table);
}
}  // namespace

Q8Encoder q8_encoder() {
  int e = g_encoder.load(std::memory_order_relaxed);
  if (e < 0) {  // the first use; a set_q8_encoder() meanwhile wins
    int chosen = default_encoder();
    e = g_encoder.compare_exchange_strong(e, chosen, std::memory_order_relaxed) ? chosen : e;
  }
  return static_cast<Q8Encoder>(e);
}

void set_q8_encoder(Q8Encoder e) { g_encoder.store(static_cast<int>(e), std::memory_order_relaxed); }

const Q8Map& q8_map(bool is_signed) {
  static const Q8Map s = build(true);
  static const Q8Map u = build(false);
  return is_signed ? s : u;
}

}  // namespace hytrain
