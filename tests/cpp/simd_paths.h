// The SIMD paths this build compiled and this CPU runs: the ones a kernel test must check.
#pragma once

#include <vector>

#include "hytrain/cpu_features.h"

inline std::vector<hytrain::SimdPath> runnable_paths() {
  std::vector<hytrain::SimdPath> out;
  for (hytrain::SimdPath p : hytrain::compiled_simd_paths()) {
    if (hytrain::cpu_supports(p)) out.push_back(p);
  }
  return out;
}
