// KSplitScheduler: the k-split solved from measured costs and the memory budget.
#include <limits>

#include "common.h"
#include "hytrain/ksplit.h"

namespace hytrain {
namespace bindings {

namespace {

// A block index, or None for "none" (any index >= the block count).
py::object block_or_none(std::size_t j, std::size_t blocks) {
  return j < blocks ? py::object(py::int_(j)) : py::object(py::none());
}

}  // namespace

void bind_scheduler(py::module_& m) {
  py::enum_<Phase>(m, "Phase")
      .value("forward", Phase::Forward)
      .value("backward", Phase::Backward)
      .value("d2h", Phase::D2H)
      .value("cpu", Phase::Cpu)
      .value("h2d", Phase::H2D)
      .value("gpu", Phase::Gpu);
  const auto prediction_dict = [](const Prediction& p) {
    py::dict d;
    d["k"] = p.k;
    d["speculative_from"] = block_or_none(p.speculative_from, p.ready.size());
    d["iter_s"] = p.iter_s;
    d["gpu_busy_s"] = p.gpu_busy_s;
    d["gpu_idle_s"] = p.gpu_idle_s;
    d["cpu_busy_s"] = p.cpu_busy_s;
    d["ready"] = p.ready;
    return d;
  };
  py::class_<IterationTimes::Wait>(m, "ForwardWait", "A forward hook's wait: its blocks, start and end (ms).")
      .def(py::init([](std::vector<int64_t> blocks, double before_ms, double after_ms) {
             return IterationTimes::Wait{std::move(blocks), before_ms, after_ms};
           }),
           py::arg("blocks"), py::arg("before_ms"), py::arg("after_ms"));
  py::class_<IterationTimes::Span>(m, "BlockSpan", "A block's copy or CPU update: start and end (s).")
      .def(py::init([](int64_t block, double start_s, double end_s) {
             return IterationTimes::Span{block, start_s, end_s};
           }),
           py::arg("block"), py::arg("start_s"), py::arg("end_s"));
  py::class_<IterationTimes>(m, "IterationTimes", "One measured iteration's raw times (see ksplit.h).")
      .def(py::init<>())
      .def_readwrite("waits", &IterationTimes::waits)
      .def_readwrite("backward_ms", &IterationTimes::backward_ms)
      .def_readwrite("gpu_update_s", &IterationTimes::gpu_update_s)
      .def_readwrite("d2h", &IterationTimes::d2h)
      .def_readwrite("h2d", &IterationTimes::h2d)
      .def_readwrite("cpu", &IterationTimes::cpu)
      .def_readwrite("launch_ms", &IterationTimes::launch_ms)
      .def_readwrite("next_start_ms", &IterationTimes::next_start_ms)
      .def_readwrite("deferred", &IterationTimes::deferred);
  m.def("attribute_iteration", [](const IterationTimes& t, KSplitScheduler* sink) {
    const IterationSummary s = attribute_iteration(t, sink);
    py::dict d;
    d["iter_gpu_s"] = s.iter_gpu_s;
    d["gpu_wait_s"] = s.gpu_wait_s;
    d["gpu_wait_frac"] = s.gpu_wait_frac;
    return d;
  }, py::arg("times"), py::arg("scheduler") = nullptr,
     "Charges an iteration's times to per-block phases and feeds them to `scheduler` (None: only the "
     "summary: iter_gpu_s, gpu_wait_s, gpu_wait_frac).");

  py::class_<KSplitScheduler>(m, "KSplitScheduler")
      .def(py::init([](std::vector<int64_t> numel, std::vector<int64_t> weight_bytes,
                       std::vector<int64_t> state_bytes, double smoothing, double hysteresis, int horizon,
                       int every, bool deferred) {
             KSplitConfig c;
             c.smoothing = smoothing;
             c.hysteresis = hysteresis;
             c.horizon = horizon;
             c.every = every;
             c.deferred = deferred;
             return std::make_unique<KSplitScheduler>(std::move(numel), std::move(weight_bytes),
                                                      std::move(state_bytes), c);
           }),
           py::arg("numel"), py::arg("weight_bytes"), py::arg("state_bytes"), py::arg("smoothing") = 0.3,
           py::arg("hysteresis") = 0.03, py::arg("horizon") = 50, py::arg("every") = 1,
           py::arg("deferred") = false)
      .def_property_readonly("blocks", &KSplitScheduler::blocks)
      .def_property("deferred", [](const KSplitScheduler& s) { return s.config().deferred; },
                    &KSplitScheduler::set_deferred)
      .def_property("overlap", [](const KSplitScheduler& s) { return s.config().overlap; },
                    &KSplitScheduler::set_overlap)
      .def_property("early_copies", [](const KSplitScheduler& s) { return s.config().early_copies; },
                    &KSplitScheduler::set_early_copies)
      .def_property("speculative_min",
                    [](const KSplitScheduler& s) { return block_or_none(s.config().speculative_min, s.blocks()); },
                    [](KSplitScheduler& s, py::object j) {
                      s.set_speculative_min(j.is_none() ? std::numeric_limits<std::size_t>::max()
                                                        : j.cast<std::size_t>());
                    },
                    "deferred mode: the first block that may be updated speculatively during "
                    "backward (predictions pick the best start from here); None: none")
      .def_property("speculative_fixed", [](const KSplitScheduler& s) { return s.config().speculative_fixed; },
                    &KSplitScheduler::set_speculative_fixed,
                    "predictions speculate from exactly max(k, speculative_min) (a fixed start)")
      .def_property("memory_budget", &KSplitScheduler::memory_budget, &KSplitScheduler::set_memory_budget)
      .def_property("min_k", &KSplitScheduler::min_k, &KSplitScheduler::set_min_k,
                    "the smallest k decide() returns: the host holds only the states of blocks >= it")
      .def("observe", &KSplitScheduler::observe, py::arg("block"), py::arg("phase"), py::arg("seconds"))
      .def("observe_rate", &KSplitScheduler::observe_rate, py::arg("phase"), py::arg("seconds_per_unit"))
      .def("observe_overhead", &KSplitScheduler::observe_overhead, py::arg("before_launch_s"),
           py::arg("after_launch_s") = 0.0)
      .def("max_k", &KSplitScheduler::max_k)
      .def("ready", &KSplitScheduler::ready)
      .def("costs", [](const KSplitScheduler& s) {
        std::vector<std::tuple<double, double, double, double, double, double, double>> out;
        for (const BlockCosts& c : s.costs()) out.emplace_back(c.fwd, c.bwd, c.d2h, c.cpu, c.h2d, c.gpu, c.migrate);
        return out;
      }, "Per-block (fwd, bwd, d2h, cpu, h2d, gpu, migrate) seconds as estimated now.")
      .def("predict", [prediction_dict](const KSplitScheduler& s, std::size_t k) {
        return prediction_dict(s.predict(k));
      }, py::arg("k"))
      .def("decide", &KSplitScheduler::decide, py::arg("current"))
      .def("last_prediction", [prediction_dict](const KSplitScheduler& s) {
        return prediction_dict(s.last_prediction());
      })
      .def_static("closed_form_k", &KSplitScheduler::closed_form_k, py::arg("L"), py::arg("t_bwd"),
                  py::arg("c"), py::arg("alpha"));

}

}  // namespace bindings
}  // namespace hytrain
