// A bounded multi-producer/multi-consumer queue of "block ready" items.
//
// Why MPMC: producers are the copy-stream pollers (one per device and direction) and the autograd
// thread; consumers are the CPU AdamW workers, several of them. The hot path is lock-free: the ring
// of cells follows D. Vyukov's bounded MPMC design, where each cell carries a sequence number that
// says whose turn it is, and a producer or consumer claims a position with one compare-and-swap.
//
// Waiting never spins forever: a blocked pop (or push on a full queue) spins briefly, then registers
// as a sleeper and sleeps on a condition variable. The other side takes the mutex only when it sees
// a sleeper, so the uncontended path never touches the mutex. A wake-up cannot be lost: cell
// publication and the sleeper count are sequentially consistent, so either the publisher sees the
// sleeper (and notifies under the mutex the sleeper holds until it waits) or the sleeper's re-check
// of the ring after registering sees the item. close() wakes everyone; pop then
// drains what is left and returns false once the queue is empty.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "hytrain/error.h"

namespace hytrain {

template <class T>
class MpmcQueue {
 public:
  explicit MpmcQueue(std::size_t capacity) : mask_(round_up(capacity) - 1),
                                            cells_(new Cell[mask_ + 1]) {
    HYTRAIN_CHECK(capacity >= 2, "queue capacity must be at least 2");
    for (std::size_t i = 0; i <= mask_; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
  }
  MpmcQueue(const MpmcQueue&) = delete;
  MpmcQueue& operator=(const MpmcQueue&) = delete;

  std::size_t capacity() const { return mask_ + 1; }

  // How long a blocked pop keeps trying (pausing between tries) before it sleeps: 0, the default,
  // spins 64 tries. Set before the consumers start.
  void set_pop_spin_ns(int64_t ns) { pop_spin_ns_ = ns; }

  bool try_push(const T& item) {
    if (!push_now(item)) return false;
    wake(pop_sleepers_, not_empty_);
    return true;
  }

  bool try_pop(T& out) {
    if (!pop_now(out)) return false;
    wake(push_sleepers_, not_full_);
    return true;
  }

  // Blocks while the queue is full. Returns false (item not queued) once the queue is closed.
  bool push(const T& item) {
    if (!block_until(push_sleepers_, not_full_, [&] { return push_now(item); }, false)) return false;
    wake(pop_sleepers_, not_empty_);
    return true;
  }

  // Blocks until an item arrives. Returns false when the queue is closed and empty.
  bool pop(T& out) {
    if (pop_spin_ns_ > 0 && spin_for(pop_spin_ns_, [&] { return pop_now(out); })) {
      wake(push_sleepers_, not_full_);
      return true;
    }
    if (!block_until(pop_sleepers_, not_empty_, [&] { return pop_now(out); }, true)) return false;
    wake(push_sleepers_, not_full_);
    return true;
  }

  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_.store(true, std::memory_order_seq_cst);
    }
    not_empty_.notify_all();
    not_full_.notify_all();
  }

  bool closed() const { return closed_.load(std::memory_order_acquire); }

 private:
  struct alignas(64) Cell {
    std::atomic<std::size_t> seq;
    T value;
  };

  // The lock-free halves: claim a position with one CAS, then publish through the cell's sequence.
  bool push_now(const T& item) {
    std::size_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos & mask_];
      const std::size_t seq = c.seq.load(std::memory_order_seq_cst);
      const auto diff = static_cast<std::intptr_t>(seq) - static_cast<std::intptr_t>(pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.value = item;
          c.seq.store(pos + 1, std::memory_order_seq_cst);
          return true;
        }
      } else if (diff < 0) {
        return false;  // full
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  bool pop_now(T& out) {
    std::size_t pos = head_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos & mask_];
      const std::size_t seq = c.seq.load(std::memory_order_seq_cst);
      const auto diff = static_cast<std::intptr_t>(seq) - static_cast<std::intptr_t>(pos + 1);
      if (diff == 0) {
        if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          out = c.value;
          c.seq.store(pos + mask_ + 1, std::memory_order_seq_cst);
          return true;
        }
      } else if (diff < 0) {
        return false;  // empty
      } else {
        pos = head_.load(std::memory_order_relaxed);
      }
    }
  }

  static std::size_t round_up(std::size_t n) {
    std::size_t p = 2;
    while (p < n) p <<= 1;
    return p;
  }

  void wake(std::atomic<int>& sleepers, std::condition_variable& cv) {
    if (sleepers.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lock(mutex_); }
      cv.notify_all();
    }
  }

  // Tries for about `ns` nanoseconds (yielding the core between tries); false if nothing came or
  // the queue closed.
  template <class TryFn>
  bool spin_for(int64_t ns, TryFn attempt) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    for (int i = 0;; ++i) {
      if (attempt()) return true;
      if (closed()) return false;
      if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::yield();
    }
  }

  // Spins briefly, then sleeps until attempt() succeeds. attempt() must not wake (it may run with
  // the mutex held); callers wake the other side after a success.
  template <class TryFn>
  bool block_until(std::atomic<int>& sleepers, std::condition_variable& cv, TryFn attempt,
                   bool drain_when_closed) {
    for (int spin = 0; spin < 64; ++spin) {
      if (closed() && !drain_when_closed) return false;
      if (attempt()) return true;
      if (spin >= 16) std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      sleepers.fetch_add(1, std::memory_order_seq_cst);  // register, then re-check the ring
      const bool ok = (!closed() || drain_when_closed) && attempt();
      if (ok || closed()) {
        sleepers.fetch_sub(1, std::memory_order_relaxed);
        return ok || (drain_when_closed && attempt());
      }
      cv.wait(lock);
      sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  int64_t pop_spin_ns_ = 0;
  const std::size_t mask_;
  std::unique_ptr<Cell[]> cells_;
  alignas(64) std::atomic<std::size_t> tail_{0};
  alignas(64) std::atomic<std::size_t> head_{0};
  alignas(64) std::atomic<int> pop_sleepers_{0};
  std::atomic<int> push_sleepers_{0};
  std::atomic<bool> closed_{false};
  std::mutex mutex_;
  std::condition_variable not_empty_;
  std::condition_variable not_full_;
};

}  // namespace hytrain
