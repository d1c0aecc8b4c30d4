// Scalar AdamW: the portable fallback and the reference the vector paths are compared with.
// Built with -ffp-contract=off so it does what it says (no fused multiply-adds).
#include <cmath>
#include <cstring>

#include "adamw_kernel.h"

namespace hytrain {
namespace {

struct VecScalar {
  using F = float;
  static constexpr int W = 1;
  static constexpr bool kStream = false;  // no non-temporal stores on the portable path
  static constexpr bool kBlockQ8 = false;  // 8-bit codes one at a time (decode_q8, store_q8)
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static F load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static uint16_t pack_bf16(F x) { return f32_to_bf16(x); }
  static uint16_t pack_f16(F x) { return f32_to_f16(x); }
  static void store_half(uint16_t* p, uint16_t h) { *p = h; }
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F max(F a, F b) { return a > b ? a : b; }
  static F fmadd(F a, F b, F c) { return a * b + c; }
  static bool any_nan(F a) { return std::isnan(a); }

  using I = uint32_t;
  static I iset1(uint32_t x) { return x; }
  static I lanes(uint32_t at) { return at; }
  static I iadd(I a, I b) { return a + b; }
  static I ixor(I a, I b) { return a ^ b; }
  static I iand(I a, I b) { return a & b; }
  static I imul(I a, I b) { return a * b; }
  // Undo records: float bits as integers, distances as signed bytes.
  static I bits(F x) {
    I u;
    std::memcpy(&u, &x, 4);
    return u;
  }
  static F from_bits(I x) {
    F f;
    std::memcpy(&f, &x, 4);
    return f;
  }
  static I isub(I a, I b) { return a - b; }
  static void istore(int32_t* p, I x) { *p = static_cast<int32_t>(x); }
  static I load_i8(const int8_t* p) { return static_cast<I>(static_cast<int32_t>(*p)); }
  static void store_i8(int8_t* p, I x) { *p = static_cast<int8_t>(static_cast<int32_t>(x)); }
  static bool fits(I d) {
    const int32_t e = static_cast<int32_t>(d);
    return e >= kMinDistance && e <= 127;
  }
  using M = bool;
  static M special(I c) { return static_cast<int32_t>(c) < kMinDistance; }
  static F blend(M k, F a, F b) { return k ? b : a; }
  template <int n>
  static I isrl(I a) { return a >> n; }
  static uint16_t pack_bf16_sr(F x, I rnd) { return f32_to_bf16_sr(x, rnd); }

  static F abs(F x) { return std::fabs(x); }
  static float hmax(F x) { return x; }
  static F decode_q8(const Q8Map& map, const uint8_t* codes) { return map.value[*codes]; }
  static void store_q8(uint8_t* out, F x, const Q8Map& map) { *out = q8_encode(map, x); }
};

}  // namespace

namespace kernels {
bool adamw_range_scalar(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  return detail::adamw_range<VecScalar>(t, s, begin, end);
}
}  // namespace kernels
}  // namespace hytrain
