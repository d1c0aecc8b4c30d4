#include "hytrain/ksplit.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "hytrain/error.h"

namespace hytrain {

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool sized_by_bytes(Phase p) { return p == Phase::D2H || p == Phase::H2D; }

void check_seconds(double s, const char* what) {
  if (!std::isfinite(s) || s < 0) {
    HYTRAIN_THROW(std::string(what) + " must be finite and >= 0, got " + std::to_string(s));
  }
}
}  // namespace

KSplitScheduler::KSplitScheduler(std::vector<std::int64_t> numel, std::vector<std::int64_t> weight_bytes,
                                 std::vector<std::int64_t> state_bytes, KSplitConfig config)
    : numel_(std::move(numel)),
      weight_bytes_(std::move(weight_bytes)),
      state_bytes_(std::move(state_bytes)),
      config_(config) {
  if (numel_.empty()) HYTRAIN_THROW("KSplitScheduler needs at least one block");
  if (weight_bytes_.size() != numel_.size() || state_bytes_.size() != numel_.size()) {
    HYTRAIN_THROW("KSplitScheduler: numel, weight_bytes and state_bytes must have one entry per block");
  }
  for (std::size_t j = 0; j < numel_.size(); ++j) {
    if (numel_[j] < 1 || weight_bytes_[j] < 0 || state_bytes_[j] < 0) {
      HYTRAIN_THROW("KSplitScheduler: block " + std::to_string(j) +
                    " needs numel >= 1 and non-negative byte counts");
    }
  }
  if (!(config_.smoothing > 0 && config_.smoothing <= 1)) {
    HYTRAIN_THROW("KSplitScheduler: smoothing must be in (0, 1]");
  }
  if (!(config_.hysteresis >= 0 && config_.hysteresis < 1)) {
    HYTRAIN_THROW("KSplitScheduler: hysteresis must be in [0, 1)");
  }
  if (config_.horizon < 1 || config_.every < 1) {
    HYTRAIN_THROW("KSplitScheduler: horizon and every must be >= 1");
  }
  ewma_.assign(numel_.size() * kPhases, kNaN);
  std::fill(rate_, rate_ + kPhases, kNaN);
}

double KSplitScheduler::size_of(std::size_t block, Phase phase) const {
  return sized_by_bytes(phase) ? static_cast<double>(weight_bytes_[block])
                               : static_cast<double>(numel_[block]);
}

void KSplitScheduler::observe(std::size_t block, Phase phase, double seconds) {
  if (block >= blocks()) {
    HYTRAIN_THROW("KSplitScheduler::observe: block " + std::to_string(block) + " of " +
                  std::to_string(blocks()));
  }
  if (phase == Phase::Count) HYTRAIN_THROW("KSplitScheduler::observe: not a phase");
  check_seconds(seconds, "a measured time");
  const double a = config_.smoothing;
  double& e = ewma_[block * kPhases + static_cast<int>(phase)];
  e = std::isnan(e) ? seconds : (1 - a) * e + a * seconds;
  const double size = size_of(block, phase);
  if (size > 0) {
    double& r = rate_[static_cast<int>(phase)];
    r = std::isnan(r) ? seconds / size : (1 - a) * r + a * seconds / size;
  }
}

void KSplitScheduler::observe_rate(Phase phase, double seconds_per_unit) {
  if (phase == Phase::Count) HYTRAIN_THROW("KSplitScheduler::observe_rate: not a phase");
  check_seconds(seconds_per_unit, "a rate");
  double& r = rate_[static_cast<int>(phase)];
  const double a = config_.smoothing;
  r = std::isnan(r) ? seconds_per_unit : (1 - a) * r + a * seconds_per_unit;
}

void KSplitScheduler::observe_overhead(double before_launch_s, double after_launch_s) {
  check_seconds(before_launch_s, "the step overhead");
  check_seconds(after_launch_s, "the step overhead");
  const double a = config_.smoothing;
  before_launch_ = overhead_seen_ ? (1 - a) * before_launch_ + a * before_launch_s : before_launch_s;
  after_launch_ = overhead_seen_ ? (1 - a) * after_launch_ + a * after_launch_s : after_launch_s;
  overhead_seen_ = true;
}

StepShape KSplitScheduler::shape() const {
  StepShape s;
  s.deferred = config_.deferred;
  s.overlap = config_.overlap;
  s.early_copies = config_.early_copies;
  s.speculative_from = std::numeric_limits<std::size_t>::max();
  s.before_launch_s = before_launch_;
  s.after_launch_s = after_launch_;
  return s;
}

double KSplitScheduler::estimate(std::size_t block, Phase phase) const {
  const double e = ewma_[block * kPhases + static_cast<int>(phase)];
  if (!std::isnan(e)) return e;
  const double r = rate_[static_cast<int>(phase)];
  if (!std::isnan(r)) return r * size_of(block, phase);
  return sized_by_bytes(phase) ? 0.0 : kNaN;
}

bool KSplitScheduler::ready() const {
  for (Phase p : {Phase::Forward, Phase::Backward, Phase::Cpu, Phase::Gpu}) {
    if (std::isnan(rate_[static_cast<int>(p)])) return false;
  }
  return true;
}

std::vector<BlockCosts> KSplitScheduler::costs() const {
  std::vector<BlockCosts> out(blocks());
  const double h2d_rate = rate_[static_cast<int>(Phase::H2D)];
  for (std::size_t j = 0; j < blocks(); ++j) {
    BlockCosts& c = out[j];
    c.fwd = estimate(j, Phase::Forward);
    c.bwd = estimate(j, Phase::Backward);
    c.d2h = estimate(j, Phase::D2H);
    c.cpu = estimate(j, Phase::Cpu);
    c.h2d = estimate(j, Phase::H2D);
    c.gpu = estimate(j, Phase::Gpu);
    c.migrate = std::isnan(h2d_rate) ? 0.0 : h2d_rate * static_cast<double>(state_bytes_[j]);
  }
  return out;
}

std::size_t KSplitScheduler::max_k() const {
  if (budget_ < 0) return blocks();
  double used = 0;
  for (std::size_t j = 0; j < blocks(); ++j) {
    used += static_cast<double>(state_bytes_[j]);
    if (used > budget_) return j;
  }
  return blocks();
}

Prediction KSplitScheduler::simulate(const std::vector<BlockCosts>& c, std::size_t k, const StepShape& shape) {
  const bool deferred = shape.deferred, early_copies = shape.early_copies && shape.deferred;
  const std::size_t L = c.size();
  if (k > L) HYTRAIN_THROW("KSplitScheduler: k=" + std::to_string(k) + " > " + std::to_string(L) + " blocks");
  Prediction p;
  p.k = k;
  p.speculative_from = deferred ? std::min(L, std::max(k, shape.speculative_from)) : L;
  p.ready.assign(L, 0.0);
  double gpu = 0, d2h_free = 0, cpu_free = 0, h2d_free = 0;
  std::vector<double> landed(L, -1.0);  // early copies: when block j's gradients reached the host
  // One block through D2H -> CPU (FIFO) -> H2D, its gradients ready at `t`.
  const auto offload = [&](std::size_t j, double t) {
    const double on_host = landed[j] >= 0 ? std::max(t, landed[j]) : (d2h_free = std::max(t, d2h_free) + c[j].d2h);
    cpu_free = std::max(on_host, cpu_free) + c[j].cpu;
    h2d_free = std::max(cpu_free, h2d_free) + c[j].h2d;
    p.ready[j] = h2d_free;
    p.cpu_busy_s += c[j].cpu;
  };
  for (std::size_t i = L; i-- > 0;) {  // backward, last block first
    gpu += c[i].bwd;
    if (deferred) {
      if (i >= k && i >= shape.speculative_from) offload(i, gpu);
      else if (early_copies && i >= k) landed[i] = d2h_free = std::max(gpu, d2h_free) + c[i].d2h;
      continue;
    }
    if (i < k) {
      gpu += c[i].gpu;
      p.ready[i] = gpu;
    } else {
      offload(i, gpu);
    }
  }
  gpu += shape.before_launch_s;
  if (deferred) {  // step(): offloaded blocks staged first (forward order), then the GPU updates
    for (std::size_t j = k; j < std::min(L, shape.speculative_from); ++j) offload(j, gpu);
    for (std::size_t j = 0; j < k; ++j) {
      gpu += c[j].gpu;
      p.ready[j] = gpu;
    }
  }
  gpu += shape.after_launch_s;
  double t = gpu;
  if (!shape.overlap) t = std::max(t, *std::max_element(p.ready.begin(), p.ready.end()));
  for (std::size_t j = 0; j < L; ++j) t = std::max(t, p.ready[j]) + c[j].fwd;
  p.iter_s = t;
  for (std::size_t j = 0; j < L; ++j) p.gpu_busy_s += c[j].fwd + c[j].bwd + (j < k ? c[j].gpu : 0.0);
  p.gpu_busy_s += shape.before_launch_s + shape.after_launch_s;
  p.gpu_idle_s = std::max(0.0, p.iter_s - p.gpu_busy_s);
  return p;
}

Prediction KSplitScheduler::best_for(const std::vector<BlockCosts>& c, std::size_t k, StepShape s) const {
  const std::size_t L = blocks();
  s.speculative_from = L;  // none
  Prediction best = simulate(c, k, s);
  if (!s.deferred || k > L) return best;
  const std::size_t lo = std::max(k, std::min(L, config_.speculative_min));
  if (config_.speculative_fixed) {
    s.speculative_from = lo;
    return simulate(c, k, s);
  }
  for (std::size_t from = L; from-- > lo;) {
    s.speculative_from = from;
    Prediction p = simulate(c, k, s);
    if (p.iter_s < best.iter_s) best = std::move(p);
  }
  return best;
}

Prediction KSplitScheduler::predict(std::size_t k) const {
  if (!ready()) HYTRAIN_THROW("KSplitScheduler::predict: forward, backward, CPU and GPU times not all known yet");
  return best_for(costs(), k, shape());
}

std::size_t KSplitScheduler::decide(std::size_t current) {
  const bool due = iterations_ % config_.every == 0;
  ++iterations_;
  if (!ready()) return current;
  const std::size_t L = blocks();
  const std::size_t cur = std::min(current, L);
  const std::size_t lo = std::min(min_k_, L);  // the host holds the states of blocks >= lo only
  const std::size_t kmax = std::max(max_k(), lo);
  const std::vector<BlockCosts> c = costs();
  const StepShape s = shape();
  const bool allowed = lo <= cur && cur <= kmax;
  if (!due && allowed) {  // not a deciding iteration: only the current k's prediction
    last_ = best_for(c, cur, s);
    return cur;
  }
  std::vector<Prediction> preds;
  preds.reserve(L + 1);
  for (std::size_t k = 0; k <= L; ++k) preds.push_back(best_for(c, k, s));
  std::size_t best = lo;
  for (std::size_t k = lo + 1; k <= kmax; ++k) {
    if (preds[k].iter_s < preds[best].iter_s) best = k;
  }
  std::size_t chosen = best;
  if (allowed && best != cur) {  // optional move: must pay for itself
    double moved = 0;
    for (std::size_t j = std::min(cur, best); j < std::max(cur, best); ++j) moved += c[j].migrate;
    const double gain = preds[cur].iter_s * (1 - config_.hysteresis) - preds[best].iter_s;
    if (gain <= moved / config_.horizon) chosen = cur;
  }
  last_ = preds[chosen];
  return chosen;
}

double KSplitScheduler::closed_form_k(double L, double t_bwd, double c, double alpha) {
  if (!(L >= 0) || !(t_bwd >= 0) || !(c > 0) || !(alpha >= 0)) {
    HYTRAIN_THROW("closed_form_k needs L >= 0, t_bwd >= 0, c > 0, alpha >= 0");
  }
  return std::clamp((L - t_bwd / c) / (1 + alpha), 0.0, L);
}

namespace {

// (block, start, end) -> block: end - max(start, the previous end), in the order the blocks ended.
std::vector<std::pair<std::int64_t, double>> service_times(std::vector<IterationTimes::Span> spans) {
  std::stable_sort(spans.begin(), spans.end(),
                   [](const IterationTimes::Span& a, const IterationTimes::Span& b) { return a.end_s < b.end_s; });
  std::vector<std::pair<std::int64_t, double>> out;
  double free = kNaN;
  for (const auto& s : spans) {
    const double begin = std::isnan(free) ? s.start_s : std::max(s.start_s, free);
    out.emplace_back(s.block, std::max(0.0, s.end_s - begin));
    free = s.end_s;
  }
  return out;
}

}  // namespace

IterationSummary attribute_iteration(const IterationTimes& t, KSplitScheduler* sink) {
  if (t.waits.empty() || t.backward_ms.empty()) {
    HYTRAIN_THROW("attribute_iteration: an iteration needs its forward waits and backward times");
  }
  const auto observe = [sink](std::int64_t block, Phase phase, double seconds) {
    if (sink) sink->observe(static_cast<std::size_t>(block), phase, seconds);
  };
  double gpu_total = 0;
  std::vector<std::pair<std::int64_t, double>> gpu = t.gpu_update_s;
  for (const auto& [b, s] : gpu) {
    observe(b, Phase::Gpu, s);
    gpu_total += s;
  }
  const auto gpu_of = [&gpu](std::int64_t b) {
    for (const auto& [block, s] : gpu) {
      if (block == b) return s;
    }
    return 0.0;
  };
  // Forward: hook i's blocks run from the end of its wait to the next hook's wait.
  double wait_s = 0;
  for (std::size_t i = 0; i < t.waits.size(); ++i) {
    const auto& w = t.waits[i];
    wait_s += (w.after_ms - w.before_ms) / 1e3;
    if (i + 1 < t.waits.size() && !w.blocks.empty()) {
      observe(w.blocks[0], Phase::Forward, std::max(0.0, t.waits[i + 1].before_ms - w.after_ms) / 1e3);
      for (std::size_t j = 1; j < w.blocks.size(); ++j) observe(w.blocks[j], Phase::Forward, 0.0);
    }
  }
  // Backward, last block first.
  std::vector<std::pair<std::int64_t, double>> bwd = t.backward_ms;
  std::sort(bwd.begin(), bwd.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  const auto& last = t.waits.back();
  for (std::size_t i = 0; i < bwd.size(); ++i) {
    const auto [b, at] = bwd[i];
    if (i == 0) {  // the last block: its forward, the loss and its backward together
      double both = std::max(0.0, at - last.after_ms) / 1e3;
      if (std::find(last.blocks.begin(), last.blocks.end(), b) != last.blocks.end()) {
        observe(b, Phase::Forward, both / 3);
        both *= 2.0 / 3.0;
      }
      observe(b, Phase::Backward, both);
      continue;
    }
    const auto [prev, prev_at] = bwd[i - 1];
    double s = (at - prev_at) / 1e3;
    if (!t.deferred) s -= gpu_of(prev);
    observe(b, Phase::Backward, std::max(0.0, s));
  }
  for (const auto& [phase, spans] : {std::make_pair(Phase::D2H, &t.d2h), std::make_pair(Phase::H2D, &t.h2d),
                                     std::make_pair(Phase::Cpu, &t.cpu)}) {
    for (const auto& [b, s] : service_times(*spans)) observe(b, phase, s);
  }
  const double end_bwd = bwd.back().second;  // block 0's (the lowest index's) gradients
  const double launch = std::isnan(t.launch_ms) ? end_bwd : t.launch_ms;
  const double deferred_gpu = t.deferred ? gpu_total : 0.0;
  if (sink) {
    sink->observe_overhead(std::max(0.0, launch - end_bwd) / 1e3,
                           std::max(0.0, (t.next_start_ms - launch) / 1e3 - deferred_gpu));
  }
  IterationSummary out;
  out.iter_gpu_s = t.next_start_ms / 1e3;
  out.gpu_wait_s = wait_s;
  out.gpu_wait_frac = out.iter_gpu_s > 0 ? wait_s / out.iter_gpu_s : 0.0;
  return out;
}

}  // namespace hytrain
