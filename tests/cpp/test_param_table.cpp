// ParamTable: parameters registered once and stepped by handle. The jobs it builds are run through
// the UpdateEngine (CPU path) and the OffloadPipeline over host copy queues (offload path: a plain
// pass, a speculative pass adopted, and one redone with a clip multiplier), and every result is
// compared bit for bit with a single-threaded adamw_step on copies of the same data. Bad
// registrations and steps are refused with hytrain::Error.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "check.h"
#include "host_copy_queue.h"
#include "hytrain/adamw.h"
#include "hytrain/dtype.h"
#include "hytrain/error.h"
#include "hytrain/offload_pipeline.h"
#include "hytrain/param_table.h"
#include "hytrain/update_engine.h"

using namespace hytrain;
using hytest::HostCopyQueue;

namespace {

const GroupHyper kGroups[2] = {{1e-3, 0.9, 0.999, 1e-8, 0.01}, {3e-4, 0.8, 0.99, 1e-6, 0.0}};

AdamWConfig config_of(const GroupHyper& g, int64_t step, double scale, bool amsgrad) {
  AdamWConfig c;
  c.lr = g.lr, c.beta1 = g.beta1, c.beta2 = g.beta2, c.eps = g.eps, c.weight_decay = g.weight_decay;
  c.step = step, c.grad_scale = scale, c.amsgrad = amsgrad;
  return c;
}

// A bf16 parameter: device weight and gradient, host state (two sets: state and shadow), staging for
// the gradient and the new weight, a shadow weight staging; the reference stepped by adamw_step.
struct Bf16Param {
  int64_t n;
  int group;
  bool amsgrad;
  std::vector<uint16_t> weight, grad, staging, shadow_copy;
  std::vector<float> s[4], sh[4];  // master, m, v, vmax
  float step = 0;
  std::vector<float> ref[4];
  std::vector<uint16_t> ref_weight;

  Bf16Param(int64_t n_, int group_, bool amsgrad_, std::mt19937& rng)
      : n(n_), group(group_), amsgrad(amsgrad_), weight(n), grad(n), staging(n), shadow_copy(n) {
    std::normal_distribution<float> normal;
    for (auto& v : s) v.assign(n, 0.0f);
    for (auto& v : sh) v.assign(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      weight[i] = f32_to_bf16(normal(rng) * 0.02f);
      s[0][i] = bf16_to_f32(weight[i]);
    }
    for (int k = 0; k < 4; ++k) ref[k] = s[k];
    ref_weight = weight;
  }
  ParamEntry entry() {
    ParamEntry e;
    e.state = {s[0].data(), s[1].data(), s[2].data(), amsgrad ? s[3].data() : nullptr};
    e.step = &step;
    e.grad = staging.data();
    e.grad_dtype = DType::bf16;
    e.copy = staging.data();
    e.numel = n;
    e.group = group;
    e.amsgrad = amsgrad;
    return e;
  }
  StateSlots shadow() { return {sh[0].data(), sh[1].data(), sh[2].data(), amsgrad ? sh[3].data() : nullptr}; }
  void new_gradient(std::mt19937& rng) {
    std::normal_distribution<float> normal;
    for (auto& g : grad) g = f32_to_bf16(normal(rng) * 1e-2f);
  }
  // The reference step: a fresh state set from `from`, the new weight, and what it writes.
  void reference(int64_t t, double scale) {
    std::vector<uint16_t> g = grad;
    AdamWTensor x{ref[0].data(), ref[1].data(), ref[2].data(), amsgrad ? ref[3].data() : nullptr, g.data(),
                  DType::bf16, g.data(), DType::bf16, n};
    adamw_step(x, config_of(kGroups[group], t, scale, amsgrad), 1, SimdPath::scalar);
    ref_weight = g;
  }
  bool state_matches(const std::vector<float>* set) const {
    bool ok = set[0] == ref[0] && set[1] == ref[1] && set[2] == ref[2];
    return ok && (!amsgrad || set[3] == ref[3]);
  }
};

TEST(registration_is_checked) {
  ParamTable t;
  float step = 0;
  std::vector<float> a(8), b(8), c(8);
  ParamEntry e;
  e.state = {a.data(), b.data(), c.data(), nullptr};
  e.step = &step;
  e.numel = 8;
  bool threw = false;
  try {
    ParamEntry bad = e;
    bad.state.exp_avg_sq = nullptr;
    t.add(bad);
  } catch (const Error&) { threw = true; }
  CHECK(threw);
  threw = false;
  try {
    ParamEntry bad = e;
    bad.amsgrad = true;  // without max_exp_avg_sq
    t.add(bad);
  } catch (const Error&) { threw = true; }
  CHECK(threw);
  threw = false;
  try {
    ParamEntry bad = e;
    bad.numel = -1;
    t.add(bad);
  } catch (const Error&) { threw = true; }
  CHECK(threw);
  CHECK(t.size() == 0);
  const int64_t h = t.add(e);
  CHECK(h == 0 && t.size() == 1);
  ParamEntry empty;  // an empty shard on this rank: registered, no buffers
  empty.step = &step;
  CHECK(t.add(empty) == 1);
  threw = false;
  try {
    t.entry(2);
  } catch (const Error&) { threw = true; }
  CHECK(threw);
  // No groups set yet: a step is refused before any counter moves.
  threw = false;
  std::vector<float> g(8, 1e-3f);
  try {
    t.cpu_jobs({h}, {{g.data(), a.data()}}, 1.0);
    t.advance({h});
  } catch (const Error&) { threw = true; }
  CHECK(threw);
  CHECK(step == 0);
  threw = false;
  try {
    t.set_groups({{-1.0, 0.9, 0.999, 1e-8, 0.0}});
  } catch (const Error&) { threw = true; }
  CHECK(threw);
  threw = false;
  try {
    t.adopt(h);  // no shadow
  } catch (const Error&) { threw = true; }
  CHECK(threw);
}

TEST(cpu_path_matches_adamw_step) {
  // fp32 parameters updated in place at their live addresses (which may change between steps), two
  // groups with different hyperparameters, amsgrad on one.
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  struct P {
    std::vector<float> w, m, v, vmax, grad;
    std::vector<float> rw, rm, rv, rvmax;
    float step = 0;
    int group;
    bool amsgrad;
  };
  std::vector<P> ps(3);
  const int64_t n = 1000;
  ParamTable table;
  table.set_groups({kGroups[0], kGroups[1]});
  std::vector<int64_t> handles;
  for (int i = 0; i < 3; ++i) {
    P& p = ps[i];
    p.group = i % 2;
    p.amsgrad = i == 2;
    p.w.resize(n), p.m.assign(n, 0), p.v.assign(n, 0), p.vmax.assign(n, 0), p.grad.resize(n);
    for (auto& x : p.w) x = normal(rng);
    p.rw = p.w, p.rm = p.m, p.rv = p.v, p.rvmax = p.vmax;
    ParamEntry e;
    e.state = {p.w.data(), p.m.data(), p.v.data(), p.amsgrad ? p.vmax.data() : nullptr};
    e.step = &p.step;
    e.numel = n;
    e.group = p.group;
    e.amsgrad = p.amsgrad;
    handles.push_back(table.add(e));
  }
  UpdateEngine engine(2, 1024, SimdPath::scalar);
  for (int t = 1; t <= 3; ++t) {
    std::vector<LiveAddresses> live;
    for (P& p : ps) {
      for (auto& g : p.grad) g = normal(rng) * 1e-2f;
      if (t == 3) {  // the weights get new storage: the live address is what is updated
        std::vector<float> moved = p.w;
        p.w.swap(moved);
      }
      live.push_back({p.grad.data(), p.w.data()});
    }
    engine.submit(t, table.cpu_jobs(handles, live, 0.5));
    table.advance(handles);
    engine.wait(t);
    for (P& p : ps) {
      AdamWTensor x{p.rw.data(), p.rm.data(), p.rv.data(), p.amsgrad ? p.rvmax.data() : nullptr, p.grad.data(),
                    DType::f32, nullptr, DType::bf16, n};
      adamw_step(x, config_of(kGroups[p.group], t, 0.5, p.amsgrad), 1, SimdPath::scalar);
      CHECK(p.step == static_cast<float>(t));
    }
  }
  for (P& p : ps) {
    // m, v were registered once; the weights were updated where they lived at each step.
    CHECK(p.m == p.rm);
    CHECK(p.v == p.rv);
    CHECK(p.w == p.rw);
    if (p.amsgrad) CHECK(p.vmax == p.rvmax);
  }
}

TEST(compact_states_step_with_the_handle_as_seed) {
  // bf16 m and v: the jobs carry the state dtype and the handle as the rounding seed, so a
  // parameter's update is the one adamw_step gives with that seed (and differs from another seed).
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  const int64_t n = 777;
  ParamTable table;
  table.set_groups({kGroups[0]});
  std::vector<float> w[2], grad(n), rw[2];
  std::vector<uint16_t> m[2], v[2], rm[2], rv[2];
  float steps[2] = {0, 0};
  std::vector<int64_t> handles;
  for (int i = 0; i < 2; ++i) {
    w[i].resize(n), m[i].assign(n, 0), v[i].assign(n, 0);
    for (auto& x : w[i]) x = i ? 0.0f : normal(rng);
    if (i) w[1] = w[0];
    rw[i] = w[i], rm[i] = m[i], rv[i] = v[i];
    ParamEntry e;
    e.state = {w[i].data(), m[i].data(), v[i].data(), nullptr};
    e.step = &steps[i];
    e.numel = n;
    e.state_dtype = DType::bf16;
    handles.push_back(table.add(e));
  }
  for (auto& g : grad) g = normal(rng) * 1e-2f;
  UpdateEngine engine(2, 1024);
  engine.submit(0, table.cpu_jobs(handles, {{grad.data(), w[0].data()}, {grad.data(), w[1].data()}}, 1.0));
  table.advance(handles);
  engine.wait(0);
  for (int i = 0; i < 2; ++i) {
    AdamWTensor x{rw[i].data(), rm[i].data(), rv[i].data(), nullptr, grad.data(), DType::f32, nullptr,
                  DType::bf16, n};
    x.state_dtype = DType::bf16;
    x.seed = static_cast<uint32_t>(handles[i]);
    adamw_step(x, config_of(kGroups[0], 1, 1.0, false), 1);
    CHECK(w[i] == rw[i] && m[i] == rm[i] && v[i] == rv[i]);
  }
  CHECK(w[0] == w[1] && m[0] != m[1]);  // same inputs, other seed: other roundings
  ParamEntry e;
  e.state = {w[0].data(), m[0].data(), v[0].data(), w[1].data()};
  e.step = &steps[0];
  e.numel = n;
  e.state_dtype = DType::bf16;
  e.amsgrad = true;
  CHECK_THROWS(table.add(e));
  e.amsgrad = false;
  e.state_dtype = DType::f16;
  CHECK_THROWS(table.add(e));
}

TEST(maximize_ascends_and_held_passes_take_the_hyperparameters_of_release) {
  // maximize: the update equals adamw_step on the negated gradient. A held pass released with
  // held_configs() uses the groups set after staging (an lr changed between backward and step()).
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  const int64_t n = 777;
  std::vector<float> w(n), m(n, 0), v(n, 0), g(n), rw, rm, rv, neg(n);
  for (auto& x : w) x = normal(rng);
  for (int64_t i = 0; i < n; ++i) g[i] = normal(rng) * 1e-2f, neg[i] = -g[i];
  rw = w, rm = m, rv = v;
  float step = 0;
  ParamTable table;
  GroupHyper up = kGroups[0];
  up.maximize = true;
  table.set_groups({up});
  ParamEntry e;
  e.state = {w.data(), m.data(), v.data(), nullptr};
  e.step = &step;
  e.numel = n;
  const std::vector<int64_t> handles{table.add(e)};
  UpdateEngine engine(2, 1024, SimdPath::scalar);
  const auto jobs = table.cpu_jobs(handles, {{g.data(), w.data()}}, 0.5);
  CHECK(jobs[0].config.grad_scale == -0.5);
  engine.submit(1, jobs);
  table.advance(handles);
  engine.wait(1);
  AdamWTensor x{rw.data(), rm.data(), rv.data(), nullptr, neg.data(), DType::f32, nullptr, DType::bf16, n};
  adamw_step(x, config_of(kGroups[0], 1, 0.5, false), 1, SimdPath::scalar);
  CHECK(w == rw);
  CHECK(m == rm);
  CHECK(v == rv);
  // The pass of step 1 was staged with lr 1e-3; the groups change before it is released.
  GroupHyper later = kGroups[1];
  later.maximize = true;
  table.set_groups({later});
  const auto configs = table.held_configs(handles, 0.25);
  CHECK(configs.size() == 1);
  CHECK(configs[0].lr == kGroups[1].lr && configs[0].beta1 == kGroups[1].beta1);
  CHECK(configs[0].step == 1);  // the counter already holds the held pass's step
  CHECK(configs[0].grad_scale == -0.25);
}

// A pipeline over host queues (scalar CPU updates), a table with both groups, and its bf16 parameters.
struct Rig {
  UpdateEngine engine{2, 1024, SimdPath::scalar};
  OffloadPipeline pipe{engine, std::make_unique<HostCopyQueue>(), std::make_unique<HostCopyQueue>()};
  ParamTable table;
  std::vector<std::unique_ptr<Bf16Param>> ps;
  std::vector<int64_t> handles;
  Rig() { table.set_groups({kGroups[0], kGroups[1]}); }
  void add(int64_t n, int group, bool amsgrad, std::mt19937& rng) {
    ps.push_back(std::make_unique<Bf16Param>(n, group, amsgrad, rng));
    handles.push_back(table.add(ps.back()->entry()));
  }
  std::vector<LiveAddresses> live() const {
    std::vector<LiveAddresses> out;
    for (auto& p : ps) out.push_back({p->grad.data(), p->weight.data()});
    return out;
  }
};

// Undo records: speculation in place. Step 1 speculates and is adopted (the state in place is the
// reference step); step 2 speculates and is redone with a multiplier (as if never speculated);
// step 3 speculates and is taken back (the state of step 2, bit for bit); then the refusals.
TEST(undo_records_speculate_in_place) {
  std::mt19937 rng(12);
  Rig rig;
  OffloadPipeline& pipe = rig.pipe;
  ParamTable& table = rig.table;
  auto& ps = rig.ps;
  auto& handles = rig.handles;
  struct Rec {
    std::vector<int8_t> d;
    std::vector<UndoEntry> esc;
    int64_t counters[2] = {0, 0};
    std::vector<uint16_t> copy;
  };
  std::vector<std::unique_ptr<Rec>> recs;
  for (int i = 0; i < 2; ++i) {
    rig.add(3001 + 17 * i, i, false, rng);
    const int64_t n = ps.back()->n;
    recs.push_back(std::make_unique<Rec>());
    Rec& r = *recs.back();
    r.d.assign(3 * n, 0), r.esc.resize(undo_capacity(n)), r.copy.assign(n, 0);
    UndoRecord u{r.d.data(), r.d.data() + n, r.d.data() + 2 * n, r.esc.data(), undo_capacity(n), r.counters};
    table.set_record(handles[i], u, r.copy.data());
    CHECK(table.has_record(handles[i]) && table.has_shadow(handles[i]) && !table.recorded(handles[i]));
  }
  auto live = [&] { return rig.live(); };
  auto speculate = [&] {
    for (auto& p : ps) p->new_gradient(rng);
    const PassPlan plan = table.offload_pass(handles, live(), 1.0, true, true, true);
    pipe.stage(0, plan.d2h, plan.jobs, plan.h2d, 0, false);
    table.advance(handles);
    for (std::size_t i = 0; i < handles.size(); ++i) table.note_recorded(handles[i], plan.jobs[i].config);
    pipe.wait_updated(0);  // finished on the CPU, the pass not consumed
    CHECK(pipe.in_flight(0));
    pipe.wait_ready(0, 0);
  };
  // Step 1, adopted.
  speculate();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    Bf16Param& p = *ps[i];
    p.reference(1, 1.0);
    CHECK(p.state_matches(p.s));  // in place
    CHECK(p.weight == p.ref_weight);
    CHECK(p.staging == p.grad);  // the gradient stays in staging: the weights went to the record's
    CHECK(table.record_complete(handles[i]));
    table.adopt(handles[i]);
    CHECK(!table.recorded(handles[i]));
  }
  // Step 2, redone with a multiplier: as if the step had been taken once, with it.
  speculate();
  const PassPlan redo = table.offload_pass(handles, live(), 0.25, false, false, false);
  pipe.stage(0, redo.d2h, redo.jobs, redo.h2d, 0, false);
  table.mark_resolved(handles);
  pipe.wait_ready(0, 0);
  for (auto& p : ps) {
    p->reference(2, 0.25);
    CHECK(p->state_matches(p->s));
    CHECK(p->weight == p->ref_weight);
    CHECK(p->step == 2.0f);
  }
  // Step 3, taken back: the state of step 2 (and a second undo does nothing).
  speculate();
  table.undo(handles, 2);
  table.undo(handles, 2);
  table.retreat(handles);
  for (auto& p : ps) {
    CHECK(p->state_matches(p->s));
    CHECK(p->step == 2.0f);
  }
  // Refused: a new pass, a shadow, a move or a drop while a speculative update is unresolved; an
  // adopt after an undo; a record for amsgrad or over the gradient staging.
  speculate();
  const auto refused = [](const std::function<void()>& f, const char* what) {
    bool threw = false;
    try {
      f();
    } catch (const Error& e) {
      threw = std::strstr(e.what(), what) != nullptr;
      if (!threw) std::printf("  message: %s\n", e.what());
    }
    CHECK(threw);
  };
  refused([&] { table.offload_pass(handles, live(), 1.0, false, true, true); }, "neither adopted nor taken back");
  refused([&] { table.clear_shadow(handles[0]); }, "neither adopted nor taken back");
  refused([&] { table.to_device(handles[0]); }, "neither adopted nor taken back");
  table.undo(handles);
  table.retreat(handles);
  refused([&] { table.adopt(handles[0]); }, "not complete");
  Bf16Param ams(64, 0, true, rng);
  const int64_t ha = table.add(ams.entry());
  Rec& r = *recs[0];
  UndoRecord u{r.d.data(), r.d.data(), r.d.data(), r.esc.data(), 64, r.counters};
  refused([&] { table.set_record(ha, u, r.copy.data()); }, "without amsgrad");
  refused([&] { table.set_record(handles[0], u, ps[0]->staging.data()); }, "is the gradient staging");
}

TEST(offload_passes_speculate_adopt_and_redo) {
  std::mt19937 rng(11);
  Rig rig;
  OffloadPipeline& pipe = rig.pipe;
  ParamTable& table = rig.table;
  auto& ps = rig.ps;
  auto& handles = rig.handles;
  for (int i = 0; i < 3; ++i) rig.add(3000 + 17 * i, i % 2, i == 1, rng);
  auto live = [&] { return rig.live(); };
  auto run = [&](const PassPlan& plan, bool hold = false, bool new_step = true) {
    pipe.stage(0, plan.d2h, plan.jobs, plan.h2d, 0, hold);
    if (new_step) table.advance(handles);
  };
  // Step 1: a plain pass, in place.
  for (auto& p : ps) p->new_gradient(rng);
  run(table.offload_pass(handles, live(), 1.0, false, true, true));
  pipe.wait_ready(0, 0);
  for (auto& p : ps) {
    p->reference(1, 1.0);
    CHECK(p->state_matches(p->s));
    CHECK(p->weight == p->ref_weight);
    CHECK(p->step == 1.0f);
  }
  // Step 2: speculative (shadows), adopted: the shadows become the state.
  for (size_t i = 0; i < ps.size(); ++i) table.set_shadow(handles[i], ps[i]->shadow(), ps[i]->shadow_copy.data());
  for (auto& p : ps) p->new_gradient(rng);
  const std::vector<std::vector<float>> before = {ps[0]->s[0], ps[0]->s[1], ps[0]->s[2]};
  run(table.offload_pass(handles, live(), 1.0, true, true, true));
  pipe.wait_ready(0, 0);
  CHECK(ps[0]->s[0] == before[0] && ps[0]->s[1] == before[1] && ps[0]->s[2] == before[2]);  // untouched
  for (size_t i = 0; i < ps.size(); ++i) {
    Bf16Param& p = *ps[i];
    p.reference(2, 1.0);
    CHECK(p.state_matches(p.sh));
    CHECK(p.weight == p.ref_weight);
    table.adopt(handles[i]);
    CHECK(table.entry(handles[i]).state.master == p.sh[0].data());
    CHECK(table.shadow(handles[i]).master == p.s[0].data());
  }
  // Step 3: speculative into the old state set, then clipping fires: redone from the (adopted)
  // state with the multiplier, the gradients still in staging, the counters not advanced again.
  for (auto& p : ps) p->new_gradient(rng);
  run(table.offload_pass(handles, live(), 1.0, true, true, true));
  pipe.wait_ready(0, 0);
  for (auto& p : ps) CHECK(p->step == 3.0f);
  // A redo must not read the weight staging the speculative pass wrote: bf16 staging was the
  // gradient, and a speculative pass writes its weights to the shadow staging, so it is intact.
  run(table.offload_pass(handles, live(), 0.25, false, false, false), false, false);
  pipe.wait_ready(0, 0);
  for (auto& p : ps) {
    p->reference(3, 0.25);
    CHECK(p->state_matches(p->sh));  // the adopted set is the state, updated in place
    CHECK(p->weight == p->ref_weight);
    CHECK(p->step == 3.0f);
  }
  // A held pass released with a multiplier.
  for (auto& p : ps) p->new_gradient(rng);
  run(table.offload_pass(handles, live(), 1.0, false, true, true), true);
  pipe.release(0, 0.5);
  pipe.wait_ready(0, 0);
  for (auto& p : ps) {
    p->reference(4, 0.5);
    CHECK(p->state_matches(p->sh));
    CHECK(p->weight == p->ref_weight);
  }
  // A held pass cancelled: the counters go back.
  for (auto& p : ps) p->new_gradient(rng);
  run(table.offload_pass(handles, live(), 1.0, false, true, true), true);
  pipe.cancel(0);
  table.retreat(handles);
  pipe.wait_ready(0, 0);
  for (auto& p : ps) {
    CHECK(p->state_matches(p->sh));  // nothing written
    CHECK(p->step == 4.0f);
  }
  // Speculating without shadows is refused before anything is staged or counted.
  table.clear_shadow(handles[2]);
  bool threw = false;
  try {
    table.offload_pass(handles, live(), 1.0, true, true, true);
  } catch (const Error&) { threw = true; }
  CHECK(threw);
  for (auto& p : ps) CHECK(p->step == 4.0f);
}

}  // namespace

// A parameter whose state is on the GPU has nothing on the host: no pass is built for it, and it
// gets state again (and is stepped from it, bit for bit) once placed back on the host.
TEST(placement_on_the_gpu_and_back) {
  std::mt19937 rng(23);
  ParamTable t;
  t.set_groups({kGroups[0], kGroups[1]});
  Bf16Param p(1000, 1, true, rng);
  ParamEntry e = p.entry();
  e.on_host = false;
  const int64_t h = t.add(e);
  CHECK(!t.on_host(h));
  CHECK(t.entry(h).state.master == nullptr && t.entry(h).grad == nullptr && t.entry(h).copy == nullptr);
  const auto refused = [&](auto&& f) {
    bool threw = false;
    try {
      f();
    } catch (const Error&) { threw = true; }
    return threw;
  };
  std::vector<uint16_t> dev_weight = p.weight;
  CHECK(refused([&] { t.offload_pass({h}, {{p.grad.data(), dev_weight.data()}}, 1.0, false, true, true); }));
  CHECK(refused([&] { t.cpu_jobs({h}, {{p.grad.data(), dev_weight.data()}}, 1.0); }));
  CHECK(refused([&] { t.set_shadow(h, p.shadow(), p.shadow_copy.data()); }));
  CHECK(p.step == 0);
  // Back on the host: the slots are checked (amsgrad needs max_exp_avg_sq), then a pass runs.
  CHECK(refused([&] { t.to_host(h, {p.s[0].data(), p.s[1].data(), p.s[2].data(), nullptr}, p.staging.data(),
                                p.staging.data()); }));
  CHECK(refused([&] { t.to_host(h, {p.s[0].data(), p.s[1].data(), p.s[2].data(), p.s[3].data()},
                                p.staging.data(), nullptr); }));
  CHECK(!t.on_host(h));
  t.to_host(h, {p.s[0].data(), p.s[1].data(), p.s[2].data(), p.s[3].data()}, p.staging.data(), p.staging.data());
  CHECK(t.on_host(h));
  p.new_gradient(rng);
  UpdateEngine engine(2, 1024, SimdPath::scalar);
  OffloadPipeline pipe(engine, std::make_unique<HostCopyQueue>(), std::make_unique<HostCopyQueue>());
  const PassPlan plan = t.offload_pass({h}, {{p.grad.data(), dev_weight.data()}}, 0.5, false, true, true);
  pipe.stage(0, plan.d2h, plan.jobs, plan.h2d, 0, false);
  t.advance({h});
  pipe.wait_ready(0, 0);
  p.reference(1, 0.5);
  CHECK(p.state_matches(p.s));
  CHECK(dev_weight == p.ref_weight);
  CHECK(p.step == 1);
  // To the GPU again: staging and shadows are forgotten; the step counter stays.
  t.set_shadow(h, p.shadow(), p.shadow_copy.data());
  t.to_device(h);
  CHECK(!t.has_shadow(h) && !t.on_host(h) && t.entry(h).step == &p.step);
}

int main() { return hytest::run_all(); }
