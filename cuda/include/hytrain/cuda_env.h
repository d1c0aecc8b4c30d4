// What the CUDA side of the native core offers the rest of the build. Nothing here exposes CUDA
// types, so the bindings and core/ compile with a plain C++ compiler.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hytrain/pinned_pool.h"

namespace hytrain {
namespace cuda {

// True when the runtime finds a driver and at least one device. Never throws: on a machine with CUDA
// compiled in but no usable GPU it returns false and leaves no sticky error behind.
bool available();
int device_count();             // 0 when unavailable
std::string runtime_version();  // "13.0" (compiled-against runtime)
std::string driver_version();   // "" when no driver
std::vector<std::string> device_names();

// Whether the driver knows `p` as page-locked host memory (cudaPointerGetAttributes).
bool is_page_locked(const void* p);

// Page-locked host memory from cudaHostAlloc (portable across devices). Requires available().
std::unique_ptr<HostAllocator> make_pinned_allocator();

}  // namespace cuda
}  // namespace hytrain
