// Device discovery and page-locked host memory. The runtime is linked statically and loads the driver
// itself, so a build with CUDA still imports on a machine with no driver: available() is then false.
#include "cuda_check.h"
#include "hytrain/cuda_env.h"

namespace hytrain {
namespace cuda {

namespace {

std::string version_string(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

class CudaPinnedAllocator final : public HostAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    void* p = nullptr;
    HYTRAIN_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override { HYTRAIN_CUDA_CHECK_NOTHROW(cudaFreeHost(p)); }
  std::string kind() const override { return "cuda-pinned"; }
  bool page_locked() const override { return true; }
};

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear, so later calls do not see a stale error
    return 0;
  }
  return n;
}

bool available() { return device_count() > 0; }

std::string runtime_version() { return version_string(CUDART_VERSION); }

std::string driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess || v == 0) {
    (void)cudaGetLastError();
    return "";
  }
  return version_string(v);
}

std::vector<std::string> device_names() {
  std::vector<std::string> names;
  const int n = device_count();
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop{};
    HYTRAIN_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
    names.push_back(std::string(prop.name) + " (sm_" + std::to_string(prop.major) +
                    std::to_string(prop.minor) + ")");
  }
  return names;
}

bool is_page_locked(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

std::unique_ptr<HostAllocator> make_pinned_allocator() {
  HYTRAIN_CHECK(available(), "page-locked CUDA host memory needs a usable GPU");
  return std::make_unique<CudaPinnedAllocator>();
}

}  // namespace cuda
}  // namespace hytrain
