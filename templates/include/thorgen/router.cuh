// thorgen MoE router (Gemma-4): logits[t, e] = (rmsnorm_noweight(x_t) * scale * H^-0.5) . W[e, :]   (W bf16 [E, H])
// then softmax -> top-k (ties -> lower expert id) -> renormalise -> * per_expert_scale[idx].
// router_logits: grid (E / warps, token groups): a warp per expert holds its W row in registers and loops over its
// block's tokens (staged in shared memory); W comes from DRAM once per step, the other token groups hit L2.
// router_topk: one block per token. The renormalised top-k weights equal exp(l_k - l_max) / sum_k exp(...):
// the softmax denominator over all experts cancels, so only the selected logits are exponentiated.
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

template <int H, int E, int THREADS>
__device__ void router_logits(const float* __restrict__ x, const __nv_bfloat16* __restrict__ scale,
                              const __nv_bfloat16* __restrict__ proj, float* __restrict__ logits, int T, float eps) {
  static_assert(H % 8 == 0, "hidden size must be a multiple of 8 (16-byte weight loads)");
  static_assert(THREADS % 32 == 0, "block size must be a multiple of 32");
  constexpr int WARPS = THREADS / 32, CH = H / 8, PER = (CH + 31) / 32;
  static_assert(E % WARPS == 0, "experts must be a multiple of the warps per block");
  __shared__ __align__(16) float xs[H];
  __shared__ float scratch[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int e = blockIdx.x * WARPS + warp;
  const bool active = e < E;
  uint4 w[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int c = lane + 32 * j;
    w[j] = (active && c < CH) ? reinterpret_cast<const uint4*>(proj + (long)e * H)[c] : make_uint4(0, 0, 0, 0);
  }
  for (int t = blockIdx.y; t < T; t += gridDim.y) {  // tokens spread over grid.y
    float ss = 0.f;
    __syncthreads();  // xs of the previous token is no longer read
    for (int i = threadIdx.x; i < H; i += THREADS) {
      const float v = x[(long)t * H + i];
      ss = fmaf(v, v, ss);
      xs[i] = v * __bfloat162float(scale[i]);
    }
    ss = block_sum<THREADS>(ss, scratch);
    __syncthreads();  // the xs writes are visible to every warp
    const float inv = rsqrtf(ss * (1.0f / H) + eps) * rsqrtf((float)H);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int c = lane + 32 * j;
      if (c < CH) {
        const __nv_bfloat16* wb = reinterpret_cast<const __nv_bfloat16*>(&w[j]);
        const float4 a = reinterpret_cast<const float4*>(xs)[2 * c], b = reinterpret_cast<const float4*>(xs)[2 * c + 1];
        acc = fmaf(a.x, __bfloat162float(wb[0]), acc); acc = fmaf(a.y, __bfloat162float(wb[1]), acc);
        acc = fmaf(a.z, __bfloat162float(wb[2]), acc); acc = fmaf(a.w, __bfloat162float(wb[3]), acc);
        acc = fmaf(b.x, __bfloat162float(wb[4]), acc); acc = fmaf(b.y, __bfloat162float(wb[5]), acc);
        acc = fmaf(b.z, __bfloat162float(wb[6]), acc); acc = fmaf(b.w, __bfloat162float(wb[7]), acc);
      }
    }
    acc = warp_sum(acc);
    if (active && lane == 0) logits[(long)t * E + e] = acc * inv;
  }
}

template <int E, int K, int THREADS>
__device__ void router_topk(const float* __restrict__ logits, const __nv_bfloat16* __restrict__ per_expert_scale,
                            int32_t* __restrict__ topk_idx, float* __restrict__ topk_w, int T) {
  static_assert(K >= 1 && K <= E && K <= 32, "top-k must lie in 1..min(E, 32)");
  static_assert(THREADS >= E && THREADS % 32 == 0, "one thread per expert");
  __shared__ unsigned long long scratch[32];
  __shared__ int sel[K];
  __shared__ float sel_logit[K];
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    const int e = threadIdx.x;
    const float l = e < E ? logits[(long)t * E + e] : 0.f;
    bool taken = false;
    for (int k = 0; k < K; ++k) {
      const unsigned long long key = (e < E && !taken) ? value_index_key(l, (uint32_t)e) : 0ull;
      const unsigned long long best = block_max_u64<THREADS>(key, scratch);
      const int idx = (int)key_index(best);
      if (e == idx) { taken = true; sel[k] = e; sel_logit[k] = l; }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const float m = sel_logit[0];  // the largest logit overall
      float p[K], sum = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k) { p[k] = expf(sel_logit[k] - m); sum += p[k]; }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        topk_idx[(long)t * K + k] = sel[k];
        topk_w[(long)t * K + k] = p[k] / sum * __bfloat162float(per_expert_scale[sel[k]]);
      }
    }
    __syncthreads();
  }
}

}  // namespace thorgen
