// AVX2 + FMA + F16C AdamW (8 lanes). Compiled with -mavx2 -mfma -mf16c for this file only; it runs
// only after cpu_supports(SimdPath::avx2) said yes.
#include <immintrin.h>

#include "adamw_kernel.h"

namespace hytrain {
namespace {

struct VecAvx2 {
  using F = __m256;
  static constexpr int W = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static constexpr bool kStream = true;
  static constexpr bool kBlockQ8 = false;  // 8-bit codes W at a time (decode_q8, store_q8)
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }  // p 32-byte aligned
  static F load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m128i pack_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static __m128i pack_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static void store_half(uint16_t* p, __m128i h) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h); }
  static void stream_half(uint16_t* p, __m128i h) {  // p 16-byte aligned
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static void fence() { _mm_sfence(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static bool any_nan(F a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }

  using I = __m256i;
  static I iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I lanes(uint32_t at) { return _mm256_add_epi32(iset1(at), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  // Undo records: float bits as integers, distances as signed bytes.
  static I bits(F x) { return _mm256_castps_si256(x); }
  static F from_bits(I x) { return _mm256_castsi256_ps(x); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static void istore(int32_t* p, I x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static I load_i8(const int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_i8(int8_t* p, I x) {  // every lane fits a byte
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  static void stream_i8(int8_t* p, I x) {  // p 8-byte aligned
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_stream_si64(reinterpret_cast<long long*>(p), _mm_cvtsi128_si64(_mm_packs_epi16(w, w)));
  }
  static bool fits(I d) {
    const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(d, iset1(127)),
                                        _mm256_cmpgt_epi32(iset1(static_cast<uint32_t>(kMinDistance)), d));
    return _mm256_testz_si256(out, out) != 0;
  }
  using M = __m256;
  static M special(I c) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(iset1(static_cast<uint32_t>(kMinDistance)), c));
  }
  static F blend(M k, F a, F b) { return _mm256_blendv_ps(a, b, k); }  // b where k
  template <int n>
  static I isrl(I a) { return _mm256_srli_epi32(a, n); }
  static __m128i pack_bf16_sr(F x, I rnd) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), rnd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }

  static F abs(F x) { return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(x), iset1(0x7FFFFFFFu))); }
  static float hmax(F x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  // quant8.h's groups: j the magnitude index (signed) or code + 1 (unsigned), G its float exponent,
  // the part j - 2^G; fmaf(part, step_L, base_L) with L = G (signed) or G - 1 (unsigned).
  static F decode_q8(const Q8Map& map, const uint8_t* codes) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    __m256i j, sign = _mm256_setzero_si256();
    if (map.is_signed) {
      const __m256i neg = _mm256_cmpgt_epi32(c, iset1(128));
      j = _mm256_sub_epi32(c, _mm256_and_si256(neg, iset1(128)));
      sign = _mm256_and_si256(neg, iset1(0x80000000u));
    } else {
      j = _mm256_add_epi32(c, iset1(1));
    }
    const __m256 jf = _mm256_cvtepi32_ps(j);
    const __m256i e = _mm256_srli_epi32(_mm256_castps_si256(jf), 23);  // 127 + G (0 for j = 0)
    const __m256 part = _mm256_sub_ps(jf, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
    const __m256i L = _mm256_sub_epi32(e, iset1(map.is_signed ? 127 : 128));
    const __m256 x = _mm256_fmadd_ps(part, _mm256_permutevar8x32_ps(_mm256_loadu_ps(map.group + 8), L),
                                     _mm256_permutevar8x32_ps(_mm256_loadu_ps(map.group), L));
    const __m256i zero = _mm256_cmpeq_epi32(c, _mm256_setzero_si256());  // code 0 is 0 in both maps
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_andnot_si256(zero, _mm256_castps_si256(x)), sign));
  }
  static void store_q8(uint8_t* out, F x, const Q8Map& map) {  // quant8.h's bucket table
    const __m256 sgn = _mm256_castsi256_ps(iset1(0x80000000u));
    __m256 a = map.is_signed ? _mm256_andnot_ps(sgn, x) : x;  // the unsigned map's x is >= 0 or -0
    a = _mm256_max_ps(_mm256_min_ps(a, _mm256_set1_ps(1.0f)), _mm256_set1_ps(kQ8BucketMin));  // NaN: 1
    const __m256i bits = _mm256_castps_si256(a);
    const int* table = static_cast<const int*>(q8_enc_by_bits(map));
    const __m256i e = _mm256_i32gather_epi32(table, _mm256_srli_epi32(bits, kQ8BucketShift), 4);
    __m256i j = _mm256_srli_epi32(_mm256_add_epi32(e, bits), kQ8BucketShift);
    if (map.is_signed) {  // 128 + j for x < 0 with j > 0; the packs saturate 256 to 255 = 128 + 127
      const __m256i neg = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ)),
                                           _mm256_cmpgt_epi32(j, _mm256_setzero_si256()));
      j = _mm256_add_epi32(j, _mm256_and_si256(neg, iset1(128)));
    } else {  // a nonzero x is never coded 0
      const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
      j = _mm256_max_epi32(j, _mm256_and_si256(pos, iset1(1)));
    }
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(j), _mm256_extracti128_si256(j, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(w, w));
  }
};

}  // namespace

namespace kernels {
bool adamw_range_avx2(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  return detail::adamw_range<VecAvx2>(t, s, begin, end);
}
}  // namespace kernels
}  // namespace hytrain
