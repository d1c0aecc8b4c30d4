// CUDA error checks: HYTRAIN_CUDA_CHECK throws hytrain::Error naming the call, file and line;
// HYTRAIN_CUDA_CHECK_NOTHROW reports to stderr, for destructors. DeviceGuard makes a device current
// for a scope.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

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

}  // namespace cuda
}  // namespace hytrain
