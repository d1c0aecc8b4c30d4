// KSplitScheduler: chooses k, the number of leading blocks (forward order) whose AdamW update runs on
// the GPU with states resident there, so that the iteration -- backward, the updates on both sides,
// the copies, and the next forward waiting for each block's new weights -- is shortest.
//
// The runtime reports per-block measurements (seconds), smoothed by an exponential moving average.
// For each candidate k the scheduler simulates one steady-state iteration of the pipeline:
//
//   compute stream : backward L-1..0 (+ in-backward GPU updates of blocks < k) | step, up to its
//                    launch | (deferred mode: GPU updates 0..k-1) | the rest of the step and the
//                    training loop | forward 0..L-1, block j waiting for ready[j]
//                    (without overlap: the forward waits for every block)
//   D2H stream     : block j's gradients, after its backward (deferred: after the step's launch, or
//                    still after its backward with early copies; speculative blocks, deferred mode:
//                    after its backward, and their CPU updates start at once)
//   CPU workers    : block j's update once its gradients landed, one block after another (FIFO)
//   H2D stream     : block j's new weights once its update finished -> ready[j]
//
// and returns the k with the smallest simulated time whose resident states fit the GPU memory
// budget. k changes only when the gain beats the hysteresis margin plus the amortised cost of moving
// the states of the blocks that change side. The uniform case reduces to the closed form
//   k = (L - T_bwd / c) / (1 + alpha)                       (closed_form_k).
// Nothing here touches a device: it is plain arithmetic on measured numbers, tested on synthetic ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace hytrain {

// What a measurement is of. Sizes that scale it: parameters (Forward, Backward, Cpu, Gpu) or weight
// bytes (D2H, H2D); blocks never measured in a kind borrow the kind's pooled per-size rate.
enum class Phase : int { Forward = 0, Backward, D2H, Cpu, H2D, Gpu, Count };

struct KSplitConfig {
  double smoothing = 0.3;       // EWMA weight of a new measurement (0 < smoothing <= 1)
  double hysteresis = 0.03;     // a new k must be predicted this fraction faster than the current one
  int horizon = 50;             // iterations over which a migration's cost is amortised
  int every = 1;                // decide every N iterations (others keep k)
  bool deferred = false;        // updates start after backward (clipping, loss scaling) in forward order
  bool overlap = true;          // false: the next forward waits for every update (no overlap at all)
  bool early_copies = false;    // deferred mode: gradients still go to the host during backward
  // Deferred mode: offloaded blocks j >= speculative_min may be updated on the CPU as soon as their
  // gradients land (a speculative update, kept when the step's multiplier turns out to be 1); for
  // each k the scheduler picks the s >= speculative_min from which they are (StepShape).
  std::size_t speculative_min = std::numeric_limits<std::size_t>::max();
  bool speculative_fixed = false;  // speculation starts exactly at max(k, speculative_min), no search
};

// One block's estimated costs (seconds); what the simulation runs on.
struct BlockCosts {
  double fwd = 0, bwd = 0, d2h = 0, cpu = 0, h2d = 0, gpu = 0, migrate = 0;
};

// The shape of a step: when updates start, and the compute-stream time around the step's launch.
struct StepShape {
  bool deferred = false;      // updates start at the step's launch, in forward order
  bool overlap = true;        // false: the next forward waits for every update
  bool early_copies = false;  // deferred, with the gradients copied to the host during backward
  // Deferred mode: offloaded blocks j >= speculative_from are updated as soon as their gradients
  // land; the others at the launch. Speculating everything is not always best: the CPU then works
  // in backward order, and the first blocks the next forward needs come last.
  std::size_t speculative_from = std::numeric_limits<std::size_t>::max();
  double before_launch_s = 0; // end of backward -> the launch (norm, overflow check)
  double after_launch_s = 0;  // the launch -> the next forward, less the GPU updates (loop, data)
};

// A simulated iteration: its length and where the time went.
struct Prediction {
  std::size_t k = 0;
  std::size_t speculative_from = 0;  // as StepShape (blocks() or more: none)
  double iter_s = 0;        // backward start to the end of the next forward
  double gpu_busy_s = 0;    // compute-stream work: forward + backward + GPU updates + step overhead
  double gpu_idle_s = 0;    // iter_s - gpu_busy_s: the compute stream waiting for weights
  double cpu_busy_s = 0;    // sum of the CPU updates
  std::vector<double> ready;  // when each block's new weights are usable
};

// One measured iteration as raw times, before any is charged to a phase. Compute-stream times are in
// ms from the first forward wait's start; copy and CPU spans are in seconds on their own clocks.
struct IterationTimes {
  struct Wait {                  // a forward hook: the blocks it waited for, the wait's start and end
    std::vector<std::int64_t> blocks;
    double before_ms = 0, after_ms = 0;
  };
  struct Span {                  // a block's copy or CPU update: when it started and ended
    std::int64_t block = 0;
    double start_s = 0, end_s = 0;
  };
  std::vector<Wait> waits;                                     // in forward order
  std::vector<std::pair<std::int64_t, double>> backward_ms;    // block -> its gradients complete
  std::vector<std::pair<std::int64_t, double>> gpu_update_s;   // block -> its GPU AdamW's duration
  std::vector<Span> d2h, h2d, cpu;
  double launch_ms = std::numeric_limits<double>::quiet_NaN();  // the step's launch (NaN: none)
  double next_start_ms = 0;      // the next iteration's first wait: the end of this one
  bool deferred = false;         // the updates started at the step's launch
};

// What an iteration showed the user.
struct IterationSummary {
  double iter_gpu_s = 0;      // its length on the compute stream
  double gpu_wait_s = 0;      // time the compute stream stood waiting for updated weights
  double gpu_wait_frac = 0;
};

class KSplitScheduler;

// The cost model's measuring half: charges an iteration's times to per-block phases, as simulate()
// replays them, and feeds them to `sink` (null: only the summary).
//  * forward of a hook's blocks: from the end of its wait to the start of the next hook's wait (its
//    first block carries it, the others 0);
//  * backward of block j: from block j+1's gradients to block j's, less a GPU update run in between
//    (not deferred); the last block's forward + loss + backward is split 1:2 between the two;
//  * D2H, CPU update and H2D: service times in the order the blocks were served (a block queued
//    behind another is charged from the moment the resource freed up), so waiting is not a cost;
//  * step overhead: end of backward -> the launch, and the launch -> the next forward less the GPU
//    updates run in it (deferred).
IterationSummary attribute_iteration(const IterationTimes& t, KSplitScheduler* sink);

class KSplitScheduler {
 public:
  // numel: parameters per block; weight_bytes: bytes of the training copy (what crosses PCIe per
  // direction); state_bytes: GPU bytes a block needs when resident (master, m, v, gradient buffer).
  KSplitScheduler(std::vector<std::int64_t> numel, std::vector<std::int64_t> weight_bytes,
                  std::vector<std::int64_t> state_bytes, KSplitConfig config = {});

  std::size_t blocks() const { return numel_.size(); }
  const KSplitConfig& config() const { return config_; }
  void set_deferred(bool deferred) { config_.deferred = deferred; }
  void set_overlap(bool overlap) { config_.overlap = overlap; }
  void set_early_copies(bool early) { config_.early_copies = early; }
  void set_speculative_min(std::size_t j) { config_.speculative_min = j; }
  void set_speculative_fixed(bool fixed) { config_.speculative_fixed = fixed; }

  // One measurement of `phase` for `block`, in seconds (>= 0, finite).
  void observe(std::size_t block, Phase phase, double seconds);
  // A per-size rate for a phase, without a block (e.g. a start-up probe of the GPU AdamW): seconds
  // per parameter (Forward/Backward/Cpu/Gpu) or per byte (D2H/H2D).
  void observe_rate(Phase phase, double seconds_per_unit);
  // Compute-stream time from the end of backward to the step's launch, and from the launch to the
  // next forward less the GPU updates in between.
  void observe_overhead(double before_launch_s, double after_launch_s = 0);
  // The step shape the predictions use (flags from the config, overheads as measured).
  StepShape shape() const;
  // GPU bytes available for resident states; negative means unlimited.
  void set_memory_budget(double bytes) { budget_ = bytes; }
  double memory_budget() const { return budget_; }

  // The smallest k allowed: the blocks from it on are all the host can hold (0: no floor).
  void set_min_k(std::size_t k) { min_k_ = k; }
  std::size_t min_k() const { return min_k_; }
  // The largest k whose resident states fit the budget.
  std::size_t max_k() const;
  // Whether every cost the simulation needs is known (each phase measured or rated somewhere).
  bool ready() const;
  // Per-block costs as estimated now (measured EWMA, else pooled rate x size, else 0 for copies).
  std::vector<BlockCosts> costs() const;
  // The simulated iteration for a given k (throws if k > blocks()), with the best speculative_from
  // the config allows (or its fixed start).
  Prediction predict(std::size_t k) const;
  static Prediction simulate(const std::vector<BlockCosts>& costs, std::size_t k, const StepShape& shape);

  // The k for the next iteration, given the k in use now. Applies `every`, the memory limit, the
  // host's floor (min_k, which wins over the memory limit: those states have nowhere else to go),
  // and hysteresis; returns `current` unchanged while ready() is false.
  std::size_t decide(std::size_t current);
  // The prediction behind the last decide() (iter_s 0 before any).
  const Prediction& last_prediction() const { return last_; }

  // Seed 002's balance for L uniform blocks: T_bwd + alpha*k*c = (L-k)*c, clamped to [0, L].
  static double closed_form_k(double L, double t_bwd, double c, double alpha);

 private:
  double estimate(std::size_t block, Phase phase) const;
  Prediction best_for(const std::vector<BlockCosts>& costs, std::size_t k, StepShape shape) const;
  double size_of(std::size_t block, Phase phase) const;

  std::vector<std::int64_t> numel_, weight_bytes_, state_bytes_;
  KSplitConfig config_;
  static constexpr int kPhases = static_cast<int>(Phase::Count);
  std::vector<double> ewma_;         // blocks x phases; NaN = never measured
  double rate_[kPhases];             // pooled seconds per unit; NaN = unknown
  double before_launch_ = 0, after_launch_ = 0;
  bool overhead_seen_ = false;
  double budget_ = -1;
  std::size_t min_k_ = 0;
  std::int64_t iterations_ = 0;
  Prediction last_;
};

}  // namespace hytrain
