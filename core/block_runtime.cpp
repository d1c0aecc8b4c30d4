// BlockRuntime: block phases, placement and the plans that follow from them (see block_runtime.h).
#include "hytrain/block_runtime.h"

#include <string>

#include "hytrain/error.h"

namespace hytrain {

const char* phase_name(BlockPhase p) {
  switch (p) {
    case BlockPhase::idle: return "idle";
    case BlockPhase::arriving: return "arriving";
    case BlockPhase::complete: return "complete";
    case BlockPhase::held: return "held";
    case BlockPhase::speculated: return "speculated";
    case BlockPhase::launched: return "launched";
  }
  return "unknown";
}

BlockRuntime::BlockRuntime(std::vector<int64_t> params, int64_t accumulation_steps) {
  if (params.empty()) HYTRAIN_THROW("BlockRuntime: no blocks");
  if (accumulation_steps < 1) HYTRAIN_THROW("BlockRuntime: accumulation_steps must be >= 1");
  for (int64_t n : params) {
    if (n < 1) HYTRAIN_THROW("BlockRuntime: every block needs at least one parameter");
    expected_.push_back(n * accumulation_steps);
  }
  const std::size_t n = params.size();
  arrivals_.assign(n, 0);
  phase_.assign(n, BlockPhase::idle);
  in_flight_.assign(n, false);
  on_gpu_.assign(n, false);
  up_later_.assign(n, false);
  handed_.assign(n, {});
}

void BlockRuntime::check(int64_t b) const {
  if (b < 0 || static_cast<std::size_t>(b) >= phase_.size()) {
    HYTRAIN_THROW("BlockRuntime: no block " + std::to_string(b) + " (there are " +
                  std::to_string(phase_.size()) + ")");
  }
}

void BlockRuntime::expect(int64_t b, std::initializer_list<BlockPhase> from, const char* to) const {
  check(b);
  for (BlockPhase p : from) {
    if (phase_[static_cast<std::size_t>(b)] == p) return;
  }
  HYTRAIN_THROW(std::string("BlockRuntime: block ") + std::to_string(b) + " cannot go from " +
                phase_name(phase_[static_cast<std::size_t>(b)]) + " to " + to);
}

BlockPhase BlockRuntime::phase(int64_t b) const {
  check(b);
  return phase_[static_cast<std::size_t>(b)];
}

int64_t BlockRuntime::arrivals(int64_t b) const {
  check(b);
  return arrivals_[static_cast<std::size_t>(b)];
}

bool BlockRuntime::any_arrived() const {
  for (int64_t a : arrivals_) {
    if (a) return true;
  }
  return false;
}

bool BlockRuntime::submitted(int64_t b) const {
  const BlockPhase p = phase(b);
  return p == BlockPhase::held || p == BlockPhase::speculated || p == BlockPhase::launched;
}

bool BlockRuntime::any_submitted() const {
  for (std::size_t b = 0; b < phase_.size(); ++b) {
    if (submitted(static_cast<int64_t>(b))) return true;
  }
  return false;
}

std::vector<int64_t> BlockRuntime::in_phase(BlockPhase p) const {
  std::vector<int64_t> out;
  for (std::size_t b = 0; b < phase_.size(); ++b) {
    if (phase_[b] == p) out.push_back(static_cast<int64_t>(b));
  }
  return out;
}

Arrival BlockRuntime::arrive(int64_t b) {
  check(b);
  const std::size_t i = static_cast<std::size_t>(b);
  if (submitted(b)) return Arrival::late;
  ++arrivals_[i];
  if (arrivals_[i] >= expected_[i]) {
    phase_[i] = BlockPhase::complete;
    return Arrival::complete;
  }
  phase_[i] = BlockPhase::arriving;
  return Arrival::counted;
}

void BlockRuntime::hold(int64_t b, std::vector<int64_t> handed) {
  expect(b, {BlockPhase::complete}, "held");
  phase_[static_cast<std::size_t>(b)] = BlockPhase::held;
  handed_[static_cast<std::size_t>(b)] = std::move(handed);
}

void BlockRuntime::speculate(int64_t b, std::vector<int64_t> handed) {
  expect(b, {BlockPhase::complete}, "speculated");
  if (on_gpu_[static_cast<std::size_t>(b)]) {
    HYTRAIN_THROW("BlockRuntime: block " + std::to_string(b) + " is GPU-resident and cannot speculate");
  }
  phase_[static_cast<std::size_t>(b)] = BlockPhase::speculated;
  handed_[static_cast<std::size_t>(b)] = std::move(handed);
}

const std::vector<int64_t>& BlockRuntime::handed(int64_t b) const {
  check(b);
  return handed_[static_cast<std::size_t>(b)];
}

void BlockRuntime::launch(int64_t b) {
  expect(b, {BlockPhase::idle, BlockPhase::arriving, BlockPhase::complete, BlockPhase::held,
             BlockPhase::speculated},
         "launched");
  phase_[static_cast<std::size_t>(b)] = BlockPhase::launched;
}

void BlockRuntime::drop(int64_t b) {
  expect(b, {BlockPhase::held, BlockPhase::speculated}, "dropped");
  phase_[static_cast<std::size_t>(b)] = BlockPhase::idle;
  handed_[static_cast<std::size_t>(b)].clear();
}

std::vector<int64_t> BlockRuntime::launch_order() const {
  std::vector<int64_t> out;
  out.reserve(phase_.size());
  for (int side = 0; side < 2; ++side) {
    for (std::size_t b = 0; b < phase_.size(); ++b) {
      if (on_gpu_[b] == (side == 1)) out.push_back(static_cast<int64_t>(b));
    }
  }
  return out;
}

void BlockRuntime::end_step() {
  for (std::size_t b = 0; b < phase_.size(); ++b) {
    if (phase_[b] == BlockPhase::held || phase_[b] == BlockPhase::speculated) {
      HYTRAIN_THROW("BlockRuntime: the step ends with block " + std::to_string(b) + " still " +
                    phase_name(phase_[b]));
    }
  }
  abandon_step();
}

void BlockRuntime::abandon_step() {
  arrivals_.assign(arrivals_.size(), 0);
  phase_.assign(phase_.size(), BlockPhase::idle);
  for (auto& h : handed_) h.clear();
}

void BlockRuntime::set_in_flight(int64_t b) {
  check(b);
  in_flight_[static_cast<std::size_t>(b)] = true;
}

bool BlockRuntime::landed(int64_t b) {
  check(b);
  const std::size_t i = static_cast<std::size_t>(b);
  in_flight_[i] = false;
  return up_later_[i];
}

bool BlockRuntime::in_flight(int64_t b) const {
  check(b);
  return in_flight_[static_cast<std::size_t>(b)];
}

std::vector<int64_t> BlockRuntime::in_flight_blocks() const {
  std::vector<int64_t> out;
  for (std::size_t b = 0; b < in_flight_.size(); ++b) {
    if (in_flight_[b]) out.push_back(static_cast<int64_t>(b));
  }
  return out;
}

bool BlockRuntime::on_gpu(int64_t b) const {
  check(b);
  return on_gpu_[static_cast<std::size_t>(b)];
}

bool BlockRuntime::any_on_gpu() const {
  for (bool g : on_gpu_) {
    if (g) return true;
  }
  return false;
}

bool BlockRuntime::moving_up_later(int64_t b) const {
  check(b);
  return up_later_[static_cast<std::size_t>(b)];
}

std::vector<int64_t> BlockRuntime::resident() const {
  std::vector<int64_t> out;
  for (std::size_t b = 0; b < on_gpu_.size(); ++b) {
    if (on_gpu_[b]) out.push_back(static_cast<int64_t>(b));
  }
  return out;
}

MigrationPlan BlockRuntime::migrate(int64_t k) {
  if (k < 0 || static_cast<std::size_t>(k) > phase_.size()) {
    HYTRAIN_THROW("BlockRuntime: k=" + std::to_string(k) + " outside [0, " + std::to_string(phase_.size()) + "]");
  }
  MigrationPlan plan;
  for (std::size_t b = 0; b < phase_.size(); ++b) {
    const int64_t id = static_cast<int64_t>(b);
    if (id < k && !on_gpu_[b]) {
      if (in_flight_[b]) {
        up_later_[b] = true;
      } else {
        plan.up.push_back(id);
      }
    } else if (id >= k) {
      up_later_[b] = false;
      if (on_gpu_[b]) plan.down.push_back(id);
    }
  }
  return plan;
}

void BlockRuntime::moved_up(int64_t b) {
  check(b);
  const std::size_t i = static_cast<std::size_t>(b);
  if (in_flight_[i]) HYTRAIN_THROW("BlockRuntime: block " + std::to_string(b) + " moved up with a pass in flight");
  on_gpu_[i] = true;
  up_later_[i] = false;
}

void BlockRuntime::moved_down(int64_t b) {
  check(b);
  on_gpu_[static_cast<std::size_t>(b)] = false;
}

std::vector<int64_t> BlockRuntime::take_up() {
  std::vector<int64_t> out;
  for (std::size_t b = 0; b < up_later_.size(); ++b) {
    if (up_later_[b] && !in_flight_[b]) out.push_back(static_cast<int64_t>(b));
  }
  return out;
}

std::vector<int64_t> BlockRuntime::plan_shadows(int64_t lowest_start, const std::vector<bool>& has_shadow,
                                                const std::vector<int64_t>& shadow_bytes, int64_t room) const {
  const std::size_t n = phase_.size();
  if (has_shadow.size() != n || shadow_bytes.size() != n) {
    HYTRAIN_THROW("BlockRuntime::plan_shadows: every per-block list needs one entry per block");
  }
  if (lowest_start < 0) lowest_start = 0;
  std::vector<int64_t> plan;
  for (int64_t b = static_cast<int64_t>(n) - 1; b >= lowest_start; --b) {
    const std::size_t i = static_cast<std::size_t>(b);
    if (on_gpu_[i]) break;
    if (!has_shadow[i]) {
      room -= shadow_bytes[i];
      if (room < 0) break;
    }
    plan.push_back(b);
  }
  return plan;
}

}  // namespace hytrain
