// The block runtime: ParamTable (parameters registered once, stepped by handle) and BlockRuntime (each
// block's phase and placement, and the plans that follow from them).
#include "common.h"

#include "hytrain/block_runtime.h"
#include "hytrain/param_table.h"

namespace hytrain {
namespace bindings {

std::vector<LiveAddresses> live_addresses(const std::vector<std::uintptr_t>& grads,
                                          const std::vector<std::uintptr_t>& weights) {
  HYTRAIN_CHECK(grads.size() == weights.size(), "one gradient and one weight address per handle");
  std::vector<LiveAddresses> out(grads.size());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    out[i].grad = as_ptr<const void>(grads[i]);
    out[i].weight = as_ptr<void>(weights[i]);
  }
  return out;
}

namespace {

StateSlots slots(std::uintptr_t master, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
                 std::uintptr_t max_exp_avg_sq) {
  return StateSlots{as_ptr<float>(master), as_ptr<void>(exp_avg), as_ptr<void>(exp_avg_sq),
                    as_ptr<void>(max_exp_avg_sq)};
}

}  // namespace

void bind_runtime(py::module_& m) {
  py::class_<GroupHyper>(m, "GroupHyper", "One param group's AdamW hyperparameters for a step.")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay, bool maximize) {
             return GroupHyper{lr, beta1, beta2, eps, weight_decay, maximize};
           }),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("maximize") = false)
      .def_readonly("maximize", &GroupHyper::maximize)
      .def_readonly("lr", &GroupHyper::lr)
      .def_readonly("beta1", &GroupHyper::beta1)
      .def_readonly("beta2", &GroupHyper::beta2)
      .def_readonly("eps", &GroupHyper::eps)
      .def_readonly("weight_decay", &GroupHyper::weight_decay);

  py::class_<ParamTable>(m, "ParamTable",
                         "Parameters' host buffers registered once (addresses validated by python/hytrain).")
      .def(py::init<>())
      .def("add",
           [](ParamTable& t, std::uintptr_t master, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
              std::uintptr_t max_exp_avg_sq, std::uintptr_t step, std::uintptr_t grad, int dtype,
              std::uintptr_t copy, int64_t numel, int group, bool amsgrad, bool on_host, int state_dtype) {
             ParamEntry e;
             e.on_host = on_host;
             e.state_dtype = static_cast<DType>(state_dtype);
             e.state = slots(master, exp_avg, exp_avg_sq, max_exp_avg_sq);
             e.step = as_ptr<float>(step);
             e.grad = as_ptr<const void>(grad);
             e.grad_dtype = static_cast<DType>(dtype);
             e.copy = as_ptr<void>(copy);
             e.numel = numel;
             e.group = group;
             e.amsgrad = amsgrad;
             return t.add(e);
           },
           py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("max_exp_avg_sq"),
           py::arg("step"), py::arg("grad"), py::arg("dtype"), py::arg("copy"), py::arg("numel"),
           py::arg("group"), py::arg("amsgrad"), py::arg("on_host") = true, py::arg("state_dtype") = 0,
           "Registers a parameter (on_host=False: its state is on the GPU; the host addresses are "
           "ignored; state_dtype: 0 float32, 1 bfloat16 m and v); returns its handle.")
      .def("__len__", &ParamTable::size)
      .def("to_device", &ParamTable::to_device, py::arg("handle"),
           "The parameter's state went to the GPU: its host slots, staging and shadows are dropped.")
      .def("to_host",
           [](ParamTable& t, int64_t h, std::uintptr_t master, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
              std::uintptr_t max_exp_avg_sq, std::uintptr_t grad, std::uintptr_t copy) {
             t.to_host(h, slots(master, exp_avg, exp_avg_sq, max_exp_avg_sq), as_ptr<const void>(grad),
                       as_ptr<void>(copy));
           },
           py::arg("handle"), py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
           py::arg("max_exp_avg_sq"), py::arg("grad"), py::arg("copy"),
           "The parameter's state is in these host buffers again, with this staging.")
      .def("on_host", &ParamTable::on_host, py::arg("handle"))
      .def("set_shadow",
           [](ParamTable& t, int64_t h, std::uintptr_t master, std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq,
              std::uintptr_t max_exp_avg_sq, std::uintptr_t copy) {
             t.set_shadow(h, slots(master, exp_avg, exp_avg_sq, max_exp_avg_sq), as_ptr<void>(copy));
           },
           py::arg("handle"), py::arg("master"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
           py::arg("max_exp_avg_sq"), py::arg("copy"))
      .def("clear_shadow", &ParamTable::clear_shadow, py::arg("handle"))
      .def("has_shadow", &ParamTable::has_shadow, py::arg("handle"))
      .def("adopt", &ParamTable::adopt, py::arg("handle"))
      .def("set_record",
           [](ParamTable& t, int64_t h, std::uintptr_t dp, std::uintptr_t dm, std::uintptr_t dv,
              std::uintptr_t escapes, int64_t capacity, std::uintptr_t counters, std::uintptr_t copy) {
             UndoRecord r;
             r.dp = as_ptr<int8_t>(dp);
             r.dm = as_ptr<int8_t>(dm);
             r.dv = as_ptr<int8_t>(dv);
             r.escapes = as_ptr<UndoEntry>(escapes);
             r.capacity = capacity;
             r.counters = as_ptr<int64_t>(counters);
             t.set_record(h, r, as_ptr<void>(copy));
           },
           py::arg("handle"), py::arg("dp"), py::arg("dm"), py::arg("dv"), py::arg("escapes"), py::arg("capacity"),
           py::arg("counters"), py::arg("copy"),
           "An undo record for the parameter's speculative updates (adamw.h): three int8 buffers of "
           "numel, `capacity` escape entries of 16 bytes, two int64 counters, and the weight staging.")
      .def("has_record", &ParamTable::has_record, py::arg("handle"))
      .def("recorded", &ParamTable::recorded, py::arg("handle"))
      .def("record_complete", &ParamTable::record_complete, py::arg("handle"))
      .def("undo", &ParamTable::undo, py::arg("handles"), py::arg("threads") = 0,
           py::call_guard<py::gil_scoped_release>(),
           "Takes back the speculative updates in place of `handles` (their passes have finished).")
      .def("mark_resolved", &ParamTable::mark_resolved, py::arg("handles"),
           "Drops the undo records of `handles` without taking them back (a state loaded over them).")
      .def("set_groups", &ParamTable::set_groups, py::arg("groups"))
      .def("advance", &ParamTable::advance, py::arg("handles"))
      .def("retreat", &ParamTable::retreat, py::arg("handles"))
      .def("state_addresses", [](const ParamTable& t, int64_t h) {
        const StateSlots& s = t.entry(h).state;
        return std::make_tuple(reinterpret_cast<std::uintptr_t>(s.master), reinterpret_cast<std::uintptr_t>(s.exp_avg),
                               reinterpret_cast<std::uintptr_t>(s.exp_avg_sq),
                               reinterpret_cast<std::uintptr_t>(s.max_exp_avg_sq));
      }, py::arg("handle"), "(master, exp_avg, exp_avg_sq, max_exp_avg_sq) addresses the next update reads.");

  py::enum_<BlockPhase>(m, "BlockPhase")
      .value("idle", BlockPhase::idle)
      .value("arriving", BlockPhase::arriving)
      .value("complete", BlockPhase::complete)
      .value("held", BlockPhase::held)
      .value("speculated", BlockPhase::speculated)
      .value("launched", BlockPhase::launched);
  py::enum_<Arrival>(m, "Arrival")
      .value("counted", Arrival::counted)
      .value("complete", Arrival::complete)
      .value("late", Arrival::late);

  py::class_<BlockRuntime>(m, "BlockRuntime", "Each block's phase and placement (see block_runtime.h).")
      .def(py::init<std::vector<int64_t>, int64_t>(), py::arg("params"), py::arg("accumulation_steps"))
      .def_property_readonly("blocks", &BlockRuntime::blocks)
      .def("phase", &BlockRuntime::phase, py::arg("block"))
      .def("arrivals", &BlockRuntime::arrivals, py::arg("block"))
      .def("any_arrived", &BlockRuntime::any_arrived)
      .def("any_submitted", &BlockRuntime::any_submitted)
      .def("submitted", &BlockRuntime::submitted, py::arg("block"))
      .def("in_phase", &BlockRuntime::in_phase, py::arg("phase"))
      .def("arrive", &BlockRuntime::arrive, py::arg("block"))
      .def("hold", &BlockRuntime::hold, py::arg("block"), py::arg("handed"))
      .def("speculate", &BlockRuntime::speculate, py::arg("block"), py::arg("handed"))
      .def("handed", &BlockRuntime::handed, py::arg("block"))
      .def("launch", &BlockRuntime::launch, py::arg("block"))
      .def("drop", &BlockRuntime::drop, py::arg("block"))
      .def("launch_order", &BlockRuntime::launch_order)
      .def("end_step", &BlockRuntime::end_step)
      .def("abandon_step", &BlockRuntime::abandon_step)
      .def("set_in_flight", &BlockRuntime::set_in_flight, py::arg("block"))
      .def("landed", &BlockRuntime::landed, py::arg("block"))
      .def("in_flight", &BlockRuntime::in_flight, py::arg("block"))
      .def("in_flight_blocks", &BlockRuntime::in_flight_blocks)
      .def("on_gpu", &BlockRuntime::on_gpu, py::arg("block"))
      .def("any_on_gpu", &BlockRuntime::any_on_gpu)
      .def("moving_up_later", &BlockRuntime::moving_up_later, py::arg("block"))
      .def("resident", &BlockRuntime::resident)
      .def("migrate", [](BlockRuntime& r, int64_t k) {
        const MigrationPlan p = r.migrate(k);
        return std::make_pair(p.up, p.down);
      }, py::arg("k"), "(blocks to move up now, blocks to move down now)")
      .def("moved_up", &BlockRuntime::moved_up, py::arg("block"))
      .def("moved_down", &BlockRuntime::moved_down, py::arg("block"))
      .def("take_up", &BlockRuntime::take_up)
      .def("plan_shadows", &BlockRuntime::plan_shadows, py::arg("lowest_start"), py::arg("has_shadow"),
           py::arg("shadow_bytes"), py::arg("room"),
           "The blocks, from the last down, that have or can allocate shadows within `room` bytes.");
}

}  // namespace bindings
}  // namespace hytrain
