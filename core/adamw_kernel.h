// The AdamW element loop, written once over a small "vector traits" interface and instantiated by
// each SIMD translation unit (adamw_scalar.cpp, adamw_avx2.cpp, adamw_avx512.cpp,
// adamw_avx512_vbmi.cpp) with its own traits and compiler flags. Keeping one body means the paths
// cannot drift apart.
//
// Traits V provide: F (vector type), W (lanes), load/store (fp32), load_bf16/load_f16 (widen),
// pack_bf16/pack_f16 (round to nearest even into W 16-bit values), pack_bf16_sr (stochastic
// rounding with 16 random bits per lane) and store_half, set1, add, sub, mul, div, sqrt, max,
// fmadd(a,b,c) = a*b+c, any_nan; I (W uint32 lanes) with iset1, lanes(at) = at + lane, iadd, ixor,
// iand, imul (low 32 bits), isrl<n>; for 8-bit states abs, hmax (the largest lane), decode_q8 (the
// values of W codes under a map) and store_q8 (W codes of x, quant8.h's encoding), or with kBlockQ8
// decode_q8_64 (64 codes into four vectors) and encode_q8_block (a block's codes from an L1
// buffer); and kStream: whether stream and stream_half (non-temporal stores to aligned addresses)
// and fence exist. The tail (fewer than W elements) goes through W-element stack buffers, so every
// path handles any size with the same full-width code and no allocation.
//
// Non-temporal stores: an output the loop does not read (the weight copy when it is not the gradient
// buffer, the new state of an out-of-place update) would otherwise be read from memory before it is
// written (write-allocate): 14 of the 42 bytes per parameter an out-of-place mixed-precision update
// moves. Streaming stores write whole lines without that read, so such an update costs the same 28
// bytes as one in place. In-place outputs were just loaded and are in cache: they use plain stores.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "hytrain/adamw.h"
#include "hytrain/quant8.h"

namespace hytrain {
namespace detail {

template <class V, DType G>
inline typename V::F load_grad(const void* base, int64_t i) {
  if constexpr (G == DType::f32) {
    return V::load(static_cast<const float*>(base) + i);
  } else if constexpr (G == DType::bf16) {
    return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return V::load_f16(static_cast<const uint16_t*>(base) + i);
  }
}

template <class V, bool kNt>
inline void store_f32(float* p, typename V::F x) {
  if constexpr (kNt) {
    V::stream(p, x);
  } else {
    V::store(p, x);
  }
}

template <class V, DType C, bool kNt>
inline void store_copy(void* base, int64_t i, typename V::F x) {
  uint16_t* p = static_cast<uint16_t*>(base) + i;
  const auto h = C == DType::bf16 ? V::pack_bf16(x) : V::pack_f16(x);
  if constexpr (kNt) {
    V::stream_half(p, h);
  } else {
    V::store_half(p, h);
  }
}

// The state's m and v: fp32, or bf16 read widened and stored stochastically rounded with 16 random
// bits per element (low half of the element's hash for m, high half for v; dtype.h).
template <class V, DType S>
inline typename V::F load_state(const void* base, int64_t i) {
  if constexpr (S == DType::f32) {
    return V::load(static_cast<const float*>(base) + i);
  } else {
    return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  }
}

template <class V, DType S, bool kNt>
inline void store_state(void* base, int64_t i, typename V::F x, typename V::I rnd) {
  if constexpr (S == DType::f32) {
    store_f32<V, kNt>(static_cast<float*>(base) + i, x);
  } else {
    uint16_t* p = static_cast<uint16_t*>(base) + i;
    const auto h = V::pack_bf16_sr(x, rnd);
    if constexpr (kNt) {
      V::stream_half(p, h);
    } else {
      V::store_half(p, h);
    }
  }
}

// sr_mix on every lane.
template <class V>
inline typename V::I mix(typename V::I x) {
  x = V::ixor(x, V::template isrl<16>(x));
  x = V::imul(x, V::iset1(0x21F0AAADu));
  x = V::ixor(x, V::template isrl<15>(x));
  x = V::imul(x, V::iset1(0x735A2D97u));
  return V::ixor(x, V::template isrl<15>(x));
}

// Pointers of one W-wide slice: either into the tensors or into tail buffers. The state is read
// from p, m, v, vmax and written to po, mo, vo, vmaxo (the same pointers when in place).
struct Slice {
  const float* p;
  const void* m;
  const void* v;
  const float* vmax;
  const void* g;
  void* copy;
  float* po;
  void* mo;
  void* vo;
  float* vmaxo;
};

// S: the dtype of m and v. kNtState: the new state goes to other memory (out of place) through
// streaming stores; kNtCopy: the weight copy does too. The W-element tail buffers are on the stack:
// the tail uses plain stores.
template <class V, DType G, bool kCopy, DType C, bool kAmsgrad, DType S, bool kNtState = false,
          bool kNtCopy = false>
struct AdamWBody {
  using F = typename V::F;
  using I = typename V::I;
  F b2, omb1, omb2, eps, wd, pdecay, nstep, bc2s, gscale, zero;
  I key, low16;
  bool l2;  // Adam's L2 term is added (weight_decay != 0 without decoupling)

  explicit AdamWBody(const AdamWScalars& s)
      : b2(V::set1(s.beta2)), omb1(V::set1(s.one_minus_beta1)), omb2(V::set1(s.one_minus_beta2)),
        eps(V::set1(s.eps)), wd(V::set1(s.weight_decay)), pdecay(V::set1(s.param_decay)),
        nstep(V::set1(s.neg_step_size)), bc2s(V::set1(s.bias_correction2_sqrt)),
        gscale(V::set1(s.grad_scale)), zero(V::set1(0.0f)), key(V::iset1(s.sr_key)),
        low16(V::iset1(0xFFFFu)), l2(s.weight_decay != 0.0f) {}

  // The moments' update and the decay of p, from the raw gradient (every state format's first half).
  // Returns the gradient the moments took in.
  inline F moments(F& p, F& m, F& v, F graw, F& bad) const {
    F g = V::mul(graw, gscale);
    bad = V::fmadd(g, zero, bad);
    // Adam's L2 term, only where there is one (as torch's): a NaN weight (eps=0's 0/0, a NaN written
    // by the loop) leaves AdamW's m and v as they are, as in torch's.
    if (l2) g = V::fmadd(wd, p, g);
    p = V::mul(p, pdecay);   // AdamW's decoupled decay; pdecay is 1 for Adam
    m = V::fmadd(omb1, V::sub(g, m), m);
    v = V::fmadd(V::mul(omb2, g), g, V::mul(v, b2));
    return g;
  }
  // The gradient moments() takes in, from the raw one and the old p.
  inline F grad_of(F graw, F p) const {
    const F g = V::mul(graw, gscale);
    return l2 ? V::fmadd(wd, p, g) : g;
  }

  // The new weight from the decayed p, the new m and the denominator's v (or its square root).
  inline F apply(F p, F m, F vd) const { return apply_root(p, m, V::sqrt(vd)); }
  inline F apply_root(F p, F m, F root) const { return V::fmadd(nstep, quotient_root(m, root), p); }
  inline F quotient_root(F m, F root) const { return V::div(m, V::add(V::div(root, bc2s), eps)); }

  // Updates W elements at offset i of the slice, whose first element is element `at` of the
  // parameter (bf16 states hash it); `bad` accumulates g*0, which is NaN exactly when some g was
  // non-finite.
  inline void operator()(const Slice& x, int64_t i, uint32_t at, F& bad) const {
    F p = V::load(x.p + i);
    F m = load_state<V, S>(x.m, i);
    F v = load_state<V, S>(x.v, i);
    moments(p, m, v, load_grad<V, G>(x.g, i), bad);
    F vd = v;
    if constexpr (kAmsgrad) {
      vd = V::max(V::load(x.vmax + i), v);
      store_f32<V, kNtState>(x.vmaxo + i, vd);
    }
    p = apply(p, m, vd);
    store_f32<V, kNtState>(x.po + i, p);
    I r = V::iset1(0);
    if constexpr (S != DType::f32) r = mix<V>(V::iadd(V::lanes(at), key));
    store_state<V, S, kNtState>(x.mo, i, m, V::iand(r, low16));
    store_state<V, S, kNtState>(x.vo, i, v, V::template isrl<16>(r));
    if constexpr (kCopy) store_copy<V, C, kNtCopy>(x.copy, i, p);
  }
};

// The state's destinations: the _out pointers of an out-of-place update, else the state itself.
struct Outputs {
  float* po;
  void* mo;
  void* vo;
  float* vmaxo;
  explicit Outputs(const AdamWTensor& t)
      : po(t.param_out ? t.param_out : t.param),
        mo(t.param_out ? t.exp_avg_out : t.exp_avg),
        vo(t.param_out ? t.exp_avg_sq_out : t.exp_avg_sq),
        vmaxo(static_cast<float*>(t.param_out ? t.max_exp_avg_sq_out : t.max_exp_avg_sq)) {}
};

template <class V, DType G, bool kCopy, DType C, bool kAmsgrad, DType S, bool kNtState, bool kNtCopy>
bool adamw_range_impl(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  constexpr int W = V::W;
  using F = typename V::F;
  const AdamWBody<V, G, kCopy, C, kAmsgrad, S, kNtState, kNtCopy> body(s);
  F bad = V::set1(0.0f);

  const Outputs o(t);
  const float* vmax_in = static_cast<const float*>(t.max_exp_avg_sq);
  const Slice whole{t.param, t.exp_avg, t.exp_avg_sq, vmax_in, t.grad, t.param_copy,
                    o.po, o.mo, o.vo, o.vmaxo};
  const auto at = [&](int64_t i) { return static_cast<uint32_t>(t.index_base + i); };
  int64_t i = begin;
  for (; i + W <= end; i += W) body(whole, i, at(i), bad);
  if constexpr (kNtState || kNtCopy) V::fence();  // streamed lines are visible before we return

  const int64_t n = end - i;
  if (n > 0) {
    alignas(64) float p[W] = {}, vmax[W] = {};
    alignas(64) unsigned char m[W * 4] = {}, v[W * 4] = {}, g[W * 4] = {};
    alignas(64) uint16_t copy[W] = {};
    const int64_t gsz = dtype_bytes(G), ssz = dtype_bytes(S);
    std::memcpy(p, t.param + i, n * 4);
    std::memcpy(m, offset_by(t.exp_avg, S, i), n * ssz);
    std::memcpy(v, offset_by(t.exp_avg_sq, S, i), n * ssz);
    if (kAmsgrad) std::memcpy(vmax, vmax_in + i, n * 4);
    std::memcpy(g, static_cast<const unsigned char*>(t.grad) + i * gsz, n * gsz);
    const AdamWBody<V, G, kCopy, C, kAmsgrad, S> plain(s);
    plain(Slice{p, m, v, vmax, g, copy, p, m, v, vmax}, 0, at(i), bad);
    std::memcpy(o.po + i, p, n * 4);
    std::memcpy(offset_by(o.mo, S, i), m, n * ssz);
    std::memcpy(offset_by(o.vo, S, i), v, n * ssz);
    if (kAmsgrad) std::memcpy(o.vmaxo + i, vmax, n * 4);
    if (kCopy) std::memcpy(static_cast<uint16_t*>(t.param_copy) + i, copy, n * 2);
  }
  return V::any_nan(bad);
}

// ---- 8-bit states (quant8.h) ---------------------------------------------------------------------

// One range's pointers: codes of its first element, and the scales of its first block.
struct Q8Slice {
  const float* p;
  const uint8_t* m;
  const uint8_t* v;
  const float* sm;
  const float* sv;
  const void* g;
  void* copy;
  float* po;
  uint8_t* mo;
  uint8_t* vo;
  float* smo;
  float* svo;
};

// The scales of the tensor's first block within the moment buffer whose codes `codes` points into.
inline float* q8_scales(const void* codes, const AdamWTensor& t) {
  if (codes == nullptr) return nullptr;
  const int64_t total = t.state_numel ? t.state_numel : t.index_base + t.numel;
  char* base = static_cast<char*>(const_cast<void*>(codes)) - t.index_base;  // element 0's code
  return reinterpret_cast<float*>(base + q8_codes_bytes(total)) + t.index_base / kQ8Block;
}

// Updates the kQ8Block elements at offset i of the slice (block `blk` of it): one pass decodes m and
// u = sqrt(v) (with kBlockQ8, 64 codes of each at a time, in registers), updates m, v and p in fp32
// and keeps the new m and u in L1-resident buffers with their largest magnitudes; the last pass
// quantises them against those new scales. The block is read whole before any of it is written, so in
// place works.
//
// The step divides once: p + nstep * m / (sqrt(v) / bc2s + eps) is computed as
// p + (nstep * bc2s) * m / (sqrt(v) + eps * bc2s), the two products folded into the scalars in double
// (AdamWScalars::q8_*), and the CUDA kernel does the same (byte-for-byte equal codes and weights).
template <class V, DType G, bool kCopy, DType C, bool kNtP, bool kNtCopy, class Body>
inline void q8_block(const Body& body, const Q8Slice& x, int64_t i, int64_t blk, typename V::F& bad,
                     const Q8Map& ms, const Q8Map& mu, typename V::F nstep, typename V::F eps,
                     Q8Encoder enc) {
  using F = typename V::F;
  constexpr int W = V::W;
  alignas(64) float mb[kQ8Block], vb[kQ8Block];
  F am = V::set1(0.0f), av = V::set1(0.0f);
  const F sm = V::set1(x.sm[blk]), sv = V::set1(x.sv[blk]);  // read once: the stores below may alias
  // Element k of the block (W of them) from its decoded m and u.
  const auto update = [&](int64_t k, F m, F u) {
    F p = V::load(x.p + i + k);
    F v = V::mul(u, u);
    body.moments(p, m, v, load_grad<V, G>(x.g, i + k), bad);
    const F root = V::sqrt(v);
    p = V::fmadd(nstep, V::div(m, V::add(root, eps)), p);
    store_f32<V, kNtP>(x.po + i + k, p);
    if constexpr (kCopy) store_copy<V, C, kNtCopy>(x.copy, i + k, p);
    V::store(mb + k, m);
    V::store(vb + k, root);
    am = V::max(am, V::abs(m));
    av = V::max(av, root);
  };
  if constexpr (V::kBlockQ8) {
    static_assert(W == 16, "64 codes are four vectors");
    for (int64_t k = 0; k < kQ8Block; k += 64) {
      F m[4], u[4];
      V::decode_q8_64(ms, x.m + i + k, sm, m);
      V::decode_q8_64(mu, x.v + i + k, sv, u);
      for (int r = 0; r < 4; ++r) update(k + 16 * r, m[r], u[r]);
    }
  } else {  // W codes at a time
    for (int64_t k = 0; k < kQ8Block; k += W) {
      update(k, V::mul(V::decode_q8(ms, x.m + i + k), sm), V::mul(V::decode_q8(mu, x.v + i + k), sv));
    }
  }
  const float amax_m = V::hmax(am), amax_v = V::hmax(av);
  const float im = amax_m > 0.0f ? 1.0f / amax_m : 0.0f, iv = amax_v > 0.0f ? 1.0f / amax_v : 0.0f;
  if constexpr (V::kBlockQ8) {
    V::encode_q8_block(ms, mb, im, x.mo + i, enc);
    V::encode_q8_block(mu, vb, iv, x.vo + i, enc);
  } else {  // m and u interleaved: two independent table reads in flight
    const F vim = V::set1(im), viv = V::set1(iv);
    for (int64_t k = 0; k < kQ8Block; k += W) {
      V::store_q8(x.mo + i + k, V::mul(V::load(mb + k), vim), ms);
      V::store_q8(x.vo + i + k, V::mul(V::load(vb + k), viv), mu);
    }
  }
  x.smo[blk] = amax_m;
  x.svo[blk] = amax_v;
}

// [begin, end) of an 8-bit-state tensor: begin is a block boundary of the parameter, end one too or
// the tensor's end (validated). A last partial block goes through zero-padded stack buffers (zero
// codes and gradients give zero moments, which leave the scales alone).
template <class V, DType G, bool kCopy, DType C, bool kNtP, bool kNtCopy>
bool adamw_range_q8(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  using F = typename V::F;
  const AdamWBody<V, G, kCopy, C, false, DType::f32, kNtP, kNtCopy> body(s);
  const Q8Map& ms = q8_map(true);
  const Q8Map& mu = q8_map(false);
  F bad = V::set1(0.0f);
  const F nstep = V::set1(s.q8_neg_step), eps = V::set1(s.q8_eps);
  const Q8Encoder enc = q8_encoder();  // once per range (resolved at validation)
  const Outputs o(t);
  const Q8Slice whole{t.param, static_cast<const uint8_t*>(t.exp_avg), static_cast<const uint8_t*>(t.exp_avg_sq),
                      q8_scales(t.exp_avg, t), q8_scales(t.exp_avg_sq, t), t.grad, t.param_copy, o.po,
                      static_cast<uint8_t*>(o.mo), static_cast<uint8_t*>(o.vo), q8_scales(o.mo, t),
                      q8_scales(o.vo, t)};
  int64_t i = begin;
  for (; i + kQ8Block <= end; i += kQ8Block) {
    q8_block<V, G, kCopy, C, kNtP, kNtCopy>(body, whole, i, i / kQ8Block, bad, ms, mu, nstep, eps, enc);
  }
  if constexpr (kNtP || kNtCopy) V::fence();

  const int64_t n = end - i;
  if (n > 0) {
    alignas(64) float p[kQ8Block] = {};
    alignas(64) uint8_t m[kQ8Block] = {}, v[kQ8Block] = {};
    alignas(64) unsigned char g[kQ8Block * 4] = {};
    alignas(64) uint16_t copy[kQ8Block] = {};
    float sm = whole.sm[i / kQ8Block], sv = whole.sv[i / kQ8Block];
    const int64_t gsz = dtype_bytes(G);
    std::memcpy(p, t.param + i, n * 4);
    std::memcpy(m, whole.m + i, n);
    std::memcpy(v, whole.v + i, n);
    std::memcpy(g, static_cast<const unsigned char*>(t.grad) + i * gsz, n * gsz);
    const AdamWBody<V, G, kCopy, C, false, DType::f32> plain(s);
    q8_block<V, G, kCopy, C, false, false>(plain, Q8Slice{p, m, v, &sm, &sv, g, copy, p, m, v, &sm, &sv}, 0, 0,
                                           bad, ms, mu, nstep, eps, enc);
    std::memcpy(o.po + i, p, n * 4);
    std::memcpy(whole.mo + i, m, n);
    std::memcpy(whole.vo + i, v, n);
    whole.smo[i / kQ8Block] = sm;
    whole.svo[i / kQ8Block] = sv;
    if (kCopy) std::memcpy(static_cast<uint16_t*>(t.param_copy) + i, copy, n * 2);
  }
  return V::any_nan(bad);
}

template <class V, DType G, bool kCopy, DType C, bool kNtState, bool kNtCopy>
bool adamw_range_ams(const AdamWTensor& t, const AdamWScalars& s, int64_t b, int64_t e) {
  if (t.state_dtype == DType::q8) return adamw_range_q8<V, G, kCopy, C, kNtState, kNtCopy>(t, s, b, e);
  if (t.state_dtype == DType::bf16) {  // amsgrad needs fp32 states (validated)
    return adamw_range_impl<V, G, kCopy, C, false, DType::bf16, kNtState, kNtCopy>(t, s, b, e);
  }
  return s.amsgrad ? adamw_range_impl<V, G, kCopy, C, true, DType::f32, kNtState, kNtCopy>(t, s, b, e)
                   : adamw_range_impl<V, G, kCopy, C, false, DType::f32, kNtState, kNtCopy>(t, s, b, e);
}

template <class V, DType G, bool kCopy, DType C>
bool adamw_range_nt(const AdamWTensor& t, const AdamWScalars& s, int64_t b, int64_t e) {
  if constexpr (V::kStream) {
    const StreamPlan plan = stream_plan(t, s, b, e, V::W);
    const bool ns = plan.state;
    const bool nc = kCopy && plan.copy;
    if (ns && nc) return adamw_range_ams<V, G, kCopy, C, true, kCopy>(t, s, b, e);
    if (ns) return adamw_range_ams<V, G, kCopy, C, true, false>(t, s, b, e);
    if (nc) return adamw_range_ams<V, G, kCopy, C, false, kCopy>(t, s, b, e);
  }
  return adamw_range_ams<V, G, kCopy, C, false, false>(t, s, b, e);
}

// ---- undo records (adamw.h) --------------------------------------------------------------------

// The reconstruction of the old p, m and v from the new ones, the gradient g the update took in and
// the quotient q it applied. Each subtracts the rounded term the update added (not a fused residual),
// so an old value of zero comes back as zero.
template <class V>
struct Reconstruct {
  using F = typename V::F;
  F nstep, ipdecay, omb1, ib1, omb2, ib2;
  explicit Reconstruct(const AdamWScalars& s)
      : nstep(V::set1(s.neg_step_size)), ipdecay(V::set1(1.0f / s.param_decay)), omb1(V::set1(s.one_minus_beta1)),
        ib1(V::set1(1.0f / (1.0f - s.one_minus_beta1))), omb2(V::set1(s.one_minus_beta2)),
        ib2(V::set1(1.0f / s.beta2)) {}
  inline F p(F p_new, F q) const { return V::mul(V::sub(p_new, V::mul(nstep, q)), ipdecay); }
  inline F m(F m_new, F g) const { return V::mul(V::sub(m_new, V::mul(omb1, g)), ib1); }
  inline F v(F v_new, F g) const { return V::mul(V::sub(v_new, V::mul(V::mul(omb2, g), g)), ib2); }
};

// One range's pointers: the state (updated in place), the gradient, the weight copy and the codes.
struct RecSlice {
  float* p;
  float* m;
  float* v;
  const void* g;
  void* copy;
  int8_t* dp;
  int8_t* dm;
  int8_t* dv;
};

template <class V, DType G, bool kCopy, DType C>
struct RecordKernel {
  using F = typename V::F;
  using I = typename V::I;
  static constexpr int W = V::W;
  using Body = AdamWBody<V, G, kCopy, C, false, DType::f32>;
  const Body body;   // this job's config: the update a write or redo makes
  const Body spec;   // record_config: the update that wrote the record (undo, redo)
  const Reconstruct<V> rb, rs;
  const UndoRecord rec;
  const int64_t base;  // the index (an escape entry's) of element 0 of the slices given

  RecordKernel(const AdamWTensor& t, const AdamWScalars& s, const AdamWScalars& sr, int64_t base_index)
      : body(s), spec(sr), rb(s), rs(sr), rec(t.record), base(base_index) {}

  static I distance(F old, F rec) { return V::isub(V::bits(old), V::bits(rec)); }
  static F restore(F rec, I d) { return V::from_bits(V::iadd(V::bits(rec), d)); }

  template <bool kNt>
  static void store_codes(int8_t* p, I d) {
    if constexpr (kNt) {
      V::stream_i8(p, d);
    } else {
      V::store_i8(p, d);
    }
  }

  // The speculative update of W elements at offset i, `valid` of them real (a tail pads the rest).
  // kNt: the distances and the weight copy (which the update does not read) through streaming stores.
  template <bool kNt = false>
  void write(const RecSlice& x, int64_t i, int valid, F& bad) const {
    const F p0 = V::load(x.p + i), m0 = V::load(x.m + i), v0 = V::load(x.v + i);
    F p = p0, m = m0, v = v0;
    const F g = body.moments(p, m, v, load_grad<V, G>(x.g, i), bad);
    const F q = body.quotient_root(m, V::sqrt(v));
    p = V::fmadd(body.nstep, q, p);
    const I dp = distance(p0, rb.p(p, q)), dm = distance(m0, rb.m(m, g)), dv = distance(v0, rb.v(v, g));
    if (valid == W && V::fits(dp) && V::fits(dm) && V::fits(dv)) {
      V::store(x.p + i, p);
      V::store(x.m + i, m);
      V::store(x.v + i, v);
      store_codes<kNt>(x.dp + i, dp);
      store_codes<kNt>(x.dm + i, dm);
      store_codes<kNt>(x.dv + i, dv);
      if constexpr (kCopy) store_copy<V, C, kNt>(x.copy, i, p);
      return;
    }
    // Some element does not fit (or a tail): element by element, with escapes.
    alignas(64) float a[6][W];
    alignas(64) int32_t d[3][W];
    V::store(a[0], p0), V::store(a[1], m0), V::store(a[2], v0), V::store(a[3], p), V::store(a[4], m),
        V::store(a[5], v);
    V::istore(d[0], dp), V::istore(d[1], dm), V::istore(d[2], dv);
    alignas(64) float weight[W];
    for (int l = 0; l < W; ++l) {
      weight[l] = a[3][l];
      if (l >= valid) continue;
      const auto fit = [](int32_t e) { return e >= kMinDistance && e <= 127; };
      int8_t cp = static_cast<int8_t>(d[0][l]), cm = static_cast<int8_t>(d[1][l]), cv = static_cast<int8_t>(d[2][l]);
      if (!(fit(d[0][l]) && fit(d[1][l]) && fit(d[2][l]))) {
        const int64_t e = __atomic_fetch_add(&rec.counters[0], 1, __ATOMIC_RELAXED);
        cp = kEscaped, cm = cv = 0;
        if (e < rec.capacity) {
          rec.escapes[e] = UndoEntry{static_cast<uint32_t>(base + i + l), a[0][l], a[1][l], a[2][l]};
        } else {  // no room to keep it: not updated
          __atomic_fetch_add(&rec.counters[1], 1, __ATOMIC_RELAXED);
          x.dp[i + l] = kUntouched, x.dm[i + l] = 0, x.dv[i + l] = 0;
          weight[l] = a[0][l];
          continue;
        }
      }
      x.p[i + l] = a[3][l], x.m[i + l] = a[4][l], x.v[i + l] = a[5][l];
      x.dp[i + l] = cp, x.dm[i + l] = cm, x.dv[i + l] = cv;
    }
    if constexpr (kCopy) store_copy<V, C, false>(x.copy, i, V::load(weight));
  }

  // Undo (redo: then the update) of W elements at offset i. Escaped elements are left for
  // escapes(); untouched ones hold their old state already.
  template <bool kRedo>
  void undo(const RecSlice& x, int64_t i, F& bad) const {
    const F p1 = V::load(x.p + i), m1 = V::load(x.m + i), v1 = V::load(x.v + i);
    const I cp = V::load_i8(x.dp + i);
    const F graw = load_grad<V, G>(x.g, i);
    F p = restore(rs.p(p1, spec.quotient_root(m1, V::sqrt(v1))), cp);
    const F g = spec.grad_of(graw, p);
    F m = restore(rs.m(m1, g), V::load_i8(x.dm + i));
    F v = restore(rs.v(v1, g), V::load_i8(x.dv + i));
    if (!V::fits(cp)) {  // escaped or untouched elements: their stored values for now
      const auto keep = V::special(cp);
      p = V::blend(keep, p, p1), m = V::blend(keep, m, m1), v = V::blend(keep, v, v1);
    }
    if constexpr (kRedo) {
      body.moments(p, m, v, graw, bad);
      p = body.apply(p, m, v);
      if constexpr (kCopy) store_copy<V, C, false>(x.copy, i, p);
    }
    V::store(x.p + i, p);
    V::store(x.m + i, m);
    V::store(x.v + i, v);
  }

  // The escaped elements of [begin, end): their old state back (redo: then updated, one at a time
  // through the same W-wide body).
  template <bool kRedo>
  void escapes(const RecSlice& x, int64_t begin, int64_t end, F& bad) const {
    const int64_t n = std::min(*rec.counters, rec.capacity);
    for (int64_t e = 0; e < n; ++e) {
      const UndoEntry& u = rec.escapes[e];
      const int64_t i = static_cast<int64_t>(u.index) - base;
      if (i < begin || i >= end) continue;
      if constexpr (!kRedo) {
        x.p[i] = u.p, x.m[i] = u.m, x.v[i] = u.v;
      } else {
        alignas(64) float p[W] = {u.p}, m[W] = {u.m}, v[W] = {u.v};
        alignas(64) unsigned char g[W * 4] = {};
        alignas(64) uint16_t copy[W] = {};
        std::memcpy(g, static_cast<const unsigned char*>(x.g) + i * dtype_bytes(G), dtype_bytes(G));
        body(Slice{p, m, v, nullptr, g, copy, p, m, v, nullptr}, 0, 0, bad);
        x.p[i] = p[0], x.m[i] = m[0], x.v[i] = v[0];
        if constexpr (kCopy) static_cast<uint16_t*>(x.copy)[i] = copy[0];
      }
    }
  }
};

template <class V, DType G, bool kCopy, DType C>
bool adamw_range_record(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  constexpr int W = V::W;
  using F = typename V::F;
  const AdamWScalars sr = make_adamw_scalars(t.record_config, t.seed);
  const RecordKernel<V, G, kCopy, C> k(t, s, sr, t.index_base);
  const RecordMode mode = t.record_mode;
  F bad = V::set1(0.0f);
  const RecSlice whole{t.param, static_cast<float*>(t.exp_avg), static_cast<float*>(t.exp_avg_sq), t.grad,
                       t.param_copy, t.record.dp, t.record.dm, t.record.dv};
  const auto run = [&](const RecSlice& x, int64_t i, int valid) {
    if (mode == RecordMode::write) k.write(x, i, valid, bad);
    else if (mode == RecordMode::undo) k.template undo<false>(x, i, bad);
    else k.template undo<true>(x, i, bad);
  };
  int64_t i = begin;
  bool streamed = false;
  if constexpr (V::kStream) {  // a write streams what it does not read, where aligned (stream_plan's rule)
    const auto at = [](const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
    streamed = mode == RecordMode::write && s.streaming_stores && end - begin >= kStreamMin &&
               at(t.record.dp + begin, W) && at(t.record.dm + begin, W) && at(t.record.dv + begin, W) &&
               (!kCopy || at(static_cast<const uint16_t*>(t.param_copy) + begin, 2 * W));
    if (streamed) {
      for (; i + W <= end; i += W) k.template write<true>(whole, i, W, bad);
      V::fence();
    }
  }
  if (!streamed) {
    for (; i + W <= end; i += W) run(whole, i, W);
  }
  const int64_t n = end - i;
  if (n > 0) {  // the tail through W-element buffers (zero padding; a write keeps no padding escapes)
    alignas(64) float p[W] = {}, m[W] = {}, v[W] = {};
    alignas(64) unsigned char g[W * 4] = {};
    alignas(64) uint16_t copy[W] = {};
    alignas(64) int8_t dp[W] = {}, dm[W] = {}, dv[W] = {};
    std::memcpy(p, t.param + i, n * 4);
    std::memcpy(m, static_cast<float*>(t.exp_avg) + i, n * 4);
    std::memcpy(v, static_cast<float*>(t.exp_avg_sq) + i, n * 4);
    std::memcpy(g, static_cast<const unsigned char*>(t.grad) + i * dtype_bytes(G), n * dtype_bytes(G));
    std::memcpy(dp, t.record.dp + i, n), std::memcpy(dm, t.record.dm + i, n), std::memcpy(dv, t.record.dv + i, n);
    // Escape entries name the tensor's element: the buffer stands at offset i.
    const RecordKernel<V, G, kCopy, C> tail(t, s, sr, t.index_base + i);
    const RecSlice buf{p, m, v, g, copy, dp, dm, dv};
    if (mode == RecordMode::write) tail.write(buf, 0, static_cast<int>(n), bad);
    else if (mode == RecordMode::undo) tail.template undo<false>(buf, 0, bad);
    else tail.template undo<true>(buf, 0, bad);
    std::memcpy(t.param + i, p, n * 4);
    std::memcpy(static_cast<float*>(t.exp_avg) + i, m, n * 4);
    std::memcpy(static_cast<float*>(t.exp_avg_sq) + i, v, n * 4);
    if (mode == RecordMode::write) {
      std::memcpy(t.record.dp + i, dp, n), std::memcpy(t.record.dm + i, dm, n), std::memcpy(t.record.dv + i, dv, n);
    }
    if (kCopy && mode != RecordMode::undo) std::memcpy(static_cast<uint16_t*>(t.param_copy) + i, copy, n * 2);
  }
  if (mode == RecordMode::undo) k.template escapes<false>(whole, begin, end, bad);
  if (mode == RecordMode::redo) k.template escapes<true>(whole, begin, end, bad);
  return mode != RecordMode::undo && V::any_nan(bad);
}

template <class V, DType G>
bool adamw_range_copy(const AdamWTensor& t, const AdamWScalars& s, int64_t b, int64_t e) {
  if (t.record_mode != RecordMode::none) {
    if (t.param_copy == nullptr) return adamw_range_record<V, G, false, DType::bf16>(t, s, b, e);
    if (t.param_copy_dtype == DType::bf16) return adamw_range_record<V, G, true, DType::bf16>(t, s, b, e);
    return adamw_range_record<V, G, true, DType::f16>(t, s, b, e);
  }
  if (t.param_copy == nullptr) return adamw_range_nt<V, G, false, DType::bf16>(t, s, b, e);
  if (t.param_copy_dtype == DType::bf16) return adamw_range_nt<V, G, true, DType::bf16>(t, s, b, e);
  return adamw_range_nt<V, G, true, DType::f16>(t, s, b, e);
}

// Entry point of a SIMD translation unit: picks the instantiation for this tensor's dtypes.
template <class V>
bool adamw_range(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end) {
  switch (t.grad_dtype) {
    case DType::f32: return adamw_range_copy<V, DType::f32>(t, s, begin, end);
    case DType::bf16: return adamw_range_copy<V, DType::bf16>(t, s, begin, end);
    case DType::f16: return adamw_range_copy<V, DType::f16>(t, s, begin, end);
    case DType::q8: break;  // a state format, never a gradient's (validated)
  }
  return false;
}

}  // namespace detail
}  // namespace hytrain
