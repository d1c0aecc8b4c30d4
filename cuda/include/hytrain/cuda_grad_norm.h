// Gradient norm and non-finite detection on the GPU, for a fixed list of fp32/bf16/fp16 tensors.
//
// accumulate() adds the sum of squares of every element to a device fp32 scalar and sets a device
// found_inf flag to 1 when any element is NaN or infinite. The order of every addition is fixed by the
// tensor list alone (chunk partials in a fixed tree, then a fixed final reduction), never by the grid
// or by timing, so the result is bitwise reproducible. It is cheap enough to run per pipeline block as
// that block's gradients become ready, accumulating into one buffer.
//
// clip_multiplier() turns the accumulated sum of squares into the AdamW gradient multiplier (unscale
// times torch.nn.utils.clip_grad_norm_'s coefficient) without leaving the device.
#pragma once

#include <cstdint>
#include <vector>

#include "hytrain/dtype.h"

namespace hytrain {
namespace cuda {

struct GradRef {
  const void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::f32;
};

class GradNormGroup {
 public:
  GradNormGroup(const std::vector<GradRef>& tensors, int device);
  ~GradNormGroup();
  GradNormGroup(const GradNormGroup&) = delete;
  GradNormGroup& operator=(const GradNormGroup&) = delete;

  // *sumsq += sum(x^2) over every element, and *found_inf = 1 when any element is non-finite (left
  // untouched otherwise); both are device pointers to one float. found_inf may be null. The group
  // owns one partials buffer: keep its calls on one stream (or ordered between streams).
  void accumulate(float* sumsq, float* found_inf, std::uintptr_t stream);

  int64_t numel() const { return numel_; }

 private:
  void* descs_ = nullptr;     // device GradRef + vector flag per tensor
  void* chunks_ = nullptr;    // device chunk table
  float* partials_ = nullptr; // one partial per chunk
  int64_t num_chunks_ = 0;
  int64_t numel_ = 0;
  int device_;
  int grid_;
};

// *out = inv_scale * min(1, max_norm / (sqrt(*sumsq) * inv_scale + 1e-6)), where inv_scale is
// *inv_scale_ptr (or 1 when null) times host_inv_scale: the norm is that of the unscaled gradients,
// exactly as clip_grad_norm_ after GradScaler.unscale_. max_norm <= 0 means no clipping.
void clip_multiplier(const float* sumsq, const float* inv_scale_ptr, float host_inv_scale,
                     float max_norm, float* out, int device, std::uintptr_t stream);

}  // namespace cuda
}  // namespace hytrain
