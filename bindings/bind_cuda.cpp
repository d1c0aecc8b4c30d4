// Everything that needs CUDA, in one place: GPU availability, page-locked host memory, the fused
// AdamW and gradient-norm groups, copy streams and the offload pipeline. A build without CUDA
// registers only what reports that there is no GPU.
#include <optional>
#include <string>

#include "common.h"
#include "hytrain/error.h"
#ifdef HYTRAIN_WITH_CUDA
#include "hytrain/copy_stream.h"
#include "hytrain/cuda_adamw.h"
#include "hytrain/cuda_env.h"
#include "hytrain/cuda_fingerprint.h"
#include "hytrain/cuda_grad_norm.h"
#endif
#include "hytrain/offload_pipeline.h"

namespace hytrain {
namespace bindings {

#ifdef HYTRAIN_WITH_CUDA

std::unique_ptr<HostAllocator> make_page_locked_allocator() { return cuda::make_pinned_allocator(); }

void add_cuda_build_info(py::dict& d) {
  d["cuda"] = cuda::runtime_version();
  d["cuda_architectures"] = HYTRAIN_CUDA_ARCHITECTURES;
  d["cuda_driver"] = cuda::driver_version();
  d["cuda_devices"] = cuda::device_names();
}

// The copy queues of a pipeline built here are CUDA copy streams.
cuda::CopyStream& cuda_stream(CopyQueue& q) { return static_cast<cuda::CopyStream&>(q); }

void bind_cuda(py::module_& m) {
  m.def("cuda_available", &cuda::available, "True when CUDA is compiled in and a GPU is usable.");
  m.def("is_page_locked", [](std::uintptr_t address) {
    return cuda::available() && cuda::is_page_locked(reinterpret_cast<const void*>(address));
  }, "True when CUDA knows the address as page-locked host memory.");

  // Rows: (param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, weight, numel, seed), addresses as ints.
  using Row = std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t,
                         std::uintptr_t, std::uintptr_t, int64_t, uint32_t>;
  py::class_<cuda::AdamWGroup>(m, "CudaAdamWGroup")
      .def(py::init([](const std::vector<Row>& rows, int grad_dtype, bool has_weight,
                       int weight_dtype, bool amsgrad, int device, int state_dtype) {
             std::vector<cuda::AdamWTensorRef> refs;
             for (const Row& r : rows) {
               refs.push_back({as_ptr<float>(std::get<0>(r)), as_ptr<void>(std::get<1>(r)),
                               as_ptr<void>(std::get<2>(r)), as_ptr<void>(std::get<3>(r)),
                               as_ptr<const void>(std::get<4>(r)), as_ptr<void>(std::get<5>(r)),
                               std::get<6>(r), std::get<7>(r)});
             }
             return std::make_unique<cuda::AdamWGroup>(refs, static_cast<DType>(grad_dtype),
                                                       has_weight, static_cast<DType>(weight_dtype),
                                                       amsgrad, device, static_cast<DType>(state_dtype));
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
  // Rows: (address, bytes).
  using SpanRow = std::tuple<std::uintptr_t, int64_t>;
  py::class_<cuda::FingerprintGroup>(m, "CudaFingerprintGroup")
      .def(py::init([](const std::vector<SpanRow>& rows, int device) {
        std::vector<cuda::SpanRef> spans;
        for (const SpanRow& r : rows) spans.push_back({as_ptr<const void>(std::get<0>(r)), std::get<1>(r)});
        return std::make_unique<cuda::FingerprintGroup>(spans, device);
      }))
      .def("compute", [](cuda::FingerprintGroup& g, std::uintptr_t out, std::uintptr_t stream) {
        g.compute(as_ptr<uint64_t>(out), stream);
      })
      .def_property_readonly("size", &cuda::FingerprintGroup::size);
  m.def("cuda_fingerprint_spans", [](const std::vector<SpanRow>& rows, std::uintptr_t out, int device,
                                     std::uintptr_t stream) {
    std::vector<cuda::SpanRef> spans;
    for (const SpanRow& r : rows) spans.push_back({as_ptr<const void>(std::get<0>(r)), std::get<1>(r)});
    cuda::fingerprint_spans(spans, as_ptr<uint64_t>(out), device, stream);
  }, py::arg("spans"), py::arg("out"), py::arg("device"), py::arg("stream"));
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
  py::class_<OffloadPipeline>(m, "OffloadPipeline")
      .def(py::init([](UpdateEngine& engine, int device, int d2h_priority, int h2d_priority) {
             return std::make_unique<OffloadPipeline>(
                 engine,
                 std::make_unique<cuda::CopyStream>(device, cuda::CopyDirection::device_to_host, d2h_priority),
                 std::make_unique<cuda::CopyStream>(device, cuda::CopyDirection::host_to_device, h2d_priority));
           }),
           py::arg("engine"), py::arg("device"), py::arg("d2h_priority") = 0,
           py::arg("h2d_priority") = 0, py::keep_alive<1, 2>())
      .def("stage", [](OffloadPipeline& p, int64_t block, ParamTable& table, const std::vector<int64_t>& handles,
                       const std::vector<std::uintptr_t>& grads, const std::vector<std::uintptr_t>& weights,
                       double grad_scale, std::uintptr_t stream, bool hold, bool speculative, bool redo,
                       bool count) {
        // A redo reads the gradients still in staging and recomputes the step the counters hold.
        if (speculative && p.in_flight(block)) {  // undo records are counted afresh by the new pass
          py::gil_scoped_release release;
          p.wait_ready(block, p.d2h().handle());
        }
        const PassPlan plan = table.offload_pass(handles, live_addresses(grads, weights), grad_scale,
                                                 speculative, !redo, !redo);
        {
          py::gil_scoped_release release;
          p.stage(block, plan.d2h, plan.jobs, plan.h2d, stream, hold);
        }
        if (!redo && count) table.advance(handles);  // a new step, counted once staged
        for (std::size_t i = 0; i < handles.size(); ++i) {  // undo records: written, or resolved
          if (!table.has_record(handles[i])) continue;
          if (speculative) table.note_recorded(handles[i], plan.jobs[i].config);
          else if (redo) table.mark_resolved({handles[i]});
        }
      }, py::arg("block"), py::arg("table"), py::arg("handles"), py::arg("grads"), py::arg("weights"),
         py::arg("grad_scale"), py::arg("stream"), py::arg("hold") = false, py::arg("speculative") = false,
         py::arg("redo") = false, py::arg("count") = true,
         "Starts a pass of the table's `handles`: gradients (device addresses) to staging, the update, "
         "the new weights to `weights` (device addresses). hold: the update waits for release(); "
         "speculative: the new state goes to the shadows, or in place with the undo record; redo: the "
         "gradients are already staged (from an undo record: the state is taken back first). A new "
         "pass updates with the counters + 1; count=False leaves the counters to the caller.")
      .def("release", [](OffloadPipeline& p, int64_t block, double grad_scale, const ParamTable* table,
                         const std::vector<int64_t>& handles) {
        if (table == nullptr) {
          p.release(block, grad_scale);
        } else {
          p.release(block, table->held_configs(handles, grad_scale));
        }
      }, py::arg("block"), py::arg("grad_scale"), py::arg("table") = nullptr,
         py::arg("handles") = std::vector<int64_t>{},
         "Lets a held pass update with `grad_scale`; with `table` and the pass's `handles`, with the "
         "table's hyperparameters of now.")
      .def("cancel", &OffloadPipeline::cancel, py::arg("block"))
      .def("wait_ready", &OffloadPipeline::wait_ready, py::arg("block"), py::arg("stream"),
           py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def("wait_updated", &OffloadPipeline::wait_updated, py::arg("block"),
           py::call_guard<py::gil_scoped_release>(),
           "Waits until the block's CPU update has finished, without consuming its pass.")
      .def("in_flight", &OffloadPipeline::in_flight)
      .def("updated", &OffloadPipeline::updated, py::arg("block"),
           "Whether the block's CPU update has finished (never waits; true with no pass in flight).")
      .def("last_pass", [](OffloadPipeline& p, int64_t block) {
        const BlockPass b = p.last_pass(block);
        py::dict d;
        d["d2h"] = std::make_tuple(b.d2h_first, b.d2h_last);
        d["h2d"] = std::make_tuple(b.h2d_first, b.h2d_last);
        d["d2h_bytes"] = b.d2h_bytes;
        d["h2d_bytes"] = b.h2d_bytes;
        d["update_ns"] = std::make_tuple(b.update.submit_ns, b.update.start_ns, b.update.end_ns);
        d["elements"] = b.update.elements;
        d["update_busy_ns"] = b.update.busy_ns;  // the workers' time inside its slices, summed
        d["update_workers"] = b.update.workers;
        return d;
      })
      .def("copy_times_ms", [](OffloadPipeline& p, const std::string& direction,
                               std::uintptr_t ref_event, uint64_t ticket) {
        HYTRAIN_CHECK(direction == "d2h" || direction == "h2d", "direction must be d2h or h2d");
        return cuda_stream(direction == "d2h" ? p.d2h() : p.h2d()).times_since_ms(ref_event, ticket);
      })
      .def_property_readonly("d2h_issued", [](OffloadPipeline& p) { return p.d2h().issued(); })
      .def_property_readonly("d2h_completed",
                             [](OffloadPipeline& p) { return p.d2h().completed(); })
      .def_property_readonly("d2h_handle", [](OffloadPipeline& p) { return cuda_stream(p.d2h()).handle(); })
      .def_property_readonly("h2d_handle", [](OffloadPipeline& p) { return cuda_stream(p.h2d()).handle(); });
}

#else

std::unique_ptr<HostAllocator> make_page_locked_allocator() {
  HYTRAIN_THROW("page-locked memory needs a build with CUDA");
}

void add_cuda_build_info(py::dict& d) {
  d["cuda"] = py::none();
  d["cuda_architectures"] = py::none();
  d["cuda_driver"] = py::none();
  d["cuda_devices"] = std::vector<std::string>{};
}

void bind_cuda(py::module_& m) {
  m.def("cuda_available", [] { return false; }, "True when CUDA is compiled in and a GPU is usable.");
  m.def("is_page_locked", [](std::uintptr_t) { return false; },
        "True when CUDA knows the address as page-locked host memory.");
}

#endif

}  // namespace bindings
}  // namespace hytrain
