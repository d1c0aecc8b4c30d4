// PinnedPool over page-aligned memory (the CUDA allocator only changes where slabs come from):
// alignment, exact sizes, reuse, coalescing, capacity errors, and a multi-threaded stress test that
// checks blocks never overlap and fragmentation stays bounded.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "hytrain/error.h"
#include "hytrain/pinned_pool.h"

using namespace hytrain;

namespace {
constexpr std::size_t MiB = 1 << 20;
PinnedPool make_pool(std::size_t capacity, std::size_t slab) {
  return PinnedPool(make_page_aligned_allocator(), capacity, slab);
}
}  // namespace

TEST(alignment_exact_sizes_and_reuse) {
  PinnedPool pool(make_page_aligned_allocator(), 64 * MiB, 8 * MiB);
  void* a = pool.allocate(1000);
  void* b = pool.allocate(3 * MiB + 1);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 256 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % 256 == 0);
  PoolStats s = pool.stats();
  CHECK(s.in_use == 1024 + (3 * MiB + 256));  // rounded to the alignment only
  CHECK(s.slabs == 1 && s.reserved == 8 * MiB);
  std::memset(a, 0xAB, 1000);
  std::memset(b, 0xCD, 3 * MiB + 1);
  pool.free(a);
  void* c = pool.allocate(900);  // best fit: the freed block comes back
  CHECK(c == a);
  pool.free(b);
  pool.free(c);
  s = pool.stats();
  CHECK(s.in_use == 0 && s.allocations == 0);
  CHECK(s.largest_free == 8 * MiB);  // neighbours coalesced back into one block
  CHECK(s.peak_in_use >= 1024 + 3 * MiB);
  CHECK(pool.trim() == 8 * MiB && pool.stats().reserved == 0);
}

TEST(large_requests_get_their_own_slab_and_zero_bytes_work) {
  auto pool = make_pool(256 * MiB, 4 * MiB);
  void* big = pool.allocate(100 * MiB + 3);
  void* z1 = pool.allocate(0);
  void* z2 = pool.allocate(0);
  CHECK(z1 != z2 && z1 && z2);
  const PoolStats s = pool.stats();
  // One slab of exactly the page-rounded request; the zero-byte blocks reuse its rounding slack.
  CHECK(s.slabs == 1);
  CHECK(s.reserved == ((100 * MiB + 3 + 4095) / 4096) * 4096);
  CHECK(s.in_use == (100 * MiB + 256) + 2 * 256);
  pool.free(big);
  pool.free(z1);
  pool.free(z2);
}

TEST(capacity_is_enforced_with_a_clear_error) {
  auto pool = make_pool(16 * MiB, 8 * MiB);
  void* a = pool.allocate(6 * MiB);
  void* b = pool.allocate(6 * MiB);  // second slab
  bool thrown = false;
  try {
    pool.allocate(6 * MiB);
  } catch (const PoolExhausted& e) {
    thrown = true;
    const std::string msg = e.what();
    CHECK(msg.find("requested 6291456 bytes") != std::string::npos);
    CHECK(msg.find("available") != std::string::npos);
    CHECK(msg.find("capacity 16777216 bytes") != std::string::npos);
  }
  CHECK(thrown);
  pool.free(a);
  // The failed request changed nothing; freed space is usable again.
  void* c = pool.allocate(6 * MiB);
  CHECK(c == a);
  pool.free(b);
  pool.free(c);
  // Empty slabs are released to make room for a request larger than any slab.
  void* d = pool.allocate(12 * MiB);
  CHECK(pool.stats().slabs == 1);
  pool.free(d);
}

TEST(reserve_makes_slabs_on_threads_that_allocations_then_use) {
  auto pool = make_pool(64 * MiB, 8 * MiB);
  // A request of its own slab (10 MiB, page-rounded), and two slabs for small requests.
  const std::size_t got = pool.reserve({10 * MiB + 5, 8 * MiB, 8 * MiB, 0}, 3);
  CHECK(got == 10 * MiB + 4096 + 16 * MiB);
  PoolStats s = pool.stats();
  CHECK(s.slabs == 3 && s.reserved == got && s.in_use == 0);
  void* big = pool.allocate(10 * MiB + 5);  // best fit: the exact slab
  std::vector<void*> small;
  for (int i = 0; i < 15; ++i) small.push_back(pool.allocate(MiB));
  for (void* p : small) std::memset(p, 0x5A, MiB);  // the reserved memory is usable
  std::memset(big, 0x33, 10 * MiB + 5);
  s = pool.stats();
  CHECK(s.slabs == 3 && s.reserved == got);  // nothing allocated beyond the reservation
  for (void* p : small) pool.free(p);
  CHECK(pool.trim() == 16 * MiB);  // the small slabs, now empty
  pool.free(big);
  // Past the capacity: an error, and nothing reserved.
  bool thrown = false;
  try {
    pool.reserve({40 * MiB, 40 * MiB}, 2);
  } catch (const PoolExhausted& e) {
    thrown = std::string(e.what()).find("exceed the capacity") != std::string::npos;
  }
  CHECK(thrown);
  CHECK(pool.stats().reserved == 0);  // the empty slab was released trying to make room; nothing new
}

namespace {
// Ordinary memory whose release waits until the test opens the gate: a slow unlock and unmap.
class GatedAllocator final : public HostAllocator {
 public:
  std::atomic<bool> open{false};
  std::atomic<int> releasing{0};
  void* allocate(std::size_t bytes) override { return inner_->allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    ++releasing;
    while (!open) std::this_thread::yield();
    inner_->deallocate(p, bytes);
  }
  std::string kind() const override { return "gated"; }
  bool page_locked() const override { return false; }
  bool zeroed() const override { return true; }

 private:
  std::unique_ptr<HostAllocator> inner_ = make_page_aligned_allocator();
};
}  // namespace

TEST(trim_releases_slabs_while_other_threads_allocate) {
  auto owned = std::make_unique<GatedAllocator>();
  GatedAllocator* gate = owned.get();
  PinnedPool pool(std::move(owned), 64 * MiB, 8 * MiB);
  void* kept = pool.allocate(MiB);       // its slab stays
  void* gone = pool.allocate(12 * MiB);  // a slab of its own, emptied below
  pool.free(gone);
  std::size_t released = 0;
  std::thread trimmer([&] { released = pool.trim(); });
  while (gate->releasing == 0) std::this_thread::yield();
  // Mid-release: the pool serves other threads, never from the slab being released, which still
  // counts as reserved until it is gone.
  auto allocated = std::async(std::launch::async, [&] { return pool.allocate(MiB); });
  const bool went_on = allocated.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  CHECK(went_on);  // (an allocation behind the release would wait for the gate)
  if (went_on) CHECK(pool.stats().reserved == 20 * MiB && pool.stats().slabs == 1);
  gate->open = true;
  void* meanwhile = allocated.get();
  CHECK(meanwhile != nullptr && meanwhile != gone);
  trimmer.join();
  CHECK(released == 12 * MiB);
  CHECK(pool.stats().reserved == 8 * MiB && pool.stats().in_use == 2 * MiB);
  pool.free(kept);
  pool.free(meanwhile);
}

TEST(memory_handed_out_for_the_first_time_is_known_zero) {
  auto pool = make_pool(64 * MiB, 8 * MiB);
  bool zeroed = false;
  auto* a = static_cast<unsigned char*>(pool.allocate(3 * MiB, &zeroed));
  CHECK(zeroed);
  CHECK(std::all_of(a, a + 3 * MiB, [](unsigned char c) { return c == 0; }));
  std::memset(a, 0x5A, 3 * MiB);
  auto* b = static_cast<unsigned char*>(pool.allocate(MiB, &zeroed));  // after a: still fresh
  CHECK(zeroed && b == a + 3 * MiB);
  pool.free(a);
  void* c = pool.allocate(2 * MiB, &zeroed);  // a's memory again: written, so not known zero
  CHECK(!zeroed && c == a);
  void* d = pool.allocate(MiB, &zeroed);  // the rest of a's block, below b: handed out before
  CHECK(!zeroed && d == a + 2 * MiB);
  void* e = pool.allocate(4 * MiB, &zeroed);  // beyond everything handed out in the slab
  CHECK(zeroed);
  for (void* p : {static_cast<void*>(b), c, d, e}) pool.free(p);
  CHECK(pool.trim() == 8 * MiB);
  void* f = pool.allocate(MiB, &zeroed);  // a new slab: fresh again
  CHECK(zeroed);
  pool.free(f);
  // An allocator that does not promise zeros never gets the promise passed on.
  struct Dirty final : HostAllocator {
    std::unique_ptr<HostAllocator> inner = make_page_aligned_allocator();
    void* allocate(std::size_t n) override { return inner->allocate(n); }
    void deallocate(void* p, std::size_t n) noexcept override { inner->deallocate(p, n); }
    std::string kind() const override { return "dirty"; }
    bool page_locked() const override { return false; }
  };
  PinnedPool dirty(std::make_unique<Dirty>(), 16 * MiB, 8 * MiB);
  void* g = dirty.allocate(MiB, &zeroed);
  CHECK(!zeroed);
  dirty.free(g);
}

TEST(bad_frees_throw) {
  auto pool = make_pool(16 * MiB, 8 * MiB);
  void* a = pool.allocate(100);
  int local = 0;
  CHECK_THROWS(pool.free(&local));
  pool.free(a);
  CHECK_THROWS(pool.free(a));  // double free
}

TEST(mixed_stress_no_overlap_bounded_fragmentation) {
  auto pool = make_pool(1024 * MiB, 32 * MiB);
  constexpr int kThreads = 4;
  constexpr int kOps = 20000;
  std::atomic<int> corrupt{0};
  std::atomic<std::size_t> peak_live{0};
  std::atomic<std::size_t> live_bytes{0};
  auto worker = [&](int id) {
    std::mt19937 rng(1000 + id);
    std::vector<std::pair<unsigned char*, std::size_t>> mine;
    for (int op = 0; op < kOps; ++op) {
      const bool alloc = mine.size() < 8 || (mine.size() < 64 && rng() % 2 == 0);
      if (alloc) {
        // Sizes span three orders of magnitude, log-uniform, none a power of two.
        const std::size_t sz = static_cast<std::size_t>(std::exp2(8 + (rng() % 1300) / 100.0)) + 13;
        auto* p = static_cast<unsigned char*>(pool.allocate(sz));
        std::memset(p, id * 37 + 1, sz);
        mine.emplace_back(p, sz);
        const std::size_t now = live_bytes += sz;
        std::size_t prev = peak_live.load();
        while (now > prev && !peak_live.compare_exchange_weak(prev, now)) {
        }
      } else {
        const std::size_t k = rng() % mine.size();
        auto [p, sz] = mine[k];
        // Another thread writing into this block would have changed its fill byte.
        if (p[0] != id * 37 + 1 || p[sz - 1] != id * 37 + 1 || p[sz / 2] != id * 37 + 1) ++corrupt;
        pool.free(p);
        live_bytes -= sz;
        mine[k] = mine.back();
        mine.pop_back();
      }
    }
    for (auto [p, sz] : mine) {
      live_bytes -= sz;
      pool.free(p);
    }
  };
  std::vector<std::thread> ts;
  for (int i = 0; i < kThreads; ++i) ts.emplace_back(worker, i);
  for (auto& t : ts) t.join();
  const PoolStats s = pool.stats();
  CHECK(corrupt == 0);
  CHECK(s.in_use == 0 && s.allocations == 0);
  std::printf("  peak live %.1f MiB, reserved %.1f MiB in %zu slabs\n",
              peak_live.load() / double(MiB), s.reserved / double(MiB), s.slabs);
  // No runaway fragmentation: reserved memory stays within a small factor of the peak live bytes.
  CHECK(s.reserved <= 2 * peak_live.load() + 2 * 32 * MiB);
  CHECK(s.largest_free == 32 * MiB || s.slabs == 0 || s.largest_free >= 32 * MiB);
}

HYTEST_MAIN()
