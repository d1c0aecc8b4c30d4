// UpdateEngine: CPU workers running AdamW job slices, built from the ParamTable.
#include "common.h"

namespace hytrain {
namespace bindings {

void bind_engine(py::module_& m) {
  py::class_<UpdateEngine>(m, "UpdateEngine")
      .def(py::init([](int workers, int64_t slice_elems, const std::string& simd) {
             return std::make_unique<UpdateEngine>(workers, slice_elems, parse_simd_path(simd));
           }),
           py::arg("workers"), py::arg("slice_elems"), py::arg("simd") = "auto")
      .def("submit", [](UpdateEngine& e, int64_t block, ParamTable& table, const std::vector<int64_t>& handles,
                        const std::vector<std::uintptr_t>& grads, const std::vector<std::uintptr_t>& weights,
                        double grad_scale) {
        const std::vector<UpdateJob> jobs = table.cpu_jobs(handles, live_addresses(grads, weights), grad_scale);
        {
          py::gil_scoped_release release;
          e.submit(block, jobs);
        }
        table.advance(handles);  // counted once queued
      }, py::arg("block"), py::arg("table"), py::arg("handles"), py::arg("grads"), py::arg("weights"),
         py::arg("grad_scale"),
         "Updates the table's `handles` in place on the CPU (gradients and weights at the given "
         "addresses), advancing their steps.")
      .def("wait", &UpdateEngine::wait, py::call_guard<py::gil_scoped_release>())
      .def("wait_all", &UpdateEngine::wait_all, py::call_guard<py::gil_scoped_release>())
      // The GIL stays held: no other Python thread submits while it waits (the workers never take it).
      .def("quiesce", &UpdateEngine::quiesce,
           "Waits until every block submitted so far has completed (errors stay for wait()); called "
           "before fork() so that the child inherits no update half done.")
      .def("done", &UpdateEngine::done)
      .def("timing", [](UpdateEngine& e, int64_t block) {
        const BlockTiming t = e.timing(block);
        return std::make_tuple(t.submit_ns, t.start_ns, t.end_ns, t.elements, t.busy_ns, t.workers);
      })
      .def_property_readonly("workers", &UpdateEngine::workers)
      .def_property_readonly("inherited", &UpdateEngine::inherited,
                             "Whether the engine was made in a process this one was forked from (its "
                             "workers are started again here at its first use).");
  m.def("fork_generation", &fork_generation,
        "How many fork()s lie between the process that loaded the module and this one.");
}

}  // namespace bindings
}  // namespace hytrain
