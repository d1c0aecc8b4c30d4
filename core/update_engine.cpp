// UpdateEngine: see hytrain/update_engine.h.
#include "hytrain/update_engine.h"

#include <chrono>
#include <thread>

#include "hytrain/error.h"
#include "hytrain/quant8.h"

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

UpdateEngine::UpdateEngine(int workers, int64_t slice_elems, SimdPath path, std::size_t queue_slices)
    : queue_(queue_slices), slice_elems_(slice_elems), path_(path) {
  HYTRAIN_CHECK(workers >= 1 && workers <= 1024, "workers must be in [1, 1024]");
  HYTRAIN_CHECK(queue_slices >= 2, "queue_slices must be at least 2");
  HYTRAIN_CHECK(slice_elems >= 1024, "slice_elems must be at least 1024");
  path_ = resolve_simd_path(path);
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { run_worker(); });
}

UpdateEngine::~UpdateEngine() {
  // The workers move the overflow into the queue as it drains; closing first would strand it.
  while (pending_.load() > 0) {
    refill();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  queue_.close();  // workers drain what is queued, then exit
  for (auto& t : threads_) t.join();
}

void UpdateEngine::set_on_complete(std::function<void(int64_t)> fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  on_complete_ = std::move(fn);
}

void UpdateEngine::submit(int64_t block, const std::vector<UpdateJob>& jobs) {
  // Validate everything before anything is queued: a refused submit changes nothing.
  for (const UpdateJob& j : jobs) validate_adamw_job(j.tensor, j.config);
  Block* b = nullptr;
  std::function<void(int64_t)> on_complete;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = blocks_[block];
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
    if (b->complete) on_complete = on_complete_;
  }
  if (b->slices.empty()) {
    completed_.notify_all();
    if (on_complete) on_complete(block);
    return;
  }
  // Straight into the queue while it has room and nothing waits ahead; the rest, in order, behind.
  // pending_ is raised before a failed try_push can be observed, so a worker that frees a cell
  // afterwards sees it and refills: the overflow cannot be stranded behind an empty queue.
  std::lock_guard<std::mutex> lock(overflow_mutex_);
  std::size_t i = 0;
  if (overflow_.empty()) {
    while (i < b->slices.size() && queue_.try_push(&b->slices[i])) ++i;
  }
  if (i == b->slices.size()) return;
  for (; i < b->slices.size(); ++i) overflow_.push_back(&b->slices[i]);
  pending_.store(overflow_.size());
  while (!overflow_.empty() && queue_.try_push(overflow_.front())) overflow_.pop_front();
  pending_.store(overflow_.size());
}

void UpdateEngine::refill() {
  std::lock_guard<std::mutex> lock(overflow_mutex_);
  while (!overflow_.empty() && queue_.try_push(overflow_.front())) overflow_.pop_front();
  pending_.store(overflow_.size());
}

void UpdateEngine::run_worker() {
  Slice* s = nullptr;
  while (queue_.pop(s)) {
    Block& b = *s->block;
    int64_t zero = 0;
    b.start_ns.compare_exchange_strong(zero, steady_now_ns());
    if (!b.failed.load(std::memory_order_acquire)) {
      const UpdateJob& j = b.jobs[s->job];
      try {
        adamw_step(slice_of(j.tensor, s->begin, s->end), j.config, 1, path_);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(b.error_mutex);
        if (!b.failed.load()) b.error = e.what();
        b.failed.store(true, std::memory_order_release);
      }
    }
    if (b.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(b);
    if (pending_.load() > 0) refill();
  }
}

void UpdateEngine::finish(Block& b) {
  const int64_t id = b.id;
  std::function<void(int64_t)> on_complete;  // copied under the lock: set_on_complete may race
  {
    std::lock_guard<std::mutex> lock(mutex_);
    b.timing.start_ns = b.start_ns.load();
    b.timing.end_ns = steady_now_ns();
    b.complete = true;
    on_complete = on_complete_;
  }
  completed_.notify_all();
  if (on_complete) on_complete(id);
}

void UpdateEngine::wait(int64_t block) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = blocks_.find(block);
  if (it == blocks_.end()) return;
  const std::shared_ptr<Block> b = it->second;  // survives a resubmit that replaces the entry
  completed_.wait(lock, [&] { return b->complete; });
  if (b->failed.load()) {
    std::lock_guard<std::mutex> elock(b->error_mutex);
    HYTRAIN_THROW("AdamW update of block " + std::to_string(block) + " failed: " + b->error);
  }
}

void UpdateEngine::wait_all() {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& kv : blocks_) ids.push_back(kv.first);
  }
  for (int64_t id : ids) wait(id);
}

bool UpdateEngine::done(int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(block);
  return it == blocks_.end() || it->second->complete;
}

BlockTiming UpdateEngine::timing(int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blocks_.find(block);
  HYTRAIN_CHECK(it != blocks_.end(), "block " + std::to_string(block) + " was never submitted");
  HYTRAIN_CHECK(it->second->complete, "block " + std::to_string(block) + " is still in flight");
  return it->second->timing;
}

}  // namespace hytrain
