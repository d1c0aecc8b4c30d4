// The offload pipeline; see hytrain/offload_pipeline.h.
#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <string>

#include "hytrain/offload_pipeline.h"
#include "hytrain/adamw.h"
#include "hytrain/error.h"

namespace hytrain {

namespace {

constexpr uint64_t kUnknownTicket = std::numeric_limits<uint64_t>::max();

}  // namespace

OffloadPipeline::OffloadPipeline(UpdateEngine& engine, std::unique_ptr<CopyQueue> d2h,
                                 std::unique_ptr<CopyQueue> h2d)
    : engine_(engine), d2h_(std::move(d2h)), h2d_(std::move(h2d)) {
  HYTRAIN_CHECK(d2h_ && h2d_, "the offload pipeline needs two copy queues");
  d2h_->set_listener([this](uint64_t ticket) { on_gradients_landed(ticket); });
  gate_ = std::make_shared<Gate>();
  gate_->owner = this;
  std::shared_ptr<Gate> gate = gate_;
  engine_.set_on_complete([gate](int64_t block) {
    std::lock_guard<std::mutex> lock(gate->mutex);
    if (gate->owner) gate->owner->on_updated(block);
  });
}

OffloadPipeline::~OffloadPipeline() {
  d2h_.reset();  // waits for queued gradient copies; the poller hands their blocks to the engine
  try {
    engine_.wait_all();
  } catch (const std::exception&) {
    // A failed update has nobody left to report to.
  }
  {
    std::lock_guard<std::mutex> lock(gate_->mutex);  // waits for a hook call under way
    gate_->owner = nullptr;
  }
  h2d_.reset();  // waits for the weight copies already issued
}

void OffloadPipeline::fail(Pass& p, const std::string& why) {
  if (p.state == State::ready || p.state == State::failed) return;
  p.state = State::failed;
  p.error = why;
  changed_.notify_all();
}

std::string OffloadPipeline::stream_failure() {
  std::string e = d2h_->failure();
  if (!e.empty()) return "gradient copy (device to host) failed: " + e;
  e = h2d_->failure();
  if (!e.empty()) return "weight copy (host to device) failed: " + e;
  return {};
}

void OffloadPipeline::stage(int64_t block, const std::vector<HostCopy>& d2h,
                            const std::vector<UpdateJob>& jobs, const std::vector<HostCopy>& h2d,
                            std::uintptr_t compute_stream, bool hold) {
  std::lock_guard<std::mutex> stage_lock(stage_mutex_);  // tickets and copying_ in one order
  if (in_flight(block)) {
    // The previous pass was never consumed (no forward used the block): let it finish, and keep
    // the new gradient copies behind its weight copies, which read the same staging memory.
    wait_ready(block, d2h_->handle());
  }
  auto p = std::make_shared<Pass>();
  p->block = block;
  p->hold = hold && !d2h.empty();
  p->jobs = jobs;
  p->h2d = h2d;
  for (const HostCopy& c : h2d) p->info.h2d_bytes += c.bytes;
  for (const HostCopy& c : d2h) p->info.d2h_bytes += c.bytes;
  p->info.d2h_last = d2h.empty() ? 0 : kUnknownTicket;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    passes_[block] = p;
    if (!d2h.empty()) copying_.push_back(p);
    else p->state = State::updating;
  }
  if (d2h.empty()) {
    submit(p);
    return;
  }
  uint64_t first = 0, last = 0;
  std::string error;
  try {
    for (const HostCopy& c : d2h) {
      last = d2h_->copy(c.dst, c.src, c.bytes, compute_stream);
      if (first == 0) first = last;
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::vector<std::shared_ptr<Pass>> landed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    p->info.d2h_first = first;
    p->info.d2h_last = error.empty() ? last : 0;
    if (!error.empty()) {
      copying_.erase(std::find(copying_.begin(), copying_.end(), p));
      fail(*p, error);
    }
    landed = take_landed(d2h_->completed());  // the poller may have passed `last` already
  }
  for (auto& q : landed) submit(q);
  if (!error.empty()) throw Error("staging block " + std::to_string(block) + ": " + error,
                                  __FILE__, __LINE__);
}

std::vector<std::shared_ptr<OffloadPipeline::Pass>> OffloadPipeline::take_landed(uint64_t done) {
  std::vector<std::shared_ptr<Pass>> out;
  std::size_t n = 0;
  while (n < copying_.size() && copying_[n]->info.d2h_last <= done) {
    Pass& p = *copying_[n];
    if (p.state == State::copying_out) {
      if (p.cancelled) {
        p.state = State::ready;
        changed_.notify_all();
      } else if (p.hold) {
        p.state = State::landed;
      } else {
        p.state = State::updating;
        out.push_back(copying_[n]);
      }
    }
    ++n;
  }
  copying_.erase(copying_.begin(), copying_.begin() + static_cast<std::ptrdiff_t>(n));
  return out;
}

void OffloadPipeline::on_gradients_landed(uint64_t ticket) {
  std::vector<std::shared_ptr<Pass>> landed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    landed = take_landed(ticket);
  }
  for (auto& p : landed) submit(p);
}

void OffloadPipeline::submit(const std::shared_ptr<Pass>& p) {
  try {
    engine_.submit(p->block, p->jobs);
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail(*p, std::string("queuing the update: ") + e.what());
  }
}

void OffloadPipeline::release(int64_t block, double grad_scale) {
  std::vector<AdamWConfig> configs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = passes_.find(block);
    HYTRAIN_CHECK(it != passes_.end() && it->second->hold,
                  "block " + std::to_string(block) + " has no held pass to release");
    for (const UpdateJob& j : it->second->jobs) {
      configs.push_back(j.config);
      // The sign is the group's (maximize); the magnitude is the step's multiplier.
      configs.back().grad_scale = j.config.grad_scale < 0 ? -grad_scale : grad_scale;
    }
  }
  release(block, configs);
}

void OffloadPipeline::release(int64_t block, const std::vector<AdamWConfig>& configs) {
  std::shared_ptr<Pass> go;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = passes_.find(block);
    HYTRAIN_CHECK(it != passes_.end() && it->second->hold,
                  "block " + std::to_string(block) + " has no held pass to release");
    Pass& p = *it->second;
    HYTRAIN_CHECK(configs.size() == p.jobs.size(),
                  "block " + std::to_string(block) + ": release with " + std::to_string(configs.size()) +
                      " configs for " + std::to_string(p.jobs.size()) + " jobs");
    for (std::size_t i = 0; i < configs.size(); ++i) p.jobs[i].config = configs[i];
    p.hold = false;
    if (p.state == State::landed) {
      p.state = State::updating;
      go = it->second;
    }
  }
  if (go) submit(go);
}

void OffloadPipeline::cancel(int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = passes_.find(block);
  HYTRAIN_CHECK(it != passes_.end() && it->second->hold,
                "block " + std::to_string(block) + " has no held pass to cancel");
  Pass& p = *it->second;
  p.jobs.clear();
  p.h2d.clear();
  p.hold = false;
  p.cancelled = true;
  if (p.state == State::landed) {
    p.state = State::ready;
    changed_.notify_all();
  }
}

void OffloadPipeline::on_updated(int64_t block) {
  std::shared_ptr<Pass> p;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = passes_.find(block);
    if (it == passes_.end() || it->second->state != State::updating) return;
    p = it->second;
  }
  std::string error;
  try {
    engine_.wait(block);  // complete already: rethrows the update's error, if any
    for (const HostCopy& c : p->h2d) {
      const uint64_t t = h2d_->copy(c.dst, c.src, c.bytes, std::nullopt);
      if (p->info.h2d_first == 0) p->info.h2d_first = t;
      p->info.h2d_last = t;
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error.empty()) {
    fail(*p, error);
    return;
  }
  p->state = State::ready;
  changed_.notify_all();
}

void OffloadPipeline::wait_ready(int64_t block, std::uintptr_t stream, double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = passes_.find(block);
  if (it == passes_.end()) return;
  const std::shared_ptr<Pass> p = it->second;
  if (p->hold && p->state != State::failed) {
    throw Error("block " + std::to_string(block) + " was staged with hold and never released",
                __FILE__, __LINE__);
  }
  const auto start = std::chrono::steady_clock::now();
  const auto settled = [&] { return p->state == State::ready || p->state == State::failed; };
  while (!settled()) {
    // The poller stops at a CUDA error without calling anyone: look at the streams now and then.
    changed_.wait_for(lock, std::chrono::milliseconds(20), settled);
    if (settled()) break;
    const std::string f = stream_failure();
    if (!f.empty()) {
      fail(*p, f);
      break;
    }
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    if (timeout_s >= 0 && waited.count() > timeout_s) {
      throw Timeout("block " + std::to_string(block) + " was not updated after " +
                        std::to_string(timeout_s) + " s",
                    __FILE__, __LINE__);
    }
  }
  passes_.erase(block);
  if (p->state == State::failed) {
    throw Error("block " + std::to_string(block) + ": " + p->error, __FILE__, __LINE__);
  }
  BlockPass info = p->info;
  try {
    info.update = engine_.timing(block);
  } catch (const std::exception&) {
    // Not submitted (no jobs): no CPU times.
  }
  last_[block] = info;
  lock.unlock();
  if (info.h2d_last != 0) h2d_->make_wait(stream, info.h2d_last);
}

void OffloadPipeline::wait_updated(int64_t block) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = passes_.find(block);
  if (it == passes_.end()) return;
  const std::shared_ptr<Pass> p = it->second;
  HYTRAIN_CHECK(!p->hold, "block " + std::to_string(block) + " is held: its update waits for release()");
  const auto settled = [&] { return p->state == State::ready || p->state == State::failed; };
  while (!settled()) {
    changed_.wait_for(lock, std::chrono::milliseconds(20), settled);
    if (settled()) break;
    const std::string f = stream_failure();  // the poller stops at a CUDA error without calling anyone
    if (!f.empty()) {
      fail(*p, f);
      break;
    }
  }
}

bool OffloadPipeline::updated(int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = passes_.find(block);
  if (it == passes_.end()) return true;
  const State s = it->second->state;
  return s == State::ready || s == State::failed;
}

bool OffloadPipeline::in_flight(int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  return passes_.count(block) != 0;
}

BlockPass OffloadPipeline::last_pass(int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = last_.find(block);
  HYTRAIN_CHECK(it != last_.end(), "block " + std::to_string(block) + " has no finished pass");
  return it->second;
}

}  // namespace hytrain
