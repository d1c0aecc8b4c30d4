// CPU AdamW microbenchmark: G params/s and GB/s for each SIMD path, beside the host bandwidth (copy and
// triad) measured in the same run over the same footprint.
//
// Bytes per parameter, each read once and each write once:
//   fp32  : read p, m, v, g (16 B), write p, m, v (12 B)                   = 28 B
//   mixed : read p, m, v (12 B) + bf16 g (2 B), write p, m, v (12 B) + bf16 copy (2 B) = 28 B
//   bf16  : mixed with bf16 m and v (compact states)                      = 20 B
//   8bit  : mixed with 8-bit m and v, plus a 4-byte scale each per 256    = 16.03 B
// so the floor at triad bandwidth B is that many bytes / B seconds per parameter.
//
// Cases: fp32 and mixed in place (the mixed copy in its own buffer), "shared" (mixed, the copy written
// over the bf16 gradient: the offload pipeline's in-place pass) and "oop" (mixed, the new state and
// copy written elsewhere: a speculative pass). Each runs with plain and with streaming stores
// (non-temporal, for the outputs the update does not read), the same bytes counted: plain stores pay a
// write-allocate read for every such output. "bf16" and "8bit" are the mixed case with compact and
// 8-bit states (quant8.h).
//
//   cpu_adam_bench [--params N] [--threads T] [--repeats R] [--paths a,b] [--cases a,b]
// --paths / --cases keep only the named SIMD paths (scalar, avx2, avx512, avx512vbmi) and cases.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "hytrain/adamw.h"
#include "hytrain/membench.h"
#include "hytrain/pinned_pool.h"
#include "hytrain/quant8.h"

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace hytrain;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class T>
T* alloc_touch(HostAllocator& a, int64_t n, T value, int threads) {
  T* p = static_cast<T*>(a.allocate(n * sizeof(T)));
  // First touch with the same static split the kernel uses, so pages sit near their threads.
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) p[i] = value;
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 256LL << 20;
  int threads = 0, repeats = 5;
  std::string paths, cases;  // comma-separated filters; empty keeps all
  auto picked = [](const std::string& list, const std::string& name) {
    return list.empty() || ("," + list + ",").find("," + name + ",") != std::string::npos;
  };
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--params") n = std::atoll(argv[i + 1]);
    else if (k == "--threads") threads = std::atoi(argv[i + 1]);
    else if (k == "--repeats") repeats = std::atoi(argv[i + 1]);
    else if (k == "--paths") paths = argv[i + 1];
    else if (k == "--cases") cases = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: %s [--params N] [--threads T] [--repeats R] [--paths a,b] [--cases a,b]\n",
                   argv[0]);
      return 2;
    }
  }
#ifdef _OPENMP
  if (threads <= 0) threads = omp_get_max_threads();
#else
  threads = 1;
#endif
  auto alloc = make_page_aligned_allocator();
  float* p = alloc_touch<float>(*alloc, n, 0.5f, threads);
  float* m = alloc_touch<float>(*alloc, n, 0.0f, threads);
  float* v = alloc_touch<float>(*alloc, n, 0.0f, threads);
  float* g32 = alloc_touch<float>(*alloc, n, 1e-3f, threads);
  uint16_t* g16 = alloc_touch<uint16_t>(*alloc, n, f32_to_bf16(1e-3f), threads);
  // Gradients of varied sizes and signs (the 8-bit states' codes depend on them; the rest does not),
  // set again before each case ("shared" writes the weight copy over them).
  auto fill_g16 = [&] {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) g16[i] = f32_to_bf16(1e-3f * static_cast<float>((i * 7919) % 1999 - 999) / 999.0f);
  };
  uint16_t* copy = alloc_touch<uint16_t>(*alloc, n, 0, threads);
  float* po = alloc_touch<float>(*alloc, n, 0.0f, threads);
  float* mo = alloc_touch<float>(*alloc, n, 0.0f, threads);
  float* vo = alloc_touch<float>(*alloc, n, 0.0f, threads);

  // Triad over the fp32 case's footprint: three arrays holding 16 bytes per parameter in all.
  const BandwidthResult bw = measure_host_bandwidth(n * 4 / 3, threads, repeats);
  std::printf("CPU AdamW, %lld params, %d threads\n", static_cast<long long>(n), threads);
  std::printf("host bandwidth: copy %.1f GB/s, triad %.1f GB/s, in-place update %.1f GB/s\n\n",
              bw.copy_gbps, bw.triad_gbps, bw.update_gbps);
  std::printf("%-10s %-7s %-10s %10s %9s %9s %9s %10s\n", "path", "case", "stores", "ms/step", "Gparam/s",
              "GB/s", "vs triad", "vs update");

  for (SimdPath path : compiled_simd_paths()) {
    if (!cpu_supports(path) || !picked(paths, simd_path_name(path))) continue;
    for (const char* kase : {"fp32", "mixed", "shared", "oop", "bf16", "8bit"}) {
      if (!picked(cases, kase)) continue;
      const bool mixed = std::strcmp(kase, "fp32") != 0;
      const DType states = std::strcmp(kase, "bf16") == 0 ? DType::bf16
                           : std::strcmp(kase, "8bit") == 0 ? DType::q8 : DType::f32;
      const double bytes_per_param = states == DType::bf16 ? 20.0 : states == DType::q8 ? 16.0 + 8.0 / kQ8Block : 28.0;
      fill_g16();
      std::memset(m, 0, n * 4);  // a zero state in every format (the buffers are fp32-sized)
      std::memset(v, 0, n * 4);
      for (bool streaming : {false, true}) {
        AdamWTensor t{p, m, v, nullptr, mixed ? static_cast<const void*>(g16) : g32,
                      mixed ? DType::bf16 : DType::f32, mixed ? copy : nullptr, DType::bf16, n};
        t.state_dtype = states;
        if (std::strcmp(kase, "shared") == 0) t.param_copy = g16;
        if (std::strcmp(kase, "oop") == 0) {
          t.param_out = po;
          t.exp_avg_out = mo;
          t.exp_avg_sq_out = vo;
        }
        std::vector<double> times;
        AdamWConfig c;
        c.streaming_stores = streaming;
        const StreamPlan plan = adamw_stream_plan(t, c, path);
        if (streaming && !plan.state && !plan.copy) continue;  // nothing this case could stream
        for (int r = 0; r <= repeats; ++r) {
          c.step = r + 1;
          const double t0 = now();
          adamw_step(t, c, threads, path);
          if (r > 0) times.push_back(now() - t0);  // the first run is warm-up
        }
        std::sort(times.begin(), times.end());
        const double s = times[times.size() / 2];
        const double gbps = bytes_per_param * n / s / 1e9;
        const char* what = plan.state ? "stream all" : plan.copy ? "stream cp" : "plain";
        std::printf("%-10s %-7s %-10s %10.2f %9.3f %9.1f %8.2fx %9.2fx\n", simd_path_name(path), kase, what,
                    s * 1e3, n / s / 1e9, gbps, gbps / bw.triad_gbps, gbps / bw.update_gbps);
      }
    }
  }
  for (void* q : {static_cast<void*>(p), static_cast<void*>(m), static_cast<void*>(v),
                  static_cast<void*>(g32), static_cast<void*>(po), static_cast<void*>(mo),
                  static_cast<void*>(vo)}) {
    alloc->deallocate(q, n * 4);
  }
  alloc->deallocate(g16, n * 2);
  alloc->deallocate(copy, n * 2);
  return 0;
}
