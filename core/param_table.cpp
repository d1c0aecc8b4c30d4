// ParamTable: registered parameters, stepped by handle (see param_table.h).
#include "hytrain/param_table.h"

#include <cmath>
#include <string>

#include "hytrain/adamw.h"
#include "hytrain/error.h"

namespace hytrain {

namespace {

void check_slots(const StateSlots& s, bool amsgrad, const char* what) {
  if (!s.master || !s.exp_avg || !s.exp_avg_sq || (amsgrad && !s.max_exp_avg_sq)) {
    HYTRAIN_THROW(std::string("ParamTable: ") + what + " needs master, exp_avg, exp_avg_sq" +
                  (amsgrad ? " and max_exp_avg_sq" : ""));
  }
}

}  // namespace

int64_t ParamTable::add(const ParamEntry& e) {
  // numel 0: a sharded parameter whose shard on this rank is empty; it is registered (handles stay
  // the parameters' indices) but never stepped.
  if (e.numel < 0) HYTRAIN_THROW("ParamTable: a parameter needs numel >= 0");
  if (e.numel > 0 && e.on_host) check_slots(e.state, e.amsgrad, "a parameter");
  if (!e.step) HYTRAIN_THROW("ParamTable: a parameter needs its step counter");
  if (e.group < 0) HYTRAIN_THROW("ParamTable: negative group index");
  if (e.state_dtype != DType::f32 && e.state_dtype != DType::bf16 && e.state_dtype != DType::q8) {
    HYTRAIN_THROW("ParamTable: states must be float32, bfloat16 or 8-bit");
  }
  if (e.state_dtype != DType::f32 && e.amsgrad) HYTRAIN_THROW("ParamTable: amsgrad needs float32 states");
  if (e.numel > 0 && e.on_host && e.grad_dtype != DType::f32 && !e.copy && e.grad) {
    HYTRAIN_THROW("ParamTable: a bf16/fp16 parameter with staging needs a weight staging buffer");
  }
  Row r;
  r.e = e;
  if (!e.on_host) {  // nothing on the host to point at
    r.e.state = StateSlots{};
    r.e.grad = nullptr;
    r.e.copy = nullptr;
  }
  entries_.push_back(r);
  return static_cast<int64_t>(entries_.size()) - 1;
}

const ParamTable::Row& ParamTable::row(int64_t handle) const {
  if (handle < 0 || static_cast<std::size_t>(handle) >= entries_.size()) {
    HYTRAIN_THROW("ParamTable: no parameter with handle " + std::to_string(handle));
  }
  return entries_[static_cast<std::size_t>(handle)];
}

ParamTable::Row& ParamTable::row(int64_t handle) {
  return const_cast<Row&>(static_cast<const ParamTable*>(this)->row(handle));
}

const ParamEntry& ParamTable::entry(int64_t handle) const { return row(handle).e; }

void ParamTable::check_resolved(const Row& r, int64_t handle, const char* what) const {
  if (r.recorded) {
    HYTRAIN_THROW("ParamTable: " + std::string(what) + " of handle " + std::to_string(handle) +
                  ", whose speculative update in place is neither adopted nor taken back");
  }
}

void ParamTable::to_device(int64_t handle) {
  Row& r = row(handle);
  check_resolved(r, handle, "a move to the GPU");
  r.drop_spares();
  r.e.state = StateSlots{};
  r.e.grad = nullptr;
  r.e.copy = nullptr;
  r.e.on_host = false;
}

void ParamTable::to_host(int64_t handle, const StateSlots& s, const void* grad, void* copy) {
  Row& r = row(handle);
  check_resolved(r, handle, "new host state");
  if (r.e.numel > 0) check_slots(s, r.e.amsgrad, "a state");
  if (r.e.numel > 0 && r.e.grad_dtype != DType::f32 && grad && !copy) {
    HYTRAIN_THROW("ParamTable: a bf16/fp16 parameter with staging needs a weight staging buffer");
  }
  r.e.state = s;
  r.e.grad = grad;
  r.e.copy = copy;
  r.e.on_host = true;
}

bool ParamTable::on_host(int64_t handle) const { return row(handle).e.on_host; }

void ParamTable::set_shadow(int64_t handle, const StateSlots& s, void* copy) {
  Row& r = row(handle);
  if (!r.e.on_host) HYTRAIN_THROW("ParamTable: a shadow for handle " + std::to_string(handle) + ", whose state is on the GPU");
  check_slots(s, r.e.amsgrad, "a shadow");
  if (r.e.grad_dtype != DType::f32 && !copy) {
    HYTRAIN_THROW("ParamTable: a bf16/fp16 parameter's shadow needs its own weight staging");
  }
  check_resolved(r, handle, "a shadow");
  r.drop_spares();
  r.shadow = s;
  r.shadow_copy = copy;
  r.has_shadow = true;
}

void ParamTable::clear_shadow(int64_t handle) {
  Row& r = row(handle);
  check_resolved(r, handle, "dropping the undo record");
  r.drop_spares();
}

bool ParamTable::has_shadow(int64_t handle) const {
  const Row& r = row(handle);
  return r.has_shadow || r.has_record;
}

void ParamTable::set_record(int64_t handle, const UndoRecord& rec, void* copy) {
  Row& r = row(handle);
  const std::string who = "ParamTable: an undo record for handle " + std::to_string(handle);
  if (!r.e.on_host) HYTRAIN_THROW(who + ", whose state is on the GPU");
  if (r.e.state_dtype != DType::f32 || r.e.amsgrad) HYTRAIN_THROW(who + ": it needs float32 states without amsgrad");
  if (!rec.dp || !rec.dm || !rec.dv || !rec.counters || rec.capacity < 0 || (rec.capacity > 0 && !rec.escapes)) {
    HYTRAIN_THROW(who + " needs its distances, escape list and counters");
  }
  if (r.e.numel > (int64_t{1} << 32)) HYTRAIN_THROW(who + ": more than 2^32 elements");
  if (r.e.grad_dtype != DType::f32 && !copy) HYTRAIN_THROW(who + ": a bf16/fp16 parameter needs its weight staging");
  if (copy && copy == r.e.grad) HYTRAIN_THROW(who + ": its weight staging is the gradient staging");
  check_resolved(r, handle, "a new undo record");
  r.drop_spares();
  r.record = rec;
  r.record_copy = copy;
  r.has_record = true;
}

bool ParamTable::has_record(int64_t handle) const { return row(handle).has_record; }

void ParamTable::note_recorded(int64_t handle, const AdamWConfig& config) {
  Row& r = row(handle);
  if (!r.has_record) HYTRAIN_THROW("ParamTable: handle " + std::to_string(handle) + " has no undo record");
  r.recorded = true;
  r.record_config = config;
}

bool ParamTable::recorded(int64_t handle) const { return row(handle).recorded; }

void ParamTable::mark_resolved(const std::vector<int64_t>& handles) {
  for (int64_t h : handles) row(h).recorded = false;
}

bool ParamTable::record_complete(int64_t handle) const {
  const Row& r = row(handle);
  return r.recorded && r.record.counters[1] == 0;
}

void ParamTable::undo(const std::vector<int64_t>& handles, int threads) {
  for (int64_t h : handles) {
    Row& r = row(h);
    if (!r.recorded) continue;
    AdamWTensor t = job(h, group_of(r), 1.0, r.record_config.step).tensor;  // the state and staging
    t.param_copy = nullptr;  // the weights are the caller's to restore
    t.record_mode = RecordMode::undo;
    t.record = r.record;
    t.record_config = r.record_config;
    adamw_step(t, r.record_config, threads);
    r.recorded = false;
  }
}

const StateSlots& ParamTable::shadow(int64_t handle) const {
  const Row& r = row(handle);
  if (!r.has_shadow) HYTRAIN_THROW("ParamTable: handle " + std::to_string(handle) + " has no shadow");
  return r.shadow;
}

void ParamTable::adopt(int64_t handle) {
  Row& r = row(handle);
  if (r.has_record) {
    if (!record_complete(handle)) {
      HYTRAIN_THROW("ParamTable: adopt() of handle " + std::to_string(handle) +
                    " whose speculative update is not complete (or not staged)");
    }
    r.recorded = false;
    return;
  }
  if (!r.has_shadow) HYTRAIN_THROW("ParamTable: adopt() of handle " + std::to_string(handle) + " without a shadow");
  // The staging buffers stay where they are: gradients land in the parameter's own, and the next
  // speculative update writes its weights to the shadow's again.
  std::swap(r.e.state, r.shadow);
}

void ParamTable::set_groups(const std::vector<GroupHyper>& groups) {
  for (std::size_t i = 0; i < groups.size(); ++i) {
    AdamWConfig c;
    c.lr = groups[i].lr;
    c.beta1 = groups[i].beta1;
    c.beta2 = groups[i].beta2;
    c.eps = groups[i].eps;
    c.weight_decay = groups[i].weight_decay;
    try {
      validate_adamw_config(c);
    } catch (const Error& e) {
      HYTRAIN_THROW("ParamTable: param group " + std::to_string(i) + ": " + e.what());
    }
  }
  groups_ = groups;
}

const GroupHyper& ParamTable::group_of(const Row& r) const {
  if (static_cast<std::size_t>(r.e.group) >= groups_.size()) {
    HYTRAIN_THROW("ParamTable: a parameter of group " + std::to_string(r.e.group) + " but " +
                  std::to_string(groups_.size()) + " group(s) are set");
  }
  return groups_[static_cast<std::size_t>(r.e.group)];
}

UpdateJob ParamTable::job(int64_t handle, const GroupHyper& g, double grad_scale, int64_t step) const {
  const Row& r = row(handle);
  if (!r.e.on_host && r.e.numel > 0) {
    HYTRAIN_THROW("ParamTable: a host update of a parameter whose state is on the GPU");
  }
  UpdateJob j;
  j.tensor.param = r.e.state.master;
  j.tensor.exp_avg = r.e.state.exp_avg;
  j.tensor.exp_avg_sq = r.e.state.exp_avg_sq;
  j.tensor.max_exp_avg_sq = r.e.state.max_exp_avg_sq;
  j.tensor.state_dtype = r.e.state_dtype;
  j.tensor.seed = static_cast<uint32_t>(handle);
  j.tensor.grad = r.e.grad;
  j.tensor.grad_dtype = r.e.grad_dtype;
  j.tensor.param_copy = r.e.grad_dtype != DType::f32 ? r.e.copy : nullptr;
  j.tensor.param_copy_dtype = r.e.grad_dtype != DType::f32 ? r.e.grad_dtype : DType::bf16;
  j.tensor.numel = r.e.numel;
  j.tensor.state_numel = r.e.numel;
  j.config.lr = g.lr;
  j.config.beta1 = g.beta1;
  j.config.beta2 = g.beta2;
  j.config.eps = g.eps;
  j.config.weight_decay = g.weight_decay;
  j.config.step = step;
  j.config.decoupled = true;
  j.config.amsgrad = r.e.amsgrad;
  j.config.grad_scale = g.maximize ? -grad_scale : grad_scale;
  return j;
}

namespace {

// The step a pass uses: the counter + 1 for a new step, the counter itself for a redo of the step it
// already counts.
int64_t pass_step(const float* counter, bool new_step) {
  const float s = *counter;
  if (!std::isfinite(s) || s < 0) HYTRAIN_THROW("ParamTable: step counter is " + std::to_string(s));
  const int64_t step = static_cast<int64_t>(s) + (new_step ? 1 : 0);
  if (step < 1) HYTRAIN_THROW("ParamTable: a redo before any step was counted");
  return step;
}

}  // namespace

std::vector<UpdateJob> ParamTable::cpu_jobs(const std::vector<int64_t>& handles,
                                            const std::vector<LiveAddresses>& live, double grad_scale) const {
  if (live.size() != handles.size()) HYTRAIN_THROW("ParamTable::cpu_jobs: one live address pair per handle");
  std::vector<UpdateJob> out;
  out.reserve(handles.size());
  for (std::size_t i = 0; i < handles.size(); ++i) {  // checked before any counter moves
    const Row& r = row(handles[i]);
    UpdateJob j = job(handles[i], group_of(r), grad_scale, pass_step(r.e.step, true));
    j.tensor.grad = live[i].grad;
    if (r.e.grad_dtype == DType::f32) {
      j.tensor.param = static_cast<float*>(live[i].weight);  // fp32 weights are their own master
    } else {
      j.tensor.param_copy = live[i].weight;
    }
    out.push_back(j);
  }
  return out;
}

std::vector<AdamWConfig> ParamTable::held_configs(const std::vector<int64_t>& handles,
                                                 double grad_scale) const {
  std::vector<AdamWConfig> out;
  out.reserve(handles.size());
  for (int64_t h : handles) {
    const Row& r = row(h);
    out.push_back(job(h, group_of(r), grad_scale, pass_step(r.e.step, false)).config);
  }
  return out;
}

void ParamTable::advance(const std::vector<int64_t>& handles) {
  for (int64_t h : handles) row(h);  // every handle valid before any counter moves
  for (int64_t h : handles) *row(h).e.step += 1.0f;
}

void ParamTable::retreat(const std::vector<int64_t>& handles) {
  for (int64_t h : handles) {
    if (!(*row(h).e.step >= 1.0f)) HYTRAIN_THROW("ParamTable: retreat() below step 0");
  }
  for (int64_t h : handles) *row(h).e.step -= 1.0f;
}

PassPlan ParamTable::offload_pass(const std::vector<int64_t>& handles, const std::vector<LiveAddresses>& live,
                                  double grad_scale, bool into_shadow, bool stage_gradients,
                                  bool new_step) const {
  if (live.size() != handles.size()) HYTRAIN_THROW("ParamTable::offload_pass: one live address pair per handle");
  PassPlan plan;
  plan.jobs.reserve(handles.size());
  plan.h2d.reserve(handles.size());
  for (std::size_t i = 0; i < handles.size(); ++i) {
    const Row& r = row(handles[i]);
    if (!r.e.grad) HYTRAIN_THROW("ParamTable: handle " + std::to_string(handles[i]) + " has no staging");
    if (into_shadow && !r.has_shadow && !r.has_record) {
      HYTRAIN_THROW("ParamTable: handle " + std::to_string(handles[i]) + " speculates without a shadow");
    }
    if (new_step) check_resolved(r, handles[i], "a new pass");
    const std::size_t bytes = static_cast<std::size_t>(r.e.numel * dtype_bytes(r.e.grad_dtype));
    if (stage_gradients) plan.d2h.push_back({const_cast<void*>(r.e.grad), live[i].grad, bytes});
    UpdateJob j = job(handles[i], group_of(r), grad_scale, pass_step(r.e.step, new_step));
    const float* new_master = r.e.state.master;
    void* new_copy = j.tensor.param_copy;
    if (r.has_record && (into_shadow || r.recorded)) {
      // In place, keeping the record (a speculative pass) or reading it back first (a redo).
      j.tensor.record_mode = into_shadow ? RecordMode::write : RecordMode::redo;
      j.tensor.record = r.record;
      j.tensor.record_config = r.record_config;
      if (r.e.grad_dtype != DType::f32) j.tensor.param_copy = r.record_copy;
      new_copy = j.tensor.param_copy;
      if (into_shadow) {  // counted afresh (the caller has waited for the block's last pass)
        r.record.counters[0] = 0;
        r.record.counters[1] = 0;
      }
    } else if (into_shadow) {  // the gradient is read from staging; everything new goes beside the state
      j.tensor.param_out = r.shadow.master;
      j.tensor.exp_avg_out = r.shadow.exp_avg;
      j.tensor.exp_avg_sq_out = r.shadow.exp_avg_sq;
      j.tensor.max_exp_avg_sq_out = r.shadow.max_exp_avg_sq;
      if (r.e.grad_dtype != DType::f32) j.tensor.param_copy = r.shadow_copy;
      new_master = r.shadow.master;
      new_copy = j.tensor.param_copy;
    }
    const void* src = r.e.grad_dtype != DType::f32 ? static_cast<const void*>(new_copy)
                                                     : static_cast<const void*>(new_master);
    // A null live weight: the block's training copy lives on the host (a streamed block), where
    // the update has just written it; nothing goes to the device.
    if (live[i].weight) plan.h2d.push_back({live[i].weight, src, bytes});
    plan.jobs.push_back(j);
  }
  return plan;
}

}  // namespace hytrain
