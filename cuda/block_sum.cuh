// A block's threads' values summed in shared memory by a halving tree (N threads, a power of two);
// every thread gets the sum. The caller synchronises before reusing `shared`.
#pragma once

namespace hytrain {
namespace cuda {

template <class T, int N>
__device__ __forceinline__ T block_tree_sum(T v, T* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
#pragma unroll
  for (int s = N / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  return shared[0];
}

}  // namespace cuda
}  // namespace hytrain
