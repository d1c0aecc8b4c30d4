#include "hytrain/pinned_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <iterator>
#include <thread>

#include "hytrain/error.h"
#include "hytrain/numa.h"

namespace hytrain {

namespace {

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

std::string gib(std::size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%zu bytes (%.3f GiB)", bytes,
                static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

class PageAlignedAllocator final : public HostAllocator {
 public:
  explicit PageAlignedAllocator(bool place) : place_(place) {}
  void* allocate(std::size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      HYTRAIN_THROW("mmap of " + gib(bytes) + " failed: " + std::strerror(errno));
    }
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);  // advisory: fewer TLB misses on multi-GB streams
#endif
    try {
      if (place_) place_pages(p, bytes);  // touched now, and spread over the NUMA nodes (hytrain/numa.h)
    } catch (...) {
      munmap(p, bytes);
      throw;
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override { munmap(p, bytes); }
  std::string kind() const override { return "page-aligned"; }
  bool page_locked() const override { return false; }
  bool zeroed() const override { return true; }  // fresh anonymous pages

 private:
  bool place_;
};

}  // namespace

std::unique_ptr<HostAllocator> make_page_aligned_allocator(bool place) {
  return std::make_unique<PageAlignedAllocator>(place);
}

PinnedPool::PinnedPool(std::unique_ptr<HostAllocator> allocator, std::size_t capacity_bytes,
                       std::size_t slab_bytes, std::size_t alignment)
    : allocator_(std::move(allocator)),
      capacity_(capacity_bytes),
      slab_bytes_(round_up(std::max<std::size_t>(slab_bytes, 1), page_size())),
      alignment_(alignment) {
  HYTRAIN_CHECK(allocator_ != nullptr, "allocator must not be null");
  HYTRAIN_CHECK(alignment_ > 0 && (alignment_ & (alignment_ - 1)) == 0 && alignment_ <= page_size(),
                "alignment must be a power of two no larger than a page, got " +
                    std::to_string(alignment));
}

PinnedPool::~PinnedPool() {
  for (auto& s : slabs_) allocator_->deallocate(s->base, s->bytes);
}

void* PinnedPool::take(Slab& slab, std::map<std::size_t, std::size_t>::iterator it,
                       std::size_t size, bool* zeroed) {
  const std::size_t offset = it->first;
  const std::size_t block = it->second;
  if (zeroed) *zeroed = allocator_->zeroed() && offset >= slab.fresh_from;
  slab.fresh_from = std::max(slab.fresh_from, offset + size);
  slab.free_blocks.erase(it);
  if (block > size) slab.free_blocks.emplace(offset + size, block - size);
  slab.used += size;
  void* p = slab.base + offset;
  live_.emplace(p, Block{&slab, offset, size});
  in_use_ += size;
  peak_ = std::max(peak_, in_use_);
  return p;
}

void* PinnedPool::allocate(std::size_t bytes, bool* zeroed) {
  const std::size_t size = round_up(std::max<std::size_t>(bytes, 1), alignment_);
  std::lock_guard<std::mutex> lock(mu_);

  // Best fit over every free block: slabs are few and blocks per slab stay few after coalescing.
  Slab* best_slab = nullptr;
  std::map<std::size_t, std::size_t>::iterator best;
  for (auto& s : slabs_) {
    for (auto it = s->free_blocks.begin(); it != s->free_blocks.end(); ++it) {
      if (it->second >= size && (!best_slab || it->second < best->second)) {
        best_slab = s.get();
        best = it;
      }
    }
  }
  if (best_slab) return take(*best_slab, best, size, zeroed);

  const std::size_t exact = round_up(size, page_size());
  std::size_t slab = std::max(exact, slab_bytes_);
  if (reserved_ + slab > capacity_) {
    if (reserved_ + exact > capacity_) trim_locked();
    if (reserved_ + exact > capacity_) throw_exhausted(bytes);
    slab = std::min(slab, capacity_ - reserved_);  // a smaller slab that still fits the request
  }
  char* base = nullptr;
  try {
    base = static_cast<char*>(allocator_->allocate(slab));
  } catch (const std::exception& e) {
    throw PoolExhausted(allocator_->kind() + " host allocation of " + gib(slab) +
                            " failed: " + e.what(),
                        __FILE__, __LINE__);
  }
  slabs_.push_back(std::unique_ptr<Slab>(new Slab{base, slab, {{0, slab}}, 0}));
  reserved_ += slab;
  Slab& s = *slabs_.back();
  return take(s, s.free_blocks.begin(), size, zeroed);
}

void PinnedPool::free(void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = live_.find(p);
  HYTRAIN_CHECK(found != live_.end(), "pointer was not allocated by this pool (or freed twice)");
  const Block b = found->second;
  live_.erase(found);
  in_use_ -= b.size;
  b.slab->used -= b.size;

  auto& fb = b.slab->free_blocks;
  auto it = fb.emplace(b.offset, b.size).first;
  auto next = std::next(it);
  if (next != fb.end() && it->first + it->second == next->first) {
    it->second += next->second;
    fb.erase(next);
  }
  if (it != fb.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      fb.erase(it);
    }
  }
}

std::size_t PinnedPool::trim_locked() {
  std::size_t released = 0;
  auto keep = std::remove_if(slabs_.begin(), slabs_.end(), [&](std::unique_ptr<Slab>& s) {
    if (s->used != 0) return false;
    allocator_->deallocate(s->base, s->bytes);
    released += s->bytes;
    return true;
  });
  slabs_.erase(keep, slabs_.end());
  reserved_ -= released;
  return released;
}

std::size_t PinnedPool::trim() {
  // The empty slabs leave the pool under the lock (nothing can carve them from then on), but are
  // given back to the system outside it: unlocking and unmapping gigabytes takes a while, and
  // allocations on other threads should not wait for it. They count as reserved until they are gone.
  std::vector<std::unique_ptr<Slab>> empty;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto keep = std::stable_partition(slabs_.begin(), slabs_.end(),
                                      [](const std::unique_ptr<Slab>& s) { return s->used != 0; });
    std::move(keep, slabs_.end(), std::back_inserter(empty));
    slabs_.erase(keep, slabs_.end());
  }
  std::size_t released = 0;
  for (auto& s : empty) {
    allocator_->deallocate(s->base, s->bytes);
    released += s->bytes;
  }
  std::lock_guard<std::mutex> lock(mu_);
  reserved_ -= released;
  return released;
}

std::size_t PinnedPool::reserve(const std::vector<std::size_t>& slab_sizes, int threads) {
  std::vector<std::size_t> sizes;
  std::size_t total = 0;
  for (std::size_t b : slab_sizes) {
    if (b == 0) continue;
    sizes.push_back(round_up(b, page_size()));
    total += sizes.back();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reserved_ + total > capacity_) trim_locked();
    if (reserved_ + total > capacity_) {
      throw PoolExhausted("pinned pool exhausted: reserving " + gib(total) + " would exceed the capacity (" +
                              gib(capacity_) + ", reserved " + gib(reserved_) + ")",
                          __FILE__, __LINE__);
    }
    reserved_ += total;  // held for the slabs being made, so that concurrent allocations see them
  }
  std::vector<char*> bases(sizes.size(), nullptr);
  std::atomic<std::size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mu;
  auto work = [&] {
    for (std::size_t i = next++; i < sizes.size(); i = next++) {
      try {
        bases[i] = static_cast<char*>(allocator_->allocate(sizes[i]));
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mu);
        if (!failure) failure = std::current_exception();
        next = sizes.size();  // the others stop taking slabs
      }
    }
  };
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(sizes.size())));
  std::vector<std::thread> pool;
  // Each on the process's CPUs, whatever the calling thread is confined to (numa.h).
  for (int t = 1; t < n; ++t) pool.emplace_back([&] { use_process_cpus(); work(); });
  work();
  for (auto& th : pool) th.join();
  std::lock_guard<std::mutex> lock(mu_);
  reserved_ -= total;
  if (failure) {  // nothing reserved: the slabs made are given back
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      if (bases[i] != nullptr) allocator_->deallocate(bases[i], sizes[i]);
    }
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      throw PoolExhausted(allocator_->kind() + " host allocation of " + gib(total) + " in " +
                              std::to_string(sizes.size()) + " slabs failed: " + e.what(),
                          __FILE__, __LINE__);
    }
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    slabs_.push_back(std::unique_ptr<Slab>(new Slab{bases[i], sizes[i], {{0, sizes[i]}}, 0}));
  }
  reserved_ += total;
  return total;
}

std::size_t PinnedPool::largest_free_locked() const {
  std::size_t largest = 0;
  for (const auto& s : slabs_) {
    for (const auto& [off, size] : s->free_blocks) largest = std::max(largest, size);
  }
  return largest;
}

void PinnedPool::throw_exhausted(std::size_t requested) const {
  const std::size_t headroom = capacity_ - reserved_;
  throw PoolExhausted("pinned pool exhausted: requested " + gib(requested) + ", available " +
                          gib(std::max(headroom, largest_free_locked())) + " (capacity " +
                          gib(capacity_) + ", in use " + gib(in_use_) + ", reserved " +
                          gib(reserved_) + ")",
                      __FILE__, __LINE__);
}

PoolStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats st;
  st.capacity = capacity_;
  st.reserved = reserved_;
  st.in_use = in_use_;
  st.peak_in_use = peak_;
  st.slabs = slabs_.size();
  st.allocations = live_.size();
  st.largest_free = largest_free_locked();
  return st;
}

}  // namespace hytrain
