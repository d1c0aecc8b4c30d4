// UpdateEngine: CPU workers running AdamW job slices, and the job rows Python builds for it.
#include "common.h"

namespace hytrain {
namespace bindings {

std::vector<UpdateJob> to_jobs(const std::vector<JobRow>& rows) {
  std::vector<UpdateJob> jobs;
  jobs.reserve(rows.size());
  for (const JobRow& r : rows) {
    UpdateJob j;
    j.tensor.param = as_ptr<float>(std::get<0>(r));
    j.tensor.exp_avg = as_ptr<float>(std::get<1>(r));
    j.tensor.exp_avg_sq = as_ptr<float>(std::get<2>(r));
    j.tensor.max_exp_avg_sq = as_ptr<float>(std::get<3>(r));
    j.tensor.grad = as_ptr<const void>(std::get<4>(r));
    j.tensor.grad_dtype = static_cast<DType>(std::get<5>(r));
    j.tensor.param_copy = as_ptr<void>(std::get<6>(r));
    j.tensor.param_copy_dtype = static_cast<DType>(std::get<7>(r));
    j.tensor.numel = std::get<8>(r);
    j.tensor.param_out = as_ptr<float>(std::get<18>(r));
    j.tensor.exp_avg_out = as_ptr<float>(std::get<19>(r));
    j.tensor.exp_avg_sq_out = as_ptr<float>(std::get<20>(r));
    j.tensor.max_exp_avg_sq_out = as_ptr<float>(std::get<21>(r));
    j.config = make_config(std::get<14>(r), std::get<9>(r), std::get<10>(r), std::get<11>(r),
                           std::get<12>(r), std::get<13>(r), std::get<15>(r), std::get<16>(r),
                           std::get<17>(r));
    jobs.push_back(j);
  }
  return jobs;
}

void bind_engine(py::module_& m) {
  py::class_<UpdateEngine>(m, "UpdateEngine")
      .def(py::init([](int workers, int64_t slice_elems, const std::string& simd) {
             return std::make_unique<UpdateEngine>(workers, slice_elems, parse_simd_path(simd));
           }),
           py::arg("workers"), py::arg("slice_elems"), py::arg("simd") = "auto")
      .def("submit", [](UpdateEngine& e, int64_t block, const std::vector<JobRow>& rows) {
        const std::vector<UpdateJob> jobs = to_jobs(rows);
        py::gil_scoped_release release;
        e.submit(block, jobs);
      })
      .def("wait", &UpdateEngine::wait, py::call_guard<py::gil_scoped_release>())
      .def("wait_all", &UpdateEngine::wait_all, py::call_guard<py::gil_scoped_release>())
      .def("done", &UpdateEngine::done)
      .def("timing", [](UpdateEngine& e, int64_t block) {
        const BlockTiming t = e.timing(block);
        return std::make_tuple(t.submit_ns, t.start_ns, t.end_ns, t.elements);
      })
      .def_property_readonly("workers", &UpdateEngine::workers);
}

}  // namespace bindings
}  // namespace hytrain
