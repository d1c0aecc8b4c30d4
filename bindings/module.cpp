// hytrain_native: the pybind11 seam. Glue only: arguments arrive already validated by python/hytrain
// (tensors become raw addresses, sizes and dtype codes there), native code re-checks cheap invariants
// and throws, and long native calls release the GIL. One binder file per area (bind_*.cpp).
#include "common.h"

#include "hytrain/error.h"

namespace py = pybind11;
using namespace hytrain;

namespace hytrain {
namespace bindings {

AdamWConfig make_config(int64_t step, double lr, double beta1, double beta2, double eps,
                        double weight_decay, bool decoupled, bool amsgrad, double grad_scale) {
  AdamWConfig c;
  c.step = step;
  c.lr = lr;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.weight_decay = weight_decay;
  c.decoupled = decoupled;
  c.amsgrad = amsgrad;
  c.grad_scale = grad_scale;
  return c;
}

}  // namespace bindings
}  // namespace hytrain

namespace {

// What a user replacing torch.optim.AdamW reaches for, resolved from hytrain at first use (PEP 562's
// module __getattr__): the optimizer is Python (it validates before any pointer reaches this module),
// `import hytrain_native` stays light (no torch, no CUDA needed) and hytrain, which imports this
// module, meets no cycle.
const char* const kFromHytrain[] = {"HybridAdamW", "CapacityError", "CheckpointError", "simd_paths",
                                    "set_simd_path", "stream_model", "__version__"};

}  // namespace

PYBIND11_MODULE(hytrain_native, m) {
  m.doc() =
      "hytrain's native core, and its optimizer under the same names as in hytrain.\n\n"
      "The drop-in replacement for torch.optim.AdamW is hytrain_native.HybridAdamW, the same object as\n"
      "hytrain.HybridAdamW (also CapacityError, CheckpointError, simd_paths, set_simd_path,\n"
      "stream_model; PoolExhaustedError and DeviceTimeoutError live here). They are resolved from the\n"
      "hytrain package when first used, so importing this module needs neither torch nor a GPU.\n\n"
      "The rest are building blocks the hytrain package drives (CPU AdamW, the pinned host pool, the\n"
      "update engine, the k-split scheduler, the CUDA runtime when built with it); they take raw\n"
      "addresses that hytrain validates first: use them through hytrain.";
  py::register_exception<PoolExhausted>(m, "PoolExhaustedError", PyExc_MemoryError);
  py::register_exception<Timeout>(m, "DeviceTimeoutError", PyExc_TimeoutError);
  bindings::bind_core(m);
  bindings::bind_pool(m);
  bindings::bind_runtime(m);
  bindings::bind_engine(m);
  bindings::bind_scheduler(m);
  bindings::bind_cuda(m);
  m.attr("__getattr__") = py::cpp_function([](const std::string& name) -> py::object {
    for (const char* n : kFromHytrain) {
      if (name == n) return py::module_::import("hytrain").attr(n);
    }
    throw py::attribute_error("module 'hytrain_native' has no attribute '" + name + "'");
  });
  m.attr("__dir__") = py::cpp_function([]() {
    py::object self = py::module_::import("hytrain_native");
    py::list names = py::module_::import("builtins").attr("list")(self.attr("__dict__"));
    for (const char* n : kFromHytrain) names.append(n);
    return py::module_::import("builtins").attr("sorted")(names);
  });
}
