// CUDA error checks: HYTRAIN_CUDA_CHECK throws hytrain::Error naming the call, file and line;
// HYTRAIN_CUDA_CHECK_NOTHROW reports to stderr, for destructors. DeviceGuard makes a device current
// for a scope; persistent_grid and upload are the shared setup of the multi-tensor kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "hytrain/error.h"

#define HYTRAIN_CUDA_CHECK(call)                                                            \
  do {                                                                                      \
    cudaError_t hytrain_err_ = (call);                                                      \
    if (hytrain_err_ != cudaSuccess) {                                                      \
      throw ::hytrain::Error(std::string("CUDA error in ") + #call + ": " +                 \
                                 cudaGetErrorName(hytrain_err_) + ": " +                    \
                                 cudaGetErrorString(hytrain_err_),                          \
                             __FILE__, __LINE__);                                           \
    }                                                                                       \
  } while (0)

#define HYTRAIN_CUDA_CHECK_NOTHROW(call)                                                    \
  do {                                                                                      \
    cudaError_t hytrain_err_ = (call);                                                      \
    if (hytrain_err_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "hytrain: CUDA error in %s: %s (%s:%d)\n", #call,                \
                   cudaGetErrorString(hytrain_err_), __FILE__, __LINE__);                   \
    }                                                                                       \
  } while (0)

namespace hytrain {
namespace cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    HYTRAIN_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) HYTRAIN_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { HYTRAIN_CUDA_CHECK_NOTHROW(cudaSetDevice(prev_)); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// Blocks for a grid that strides over `work_items`: as many as the device holds at once, at most one
// per item, at least one. Call with the device current.
// (Two attribute queries: cheap enough for a launch during backward, unlike cudaGetDeviceProperties.)
inline int persistent_grid(int device, int threads_per_block, int64_t work_items) {
  int sms = 0, threads = 0;
  HYTRAIN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  HYTRAIN_CUDA_CHECK(cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, device));
  const int64_t resident = static_cast<int64_t>(sms) * (threads / threads_per_block);
  return static_cast<int>(std::max<int64_t>(1, std::min(work_items, resident)));
}

// Copies a host table to a new device allocation (freed by the caller with cudaFree).
template <class T>
void* upload(const std::vector<T>& table) {
  void* p = nullptr;
  HYTRAIN_CUDA_CHECK(cudaMalloc(&p, sizeof(T) * table.size()));
  const cudaError_t e = cudaMemcpy(p, table.data(), sizeof(T) * table.size(), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    HYTRAIN_CUDA_CHECK_NOTHROW(cudaFree(p));
    HYTRAIN_CUDA_CHECK(e);
  }
  return p;
}

// Frees a device allocation made by upload or cudaMalloc, if any, and forgets it (never throws: for
// destructors and for constructors cleaning up before they rethrow).
template <class T>
void free_device(T*& p) noexcept {
  if (p != nullptr) HYTRAIN_CUDA_CHECK_NOTHROW(cudaFree(p));
  p = nullptr;
}

}  // namespace cuda
}  // namespace hytrain
