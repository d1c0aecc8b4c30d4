// CPU AdamW against an independent float64 reference, every compiled SIMD path the CPU runs, in
// lockstep over 20 steps on fresh random inputs of many sizes (empty, tails shorter than a vector,
// tens of millions). Outputs start poisoned (the bf16/fp16 copy) so an unwritten element fails.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <pmmintrin.h>  // MXCSR: _MM_DENORMALS_ZERO_ON
#endif

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

// Tolerances, element by element, for fp32 state after 20 steps against float64, with
// e = |x - ref| / max(|ref|, rms(ref)) (the rms floor covers values passing near zero, where any
// fp32 computation has only absolute accuracy):
//   every element e <= 2e-6, and at most one element in 1e5 has e > 1e-6.
// 20 steps of 3-4 fp32 roundings each put the worst of tens of millions of elements just past 1e-6
// for any fp32 implementation (PyTorch's own AdamW included: tests/python/test_cpu_adam.py measures
// it), while the bulk sits far below.
constexpr double kRelAll = 2e-6;
constexpr double kRelBulk = 1e-6;
constexpr double kBulkFraction = 1e-5;

struct Ref {  // float64 AdamW state
  std::vector<double> p, m, v, vmax;
};

struct State {  // fp32 state of one SIMD path
  SimdPath path;
  std::vector<float> p, m, v, vmax;
  std::vector<uint16_t> copy;
};

double grad_value(const std::vector<uint16_t>& h, const std::vector<float>& f, DType dt, int64_t i) {
  if (dt == DType::f32) return f[i];
  return dt == DType::bf16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
}

void ref_step(Ref& r, const AdamWConfig& c, const std::vector<uint16_t>& gh,
              const std::vector<float>& gf, DType dt) {
  const double bc1 = 1.0 - std::pow(c.beta1, c.step);
  const double bc2 = 1.0 - std::pow(c.beta2, c.step);
  for (size_t i = 0; i < r.p.size(); ++i) {
    double g = grad_value(gh, gf, dt, i) * static_cast<double>(static_cast<float>(c.grad_scale));
    if (!c.decoupled) g += c.weight_decay * r.p[i];
    if (c.decoupled) r.p[i] *= 1.0 - c.lr * c.weight_decay;
    r.m[i] = c.beta1 * r.m[i] + (1.0 - c.beta1) * g;
    r.v[i] = c.beta2 * r.v[i] + (1.0 - c.beta2) * g * g;
    double vd = r.v[i];
    if (c.amsgrad) vd = r.vmax[i] = std::max(r.vmax[i], r.v[i]);
    r.p[i] -= c.lr / bc1 * r.m[i] / (std::sqrt(vd) / std::sqrt(bc2) + c.eps);
  }
}

// Returns the number of elements outside tolerance, printing the worst.
int64_t compare(const char* what, SimdPath path, const std::vector<float>& got,
                const std::vector<double>& want) {
  if (want.empty()) return 0;
  double ss = 0;
  for (double w : want) ss += w * w;
  const double floor = std::sqrt(ss / want.size());
  int64_t bad = 0, over_bulk = 0;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), floor);
    if (!(err <= kRelAll)) ++bad;  // NaN fails too
    if (!(err <= kRelBulk)) ++over_bulk;
    worst = std::max(worst, err);
  }
  if (over_bulk > kBulkFraction * static_cast<double>(want.size())) bad += over_bulk;
  if (bad || getenv("HYTEST_VERBOSE")) {
    std::printf("  %s [%s]: %lld bad, %lld over %.0e, worst relative error %.3g\n", what,
                simd_path_name(path), static_cast<long long>(bad),
                static_cast<long long>(over_bulk), kRelBulk, worst);
  }
  return bad;
}

struct Case {
  int64_t n;
  DType grad;
  bool copy;
  DType copy_dtype;
  bool amsgrad;
  bool decoupled;
  int threads;
  int steps;
};

void run_case(const Case& k, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> uni(0.0, 1.0);

  Ref ref;
  ref.p.resize(k.n);
  ref.m.assign(k.n, 0.0);
  ref.v.assign(k.n, 0.0);
  ref.vmax.assign(k.n, 0.0);
  std::vector<float> p0(k.n);
  for (int64_t i = 0; i < k.n; ++i) ref.p[i] = p0[i] = normal(rng);

  std::vector<State> states;
  for (SimdPath path : runnable_paths()) {
    states.push_back({path, p0, std::vector<float>(k.n, 0.0f), std::vector<float>(k.n, 0.0f),
                      std::vector<float>(k.n, 0.0f), std::vector<uint16_t>(k.copy ? k.n : 0)});
  }

  std::vector<float> gf(k.grad == DType::f32 ? k.n : 0);
  std::vector<uint16_t> gh(k.grad == DType::f32 ? 0 : k.n);
  for (int step = 1; step <= k.steps; ++step) {
    AdamWConfig c;
    c.lr = 1e-3 * (0.5 + uni(rng));  // changes every step, as under an LR scheduler
    c.beta1 = 0.9;
    c.beta2 = 0.999;
    c.eps = 1e-8;
    c.weight_decay = 0.01 + 0.1 * uni(rng);
    c.step = step;
    c.decoupled = k.decoupled;
    c.amsgrad = k.amsgrad;
    c.grad_scale = 0.25 + uni(rng);
    const float gstd = static_cast<float>(std::exp(4.0 * uni(rng) - 2.0));  // magnitudes vary
    for (int64_t i = 0; i < k.n; ++i) {
      const float g = normal(rng) * gstd;
      if (k.grad == DType::f32) gf[i] = g;
      else gh[i] = k.grad == DType::bf16 ? f32_to_bf16(g) : f32_to_f16(g);
    }
    ref_step(ref, c, gh, gf, k.grad);

    for (State& s : states) {
      std::fill(s.copy.begin(), s.copy.end(), uint16_t{0x7FFF});  // poison: a NaN pattern
      AdamWTensor t;
      t.param = s.p.data();
      t.exp_avg = s.m.data();
      t.exp_avg_sq = s.v.data();
      t.max_exp_avg_sq = k.amsgrad ? s.vmax.data() : nullptr;
      t.grad = k.grad == DType::f32 ? static_cast<const void*>(gf.data()) : gh.data();
      t.grad_dtype = k.grad;
      t.param_copy = k.copy ? s.copy.data() : nullptr;
      t.param_copy_dtype = k.copy_dtype;
      t.numel = k.n;
      const bool nonfinite = adamw_step(t, c, k.threads, s.path);
      CHECK_MSG(!nonfinite, "false non-finite report at n=%lld", static_cast<long long>(k.n));
    }
  }

  for (State& s : states) {
    int64_t bad = compare("param", s.path, s.p, ref.p) + compare("exp_avg", s.path, s.m, ref.m) +
                  compare("exp_avg_sq", s.path, s.v, ref.v);
    if (k.amsgrad) bad += compare("max_exp_avg_sq", s.path, s.vmax, ref.vmax);
    int64_t bad_copy = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(s.copy.size()); ++i) {
      const uint16_t want = k.copy_dtype == DType::bf16 ? f32_to_bf16(s.p[i]) : f32_to_f16(s.p[i]);
      bad_copy += s.copy[i] != want;
    }
    CHECK_MSG(bad == 0 && bad_copy == 0,
              "path %s n=%lld grad=%s copy=%d amsgrad=%d decoupled=%d: %lld state, %lld copy errors",
              simd_path_name(s.path), static_cast<long long>(k.n), dtype_name(k.grad), k.copy,
              k.amsgrad, k.decoupled, static_cast<long long>(bad), static_cast<long long>(bad_copy));
  }
  // AVX2 and AVX-512 do the same fused operations in the same order: bit-identical results.
  const State* a2 = nullptr;
  const State* a5 = nullptr;
  for (const State& s : states) {
    if (s.path == SimdPath::avx2) a2 = &s;
    if (s.path == SimdPath::avx512) a5 = &s;
  }
  if (a2 && a5) CHECK(a2->p == a5->p && a2->m == a5->m && a2->v == a5->v && a2->copy == a5->copy);
}

}  // namespace

TEST(sizes_and_grad_dtypes_match_float64) {
  const int64_t sizes[] = {0, 1, 2, 7, 8, 15, 16, 17, 31, 33, 100, 1023, 4097, 65537, 300001};
  uint32_t seed = 1;
  for (int64_t n : sizes) {
    run_case({n, DType::f32, false, DType::bf16, false, true, 2, 20}, seed++);
    run_case({n, DType::bf16, true, DType::bf16, false, true, 2, 20}, seed++);
    run_case({n, DType::f16, true, DType::f16, false, true, 2, 20}, seed++);
  }
}

TEST(adam_l2_and_amsgrad_match_float64) {
  run_case({100003, DType::f32, true, DType::bf16, false, false, 2, 20}, 101);
  run_case({100003, DType::bf16, true, DType::f16, true, true, 2, 20}, 102);
  run_case({4099, DType::f16, false, DType::bf16, true, false, 3, 20}, 103);
}

TEST(tens_of_millions_match_float64) {
  run_case({20'000'003, DType::bf16, true, DType::bf16, false, true, 2, 20}, 201);
}

TEST(thread_count_does_not_change_results) {
  const int64_t n = 1'000'001;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> p(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    g[i] = normal(rng);
  }
  std::vector<float> results[3];
  const int threads[3] = {1, 2, 5};
  for (int k = 0; k < 3; ++k) {
    std::vector<float> pk = p, m(n, 0.0f), v(n, 0.0f);
    AdamWTensor t{pk.data(), m.data(), v.data(), nullptr, g.data(), DType::f32, nullptr,
                  DType::bf16, n};
    AdamWConfig c;
    for (int step = 1; step <= 3; ++step) {
      c.step = step;
      adamw_step(t, c, threads[k]);
    }
    results[k] = pk;
  }
  CHECK(results[0] == results[1] && results[0] == results[2]);
}

TEST(gradient_and_weight_copy_may_share_a_buffer) {
  // The offload pipeline stages a bf16/fp16 gradient and receives the new weight in one buffer:
  // each element's gradient is read before its copy is written, on every SIMD path and in the tail.
  const int64_t n = 100'003;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (DType half : {DType::bf16, DType::f16}) {
    for (SimdPath path : compiled_simd_paths()) {
      if (!cpu_supports(path)) continue;
      std::vector<float> p(n), p2, m(n, 0.1f), m2, v(n, 0.01f), v2;
      std::vector<uint16_t> g(n), copy(n), shared;
      for (int64_t i = 0; i < n; ++i) {
        p[i] = normal(rng);
        const float x = normal(rng) * 1e-2f;
        g[i] = half == DType::bf16 ? f32_to_bf16(x) : f32_to_f16(x);
      }
      p2 = p, m2 = m, v2 = v, shared = g;
      AdamWConfig c;
      c.step = 3;
      AdamWTensor apart{p.data(), m.data(), v.data(), nullptr, g.data(), half, copy.data(), half, n};
      AdamWTensor same{p2.data(), m2.data(), v2.data(), nullptr, shared.data(), half, shared.data(), half, n};
      adamw_step(apart, c, 3, path);
      adamw_step(same, c, 3, path);
      CHECK(p == p2 && m == m2 && v == v2 && copy == shared);
    }
  }
}

TEST(bf16_weight_copies_round_every_class_of_float_as_the_scalar_conversion) {
  // The weight copy (fp32 and 8-bit states, the copy apart and over the gradient) against dtype.h's
  // f32_to_bf16 for floats of every class: a sweep of bit patterns (every sign, exponent and the
  // mantissa's top and bottom bits), round-to-even ties both ways, denormals, zeros, infinities, NaNs
  // of every sign and payload, and values that round up to infinity. With lr = 0 and no decay a
  // finite weight stays (a NaN comes back quiet; an infinite one NaN, through the L2 term's 0 * inf),
  // and each copy must be f32_to_bf16 of the weight written.
  // One instruction rounds on CPUs with AVX512_BF16 (avx512vbmi) where a vector holds no NaN or
  // denormal: the vectors here mix them in and leave them out.
  std::vector<uint32_t> bits;
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t e = 0; e < 256; ++e) {
      for (uint32_t mant : {0u, 1u, 0x7FFFu, 0x8000u, 0x8001u, 0x18000u, 0x10000u, 0x3FFFFFu, 0x400000u, 0x7FFFFFu}) {
        bits.push_back(sign | (e << 23) | mant);
      }
    }
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 20000; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  for (int i = 0; i < 20000; ++i) bits.push_back(0x3F000000u + (static_cast<uint32_t>(rng()) & 0xFFFFFFu));  // normals only
  // Runs of one class, 32 long, so whole vectors of them take the one-instruction rounding: zeros, the
  // smallest normal, the largest finite (rounds up to infinity) and a tie below it that does too.
  while (bits.size() % 32) bits.push_back(0x3F800000u);
  for (uint32_t x : {0x00000000u, 0x80000000u, 0x00800000u, 0x80800000u, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F7F8000u,
                     0x7F7E8000u}) {
    bits.insert(bits.end(), 32, x);
  }
  const int64_t n = static_cast<int64_t>(bits.size());
  for (DType states : {DType::f32, DType::q8}) {
    for (bool shared : {false, true}) {
      for (SimdPath path : runnable_paths()) {
        std::vector<float> p(n);
        for (int64_t i = 0; i < n; ++i) p[i] = bits_f32(bits[i]);
        std::vector<uint16_t> g(n, 0), copy(n, 0x1234);
        const int64_t sb = states == DType::q8 ? q8_state_bytes(n) : n * 4;
        std::vector<uint8_t> m(sb, 0), v(sb, 0);
        AdamWConfig c;
        c.lr = 0.0;
        c.weight_decay = 0.0;
        AdamWTensor t{p.data(), m.data(), v.data(), nullptr, g.data(), DType::bf16,
                      shared ? g.data() : copy.data(), DType::bf16, n};
        t.state_dtype = states;
        adamw_step(t, c, /*num_threads=*/2, path);
        const std::vector<uint16_t>& out = shared ? g : copy;
        int64_t wrong = 0;
        for (int64_t i = 0; i < n; ++i) {
          const bool finite = (bits[i] & 0x7F800000u) != 0x7F800000u;
          wrong += finite && f32_bits(p[i]) != bits[i];  // the weight stayed
          wrong += out[i] != f32_to_bf16(p[i]);
        }
        if (wrong) std::fprintf(stderr, "  %s, %s states, copy %s: %lld wrong\n", simd_path_name(path),
                                states == DType::q8 ? "8-bit" : "fp32", shared ? "over the gradient" : "apart",
                                static_cast<long long>(wrong));
        CHECK(wrong == 0);
      }
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
TEST(bf16_weight_copies_of_denormal_weights_under_daz_round_as_the_scalar_conversion) {
  // MXCSR.DAZ (torch.set_flush_denormal(True)) on the updating thread: the arithmetic reads denormal
  // inputs as zero, but new weights may still be denormal (no FTZ), and their copies must be
  // f32_to_bf16's on every path, the vector paths' weights and copies the same bits. (vcvtneps2bf16's guard classes a denormal as zero
  // under DAZ: the kernel then takes the portable rounding.) One thread: the calling one.
  const int64_t n = 4096;
  std::vector<float> p0(n);
  for (int64_t i = 0; i < n; ++i) p0[i] = bits_f32(0x00800000u + static_cast<uint32_t>(i) * 517u);  // just above min normal
  std::vector<uint16_t> ref_copy;
  std::vector<float> ref_p;
  for (SimdPath path : runnable_paths()) {
    std::vector<float> p = p0, m(n, 0.0f), v(n, 0.0f);
    std::vector<uint16_t> g(n, f32_to_bf16(1.0f)), copy(n, 0x1234);
    AdamWConfig c;
    c.lr = 2e-39;  // a first step moves p by -lr / (1 - beta1) = -2e-38 (normal): denormal results
    c.weight_decay = 0.0;
    AdamWTensor t{p.data(), m.data(), v.data(), nullptr, g.data(), DType::bf16, copy.data(), DType::bf16, n};
    const unsigned csr = _mm_getcsr();
    _mm_setcsr((csr | _MM_DENORMALS_ZERO_ON) & ~static_cast<unsigned>(_MM_FLUSH_ZERO_ON));
    adamw_step(t, c, 1, path);
    _mm_setcsr(csr);
    int64_t denormal = 0, wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      denormal += p[i] != 0.0f && std::fabs(p[i]) < 1.17549435e-38f;
      wrong += copy[i] != f32_to_bf16(p[i]);
    }
    if (wrong) std::fprintf(stderr, "  %s: %lld copies wrong\n", simd_path_name(path), static_cast<long long>(wrong));
    CHECK(wrong == 0);
    if (path == SimdPath::scalar) continue;  // separate multiply and add: the denormal product read as 0
    CHECK(denormal > n / 2);  // fused: most new weights denormal
    if (ref_p.empty()) ref_p = p, ref_copy = copy;
    CHECK(p == ref_p && copy == ref_copy);
  }
}
#endif

TEST(out_of_place_equals_in_place_and_leaves_the_input_alone) {
  // A speculative update writes the new state elsewhere: bit for bit what the in-place update
  // writes, with the input state untouched, on every SIMD path, in the tail, with amsgrad, in
  // threaded pieces and through the UpdateEngine's slices.
  const int64_t n = 100'003;
  std::mt19937 rng(13);
  std::normal_distribution<float> normal;
  std::vector<float> p(n), m(n), v(n), vmax(n);
  std::vector<uint16_t> g(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    m[i] = normal(rng) * 1e-2f;
    v[i] = std::abs(normal(rng)) * 1e-4f;
    vmax[i] = v[i] * (i % 3 == 0 ? 2.0f : 1.0f);
    g[i] = f32_to_bf16(normal(rng) * 1e-2f);
  }
  for (bool amsgrad : {false, true}) {
    AdamWConfig c;
    c.step = 5;
    c.amsgrad = amsgrad;
    c.grad_scale = 0.37;
    for (SimdPath path : runnable_paths()) {
      std::vector<float> ip = p, im = m, iv = v, ivmax = vmax;
      std::vector<uint16_t> icopy(n), ocopy(n);
      AdamWTensor in_place{ip.data(), im.data(), iv.data(), ivmax.data(), g.data(), DType::bf16,
                           icopy.data(), DType::bf16, n};
      adamw_step(in_place, c, 3, path);
      std::vector<float> sp = p, sm = m, sv = v, svmax = vmax;
      std::vector<float> op(n, NAN), om(n, NAN), ov(n, NAN), ovmax(n, NAN);
      AdamWTensor apart{sp.data(), sm.data(), sv.data(), svmax.data(), g.data(), DType::bf16,
                        ocopy.data(), DType::bf16, n};
      apart.param_out = op.data();
      apart.exp_avg_out = om.data();
      apart.exp_avg_sq_out = ov.data();
      apart.max_exp_avg_sq_out = ovmax.data();
      adamw_step(apart, c, 3, path);
      CHECK_MSG(op == ip && om == im && ov == iv && ocopy == icopy, "%s amsgrad=%d", simd_path_name(path),
                int(amsgrad));
      CHECK(!amsgrad || ovmax == ivmax);
      CHECK(sp == p && sm == m && sv == v && svmax == vmax);
    }
    UpdateEngine engine(2, 4096, best_simd_path());  // 25 slices, the last a short one
    std::vector<float> sp = p, sm = m, sv = v, svmax = vmax;
    std::vector<float> op(n, NAN), om(n, NAN), ov(n, NAN), ovmax(n, NAN), ip = p, im = m, iv = v,
                                   ivmax = vmax;
    UpdateJob job;
    job.tensor = AdamWTensor{sp.data(), sm.data(), sv.data(), svmax.data(), g.data(), DType::bf16,
                             nullptr, DType::bf16, n};
    job.tensor.param_out = op.data();
    job.tensor.exp_avg_out = om.data();
    job.tensor.exp_avg_sq_out = ov.data();
    job.tensor.max_exp_avg_sq_out = ovmax.data();
    job.config = c;
    engine.submit(0, {job});
    engine.wait(0);
    AdamWTensor ref{ip.data(), im.data(), iv.data(), ivmax.data(), g.data(), DType::bf16, nullptr,
                    DType::bf16, n};
    adamw_step(ref, c, 1, best_simd_path());
    CHECK(op == ip && om == im && ov == iv && (!amsgrad || ovmax == ivmax));
    CHECK(sp == p && sm == m && sv == v && svmax == vmax);
  }
}

// Storage with a chosen alignment: `offset` floats past a 4096-byte boundary.
struct Aligned {
  std::vector<float> raw;
  float* at;
  Aligned(int64_t n, int64_t offset, float fill) : raw(n + 1024 + offset, fill) {
    const auto a = reinterpret_cast<uintptr_t>(raw.data());
    at = reinterpret_cast<float*>((a + 4095) / 4096 * 4096) + offset;
  }
  std::vector<float> get(int64_t n) const { return {at, at + n}; }
};

TEST(streaming_stores_write_what_plain_stores_write) {
  // Outputs the update does not read (out-of-place state, a weight copy apart from the gradient)
  // go through non-temporal stores when aligned: bit for bit what plain stores write, on every
  // SIMD path, bf16 and fp16 copies, with amsgrad, threaded and through the engine's slices; and
  // the plan says which outputs stream (aligned yes, one float off no, switched off no).
  const int64_t n = 3 * kStreamMin + 77;
  std::mt19937 rng(17);
  std::normal_distribution<float> normal;
  std::vector<float> p(n), m(n), v(n), vmax(n);
  std::vector<uint16_t> g(n + 64);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    m[i] = normal(rng) * 1e-2f;
    v[i] = std::abs(normal(rng)) * 1e-4f;
    vmax[i] = v[i] * (i % 3 == 0 ? 2.0f : 1.0f);
  }
  int streamed_state = 0, streamed_copy = 0;
  for (DType half : {DType::bf16, DType::f16}) {
    for (int64_t i = 0; i < n; ++i) {
      const float x = normal(rng) * 1e-2f;
      g[i] = half == DType::bf16 ? f32_to_bf16(x) : f32_to_f16(x);
    }
    for (bool amsgrad : {false, true}) {
      for (int64_t offset : {0, 1}) {
        for (SimdPath path : runnable_paths()) {
          for (int threads : {1, 3}) {
            std::vector<std::vector<float>> results[2];
            std::vector<uint16_t> copies[2];
            for (int streaming = 0; streaming < 2; ++streaming) {
              AdamWConfig c;
              c.step = 4;
              c.amsgrad = amsgrad;
              c.grad_scale = 0.61;
              c.streaming_stores = streaming == 1;
              Aligned ip(n, 0, 0), im(n, 0, 0), iv(n, 0, 0), ivm(n, 0, 0);
              std::copy(p.begin(), p.end(), ip.at);
              std::copy(m.begin(), m.end(), im.at);
              std::copy(v.begin(), v.end(), iv.at);
              std::copy(vmax.begin(), vmax.end(), ivm.at);
              Aligned op(n, offset, NAN), om(n, offset, NAN), ov(n, offset, NAN), ovm(n, offset, NAN),
                  copy(n, 0, NAN);
              auto* copy16 = reinterpret_cast<uint16_t*>(copy.at) + offset;
              AdamWTensor t{ip.at, im.at, iv.at, ivm.at, g.data(), half, copy16, half, n};
              t.param_out = op.at;
              t.exp_avg_out = om.at;
              t.exp_avg_sq_out = ov.at;
              t.max_exp_avg_sq_out = ovm.at;
              const StreamPlan plan = adamw_stream_plan(t, c, path);
              const bool vector = path != SimdPath::scalar;
              CHECK(plan.state == (streaming == 1 && vector && offset == 0));
              CHECK(plan.copy == (streaming == 1 && vector && offset == 0));
              streamed_state += plan.state;
              streamed_copy += plan.copy;
              adamw_step(t, c, threads, path);
              CHECK(ip.get(n) == p && im.get(n) == m && iv.get(n) == v && ivm.get(n) == vmax);
              results[streaming] = {op.get(n), om.get(n), ov.get(n)};
              if (amsgrad) results[streaming].push_back(ovm.get(n));
              copies[streaming].assign(copy16, copy16 + n);
            }
            CHECK_MSG(results[0] == results[1] && copies[0] == copies[1], "%s offset %d threads %d",
                      simd_path_name(path), int(offset), threads);
          }
        }
      }
    }
  }
  // Through the engine: its slices start aligned and stream; the result is the in-place one.
  Aligned sp(n, 0, 0), sm(n, 0, 0), sv(n, 0, 0), op(n, 0, NAN), om(n, 0, NAN), ov(n, 0, NAN), copy(n, 0, 0);
  std::copy(p.begin(), p.end(), sp.at);
  std::copy(m.begin(), m.end(), sm.at);
  std::copy(v.begin(), v.end(), sv.at);
  UpdateEngine engine(2, kStreamMin, best_simd_path());
  UpdateJob job;
  auto* copy16 = reinterpret_cast<uint16_t*>(copy.at);
  job.tensor = AdamWTensor{sp.at, sm.at, sv.at, nullptr, g.data(), DType::f16, copy16, DType::f16, n};
  job.tensor.param_out = op.at;
  job.tensor.exp_avg_out = om.at;
  job.tensor.exp_avg_sq_out = ov.at;
  job.config.step = 2;
  engine.submit(0, {job});
  engine.wait(0);
  std::vector<float> ip = p, im = m, iv = v;
  std::vector<uint16_t> icopy(n);
  AdamWTensor ref{ip.data(), im.data(), iv.data(), nullptr, g.data(), DType::f16, icopy.data(), DType::f16, n};
  adamw_step(ref, job.config, 1, best_simd_path());
  CHECK(op.get(n) == ip && om.get(n) == im && ov.get(n) == iv &&
        std::vector<uint16_t>(copy16, copy16 + n) == icopy);
  CHECK(best_simd_path() == SimdPath::scalar || (streamed_state > 0 && streamed_copy > 0));
}

TEST(non_finite_gradients_are_reported) {
  for (SimdPath path : runnable_paths()) {
    for (int64_t n : {1, 17, 1000, 100001}) {
      for (float bad : {INFINITY, -INFINITY, NAN}) {
        for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
          std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n, 0.5f);
          g[at] = bad;
          AdamWTensor t{p.data(), m.data(), v.data(), nullptr, g.data(), DType::f32, nullptr,
                        DType::bf16, n};
          AdamWConfig c;
          CHECK_MSG(adamw_step(t, c, 2, path), "%s n=%lld at=%lld", simd_path_name(path),
                    static_cast<long long>(n), static_cast<long long>(at));
        }
      }
      // A finite gradient that overflows once scaled is non-finite too.
      std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n, 3e38f);
      AdamWTensor t{p.data(), m.data(), v.data(), nullptr, g.data(), DType::f32, nullptr,
                    DType::bf16, n};
      AdamWConfig c;
      c.grad_scale = 10.0;
      CHECK(adamw_step(t, c, 1, path));
    }
  }
}

TEST(invalid_arguments_throw) {
  std::vector<float> p(8, 1.0f), m(8), v(8), g(8);
  AdamWTensor t{p.data(), m.data(), v.data(), nullptr, g.data(), DType::f32, nullptr, DType::bf16, 8};
  AdamWConfig c;
  c.step = 0;
  CHECK_THROWS(adamw_step(t, c));
  c = AdamWConfig{};
  c.lr = -1;
  CHECK_THROWS(adamw_step(t, c));
  c = AdamWConfig{};
  c.beta2 = 1.0;
  CHECK_THROWS(adamw_step(t, c));
  c = AdamWConfig{};
  c.amsgrad = true;
  CHECK_THROWS(adamw_step(t, c));
  c = AdamWConfig{};
  AdamWTensor null_grad = t;
  null_grad.grad = nullptr;
  CHECK_THROWS(adamw_step(null_grad, c));
  AdamWTensor f32_copy = t;
  f32_copy.param_copy = p.data();
  f32_copy.param_copy_dtype = DType::f32;
  CHECK_THROWS(adamw_step(f32_copy, c));
  AdamWTensor half_out = t;  // outputs come all together or not at all
  half_out.param_out = p.data();
  CHECK_THROWS(adamw_step(half_out, c));
  CHECK(p[0] == 1.0f);  // nothing was touched by the rejected calls
}

HYTEST_MAIN()
