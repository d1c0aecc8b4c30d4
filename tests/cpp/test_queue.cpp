// MpmcQueue: several producers and consumers move HYTRAIN_QUEUE_ITEMS items (default 10 million)
// through a small ring; every item must arrive exactly once, and each consumer must see each
// producer's items in the order they were pushed. Also: blocking pop wakes on push and on close.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

#include "check.h"
#include "hytrain/mpmc_queue.h"

using hytrain::MpmcQueue;

namespace {

uint64_t items_from_env() {
  const char* s = std::getenv("HYTRAIN_QUEUE_ITEMS");
  return s ? std::strtoull(s, nullptr, 10) : 10'000'000ull;
}

void stress(int producers, int consumers, std::size_t capacity, uint64_t total, int64_t spin_ns = 0) {
  MpmcQueue<uint64_t> q(capacity);
  q.set_pop_spin_ns(spin_ns);
  const uint64_t per = total / producers;
  std::vector<std::atomic<uint8_t>> seen(per * producers);
  for (auto& s : seen) s.store(0, std::memory_order_relaxed);
  std::atomic<int> order_errors{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < consumers; ++c) {
    threads.emplace_back([&] {
      std::vector<int64_t> last(producers, -1);
      uint64_t item;
      while (q.pop(item)) {
        const uint64_t p = item >> 40, seq = item & ((1ull << 40) - 1);
        if (static_cast<int64_t>(seq) <= last[p]) order_errors.fetch_add(1);
        last[p] = static_cast<int64_t>(seq);
        seen[p * per + seq].fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  std::vector<std::thread> prod;
  for (int p = 0; p < producers; ++p) {
    prod.emplace_back([&, p] {
      for (uint64_t i = 0; i < per; ++i) {
        const uint64_t item = (static_cast<uint64_t>(p) << 40) | i;
        if (i % 3 == 0) {
          while (!q.try_push(item)) std::this_thread::yield();  // the non-blocking path too
        } else {
          CHECK(q.push(item));
        }
      }
    });
  }
  for (auto& t : prod) t.join();
  q.close();
  for (auto& t : threads) t.join();
  uint64_t missing = 0, duplicated = 0;
  for (auto& s : seen) {
    const uint8_t n = s.load();
    missing += n == 0;
    duplicated += n > 1;
  }
  CHECK_MSG(missing == 0 && duplicated == 0, "%d producers, %d consumers: %llu missing, %llu duplicated",
            producers, consumers, static_cast<unsigned long long>(missing),
            static_cast<unsigned long long>(duplicated));
  CHECK_MSG(order_errors.load() == 0, "%d per-producer order violations", order_errors.load());
}

}  // namespace

TEST(many_producers_many_consumers) { stress(4, 4, 1024, items_from_env()); }

TEST(one_producer_one_consumer_tiny_ring) { stress(1, 1, 2, items_from_env() / 10); }

TEST(more_consumers_than_work) { stress(2, 8, 64, items_from_env() / 10); }

TEST(spinning_consumers_lose_and_repeat_nothing) { stress(2, 4, 64, items_from_env() / 10, 2'000'000); }

TEST(a_spinning_pop_takes_a_push_and_ends_at_close) {
  MpmcQueue<int> q(8);
  q.set_pop_spin_ns(5'000'000'000);  // 5 s: longer than the test, so both ends come while it spins
  std::atomic<int> got{-1};
  std::atomic<bool> ended{false};
  std::thread consumer([&] {
    int v;
    if (q.pop(v)) got.store(v);
    int w;
    CHECK(!q.pop(w));  // closed and empty
    ended.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(got.load() == -1);
  CHECK(q.push(7));
  while (got.load() == -1) std::this_thread::yield();
  CHECK(got.load() == 7);
  const auto closed_at = std::chrono::steady_clock::now();
  q.close();
  consumer.join();
  CHECK(ended.load());
  CHECK(std::chrono::steady_clock::now() - closed_at < std::chrono::seconds(2));  // not the 5 s spin
}

TEST(pop_sleeps_until_push_and_close_wakes) {
  MpmcQueue<int> q(8);
  std::atomic<int> got{-1};
  std::thread consumer([&] {
    int v;
    if (q.pop(v)) got.store(v);
    int w;
    CHECK(!q.pop(w));  // closed and empty
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // consumer is asleep by now
  CHECK(got.load() == -1);
  CHECK(q.push(42));
  while (got.load() == -1) std::this_thread::yield();
  CHECK(got.load() == 42);
  q.close();
  consumer.join();
  CHECK(!q.push(1));  // closed
}

TEST(close_drains_remaining_items) {
  MpmcQueue<int> q(4);
  CHECK(q.try_push(1) && q.try_push(2));
  q.close();
  int a = 0, b = 0, c = 0;
  CHECK(q.pop(a) && q.pop(b) && !q.pop(c));
  CHECK(a == 1 && b == 2);
}

TEST(full_queue_refuses_try_push_and_capacity_rounds_up) {
  MpmcQueue<int> q(5);
  CHECK(q.capacity() == 8);
  for (int i = 0; i < 8; ++i) CHECK(q.try_push(i));
  CHECK(!q.try_push(99));
  int v;
  CHECK(q.try_pop(v) && v == 0);
  CHECK(q.try_push(8));
  CHECK_THROWS(MpmcQueue<int>(1));
}

HYTEST_MAIN()
