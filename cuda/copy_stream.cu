// Copy streams with host completion notification; see hytrain/copy_stream.h.
#include <chrono>
#include <string>
#include <thread>

#include "cuda_check.h"
#include "hytrain/copy_stream.h"
#include "hytrain/error.h"
#include "hytrain/thread_name.h"

namespace hytrain {
namespace cuda {

namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

std::string error_text(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

}  // namespace

CopyStream::CopyStream(int device, CopyDirection direction, int priority, std::size_t ring)
    : device_(device), direction_(direction) {
  HYTRAIN_CHECK(ring >= 2, "the event ring needs at least 2 slots");
  int count = 0;
  HYTRAIN_CUDA_CHECK(cudaGetDeviceCount(&count));
  HYTRAIN_CHECK(device >= 0 && device < count,
                "device " + std::to_string(device) + " does not exist (" + std::to_string(count) +
                    " visible)");
  DeviceGuard guard(device_);
  int lo = 0, hi = 0;  // numerically: lo is the lowest priority (0), hi the highest (negative)
  HYTRAIN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  const int p = priority < hi ? hi : (priority > lo ? lo : priority);
  cudaStream_t s = nullptr;
  HYTRAIN_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, p));
  stream_ = s;
  start_events_.resize(ring, nullptr);
  end_events_.resize(ring, nullptr);
  for (std::size_t i = 0; i < ring; ++i) {
    cudaEvent_t a = nullptr, b = nullptr;
    HYTRAIN_CUDA_CHECK(cudaEventCreate(&a));
    start_events_[i] = a;
    HYTRAIN_CUDA_CHECK(cudaEventCreateWithFlags(&b, cudaEventBlockingSync));
    end_events_[i] = b;
  }
  cudaEvent_t e = nullptr;
  HYTRAIN_CUDA_CHECK(cudaEventCreate(&e));
  epoch_ = e;
  HYTRAIN_CUDA_CHECK(cudaEventRecord(e, s));
  poller_ = std::thread([this] { poll_loop(); });
}

CopyStream::~CopyStream() {
  DeviceGuard guard(device_);
  if (stream_) HYTRAIN_CUDA_CHECK_NOTHROW(cudaStreamSynchronize(as_stream(stream_)));
  {
    std::lock_guard<std::mutex> lock(wait_mutex_);
    stop_ = true;
  }
  work_.notify_all();
  if (poller_.joinable()) poller_.join();
  for (void* e : start_events_) if (e) HYTRAIN_CUDA_CHECK_NOTHROW(cudaEventDestroy(as_event(e)));
  for (void* e : end_events_) if (e) HYTRAIN_CUDA_CHECK_NOTHROW(cudaEventDestroy(as_event(e)));
  if (epoch_) HYTRAIN_CUDA_CHECK_NOTHROW(cudaEventDestroy(as_event(epoch_)));
  if (stream_) HYTRAIN_CUDA_CHECK_NOTHROW(cudaStreamDestroy(as_stream(stream_)));
}

void CopyStream::set_listener(std::function<void(uint64_t)> listener) {
  std::lock_guard<std::mutex> lock(issue_mutex_);
  HYTRAIN_CHECK(issued() == 0, "set the listener before the first copy");
  listener_ = std::move(listener);
}

void CopyStream::poll_loop() {
  name_this_thread("hytrain-copies");
  // The poller's own current device: events of this device are waited on here.
  if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  for (;;) {
    const uint64_t next = completed() + 1;
    {
      std::unique_lock<std::mutex> lock(wait_mutex_);
      work_.wait(lock, [&] { return stop_ || issued() >= next; });
      if (issued() < next) return;  // stopping, nothing left in flight
    }
    // Sleeps until the copy's end event fires. The slot cannot be reused before `next` is counted.
    const cudaError_t st = cudaEventSynchronize(as_event(end_events_[slot(next)]));
    if (st != cudaSuccess) {
      {
        std::lock_guard<std::mutex> lock(wait_mutex_);
        error_ = error_text("cudaEventSynchronize on the copy stream", st);
      }
      landed_.notify_all();
      return;
    }
    completed_.store(next, std::memory_order_release);
    if (listener_) listener_(next);
    { std::lock_guard<std::mutex> lock(wait_mutex_); }  // a waiter is either asleep or sees `next`
    landed_.notify_all();
  }
}

uint64_t CopyStream::copy(void* dst, const void* src, std::size_t bytes,
                          std::optional<std::uintptr_t> after_stream) {
  HYTRAIN_CHECK(bytes == 0 || (dst != nullptr && src != nullptr), "copy pointers must be non-null");
  std::lock_guard<std::mutex> lock(issue_mutex_);
  const uint64_t ticket = issued() + 1;
  // The ring slot is free once the ticket that used it last has landed.
  if (ticket > start_events_.size()) wait(ticket - start_events_.size());
  DeviceGuard guard(device_);
  cudaStream_t s = as_stream(stream_);
  if (after_stream.has_value()) {
    cudaEvent_t e = as_event(start_events_[slot(ticket)]);
    // The start event doubles as the "producer is done" marker: recorded on the producer's stream,
    // waited on here, then re-recorded below as this copy's start.
    HYTRAIN_CUDA_CHECK(cudaEventRecord(e, reinterpret_cast<cudaStream_t>(*after_stream)));
    HYTRAIN_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0));
  }
  HYTRAIN_CUDA_CHECK(cudaEventRecord(as_event(start_events_[slot(ticket)]), s));
  const cudaMemcpyKind kind = direction_ == CopyDirection::device_to_host ? cudaMemcpyDeviceToHost
                                                                          : cudaMemcpyHostToDevice;
  if (bytes > 0) HYTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s));
  HYTRAIN_CUDA_CHECK(cudaEventRecord(as_event(end_events_[slot(ticket)]), s));
  {
    std::lock_guard<std::mutex> wl(wait_mutex_);
    issued_.store(ticket, std::memory_order_release);
  }
  work_.notify_one();
  return ticket;
}

void CopyStream::make_wait(std::uintptr_t stream, uint64_t ticket) {
  HYTRAIN_CHECK(ticket <= issued(), "ticket " + std::to_string(ticket) + " was never issued");
  if (ticket == 0 || query(ticket)) return;
  std::lock_guard<std::mutex> lock(issue_mutex_);
  // Not landed, so its slot has not been reused (copy() waits for a slot's ticket before reusing it).
  DeviceGuard guard(device_);
  HYTRAIN_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                                         as_event(end_events_[slot(ticket)]), 0));
}

void CopyStream::wait(uint64_t ticket, double timeout_s) {
  HYTRAIN_CHECK(ticket <= issued(), "ticket " + std::to_string(ticket) + " was never issued");
  const auto ready = [&] { return query(ticket) || !error_.empty(); };
  std::unique_lock<std::mutex> lock(wait_mutex_);
  if (timeout_s < 0) {
    landed_.wait(lock, ready);
  } else if (!landed_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready)) {
    throw Timeout("copy ticket " + std::to_string(ticket) + " had not landed after " +
                      std::to_string(timeout_s) + " s (" + std::to_string(completed()) + " of " +
                      std::to_string(issued()) + " copies done)",
                  __FILE__, __LINE__);
  }
  if (!query(ticket)) throw Error(error_ + " (waiting for ticket " + std::to_string(ticket) + ")",
                                  __FILE__, __LINE__);
}

std::pair<double, double> CopyStream::times_ms(uint64_t ticket) {
  return times_since_ms(reinterpret_cast<std::uintptr_t>(epoch_), ticket);
}

std::pair<double, double> CopyStream::times_since_ms(std::uintptr_t ref_event, uint64_t ticket) {
  HYTRAIN_CHECK(ref_event != 0, "the reference event is null");
  HYTRAIN_CHECK(ticket >= 1 && query(ticket), "ticket " + std::to_string(ticket) +
                                                  " has not landed");
  std::lock_guard<std::mutex> lock(issue_mutex_);
  HYTRAIN_CHECK(issued() - ticket < start_events_.size(),
                "ticket " + std::to_string(ticket) + " is older than the event ring");
  DeviceGuard guard(device_);
  cudaEvent_t ref = reinterpret_cast<cudaEvent_t>(ref_event);
  float a = 0.0f, b = 0.0f;
  HYTRAIN_CUDA_CHECK(cudaEventElapsedTime(&a, ref, as_event(start_events_[slot(ticket)])));
  HYTRAIN_CUDA_CHECK(cudaEventElapsedTime(&b, ref, as_event(end_events_[slot(ticket)])));
  return {a, b};
}

std::string CopyStream::failure() {
  std::lock_guard<std::mutex> lock(wait_mutex_);
  return error_;
}

}  // namespace cuda
}  // namespace hytrain
