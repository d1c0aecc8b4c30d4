// Each chunk of kChunk 16-bit words is summed by one block (16-byte loads where the span is aligned)
// and added to its span's fingerprint with one 64-bit atomic: a sum modulo 2^64, so the order of the
// additions does not change the result.
#include "cuda_check.h"
#include "hytrain/cuda_fingerprint.h"
#include "hytrain/error.h"
#include "hytrain/fingerprint.h"

namespace hytrain {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 65536;  // words per chunk: 256 per thread

struct Desc {
  const unsigned char* data;
  int64_t bytes;
  bool vec;  // 16-byte aligned
};

struct Chunk {
  int64_t span;
  int64_t start;  // first word
};

__device__ __forceinline__ uint64_t word_at(const unsigned char* p, int64_t i) {
  return static_cast<uint64_t>(p[2 * i]) | (static_cast<uint64_t>(p[2 * i + 1]) << 8);
}

__global__ void __launch_bounds__(kThreads)
    fingerprint_kernel(const Desc* __restrict__ descs, const Chunk* __restrict__ chunks,
                       int64_t num_chunks, unsigned long long* __restrict__ out) {
  __shared__ unsigned long long shared[kThreads];
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    const Desc d = descs[ch.span];
    const int64_t words = d.bytes / 2;
    const int64_t end = min(ch.start + kChunk, words);
    unsigned long long acc = 0;
    int64_t i = ch.start;
    if (d.vec) {
      const int64_t vec_end = ch.start + (end - ch.start) / 8 * 8;
      for (int64_t j = ch.start + threadIdx.x * 8; j < vec_end; j += kThreads * 8) {
        const uint4 q = *reinterpret_cast<const uint4*>(d.data + 2 * j);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          acc += fingerprint_mix(j + 2 * k, w[k] & 0xFFFFu);
          acc += fingerprint_mix(j + 2 * k + 1, w[k] >> 16);
        }
      }
      i = vec_end;
    }
    for (int64_t j = i + threadIdx.x; j < end; j += kThreads) {
      acc += fingerprint_mix(j, static_cast<uint32_t>(word_at(d.data, j)));
    }
    if ((d.bytes % 2) && words >= ch.start && words < ch.start + kChunk && threadIdx.x == 0) {
      acc += fingerprint_mix(words, d.data[d.bytes - 1]);
    }
    shared[threadIdx.x] = acc;
    __syncthreads();
#pragma unroll
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(out + ch.span, shared[0]);
    __syncthreads();  // shared[] is reused by the next chunk
  }
}

}  // namespace

FingerprintGroup::FingerprintGroup(const std::vector<SpanRef>& spans, int device) : device_(device) {
  std::vector<Desc> descs;
  std::vector<Chunk> chunks;
  for (const SpanRef& s : spans) {
    HYTRAIN_CHECK(s.bytes >= 0, "bytes must be >= 0");
    HYTRAIN_CHECK(s.bytes == 0 || s.data != nullptr, "span pointer must be non-null");
    const int64_t words = s.bytes / 2 + (s.bytes % 2);  // a chunk for a lone trailing byte too
    for (int64_t w = 0; w < words; w += kChunk) chunks.push_back({static_cast<int64_t>(descs.size()), w});
    const auto* data = static_cast<const unsigned char*>(s.data);
    descs.push_back({data, s.bytes, reinterpret_cast<std::uintptr_t>(data) % 16 == 0});
  }
  size_ = static_cast<int64_t>(descs.size());
  num_chunks_ = static_cast<int64_t>(chunks.size());
  DeviceGuard guard(device_);
  grid_ = persistent_grid(device_, kThreads, num_chunks_);
  if (num_chunks_ == 0) return;
  try {
    descs_ = upload(descs);
    chunks_ = upload(chunks);
  } catch (...) {  // a constructor that throws gets no destructor: free what was made
    free_device(descs_);
    throw;
  }
}

FingerprintGroup::~FingerprintGroup() {
  free_device(descs_);
  free_device(chunks_);
}

void FingerprintGroup::compute(uint64_t* out, std::uintptr_t stream) {
  HYTRAIN_CHECK(out != nullptr || size_ == 0, "out must be a device pointer");
  if (size_ == 0) return;
  DeviceGuard guard(device_);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  HYTRAIN_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(uint64_t) * size_, s));
  if (num_chunks_ == 0) return;
  fingerprint_kernel<<<grid_, kThreads, 0, s>>>(static_cast<const Desc*>(descs_),
                                                static_cast<const Chunk*>(chunks_), num_chunks_,
                                                reinterpret_cast<unsigned long long*>(out));
  HYTRAIN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace cuda
}  // namespace hytrain
