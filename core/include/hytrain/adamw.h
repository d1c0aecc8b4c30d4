// CPU AdamW: one fused, OpenMP-parallel pass over a flat fp32 tensor and its Adam states.
//
// Per element it reads the master weight p, m, v (and v_max for amsgrad) and the gradient (fp32,
// bf16 or fp16), multiplies the gradient by `grad_scale` (loss-scale unscaling times the clipping
// coefficient), updates m, v and p in place, and optionally writes a bf16/fp16 copy of the new weight
// (the copy that goes back to the GPU). The math follows torch.optim.AdamW / Adam (foreach=False):
//
//   g  = grad * grad_scale                   (+ weight_decay * p        for Adam's L2 decay)
//   p  = p * (1 - lr * weight_decay)         (AdamW's decoupled decay only)
//   m  = m + (1 - beta1) * (g - m)
//   v  = v * beta2 + (1 - beta2) * g * g
//   v_max = max(v_max, v)                    (amsgrad; the denominator then uses v_max)
//   p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// States are fp32; or compact: bf16 m and v beside the fp32 master, read widened, updated in fp32
// exactly as above and stored stochastically rounded (dtype.h: sr_mix; each tensor carries a seed,
// each parameter its own, and the index of its first element in the parameter, index_base, which
// with the step pick each element's random bits); or 8-bit: blockwise-quantised m and v
// (quant8.h), each block of 256 elements dequantised, updated in fp32 as above, its largest |m| and
// |v| kept as the block's new scales and the new m and v stored as their nearest codes.
#pragma once

#include <cstdint>

#include "hytrain/cpu_features.h"
#include "hytrain/dtype.h"

namespace hytrain {

// Hyperparameters in double, as PyTorch holds them; they are folded into float scalars once per step.
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t step = 1;        // 1-based step number used for bias correction
  bool decoupled = true;   // true: AdamW (decoupled decay); false: Adam with L2 decay
  bool amsgrad = false;
  double grad_scale = 1.0; // multiplier applied to every gradient element
  // Non-temporal stores for the outputs the update does not read (a weight copy that is not the
  // gradient buffer, out-of-place state): saves their write-allocate reads. Results are identical
  // either way; off only to measure what it buys.
  bool streaming_stores = true;
};

// Undo records: a speculative update done in place that can take itself back exactly.
//
// A speculative update (the step's gradient multiplier not known yet) may write the new state over
// the old one when it keeps what the old one was. Every step of the update can be run backwards from
// the new values and the gradient to within a few ulps; the record keeps, per element, how far the old
// value's bits are from that reconstruction: one signed byte each for p, m and v (fp32 states without
// amsgrad), against 12 bytes for a copy of the old state. The reconstruction is computed by the same
// instructions when the record is written and when it is read, so the old state comes back bit for
// bit. An element whose distance does not fit a byte (a moment crossing zero, a weight near zero, a
// non-finite gradient) keeps its old p, m and v in the escape list instead; once that is full, further
// such elements are left untouched (not updated), and the record is incomplete: such a pass cannot be
// adopted as the step's result, only taken back or redone.
//
//   dp[i]: the distance of p, or kEscaped (old values in escapes) or kUntouched (not updated)
//   dm[i], dv[i]: the distances of m and v (0 for escaped and untouched elements)
struct UndoEntry {
  uint32_t index;  // the element's index_base + offset in its tensor
  float p, m, v;
};
constexpr int8_t kEscaped = -128;
constexpr int8_t kUntouched = -127;
constexpr int32_t kMinDistance = -126;  // distances that fit: [kMinDistance, 127]

struct UndoRecord {
  int8_t* dp = nullptr;
  int8_t* dm = nullptr;
  int8_t* dv = nullptr;
  UndoEntry* escapes = nullptr;
  int64_t capacity = 0;         // entries in `escapes`
  int64_t* counters = nullptr;  // [0] escape entries claimed (may pass capacity), [1] elements untouched
};

// What an update does with its record: none; write (a speculative update in place, keeping the
// record); undo (the state as before that update); redo (undo, then the update with this job's
// config: the step's multiplier and hyperparameters). undo and redo run the reconstruction with
// record_config, the config of the update that wrote the record.
enum class RecordMode : int32_t { none = 0, write = 1, undo = 2, redo = 3 };

// Escape entries a record of n elements gets: one per 128 elements (1/8 byte per element), at least 64.
inline int64_t undo_capacity(int64_t n) { return n / 128 > 64 ? n / 128 : 64; }

struct AdamWTensor {
  float* param = nullptr;
  void* exp_avg = nullptr;          // state_dtype elements
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;   // required when amsgrad (fp32 states only)
  const void* grad = nullptr;
  DType grad_dtype = DType::f32;
  void* param_copy = nullptr;       // optional bf16/fp16 copy of the updated weight; may be the
                                    // grad buffer itself (each gradient is read before its copy is written)
  DType param_copy_dtype = DType::bf16;
  int64_t numel = 0;
  // Optional destinations of the new master weight and states (all three, or none: in place), e.g.
  // a speculative update that must leave the current state intact. max_exp_avg_sq_out is required
  // with them when amsgrad. Inputs and outputs are either the same memory or disjoint.
  float* param_out = nullptr;
  void* exp_avg_out = nullptr;
  void* exp_avg_sq_out = nullptr;
  void* max_exp_avg_sq_out = nullptr;
  DType state_dtype = DType::f32;   // of exp_avg, exp_avg_sq and their outputs: f32, bf16 or q8
  uint32_t seed = 0;                // bf16 states: the parameter's stochastic-rounding seed
  int64_t index_base = 0;           // the parameter index of element 0 of this tensor (a slice's)
  // q8 states: the parameter's element count, which places the block scales after its codes in each
  // moment's buffer (quant8.h); 0 means index_base + numel (a whole tensor). A q8 range starts on a
  // block boundary of the parameter (index_base + begin a multiple of kQ8Block).
  int64_t state_numel = 0;
  // Undo records (above): fp32 states without amsgrad, in place; param_copy, if any, is not the
  // gradient (undo and redo read the gradient again).
  RecordMode record_mode = RecordMode::none;
  UndoRecord record{};
  AdamWConfig record_config{};
};

inline int64_t dtype_bytes(DType t) { return t == DType::f32 ? 4 : (t == DType::q8 ? 1 : 2); }
// p advanced by n elements of dtype t.
inline void* offset_by(void* p, DType t, int64_t n) {
  return p ? static_cast<char*>(p) + n * dtype_bytes(t) : nullptr;
}

// Scalars derived once per step from AdamWConfig (bias corrections folded in, computed in double as
// PyTorch computes them in Python, then rounded to float).
struct AdamWScalars {
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float weight_decay;      // L2 coefficient (Adam) or 0
  float param_decay;       // 1 - lr * weight_decay (AdamW) or 1
  float neg_step_size;     // -lr / (1 - beta1^t)
  float bias_correction2_sqrt;
  // 8-bit states divide once: p + q8_neg_step * m / (sqrt(v) + q8_eps), i.e. neg_step_size and eps
  // times sqrt(1 - beta2^t), each product rounded once from double.
  float q8_neg_step, q8_eps;
  float grad_scale;
  uint32_t sr_key;         // sr_key(seed, step): set per tensor (bf16 states)
  bool amsgrad;
  bool streaming_stores;
};

// Throws hytrain::Error naming the first out-of-range hyperparameter.
void validate_adamw_config(const AdamWConfig& cfg);
// Throws hytrain::Error naming what is wrong with a job's hyperparameters or pointers.
void validate_adamw_job(const AdamWTensor& t, const AdamWConfig& cfg);
// seed: the tensor's stochastic-rounding seed (bf16 states; any value for fp32 ones).
AdamWScalars make_adamw_scalars(const AdamWConfig& cfg, uint32_t seed = 0);

// Updates one tensor in place. Returns true when any gradient element was non-finite (the update is
// still applied: callers that must skip on overflow check first). num_threads <= 0 means OpenMP's
// default. Throws hytrain::Error on invalid arguments.
bool adamw_step(const AdamWTensor& t, const AdamWConfig& cfg, int num_threads = 0,
                SimdPath path = SimdPath::automatic);

// Which outputs an update of [begin, end) writes with streaming stores on a path of `lanes` fp32
// lanes: the new state when out of place (each output distinct from its input), the weight copy when
// it is not the gradient buffer; each only when enabled, the range is long enough to stream
// (kStreamMin elements) and its outputs are aligned to the vector at `begin`.
struct StreamPlan {
  bool state = false;
  bool copy = false;
};
constexpr int64_t kStreamMin = 1 << 14;
StreamPlan stream_plan(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end, int lanes);
// The same for a whole-tensor adamw_step on `path` (single-threaded; threaded pieces start on whole
// cache lines, so they stream when the whole does).
StreamPlan adamw_stream_plan(const AdamWTensor& t, const AdamWConfig& cfg, SimdPath path = SimdPath::automatic);

// Range kernels, one per SIMD translation unit; [begin, end) of the tensor, single-threaded.
// Return true when a non-finite gradient element was seen.
struct Q8Map;  // quant8.h

namespace kernels {
bool adamw_range_scalar(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end);
bool adamw_range_avx2(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end);
bool adamw_range_avx512(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end);
bool adamw_range_avx512vbmi(const AdamWTensor& t, const AdamWScalars& s, int64_t begin, int64_t end);
// The 8-bit encoders alone (q8_encode_with below).
void q8_encode_avx512(const Q8Map& map, const float* in, float inv, uint8_t* codes, int64_t n);
void q8_encode_avx512vbmi(const Q8Map& map, const float* in, float inv, uint8_t* codes, int64_t n);
}  // namespace kernels

// For tests: a vector path's 8-bit encoder alone, codes[i] = the code of in[i] * inv, n a multiple of
// 256 (the VBMI path with q8_encoder()'s choice). False where this build has no such encoder for
// `path` (the scalar and AVX2 paths, or a non-x86 build); call only where cpu_supports(path).
bool q8_encode_with(SimdPath path, const Q8Map& map, const float* in, float inv, uint8_t* codes, int64_t n);

}  // namespace hytrain
