// Host memory pool for master weights, Adam states and copy staging.
//
// Memory comes in large slabs from a HostAllocator: page-locked memory from CUDA when a GPU is usable
// (so copies run at full PCIe speed and asynchronously), page-aligned ordinary memory otherwise. Slabs
// are sub-allocated best-fit with coalescing of neighbouring free blocks, at exact sizes rounded only
// to the alignment, so a 3 GB tensor costs 3 GB, not 4. Requests larger than a slab get a slab of
// their own. Total reserved memory never exceeds the capacity: past it, allocate() throws
// PoolExhausted naming the requested and available sizes. Thread-safe; allocation is not on the
// per-iteration hot path (buffers are allocated once and reused).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace hytrain {

class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  virtual void* allocate(std::size_t bytes) = 0;  // throws on failure
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  virtual std::string kind() const = 0;           // "cuda-registered", "page-aligned", ...
  virtual bool page_locked() const = 0;
  // Whether a new slab's memory reads as zeros (fresh anonymous pages do): the pool then skips
  // zeroing what it hands out for the first time.
  virtual bool zeroed() const { return false; }
};

// Ordinary memory aligned to pages (and advised for transparent huge pages where available), its pages
// touched and placed over the NUMA nodes as hytrain/numa.h says; `place = false` leaves them to be
// placed by whoever touches them first (a bandwidth probe that touches them from its own threads).
std::unique_ptr<HostAllocator> make_page_aligned_allocator(bool place = true);

struct PoolStats {
  std::size_t capacity = 0;     // bytes the pool may reserve
  std::size_t reserved = 0;     // bytes held in slabs
  std::size_t in_use = 0;       // bytes handed out (after alignment rounding)
  std::size_t peak_in_use = 0;
  std::size_t slabs = 0;
  std::size_t allocations = 0;  // live allocations
  std::size_t largest_free = 0; // largest free block in any slab
};

class PinnedPool {
 public:
  static constexpr std::size_t kDefaultAlignment = 256;

  PinnedPool(std::unique_ptr<HostAllocator> allocator, std::size_t capacity_bytes,
             std::size_t slab_bytes, std::size_t alignment = kDefaultAlignment);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Returns `bytes` (rounded up to the alignment) of memory aligned to the alignment. A zero-byte
  // request returns a distinct, valid, alignment-sized block. Throws PoolExhausted past capacity.
  // With `zeroed`, sets it to whether the block is known to read as zeros: memory of a zeroing
  // allocator's slab that the pool has never handed out before.
  void* allocate(std::size_t bytes, bool* zeroed = nullptr);
  // Returns memory to the pool; throws on a pointer the pool did not hand out.
  void free(void* p);
  // Releases slabs with nothing allocated in them; returns the bytes released. The release itself
  // (unlocking, unmapping) runs outside the pool's lock: allocations on other threads go on meanwhile.
  std::size_t trim();

  // Reserves slabs of these sizes (each rounded up to a page) ahead of the allocations that will
  // use them, on `threads` threads at once: page-locking is the slow part of making a large state,
  // and it scales with threads where one allocation at a time does not. Throws PoolExhausted
  // (nothing reserved) if they would exceed the capacity. Returns the bytes reserved. Allocation
  // then carves these slabs best-fit as any other; trim() releases those left unused.
  std::size_t reserve(const std::vector<std::size_t>& slab_sizes, int threads);

  PoolStats stats() const;
  std::string kind() const { return allocator_->kind(); }
  bool page_locked() const { return allocator_->page_locked(); }
  std::size_t alignment() const { return alignment_; }

 private:
  struct Slab {
    char* base;
    std::size_t bytes;
    std::map<std::size_t, std::size_t> free_blocks;  // offset -> size, coalesced
    std::size_t used = 0;
    std::size_t fresh_from = 0;  // [fresh_from, bytes) has never been handed out
  };
  struct Block {
    Slab* slab;
    std::size_t offset;
    std::size_t size;
  };

  void* take(Slab& slab, std::map<std::size_t, std::size_t>::iterator it, std::size_t size,
             bool* zeroed);
  std::size_t trim_locked();
  std::size_t largest_free_locked() const;
  [[noreturn]] void throw_exhausted(std::size_t requested) const;

  std::unique_ptr<HostAllocator> allocator_;
  const std::size_t capacity_;
  const std::size_t slab_bytes_;
  const std::size_t alignment_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  std::unordered_map<void*, Block> live_;
  std::size_t reserved_ = 0;
  std::size_t in_use_ = 0;
  std::size_t peak_ = 0;
};

}  // namespace hytrain
