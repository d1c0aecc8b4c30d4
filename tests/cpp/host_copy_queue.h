// A CopyQueue on the host for the C++ tests: copies run on a thread of their own, in issue order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "hytrain/copy_queue.h"

namespace hytest {

using hytrain::CopyQueue;

// Copies performed by a thread of its own, in issue order; make_wait waits on the host. From ticket
// `fail_at` on (0: never) the queue is broken: failure() says so and nothing more lands.
class HostCopyQueue final : public CopyQueue {
 public:
  explicit HostCopyQueue(uint64_t fail_at = 0) : fail_at_(fail_at), worker_([this] { run(); }) {}
  ~HostCopyQueue() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    work_.notify_all();
    worker_.join();
  }

  uint64_t copy(void* dst, const void* src, std::size_t bytes, std::optional<std::uintptr_t>) override {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back({dst, src, bytes});
    const uint64_t ticket = ++issued_;
    work_.notify_all();
    return ticket;
  }
  uint64_t issued() const override { return issued_.load(); }
  uint64_t completed() const override { return completed_.load(); }
  void make_wait(std::uintptr_t, uint64_t ticket) override {
    std::unique_lock<std::mutex> lock(mutex_);
    landed_.wait(lock, [&] { return completed_.load() >= ticket || !error_.empty(); });
  }
  std::string failure() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  std::uintptr_t handle() const override { return 0; }
  void set_listener(std::function<void(uint64_t)> listener) override { listener_ = std::move(listener); }

 private:
  struct Copy {
    void* dst;
    const void* src;
    std::size_t bytes;
  };

  void run() {
    for (;;) {
      Copy c{};
      uint64_t ticket = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_.wait(lock, [&] { return stop_ || !pending_.empty(); });
        if (pending_.empty()) return;  // stopped, and every issued copy was handled
        c = pending_.front();
        pending_.pop_front();
        ticket = completed_.load() + 1;
        if (!error_.empty() || (fail_at_ != 0 && ticket >= fail_at_)) {
          error_ = "injected copy failure at ticket " + std::to_string(ticket);
          landed_.notify_all();
          continue;
        }
      }
      std::memcpy(c.dst, c.src, c.bytes);
      completed_.store(ticket);
      if (listener_) listener_(ticket);
      std::lock_guard<std::mutex> lock(mutex_);
      landed_.notify_all();
    }
  }

  uint64_t fail_at_;
  std::mutex mutex_;
  std::condition_variable work_, landed_;
  std::deque<Copy> pending_;
  std::atomic<uint64_t> issued_{0}, completed_{0};
  bool stop_ = false;
  std::string error_;
  std::function<void(uint64_t)> listener_;
  std::thread worker_;
};

}  // namespace hytest
