// Fused multi-tensor AdamW on the GPU: one launch updates a whole list of tensors (fp32 master
// weight, m, v -- fp32, bf16 stochastically rounded as on the CPU, or 8-bit blockwise as on the
// CPU, quant8.h -- resident on the device), reading fp32/bf16/fp16 gradients and writing the
// bf16/fp16 model weight in place. The math is the CPU kernel's, operation for operation with the same fused
// multiply-adds and correctly rounded sqrt/divide, so a block gives bit-identical results on either
// side and can move between them without changing the training trajectory.
//
// The gradient multiplier (unscale times clip coefficient) and a non-finite flag are read from device
// memory, so no host synchronisation is needed: a non-zero flag turns the launch into a no-op.
#pragma once

#include <cstdint>
#include <vector>

#include "hytrain/adamw.h"

namespace hytrain {
namespace cuda {

struct AdamWTensorRef {
  float* param = nullptr;
  void* exp_avg = nullptr;          // the group's state dtype
  void* exp_avg_sq = nullptr;
  void* max_exp_avg_sq = nullptr;   // amsgrad only (fp32)
  const void* grad = nullptr;
  void* weight = nullptr;           // the model's bf16/fp16 weight, or null
  int64_t numel = 0;
  uint32_t seed = 0;                // bf16 states: the stochastic-rounding seed (the CPU's)
};

// A fixed list of tensors on one device, with its chunk table uploaded once at construction.
class AdamWGroup {
 public:
  // state_dtype: f32, bf16 m and v (compact states, rounded as the CPU kernel rounds them) or q8
  // (each moment one buffer of q8_state_bytes(numel), quantised as the CPU kernel quantises).
  AdamWGroup(const std::vector<AdamWTensorRef>& tensors, DType grad_dtype, bool has_weight,
             DType weight_dtype, bool amsgrad, int device, DType state_dtype = DType::f32);
  ~AdamWGroup();
  AdamWGroup(const AdamWGroup&) = delete;
  AdamWGroup& operator=(const AdamWGroup&) = delete;

  // Enqueues one step on `stream` (a cudaStream_t; 0 = legacy default). `grad_scale` and
  // `found_inf` are device pointers to one float each, or null (scale 1, never skip). cfg.grad_scale
  // multiplies on top of *grad_scale. cfg.amsgrad must match the group's.
  void step(const AdamWConfig& cfg, const float* grad_scale, const float* found_inf,
            std::uintptr_t stream);

  int64_t numel() const { return numel_; }
  int64_t num_tensors() const { return num_tensors_; }

 private:
  void* descs_ = nullptr;   // device AdamWTensorRef[num_tensors_]
  void* chunks_ = nullptr;  // device chunk table
  void* q8_ = nullptr;      // q8 states: the maps' values and midpoints (device)
  int64_t num_chunks_ = 0;
  int64_t num_tensors_ = 0;
  int64_t numel_ = 0;
  DType grad_dtype_;
  bool has_weight_;
  DType weight_dtype_;
  bool amsgrad_;
  DType state_dtype_;
  bool vectorized_;
  int device_;
  int grid_;
};

}  // namespace cuda
}  // namespace hytrain
