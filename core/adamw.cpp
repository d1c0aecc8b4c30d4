// AdamW dispatch: validates the arguments, folds the bias corrections into scalars, picks the SIMD
// range kernel and splits the tensor across OpenMP threads in contiguous, cache-line-aligned pieces
// (one piece per thread: each thread streams its own region, which also keeps first-touch pages
// local). Small tensors run on the calling thread, where a parallel region would cost more than it
// saves.
#include "hytrain/adamw.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "hytrain/error.h"
#include "hytrain/quant8.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace hytrain {

namespace {

using RangeFn = bool (*)(const AdamWTensor&, const AdamWScalars&, int64_t, int64_t);

RangeFn range_kernel(SimdPath path) {
  switch (resolve_simd_path(path)) {
#ifdef HYTRAIN_HAVE_AVX512
    case SimdPath::avx512: return kernels::adamw_range_avx512;
    case SimdPath::avx512vbmi: return kernels::adamw_range_avx512vbmi;
#endif
#ifdef HYTRAIN_HAVE_AVX2
    case SimdPath::avx2: return kernels::adamw_range_avx2;
#endif
    default: return kernels::adamw_range_scalar;
  }
}

}  // namespace

bool q8_encode_with(SimdPath path, const Q8Map& map, const float* in, float inv, uint8_t* codes, int64_t n) {
  HYTRAIN_CHECK(n % kQ8Block == 0, "q8_encode_with: n must be a multiple of 256");
#ifdef HYTRAIN_HAVE_AVX512
  if (path == SimdPath::avx512) return kernels::q8_encode_avx512(map, in, inv, codes, n), true;
  if (path == SimdPath::avx512vbmi) return kernels::q8_encode_avx512vbmi(map, in, inv, codes, n), true;
#endif
  (void)map, (void)in, (void)inv, (void)codes, (void)path;
  return false;
}

namespace {

constexpr int64_t kSerialBelow = 1 << 15;  // elements; below this one thread is faster
constexpr int64_t kPieceAlign = 64;        // elements: 256 B of fp32, whole cache lines

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

StreamPlan stream_plan(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end, int lanes) {
  StreamPlan plan;
  if (!s.streaming_stores || lanes <= 1 || end - begin < kStreamMin) return plan;
  const int64_t vec = int64_t{lanes} * 4;
  const int64_t svec = int64_t{lanes} * dtype_bytes(t.state_dtype);
  if (t.param_out != nullptr) {
    plan.state = t.param_out != t.param && t.exp_avg_out != t.exp_avg && t.exp_avg_sq_out != t.exp_avg_sq &&
                 aligned(t.param_out + begin, vec) && aligned(offset_by(t.exp_avg_out, t.state_dtype, begin), svec) &&
                 aligned(offset_by(t.exp_avg_sq_out, t.state_dtype, begin), svec);
    if (s.amsgrad) {
      plan.state = plan.state && t.max_exp_avg_sq_out != t.max_exp_avg_sq &&
                   aligned(offset_by(t.max_exp_avg_sq_out, DType::f32, begin), vec);
    }
  }
  plan.copy = t.param_copy != nullptr && t.param_copy != t.grad &&
              aligned(static_cast<const uint16_t*>(t.param_copy) + begin, vec / 2);
  return plan;
}

StreamPlan adamw_stream_plan(const AdamWTensor& t, const AdamWConfig& cfg, SimdPath path) {
  int lanes = 1;
  switch (resolve_simd_path(path)) {
    case SimdPath::avx512:
    case SimdPath::avx512vbmi: lanes = 16; break;
    case SimdPath::avx2: lanes = 8; break;
    default: break;
  }
  return stream_plan(t, make_adamw_scalars(cfg, t.seed), 0, t.numel, lanes);
}

void validate_adamw_config(const AdamWConfig& c) {
  auto finite_nonneg = [](double x) { return std::isfinite(x) && x >= 0.0; };
  HYTRAIN_CHECK(finite_nonneg(c.lr), "lr must be finite and >= 0");
  HYTRAIN_CHECK(c.beta1 >= 0.0 && c.beta1 < 1.0, "beta1 must be in [0, 1)");
  HYTRAIN_CHECK(c.beta2 >= 0.0 && c.beta2 < 1.0, "beta2 must be in [0, 1)");
  HYTRAIN_CHECK(std::isfinite(c.eps) && c.eps >= 0.0, "eps must be finite and >= 0");
  HYTRAIN_CHECK(finite_nonneg(c.weight_decay), "weight_decay must be finite and >= 0");
  HYTRAIN_CHECK(std::isfinite(c.grad_scale), "grad_scale must be finite");
  HYTRAIN_CHECK(c.step >= 1, "step must be >= 1, got " + std::to_string(c.step));
}


AdamWScalars make_adamw_scalars(const AdamWConfig& c, uint32_t seed) {
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(c.step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(c.step));
  auto f = [](double x) { return static_cast<float>(x); };
  AdamWScalars s{};
  s.lr = f(c.lr);
  s.beta1 = f(c.beta1);
  s.beta2 = f(c.beta2);
  s.one_minus_beta1 = f(1.0 - c.beta1);
  s.one_minus_beta2 = f(1.0 - c.beta2);
  s.eps = f(c.eps);
  s.weight_decay = c.decoupled ? 0.0f : f(c.weight_decay);
  s.param_decay = c.decoupled ? f(1.0 - c.lr * c.weight_decay) : 1.0f;
  s.neg_step_size = f(-c.lr / bc1);
  s.bias_correction2_sqrt = f(std::sqrt(bc2));
  s.q8_neg_step = f(-c.lr / bc1 * std::sqrt(bc2));
  s.q8_eps = f(c.eps * std::sqrt(bc2));
  s.grad_scale = f(c.grad_scale);
  s.sr_key = sr_key(seed, c.step);
  s.amsgrad = c.amsgrad;
  s.streaming_stores = c.streaming_stores;
  return s;
}

void validate_adamw_job(const AdamWTensor& t, const AdamWConfig& cfg) {
  validate_adamw_config(cfg);
  HYTRAIN_CHECK(t.numel >= 0, "numel must be >= 0");
  if (t.numel == 0) return;
  HYTRAIN_CHECK(t.param && t.exp_avg && t.exp_avg_sq && t.grad,
                "param, exp_avg, exp_avg_sq and grad must be non-null");
  HYTRAIN_CHECK(t.state_dtype == DType::f32 || t.state_dtype == DType::bf16 || t.state_dtype == DType::q8,
                "exp_avg and exp_avg_sq must be float32, bfloat16 or 8-bit");
  if (t.state_dtype == DType::q8) {
    q8_encoder();  // resolved here, not on a kernel thread: a bad HYTRAIN_Q8_ENCODER throws before any write
    HYTRAIN_CHECK(t.index_base >= 0 && t.index_base % range_granule(t.state_dtype) == 0,
                  "8-bit states: a tensor starts on a block boundary (index_base a multiple of 256)");
    HYTRAIN_CHECK(t.state_numel == 0 || t.state_numel >= t.index_base + t.numel,
                  "8-bit states: state_numel is smaller than the tensor");
  }
  HYTRAIN_CHECK(!cfg.amsgrad || t.state_dtype == DType::f32, "amsgrad needs float32 states");
  HYTRAIN_CHECK(!cfg.amsgrad || t.max_exp_avg_sq, "amsgrad needs max_exp_avg_sq");
  HYTRAIN_CHECK(t.grad_dtype != DType::q8, "grad must be float32, bfloat16 or float16");
  HYTRAIN_CHECK(t.param_copy == nullptr || t.param_copy_dtype == DType::bf16 || t.param_copy_dtype == DType::f16,
                "param_copy must be bfloat16 or float16");
  HYTRAIN_CHECK((t.param_out == nullptr && t.exp_avg_out == nullptr && t.exp_avg_sq_out == nullptr &&
                 t.max_exp_avg_sq_out == nullptr) ||
                    (t.param_out && t.exp_avg_out && t.exp_avg_sq_out && (!cfg.amsgrad || t.max_exp_avg_sq_out)),
                "param_out, exp_avg_out and exp_avg_sq_out (and max_exp_avg_sq_out with amsgrad) are "
                "given together or not at all");
  if (t.record_mode != RecordMode::none) {
    const UndoRecord& r = t.record;
    HYTRAIN_CHECK(t.state_dtype == DType::f32 && !cfg.amsgrad && !t.record_config.amsgrad,
                  "an undo record needs float32 states without amsgrad");
    HYTRAIN_CHECK(t.param_out == nullptr, "an update with an undo record is in place");
    HYTRAIN_CHECK(r.dp && r.dm && r.dv && r.counters && (r.escapes || r.capacity == 0) && r.capacity >= 0,
                  "an undo record needs its distances, escape list and counters");
    HYTRAIN_CHECK(t.index_base >= 0 && t.index_base + t.numel <= (int64_t{1} << 32),
                  "an undo record indexes at most 2^32 elements");
    HYTRAIN_CHECK(t.param_copy == nullptr || t.param_copy != t.grad,
                  "an update with an undo record cannot write its weights over its gradient");
    if (t.record_mode != RecordMode::write) validate_adamw_config(t.record_config);
  }
}

bool adamw_step(const AdamWTensor& t, const AdamWConfig& cfg, int num_threads, SimdPath path) {
  validate_adamw_job(t, cfg);
  const RangeFn kernel = range_kernel(path);
  if (t.numel == 0) return false;
  const AdamWScalars s = make_adamw_scalars(cfg, t.seed);

  int threads = 1;
#ifdef _OPENMP
  threads = num_threads > 0 ? num_threads : omp_get_max_threads();
#endif
  if (threads <= 1 || t.numel < kSerialBelow) return kernel(t, s, 0, t.numel);

  int nonfinite = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : nonfinite)
  {
    // Contiguous pieces of whole cache lines, sized by the team OpenMP actually gave us.
    const int64_t team = omp_get_num_threads();
    const int64_t per = (t.numel + team - 1) / team;
    const int64_t align = std::max(kPieceAlign, range_granule(t.state_dtype));  // both powers of two
    const int64_t piece = (per + align - 1) / align * align;
    const int64_t b = omp_get_thread_num() * piece;
    const int64_t e = b + piece < t.numel ? b + piece : t.numel;
    if (b < e) nonfinite |= kernel(t, s, b, e) ? 1 : 0;
  }
#endif
  return nonfinite != 0;
}

}  // namespace hytrain
