#include "hytrain/membench.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "hytrain/error.h"
#include "hytrain/pinned_pool.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace hytrain {

namespace {

double seconds_now() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

int team_size(int num_threads) {
#ifdef _OPENMP
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
  return 1;
#endif
}

}  // namespace

BandwidthResult measure_host_bandwidth(int64_t n, int num_threads, int repeats) {
  HYTRAIN_CHECK(n > 0, "elements must be > 0");
  HYTRAIN_CHECK(repeats > 0, "repeats must be > 0");
  const int threads = team_size(num_threads);
  auto alloc = make_page_aligned_allocator(/*place=*/false);  // placed by the threads' own first touch
  const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(float);
  float* a = static_cast<float*>(alloc->allocate(bytes));
  float* b = static_cast<float*>(alloc->allocate(bytes));
  float* c = static_cast<float*>(alloc->allocate(bytes));

#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    a[i] = 1.0f;
    b[i] = 2.0f + static_cast<float>(i & 7);
    c[i] = 0.5f;
  }

  double best_copy = 1e30, best_triad = 1e30, best_update = 1e30;
  const float s = 1.0001f;
  for (int r = 0; r < repeats; ++r) {
    double t0 = seconds_now();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) c[i] = a[i];
    double t1 = seconds_now();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    double t2 = seconds_now();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) a[i] = a[i] + s * c[i];
    double t3 = seconds_now();
    best_copy = std::min(best_copy, t1 - t0);
    best_triad = std::min(best_triad, t2 - t1);
    best_update = std::min(best_update, t3 - t2);
  }
  alloc->deallocate(a, bytes);
  alloc->deallocate(b, bytes);
  alloc->deallocate(c, bytes);
  return {2.0 * bytes / best_copy / 1e9, 3.0 * bytes / best_triad / 1e9,
          3.0 * bytes / best_update / 1e9};
}

}  // namespace hytrain
