// Each chunk of kChunk 16-bit words is summed by one block (16-byte loads where the span is aligned)
// and added to its span's fingerprint with one 64-bit atomic: a sum modulo 2^64, so the order of the
// additions does not change the result.
#include <algorithm>

#include "block_sum.cuh"
#include "cuda_check.h"
#include "hytrain/cuda_fingerprint.h"
#include "hytrain/error.h"
#include "hytrain/fingerprint.h"

namespace hytrain {
namespace cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 65536;  // words per chunk: 256 per thread
constexpr int kListSpans = 32;     // spans per launch of fingerprint_spans

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

// One chunk's share of its span's fingerprint, added to out with one atomic (every thread of the
// block calls it; shared is the block's reduction buffer).
__device__ __forceinline__ void chunk_fingerprint(const Desc d, int64_t start, unsigned long long* out,
                                                  unsigned long long* shared) {
  const int64_t words = d.bytes / 2;
  const int64_t end = min(start + kChunk, words);
  unsigned long long acc = 0;
  int64_t i = start;
  if (d.vec) {
    const int64_t vec_end = start + (end - start) / 8 * 8;
    for (int64_t j = start + threadIdx.x * 8; j < vec_end; j += kThreads * 8) {
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
  if ((d.bytes % 2) && words >= start && words < start + kChunk && threadIdx.x == 0) {
    acc += fingerprint_mix(words, d.data[d.bytes - 1]);
  }
  const unsigned long long total = block_tree_sum<unsigned long long, kThreads>(acc, shared);
  if (threadIdx.x == 0) atomicAdd(out, total);
  __syncthreads();  // shared[] is reused by the next chunk
}

__global__ void __launch_bounds__(kThreads)
    fingerprint_kernel(const Desc* __restrict__ descs, const Chunk* __restrict__ chunks,
                       int64_t num_chunks, unsigned long long* __restrict__ out) {
  __shared__ unsigned long long shared[kThreads];
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Chunk ch = chunks[c];
    chunk_fingerprint(descs[ch.span], ch.start, out + ch.span, shared);
  }
}

// Up to kListSpans spans passed by value (no table to upload): chunk c belongs to the span whose
// first chunk is the last one <= c.
struct SpanList {
  Desc desc[kListSpans];
  int64_t first[kListSpans + 1];  // first chunk of each span; first[n]: the total
  int n;
};

__global__ void __launch_bounds__(kThreads) fingerprint_list_kernel(const SpanList list,
                                                                    unsigned long long* __restrict__ out) {
  __shared__ unsigned long long shared[kThreads];
  for (int64_t c = blockIdx.x; c < list.first[list.n]; c += gridDim.x) {
    int s = 0;
    while (list.first[s + 1] <= c) ++s;
    chunk_fingerprint(list.desc[s], (c - list.first[s]) * kChunk, out + s, shared);
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

void fingerprint_spans(const std::vector<SpanRef>& spans, uint64_t* out, int device, std::uintptr_t stream) {
  HYTRAIN_CHECK(out != nullptr || spans.empty(), "out must be a device pointer");
  if (spans.empty()) return;
  DeviceGuard guard(device);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  HYTRAIN_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(uint64_t) * spans.size(), s));
  for (size_t lo = 0; lo < spans.size(); lo += kListSpans) {
    SpanList list{};
    list.n = static_cast<int>(std::min<size_t>(kListSpans, spans.size() - lo));
    for (int k = 0; k < list.n; ++k) {
      const SpanRef& r = spans[lo + k];
      HYTRAIN_CHECK(r.bytes >= 0, "bytes must be >= 0");
      HYTRAIN_CHECK(r.bytes == 0 || r.data != nullptr, "span pointer must be non-null");
      const auto* data = static_cast<const unsigned char*>(r.data);
      list.desc[k] = {data, r.bytes, reinterpret_cast<std::uintptr_t>(data) % 16 == 0};
      const int64_t words = r.bytes / 2 + (r.bytes % 2);
      list.first[k + 1] = list.first[k] + (words + kChunk - 1) / kChunk;
    }
    if (list.first[list.n] == 0) continue;
    fingerprint_list_kernel<<<persistent_grid(device, kThreads, list.first[list.n]), kThreads, 0, s>>>(
        list, reinterpret_cast<unsigned long long*>(out + lo));
    HYTRAIN_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace cuda
}  // namespace hytrain
