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
//
// After fork() the child has none of the parent's threads, and any lock one of them held stays held:
// the engine notices (fork_generation(), counted by a pthread_atfork handler) at its first use in
// the child, leaves the parent's queue, locks and threads untouched, and starts its workers again
// with a new queue. The memory a job points to is the child's copy-on-write copy. Blocks complete at
// the fork stay complete; a block still in flight then is incomplete in the child (some slices were
// updated, some not) and its wait() throws: callers that want to keep using an engine across a fork
// call quiesce() in the parent just before it. An engine destroyed in a process it was not made or
// used in joins nothing.
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
  int64_t busy_ns = 0;  // the workers' time inside the block's slices, summed (span x workers where all ran it)
  int workers = 0;      // the workers that ran at least one of its slices
};

int64_t steady_now_ns();

// How many fork()s lie between the process that loaded this library and this one (0 there): each
// fork's child counts one more (a pthread_atfork handler, registered at the first call).
uint64_t fork_generation();

class UpdateEngine {
 public:
  // Slices the lock-free queue holds by default. submit() never blocks: slices that do not fit wait,
  // in order, in an overflow list that the workers move into the queue as it drains.
  static constexpr std::size_t kQueueSlices = std::size_t(1) << 18;

  UpdateEngine(int workers, int64_t slice_elems, SimdPath path = SimdPath::automatic,
               std::size_t queue_slices = kQueueSlices);
  // Finishes queued work (overflow included), then joins the workers; in a forked child that never
  // used the engine, leaves the parent's runtime as it is (its threads are not there to join).
  ~UpdateEngine();
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
  // Blocks until every block submitted so far has completed, failed or not (errors stay for wait()):
  // nothing is in flight on return unless another thread submits meanwhile. Call before fork().
  void quiesce();
  bool done(int64_t block);
  BlockTiming timing(int64_t block);
  // Called on a worker thread when a block completes (error or not); it must not throw. It may be
  // replaced at any time (a call already under way finishes with the old function).
  void set_on_complete(std::function<void(int64_t)> fn);

  int workers() const { return workers_; }
  // Whether this engine was made in a process that this one was forked from.
  bool inherited() const { return born_ != fork_generation(); }

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
    std::atomic<int64_t> busy_ns{0};
    std::atomic<uint64_t> seen[16] = {};  // bit w: worker w ran a slice (workers <= 1024)
    std::atomic<bool> failed{false};
    std::mutex error_mutex;  // guards error
    std::string error;       // the first failure's message
    BlockTiming timing;
    bool complete = true;
    int64_t id = 0;
  };

  // The queue, the workers and the blocks: what a fork leaves behind in the child (update_engine.cpp).
  struct Runtime;

  Runtime& here();  // this process's runtime, made again at the first use after a fork

  int workers_;
  int64_t slice_elems_;
  SimdPath path_;
  std::size_t queue_slices_;
  const uint64_t born_;               // fork_generation() at construction
  std::atomic<uint64_t> generation_;  // fork_generation() that runtime_ was made in
  std::mutex respawn_mutex_;          // one thread makes the child's runtime
  std::unique_ptr<Runtime> runtime_;
};

}  // namespace hytrain
