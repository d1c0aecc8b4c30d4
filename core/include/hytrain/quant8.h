// 8-bit optimizer states: blockwise dynamic quantisation of Adam's m and v (the scheme of
// Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization").
//
// A moment of n elements is one byte buffer of q8_state_bytes(n): n one-byte codes, padded to a
// multiple of 64 bytes, then one fp32 scale per block of kQ8Block elements (blocks start at element
// 0 of the parameter). m: element i is value[code_i] * scale under the signed map over [-1, 1], the
// scale being the block's largest |m|. v is kept as its square root, u = sqrt(v) (the update divides
// by it): u_i = value[code_i] * scale under the unsigned map over [0, 1], the scale being the block's
// largest u, and v_i = u_i * u_i. So v's codes span seven decades of the gradient's size, as m's do,
// rather than of its square; and a nonzero u is never coded 0 (the smallest nonzero code instead):
// a v rounded to zero under a nonzero m would make the update m / eps. All-zero bytes are the zero
// state (every scale 0), so zero-filled memory is a fresh optimizer state, and a buffer moves
// between host and GPU as a plain copy.
//
// The maps ("dynamic tree" quantisation): magnitudes in decades 10^-d (d = 0..6), each decade cut
// into equal parts in its [0.1, 1] * 10^-d range with the part's midpoint as value; the top decade
// gets 64 parts (signed) or 128 (unsigned), each lower one half as many; plus 0 and 1. So
// the precision is finest near the block's largest value and the range spans seven decades. In
// float: decade 10^-(6-L) is group L = 0..6 with base_L and step_L (its first midpoint and the
// parts' width, each rounded to float once) and its part j is fmaf(j, step_L, base_L); 1 is group 7
// (base 1, step 0). The vector paths decode a code arithmetically this way: the group is the
// exponent of the code's magnitude index as a float, the part its remaining bits.
//
// Encoding (the definition every path computes exactly): the magnitudes A[0] = 0 < A[1] < ... of the
// map and the float midpoints mid[i] = (A[i] + A[i+1]) * 0.5f; x in [-1, 1] (already divided by the
// block's scale) has magnitude index j = #{i : |x| > mid[i]} (nearest, ties to the smaller
// magnitude). Unsigned (x >= 0 or -0: a root): code j, or 1 where j = 0 < x. Signed: code j for
// x >= 0, 128 + min(j, 127) for x < 0 with j > 0 (the map has +1 but no -1), and 0 for x < 0 with
// j = 0. A NaN (a state after a non-finite gradient) counts as |x| = 1 everywhere. The CPU finds j
// with one read of a table indexed by |x|'s top bits (enc), or, on the VBMI path, arithmetically
// (below); the GPU with a binary search over mid; all count the same.
//
// The arithmetic encoder: within group L the midpoints lie a step apart, so
// floor(fmaf(a, 1 / step_L, first_L - base_L / step_L)) (first_L: the magnitude index of the group's
// part 0) is j or j - 1 for every a of the group; the mid above it settles which. The group comes from
// a's binade: each binade holds at most one power of ten, where the group changes (cut, lower). The
// margins are half a step inside a group and 0.3 of one at a group's lower edge (its boundary
// midpoint lies 0.2 of a step above the power of ten); fp32 errors are under 1e-4 of a step.
// test_q8_states (C++) checks it against the binary search for every float in [2^-25, 1.0001].
#pragma once

#include <cmath>
#include <cstdint>

#include "hytrain/dtype.h"

namespace hytrain {

constexpr int64_t kQ8Block = 256;      // elements per scale
constexpr int64_t kQ8CodeAlign = 64;   // bytes: the scales start on a cache line

// Where a range of a tensor whose states are `t` may start (a multiple of this many elements of the
// parameter): 8-bit states are quantised in whole blocks; the others anywhere.
inline int64_t range_granule(DType t) { return t == DType::q8 ? kQ8Block : 1; }

HYTRAIN_HOST_DEVICE inline int64_t q8_codes_bytes(int64_t n) {
  return (n + kQ8CodeAlign - 1) / kQ8CodeAlign * kQ8CodeAlign;
}
HYTRAIN_HOST_DEVICE inline int64_t q8_blocks(int64_t n) { return (n + kQ8Block - 1) / kQ8Block; }
// Bytes of one 8-bit moment of n elements: codes, padding, scales.
HYTRAIN_HOST_DEVICE inline int64_t q8_state_bytes(int64_t n) { return q8_codes_bytes(n) + 4 * q8_blocks(n); }

// The bucket table of the CPU encoder: |x|'s bits >> kQ8BucketShift (exponent and 8 mantissa bits),
// clamped to [2^-23, 1]; below 2^-23 every |x| is under the first midpoint.
constexpr int kQ8BucketShift = 15;
constexpr int32_t kQ8BucketLo = (127 - 23) << 8;  // bits(2^-23) >> 15
constexpr int32_t kQ8BucketHi = 127 << 8;         // bits(1.0) >> 15
constexpr int32_t kQ8Buckets = kQ8BucketHi - kQ8BucketLo + 1;

struct Q8Map {
  bool is_signed = false;
  int magnitudes = 0;     // entries of A: 129 (signed) or 256 (unsigned)
  float value[256];       // code -> value in [-1, 1]
  float mid[256];         // mid[i] between A[i] and A[i+1]; +infinity from magnitudes - 1 on
  float group[16];        // part j of group L is fmaf(j, group[8 + L], group[L]): bases, then steps
  // value[] as byte planes: plane[q][c] is byte q (little-endian) of value[c]'s bits, so four byte
  // permutes of the codes rebuild the values (the AVX-512 VBMI decoder).
  alignas(64) uint8_t plane[4][256];
  alignas(64) uint8_t mid_plane[4][256];  // the same for mid[]
  // The arithmetic encoder (above), for a = |x| clamped to [2^-24, 1]: the binade's cut and the group below it,
  // by the exponent's low 5 bits (the binades of 2^-24 .. 1 are distinct there); 1 / step_L and
  // first_L - base_L / step_L by group (lanes 0-6 of 16).
  alignas(64) float cut[32];
  alignas(64) int32_t lower[32];
  alignas(64) float inv_step[16];
  alignas(64) float offset[16];
  // enc[b], for bucket b (the floats whose bits >> 15 are b + kQ8BucketLo, the bucket's start s_b =
  // (b + kQ8BucketLo) << 15): with n_b = #{i : mid[i] < the bucket's smallest float} and t_b the low 15
  // bits of the one midpoint a bucket may hold (0x7FFF where it holds none: no float of the bucket has
  // greater ones), enc[b] = (n_b << 15) + 0x7FFF - t_b - s_b (mod 2^32). For a in the bucket,
  // bits(a) = s_b + low with low < 2^15, so (enc[b] + bits(a)) >> 15 = n_b + [low > t_b]: the count,
  // from one table read, an add and a shift (a is |x| clamped to [2^-23, 1]: a NaN counts as 1).
  uint32_t enc[kQ8Buckets];
};

// The two maps, built once (thread-safe).
const Q8Map& q8_map(bool is_signed);

// How the AVX-512 VBMI path encodes: with the bucket table (a gather per 16 codes) or arithmetically
// (no gather). Both give the same codes. By default arithmetically where gathers are slow (AMD
// processors: on Zen 4 a 16-lane gather costs about as much as the rest of the encoding), else with
// the table; HYTRAIN_Q8_ENCODER=table|arithmetic or set_q8_encoder() overrides. The variable is read at
// the first 8-bit job's validation (validate_adamw_job, on the calling thread, before anything is
// written); another value is refused there with an error naming it, every time.
enum class Q8Encoder : int { table = 0, arithmetic = 1 };
Q8Encoder q8_encoder();
void set_q8_encoder(Q8Encoder e);

// The magnitude index of |x| by binary search over mid (the GPU's way; also the reference).
HYTRAIN_HOST_DEVICE inline int q8_magnitude_index(const float* mid, float ax) {
  int j = 0;
  for (int step = 128; step >= 1; step >>= 1) {
    if (mid[j + step - 1] < ax) j += step;
  }
  return j;
}

// The code of x from its magnitude index j and sign (see above).
HYTRAIN_HOST_DEVICE inline uint8_t q8_code(bool is_signed, float x, int j) {
  if (!is_signed) return static_cast<uint8_t>(j == 0 && x > 0.0f ? 1 : j);
  if (!(x < 0.0f) || j == 0) return static_cast<uint8_t>(j);  // -0 has j = 0
  return static_cast<uint8_t>(128 + (j < 127 ? j : 127));
}

// The arithmetic encoder's magnitude index of |x| (quant8.h's estimate, then the midpoint above it),
// computed as the AVX-512 VBMI path computes it lane by lane.
constexpr float kQ8Tiny = 5.9604644775390625e-08f;  // 2^-24, below every map's first midpoint
inline int q8_index_estimated(const Q8Map& map, float ax) {
  float a = ax < 1.0f ? ax : 1.0f;  // a NaN counts as 1, as in the bucket table's encoder
  a = a > kQ8Tiny ? a : kQ8Tiny;
  const int e = static_cast<int>((f32_bits(a) >> 23) & 31);
  const int L = map.lower[e] + (a >= map.cut[e] ? 1 : 0);
  const int j = static_cast<int>(std::floor(std::fma(a, map.inv_step[L], map.offset[L])));
  return j + (a > map.mid[j] ? 1 : 0);
}

// enc indexed by bits(a) >> kQ8BucketShift itself (the vector paths' gather base): no element
// below kQ8BucketLo is ever read.
inline const void* q8_enc_by_bits(const Q8Map& map) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(map.enc) - uintptr_t{kQ8BucketLo} * 4);
}

// Scalar encoder with the bucket table (what the SIMD paths do lane by lane).
constexpr float kQ8BucketMin = 1.1920928955078125e-07f;  // 2^-23, the first bucket's start
inline uint8_t q8_encode(const Q8Map& map, float x) {
  float a = std::fabs(x);
  a = a < 1.0f ? a : 1.0f;  // NaN: 1, as the vector paths' min (which returns its second operand)
  a = a > kQ8BucketMin ? a : kQ8BucketMin;
  const uint32_t bits = f32_bits(a);
  const int j = static_cast<int>((map.enc[(bits >> kQ8BucketShift) - kQ8BucketLo] + bits) >> kQ8BucketShift);
  return q8_code(map.is_signed, x, j);
}

}  // namespace hytrain
