// A queue of memory copies in one direction, landing in issue order: what the offload pipeline needs of
// a copy stream. cuda/ implements it on a CUDA stream (hytrain::cuda::CopyStream); tests implement it
// on the host, so the pipeline's whole block lifecycle runs under ctest on a CPU.
//
// Every copy gets a ticket, 1, 2, 3... in issue order; "ticket n has landed" is one counter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace hytrain {

// One copy of `bytes` from src to dst.
struct HostCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
};

class CopyQueue {
 public:
  virtual ~CopyQueue() = default;  // implementations wait for the copies already issued

  // Enqueues dst <- src (bytes). With `after` (a stream handle; for CUDA a cudaStream_t), the copy
  // first waits for all work already enqueued on that stream (the work that produced the data).
  // Returns the copy's ticket.
  virtual uint64_t copy(void* dst, const void* src, std::size_t bytes, std::optional<std::uintptr_t> after) = 0;
  virtual uint64_t issued() const = 0;
  virtual uint64_t completed() const = 0;
  // Makes `stream` wait until `ticket` has landed (for CUDA on the device, with no host wait).
  virtual void make_wait(std::uintptr_t stream, uint64_t ticket) = 0;
  // The first error the queue hit, or "" (the queue is then unusable).
  virtual std::string failure() = 0;
  // The queue's own stream, as another queue's `after` or `make_wait` takes it (0 where there is none).
  virtual std::uintptr_t handle() const = 0;
  // Called with each landed ticket, in order, on the queue's own thread. It must be quick and must not
  // call the queue. Set it before the first copy.
  virtual void set_listener(std::function<void(uint64_t)> listener) = 0;
};

}  // namespace hytrain
