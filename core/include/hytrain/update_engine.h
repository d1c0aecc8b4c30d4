// CPU AdamW workers fed by the lock-free queue: the host half of the pipeline.
//
// A caller submits a block (a list of tensors, each with its own AdamW hyperparameters); the engine
// cuts it into slices of at most `slice_elems` elements, pushes the slices into an MpmcQueue, and
// `workers` threads pop and update them, single-threaded each (AdamW is elementwise, so slices of one
// tensor are independent; a big embedding spreads over every worker). When a block's last slice is
// done the block is complete: waiters wake and an optional callback runs (the hook that starts the
// block's H2D copy). Each block's submit, first-start and end times (steady clock, ns) are kept for
// traces and the scheduler.
//
// Errors never escape a worker: the first one of a block is kept and rethrown by wait(block).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "hytrain/adamw.h"
#include "hytrain/mpmc_queue.h"

namespace hytrain {

struct UpdateJob {
  AdamWTensor tensor;
  AdamWConfig config;
};

struct BlockTiming {
  int64_t submit_ns = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int64_t elements = 0;
};

int64_t steady_now_ns();

class UpdateEngine {
 public:
  // Slices the lock-free queue holds by default. submit() never blocks: slices that do not fit wait,
  // in order, in an overflow list that the workers move into the queue as it drains.
  static constexpr std::size_t kQueueSlices = std::size_t(1) << 18;

  UpdateEngine(int workers, int64_t slice_elems, SimdPath path = SimdPath::automatic,
               std::size_t queue_slices = kQueueSlices);
  ~UpdateEngine();  // finishes queued work (overflow included), then joins the workers
  UpdateEngine(const UpdateEngine&) = delete;
  UpdateEngine& operator=(const UpdateEngine&) = delete;

  // Queues a block's jobs, without blocking; blocks are updated in submission order. The memory
  // they point to must stay valid until the block completes. Throws (queuing nothing) on invalid
  // jobs or when the block is still in flight.
  void submit(int64_t block, const std::vector<UpdateJob>& jobs);
  // Blocks until the block completes (returns at once for a block never submitted); rethrows its
  // first error.
  void wait(int64_t block);
  void wait_all();
  bool done(int64_t block);
  BlockTiming timing(int64_t block);
  // Called on a worker thread when a block completes (error or not); it must not throw. It may be
  // replaced at any time (a call already under way finishes with the old function).
  void set_on_complete(std::function<void(int64_t)> fn);

  int workers() const { return static_cast<int>(threads_.size()); }

 private:
  struct Block;
  struct Slice {
    Block* block;
    int job;
    int64_t begin, end;
  };
  struct Block {
    std::vector<UpdateJob> jobs;
    std::vector<Slice> slices;
    std::atomic<int64_t> remaining{0};
    std::atomic<int64_t> start_ns{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;  // guards error
    std::string error;       // the first failure's message
    BlockTiming timing;
    bool complete = true;
    int64_t id = 0;
  };

  void run_worker();
  void finish(Block& b);
  void refill();  // moves overflow slices into the queue while they fit (takes overflow_mutex_)

  MpmcQueue<Slice*> queue_;
  std::mutex overflow_mutex_;            // guards overflow_
  std::deque<Slice*> overflow_;          // slices behind a full queue, in submission order
  std::atomic<std::size_t> pending_{0};  // overflow_.size(), for the workers' lock-free check
  int64_t slice_elems_;
  SimdPath path_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;  // guards blocks_ (the map) and each Block's complete/timing
  std::condition_variable completed_;
  std::unordered_map<int64_t, std::shared_ptr<Block>> blocks_;  // waiters hold a reference too
  std::function<void(int64_t)> on_complete_;
};

}  // namespace hytrain
