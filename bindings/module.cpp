// hytrain_native: the pybind11 seam. Glue only: arguments arrive already validated by python/hytrain
// (tensors become raw addresses, sizes and dtype codes there), native code re-checks cheap invariants
// and throws, and long native calls release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <tuple>

#include "hytrain/adamw.h"
#include "hytrain/cpu_features.h"
#include "hytrain/error.h"
#include "hytrain/ksplit.h"
#include "hytrain/membench.h"
#include "hytrain/pinned_pool.h"
#include "hytrain/update_engine.h"
#ifdef HYTRAIN_WITH_CUDA
#include "hytrain/cuda_adamw.h"
#include "hytrain/cuda_copy.h"
#include "hytrain/cuda_env.h"
#include "hytrain/cuda_grad_norm.h"
#include "hytrain/cuda_pipeline.h"
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using namespace hytrain;

namespace {

template <class T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// One block of pool memory, exposed to Python through the buffer protocol; torch.frombuffer keeps a
// reference to it, so the block returns to the pool only after the last tensor view is gone.
struct Allocation {
  Allocation(std::shared_ptr<PinnedPool> p, void* mem, std::size_t n)
      : pool(std::move(p)), ptr(mem), nbytes(n) {}
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  ~Allocation() { pool->free(ptr); }

  std::shared_ptr<PinnedPool> pool;
  void* ptr;
  std::size_t nbytes;
};

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

// A block index, or None for "none" (any index >= the block count).
py::object block_or_none(std::size_t j, std::size_t blocks) {
  return j < blocks ? py::object(py::int_(j)) : py::object(py::none());
}

py::dict stats_dict(const PoolStats& s) {
  py::dict d;
  d["capacity"] = s.capacity;
  d["reserved"] = s.reserved;
  d["in_use"] = s.in_use;
  d["peak_in_use"] = s.peak_in_use;
  d["slabs"] = s.slabs;
  d["allocations"] = s.allocations;
  d["largest_free"] = s.largest_free;
  return d;
}

std::vector<std::string> path_names(const std::vector<SimdPath>& paths) {
  std::vector<std::string> out;
  for (SimdPath p : paths) out.emplace_back(simd_path_name(p));
  return out;
}

bool cuda_available() {
#ifdef HYTRAIN_WITH_CUDA
  return cuda::available();
#else
  return false;
#endif
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
#ifdef HYTRAIN_WITH_CUDA
  d["cuda"] = cuda::runtime_version();
  d["cuda_architectures"] = HYTRAIN_CUDA_ARCHITECTURES;
  d["cuda_driver"] = cuda::driver_version();
  d["cuda_devices"] = cuda::device_names();
#else
  d["cuda"] = py::none();
  d["cuda_architectures"] = py::none();
  d["cuda_driver"] = py::none();
  d["cuda_devices"] = std::vector<std::string>{};
#endif
  return d;
}

std::shared_ptr<PinnedPool> make_pool(std::size_t capacity, std::size_t slab_bytes, bool pinned,
                                      std::size_t alignment) {
  std::unique_ptr<HostAllocator> alloc;
#ifdef HYTRAIN_WITH_CUDA
  if (pinned) alloc = cuda::make_pinned_allocator();
#else
  if (pinned) HYTRAIN_THROW("page-locked memory needs a build with CUDA");
#endif
  if (!alloc) alloc = make_page_aligned_allocator();
  return std::make_shared<PinnedPool>(std::move(alloc), capacity, slab_bytes, alignment);
}

// Job rows: (param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, grad_dtype, param_copy,
// param_copy_dtype, numel, lr, beta1, beta2, eps, weight_decay, step, decoupled, amsgrad,
// grad_scale, param_out, exp_avg_out, exp_avg_sq_out, max_exp_avg_sq_out), addresses as ints
// (outputs 0: in place), validated by python/hytrain.
using JobRow = std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t,
                          std::uintptr_t, int, std::uintptr_t, int, int64_t, double, double,
                          double, double, double, int64_t, bool, bool, double, std::uintptr_t,
                          std::uintptr_t, std::uintptr_t, std::uintptr_t>;

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

}  // namespace

PYBIND11_MODULE(hytrain_native, m) {
  m.doc() = "hytrain native core: CPU AdamW, pinned host pool, CUDA runtime (when built with it)";
  py::register_exception<PoolExhausted>(m, "PoolExhaustedError", PyExc_MemoryError);
  py::register_exception<Timeout>(m, "DeviceTimeoutError", PyExc_TimeoutError);

  m.def("build_info", &build_info, "What this binary was built with.");
  m.def("cuda_available", &cuda_available, "True when CUDA is compiled in and a GPU is usable.");
  m.def("is_page_locked", [](std::uintptr_t address) {
#ifdef HYTRAIN_WITH_CUDA
    return cuda::available() && cuda::is_page_locked(reinterpret_cast<const void*>(address));
#else
    (void)address;
    return false;
#endif
  }, "True when CUDA knows the address as page-locked host memory.");
  m.def("simd_paths_compiled", [] { return path_names(compiled_simd_paths()); });
  m.def("cpu_supports", [](const std::string& name) { return cpu_supports(parse_simd_path(name)); });
  m.def("best_simd_path", [] { return std::string(simd_path_name(best_simd_path())); });

  m.def(
      "adamw_step",
      [](std::uintptr_t param, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
         std::uintptr_t max_exp_avg_sq, std::uintptr_t grad, int grad_dtype,
         std::uintptr_t param_copy, int param_copy_dtype, int64_t numel, double lr, double beta1,
         double beta2, double eps, double weight_decay, int64_t step, bool decoupled, bool amsgrad,
         double grad_scale, int num_threads, const std::string& simd) {
        const SimdPath path = parse_simd_path(simd);
        AdamWTensor t;
        t.param = as_ptr<float>(param);
        t.exp_avg = as_ptr<float>(exp_avg);
        t.exp_avg_sq = as_ptr<float>(exp_avg_sq);
        t.max_exp_avg_sq = as_ptr<float>(max_exp_avg_sq);
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

#ifdef HYTRAIN_WITH_CUDA
  // Rows: (param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, weight, numel), addresses as ints.
  using Row = std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t,
                         std::uintptr_t, std::uintptr_t, int64_t>;
  py::class_<cuda::AdamWGroup>(m, "CudaAdamWGroup")
      .def(py::init([](const std::vector<Row>& rows, int grad_dtype, bool has_weight,
                       int weight_dtype, bool amsgrad, int device) {
             std::vector<cuda::AdamWTensorRef> refs;
             for (const Row& r : rows) {
               refs.push_back({as_ptr<float>(std::get<0>(r)), as_ptr<float>(std::get<1>(r)),
                               as_ptr<float>(std::get<2>(r)), as_ptr<float>(std::get<3>(r)),
                               as_ptr<const void>(std::get<4>(r)), as_ptr<void>(std::get<5>(r)),
                               std::get<6>(r)});
             }
             return std::make_unique<cuda::AdamWGroup>(refs, static_cast<DType>(grad_dtype),
                                                       has_weight, static_cast<DType>(weight_dtype),
                                                       amsgrad, device);
           }))
      .def("step",
           [](cuda::AdamWGroup& g, int64_t step, double lr, double beta1, double beta2, double eps,
              double weight_decay, bool decoupled, bool amsgrad, double grad_scale,
              std::uintptr_t grad_scale_ptr, std::uintptr_t found_inf_ptr, std::uintptr_t stream) {
             const AdamWConfig c = make_config(step, lr, beta1, beta2, eps, weight_decay, decoupled,
                                               amsgrad, grad_scale);
             g.step(c, as_ptr<const float>(grad_scale_ptr), as_ptr<const float>(found_inf_ptr),
                    stream);
           })
      .def_property_readonly("numel", &cuda::AdamWGroup::numel);

  // Rows: (address, numel, dtype code).
  using GradRow = std::tuple<std::uintptr_t, int64_t, int>;
  py::class_<cuda::GradNormGroup>(m, "CudaGradNormGroup")
      .def(py::init([](const std::vector<GradRow>& rows, int device) {
        std::vector<cuda::GradRef> refs;
        for (const GradRow& r : rows) {
          refs.push_back({as_ptr<const void>(std::get<0>(r)), std::get<1>(r),
                          static_cast<DType>(std::get<2>(r))});
        }
        return std::make_unique<cuda::GradNormGroup>(refs, device);
      }))
      .def("accumulate", [](cuda::GradNormGroup& g, std::uintptr_t sumsq, std::uintptr_t found_inf,
                            std::uintptr_t stream) {
        g.accumulate(as_ptr<float>(sumsq), as_ptr<float>(found_inf), stream);
      })
      .def_property_readonly("numel", &cuda::GradNormGroup::numel);
  m.def("cuda_clip_multiplier", [](std::uintptr_t sumsq, std::uintptr_t inv_scale,
                                   double host_inv_scale, double max_norm, std::uintptr_t out,
                                   int device, std::uintptr_t stream) {
    cuda::clip_multiplier(as_ptr<const float>(sumsq), as_ptr<const float>(inv_scale),
                          static_cast<float>(host_inv_scale), static_cast<float>(max_norm),
                          as_ptr<float>(out), device, stream);
  });

  py::class_<cuda::CopyStream>(m, "CudaCopyStream")
      .def(py::init([](int device, const std::string& direction, int priority, std::size_t ring) {
             HYTRAIN_CHECK(direction == "d2h" || direction == "h2d",
                           "direction must be 'd2h' or 'h2d', got '" + direction + "'");
             return std::make_unique<cuda::CopyStream>(
                 device,
                 direction == "d2h" ? cuda::CopyDirection::device_to_host
                                    : cuda::CopyDirection::host_to_device,
                 priority, ring);
           }),
           py::arg("device"), py::arg("direction"), py::arg("priority") = 0,
           py::arg("ring") = 1024)
      .def("copy", [](cuda::CopyStream& c, std::uintptr_t dst, std::uintptr_t src,
                      std::size_t bytes, std::optional<std::uintptr_t> after_stream) {
        return c.copy(as_ptr<void>(dst), as_ptr<const void>(src), bytes, after_stream);
      })
      .def("make_wait", &cuda::CopyStream::make_wait)
      .def("query", &cuda::CopyStream::query)
      .def("wait", &cuda::CopyStream::wait, py::arg("ticket"), py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("times_ms", &cuda::CopyStream::times_ms)
      .def_property_readonly("issued", &cuda::CopyStream::issued)
      .def_property_readonly("completed", &cuda::CopyStream::completed)
      .def_property_readonly("handle", &cuda::CopyStream::handle)
      .def_property_readonly("device", &cuda::CopyStream::device);
#endif

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
  m.def("steady_now_ns", &steady_now_ns, "The clock of UpdateEngine timings (ns).");

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

#ifdef HYTRAIN_WITH_CUDA
  // Copy rows: (dst, src, bytes).
  using CopyRow = std::tuple<std::uintptr_t, std::uintptr_t, std::size_t>;
  const auto to_copies = [](const std::vector<CopyRow>& rows) {
    std::vector<cuda::HostCopy> out;
    out.reserve(rows.size());
    for (const CopyRow& r : rows) {
      out.push_back({as_ptr<void>(std::get<0>(r)), as_ptr<const void>(std::get<1>(r)),
                     std::get<2>(r)});
    }
    return out;
  };
  py::class_<cuda::OffloadPipeline>(m, "OffloadPipeline")
      .def(py::init([](UpdateEngine& engine, int device, int d2h_priority, int h2d_priority) {
             return std::make_unique<cuda::OffloadPipeline>(engine, device, d2h_priority,
                                                            h2d_priority);
           }),
           py::arg("engine"), py::arg("device"), py::arg("d2h_priority") = 0,
           py::arg("h2d_priority") = 0, py::keep_alive<1, 2>())
      .def("stage", [to_copies](cuda::OffloadPipeline& p, int64_t block,
                                const std::vector<CopyRow>& d2h, const std::vector<JobRow>& rows,
                                const std::vector<CopyRow>& h2d, std::uintptr_t stream, bool hold) {
        const auto jobs = to_jobs(rows);
        const auto out = to_copies(d2h);
        const auto in = to_copies(h2d);
        py::gil_scoped_release release;
        p.stage(block, out, jobs, in, stream, hold);
      }, py::arg("block"), py::arg("d2h"), py::arg("jobs"), py::arg("h2d"), py::arg("stream"),
         py::arg("hold") = false)
      .def("release", &cuda::OffloadPipeline::release, py::arg("block"), py::arg("grad_scale"))
      .def("cancel", &cuda::OffloadPipeline::cancel, py::arg("block"))
      .def("wait_ready", &cuda::OffloadPipeline::wait_ready, py::arg("block"), py::arg("stream"),
           py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def("in_flight", &cuda::OffloadPipeline::in_flight)
      .def("last_pass", [](cuda::OffloadPipeline& p, int64_t block) {
        const cuda::BlockPass b = p.last_pass(block);
        py::dict d;
        d["d2h"] = std::make_tuple(b.d2h_first, b.d2h_last);
        d["h2d"] = std::make_tuple(b.h2d_first, b.h2d_last);
        d["d2h_bytes"] = b.d2h_bytes;
        d["h2d_bytes"] = b.h2d_bytes;
        d["update_ns"] = std::make_tuple(b.update.submit_ns, b.update.start_ns, b.update.end_ns);
        d["elements"] = b.update.elements;
        return d;
      })
      .def("copy_times_ms", [](cuda::OffloadPipeline& p, const std::string& direction,
                               std::uintptr_t ref_event, uint64_t ticket) {
        HYTRAIN_CHECK(direction == "d2h" || direction == "h2d", "direction must be d2h or h2d");
        return (direction == "d2h" ? p.d2h() : p.h2d()).times_since_ms(ref_event, ticket);
      })
      .def_property_readonly("d2h_issued", [](cuda::OffloadPipeline& p) { return p.d2h().issued(); })
      .def_property_readonly("d2h_completed",
                             [](cuda::OffloadPipeline& p) { return p.d2h().completed(); })
      .def_property_readonly("d2h_handle", [](cuda::OffloadPipeline& p) { return p.d2h().handle(); })
      .def_property_readonly("h2d_handle", [](cuda::OffloadPipeline& p) { return p.h2d().handle(); });
#endif

  py::class_<Allocation, std::shared_ptr<Allocation>>(m, "Allocation", py::buffer_protocol())
      .def_property_readonly("ptr", [](const Allocation& a) {
        return reinterpret_cast<std::uintptr_t>(a.ptr);
      })
      .def_property_readonly("nbytes", [](const Allocation& a) { return a.nbytes; })
      .def_buffer([](Allocation& a) {
        return py::buffer_info(a.ptr, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(a.nbytes)}, {1}, false);
      });

  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(m, "PinnedPool")
      .def(py::init(&make_pool), py::arg("capacity_bytes"), py::arg("slab_bytes"),
           py::arg("pinned"), py::arg("alignment") = PinnedPool::kDefaultAlignment)
      .def(
          "allocate",
          [](std::shared_ptr<PinnedPool> self, std::size_t nbytes) {
            void* p = self->allocate(nbytes);
            return std::make_shared<Allocation>(self, p, nbytes);
          },
          py::arg("nbytes"))
      .def("stats", [](const PinnedPool& p) { return stats_dict(p.stats()); })
      .def("trim", &PinnedPool::trim)
      .def_property_readonly("kind", &PinnedPool::kind)
      .def_property_readonly("page_locked", &PinnedPool::page_locked)
      .def_property_readonly("alignment", &PinnedPool::alignment);
}
