// Shared by the binder files of hytrain_native: address conversion, the AdamW settings and job rows
// that several areas take, and the binder of each area (module.cpp calls them in order).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "hytrain/adamw.h"
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

// Job rows: (param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, grad_dtype, param_copy,
// param_copy_dtype, numel, lr, beta1, beta2, eps, weight_decay, step, decoupled, amsgrad,
// grad_scale, param_out, exp_avg_out, exp_avg_sq_out, max_exp_avg_sq_out), addresses as ints
// (outputs 0: in place), validated by python/hytrain.
using JobRow = std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t,
                          std::uintptr_t, int, std::uintptr_t, int, int64_t, double, double,
                          double, double, double, int64_t, bool, bool, double, std::uintptr_t,
                          std::uintptr_t, std::uintptr_t, std::uintptr_t>;
std::vector<UpdateJob> to_jobs(const std::vector<JobRow>& rows);

// What only a CUDA build has (defined in bind_cuda.cpp either way): page-locked host memory for the
// pool (null where no GPU is usable, so the pool falls back to page-aligned memory; a build without
// CUDA throws) and the CUDA part of build_info.
std::unique_ptr<HostAllocator> make_page_locked_allocator();
void add_cuda_build_info(py::dict& d);

void bind_core(py::module_& m);       // build info, SIMD paths, the raw AdamW step, bandwidth probe
void bind_pool(py::module_& m);       // PinnedPool and its allocations
void bind_engine(py::module_& m);     // UpdateEngine
void bind_scheduler(py::module_& m);  // KSplitScheduler
void bind_cuda(py::module_& m);       // GPU availability; AdamW, grad norm, copy streams, pipeline

}  // namespace bindings
}  // namespace hytrain
