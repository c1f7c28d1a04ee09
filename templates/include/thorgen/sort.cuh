// thorgen block-wide sort in shared memory, shared by the sampler (sample.cuh) and the logprobs (logits.cuh).
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

// descending bitonic sort of n (a power of two) keys in shared memory by THREADS threads (every thread of the block
// calls it; it ends with a barrier)
template <int THREADS>
__device__ void block_sort_desc(unsigned long long* keys, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += THREADS) {
        const int p = i ^ j;
        if (p > i) {
          const bool desc = (i & k) == 0;
          const unsigned long long a = keys[i], b = keys[p];
          if (desc ? (a < b) : (a > b)) { keys[i] = b; keys[p] = a; }
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace thorgen
