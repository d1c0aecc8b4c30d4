// Device discovery and page-locked host memory. The runtime is linked statically and loads the driver
// itself, so a build with CUDA still imports on a machine with no driver: available() is then false.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cuda_check.h"
#include "hytrain/cuda_env.h"
#include "hytrain/numa.h"

namespace hytrain {
namespace cuda {

namespace {

std::string version_string(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// Page-locked memory made the fast way: mmap (transparent huge pages advised), every page touched
// (place_pages), then cudaHostRegister. On an H100 host this pins 4.9 GB/s on one thread and
// about 25 GB/s on 8-16 threads (bench/pin_rate.cu), where cudaHostAlloc gives 1.5-2.5 GB/s at any
// thread count: the difference between a 7 B model's first step after 5 s or after a minute.
// Registered with cudaHostRegisterPortable: usable by every device, as cudaHostAllocPortable was.
class CudaRegisteredAllocator final : public HostAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    HYTRAIN_CHECK(p != MAP_FAILED, "mmap of " + std::to_string(bytes) + " bytes failed: " +
                                       std::strerror(errno));
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    // First touch here, so that registering finds every page present, and placed: spread over the
    // NUMA nodes this process runs on (hytrain/numa.h).
    try {
      place_pages(p, bytes);
    } catch (...) {
      munmap(p, bytes);
      throw;
    }
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      munmap(p, bytes);
      HYTRAIN_THROW(std::string("cudaHostRegister of ") + std::to_string(bytes) + " bytes failed: " +
                    cudaGetErrorString(e));
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    HYTRAIN_CUDA_CHECK_NOTHROW(cudaHostUnregister(p));
    munmap(p, bytes);
  }
  std::string kind() const override { return "cuda-registered"; }
  bool page_locked() const override { return true; }
  bool zeroed() const override { return true; }  // fresh anonymous pages, registered as they are
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
  return std::make_unique<CudaRegisteredAllocator>();
}

}  // namespace cuda
}  // namespace hytrain
