// KSplitScheduler on synthetic timings: the closed form in the uniform case, the direction of k when
// the CPU slows or GPU memory shrinks, hysteresis under noise, and the simulation against an
// independent tick-by-tick simulation of the same pipeline.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "check.h"
#include "hytrain/ksplit.h"

using namespace hytrain;

namespace {

struct Uniform {
  std::size_t L = 24;
  double fwd = 1e-3, bwd = 2e-3, d2h = 0, cpu = 10e-3, h2d = 0, gpu = 1e-3;
  std::int64_t numel = 1000000;
  std::int64_t state_bytes = 16000000;
};

KSplitScheduler make(const Uniform& u, KSplitConfig cfg = {}) {
  KSplitScheduler s(std::vector<std::int64_t>(u.L, u.numel), std::vector<std::int64_t>(u.L, 2 * u.numel),
                    std::vector<std::int64_t>(u.L, u.state_bytes), cfg);
  return s;
}

void feed(KSplitScheduler& s, const Uniform& u, std::mt19937* rng = nullptr, double noise = 0) {
  std::uniform_real_distribution<double> jitter(1 - noise, 1 + noise);
  const auto n = [&](double x) { return rng ? x * jitter(*rng) : x; };
  for (std::size_t j = 0; j < u.L; ++j) {
    s.observe(j, Phase::Forward, n(u.fwd));
    s.observe(j, Phase::Backward, n(u.bwd));
    s.observe(j, Phase::D2H, n(u.d2h));
    s.observe(j, Phase::Cpu, n(u.cpu));
    s.observe(j, Phase::H2D, n(u.h2d));
    s.observe(j, Phase::Gpu, n(u.gpu));
  }
}

std::size_t best_k(KSplitScheduler& s) {  // a fresh decision from k = 0 without hysteresis effects
  std::size_t best = 0;
  for (std::size_t k = 1; k <= s.max_k(); ++k) {
    if (s.predict(k).iter_s < s.predict(best).iter_s) best = k;
  }
  return best;
}

// The same pipeline, simulated one integer tick at a time with explicit resources and queues.
struct Ticks {
  std::vector<long> fwd, bwd, d2h, cpu, h2d, gpu;
};

long brute_force(const Ticks& c, std::size_t k, bool deferred, long overhead, long after, bool overlap,
                 bool early, std::size_t spec_from) {
  const std::size_t L = c.fwd.size();
  std::vector<bool> spec(L);  // deferred: offloaded blocks updated as soon as their gradients land
  for (std::size_t j = 0; j < L; ++j) spec[j] = deferred && j >= k && j >= spec_from;
  enum Kind { Bwd, Gpu, Overhead, After, Fwd };
  struct Op { Kind kind; std::size_t block; long dur; };
  std::vector<Op> program;
  for (std::size_t i = L; i-- > 0;) {
    program.push_back({Bwd, i, c.bwd[i]});
    if (!deferred && i < k) program.push_back({Gpu, i, c.gpu[i]});
  }
  program.push_back({Overhead, 0, overhead});
  if (deferred) for (std::size_t j = 0; j < k; ++j) program.push_back({Gpu, j, c.gpu[j]});
  program.push_back({After, 0, after});
  for (std::size_t j = 0; j < L; ++j) program.push_back({Fwd, j, c.fwd[j]});

  struct Lane {
    std::vector<std::size_t> queue;  // FIFO of blocks
    std::size_t head = 0;
    long left = -1;                  // -1: idle
  };
  Lane lanes[3];  // D2H, CPU, H2D
  const std::vector<long>* dur[3] = {&c.d2h, &c.cpu, &c.h2d};
  std::vector<bool> ready(L, false), landed(L, false);
  early = early && deferred;
  std::size_t pc = 0;
  long left = -1;  // compute stream's current op
  for (long t = 0;; ++t) {
    for (bool changed = true; changed;) {
      changed = false;
      if (pc < program.size()) {
        const Op& op = program[pc];
        const bool all_ready = std::all_of(ready.begin(), ready.end(), [](bool r) { return r; });
        if (left < 0 && (op.kind != Fwd || (ready[op.block] && (overlap || all_ready)))) {
          left = op.dur;
          changed = true;
        }
        if (left == 0) {
          if (op.kind == Bwd && (!deferred || early || spec[op.block]) && op.block >= k) {
            lanes[0].queue.push_back(op.block);
          }
          if (op.kind == Gpu) ready[op.block] = true;
          if (op.kind == Overhead && deferred) {  // the step's launch, in forward order
            for (std::size_t j = k; j < L; ++j) {
              if (!spec[j]) lanes[early ? 1 : 0].queue.push_back(j);
            }
          }
          ++pc;
          left = -1;
          changed = true;
        }
      }
      for (int r = 0; r < 3; ++r) {
        Lane& lane = lanes[r];
        if (lane.left < 0 && lane.head < lane.queue.size() && (r != 1 || !early || landed[lane.queue[lane.head]])) {
          lane.left = (*dur[r])[lane.queue[lane.head]];
          changed = true;
        }
        if (lane.left == 0) {
          const std::size_t b = lane.queue[lane.head++];
          if (r == 0) landed[b] = true;
          if (r == 0 && early && !spec[b]) {
            // held: the CPU queue gets it at the launch
          } else if (r < 2) lanes[r + 1].queue.push_back(b);
          else ready[b] = true;
          lane.left = -1;
          changed = true;
        }
      }
    }
    if (pc == program.size()) return t;
    if (left > 0) --left;
    for (Lane& lane : lanes) if (lane.left > 0) --lane.left;
  }
}

}  // namespace

TEST(closed_form_is_reproduced_in_the_uniform_case) {
  // Uniform blocks, no copies, no forward window: the simulation's best k is where the GPU's
  // backward plus its k updates meets the CPU's L-k updates.
  for (double alpha : {0.05, 0.1, 0.3}) {
    for (double cpu : {4e-3, 10e-3, 30e-3}) {
      Uniform u;
      u.fwd = 0;
      u.cpu = cpu;
      u.gpu = alpha * cpu;
      KSplitScheduler s = make(u);
      feed(s, u);
      const std::size_t k = best_k(s);
      const double L = static_cast<double>(u.L);
      // The first CPU update can start only after the last block's backward: T_bwd counts L-1 blocks.
      const double exact = KSplitScheduler::closed_form_k(L, (L - 1) * u.bwd, u.cpu, alpha);
      const double seed = KSplitScheduler::closed_form_k(L, L * u.bwd, u.cpu, alpha);
      CHECK_MSG(std::floor(exact) <= k && k <= std::ceil(exact), "alpha %g cpu %g: k=%zu exact %g", alpha,
                cpu, k, exact);
      CHECK_MSG(std::fabs(k - seed) <= 1.0 + u.bwd / u.cpu, "k=%zu seed %g", k, seed);
    }
  }
  CHECK(KSplitScheduler::closed_form_k(10, 100, 1, 0.1) == 0);   // backward alone outlasts the CPU
  CHECK(KSplitScheduler::closed_form_k(10, 0, 1, 0) == 10);
  CHECK_THROWS(KSplitScheduler::closed_form_k(10, 1, 0, 0.1));
}

TEST(slower_cpu_gives_larger_k) {
  std::size_t previous = 0;
  for (double cpu : {3e-3, 6e-3, 12e-3, 24e-3, 48e-3}) {
    Uniform u;
    u.cpu = cpu;
    u.d2h = u.h2d = 1e-3;
    for (bool deferred : {false, true}) {
      KSplitConfig cfg;
      cfg.deferred = deferred;
      KSplitScheduler s = make(u, cfg);
      feed(s, u);
      const std::size_t k = s.decide(0);
      if (!deferred) {
        CHECK_MSG(k >= previous, "cpu %g: k=%zu after %zu", cpu, k, previous);
        previous = k;
      }
      CHECK(s.last_prediction().k == k);
    }
  }
  CHECK(previous > 0);
}

TEST(less_gpu_memory_gives_smaller_k) {
  Uniform u;
  u.cpu = 40e-3;
  KSplitScheduler s = make(u);
  feed(s, u);
  const std::size_t free_k = s.decide(0);
  CHECK(free_k > 4);
  std::size_t previous = free_k;
  for (std::size_t fit : {free_k - 1, free_k / 2, std::size_t(1), std::size_t(0)}) {
    s.set_memory_budget(static_cast<double>(fit) * u.state_bytes + u.state_bytes / 2);
    CHECK(s.max_k() == fit);
    const std::size_t k = s.decide(previous);  // over budget: must move down, hysteresis or not
    CHECK_MSG(k == fit, "fit %zu: k=%zu", fit, k);
    previous = k;
  }
  s.set_memory_budget(-1);
  CHECK(s.max_k() == u.L);
}

// The host's floor: blocks below min_k have nowhere to live but the GPU, so decide() never goes
// under it, even past the memory budget, and chooses freely above it.
TEST(host_floor_bounds_k_from_below) {
  Uniform u;
  u.cpu = 1e-3;  // a fast CPU: unbounded, the best k is small
  KSplitScheduler s = make(u);
  feed(s, u);
  const std::size_t free_k = s.decide(0);
  CHECK(free_k + 3 < u.L);
  const std::size_t floor = free_k + 3;
  s.set_min_k(floor);
  CHECK(s.min_k() == floor);
  CHECK(s.decide(0) == floor);       // below the floor: must move up, hysteresis or not
  CHECK(s.decide(floor) == floor);   // at the floor, where the unbounded optimum is below it
  CHECK(s.decide(u.L) >= floor);
  s.set_memory_budget(static_cast<double>(floor - 2) * u.state_bytes);  // the GPU holds fewer
  CHECK(s.max_k() == floor - 2);
  CHECK(s.decide(floor) == floor);   // the floor wins: those states cannot go to the host
  CHECK(s.last_prediction().k == floor);
  s.set_min_k(u.L + 5);              // past the last block: all of them
  CHECK(s.decide(0) == u.L);
}

TEST(noise_does_not_make_k_oscillate) {
  Uniform u;
  u.cpu = 10e-3;
  u.d2h = u.h2d = 1.5e-3;
  const auto changes = [&](double hysteresis, int horizon) {
    KSplitConfig cfg;
    cfg.hysteresis = hysteresis;
    cfg.horizon = horizon;
    cfg.smoothing = 0.5;
    KSplitScheduler s = make(u, cfg);
    std::mt19937 rng(7);
    feed(s, u, &rng, 0.15);
    std::size_t k = s.decide(0);
    int n = 0;
    for (int it = 0; it < 400; ++it) {
      feed(s, u, &rng, 0.15);
      const std::size_t next = s.decide(k);
      n += next != k;
      k = next;
    }
    return n;
  };
  const int with = changes(0.03, 50), without = changes(0.0, 1 << 30);  // the latter: no damping
  std::printf("  k changes in 400 noisy iterations: %d with hysteresis, %d without\n", with, without);
  CHECK_MSG(with <= 2, "k changed %d times under noise with hysteresis", with);
  CHECK_MSG(without > 4, "the noise should move an undamped scheduler (it changed %d times)", without);
}

TEST(migration_cost_holds_back_a_small_gain) {
  Uniform u;
  u.cpu = 10e-3;
  KSplitConfig cfg;
  cfg.hysteresis = 0;
  cfg.horizon = 1;  // a move must pay for itself within one iteration
  KSplitScheduler s = make(u, cfg);
  feed(s, u);
  s.observe_rate(Phase::H2D, 1.0);  // one second per state byte: moving anything is hopeless
  const std::size_t target = best_k(s);
  CHECK(target > 0);
  CHECK(s.decide(0) == 0);
  KSplitScheduler cheap = make(u, cfg);
  feed(cheap, u);  // copies measured as free
  CHECK(cheap.decide(0) == target);
}

TEST(predictions_match_a_tick_by_tick_simulation) {
  std::mt19937 rng(2024);
  std::uniform_int_distribution<long> small(0, 6), mid(1, 20), big(1, 60);
  for (int trial = 0; trial < 600; ++trial) {
    const std::size_t L = 1 + rng() % 12;
    Ticks t;
    std::vector<BlockCosts> costs(L);
    for (std::size_t j = 0; j < L; ++j) {
      t.fwd.push_back(mid(rng));
      t.bwd.push_back(mid(rng));
      t.d2h.push_back(small(rng));
      t.cpu.push_back(big(rng));
      t.h2d.push_back(small(rng));
      t.gpu.push_back(small(rng));
      costs[j] = {double(t.fwd[j]), double(t.bwd[j]), double(t.d2h[j]), double(t.cpu[j]),
                  double(t.h2d[j]), double(t.gpu[j]), 0};
    }
    const std::size_t k = rng() % (L + 1);
    const bool deferred = rng() % 2;
    StepShape shape;
    shape.deferred = deferred;
    shape.overlap = trial % 5 != 0;
    shape.early_copies = trial % 3 == 0;
    if (trial % 4 == 1) shape.speculative_from = rng() % (L + 2);
    const long overhead = small(rng), after = small(rng);
    shape.before_launch_s = double(overhead);
    shape.after_launch_s = double(after);
    const long ticks = brute_force(t, k, deferred, overhead, after, shape.overlap, shape.early_copies,
                                   shape.speculative_from);
    const Prediction p = KSplitScheduler::simulate(costs, k, shape);
    const bool overlap = shape.overlap;
    CHECK_MSG(p.iter_s == double(ticks), "trial %d L=%zu k=%zu deferred=%d overlap=%d spec=%zu: %g vs %ld",
              trial, L, k, int(deferred), int(overlap), shape.speculative_from, p.iter_s, ticks);
    CHECK(std::fabs(p.iter_s - p.gpu_busy_s - p.gpu_idle_s) < 1e-9);
  }
}

TEST(speculation_is_chosen_where_it_helps) {
  // Every offloaded block speculated: the CPU works during backward exactly as without clipping.
  // Not always best (the CPU then works in backward order, and the next forward needs the first
  // blocks first): predictions take the best start at or above the allowed minimum, and never do
  // worse than no speculation.
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0.5, 2.0);
  int helped = 0, partial = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t L = 2 + rng() % 10;
    std::vector<BlockCosts> c(L);
    for (auto& b : c) b = {u(rng), 2 * u(rng), 0.3 * u(rng), (trial % 2 ? 5 : 1) * u(rng), 0.3 * u(rng), 0.2 * u(rng), 0};
    StepShape deferred, plain;
    deferred.deferred = true;
    deferred.early_copies = true;
    deferred.before_launch_s = plain.before_launch_s = 0.5;
    deferred.speculative_from = 0;
    CHECK(KSplitScheduler::simulate(c, 0, deferred).iter_s == KSplitScheduler::simulate(c, 0, plain).iter_s);

    KSplitScheduler s(std::vector<std::int64_t>(L, 1000), std::vector<std::int64_t>(L, 2000),
                      std::vector<std::int64_t>(L, 14000));
    for (std::size_t j = 0; j < L; ++j) {
      s.observe(j, Phase::Forward, c[j].fwd);
      s.observe(j, Phase::Backward, c[j].bwd);
      s.observe(j, Phase::D2H, c[j].d2h);
      s.observe(j, Phase::Cpu, c[j].cpu);
      s.observe(j, Phase::H2D, c[j].h2d);
      s.observe(j, Phase::Gpu, c[j].gpu);
    }
    s.observe_overhead(0.5);
    s.set_deferred(true);
    s.set_early_copies(true);
    const std::size_t k = rng() % (L + 1), lo = rng() % (L + 1);
    const double none = s.predict(k).iter_s;
    CHECK(s.predict(k).speculative_from == L);  // not allowed yet
    s.set_speculative_min(lo);
    const Prediction p = s.predict(k);
    CHECK(p.speculative_from >= std::max(k, lo) && p.speculative_from <= L);
    CHECK(p.iter_s <= none);
    double best = none;
    for (std::size_t from = std::max(k, lo); from <= L; ++from) {
      deferred.speculative_from = from;
      best = std::min(best, KSplitScheduler::simulate(s.costs(), k, deferred).iter_s);
    }
    CHECK(p.iter_s == best);
    s.set_speculative_fixed(true);  // a fixed start: exactly there, whatever is best
    const Prediction fixed = s.predict(k);
    deferred.speculative_from = std::max(k, lo);
    CHECK(fixed.speculative_from == std::min(L, std::max(k, lo)));
    CHECK(fixed.iter_s == KSplitScheduler::simulate(s.costs(), k, deferred).iter_s);
    s.set_speculative_fixed(false);
    helped += p.iter_s < none;
    partial += p.speculative_from > std::max(k, lo) && p.speculative_from < L;
  }
  std::printf("  speculation helped in %d of 200 cases, partially in %d\n", helped, partial);
  CHECK(helped > 20 && partial > 5);  // both outcomes occur, so the search matters
}

TEST(unmeasured_blocks_borrow_pooled_rates_and_waits_until_ready) {
  Uniform u;
  KSplitScheduler s = make(u);
  CHECK(!s.ready());
  CHECK(s.decide(3) == 3);  // nothing known: keep the current k
  CHECK_THROWS(s.predict(0));
  for (std::size_t j = 0; j < u.L; ++j) {
    s.observe(j, Phase::Forward, u.fwd);
    s.observe(j, Phase::Backward, u.bwd);
    s.observe(j, Phase::Cpu, u.cpu);
  }
  CHECK(!s.ready());
  s.observe_rate(Phase::Gpu, 2e-9);  // e.g. a start-up probe: 2 ns per parameter
  CHECK(s.ready());
  const std::vector<BlockCosts> c = s.costs();
  CHECK(std::fabs(c[5].gpu - 2e-9 * u.numel) < 1e-12);
  CHECK(c[5].d2h == 0 && c[5].h2d == 0);  // copies never measured count as free
  s.observe(5, Phase::Gpu, 1e-3);
  CHECK(s.costs()[5].gpu == 1e-3);
}

TEST(every_n_iterations) {
  Uniform u;
  u.cpu = 20e-3;
  KSplitConfig cfg;
  cfg.every = 4;
  KSplitScheduler s = make(u, cfg);
  feed(s, u);
  const std::size_t k = s.decide(0);  // the first call decides
  CHECK(k > 0);
  CHECK(s.decide(0) == 0 && s.decide(0) == 0 && s.decide(0) == 0);
  CHECK(s.decide(0) == k);
}

TEST(bad_input_throws) {
  CHECK_THROWS(KSplitScheduler({}, {}, {}));
  CHECK_THROWS(KSplitScheduler({1, 2}, {1}, {1, 2}));
  CHECK_THROWS(KSplitScheduler({0}, {1}, {1}));
  KSplitConfig bad;
  bad.smoothing = 0;
  CHECK_THROWS(KSplitScheduler({1}, {1}, {1}, bad));
  KSplitScheduler s({1, 1}, {2, 2}, {12, 12});
  CHECK_THROWS(s.observe(2, Phase::Cpu, 1.0));
  CHECK_THROWS(s.observe(0, Phase::Cpu, -1.0));
  CHECK_THROWS(s.observe(0, Phase::Cpu, std::nan("")));
  CHECK_THROWS(s.observe_overhead(INFINITY));
  CHECK_THROWS(KSplitScheduler::simulate(std::vector<BlockCosts>(2), 3, StepShape{}));
}

// The measuring half of the cost model on a hand-built iteration whose costs are known: forward
// between waits, the last block's forward+loss+backward split 1:2, backward less an in-between GPU
// update, copies and CPU updates as service times (a block queued behind another is charged from
// when the resource freed), and the step overheads.
TEST(attribution_recovers_known_costs) {
  KSplitConfig cfg;
  cfg.smoothing = 1.0;  // each estimate is the last measurement
  KSplitScheduler s({1000, 1000, 1000}, {2000, 2000, 2000}, {16000, 16000, 16000}, cfg);
  IterationTimes t;
  t.waits = {{{0}, 0.0, 0.5}, {{1}, 2.5, 3.0}, {{2}, 6.0, 6.0}};
  t.backward_ms = {{2, 18.0}, {1, 24.0}, {0, 30.0}};  // block 2: 4 ms forward + 8 ms backward
  t.gpu_update_s = {{1, 1e-3}};                       // block 1's GPU update before block 0's backward
  t.d2h = {{2, 0.0181, 0.0191}, {0, 0.0302, 0.0312}};
  t.cpu = {{0, 0.025, 0.035}, {2, 0.0191, 0.0291}};  // block 0 queued behind block 2
  t.launch_ms = 30.5;
  t.next_start_ms = 40.0;
  const IterationSummary sum = attribute_iteration(t, &s);
  const auto near = [](double a, double b) { return std::fabs(a - b) < 1e-12; };
  const std::vector<BlockCosts> c = s.costs();
  CHECK(near(c[0].fwd, 2e-3) && near(c[1].fwd, 3e-3) && near(c[2].fwd, 4e-3));
  CHECK(near(c[0].bwd, 5e-3) && near(c[1].bwd, 6e-3) && near(c[2].bwd, 8e-3));
  CHECK(near(c[1].gpu, 1e-3));
  CHECK(near(c[0].d2h, 1e-3) && near(c[2].d2h, 1e-3));
  CHECK(near(c[2].cpu, 10e-3) && near(c[0].cpu, 5.9e-3));
  const StepShape shape = s.shape();
  CHECK(near(shape.before_launch_s, 0.5e-3) && near(shape.after_launch_s, 9.5e-3));
  CHECK(near(sum.iter_gpu_s, 0.040) && near(sum.gpu_wait_s, 1e-3) && near(sum.gpu_wait_frac, 0.025));
  // Deferred: the GPU updates ran after the launch, not inside backward.
  t.deferred = true;
  attribute_iteration(t, &s);
  CHECK(near(s.costs()[0].bwd, 6e-3));
  CHECK(near(s.shape().after_launch_s, 8.5e-3));
  // Without a scheduler: the summary alone. An iteration without waits is refused.
  CHECK(near(attribute_iteration(t, nullptr).iter_gpu_s, 0.040));
  IterationTimes empty;
  CHECK_THROWS(attribute_iteration(empty, nullptr));
}

HYTEST_MAIN()
