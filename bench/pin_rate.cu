// How fast host memory can be page-locked on this machine, by method and thread count: the floor
// for how soon a large model's first step can follow its load (all of the optimizer's host state is
// pinned before the first update).
//
//   alloc     cudaHostAlloc per slab (what PinnedPool's CUDA allocator does, one slab at a time)
//   register  mmap + first touch of every page + cudaHostRegister per slab
//
// Each method runs with T threads, each taking slabs from a shared counter. Prints one JSON line per
// (method, threads) with GB/s. Build: nvcc -O2 -std=c++17 bench/pin_rate.cu -o pin_rate
// Run: ./pin_rate [GiB=16] [slab MiB=256]
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

static double run(const char* method, int threads, std::size_t slabs, std::size_t slab) {
  std::vector<void*> ptrs(slabs, nullptr);
  std::atomic<std::size_t> next{0};
  const bool reg = std::strcmp(method, "register") == 0;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (std::size_t i = next++; i < slabs; i = next++) {
        if (reg) {
          void* p = mmap(nullptr, slab, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
          if (p == MAP_FAILED) std::exit(2);
          madvise(p, slab, MADV_HUGEPAGE);
          std::memset(p, 0, slab);  // first touch: the pages exist (and are local to this thread's node)
          check(cudaHostRegister(p, slab, cudaHostRegisterPortable), "cudaHostRegister");
          ptrs[i] = p;
        } else {
          check(cudaHostAlloc(&ptrs[i], slab, cudaHostAllocPortable), "cudaHostAlloc");
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (void* p : ptrs) {
    if (reg) {
      check(cudaHostUnregister(p), "cudaHostUnregister");
      munmap(p, slab);
    } else {
      check(cudaFreeHost(p), "cudaFreeHost");
    }
  }
  return s;
}

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 16.0;
  const std::size_t slab = (argc > 2 ? std::atoi(argv[2]) : 256) * (std::size_t(1) << 20);
  const std::size_t slabs = static_cast<std::size_t>(gib * (1 << 30) / slab);
  check(cudaFree(nullptr), "context");
  for (const char* method : {"alloc", "register"}) {
    for (int threads : {1, 2, 4, 8, 16}) {
      double s = run(method, threads, slabs, slab);
      std::printf("{\"method\": \"%s\", \"threads\": %d, \"gib\": %.1f, \"slab_mib\": %zu, \"s\": %.3f, "
                  "\"gb_per_s\": %.2f}\n",
                  method, threads, gib, slab >> 20, s, slabs * slab / s / 1e9);
      std::fflush(stdout);
    }
  }
  return 0;
}
