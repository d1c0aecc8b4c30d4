// Undo records (adamw.h): a speculative update in place that can take itself back. On every compiled
// SIMD path the CPU runs, odd sizes, fp32 and bf16 gradients, AdamW and Adam, one and several
// threads, and through the UpdateEngine's slices:
//   - a write gives bit for bit the state and weights of a plain update (elements left untouched,
//     when the escape list is full, keep their old state and weight);
//   - an undo gives back the state before the write, bit for bit, whatever the inputs (zeros,
//     weights near zero, moments crossing zero, non-finite gradients, a full escape list);
//   - a redo with another multiplier and learning rate gives bit for bit a plain update from the old
//     state with them;
//   - what the record refuses (8-bit or bf16 states, amsgrad, weights written over the gradient).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <vector>

#include "check.h"
#include "simd_paths.h"
#include "hytrain/adamw.h"
#include "hytrain/dtype.h"
#include "hytrain/error.h"
#include "hytrain/update_engine.h"

using namespace hytrain;

namespace {

// 64-byte aligned buffers, as the pool gives: the streaming stores of a write need them.
template <class T>
struct AlignedAlloc {
  using value_type = T;
  AlignedAlloc() = default;
  template <class U>
  AlignedAlloc(const AlignedAlloc<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const AlignedAlloc&) const { return true; }
  bool operator!=(const AlignedAlloc&) const { return false; }
};
template <class T>
using AVec = std::vector<T, AlignedAlloc<T>>;

struct State {
  AVec<float> p, m, v;
  AVec<uint16_t> copy;
};

struct Case {
  State s;
  std::vector<float> g32;
  std::vector<uint16_t> g16;
  DType gd = DType::bf16;
  const void* grad() const { return gd == DType::f32 ? static_cast<const void*>(g32.data()) : g16.data(); }
};

// A state as training leaves it: weights ~ N(0, 0.02) with exact zeros and values near zero, m and
// v of a gradient ~ N(0, 1e-3), some never touched (zero), and gradients with spikes; `bad` puts
// non-finite gradients in.
Case make_case(int64_t n, DType gd, uint32_t seed, bool bad = false) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  Case c;
  c.gd = gd;
  c.s.p.resize(n), c.s.m.resize(n), c.s.v.resize(n), c.s.copy.assign(n, 0);
  c.g32.resize(n), c.g16.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const float u = uni(rng);
    c.s.p[i] = u < 0.01f ? 0.0f : (u < 0.02f ? 1e-7f * normal(rng) : 0.02f * normal(rng));
    const float gs = 1e-3f * normal(rng);
    c.s.m[i] = u > 0.98f ? 0.0f : 0.3f * gs;
    c.s.v[i] = u > 0.98f ? 0.0f : 1e-6f * (0.5f + uni(rng));
    float g = 1e-3f * normal(rng) * (uni(rng) < 0.01f ? 300.0f : 1.0f);
    if (bad && uni(rng) < 0.001f) g = uni(rng) < 0.5f ? std::numeric_limits<float>::quiet_NaN() : INFINITY;
    c.g32[i] = g;
    c.g16[i] = f32_to_bf16(g);
  }
  return c;
}

AdamWConfig config(int64_t step, double lr, double scale, bool decoupled);

// A state as training leaves it: weights ~ N(0, 0.02), then `steps` AdamW steps of gradient noise
// (m crossing zero, v of the noise's scale), and the next gradient.
Case make_trained(int64_t n, int steps, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Case c;
  c.gd = DType::bf16;
  c.s.p.resize(n), c.s.m.assign(n, 0.0f), c.s.v.assign(n, 0.0f), c.s.copy.assign(n, 0);
  c.g32.resize(n), c.g16.resize(n);
  for (auto& x : c.s.p) x = 0.02f * normal(rng);
  for (int k = 0; k <= steps; ++k) {
    for (int64_t i = 0; i < n; ++i) c.g16[i] = f32_to_bf16(1e-3f * normal(rng));
    if (k == steps) break;
    AdamWTensor t;
    t.param = c.s.p.data(), t.exp_avg = c.s.m.data(), t.exp_avg_sq = c.s.v.data();
    t.grad = c.g16.data(), t.grad_dtype = DType::bf16, t.numel = n;
    adamw_step(t, config(k + 1, 3e-4, 1.0, true));
  }
  return c;
}

AdamWConfig config(int64_t step, double lr, double scale, bool decoupled) {
  AdamWConfig c;
  c.lr = lr;
  c.weight_decay = 0.1;
  c.step = step;
  c.grad_scale = scale;
  c.decoupled = decoupled;
  return c;
}

struct Record {
  AVec<int8_t> dp, dm, dv;
  std::vector<UndoEntry> esc;
  int64_t counters[2] = {0, 0};
  UndoRecord view(int64_t capacity) {
    UndoRecord r;
    r.dp = dp.data(), r.dm = dm.data(), r.dv = dv.data();
    r.escapes = esc.data();
    r.capacity = capacity;
    r.counters = counters;
    return r;
  }
  explicit Record(int64_t n) : dp(n), dm(n), dv(n), esc(undo_capacity(n)) {}
};

AdamWTensor tensor(State& s, const Case& c) {
  AdamWTensor t;
  t.param = s.p.data();
  t.exp_avg = s.m.data();
  t.exp_avg_sq = s.v.data();
  t.grad = c.grad();
  t.grad_dtype = c.gd;
  t.param_copy = c.gd == DType::f32 ? nullptr : s.copy.data();
  t.param_copy_dtype = DType::bf16;
  t.numel = static_cast<int64_t>(s.p.size());
  return t;
}

bool same_bits(const AVec<float>& a, const AVec<float>& b, int64_t* first = nullptr) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0) {
      if (first) *first = static_cast<int64_t>(i);
      return false;
    }
  }
  return true;
}

void check_state(const State& got, const State& want, bool copy, const char* what, SimdPath path, int64_t n) {
  int64_t at = -1;
  const bool ok = same_bits(got.p, want.p, &at) && same_bits(got.m, want.m, &at) && same_bits(got.v, want.v, &at) &&
                  (!copy || got.copy == want.copy);
  if (!ok) {
    std::printf("  %s differs: path %s, n %lld, element %lld\n", what, simd_path_name(path),
                static_cast<long long>(n), static_cast<long long>(at));
  }
  CHECK(ok);
}

// One write then undo, and one write then redo, against plain updates.
void round_trip_of(const Case& c, SimdPath path, int threads, bool decoupled, int64_t capacity,
                   double* escaped = nullptr);

void round_trip(int64_t n, DType gd, SimdPath path, int threads, bool decoupled, int64_t capacity, bool bad,
                uint32_t seed) {
  round_trip_of(make_case(n, gd, seed, bad), path, threads, decoupled, capacity);
}

void round_trip_of(const Case& c, SimdPath path, int threads, bool decoupled, int64_t capacity, double* escaped) {
  const int64_t n = static_cast<int64_t>(c.s.p.size());
  const DType gd = c.gd;
  const AdamWConfig spec = config(7, 1e-3, 1.0, decoupled);
  const AdamWConfig step = config(7, 2e-3, 0.37, decoupled);

  State plain = c.s;  // the update a write must equal (where it updated)
  adamw_step(tensor(plain, c), spec, threads, path);

  Record r(n);
  State s = c.s;
  AdamWTensor t = tensor(s, c);
  t.record_mode = RecordMode::write;
  t.record = r.view(capacity);
  adamw_step(t, spec, threads, path);
  {  // the same without streaming stores (large aligned ranges stream the distances and copy)
    Record r2(n);
    State s2 = c.s;
    AdamWTensor t2 = tensor(s2, c);
    t2.record_mode = RecordMode::write;
    t2.record = r2.view(capacity);
    AdamWConfig plain_stores = spec;
    plain_stores.streaming_stores = false;
    adamw_step(t2, plain_stores, threads, path);
    // (With a full escape list, which elements got entries depends on the threads' timing.)
    if (r.counters[1] == 0 && r2.counters[1] == 0) {
      CHECK(same_bits(s2.p, s.p) && s2.copy == s.copy && r2.dp == r.dp && r2.dm == r.dm && r2.dv == r.dv);
    }
  }
  int64_t untouched = 0;
  State want = plain;
  for (int64_t i = 0; i < n; ++i) {
    if (r.dp[i] == kUntouched) {
      ++untouched;
      want.p[i] = c.s.p[i], want.m[i] = c.s.m[i], want.v[i] = c.s.v[i];
      want.copy[i] = f32_to_bf16(c.s.p[i]);
    }
  }
  CHECK(untouched == r.counters[1]);
  CHECK(std::min(r.counters[0], capacity) + untouched >= 0);
  check_state(s, want, gd != DType::f32, "write", path, n);
  if (escaped) *escaped = static_cast<double>(r.counters[0]) / static_cast<double>(n);

  State back = s;  // undo
  AdamWTensor u = tensor(back, c);
  u.record_mode = RecordMode::undo;
  u.record = r.view(capacity);
  u.record_config = spec;
  adamw_step(u, spec, threads, path);
  check_state(back, c.s, false, "undo", path, n);

  State redo = s;  // redo with the step's multiplier and lr
  AdamWTensor d = tensor(redo, c);
  d.record_mode = RecordMode::redo;
  d.record = r.view(capacity);
  d.record_config = spec;
  adamw_step(d, step, threads, path);
  State want_redo = c.s;
  adamw_step(tensor(want_redo, c), step, threads, path);
  check_state(redo, want_redo, gd != DType::f32, "redo", path, n);
}

}  // namespace

TEST(write_undo_and_redo_are_exact_on_every_path) {
  const int64_t sizes[] = {1, 7, 16, 17, 33, 1000, 40001};
  uint32_t seed = 1;
  for (SimdPath path : runnable_paths()) {
    for (int64_t n : sizes) {
      for (DType gd : {DType::bf16, DType::f32}) {
        for (bool decoupled : {true, false}) {
          round_trip(n, gd, path, 1, decoupled, undo_capacity(n), false, seed++);
        }
      }
    }
  }
}

TEST(a_trained_state_keeps_within_its_escape_list) {
  const Case c = make_trained(300007, 20, 77);
  for (SimdPath path : runnable_paths()) {
    double escaped = 0;
    round_trip_of(c, path, 3, true, undo_capacity(300007), &escaped);
    std::printf("  %s: %.4f %% of elements escaped\n", simd_path_name(path), 100.0 * escaped);
    CHECK(escaped < 0.25 / 128);  // a quarter of the list at most
  }
}

TEST(the_adversarial_state_escapes_more_and_comes_back_all_the_same) {
  for (SimdPath path : runnable_paths()) {
    double escaped = 0;
    round_trip_of(make_case(300007, DType::bf16, 78), path, 3, true, undo_capacity(300007), &escaped);
    std::printf("  %s: %.4f %% of elements escaped\n", simd_path_name(path), 100.0 * escaped);
  }
}

TEST(non_finite_gradients_and_full_escape_lists) {
  for (SimdPath path : runnable_paths()) {
    round_trip(5003, DType::bf16, path, 1, true, undo_capacity(5003), true, 5);
    for (int64_t capacity : {0, 3}) {  // elements that do not fit are left untouched
      round_trip(5003, DType::bf16, path, 2, true, capacity, true, 6);
      round_trip(5003, DType::f32, path, 1, false, capacity, false, 8);
    }
  }
}

TEST(slices_of_the_update_engine) {
  const int64_t n = 100003;
  const Case c = make_case(n, DType::bf16, 11);
  const AdamWConfig spec = config(3, 1e-3, 1.0, true);
  Record r(n);
  State s = c.s;
  AdamWTensor t = tensor(s, c);
  t.record_mode = RecordMode::write;
  t.record = r.view(undo_capacity(n));
  {
    UpdateEngine engine(3, 4099);  // odd slices: escape entries and codes of every slice
    engine.submit(0, {UpdateJob{t, spec}});
    engine.wait(0);
    AdamWTensor u = tensor(s, c);
    u.record_mode = RecordMode::undo;
    u.record = r.view(undo_capacity(n));
    u.record_config = spec;
    engine.submit(1, {UpdateJob{u, spec}});
    engine.wait(1);
  }
  check_state(s, c.s, false, "undo after engine slices", SimdPath::automatic, n);
}

TEST(what_a_record_refuses) {
  const int64_t n = 64;
  Case c = make_case(n, DType::bf16, 3);
  Record r(n);
  State s = c.s;
  std::vector<float> vmax(n, 0.0f);
  const auto refused = [&](AdamWTensor t, AdamWConfig cfg, const char* what) {
    bool threw = false;
    try {
      adamw_step(t, cfg);
    } catch (const Error& e) {
      threw = std::strstr(e.what(), what) != nullptr;
      if (!threw) std::printf("  message: %s\n", e.what());
    }
    CHECK(threw);
  };
  AdamWTensor t = tensor(s, c);
  t.record_mode = RecordMode::write;
  t.record = r.view(undo_capacity(n));
  AdamWConfig ams = config(1, 1e-3, 1.0, true);
  ams.amsgrad = true;
  AdamWTensor a = t;
  a.max_exp_avg_sq = vmax.data();
  refused(a, ams, "without amsgrad");
  AdamWTensor b = t;
  b.state_dtype = DType::bf16;
  refused(b, config(1, 1e-3, 1.0, true), "float32 states");
  AdamWTensor over = t;
  over.param_copy = const_cast<void*>(over.grad);
  refused(over, config(1, 1e-3, 1.0, true), "over its gradient");
  AdamWTensor none = t;
  none.record.counters = nullptr;
  refused(none, config(1, 1e-3, 1.0, true), "counters");
  CHECK(s.p == c.s.p);  // nothing was written
}

int main() { return hytest::run_all(); }
