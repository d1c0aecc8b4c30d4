#include "hytrain/cpu_features.h"

#include "hytrain/error.h"

namespace hytrain {

const char* simd_path_name(SimdPath p) {
  switch (p) {
    case SimdPath::automatic: return "auto";
    case SimdPath::scalar: return "scalar";
    case SimdPath::avx2: return "avx2";
    case SimdPath::avx512: return "avx512";
    case SimdPath::avx512vbmi: return "avx512vbmi";
  }
  return "unknown";
}

SimdPath parse_simd_path(const std::string& name) {
  for (SimdPath p : {SimdPath::automatic, SimdPath::scalar, SimdPath::avx2, SimdPath::avx512,
                     SimdPath::avx512vbmi}) {
    if (name == simd_path_name(p)) return p;
  }
  HYTRAIN_THROW("unknown SIMD path '" + name + "' (expected auto, scalar, avx2, avx512 or avx512vbmi)");
}

std::vector<SimdPath> compiled_simd_paths() {
  std::vector<SimdPath> paths{SimdPath::scalar};
#ifdef HYTRAIN_HAVE_AVX2
  paths.push_back(SimdPath::avx2);
#endif
#ifdef HYTRAIN_HAVE_AVX512
  paths.push_back(SimdPath::avx512);
  paths.push_back(SimdPath::avx512vbmi);
#endif
  return paths;
}

bool cpu_supports(SimdPath p) {
  switch (p) {
    case SimdPath::automatic:
    case SimdPath::scalar: return true;
#if defined(__x86_64__) || defined(__i386__)
    // libgcc's checks include the OS's XSAVE state (XCR0), not only the CPUID bits.
    case SimdPath::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case SimdPath::avx512: return __builtin_cpu_supports("avx512f");
    case SimdPath::avx512vbmi:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi");
#else
    default: return false;
#endif
  }
  return false;
}

bool cpu_has_avx512bf16() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

SimdPath best_simd_path() {
  SimdPath best = SimdPath::scalar;
  for (SimdPath p : compiled_simd_paths()) {
    if (cpu_supports(p)) best = p;  // compiled_simd_paths() is ordered slowest to fastest
  }
  return best;
}

SimdPath resolve_simd_path(SimdPath requested) {
  if (requested == SimdPath::automatic) return best_simd_path();
  bool compiled = false;
  for (SimdPath p : compiled_simd_paths()) compiled |= (p == requested);
  if (!compiled) {
    HYTRAIN_THROW(std::string("SIMD path '") + simd_path_name(requested) +
                  "' is not compiled into this build");
  }
  if (!cpu_supports(requested)) {
    HYTRAIN_THROW(std::string("SIMD path '") + simd_path_name(requested) +
                  "' is not supported by this CPU");
  }
  return requested;
}

}  // namespace hytrain
