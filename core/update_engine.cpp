// UpdateEngine: see hytrain/update_engine.h.
#include "hytrain/update_engine.h"

#include <pthread.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "hytrain/error.h"
#include "hytrain/quant8.h"
#include "hytrain/thread_name.h"

namespace hytrain {

int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

// The sub-tensor [begin, end) of a job's tensor: every pointer offset by `begin` elements (the
// slice's first element keeps its index in the parameter).
AdamWTensor slice_of(const AdamWTensor& t, int64_t begin, int64_t end) {
  AdamWTensor s = t;
  const DType sd = t.state_dtype;
  s.param = t.param + begin;
  s.exp_avg = offset_by(t.exp_avg, sd, begin);
  s.exp_avg_sq = offset_by(t.exp_avg_sq, sd, begin);
  s.max_exp_avg_sq = offset_by(t.max_exp_avg_sq, DType::f32, begin);
  s.grad = static_cast<const char*>(t.grad) + begin * dtype_bytes(t.grad_dtype);
  s.param_copy = offset_by(t.param_copy, t.param_copy_dtype, begin);
  if (t.param_out) {
    s.param_out = t.param_out + begin;
    s.exp_avg_out = offset_by(t.exp_avg_out, sd, begin);
    s.exp_avg_sq_out = offset_by(t.exp_avg_sq_out, sd, begin);
    s.max_exp_avg_sq_out = offset_by(t.max_exp_avg_sq_out, DType::f32, begin);
  }
  if (t.record.dp) {
    s.record.dp = t.record.dp + begin;
    s.record.dm = t.record.dm + begin;
    s.record.dv = t.record.dv + begin;
  }
  s.state_numel = t.state_numel ? t.state_numel : t.index_base + t.numel;  // 8-bit scales stay where they are
  s.index_base = t.index_base + begin;
  s.numel = end - begin;
  return s;
}

}  // namespace

namespace {

// HYTRAIN_WORKER_SPIN_US: how long an idle update worker keeps looking for work before it sleeps
// (default 0: a few dozen tries). A measurement knob for hosts where a worker woken from sleep starts slowly.
int64_t worker_spin_ns() {
  const char* v = std::getenv("HYTRAIN_WORKER_SPIN_US");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long long us = std::strtoll(v, &end, 10);
  return (end != v && *end == '\0' && us > 0 && us <= 10'000'000) ? us * 1000 : 0;
}

std::atomic<uint64_t> g_forks{0};

void count_fork_in_child() { g_forks.fetch_add(1, std::memory_order_acq_rel); }

}  // namespace

uint64_t fork_generation() {
  static const int registered = pthread_atfork(nullptr, nullptr, count_fork_in_child);
  (void)registered;
  return g_forks.load(std::memory_order_acquire);
}

struct UpdateEngine::Runtime {
  Runtime(std::size_t queue_slices, SimdPath path) : queue(queue_slices), path(path) {}

  void start(int workers) {
    queue.set_pop_spin_ns(worker_spin_ns());
    for (int i = 0; i < workers; ++i) threads.emplace_back([this, i] {
      name_this_thread("hytrain-update");
      run_worker(i);
    });
  }
  void stop();  // drains the queue (overflow included), then joins the workers
  void run_worker(int index);
  void finish(Block& b);
  void refill();  // moves overflow slices into the queue while they fit (takes overflow_mutex)

  MpmcQueue<Slice*> queue;
  SimdPath path;
  std::mutex overflow_mutex;            // guards overflow
  std::deque<Slice*> overflow;          // slices behind a full queue, in submission order
  std::atomic<std::size_t> pending{0};  // overflow.size(), for the workers' lock-free check
  std::vector<std::thread> threads;
  std::mutex mutex;  // guards blocks (the map) and each Block's complete/timing
  std::condition_variable completed;
  std::unordered_map<int64_t, std::shared_ptr<Block>> blocks;  // waiters hold a reference too
  std::function<void(int64_t)> on_complete;
};

UpdateEngine::UpdateEngine(int workers, int64_t slice_elems, SimdPath path, std::size_t queue_slices)
    : workers_(workers), slice_elems_(slice_elems), path_(path), queue_slices_(queue_slices),
      born_(fork_generation()), generation_(born_) {
  HYTRAIN_CHECK(workers >= 1 && workers <= 1024, "workers must be in [1, 1024]");
  HYTRAIN_CHECK(queue_slices >= 2, "queue_slices must be at least 2");
  HYTRAIN_CHECK(slice_elems >= 1024, "slice_elems must be at least 1024");
  path_ = resolve_simd_path(path);
  runtime_ = std::make_unique<Runtime>(queue_slices_, path_);
  runtime_->start(workers_);
}

UpdateEngine::~UpdateEngine() {
  if (generation_.load(std::memory_order_acquire) != fork_generation()) {
    (void)runtime_.release();  // the parent's: its threads are not here to join, its locks may be held
    return;
  }
  runtime_->stop();
}

void UpdateEngine::Runtime::stop() {
  // The workers move the overflow into the queue as it drains; closing first would strand it.
  while (pending.load() > 0) {
    refill();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  queue.close();  // workers drain what is queued, then exit
  for (auto& t : threads) t.join();
}

UpdateEngine::Runtime& UpdateEngine::here() {
  const uint64_t now = fork_generation();
  if (generation_.load(std::memory_order_acquire) == now) return *runtime_;
  std::lock_guard<std::mutex> lock(respawn_mutex_);
  if (generation_.load(std::memory_order_acquire) != now) {
    // The first use in a forked child. Nothing of the parent's runtime is touched but to read it
    // (this thread is the child's only user of it): its threads are gone and a lock one of them held
    // stays held, so it is left as it is (never freed), and a new one starts.
    Runtime* old = runtime_.release();
    auto fresh = std::make_unique<Runtime>(queue_slices_, path_);
    fresh->on_complete = old->on_complete;
    for (const auto& [id, b] : old->blocks) {
      if (b->complete) {
        fresh->blocks[id] = b;
        continue;
      }
      // Some of its slices were updated before the fork, others not: its state is not an update.
      auto lost = std::make_shared<Block>();
      lost->id = id;
      lost->timing = b->timing;
      lost->failed.store(true);
      lost->error = "the process forked while this block was being updated, so the update is incomplete "
                    "in the child (quiesce the engine before fork())";
      fresh->blocks[id] = lost;
    }
    fresh->start(workers_);
    runtime_ = std::move(fresh);
    generation_.store(now, std::memory_order_release);
  }
  return *runtime_;
}

void UpdateEngine::set_on_complete(std::function<void(int64_t)> fn) {
  Runtime& r = here();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.on_complete = std::move(fn);
}

void UpdateEngine::submit(int64_t block, const std::vector<UpdateJob>& jobs) {
  // Validate everything before anything is queued: a refused submit changes nothing.
  for (const UpdateJob& j : jobs) validate_adamw_job(j.tensor, j.config);
  Runtime& r = here();
  Block* b = nullptr;
  std::function<void(int64_t)> on_complete;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto& slot = r.blocks[block];
    if (slot && !slot->complete) {
      HYTRAIN_THROW("block " + std::to_string(block) + " is still being updated");
    }
    slot = std::make_shared<Block>();
    b = slot.get();
    b->id = block;
    b->jobs = jobs;
    for (int i = 0; i < static_cast<int>(jobs.size()); ++i) {
      const int64_t n = jobs[i].tensor.numel;
      const int64_t granule = range_granule(jobs[i].tensor.state_dtype);  // 8-bit: whole blocks
      const int64_t step = (slice_elems_ + granule - 1) / granule * granule;
      for (int64_t s = 0; s < n; s += step) {
        b->slices.push_back({b, i, s, std::min(n, s + step)});
      }
      b->timing.elements += n;
    }
    b->timing.submit_ns = steady_now_ns();
    b->remaining.store(static_cast<int64_t>(b->slices.size()));
    b->complete = b->slices.empty();
    if (b->complete) b->timing.start_ns = b->timing.end_ns = b->timing.submit_ns;
    if (b->complete) on_complete = r.on_complete;
  }
  if (b->slices.empty()) {
    r.completed.notify_all();
    if (on_complete) on_complete(block);
    return;
  }
  // Straight into the queue while it has room and nothing waits ahead; the rest, in order, behind.
  // pending is raised before a failed try_push can be observed, so a worker that frees a cell
  // afterwards sees it and refills: the overflow cannot be stranded behind an empty queue.
  std::lock_guard<std::mutex> lock(r.overflow_mutex);
  std::size_t i = 0;
  if (r.overflow.empty()) {
    while (i < b->slices.size() && r.queue.try_push(&b->slices[i])) ++i;
  }
  if (i == b->slices.size()) return;
  for (; i < b->slices.size(); ++i) r.overflow.push_back(&b->slices[i]);
  r.pending.store(r.overflow.size());
  while (!r.overflow.empty() && r.queue.try_push(r.overflow.front())) r.overflow.pop_front();
  r.pending.store(r.overflow.size());
}

void UpdateEngine::Runtime::refill() {
  std::lock_guard<std::mutex> lock(overflow_mutex);
  while (!overflow.empty() && queue.try_push(overflow.front())) overflow.pop_front();
  pending.store(overflow.size());
}

void UpdateEngine::Runtime::run_worker(int index) {
  Slice* s = nullptr;
  const uint64_t bit = uint64_t{1} << (index % 64);
  while (queue.pop(s)) {
    Block& b = *s->block;
    int64_t zero = 0;
    const int64_t began = steady_now_ns();
    b.start_ns.compare_exchange_strong(zero, began);
    if (!(b.seen[index / 64 % 16].load(std::memory_order_relaxed) & bit)) {
      b.seen[index / 64 % 16].fetch_or(bit, std::memory_order_relaxed);
    }
    if (!b.failed.load(std::memory_order_acquire)) {
      const UpdateJob& j = b.jobs[s->job];
      try {
        adamw_step(slice_of(j.tensor, s->begin, s->end), j.config, 1, path);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(b.error_mutex);
        if (!b.failed.load()) b.error = e.what();
        b.failed.store(true, std::memory_order_release);
      }
    }
    b.busy_ns.fetch_add(steady_now_ns() - began, std::memory_order_relaxed);
    if (b.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(b);
    if (pending.load() > 0) refill();
  }
}

void UpdateEngine::Runtime::finish(Block& b) {
  const int64_t id = b.id;
  std::function<void(int64_t)> call;  // copied under the lock: set_on_complete may race
  {
    std::lock_guard<std::mutex> lock(mutex);
    b.timing.start_ns = b.start_ns.load();
    b.timing.end_ns = steady_now_ns();
    b.timing.busy_ns = b.busy_ns.load();
    int seen = 0;
    for (const auto& word : b.seen) seen += __builtin_popcountll(word.load(std::memory_order_relaxed));
    b.timing.workers = seen;
    b.complete = true;
    call = on_complete;
  }
  completed.notify_all();
  if (call) call(id);
}

void UpdateEngine::wait(int64_t block) {
  Runtime& r = here();
  std::unique_lock<std::mutex> lock(r.mutex);
  auto it = r.blocks.find(block);
  if (it == r.blocks.end()) return;
  const std::shared_ptr<Block> b = it->second;  // survives a resubmit that replaces the entry
  r.completed.wait(lock, [&] { return b->complete; });
  if (b->failed.load()) {
    std::lock_guard<std::mutex> elock(b->error_mutex);
    HYTRAIN_THROW("AdamW update of block " + std::to_string(block) + " failed: " + b->error);
  }
}

void UpdateEngine::wait_all() {
  std::vector<int64_t> ids;
  {
    Runtime& r = here();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& kv : r.blocks) ids.push_back(kv.first);
  }
  for (int64_t id : ids) wait(id);
}

void UpdateEngine::quiesce() {
  Runtime& r = here();
  std::unique_lock<std::mutex> lock(r.mutex);
  r.completed.wait(lock, [&] {
    for (const auto& kv : r.blocks) {
      if (!kv.second->complete) return false;
    }
    return true;
  });
}

bool UpdateEngine::done(int64_t block) {
  Runtime& r = here();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.blocks.find(block);
  return it == r.blocks.end() || it->second->complete;
}

BlockTiming UpdateEngine::timing(int64_t block) {
  Runtime& r = here();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.blocks.find(block);
  HYTRAIN_CHECK(it != r.blocks.end(), "block " + std::to_string(block) + " was never submitted");
  HYTRAIN_CHECK(it->second->complete, "block " + std::to_string(block) + " is still in flight");
  return it->second->timing;
}

}  // namespace hytrain
