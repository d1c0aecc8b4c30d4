// ParamTable: every offloaded parameter's host-side buffers, registered once and stepped by handle.
//
// Python registers a parameter when its state is created: the fp32 master, m, v (and v_max with
// amsgrad), the step counter, the gradient staging buffer and where the new bf16/fp16 weight is
// written, the element count and dtypes, and its param-group index. A step then passes only what
// changes -- the groups' hyperparameters, the gradient multiplier, and for the CPU path the
// gradient and weight addresses of the moment -- and the table builds the UpdateEngine jobs.
//
// A parameter that speculates keeps either a shadow set, which the speculative update writes beside
// the state (with its own weight staging), adopt() swapping them; or an undo record (adamw.h, fp32
// states without amsgrad: about 5 bytes a parameter against 14), with which the speculative update
// writes the state in place and can be taken back (undo) or redone from the old state (redo).
//
// Step counters are the caller's (torch's per-parameter `step` tensors, fp32 as torch keeps them): a
// new step reads the counter, uses counter + 1 and writes it back. Everything runs on the
// caller's thread; the workers get plain jobs, never the table.
//
// What a step passes: the groups' hyperparameters when they changed (set_groups), the multiplier,
// and the live addresses of the gradients and weights (torch may give them new storage any step).
#pragma once

#include <cstdint>
#include <vector>

#include "hytrain/copy_queue.h"
#include "hytrain/dtype.h"
#include "hytrain/update_engine.h"

namespace hytrain {

// A set of state buffers of one parameter: the fp32 master, m and v in the entry's state dtype
// (max_exp_avg_sq, fp32, null without amsgrad).
struct StateSlots {
  float* master = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;
};

// What is registered once per parameter.
struct ParamEntry {
  StateSlots state;
  float* step = nullptr;            // the parameter's step counter (fp32, as torch keeps it)
  const void* grad = nullptr;       // gradient staging (offloaded CUDA parameters); may be null
  DType grad_dtype = DType::f32;    // the gradient's (and the training weights') dtype
  void* copy = nullptr;             // where the new bf16/fp16 weight goes (null: fp32, none)
  int64_t numel = 0;
  int group = 0;                    // index into the step's hyperparameter list
  bool amsgrad = false;
  // m and v: f32, bf16 (compact states, stochastically rounded with the handle as seed, so a
  // parameter rounds the same way on either side and in every pass) or q8 (8-bit blockwise, each
  // moment one buffer of q8_state_bytes(numel): codes, then block scales).
  DType state_dtype = DType::f32;
  // false: the state lives on the GPU (a resident block); the host holds none of it, so the entry
  // has no state slots or staging, and building a pass for it throws.
  bool on_host = true;
};

// One param group's hyperparameters for a step.
struct GroupHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
  bool maximize = false;  // ascend: the gradient enters with its sign flipped (a negative multiplier)
};

// Per-step addresses in the caller's tensors: the gradient, and the training weight (on the CPU
// path the fp32 weight is its own master and a bf16/fp16 weight is the copy written in place).
struct LiveAddresses {
  const void* grad = nullptr;
  void* weight = nullptr;
};

// An offloaded pass of some parameters: gradients to their staging, the updates, the new weights back.
struct PassPlan {
  std::vector<HostCopy> d2h;
  std::vector<UpdateJob> jobs;
  std::vector<HostCopy> h2d;
};

class ParamTable {
 public:
  // Registers a parameter; returns its handle. Throws hytrain::Error on an incomplete entry.
  int64_t add(const ParamEntry& e);
  std::size_t size() const { return entries_.size(); }
  const ParamEntry& entry(int64_t handle) const;

  // Placement. to_device: the state went to the GPU; its host buffers, staging and shadows are
  // gone (the entry keeps its step counter). to_host: the state is in these host buffers again,
  // with this staging (gradient, and the bf16/fp16 weight copy).
  void to_device(int64_t handle);
  void to_host(int64_t handle, const StateSlots& s, const void* grad, void* copy);
  bool on_host(int64_t handle) const;
  // Shadows for speculation: a second set of state buffers and their own weight staging.
  void set_shadow(int64_t handle, const StateSlots& s, void* copy);
  void clear_shadow(int64_t handle);
  bool has_shadow(int64_t handle) const;
  const StateSlots& shadow(int64_t handle) const;
  // An undo record instead (the parameter's shadow set is dropped): distances, escape list and
  // counters as adamw.h says, and the weight staging the speculative update writes (bf16/fp16).
  void set_record(int64_t handle, const UndoRecord& record, void* copy);
  bool has_record(int64_t handle) const;
  // A speculative pass with the record was staged (its config, for undo and redo), not yet resolved.
  void note_recorded(int64_t handle, const AdamWConfig& config);
  bool recorded(int64_t handle) const;
  // A redo of `handles` was staged, or a state loaded over them: their records are resolved.
  void mark_resolved(const std::vector<int64_t>& handles);
  // Once the speculative pass has finished: whether it updated every element (else it can only be
  // taken back or redone).
  bool record_complete(int64_t handle) const;
  // Takes the speculative updates of `handles` back (those with a record not resolved yet), on the
  // calling thread and `threads` OpenMP threads; their passes must have finished.
  void undo(const std::vector<int64_t>& handles, int threads = 0);
  // The speculative result is the step's: shadow and state change places (staging stays put); with
  // a record, the state in place is the result (it must be complete).
  void adopt(int64_t handle);

  // The param groups' hyperparameters, for the passes built from now on (set when they change).
  void set_groups(const std::vector<GroupHyper>& groups);
  const std::vector<GroupHyper>& groups() const { return groups_; }

  // CPU path: the jobs of a new step updating `handles` in place (step: counter + 1), reading the
  // gradients and writing the weights at `live` (one per handle), with the groups' hyperparameters
  // and the gradient multiplier. The counters move only by advance(), once the jobs are queued.
  std::vector<UpdateJob> cpu_jobs(const std::vector<int64_t>& handles, const std::vector<LiveAddresses>& live,
                                  double grad_scale) const;
  // Offload path: gradients from the device (`live[i].grad`) into staging, the jobs reading them
  // there, and each new weight from its staging (fp32: the master) to the device (`live[i].weight`);
  // with `stage_gradients` false the gradients are already in staging (a redo) and d2h is empty.
  // into_shadow: the new state and weights go to the shadows, or in place with the record (each
  // handle must have one or the other; note_recorded() once staged).
  // new_step: the jobs use counter + 1 (advance() once they are staged); else they redo the step the
  // counters already hold (a speculative pass done again with the step's multiplier; from a record
  // not resolved yet, the state is first taken back, and the record is resolved once staged).
  PassPlan offload_pass(const std::vector<int64_t>& handles, const std::vector<LiveAddresses>& live,
                        double grad_scale, bool into_shadow, bool stage_gradients, bool new_step) const;
  // The step counters of `handles` move to counter + 1 (a new step's jobs were queued); retreat()
  // takes it back (a held pass cancelled, a speculative one dropped).
  void advance(const std::vector<int64_t>& handles);
  // The configs of a held pass of `handles` (its step already counted) with the groups'
  // hyperparameters of now and the multiplier: what release() gives the pass, so that a change of
  // lr or any hyperparameter between the hand-off and step() is the one used, as in torch.
  std::vector<AdamWConfig> held_configs(const std::vector<int64_t>& handles, double grad_scale) const;
  void retreat(const std::vector<int64_t>& handles);

 private:
  struct Row {
    ParamEntry e;
    StateSlots shadow;
    void* shadow_copy = nullptr;
    bool has_shadow = false;
    UndoRecord record{};
    void* record_copy = nullptr;
    bool has_record = false;
    bool recorded = false;  // a speculative write in place, not resolved
    AdamWConfig record_config{};
    void drop_spares() {  // no shadow set, no record
      shadow = StateSlots{};
      shadow_copy = nullptr;
      has_shadow = false;
      record = UndoRecord{};
      record_copy = nullptr;
      has_record = false;
    }
  };
  void check_resolved(const Row& r, int64_t handle, const char* what) const;
  const Row& row(int64_t handle) const;
  Row& row(int64_t handle);
  UpdateJob job(int64_t handle, const GroupHyper& g, double grad_scale, int64_t step) const;
  const GroupHyper& group_of(const Row& r) const;
  std::vector<Row> entries_;
  std::vector<GroupHyper> groups_;
};

}  // namespace hytrain
