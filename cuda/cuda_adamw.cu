// Fused multi-tensor AdamW. The tensor list is cut into fixed-size chunks once (the chunk table lives
// on the device); a persistent grid strides over the chunks, each thread moving 4 elements per
// iteration with 16-byte fp32 loads when every pointer is aligned for it. Explicit _rn intrinsics
// pin every rounding to the CPU kernel's (nvcc would otherwise contract a*b+c on its own).
#include <algorithm>
#include <string>

#include "cuda_check.h"
#include "dtype_convert.cuh"
#include "hytrain/cuda_adamw.h"
#include "hytrain/error.h"
#include "hytrain/quant8.h"

namespace hytrain {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int64_t kChunk = kThreads * kVec * 16;  // elements per chunk

struct Chunk {
  int64_t tensor;
  int64_t start;
};

struct Scalars {
  float b2, omb1, omb2, eps, wd, pdecay, nstep, bc2s, host_scale;
  float q8_nstep, q8_eps;  // 8-bit states divide once (adamw_kernel.h's q8_block)
  uint32_t step_key;  // sr_mix(step): each tensor's key is sr_mix(seed ^ step_key)
  bool amsgrad;
};

// ---- compact (bf16) states: dtype.h's stochastic rounding (its sr_mix), bit for bit --------------

__device__ __forceinline__ uint16_t round_sr(float x, uint32_t r16) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + r16) >> 16);
}

template <DType S>
__device__ __forceinline__ float load_state(const void* p, int64_t i) {
  if constexpr (S == DType::f32) {
    return static_cast<const float*>(p)[i];
  } else {
    return widen<DType::bf16>(static_cast<const uint16_t*>(p)[i]);
  }
}

// Stores element i's new m and v (bf16: rounded with the low and high halves of its hash).
template <DType S>
__device__ __forceinline__ void store_mv(const AdamWTensorRef& t, int64_t i, float m, float v, uint32_t key) {
  if constexpr (S == DType::f32) {
    static_cast<float*>(t.exp_avg)[i] = m;
    static_cast<float*>(t.exp_avg_sq)[i] = v;
  } else {
    const uint32_t r = sr_mix(static_cast<uint32_t>(i) + key);
    static_cast<uint16_t*>(t.exp_avg)[i] = round_sr(m, r & 0xFFFFu);
    static_cast<uint16_t*>(t.exp_avg_sq)[i] = round_sr(v, r >> 16);
  }
}

template <DType G>
__device__ __forceinline__ float load_grad(const void* g, int64_t i) {
  if constexpr (G == DType::f32) {
    return static_cast<const float*>(g)[i];
  } else {
    return widen<G>(static_cast<const uint16_t*>(g)[i]);
  }
}

// ---- the update ----------------------------------------------------------------------------------

struct Elem {
  float p, m, v, vmax;
};

__device__ __forceinline__ void update(Elem& e, float g, float gscale, const Scalars& s) {
  g = __fmul_rn(g, gscale);
  if (s.wd != 0.0f) g = __fmaf_rn(s.wd, e.p, g);  // Adam's L2 term only where there is one, as torch's
  e.p = __fmul_rn(e.p, s.pdecay);
  e.m = __fmaf_rn(s.omb1, __fsub_rn(g, e.m), e.m);
  e.v = __fmaf_rn(__fmul_rn(s.omb2, g), g, __fmul_rn(e.v, s.b2));
  float vd = e.v;
  if (s.amsgrad) vd = e.vmax = fmaxf(e.vmax, e.v);
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vd), s.bc2s), s.eps);
  e.p = __fmaf_rn(s.nstep, __fdiv_rn(e.m, denom), e.p);
}

template <DType G, bool kW, DType WD, DType S>
__device__ __forceinline__ void scalar_range(const AdamWTensorRef& t, int64_t b, int64_t e,
                                             int64_t stride, float gscale, const Scalars& s,
                                             uint32_t key) {
  float* vmax = static_cast<float*>(t.max_exp_avg_sq);
  for (int64_t i = b; i < e; i += stride) {
    Elem x{t.param[i], load_state<S>(t.exp_avg, i), load_state<S>(t.exp_avg_sq, i),
           s.amsgrad ? vmax[i] : 0.0f};
    update(x, load_grad<G>(t.grad, i), gscale, s);
    t.param[i] = x.p;
    store_mv<S>(t, i, x.m, x.v, key);
    if (s.amsgrad) vmax[i] = x.vmax;
    if constexpr (kW) static_cast<uint16_t*>(t.weight)[i] = narrow<WD>(x.p);
  }
}

template <DType S>
__device__ __forceinline__ void load_state4(const void* p, int64_t i, float out[4]) {
  if constexpr (S == DType::f32) {
    const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
  } else {
    const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
    out[0] = widen<DType::bf16>(q.x & 0xFFFF), out[1] = widen<DType::bf16>(q.x >> 16);
    out[2] = widen<DType::bf16>(q.y & 0xFFFF), out[3] = widen<DType::bf16>(q.y >> 16);
  }
}

template <DType G>
__device__ __forceinline__ void load_grad4(const void* g, int64_t i, float out[4]) {
  if constexpr (G == DType::f32) {
    const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(g) + i);
    out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
  } else {
    const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(g) + i);
    out[0] = widen<G>(q.x & 0xFFFF), out[1] = widen<G>(q.x >> 16);
    out[2] = widen<G>(q.y & 0xFFFF), out[3] = widen<G>(q.y >> 16);
  }
}

template <DType G, bool kW, DType WD, bool kVectorized, DType S>
__global__ void __launch_bounds__(kThreads)
    adamw_multi_kernel(const AdamWTensorRef* __restrict__ descs, const Chunk* __restrict__ chunks,
                       int64_t num_chunks, Scalars s, const float* grad_scale,
                       const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // skipped step: write nothing
  const float gscale = grad_scale ? __fmul_rn(s.host_scale, *grad_scale) : s.host_scale;
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const AdamWTensorRef t = descs[ch.tensor];
    const int64_t end = min(ch.start + kChunk, t.numel);
    const uint32_t key = S == DType::f32 ? 0u : sr_mix(t.seed ^ s.step_key);
    if constexpr (!kVectorized) {
      scalar_range<G, kW, WD, S>(t, ch.start + threadIdx.x, end, kThreads, gscale, s, key);
    } else {
      for (int64_t i = ch.start + threadIdx.x * kVec; i < end; i += kThreads * kVec) {
        if (i + kVec > end) {
          scalar_range<G, kW, WD, S>(t, i, end, 1, gscale, s, key);
          continue;
        }
        const float4 p = *reinterpret_cast<const float4*>(t.param + i);
        float m[4], v[4];
        load_state4<S>(t.exp_avg, i, m);
        load_state4<S>(t.exp_avg_sq, i, v);
        float4 vm = make_float4(0.f, 0.f, 0.f, 0.f);
        if (s.amsgrad) vm = *reinterpret_cast<const float4*>(static_cast<const float*>(t.max_exp_avg_sq) + i);
        float g[4];
        load_grad4<G>(t.grad, i, g);
        Elem x[4] = {{p.x, m[0], v[0], vm.x}, {p.y, m[1], v[1], vm.y}, {p.z, m[2], v[2], vm.z},
                     {p.w, m[3], v[3], vm.w}};
#pragma unroll
        for (int k = 0; k < 4; ++k) update(x[k], g[k], gscale, s);
        *reinterpret_cast<float4*>(t.param + i) = make_float4(x[0].p, x[1].p, x[2].p, x[3].p);
        if constexpr (S == DType::f32) {
          *reinterpret_cast<float4*>(static_cast<float*>(t.exp_avg) + i) = make_float4(x[0].m, x[1].m, x[2].m, x[3].m);
          *reinterpret_cast<float4*>(static_cast<float*>(t.exp_avg_sq) + i) =
              make_float4(x[0].v, x[1].v, x[2].v, x[3].v);
        } else {
          uint16_t hm[4], hv[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint32_t r = sr_mix(static_cast<uint32_t>(i + k) + key);
            hm[k] = round_sr(x[k].m, r & 0xFFFFu);
            hv[k] = round_sr(x[k].v, r >> 16);
          }
          *reinterpret_cast<uint2*>(static_cast<uint16_t*>(t.exp_avg) + i) =
              make_uint2(hm[0] | (static_cast<uint32_t>(hm[1]) << 16), hm[2] | (static_cast<uint32_t>(hm[3]) << 16));
          *reinterpret_cast<uint2*>(static_cast<uint16_t*>(t.exp_avg_sq) + i) =
              make_uint2(hv[0] | (static_cast<uint32_t>(hv[1]) << 16), hv[2] | (static_cast<uint32_t>(hv[3]) << 16));
        }
        if (s.amsgrad) {
          *reinterpret_cast<float4*>(static_cast<float*>(t.max_exp_avg_sq) + i) =
              make_float4(x[0].vmax, x[1].vmax, x[2].vmax, x[3].vmax);
        }
        if constexpr (kW) {
          uint2 w;
          w.x = narrow<WD>(x[0].p) | (static_cast<uint32_t>(narrow<WD>(x[1].p)) << 16);
          w.y = narrow<WD>(x[2].p) | (static_cast<uint32_t>(narrow<WD>(x[3].p)) << 16);
          *reinterpret_cast<uint2*>(static_cast<uint16_t*>(t.weight) + i) = w;
        }
      }
    }
  }
}

// ---- 8-bit states (quant8.h): one warp per block of kQ8Block elements -------------------------------

struct Q8Tables {
  float value_s[256], value_u[256], mid_s[256], mid_u[256];
};

constexpr int kQ8PerLane = kQ8Block / 32;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}

// |x| clamped to 1 as the CPU encoders do (fminf returns 1 for a NaN: the same code as on the CPU).
__device__ __forceinline__ uint8_t q8_encode_dev(const float* mid, bool is_signed, float x) {
  return q8_code(is_signed, x, q8_magnitude_index(mid, fminf(fabsf(x), 1.0f)));
}

template <DType G, bool kW, DType WD>
__global__ void __launch_bounds__(kThreads)
    adamw_q8_kernel(const AdamWTensorRef* __restrict__ descs, const Chunk* __restrict__ chunks,
                    int64_t num_chunks, Scalars s, const float* grad_scale, const float* found_inf,
                    const Q8Tables* __restrict__ tables) {
  __shared__ Q8Tables q;
  if (found_inf != nullptr && *found_inf != 0.0f) return;  // skipped step: write nothing
  for (int i = threadIdx.x; i < 256; i += kThreads) {
    q.value_s[i] = tables->value_s[i], q.value_u[i] = tables->value_u[i];
    q.mid_s[i] = tables->mid_s[i], q.mid_u[i] = tables->mid_u[i];
  }
  __syncthreads();
  const float gscale = grad_scale ? __fmul_rn(s.host_scale, *grad_scale) : s.host_scale;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const AdamWTensorRef t = descs[ch.tensor];
    const int64_t end = min(ch.start + kChunk, t.numel);
    uint8_t* mc = static_cast<uint8_t*>(t.exp_avg);
    uint8_t* vc = static_cast<uint8_t*>(t.exp_avg_sq);
    float* ms = reinterpret_cast<float*>(mc + q8_codes_bytes(t.numel));
    float* vs = reinterpret_cast<float*>(vc + q8_codes_bytes(t.numel));
    for (int64_t b = ch.start + int64_t{warp} * kQ8Block; b < end; b += int64_t{kThreads / 32} * kQ8Block) {
      const int64_t blk = b / kQ8Block;
      const float sm = ms[blk], sv = vs[blk];
      float m[kQ8PerLane], v[kQ8PerLane];
      float am = 0.0f, av = 0.0f;
#pragma unroll
      for (int k = 0; k < kQ8PerLane; ++k) {
        const int64_t i = b + lane + 32 * k;
        m[k] = v[k] = 0.0f;
        if (i < end) {
          const float u = __fmul_rn(q.value_u[vc[i]], sv);  // v's square root
          float p = t.param[i], mk = __fmul_rn(q.value_s[mc[i]], sm), vk = __fmul_rn(u, u);
          float g = __fmul_rn(load_grad<G>(t.grad, i), gscale);
          if (s.wd != 0.0f) g = __fmaf_rn(s.wd, p, g);  // (a NaN weight leaves AdamW's m and v alone)
          p = __fmul_rn(p, s.pdecay);
          mk = __fmaf_rn(s.omb1, __fsub_rn(g, mk), mk);
          vk = __fmaf_rn(__fmul_rn(s.omb2, g), g, __fmul_rn(vk, s.b2));
          const float root = __fsqrt_rn(vk);
          p = __fmaf_rn(s.q8_nstep, __fdiv_rn(mk, __fadd_rn(root, s.q8_eps)), p);
          t.param[i] = p;
          if constexpr (kW) static_cast<uint16_t*>(t.weight)[i] = narrow<WD>(p);
          m[k] = mk, v[k] = root;
          am = fmaxf(am, fabsf(mk)), av = fmaxf(av, root);
        }
      }
      am = warp_max(am), av = warp_max(av);
      const float im = am > 0.0f ? __fdiv_rn(1.0f, am) : 0.0f;
      const float iv = av > 0.0f ? __fdiv_rn(1.0f, av) : 0.0f;
#pragma unroll
      for (int k = 0; k < kQ8PerLane; ++k) {
        const int64_t i = b + lane + 32 * k;
        if (i < end) {
          mc[i] = q8_encode_dev(q.mid_s, true, __fmul_rn(m[k], im));
          vc[i] = q8_encode_dev(q.mid_u, false, __fmul_rn(v[k], iv));
        }
      }
      if (lane == 0) ms[blk] = am, vs[blk] = av;
    }
  }
}

using Q8KernelFn = void (*)(const AdamWTensorRef*, const Chunk*, int64_t, Scalars, const float*, const float*,
                            const Q8Tables*);

template <DType G>
Q8KernelFn pick_q8_weight(bool has_weight, DType wd) {
  if (!has_weight) return adamw_q8_kernel<G, false, DType::bf16>;
  if (wd == DType::bf16) return adamw_q8_kernel<G, true, DType::bf16>;
  return adamw_q8_kernel<G, true, DType::f16>;
}

Q8KernelFn pick_q8(DType g, bool has_weight, DType wd) {
  switch (g) {
    case DType::f32: return pick_q8_weight<DType::f32>(has_weight, wd);
    case DType::bf16: return pick_q8_weight<DType::bf16>(has_weight, wd);
    case DType::f16: return pick_q8_weight<DType::f16>(has_weight, wd);
    case DType::q8: break;
  }
  HYTRAIN_THROW("unknown gradient dtype");
}

// ---- dispatch ------------------------------------------------------------------------------------

using KernelFn = void (*)(const AdamWTensorRef*, const Chunk*, int64_t, Scalars, const float*,
                          const float*);

template <DType G, bool kW, DType WD>
KernelFn pick_vec(bool vectorized, DType sd) {
  if (sd == DType::bf16) {
    return vectorized ? adamw_multi_kernel<G, kW, WD, true, DType::bf16>
                      : adamw_multi_kernel<G, kW, WD, false, DType::bf16>;
  }
  return vectorized ? adamw_multi_kernel<G, kW, WD, true, DType::f32>
                    : adamw_multi_kernel<G, kW, WD, false, DType::f32>;
}

template <DType G>
KernelFn pick_weight(bool has_weight, DType wd, bool vectorized, DType sd) {
  if (!has_weight) return pick_vec<G, false, DType::bf16>(vectorized, sd);
  if (wd == DType::bf16) return pick_vec<G, true, DType::bf16>(vectorized, sd);
  return pick_vec<G, true, DType::f16>(vectorized, sd);
}

KernelFn pick_kernel(DType g, bool has_weight, DType wd, bool vectorized, DType sd) {
  switch (g) {
    case DType::f32: return pick_weight<DType::f32>(has_weight, wd, vectorized, sd);
    case DType::bf16: return pick_weight<DType::bf16>(has_weight, wd, vectorized, sd);
    case DType::f16: return pick_weight<DType::f16>(has_weight, wd, vectorized, sd);
    case DType::q8: break;
  }
  HYTRAIN_THROW("unknown gradient dtype");
}

bool aligned(const void* p, std::uintptr_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

}  // namespace

AdamWGroup::AdamWGroup(const std::vector<AdamWTensorRef>& tensors, DType grad_dtype,
                       bool has_weight, DType weight_dtype, bool amsgrad, int device, DType state_dtype)
    : grad_dtype_(grad_dtype), has_weight_(has_weight), weight_dtype_(weight_dtype),
      amsgrad_(amsgrad), state_dtype_(state_dtype), vectorized_(true), device_(device) {
  HYTRAIN_CHECK(!has_weight || weight_dtype != DType::f32, "weight must be bfloat16 or float16");
  HYTRAIN_CHECK(state_dtype == DType::f32 || state_dtype == DType::bf16 || state_dtype == DType::q8,
                "states must be float32, bfloat16 or 8-bit");
  HYTRAIN_CHECK(grad_dtype != DType::q8, "gradients must be float32, bfloat16 or float16");
  HYTRAIN_CHECK(!amsgrad || state_dtype == DType::f32, "amsgrad needs float32 states");
  const int64_t gsize = grad_dtype == DType::f32 ? 4 : 2;
  const int64_t ssize = dtype_bytes(state_dtype);
  std::vector<Chunk> chunks;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const AdamWTensorRef& t = tensors[k];
    HYTRAIN_CHECK(t.numel >= 0, "numel must be >= 0");
    if (t.numel == 0) continue;
    HYTRAIN_CHECK(t.param && t.exp_avg && t.exp_avg_sq && t.grad, "tensor pointers must be non-null");
    HYTRAIN_CHECK(!amsgrad || t.max_exp_avg_sq, "amsgrad needs max_exp_avg_sq");
    HYTRAIN_CHECK(!has_weight || t.weight, "weight pointer must be non-null");
    vectorized_ = vectorized_ && aligned(t.param, 16) && aligned(t.exp_avg, 4 * ssize) &&
                  aligned(t.exp_avg_sq, 4 * ssize) && (!amsgrad || aligned(t.max_exp_avg_sq, 16)) &&
                  aligned(t.grad, 4 * gsize) && (!has_weight || aligned(t.weight, 8));
    for (int64_t s = 0; s < t.numel; s += kChunk) chunks.push_back({static_cast<int64_t>(k), s});
    numel_ += t.numel;
  }
  num_tensors_ = static_cast<int64_t>(tensors.size());
  num_chunks_ = static_cast<int64_t>(chunks.size());

  DeviceGuard guard(device_);
  grid_ = persistent_grid(device_, kThreads, num_chunks_);
  if (num_chunks_ == 0) return;
  try {
    descs_ = upload(tensors);
    chunks_ = upload(chunks);
    if (state_dtype == DType::q8) {
      Q8Tables tab;
      const Q8Map &ms = q8_map(true), &mu = q8_map(false);
      for (int i = 0; i < 256; ++i) {
        tab.value_s[i] = ms.value[i], tab.value_u[i] = mu.value[i];
        tab.mid_s[i] = ms.mid[i], tab.mid_u[i] = mu.mid[i];
      }
      q8_ = upload(std::vector<Q8Tables>{tab});
    }
  } catch (...) {  // a constructor that throws gets no destructor: free what was made
    free_device(descs_);
    free_device(chunks_);
    throw;
  }
}

AdamWGroup::~AdamWGroup() {
  free_device(descs_);
  free_device(chunks_);
  free_device(q8_);
}

void AdamWGroup::step(const AdamWConfig& cfg, const float* grad_scale, const float* found_inf,
                      std::uintptr_t stream) {
  HYTRAIN_CHECK(cfg.amsgrad == amsgrad_, "amsgrad must match the group's setting");
  validate_adamw_config(cfg);
  const AdamWScalars a = make_adamw_scalars(cfg);
  if (num_chunks_ == 0) return;
  const Scalars s{a.beta2, a.one_minus_beta1, a.one_minus_beta2, a.eps, a.weight_decay,
                  a.param_decay, a.neg_step_size, a.bias_correction2_sqrt, a.grad_scale, a.q8_neg_step, a.q8_eps,
                  sr_mix(static_cast<uint32_t>(cfg.step)), a.amsgrad};
  DeviceGuard guard(device_);
  if (state_dtype_ == DType::q8) {
    const Q8KernelFn k = pick_q8(grad_dtype_, has_weight_, weight_dtype_);
    k<<<grid_, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        static_cast<const AdamWTensorRef*>(descs_), static_cast<const Chunk*>(chunks_), num_chunks_, s, grad_scale,
        found_inf, static_cast<const Q8Tables*>(q8_));
    HYTRAIN_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const KernelFn k = pick_kernel(grad_dtype_, has_weight_, weight_dtype_, vectorized_, state_dtype_);
  k<<<grid_, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<const AdamWTensorRef*>(descs_), static_cast<const Chunk*>(chunks_), num_chunks_,
      s, grad_scale, found_inf);
  HYTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace cuda
}  // namespace hytrain
