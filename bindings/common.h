// Shared by the binder files of hytrain_native: address conversion, the AdamW settings and live addresses
// that several areas take, and the binder of each area (module.cpp calls them in order).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "hytrain/adamw.h"
#include "hytrain/param_table.h"
#include "hytrain/pinned_pool.h"
#include "hytrain/update_engine.h"

namespace hytrain {
namespace bindings {

namespace py = pybind11;

template <class T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

AdamWConfig make_config(int64_t step, double lr, double beta1, double beta2, double eps,
                        double weight_decay, bool decoupled, bool amsgrad, double grad_scale);

// The live gradient and weight addresses of a pass, one pair per ParamTable handle.
std::vector<LiveAddresses> live_addresses(const std::vector<std::uintptr_t>& grads,
                                          const std::vector<std::uintptr_t>& weights);

// What only a CUDA build has (defined in bind_cuda.cpp either way): page-locked host memory for the
// pool (null where no GPU is usable, so the pool falls back to page-aligned memory; a build without
// CUDA throws) and the CUDA part of build_info.
std::unique_ptr<HostAllocator> make_page_locked_allocator();
void add_cuda_build_info(py::dict& d);

void bind_core(py::module_& m);       // build info, SIMD paths, the raw AdamW step, bandwidth probe
void bind_pool(py::module_& m);       // PinnedPool and its allocations
void bind_runtime(py::module_& m);    // ParamTable, BlockRuntime
void bind_engine(py::module_& m);     // UpdateEngine
void bind_scheduler(py::module_& m);  // KSplitScheduler
void bind_cuda(py::module_& m);       // GPU availability; AdamW, grad norm, copy streams, pipeline

}  // namespace bindings
}  // namespace hytrain
