// 8-bit blockwise Adam states on the CPU (quant8.h). The maps are rebuilt here from their
// definition; the encoder is checked against a linear scan over every midpoint on values that hit
// each bucket and midpoint (v's map codes its square root, a nonzero one never as 0); one step from
// fresh random codes and scales is checked against a float64 reference on every compiled SIMD path
// the CPU runs (odd sizes, partial last blocks); and every vector width, thread count, UpdateEngine slicing and out-of-place update gives the same bytes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "simd_paths.h"
#include "hytrain/adamw.h"
#include "hytrain/cpu_features.h"
#include "hytrain/dtype.h"
#include "hytrain/error.h"
#include "hytrain/quant8.h"
#include "hytrain/update_engine.h"

using namespace hytrain;

namespace {

// The magnitudes of a map, from its definition: 0; decades 10^-6 .. 10^0, the top one cut into 64
// (signed) or 128 (unsigned) equal parts of [0.1, 1] * 10^-d, each lower decade half as many, part j
// at its midpoint, fmaf(j, width, first midpoint) with the two rounded to float; 1.
std::vector<float> magnitudes(bool is_signed) {
  std::vector<float> a{0.0f};
  for (int d = 6; d >= 0; --d) {
    const int parts = (is_signed ? 64 : 128) >> d;
    const float first = static_cast<float>(std::pow(10.0, -d) * (0.1 + 0.45 / parts));
    const float width = static_cast<float>(std::pow(10.0, -d) * 0.9 / parts);
    for (int j = 0; j < parts; ++j) a.push_back(std::fma(static_cast<float>(j), width, first));
  }
  a.push_back(1.0f);
  return a;
}

// The code of x by the definition: the magnitude index counts the midpoints below |x|.
uint8_t code_by_scan(const std::vector<float>& a, bool is_signed, float x) {
  int j = 0;
  for (size_t i = 0; i + 1 < a.size(); ++i) j += std::fabs(x) > (a[i] + a[i + 1]) * 0.5f;
  if (!is_signed) return static_cast<uint8_t>(j == 0 && x > 0 ? 1 : j);  // nonzero is never 0
  if (!std::signbit(x)) return static_cast<uint8_t>(j);
  return j == 0 ? 0 : static_cast<uint8_t>(128 + std::min(j, 127));
}

float decode(const std::vector<float>& a, bool is_signed, uint8_t c) {
  if (!is_signed || c <= 128) return c < a.size() ? a[c] : 0.0f;
  return -a[c - 128];
}

// A parameter's state: master, the two moment buffers (codes, padding, scales), a bf16 gradient.
struct State {
  std::vector<float> p;
  std::vector<uint8_t> m, v;
  std::vector<uint16_t> g, copy;
  int64_t n;
  float* sm() { return reinterpret_cast<float*>(m.data() + q8_codes_bytes(n)); }
  float* sv() { return reinterpret_cast<float*>(v.data() + q8_codes_bytes(n)); }
};

State random_state(int64_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> byte(0, 255);
  State s{std::vector<float>(n), std::vector<uint8_t>(q8_state_bytes(n)), std::vector<uint8_t>(q8_state_bytes(n)),
          std::vector<uint16_t>(n), std::vector<uint16_t>(n, 0x7FFF), n};
  for (int64_t i = 0; i < n; ++i) {
    s.p[i] = normal(rng);
    s.m[i] = static_cast<uint8_t>(byte(rng));
    s.v[i] = static_cast<uint8_t>(byte(rng));
    s.g[i] = f32_to_bf16(normal(rng) * 1e-2f * (i % 7 == 0 ? 30.0f : 1.0f));
  }
  for (int64_t b = 0; b < q8_blocks(n); ++b) {
    s.sm()[b] = std::fabs(normal(rng)) * 1e-2f;
    s.sv()[b] = std::fabs(normal(rng)) * 1e-4f;
  }
  return s;
}

AdamWConfig config(int64_t step) {
  AdamWConfig c;
  c.lr = 1e-3;
  c.weight_decay = 0.05;
  c.step = step;
  c.grad_scale = 0.5;
  return c;
}

AdamWTensor tensor_of(State& s) {
  AdamWTensor t;
  t.param = s.p.data();
  t.exp_avg = s.m.data();
  t.exp_avg_sq = s.v.data();
  t.grad = s.g.data();
  t.grad_dtype = DType::bf16;
  t.param_copy = s.copy.data();
  t.numel = s.n;
  t.state_dtype = DType::q8;
  return t;
}

State run(const State& in, const AdamWConfig& c, SimdPath path, int threads) {
  State o = in;
  adamw_step(tensor_of(o), c, threads, path);
  return o;
}

bool same(const State& a, const State& b) { return a.p == b.p && a.m == b.m && a.v == b.v && a.copy == b.copy; }

}  // namespace

TEST(q8_maps_are_their_definition) {
  for (bool sg : {true, false}) {
    const Q8Map& map = q8_map(sg);
    const std::vector<float> a = magnitudes(sg);
    CHECK(static_cast<int>(a.size()) == map.magnitudes && a.size() == (sg ? 129u : 256u));
    for (int c = 0; c < 256; ++c) CHECK(map.value[c] == decode(a, sg, static_cast<uint8_t>(c)));
    CHECK(map.value[0] == 0.0f && (sg ? map.value[128] : map.value[255]) == 1.0f);
  }
}

TEST(q8_encoder_counts_the_midpoints_below_x) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_real_distribution<float> expo(-26.0f, 0.0f);
  for (bool sg : {true, false}) {
    const Q8Map& map = q8_map(sg);
    const std::vector<float> a = magnitudes(sg);
    std::vector<float> xs{0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, -1.0000001f, 1e-30f, -1e-30f, 5e-8f};
    for (size_t i = 0; i + 1 < a.size(); ++i) {  // every midpoint, and its float neighbours
      const float mid = (a[i] + a[i + 1]) * 0.5f;
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 2.0f)}) xs.insert(xs.end(), {x, -x});
    }
    for (int k = 0; k < 200000; ++k) xs.push_back(std::copysign(std::exp2(expo(rng)), unit(rng)));
    for (int k = 0; k < 20000; ++k) xs.push_back(unit(rng));
    int64_t wrong = 0, wrong_search = 0;
    for (float x : xs) {
      if (!sg && std::signbit(x)) x = -x;
      const uint8_t want = code_by_scan(a, sg, x);
      wrong += q8_encode(map, x) != want;
      wrong_search += q8_code(sg, x, q8_magnitude_index(map.mid, std::fabs(x))) != want;
    }
    CHECK_MSG(wrong == 0 && wrong_search == 0, "%s map: %lld codes off by the bucket table, %lld by the search",
              sg ? "signed" : "unsigned", static_cast<long long>(wrong), static_cast<long long>(wrong_search));
  }
}

// The arithmetic encoder (the VBMI path's) against the binary search, for every float from 2^-25 to
// 1.0001 (below, a is clamped to 2^-24; a few of those and NaN too): about 2 x 2.2e8 values.
TEST(q8_arithmetic_encoder_counts_the_midpoints_below_every_float) {
  for (bool sg : {true, false}) {
    const Q8Map& map = q8_map(sg);
    int64_t wrong = 0, checked = 0;
    uint32_t first_wrong = 0;
    const uint32_t lo = f32_bits(std::ldexp(1.0f, -25)), hi = f32_bits(1.0001f);
    for (uint32_t b = lo; b <= hi; ++b) {
      const float x = bits_f32(b);
      const bool off = q8_index_estimated(map, x) != q8_magnitude_index(map.mid, x);
      if (off && wrong++ == 0) first_wrong = b;
      ++checked;
    }
    for (float x : {0.0f, 1e-30f, 1e-10f, 5.9e-8f}) {
      wrong += q8_index_estimated(map, x) != q8_magnitude_index(map.mid, x);
      ++checked;
    }
    // A NaN (a state after a non-finite gradient) counts as 1 in both CPU encoders.
    CHECK(q8_index_estimated(map, std::nanf("")) == map.magnitudes - 1);
    CHECK(q8_encode(map, std::nanf("")) == q8_code(sg, 1.0f, map.magnitudes - 1));
    CHECK_MSG(wrong == 0, "%s map: %lld of %lld indices off, the first at %.9g", sg ? "signed" : "unsigned",
              static_cast<long long>(wrong), static_cast<long long>(checked), bits_f32(first_wrong));
  }
}

// The vector encoders themselves (AVX-512F's table; VBMI's table and arithmetic ones) against the
// binary search, for every float from 2^-25 to 1.0001 and, on the signed map, every third one negated;
// then zeros, tiny values, infinities and NaN (a NaN counts as 1).
TEST(q8_vector_encoders_code_every_float_as_the_binary_search) {
  std::vector<SimdPath> paths;
  std::vector<float> probe(kQ8Block, 0.5f);
  std::vector<uint8_t> probe_codes(kQ8Block);
  for (SimdPath p : runnable_paths()) {
    if (q8_encode_with(p, q8_map(true), probe.data(), 1.0f, probe_codes.data(), kQ8Block)) paths.push_back(p);
  }
  if (paths.empty()) return;
  const Q8Encoder chosen = q8_encoder();
  constexpr int64_t kChunk = 1 << 16;  // a multiple of kQ8Block
  std::vector<float> x(kChunk);
  std::vector<uint8_t> want(kChunk), got(kChunk);
  for (bool sg : {true, false}) {
    const Q8Map& map = q8_map(sg);
    auto reference = [&](float v) {
      const float a = std::fabs(v);
      return q8_code(sg, v, q8_magnitude_index(map.mid, a < 1.0f ? a : 1.0f));  // NaN: 1
    };
    std::vector<float> values;
    int64_t wrong = 0, checked = 0;
    float first_wrong = 0.0f;
    auto run = [&](int64_t n) {
      for (int64_t i = n; i < kChunk; ++i) x[i] = 0.0f;
      for (int64_t i = 0; i < kChunk; ++i) want[i] = reference(x[i]);
      for (SimdPath p : paths) {
        for (Q8Encoder enc : {Q8Encoder::table, Q8Encoder::arithmetic}) {
          if (p == SimdPath::avx512 && enc == Q8Encoder::arithmetic) continue;
          set_q8_encoder(enc);
          q8_encode_with(p, map, x.data(), 1.0f, got.data(), kChunk);
          for (int64_t i = 0; i < n; ++i) {
            if (got[i] != want[i] && wrong++ == 0) first_wrong = x[i];
          }
          checked += n;
        }
      }
    };
    const uint32_t lo = f32_bits(std::ldexp(1.0f, -25)), hi = f32_bits(1.0001f);
    for (int neg = 0; neg < (sg ? 2 : 1); ++neg) {
      int64_t n = 0;
      for (uint32_t b = lo; b <= hi; b += neg ? 3 : 1) {
        x[n++] = neg ? -bits_f32(b) : bits_f32(b);
        if (n == kChunk) run(n), n = 0;
      }
      run(n);
    }
    int64_t n = 0;
    for (float v : {0.0f, -0.0f, 1e-30f, 1e-10f, 5.9e-8f, 1.0f, std::numeric_limits<float>::infinity(),
                    std::nanf(""), 1e-40f}) {
      x[n++] = v;
      if (sg) x[n++] = -v;
    }
    run(n);
    CHECK_MSG(wrong == 0, "%s map: %lld of %lld codes off, the first at %.9g", sg ? "signed" : "unsigned",
              static_cast<long long>(wrong), static_cast<long long>(checked), first_wrong);
  }
  set_q8_encoder(chosen);
}

// Every path, and on the VBMI path both encoders (the bucket table and the arithmetic one).
TEST(q8_step_matches_float64_on_every_path) {
  const int64_t sizes[] = {0, 1, 15, 255, 256, 257, 1000, 100'003};
  const std::vector<float> as = magnitudes(true), au = magnitudes(false);
  const Q8Encoder chosen = q8_encoder();
  for (Q8Encoder enc : {Q8Encoder::table, Q8Encoder::arithmetic}) {
  set_q8_encoder(enc);
  for (SimdPath path : runnable_paths()) {
    for (int64_t n : sizes) {
      const State in = random_state(n, static_cast<uint32_t>(n * 7 + 3));
      const AdamWConfig c = config(5);
      const State o = run(in, c, path, 2);
      State ref_in = in;  // for the old scales
      const double bc1 = 1.0 - std::pow(c.beta1, 5), bc2 = 1.0 - std::pow(c.beta2, 5);
      int64_t bad_p = 0, bad_copy = 0, bad_scale = 0, bad_code = 0;
      for (int64_t b = 0; b < q8_blocks(n); ++b) {
        const int64_t lo = b * kQ8Block, hi = std::min(n, lo + kQ8Block);
        std::vector<double> m(hi - lo), v(hi - lo);
        double am = 0, av = 0;
        for (int64_t i = lo; i < hi; ++i) {
          const double m0 = double(decode(as, true, in.m[i])) * ref_in.sm()[b];
          const double u0 = double(decode(au, false, in.v[i])) * ref_in.sv()[b];  // v is kept as its root
          const double v0 = u0 * u0;
          const double g = double(bf16_to_f32(in.g[i])) * c.grad_scale;
          m[i - lo] = m0 + (1.0 - c.beta1) * (g - m0);
          v[i - lo] = c.beta2 * v0 + (1.0 - c.beta2) * g * g;
          const double u = c.lr / bc1 * m[i - lo] / (std::sqrt(v[i - lo]) / std::sqrt(bc2) + c.eps);
          const double p = in.p[i] * (1.0 - c.lr * c.weight_decay) - u;
          bad_p += std::fabs(o.p[i] - p) > 2e-6 * std::fmax(std::fabs(p), 1e-3) + 1e-5 * std::fabs(u);
          bad_copy += o.copy[i] != f32_to_bf16(o.p[i]);
          am = std::max(am, std::fabs(m[i - lo]));
          av = std::max(av, std::sqrt(v[i - lo]));
        }
        State& oo = const_cast<State&>(o);
        const double sm = oo.sm()[b], sv = oo.sv()[b];
        bad_scale += std::fabs(sm - am) > 1e-5 * am || std::fabs(sv - av) > 1e-5 * av;
        for (int64_t i = lo; i < hi; ++i) {
          // The nearest code of the exact value; where fp32 arithmetic puts it within 1e-5 of a
          // midpoint, the code on the other side of it is right too.
          for (int k = 0; k < 2; ++k) {
            const bool sg = k == 0;
            const double x = (sg ? m[i - lo] : std::sqrt(v[i - lo])) / (sg ? sm : sv);
            const uint8_t got = (sg ? o.m : o.v)[i];
            const std::vector<float>& a = sg ? as : au;
            bool ok = false;
            for (double d : {0.0, 1e-5, -1e-5}) {
              ok = ok || got == code_by_scan(a, sg, static_cast<float>(x * (1.0 + d)));
            }
            bad_code += !ok;
          }
        }
      }
      CHECK_MSG(bad_p == 0 && bad_copy == 0 && bad_scale == 0 && bad_code == 0,
                "path %s (%s encoder) n=%lld: %lld weights, %lld copies, %lld block scales, %lld codes off",
                simd_path_name(path), enc == Q8Encoder::table ? "table" : "arithmetic", static_cast<long long>(n),
                static_cast<long long>(bad_p), static_cast<long long>(bad_copy), static_cast<long long>(bad_scale),
                static_cast<long long>(bad_code));
    }
  }
  }
  set_q8_encoder(chosen);
}

TEST(q8_states_are_the_same_bytes_on_every_width_thread_count_slicing_and_out_of_place) {
  const int64_t n = 300'007;
  const State in = random_state(n, 11);
  const AdamWConfig c = config(3);
  std::vector<State> outs;
  const Q8Encoder chosen = q8_encoder();
  for (SimdPath path : runnable_paths()) {
    if (path == SimdPath::scalar) continue;  // the portable path need not fuse multiply-adds
    for (Q8Encoder enc : {Q8Encoder::table, Q8Encoder::arithmetic}) {  // the VBMI path has both
      set_q8_encoder(enc);
      outs.push_back(run(in, c, path, 1));
      outs.push_back(run(in, c, path, 5));
    }
  }
  set_q8_encoder(chosen);
  if (outs.empty()) return;
  // The update engine's slices (1100 elements: rounded up to whole blocks).
  State sliced = in;
  {
    UpdateEngine engine(3, 1100);
    UpdateJob j;
    j.tensor = tensor_of(sliced);
    j.tensor.state_numel = n;
    j.config = c;
    engine.submit(0, {j});
    engine.wait(0);
  }
  outs.push_back(sliced);
  // Out of place: the input untouched, the outputs the in-place result.
  State src = in, dst = in;
  std::fill(dst.m.begin(), dst.m.begin() + n, 0x55);  // codes and scales overwritten, the padding kept
  std::fill(dst.v.begin(), dst.v.begin() + n, 0xAA);
  std::fill(dst.sm(), dst.sm() + q8_blocks(n), -1.0f);
  std::fill(dst.sv(), dst.sv() + q8_blocks(n), -1.0f);
  AdamWTensor t = tensor_of(src);
  t.param_out = dst.p.data();
  t.exp_avg_out = dst.m.data();
  t.exp_avg_sq_out = dst.v.data();
  t.param_copy = dst.copy.data();
  adamw_step(t, c, 4);
  CHECK(src.p == in.p && src.m == in.m && src.v == in.v);
  outs.push_back(dst);
  for (size_t k = 0; k < outs.size(); ++k) {
    const State& o = outs[k];
    CHECK_MSG(same(o, outs[0]), "result %zu of %zu differs (p %d m %d v %d copy %d)", k, outs.size(),
              o.p == outs[0].p, o.m == outs[0].m, o.v == outs[0].v, o.copy == outs[0].copy);
  }
}

TEST(q8_zero_state_is_zero_bytes_and_a_tensor_starts_on_a_block) {
  // All-zero buffers are a fresh state: the first step gives m = (1 - beta1) g, v = (1 - beta2) g^2.
  State s = random_state(1000, 3);
  std::fill(s.m.begin(), s.m.end(), 0);
  std::fill(s.v.begin(), s.v.end(), 0);
  const State o = run(s, config(1), best_simd_path(), 1);
  State& oo = const_cast<State&>(o);
  for (int64_t b = 0; b < q8_blocks(1000); ++b) {
    float gmax = 0;
    for (int64_t i = b * kQ8Block; i < std::min<int64_t>(1000, (b + 1) * kQ8Block); ++i) {
      gmax = std::max(gmax, std::fabs(bf16_to_f32(s.g[i]) * 0.5f));
    }
    CHECK(std::fabs(oo.sm()[b] - 0.1f * gmax) <= 1e-6f * gmax);
  }
  AdamWTensor t = tensor_of(s);
  t.index_base = 100;  // not a block boundary
  CHECK_THROWS(adamw_step(t, config(1)));
  t.index_base = 0;
  AdamWConfig c = config(1);
  c.amsgrad = true;
  std::vector<float> vmax(1000);
  t.max_exp_avg_sq = vmax.data();
  CHECK_THROWS(adamw_step(t, c));
}

HYTEST_MAIN()
