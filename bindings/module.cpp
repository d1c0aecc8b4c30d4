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

PYBIND11_MODULE(hytrain_native, m) {
  m.doc() = "hytrain native core: CPU AdamW, pinned host pool, CUDA runtime (when built with it)";
  py::register_exception<PoolExhausted>(m, "PoolExhaustedError", PyExc_MemoryError);
  py::register_exception<Timeout>(m, "DeviceTimeoutError", PyExc_TimeoutError);
  bindings::bind_core(m);
  bindings::bind_pool(m);
  bindings::bind_runtime(m);
  bindings::bind_engine(m);
  bindings::bind_scheduler(m);
  bindings::bind_cuda(m);
}
