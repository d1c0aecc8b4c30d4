// UpdateEngine: submit() never blocks, even when a step's slices are many times what the queue holds
// (the rest wait in order in the overflow list), every block completes with exactly the result of a
// single-threaded AdamW, completion hooks fire once per block, and destroying the engine with work
// still in the overflow finishes that work. Runs under ThreadSanitizer in CI as well.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "hytrain/adamw.h"
#include "hytrain/update_engine.h"

using namespace hytrain;

namespace {

struct Tensors {
  std::vector<float> p, m, v, g;
};

Tensors make(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  Tensors t{std::vector<float>(n), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f),
            std::vector<float>(n)};
  for (int64_t i = 0; i < n; ++i) {
    t.p[i] = normal(rng);
    t.g[i] = normal(rng) * 1e-2f;
  }
  return t;
}

UpdateJob job_of(Tensors& t) {
  UpdateJob j;
  j.tensor = AdamWTensor{t.p.data(), t.m.data(), t.v.data(), nullptr, t.g.data(), DType::f32, nullptr,
                         DType::bf16, static_cast<int64_t>(t.p.size())};
  j.config.step = 1;
  j.config.lr = 1e-3;
  return j;
}

void reference(Tensors& t) {
  UpdateJob j = job_of(t);
  adamw_step(j.tensor, j.config, 1, SimdPath::scalar);
}

}  // namespace

TEST(submit_never_blocks_and_the_overflow_completes) {
  // 4 queue cells, 1024-element slices: each block is ~100 slices, the step ~600.
  constexpr int kBlocks = 6;
  constexpr int64_t kN = 100'000;
  UpdateEngine engine(3, 1024, SimdPath::scalar, 4);
  std::atomic<int> hooks{0};
  engine.set_on_complete([&](int64_t) { hooks.fetch_add(1); });
  std::vector<Tensors> mine, ref;
  for (int b = 0; b < kBlocks; ++b) {
    mine.push_back(make(kN, 100 + b));
    ref.push_back(mine.back());
    reference(ref.back());
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int b = 0; b < kBlocks; ++b) engine.submit(b, {job_of(mine[b])});
  const double submit_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int b = 0; b < kBlocks; ++b) engine.wait(b);
  for (int b = 0; b < kBlocks; ++b) {
    CHECK_MSG(mine[b].p == ref[b].p && mine[b].m == ref[b].m && mine[b].v == ref[b].v, "block %d", b);
    // Its team: 1 to 3 workers ran its ~100 slices, inside them for at most span x workers.
    const hytrain::BlockTiming t = engine.timing(b);
    CHECK_MSG(t.workers >= 1 && t.workers <= 3 && t.elements == kN, "block %d: %d workers", b, t.workers);
    CHECK_MSG(t.busy_ns > 0 && t.busy_ns <= (t.end_ns - t.start_ns) * t.workers, "block %d: busy %lld ns", b,
              static_cast<long long>(t.busy_ns));
  }
  // wait() returns once a block is complete; its hook runs just after, on the worker.
  for (int i = 0; i < 5000 && hooks.load() < kBlocks; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(hooks.load() == kBlocks);
  std::printf("  6 blocks of ~100 slices through 4 queue cells: submit took %.3f ms\n", submit_s * 1e3);
}

TEST(slices_keep_submission_order_through_the_overflow) {
  // One worker takes slices in queue order: blocks must complete exactly in submission order, also
  // when a later submit arrives while earlier slices still wait in the overflow.
  UpdateEngine engine(1, 1024, SimdPath::scalar, 2);
  std::vector<int> order;
  std::mutex order_mutex;
  engine.set_on_complete([&](int64_t b) {
    std::lock_guard<std::mutex> lock(order_mutex);
    order.push_back(static_cast<int>(b));
  });
  std::vector<Tensors> mine;
  for (int b = 0; b < 8; ++b) mine.push_back(make(b % 2 ? 2000 : 50'000, 200 + b));
  for (int b = 0; b < 8; ++b) engine.submit(b, {job_of(mine[b])});
  engine.wait_all();
  for (int i = 0; i < 5000; ++i) {
    {
      std::lock_guard<std::mutex> lock(order_mutex);
      if (order.size() == 8) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> lock(order_mutex);
  CHECK((order == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(destroying_with_work_in_the_overflow_finishes_it) {
  Tensors mine = make(300'000, 7), ref = mine;
  reference(ref);
  {
    UpdateEngine engine(2, 1024, SimdPath::scalar, 2);
    engine.submit(0, {job_of(mine)});
  }  // ~293 slices behind a 2-cell queue
  CHECK(mine.p == ref.p && mine.m == ref.m && mine.v == ref.v);
}

TEST(many_small_submits_from_two_threads) {
  // Two producers (as the copy-stream poller and the training thread), the smallest queue.
  UpdateEngine engine(2, 1024, SimdPath::scalar, 2);
  constexpr int kPer = 40;
  std::vector<Tensors> mine, ref;
  for (int b = 0; b < 2 * kPer; ++b) {
    mine.push_back(make(5000, 300 + b));
    ref.push_back(mine.back());
    reference(ref.back());
  }
  std::thread a([&] { for (int b = 0; b < kPer; ++b) engine.submit(b, {job_of(mine[b])}); });
  std::thread c([&] { for (int b = kPer; b < 2 * kPer; ++b) engine.submit(b, {job_of(mine[b])}); });
  a.join();
  c.join();
  engine.wait_all();
  for (int b = 0; b < 2 * kPer; ++b) CHECK_MSG(mine[b].p == ref[b].p && mine[b].v == ref[b].v, "block %d", b);
}

HYTEST_MAIN()
