// The offload pipeline: one GPU's blocks, from gradients on the device to updated weights back on it.
// It is host logic over two copy queues (copy_queue.h): cuda/ gives it CUDA copy streams, the C++
// tests give it host queues.
//
//   stage(block)   D2H of the block's gradients into pinned staging, ordered after the compute
//                  stream's queued work (the backward that produced them)
//   d2h poller     when the block's last gradient copy lands, its AdamW jobs go to the UpdateEngine
//                  (the listener runs on the copy stream's poller thread; nothing waits on the host)
//   engine         CPU workers update fp32 master, m and v in pinned memory and write the new
//                  bf16/fp16 weights into pinned staging
//   on_complete    a worker issues the block's H2D copies into the model's weights
//   wait_ready     the host waits until those copies are issued, then makes the compute stream wait
//                  for them on the device, just before the block's next forward
//
// Every failure of a block (a CUDA error on either copy stream, an update error) is kept with the
// block and thrown by wait_ready in the training thread; no stage ever throws on a helper thread.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "hytrain/copy_queue.h"
#include "hytrain/update_engine.h"

namespace hytrain {

// The copy tickets and CPU update times of a block's last completed pass through the pipeline.
struct BlockPass {
  uint64_t d2h_first = 0, d2h_last = 0;  // tickets on the D2H stream (0 when none)
  uint64_t h2d_first = 0, h2d_last = 0;  // tickets on the H2D stream
  BlockTiming update;                    // UpdateEngine timing (steady clock, ns)
  std::size_t d2h_bytes = 0, h2d_bytes = 0;
};

class OffloadPipeline {
 public:
  // The engine must outlive the pipeline; the pipeline installs the engine's on-complete hook and
  // owns the two copy queues (gradients device to host, weights host to device).
  OffloadPipeline(UpdateEngine& engine, std::unique_ptr<CopyQueue> d2h, std::unique_ptr<CopyQueue> h2d);
  ~OffloadPipeline();  // drains in-flight blocks (errors are dropped), then stops the copy queues
  OffloadPipeline(const OffloadPipeline&) = delete;
  OffloadPipeline& operator=(const OffloadPipeline&) = delete;

  // Starts a block's pass. compute_stream: the cudaStream_t whose queued work produced the gradients
  // (and last read the weights). If the block's previous pass was never consumed by wait_ready, the
  // host waits for it first and the new gradient copies wait for its weight copies on the device.
  // hold: the gradients are copied out now, but the update waits for release() (clipping: the
  // gradient multiplier is known only once every block's gradients exist).
  void stage(int64_t block, const std::vector<HostCopy>& d2h, const std::vector<UpdateJob>& jobs,
             const std::vector<HostCopy>& h2d, std::uintptr_t compute_stream, bool hold = false);
  // Lets a held block's update go, with every job's gradient multiplier set to grad_scale; it is
  // submitted at once when its gradients have landed, else when they land. Throws if the block has
  // no held pass.

  // Waits until the block's updated weights are on their way to the device and orders `stream` after
  // them. Returns at once for a block with no pass in flight. Throws hytrain::Error for a failed pass
  // (the block is then free to be staged again) and hytrain::Timeout after timeout_s (< 0: never).
  void wait_ready(int64_t block, std::uintptr_t stream, double timeout_s = -1.0);

  // Waits until the block's CPU update has finished (or failed) without consuming the pass: wait_ready
  // still follows, and reports a failure. Returns at once for a block with no pass in flight.
  void wait_updated(int64_t block);

  void release(int64_t block, double grad_scale);
  // The same with every job's hyperparameters replaced (one config per job, in staging order; the
  // multiplier is in the configs): the hyperparameters of step() time, not of the hand-off.
  void release(int64_t block, const std::vector<AdamWConfig>& configs);
  // Drops a held block's update (nothing is written to its states or weights); the pass ends when
  // its gradient copies have landed. Throws if the block has no held pass.
  void cancel(int64_t block);
  bool in_flight(int64_t block);
  // Whether the block's CPU update has finished (or failed), without waiting or consuming the pass:
  // true for a block with no pass in flight, false for a held one.
  bool updated(int64_t block);
  // The last pass of `block` that wait_ready consumed.
  BlockPass last_pass(int64_t block);

  CopyQueue& d2h() { return *d2h_; }
  CopyQueue& h2d() { return *h2d_; }

 private:
  enum class State { copying_out, landed, updating, ready, failed };  // landed: held on the host
  struct Pass {
    int64_t block = 0;
    State state = State::copying_out;
    bool hold = false;
    bool cancelled = false;
    std::vector<UpdateJob> jobs;
    std::vector<HostCopy> h2d;
    BlockPass info;
    std::string error;
  };

  // The engine's hook holds this; the destructor clears `owner`, waiting for a call under way.
  struct Gate {
    std::mutex mutex;
    OffloadPipeline* owner = nullptr;
  };

  void on_gradients_landed(uint64_t ticket);  // d2h poller thread
  void on_updated(int64_t block);             // engine worker thread
  void submit(const std::shared_ptr<Pass>& p);
  // With mutex_ held: removes the passes whose gradients are all on the host (in ticket order) and
  // returns those still to be submitted.
  std::vector<std::shared_ptr<Pass>> take_landed(uint64_t completed);
  void fail(Pass& p, const std::string& why);  // with mutex_ held
  std::string stream_failure();

  UpdateEngine& engine_;
  std::unique_ptr<CopyQueue> d2h_;
  std::unique_ptr<CopyQueue> h2d_;
  std::shared_ptr<Gate> gate_;
  std::mutex stage_mutex_;           // one stage() at a time
  std::mutex mutex_;                // guards everything below
  std::condition_variable changed_;  // some pass changed state
  std::unordered_map<int64_t, std::shared_ptr<Pass>> passes_;
  std::vector<std::shared_ptr<Pass>> copying_;  // passes in D2H, in ticket order
  std::unordered_map<int64_t, BlockPass> last_;
};

}  // namespace hytrain
