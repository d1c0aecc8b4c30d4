// Deterministic sum of squares and non-finite detection. Pass 1: each chunk of kChunk elements is
// reduced by one block (fixed per-thread element sets, fixed shared-memory tree) into partials[chunk];
// a persistent grid strides over chunks, so the grid size never changes a partial. Pass 2: one block
// folds the partials in a fixed order (in double) and adds the total to the caller's fp32 scalar.
#include <algorithm>

#include "block_sum.cuh"
#include "cuda_check.h"
#include "dtype_convert.cuh"
#include "hytrain/cuda_grad_norm.h"
#include "hytrain/error.h"

namespace hytrain {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kFinalThreads = 512;
constexpr int64_t kChunk = 32768;  // elements per chunk: 128 per thread

struct Desc {
  const void* data;
  int64_t numel;
  DType dtype;
  bool vec;  // 16-byte loads: data is 16-byte aligned
};

struct Chunk {
  int64_t tensor;
  int64_t start;
};

template <DType D>
__device__ __forceinline__ float load(const void* p, int64_t i) {
  if constexpr (D == DType::f32) {
    return static_cast<const float*>(p)[i];
  } else {
    return widen<D>(static_cast<const uint16_t*>(p)[i]);
  }
}

__device__ __forceinline__ void add_square(float x, float& acc, bool& bad) {
  bad |= !isfinite(x);
  acc = __fmaf_rn(x, x, acc);
}

// Sum of squares of t[start, end) as this thread sees it: 16-byte groups strided by the block, then a
// scalar tail. The element-to-thread map depends only on (start, end), so the result is reproducible.
template <DType D>
__device__ float thread_sum(const Desc& t, int64_t start, int64_t end, bool& bad) {
  constexpr int kPer = D == DType::f32 ? 4 : 8;  // elements per 16 bytes
  float acc = 0.0f;
  int64_t i = start;
  if (t.vec) {
    const int64_t vec_end = start + (end - start) / kPer * kPer;
    for (int64_t j = start + threadIdx.x * kPer; j < vec_end; j += kThreads * kPer) {
      const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const char*>(t.data) +
                                                      j * (D == DType::f32 ? 4 : 2));
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (D == DType::f32) {
          add_square(__uint_as_float(w[k]), acc, bad);
        } else {
          add_square(widen<D>(w[k] & 0xFFFF), acc, bad);
          add_square(widen<D>(w[k] >> 16), acc, bad);
        }
      }
    }
    i = vec_end;
  }
  for (int64_t j = i + threadIdx.x; j < end; j += kThreads) add_square(load<D>(t.data, j), acc, bad);
  return acc;
}

__global__ void __launch_bounds__(kThreads)
    partial_kernel(const Desc* __restrict__ descs, const Chunk* __restrict__ chunks,
                   int64_t num_chunks, float* __restrict__ partials, float* found_inf) {
  __shared__ float shared[kThreads];
  bool bad = false;
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const Desc t = descs[ch.tensor];
    const int64_t end = min(ch.start + kChunk, t.numel);
    float acc = 0.0f;
    switch (t.dtype) {
      case DType::f32: acc = thread_sum<DType::f32>(t, ch.start, end, bad); break;
      case DType::bf16: acc = thread_sum<DType::bf16>(t, ch.start, end, bad); break;
      case DType::f16: acc = thread_sum<DType::f16>(t, ch.start, end, bad); break;
      case DType::q8: break;  // never a gradient's dtype
    }
    const float total = block_tree_sum<float, kThreads>(acc, shared);
    if (threadIdx.x == 0) partials[c] = total;
    __syncthreads();  // shared[] is reused by the next chunk
  }
  if (bad && found_inf != nullptr) *found_inf = 1.0f;  // every writer stores the same value
}

__global__ void __launch_bounds__(kFinalThreads)
    final_kernel(const float* __restrict__ partials, int64_t num_chunks, float* sumsq) {
  __shared__ double shared[kFinalThreads];
  double acc = 0.0;
  for (int64_t c = threadIdx.x; c < num_chunks; c += kFinalThreads) acc += partials[c];
  const double total = block_tree_sum<double, kFinalThreads>(acc, shared);
  if (threadIdx.x == 0) *sumsq = static_cast<float>(static_cast<double>(*sumsq) + total);
}

__global__ void clip_kernel(const float* sumsq, const float* inv_scale_ptr, float host_inv_scale,
                            float max_norm, float* out) {
  const float inv_scale =
      inv_scale_ptr ? __fmul_rn(*inv_scale_ptr, host_inv_scale) : host_inv_scale;
  float coef = 1.0f;
  if (max_norm > 0.0f) {
    const float norm = __fmul_rn(__fsqrt_rn(*sumsq), inv_scale);
    coef = fminf(1.0f, __fdiv_rn(max_norm, __fadd_rn(norm, 1e-6f)));
  }
  *out = __fmul_rn(inv_scale, coef);
}

}  // namespace

GradNormGroup::GradNormGroup(const std::vector<GradRef>& tensors, int device) : device_(device) {
  std::vector<Desc> descs;
  std::vector<Chunk> chunks;
  for (const GradRef& t : tensors) {
    HYTRAIN_CHECK(t.numel >= 0, "numel must be >= 0");
    HYTRAIN_CHECK(t.numel == 0 || t.data != nullptr, "tensor pointer must be non-null");
    const bool vec = reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0;
    for (int64_t s = 0; s < t.numel; s += kChunk) {
      chunks.push_back({static_cast<int64_t>(descs.size()), s});
    }
    descs.push_back({t.data, t.numel, t.dtype, vec});
    numel_ += t.numel;
  }
  num_chunks_ = static_cast<int64_t>(chunks.size());
  DeviceGuard guard(device_);
  grid_ = persistent_grid(device_, kThreads, num_chunks_);
  if (num_chunks_ == 0) return;
  try {
    descs_ = upload(descs);
    chunks_ = upload(chunks);
    HYTRAIN_CUDA_CHECK(cudaMalloc(&partials_, sizeof(float) * chunks.size()));
  } catch (...) {  // a constructor that throws gets no destructor: free what was made
    free_device(descs_);
    free_device(chunks_);
    throw;
  }
}

GradNormGroup::~GradNormGroup() {
  free_device(descs_);
  free_device(chunks_);
  free_device(partials_);
}

void GradNormGroup::accumulate(float* sumsq, float* found_inf, std::uintptr_t stream) {
  HYTRAIN_CHECK(sumsq != nullptr, "sumsq must be a device pointer");
  if (num_chunks_ == 0) return;
  DeviceGuard guard(device_);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  partial_kernel<<<grid_, kThreads, 0, s>>>(static_cast<const Desc*>(descs_),
                                            static_cast<const Chunk*>(chunks_), num_chunks_,
                                            partials_, found_inf);
  HYTRAIN_CUDA_CHECK(cudaGetLastError());
  final_kernel<<<1, kFinalThreads, 0, s>>>(partials_, num_chunks_, sumsq);
  HYTRAIN_CUDA_CHECK(cudaGetLastError());
}

void clip_multiplier(const float* sumsq, const float* inv_scale_ptr, float host_inv_scale,
                     float max_norm, float* out, int device, std::uintptr_t stream) {
  HYTRAIN_CHECK(sumsq != nullptr && out != nullptr, "sumsq and out must be device pointers");
  DeviceGuard guard(device);
  clip_kernel<<<1, 1, 0, reinterpret_cast<cudaStream_t>(stream)>>>(sumsq, inv_scale_ptr,
                                                                    host_inv_scale, max_norm, out);
  HYTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace cuda
}  // namespace hytrain
