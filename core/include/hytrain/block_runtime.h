// BlockRuntime: each block's phase within a step, where its states live, and the decisions that
// follow from them -- when a block's gradients are complete, the launch order of a step, which
// states move for a new k, and which blocks can speculate with which shadows.
//
// A block's phase in a step:
//
//   idle --arrive()--> arriving --(last gradient)--> complete
//   complete/arriving/idle --launch()--> launched        (updates under way or done)
//   complete --hold()--> held                             (gradients out, waiting for the multiplier)
//   complete --speculate()--> speculated                  (updated beside the state, checked at step())
//   held/speculated --launch()--> launched                (released, adopted, redone, restaged)
//   held/speculated --drop()--> idle                      (a step not taken)
//   end_step(): launched -> idle, arrivals reset; nothing may still be held or speculated
//
// Orthogonal to the phase: whether a pass is in flight (launched, and its new weights not yet waited
// for -- this outlives the step, into the next forward), and the placement: host (offloaded, updated
// by the CPU workers) or GPU (states resident, updated by the fused CUDA AdamW), with a move up that
// waits for the block's pass in flight.
//
// The runtime makes no copy and no update itself: the caller does what it decides, through the
// offload pipeline (copy queues and CPU workers) and the GPU update, and reports back. It is plain
// host logic, tested by ctest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace hytrain {

enum class BlockPhase : int { idle = 0, arriving, complete, held, speculated, launched };
const char* phase_name(BlockPhase p);

enum class Arrival : int {
  counted = 0,  // one more gradient of the block
  complete,     // the block's last gradient of the step (all micro-batches)
  late,         // a gradient after the block was handed off or launched in this step
};

// What a new k asks of the states (block indices, forward order).
struct MigrationPlan {
  std::vector<int64_t> up;    // move to the GPU now
  std::vector<int64_t> down;  // move to the host now
  // (blocks to move up once their pass in flight is waited for are kept by the runtime: take_up)
};

class BlockRuntime {
 public:
  // params: the parameters of each block (forward order); a block's gradients are complete after
  // params[b] * accumulation_steps arrivals.
  BlockRuntime(std::vector<int64_t> params, int64_t accumulation_steps);

  std::size_t blocks() const { return phase_.size(); }
  BlockPhase phase(int64_t b) const;
  int64_t arrivals(int64_t b) const;
  bool any_arrived() const;
  bool any_submitted() const;                      // held, speculated or launched in this step
  bool submitted(int64_t b) const;
  std::vector<int64_t> in_phase(BlockPhase p) const;

  // ---- a step ----
  Arrival arrive(int64_t b);
  // handed: the parameters (ParamTable handles) whose gradients were handed off with the block.
  void hold(int64_t b, std::vector<int64_t> handed);
  void speculate(int64_t b, std::vector<int64_t> handed);
  // What hold()/speculate() recorded for the block in this step (empty otherwise).
  const std::vector<int64_t>& handed(int64_t b) const;
  void launch(int64_t b);
  void drop(int64_t b);
  // Offloaded blocks first (their copies start before GPU updates queue on the compute stream), each
  // side in forward order.
  std::vector<int64_t> launch_order() const;
  void end_step();
  // Forgets a step that failed part way: arrivals reset, held/speculated/launched back to idle (the
  // caller has cancelled or dropped their passes). Passes in flight stay in flight.
  void abandon_step();

  // ---- passes in flight ----
  void set_in_flight(int64_t b);
  // The block's pass was waited for; returns whether its states are to move up now (see migrate).
  bool landed(int64_t b);
  bool in_flight(int64_t b) const;
  std::vector<int64_t> in_flight_blocks() const;

  // ---- placement ----
  bool on_gpu(int64_t b) const;
  bool any_on_gpu() const;
  bool moving_up_later(int64_t b) const;
  std::vector<int64_t> resident() const;
  // k: blocks < k GPU-resident. Blocks with a pass in flight move up after it (landed() says so).
  MigrationPlan migrate(int64_t k);
  void moved_up(int64_t b);
  void moved_down(int64_t b);
  // Blocks still waiting to move up whose pass is no longer in flight (a settle point).
  std::vector<int64_t> take_up();

  // ---- speculation ----
  // From the last block down to lowest_start: each offloaded block that has shadows, or can allocate
  // them within `room` bytes (shadow_bytes[b]); stops at the first GPU-resident block or the first
  // that cannot. has_shadow, shadow_bytes: per block.
  std::vector<int64_t> plan_shadows(int64_t lowest_start, const std::vector<bool>& has_shadow,
                                    const std::vector<int64_t>& shadow_bytes, int64_t room) const;

 private:
  void check(int64_t b) const;
  void expect(int64_t b, std::initializer_list<BlockPhase> from, const char* to) const;

  std::vector<int64_t> expected_;
  std::vector<int64_t> arrivals_;
  std::vector<BlockPhase> phase_;
  std::vector<bool> in_flight_;
  std::vector<bool> on_gpu_;
  std::vector<bool> up_later_;
  std::vector<std::vector<int64_t>> handed_;
};

}  // namespace hytrain
