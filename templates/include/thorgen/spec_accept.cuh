// thorgen DFlash acceptance on the device: after a verify step, how many of its tokens commit, and the next step's
// block (positions, sampled positions, ids[0]), so that the host can enqueue that step before it reads this one.
// Hand-written; included by spec_accept.cu.j2. The host applies the same rule to the tokens it reads back
// (runtime/cuda_backend.CudaRunner.decode) and uses a launched-ahead step only where the two agree.
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

// rule[0] = most tokens a step may commit (1 + the request's draft cap), rule[1] = K >= 0: commit exactly K + 1
// (bench --emulate-acceptance), else -1: the longest prefix where draft i (ids[i]) equals target i-1 (out_ids[i-1]).
// One thread: 16 reads and 33 writes, read all before writing (ids[0] is rewritten, ids[1..] are the drafts).
template <int B>
__device__ void spec_accept(int32_t* __restrict__ ids, const int32_t* __restrict__ out_ids,
                            int32_t* __restrict__ positions, int32_t* __restrict__ sampled,
                            const int32_t* __restrict__ rule, int32_t* __restrict__ accepted) {
  static_assert(B >= 2 && B <= 64, "a verify block of 2..64 rows");
  const int most = min(max(rule[0], 1), B), k = rule[1];
  int n = 1;
  while (n < most && (k < 0 ? ids[n] == out_ids[n - 1] : n <= k)) ++n;
  const int next = positions[0] + n;
  const int32_t last = out_ids[n - 1];
  for (int i = 0; i < B; ++i) {
    positions[i] = next + i;
    sampled[i] = next + 1 + i;
  }
  ids[0] = last;
  accepted[0] = n;
}

}  // namespace thorgen
