// Which SIMD implementation runs. All paths are compiled side by side (no -march=native); the best
// one the CPU supports is picked at run time, and a caller may force one for tests and benchmarks.
#pragma once

#include <string>
#include <vector>

namespace hytrain {

enum class SimdPath : int { automatic = 0, scalar = 1, avx2 = 2, avx512 = 3, avx512vbmi = 4 };

const char* simd_path_name(SimdPath p);
SimdPath parse_simd_path(const std::string& name);  // throws on an unknown name

// Paths this binary contains (scalar always; avx2, avx512, avx512vbmi when the compiler could build them).
std::vector<SimdPath> compiled_simd_paths();
// Whether this CPU (and OS) can execute the path.
bool cpu_supports(SimdPath p);
// Whether this CPU (and OS) has AVX512_BF16 (the avx512vbmi path then rounds bf16 weight copies with
// vcvtneps2bf16, where MXCSR.DAZ is clear; the bits are the same either way).
bool cpu_has_avx512bf16();
// The best compiled path this CPU supports.
SimdPath best_simd_path();
// Resolves `automatic` to best_simd_path(); throws if the path is not compiled in or not supported.
SimdPath resolve_simd_path(SimdPath requested);

}  // namespace hytrain
