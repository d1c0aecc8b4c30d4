// Copy streams with host completion notification; see hytrain/cuda_copy.h.
#include <chrono>
#include <string>

#include "cuda_check.h"
#include "hytrain/cuda_copy.h"
#include "hytrain/error.h"

namespace hytrain {
namespace cuda {

namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

// How often a host wait looks at the stream for errors while no completion has arrived.
constexpr auto kErrorPoll = std::chrono::milliseconds(2);

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
    HYTRAIN_CUDA_CHECK(cudaEventCreate(&b));
    end_events_[i] = b;
  }
  cudaEvent_t e = nullptr;
  HYTRAIN_CUDA_CHECK(cudaEventCreate(&e));
  epoch_ = e;
  HYTRAIN_CUDA_CHECK(cudaEventRecord(e, s));
}

CopyStream::~CopyStream() {
  DeviceGuard guard(device_);
  if (stream_) HYTRAIN_CUDA_CHECK_NOTHROW(cudaStreamSynchronize(as_stream(stream_)));
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

void CopyStream::on_landed(void* self) {
  auto* cs = static_cast<CopyStream*>(self);
  const uint64_t t = cs->completed_.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (cs->listener_) cs->listener_(t);
  { std::lock_guard<std::mutex> lock(cs->wait_mutex_); }  // a waiter is either asleep or sees t
  cs->landed_.notify_all();
}

uint64_t CopyStream::copy(void* dst, const void* src, std::size_t bytes,
                          std::uintptr_t after_stream) {
  HYTRAIN_CHECK(bytes == 0 || (dst != nullptr && src != nullptr), "copy pointers must be non-null");
  std::lock_guard<std::mutex> lock(issue_mutex_);
  const uint64_t ticket = issued() + 1;
  // The ring slot is free once the ticket that used it last has landed.
  if (ticket > start_events_.size()) wait(ticket - start_events_.size());
  DeviceGuard guard(device_);
  cudaStream_t s = as_stream(stream_);
  if (after_stream != 0) {
    cudaEvent_t e = as_event(start_events_[slot(ticket)]);
    // The start event doubles as the "producer is done" marker: recorded on the producer's stream,
    // waited on here, then re-recorded below as this copy's start.
    HYTRAIN_CUDA_CHECK(cudaEventRecord(e, reinterpret_cast<cudaStream_t>(after_stream)));
    HYTRAIN_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0));
  }
  HYTRAIN_CUDA_CHECK(cudaEventRecord(as_event(start_events_[slot(ticket)]), s));
  const cudaMemcpyKind kind = direction_ == CopyDirection::device_to_host ? cudaMemcpyDeviceToHost
                                                                          : cudaMemcpyHostToDevice;
  if (bytes > 0) HYTRAIN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s));
  HYTRAIN_CUDA_CHECK(cudaEventRecord(as_event(end_events_[slot(ticket)]), s));
  HYTRAIN_CUDA_CHECK(cudaLaunchHostFunc(s, &CopyStream::on_landed, this));
  issued_.store(ticket, std::memory_order_release);
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
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(
                         timeout_s < 0 ? 0.0 : timeout_s));
  std::unique_lock<std::mutex> lock(wait_mutex_);
  while (!query(ticket)) {
    landed_.wait_for(lock, kErrorPoll, [&] { return query(ticket); });
    if (query(ticket)) break;
    // A failed stream never runs its host functions: look for the error instead of waiting forever.
    const cudaError_t st = cudaStreamQuery(as_stream(stream_));
    if (st != cudaSuccess && st != cudaErrorNotReady) {
      throw Error(std::string("CUDA error in the copy stream while waiting for ticket ") +
                      std::to_string(ticket) + ": " + cudaGetErrorName(st) + ": " +
                      cudaGetErrorString(st),
                  __FILE__, __LINE__);
    }
    if (timeout_s >= 0 && clock::now() >= deadline) {
      throw Timeout("copy ticket " + std::to_string(ticket) + " had not landed after " +
                        std::to_string(timeout_s) + " s (" + std::to_string(completed()) +
                        " of " + std::to_string(issued()) + " copies done)",
                    __FILE__, __LINE__);
    }
  }
}

std::pair<double, double> CopyStream::times_ms(uint64_t ticket) {
  HYTRAIN_CHECK(ticket >= 1 && query(ticket), "ticket " + std::to_string(ticket) +
                                                  " has not landed");
  std::lock_guard<std::mutex> lock(issue_mutex_);
  HYTRAIN_CHECK(issued() - ticket < start_events_.size(),
                "ticket " + std::to_string(ticket) + " is older than the event ring");
  DeviceGuard guard(device_);
  float a = 0.0f, b = 0.0f;
  HYTRAIN_CUDA_CHECK(cudaEventElapsedTime(&a, as_event(epoch_), as_event(start_events_[slot(ticket)])));
  HYTRAIN_CUDA_CHECK(cudaEventElapsedTime(&b, as_event(epoch_), as_event(end_events_[slot(ticket)])));
  return {a, b};
}

}  // namespace cuda
}  // namespace hytrain
