// AVX-512 AdamW (16 lanes). Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c for
// this file only; it runs only after cpu_supports(SimdPath::avx512) said yes.
#include <immintrin.h>

#include "adamw_kernel.h"

namespace hytrain {
namespace {

struct VecAvx512 {
  using F = __m512;
  static constexpr int W = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static constexpr bool kStream = true;
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }  // p 64-byte aligned
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m256i pack_bf16(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  static __m256i pack_f16(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store_half(uint16_t* p, __m256i h) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h); }
  static void stream_half(uint16_t* p, __m256i h) {  // p 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static void fence() { _mm_sfence(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static bool any_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }

  using I = __m512i;
  static I iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I lanes(uint32_t at) {
    return _mm512_add_epi32(iset1(at), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  // Undo records: float bits as integers, distances as signed bytes.
  static I bits(F x) { return _mm512_castps_si512(x); }
  static F from_bits(I x) { return _mm512_castsi512_ps(x); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static void istore(int32_t* p, I x) { _mm512_storeu_si512(p, x); }
  static I load_i8(const int8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_i8(int8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static void stream_i8(int8_t* p, I x) {  // p 16-byte aligned
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  static bool fits(I d) {
    return (_mm512_cmplt_epi32_mask(d, iset1(static_cast<uint32_t>(kMinDistance))) |
            _mm512_cmpgt_epi32_mask(d, iset1(127))) == 0;
  }
  using M = __mmask16;
  static M special(I c) { return _mm512_cmplt_epi32_mask(c, iset1(static_cast<uint32_t>(kMinDistance))); }
  static F blend(M k, F a, F b) { return _mm512_mask_blend_ps(k, a, b); }  // b where k
  template <int n>
  static I isrl(I a) { return _mm512_srli_epi32(a, n); }
  static __m256i pack_bf16_sr(F x, I rnd) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), rnd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }

  static F abs(F x) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), iset1(0x7FFFFFFFu))); }
  static float hmax(F x) { return _mm512_reduce_max_ps(x); }
  // quant8.h's groups: j the magnitude index (signed) or code + 1 (unsigned), G its float exponent,
  // the part j - 2^G; fmaf(part, step_L, base_L) with L = G (signed) or G - 1 (unsigned).
  static F decode_q8(const Q8Map& map, const uint8_t* codes) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    __m512i j, sign = _mm512_setzero_si512();
    if (map.is_signed) {
      const __mmask16 neg = _mm512_cmpgt_epi32_mask(c, iset1(128));
      j = _mm512_mask_sub_epi32(c, neg, c, iset1(128));
      sign = _mm512_maskz_mov_epi32(neg, iset1(0x80000000u));
    } else {
      j = _mm512_add_epi32(c, iset1(1));
    }
    const __m512 jf = _mm512_cvtepi32_ps(j);
    const __m512i e = _mm512_srli_epi32(_mm512_castps_si512(jf), 23);  // 127 + G (0 for j = 0)
    const __m512 part = _mm512_sub_ps(jf, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
    const __m512i L = _mm512_sub_epi32(e, iset1(map.is_signed ? 127 : 128));
    const __m512 tables = _mm512_loadu_ps(map.group);  // bases in lanes 0..7, steps in 8..15
    const __m512i Lm = _mm512_and_si512(L, iset1(7));
    const __m512 x = _mm512_fmadd_ps(part, _mm512_permutexvar_ps(_mm512_add_epi32(Lm, iset1(8)), tables),
                                     _mm512_permutexvar_ps(Lm, tables));
    const __mmask16 nonzero = _mm512_test_epi32_mask(c, c);  // code 0 is 0 in both maps
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_maskz_mov_epi32(nonzero, _mm512_castps_si512(x)), sign));
  }
  static void store_q8(uint8_t* out, F x, const Q8Map& map) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i a = _mm512_and_si512(bits, iset1(0x7FFFFFFFu));
    __m512i b = _mm512_sub_epi32(_mm512_srli_epi32(a, kQ8BucketShift), iset1(kQ8BucketLo));
    b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), iset1(kQ8Buckets - 1));
    const __m512i e = _mm512_i32gather_epi32(b, map.enc, 4);
    __m512i j = _mm512_and_si512(e, iset1(0xFFu));
    const __mmask16 inc = _mm512_cmpgt_epi32_mask(_mm512_and_si512(a, iset1(0x7FFFu)), _mm512_srli_epi32(e, 8));
    j = _mm512_mask_add_epi32(j, inc, j, iset1(1));
    if (map.is_signed) {
      const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ) & _mm512_test_epi32_mask(j, j);
      j = _mm512_mask_add_epi32(j, neg, _mm512_min_epi32(j, iset1(127)), iset1(128));
    } else {  // a nonzero x is never coded 0
      j = _mm512_mask_max_epi32(j, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), j, iset1(1));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(j));
  }
};

}  // namespace

namespace kernels {
bool adamw_range_avx512(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  return detail::adamw_range<VecAvx512>(t, s, begin, end);
}
}  // namespace kernels
}  // namespace hytrain
