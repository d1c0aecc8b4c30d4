// Build information, SIMD paths, the raw-pointer AdamW step and the host bandwidth probe.
#include <string>

#include "common.h"
#include "hytrain/cpu_features.h"
#include "hytrain/fingerprint.h"
#include "hytrain/membench.h"
#include "hytrain/quant8.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace hytrain {
namespace bindings {

namespace {

std::vector<std::string> path_names(const std::vector<SimdPath>& paths) {
  std::vector<std::string> out;
  for (SimdPath p : paths) out.emplace_back(simd_path_name(p));
  return out;
}

py::dict build_info() {
  py::dict d;
  d["version"] = HYTRAIN_VERSION;
  d["compiler"] = HYTRAIN_COMPILER;
  d["simd_compiled"] = path_names(compiled_simd_paths());
  d["simd_selected"] = simd_path_name(best_simd_path());
#ifdef _OPENMP
  d["openmp"] = _OPENMP;
  d["openmp_max_threads"] = omp_get_max_threads();
#else
  d["openmp"] = py::none();
  d["openmp_max_threads"] = 1;
#endif
  add_cuda_build_info(d);
  return d;
}

}  // namespace

void bind_core(py::module_& m) {
  m.def("build_info", &build_info, "What this binary was built with.");
  m.def("simd_paths_compiled", [] { return path_names(compiled_simd_paths()); });
  m.def("cpu_supports", [](const std::string& name) { return cpu_supports(parse_simd_path(name)); });
  m.def("best_simd_path", [] { return std::string(simd_path_name(best_simd_path())); });
  m.def(
      "adamw_step",
      [](std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
         std::uintptr_t max_exp_avg_sq, std::uintptr_t grad, int grad_dtype,
         std::uintptr_t param_copy, int param_copy_dtype, int64_t numel, double lr, double beta1,
         double beta2, double eps, double weight_decay, int64_t step, bool decoupled, bool amsgrad,
         double grad_scale, int num_threads, const std::string& simd, int state_dtype, uint32_t seed,
         int64_t index_base) {
        const SimdPath path = parse_simd_path(simd);
        AdamWTensor t;
        t.param = as_ptr<float>(param);
        t.exp_avg = as_ptr<void>(exp_avg);
        t.exp_avg_sq = as_ptr<void>(exp_avg_sq);
        t.max_exp_avg_sq = as_ptr<void>(max_exp_avg_sq);
        t.state_dtype = static_cast<DType>(state_dtype);
        t.seed = seed;
        t.index_base = index_base;
        t.grad = as_ptr<const void>(grad);
        t.grad_dtype = static_cast<DType>(grad_dtype);
        t.param_copy = as_ptr<void>(param_copy);
        t.param_copy_dtype = static_cast<DType>(param_copy_dtype);
        t.numel = numel;
        const AdamWConfig c =
            make_config(step, lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, grad_scale);
        py::gil_scoped_release release;
        return adamw_step(t, c, num_threads, path);
      },
      "Raw-pointer AdamW step; call hytrain.cpu_adam.adamw_step, which validates tensors.");

  m.def(
      "measure_host_bandwidth",
      [](int64_t elements, int num_threads, int repeats) {
        BandwidthResult r;
        {
          py::gil_scoped_release release;
          r = measure_host_bandwidth(elements, num_threads, repeats);
        }
        py::dict d;
        d["copy_gbps"] = r.copy_gbps;
        d["triad_gbps"] = r.triad_gbps;
        d["update_gbps"] = r.update_gbps;
        return d;
      },
      py::arg("elements"), py::arg("num_threads") = 0, py::arg("repeats") = 5);

  m.def(
      "q8_map",
      [](bool is_signed) {
        const Q8Map& map = q8_map(is_signed);
        return py::make_tuple(std::vector<float>(map.value, map.value + 256), std::vector<float>(map.mid, map.mid + 256));
      },
      py::arg("signed"), "The 8-bit state map (quant8.h): (value of each code, midpoints; +inf past the last).");
  m.def("steady_now_ns", &steady_now_ns, "The clock of UpdateEngine timings (ns).");
  m.def("undo_capacity", &undo_capacity, py::arg("numel"), "Escape entries an undo record of numel elements gets.");
  m.def(
      "fingerprint",
      [](std::uintptr_t data, int64_t bytes) {
        py::gil_scoped_release nogil;
        return fingerprint(as_ptr<const void>(data), bytes);
      },
      py::arg("data"), py::arg("bytes"), "The fingerprint (fingerprint.h) of host memory [data, data + bytes).");
}

}  // namespace bindings
}  // namespace hytrain
