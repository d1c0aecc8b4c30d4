// Compact (bf16) Adam states on the CPU: one step from fresh random states against a float64
// reference, on every compiled SIMD path the CPU runs, odd sizes included. The new m and v must be
// one of the two bf16 values around the reference, rounded the way the counter-based hash says
// (written out again here, not taken from the library); the same bits on every vector width,
// thread count and slicing; and unbiased on average, so that v's slow decay survives rounding.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "simd_paths.h"
#include "hytrain/adamw.h"
#include "hytrain/cpu_features.h"
#include "hytrain/dtype.h"
#include "hytrain/error.h"
#include "hytrain/update_engine.h"

using namespace hytrain;

namespace {

// The rounding's random bits, from its definition: lowbias32-style mixing of the element index
// plus a key from the seed and the step.
uint32_t hash32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x21F0AAADu;
  x = (x ^ (x >> 15)) * 0x735A2D97u;
  return x ^ (x >> 15);
}

uint32_t element_bits(uint32_t seed, int64_t step, int64_t i) {
  const uint32_t key = hash32(seed ^ hash32(static_cast<uint32_t>(step)));
  return hash32(static_cast<uint32_t>(i) + key);
}

float widen(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t stochastic(float x, uint32_t r16) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + r16) >> 16);
}

struct Inputs {
  std::vector<float> p;
  std::vector<uint16_t> m, v, g;
};

Inputs random_inputs(int64_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Inputs in{std::vector<float>(n), std::vector<uint16_t>(n), std::vector<uint16_t>(n), std::vector<uint16_t>(n)};
  for (int64_t i = 0; i < n; ++i) {
    in.p[i] = normal(rng);
    in.m[i] = f32_to_bf16(normal(rng) * 1e-2f);
    in.v[i] = f32_to_bf16(std::fabs(normal(rng)) * 1e-4f);
    in.g[i] = f32_to_bf16(normal(rng) * 1e-2f);
  }
  return in;
}

struct Out {
  std::vector<float> p;
  std::vector<uint16_t> m, v, copy;
};

AdamWConfig config(int64_t step) {
  AdamWConfig c;
  c.lr = 1e-3;
  c.weight_decay = 0.05;
  c.step = step;
  c.grad_scale = 0.5;
  return c;
}

Out run(const Inputs& in, const AdamWConfig& c, uint32_t seed, SimdPath path, int threads) {
  Out o{in.p, in.m, in.v, std::vector<uint16_t>(in.p.size(), 0x7FFF)};
  AdamWTensor t;
  t.param = o.p.data();
  t.exp_avg = o.m.data();
  t.exp_avg_sq = o.v.data();
  t.grad = in.g.data();
  t.grad_dtype = DType::bf16;
  t.param_copy = o.copy.data();
  t.numel = static_cast<int64_t>(in.p.size());
  t.state_dtype = DType::bf16;
  t.seed = seed;
  adamw_step(t, c, threads, path);
  return o;
}

}  // namespace

TEST(bf16_states_round_stochastically_around_float64) {
  const int64_t sizes[] = {0, 1, 15, 17, 33, 1000, 100'003};
  for (SimdPath path : runnable_paths()) {
    for (int64_t n : sizes) {
      const uint32_t seed = static_cast<uint32_t>(n * 7 + 3);
      const Inputs in = random_inputs(n, seed);
      const AdamWConfig c = config(5);
      const Out o = run(in, c, seed, path, 2);
      const double bc1 = 1.0 - std::pow(c.beta1, 5), bc2 = 1.0 - std::pow(c.beta2, 5);
      int64_t outside = 0, other_way = 0, bad_p = 0, bad_copy = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double g = double(widen(in.g[i])) * c.grad_scale;
        const double m = widen(in.m[i]) + (1.0 - c.beta1) * (g - widen(in.m[i]));
        const double v = c.beta2 * widen(in.v[i]) + (1.0 - c.beta2) * g * g;
        const double p = in.p[i] * (1.0 - c.lr * c.weight_decay) -
                         c.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + c.eps);
        bad_p += std::fabs(o.p[i] - p) > 2e-6 * std::fmax(std::fabs(p), 1e-3);
        bad_copy += o.copy[i] != f32_to_bf16(o.p[i]);
        const uint32_t r = element_bits(seed, 5, i);
        const double ref[2] = {m, v};
        // What fp32 arithmetic may add to the reference: a few roundings of the terms' size.
        const double terms[2] = {std::fabs(widen(in.m[i])) + std::fabs(g), widen(in.v[i]) + g * g};
        const uint16_t got[2] = {o.m[i], o.v[i]};
        const uint32_t r16[2] = {r & 0xFFFFu, r >> 16};
        for (int k = 0; k < 2; ++k) {
          // Either bf16 neighbour of the reference: less than one bf16 ulp (<= 2^-7 |x|) away.
          outside += std::fabs(widen(got[k]) - ref[k]) > std::ldexp(std::fabs(ref[k]), -7) + std::ldexp(terms[k], -21);
          other_way += got[k] != stochastic(static_cast<float>(ref[k]), r16[k]);
        }
      }
      CHECK_MSG(bad_p == 0 && bad_copy == 0 && outside == 0 && other_way <= 1 + 2 * n / 1000,
                "path %s n=%lld: %lld weights, %lld copies off; %lld states outside the bracket, %lld "
                "rounded against the hash", simd_path_name(path), static_cast<long long>(n),
                static_cast<long long>(bad_p), static_cast<long long>(bad_copy),
                static_cast<long long>(outside), static_cast<long long>(other_way));
    }
  }
}

TEST(bf16_states_are_the_same_bits_on_every_width_thread_count_and_slicing) {
  const int64_t n = 300'007;
  const Inputs in = random_inputs(n, 11);
  const AdamWConfig c = config(3);
  std::vector<Out> outs;
  for (SimdPath path : runnable_paths()) {
    if (path == SimdPath::scalar) continue;  // the portable path need not fuse multiply-adds
    outs.push_back(run(in, c, 42, path, 1));
    outs.push_back(run(in, c, 42, path, 5));
  }
  // The update engine's slices hash each element by its index in the parameter.
  Out sliced{in.p, in.m, in.v, std::vector<uint16_t>(n, 0x7FFF)};
  {
    UpdateEngine engine(3, 4096);
    UpdateJob j;
    j.tensor.param = sliced.p.data();
    j.tensor.exp_avg = sliced.m.data();
    j.tensor.exp_avg_sq = sliced.v.data();
    j.tensor.grad = in.g.data();
    j.tensor.grad_dtype = DType::bf16;
    j.tensor.param_copy = sliced.copy.data();
    j.tensor.numel = n;
    j.tensor.state_dtype = DType::bf16;
    j.tensor.seed = 42;
    j.config = c;
    engine.submit(0, {j});
    engine.wait(0);
  }
  if (best_simd_path() != SimdPath::scalar) outs.push_back(sliced);
  CHECK(!outs.empty());
  for (const Out& o : outs) {
    CHECK(o.p == outs[0].p && o.m == outs[0].m && o.v == outs[0].v && o.copy == outs[0].copy);
  }
  // Another seed or step rounds other elements the other way.
  const Out other = run(in, c, 43, SimdPath::automatic, 1);
  CHECK(other.m != outs[0].m && other.p == outs[0].p);
}

TEST(bf16_v_decays_on_average_where_nearest_rounding_would_keep_it) {
  // No gradient: v shrinks by beta2 = 0.999 per step, a tenth of a percent, less than half a bf16
  // ulp (0.4 %): rounded to nearest it would never move. Stochastic rounding keeps the decay on
  // average: after 300 steps the mean is 0.999^300 = 0.7407.
  const int64_t n = 1 << 16;
  for (SimdPath path : runnable_paths()) {
    std::vector<float> p(n, 1.0f);
    std::vector<uint16_t> m(n, 0), v(n, f32_to_bf16(1.0f)), g(n, 0);
    for (int step = 1; step <= 300; ++step) {
      AdamWTensor t;
      t.param = p.data();
      t.exp_avg = m.data();
      t.exp_avg_sq = v.data();
      t.grad = g.data();
      t.grad_dtype = DType::bf16;
      t.numel = n;
      t.state_dtype = DType::bf16;
      t.seed = 9;
      AdamWConfig c;
      c.lr = 0.0;
      c.weight_decay = 0.0;
      c.step = step;
      adamw_step(t, c, 2, path);
    }
    double mean = 0;
    for (uint16_t h : v) mean += widen(h);
    mean /= n;
    const double want = std::pow(0.999, 300);
    CHECK_MSG(std::fabs(mean / want - 1.0) < 2e-3, "path %s: mean v %.6f, want %.6f", simd_path_name(path), mean, want);
  }
}

TEST(bf16_states_refuse_amsgrad_and_other_dtypes) {
  std::vector<float> p(64, 1.0f), vmax(64, 0.0f);
  std::vector<uint16_t> m(64, 0), v(64, 0), g(64, 0);
  AdamWTensor t;
  t.param = p.data();
  t.exp_avg = m.data();
  t.exp_avg_sq = v.data();
  t.max_exp_avg_sq = vmax.data();
  t.grad = g.data();
  t.grad_dtype = DType::bf16;
  t.numel = 64;
  t.state_dtype = DType::bf16;
  AdamWConfig c;
  c.amsgrad = true;
  CHECK_THROWS(adamw_step(t, c));
  c.amsgrad = false;
  t.state_dtype = DType::f16;
  CHECK_THROWS(adamw_step(t, c));
}

HYTEST_MAIN()
