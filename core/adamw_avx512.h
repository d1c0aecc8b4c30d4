// AVX-512 AdamW traits (16 lanes), for two translation units: adamw_avx512.cpp (AVX-512F, with FMA
// and F16C: SimdPath::avx512) and adamw_avx512_vbmi.cpp (also AVX-512BW, DQ and VBMI:
// SimdPath::avx512vbmi), each built with its own flags and run only after cpu_supports() said yes.
// They differ in how 8-bit states are coded: with kVbmi a block's codes become values through byte
// permutes of the map's value table, and new codes are packed 64 at a time. kBf16 (the VBMI unit, on
// CPUs with AVX512_BF16: Sapphire Rapids, Zen 4 on) rounds weight copies to bf16 with one
// instruction, the same bits as the portable rounding (below).
#pragma once

#include <immintrin.h>

#include "adamw_kernel.h"

namespace hytrain {
namespace detail {
namespace {  // each including translation unit has its own copy, built with its own flags

template <bool kVbmi, bool kBf16 = false>
struct VecAvx512 {
  using F = __m512;
  static constexpr int W = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static constexpr bool kStream = true;
  static constexpr bool kBlockQ8 = kVbmi;
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }  // p 64-byte aligned
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // Nearest even (dtype.h's f32_to_bf16): a NaN becomes 0x7FC0, a denormal rounds as any float.
  static __m256i pack_bf16_portable(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  // vcvtneps2bf16 rounds to nearest even too, but reads denormals as zero and keeps a NaN's sign and
  // payload: a vector holding either (fpclass: quiet or signalling NaN, denormal) takes the portable
  // rounding, so the bits are the same on every path. fpclass classes a denormal as zero under
  // MXCSR.DAZ: the caller runs kBf16 only where that bit is clear (adamw_avx512_vbmi.cpp).
  static __m256i pack_bf16(F x) {
    if constexpr (kBf16) {
#ifdef HYTRAIN_HAVE_AVX512BF16
      if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80) == 0, 1)) {
        return (__m256i)_mm512_cvtneps_pbh(x);  // a same-size vector cast: the 16 bf16 bit patterns
      }
#endif
    }
    return pack_bf16_portable(x);
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
  // value[code] by a gather from the map's 1 KB table (L1-resident); on the Intel host measured in
  // docs/performance.md it beat decoding the code's group arithmetically (AVX2's way) by about 12 %.
  static F decode_q8(const Q8Map& map, const uint8_t* codes) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    return _mm512_i32gather_ps(c, map.value, 4);
  }
  // quant8.h's encoding of x with the bucket table, one code per 32-bit lane (a signed negative code
  // may be 256: the unsigned saturating narrow makes it 255 = 128 + min(j, 127)).
  static __m512i codes_q8(F x, const Q8Map& map) {
    F a = map.is_signed ? abs(x) : x;  // the unsigned map's x is >= 0 or -0 (clamped below to 2^-23)
    a = _mm512_max_ps(_mm512_min_ps(a, _mm512_set1_ps(1.0f)), _mm512_set1_ps(kQ8BucketMin));  // NaN: 1
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(bits, kQ8BucketShift), q8_enc_by_bits(map), 4);
    const __m512i j = _mm512_srli_epi32(_mm512_add_epi32(e, bits), kQ8BucketShift);
    if (map.is_signed) {  // the comparison's predicate is an immediate: one call per branch
      const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
      return _mm512_mask_add_epi32(j, _mm512_mask_test_epi32_mask(neg, j, j), j, iset1(128));
    }
    const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
    return _mm512_mask_max_epi32(j, pos, j, iset1(1));  // a nonzero x is never coded 0
  }
  static void store_q8(uint8_t* out, F x, const Q8Map& map) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtusepi32_epi8(codes_q8(x, map)));
  }

  // ---- kVbmi: 8-bit codes a block at a time (kQ8Block a multiple of 64) ----
  // Byte unpacks and saturating packs interleave within 128-bit lanes: they move 32-bit group 4l + r
  // of a 64-byte vector to group 4r + l and back (a 4 x 4 transpose of 4-byte groups, its own inverse).
  static __m512i transpose4x4() {
    return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  }
  // 64 lookups in a 256-entry float table held as byte planes (Q8Map::plane, mid_plane): each plane
  // is two two-register byte permutes (indices below and above 128) and a blend; the four planes
  // interleave into floats. out[r] lane i is table[idx byte 16 * (i / 4) + 4 * r + i % 4], which is
  // natural order when idx is the packed (or transposed) form of four index vectors.
  static void lookup64(const uint8_t (*planes)[256], __m512i idx, F out[4]) {
    const __mmask64 high = _mm512_movepi8_mask(idx);  // index >= 128
    __m512i b[4];
    for (int q = 0; q < 4; ++q) {
      const uint8_t* t = planes[q];
      const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t), idx, _mm512_load_si512(t + 64));
      const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), idx, _mm512_load_si512(t + 192));
      b[q] = _mm512_mask_blend_epi8(high, lo, hi);
    }
    const __m512i w0 = _mm512_unpacklo_epi8(b[0], b[1]), w1 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i w2 = _mm512_unpacklo_epi8(b[2], b[3]), w3 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w0, w2));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w0, w2));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w1, w3));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w1, w3));
  }
  // Four vectors of 32-bit lanes (each 0..255, or more where a saturating pack should give 255) as
  // bytes in the packs' interleaved order.
  static __m512i pack4(const __m512i j[4]) {
    return _mm512_packus_epi16(_mm512_packus_epi32(j[0], j[1]), _mm512_packus_epi32(j[2], j[3]));
  }
  // out[r] = value[codes[16 r + i]] * scale for the 64 codes at `codes`: exactly decode_q8's values.
  static void decode_q8_64(const Q8Map& map, const uint8_t* codes, F scale, F out[4]) {
    static_assert(kVbmi, "byte permutes: the VBMI unit only (kBlockQ8)");
    lookup64(map.plane, _mm512_permutexvar_epi32(transpose4x4(), _mm512_loadu_si512(codes)), out);
    for (int r = 0; r < 4; ++r) out[r] = _mm512_mul_ps(out[r], scale);
  }
  // codes[i] = the code of in[i] * inv, by the bucket table or by quant8.h's arithmetic encoder (no
  // gather: the estimate from the binade's cut and the group's step, the midpoint above it looked up 64
  // at a time, the sign), as enc says; the codes packed to bytes 64 at a time (a signed
  // negative 128 + 128 saturates to 255 = 128 + min(j, 127)).
  static void encode_q8_block(const Q8Map& map, const float* in, float inv, uint8_t* codes, Q8Encoder enc) {
    if constexpr (kVbmi) {
      const __m512i order = transpose4x4();
      if (enc == Q8Encoder::table) {
        const F s = _mm512_set1_ps(inv);
        for (int64_t k = 0; k < kQ8Block; k += 64) {
          __m512i j[4];
          for (int r = 0; r < 4; ++r) j[r] = codes_q8(_mm512_mul_ps(_mm512_load_ps(in + k + 16 * r), s), map);
          _mm512_storeu_si512(codes + k, _mm512_permutexvar_epi32(order, pack4(j)));
        }
        return;
      }
      const F s = _mm512_set1_ps(inv), tiny = _mm512_set1_ps(kQ8Tiny), zero = _mm512_setzero_ps();
      const F cut0 = _mm512_load_ps(map.cut), cut1 = _mm512_load_ps(map.cut + 16);
      const __m512i low0 = _mm512_load_si512(map.lower), low1 = _mm512_load_si512(map.lower + 16);
      const F kstep = _mm512_load_ps(map.inv_step), koff = _mm512_load_ps(map.offset);
      const __m512i one = iset1(1);
      for (int64_t k = 0; k < kQ8Block; k += 64) {
        F x[4], a[4], mid[4];
        __m512i j[4];
        for (int r = 0; r < 4; ++r) {
          x[r] = _mm512_mul_ps(_mm512_load_ps(in + k + 16 * r), s);
          a[r] = _mm512_max_ps(_mm512_min_ps(map.is_signed ? abs(x[r]) : x[r], _mm512_set1_ps(1.0f)), tiny);  // NaN: 1
          const __m512i e = _mm512_srli_epi32(_mm512_castps_si512(a[r]), 23);  // permutes use its low 5 bits
          __m512i L = _mm512_permutex2var_epi32(low0, e, low1);
          L = _mm512_mask_add_epi32(L, _mm512_cmp_ps_mask(a[r], _mm512_permutex2var_ps(cut0, e, cut1), _CMP_GE_OQ),
                                    L, one);
          const F t = _mm512_fmadd_ps(a[r], _mm512_permutexvar_ps(L, kstep), _mm512_permutexvar_ps(L, koff));
          j[r] = _mm512_cvt_roundps_epi32(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        }
        lookup64(map.mid_plane, pack4(j), mid);
        for (int r = 0; r < 4; ++r) {
          j[r] = _mm512_mask_add_epi32(j[r], _mm512_cmp_ps_mask(a[r], mid[r], _CMP_GT_OQ), j[r], one);
          if (map.is_signed) {
            const __mmask16 neg = _mm512_cmp_ps_mask(x[r], zero, _CMP_LT_OQ) & _mm512_test_epi32_mask(j[r], j[r]);
            j[r] = _mm512_mask_add_epi32(j[r], neg, j[r], iset1(128));
          } else {  // a nonzero x is never coded 0
            j[r] = _mm512_mask_max_epi32(j[r], _mm512_cmp_ps_mask(x[r], zero, _CMP_GT_OQ), j[r], one);
          }
        }
        _mm512_storeu_si512(codes + k, _mm512_permutexvar_epi32(order, pack4(j)));
      }
    }
  }
};

}  // namespace
}  // namespace detail
}  // namespace hytrain
