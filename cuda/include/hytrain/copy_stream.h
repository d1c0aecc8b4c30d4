// A copy stream: one direction of host<->device traffic on its own CUDA stream, separate from the
// compute stream (which PyTorch owns and passes in as a handle).
//
// Every copy gets a ticket, 1, 2, 3... in issue order. Because a stream runs its work in order, "ticket
// n has landed" is one counter. A ring of timed events holds a start/end pair per ticket; a poller
// thread sleeps on each end event in turn (blocking-sync events: no spinning core), then advances
// `completed`, wakes host waiters and calls an optional listener (the pipeline's hook for "this
// block's gradients are on the host"). Nothing is enqueued on the stream for the host's sake, so the
// notification never stalls the copies behind it. The same events let another stream wait for a ticket
// on the device and give each copy's start and end times for traces and bandwidth.
//
// Host waits never hang on a failed stream: they poll the stream for errors while waiting and throw
// hytrain::Error naming the CUDA call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hytrain/copy_queue.h"

namespace hytrain {
namespace cuda {

enum class CopyDirection { device_to_host, host_to_device };

class CopyStream final : public CopyQueue {
 public:
  // priority: 0 = default, negative = higher (CUDA's convention, clamped to the device's range).
  CopyStream(int device, CopyDirection direction, int priority = 0, std::size_t ring = 1024);
  ~CopyStream();  // waits for queued work, then releases the stream and events
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  // Enqueues dst <- src (bytes). With after_stream (a cudaStream_t; 0 is the legacy default stream),
  // the copy first waits on the device for all work already enqueued on that stream (the compute
  // stream that produced the data). Returns the copy's ticket. Blocks only when `ring` copies are
  // still in flight.
  uint64_t copy(void* dst, const void* src, std::size_t bytes,
                std::optional<std::uintptr_t> after_stream) override;

  // Makes `stream` wait on the device until `ticket` has landed (no host synchronisation).
  void make_wait(std::uintptr_t stream, uint64_t ticket) override;

  bool query(uint64_t ticket) const { return completed() >= ticket; }
  // Blocks the host until `ticket` has landed. timeout_s < 0 waits forever. Throws hytrain::Error on a
  // CUDA error in the stream, hytrain::Timeout when the timeout passes.
  void wait(uint64_t ticket, double timeout_s = -1.0);

  uint64_t issued() const override { return issued_.load(std::memory_order_acquire); }
  uint64_t completed() const override { return completed_.load(std::memory_order_acquire); }

  // (start_ms, end_ms) of a landed ticket, relative to the stream's creation; the ticket must be one
  // of the last `ring` issued.
  std::pair<double, double> times_ms(uint64_t ticket);
  // The same, relative to `ref_event` (a timing cudaEvent_t recorded on this device), so copies can
  // be placed on another stream's timeline.
  std::pair<double, double> times_since_ms(std::uintptr_t ref_event, uint64_t ticket);

  // The first CUDA error the stream hit, or "" (the stream is then unusable).
  std::string failure() override;

  // Called on the poller thread with each landed ticket, in order. It must be quick; it must not
  // call this stream's methods. Set it before the first copy.
  void set_listener(std::function<void(uint64_t)> listener) override;

  std::uintptr_t handle() const override { return reinterpret_cast<std::uintptr_t>(stream_); }
  int device() const { return device_; }
  CopyDirection direction() const { return direction_; }

 private:
  void poll_loop();
  std::size_t slot(uint64_t ticket) const { return ticket % start_events_.size(); }

  int device_;
  CopyDirection direction_;
  void* stream_ = nullptr;            // cudaStream_t
  void* epoch_ = nullptr;             // cudaEvent_t recorded at creation
  std::vector<void*> start_events_;   // ring of cudaEvent_t
  std::vector<void*> end_events_;
  std::mutex issue_mutex_;
  std::atomic<uint64_t> issued_{0};
  std::atomic<uint64_t> completed_{0};
  std::mutex wait_mutex_;             // guards the two condition variables, stop_ and error_
  std::condition_variable landed_;    // completed_ advanced (or an error)
  std::condition_variable work_;      // issued_ advanced (or stop)
  bool stop_ = false;
  std::string error_;                 // first CUDA error the poller saw
  std::function<void(uint64_t)> listener_;
  std::thread poller_;
};

}  // namespace cuda
}  // namespace hytrain
