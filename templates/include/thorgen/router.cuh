// thorgen MoE router (Gemma-4): logits[t, e] = (rmsnorm_noweight(x_t) * scale * H^-0.5) . W[e, :]   (W bf16 [E, H])
// then softmax -> top-k (ties -> lower expert id) -> renormalise -> * per_expert_scale[idx].
// router_logits: grid (E / warps, token groups): a warp per expert holds its W row in registers and loops over its
// block's tokens (staged in shared memory); W comes from DRAM once per step, the other token groups hit L2.
// router_topk: one block per token. The renormalised top-k weights equal exp(l_k - l_max) / sum_k exp(...):
// the softmax denominator over all experts cancels, so only the selected logits are exponentiated.
// router_fused (one launch instead of two on the decode critical path): router_logits with K > 0; each block bumps
// a per-token counter after writing its logits and the token's last block runs the top-k on that row with one warp
// (router_topk_warp: the same keys, tie rule and fp32 weight math as router_topk, so the results are bit-identical).
// The counters start zeroed (the runtime zeroes them once) and the last block re-zeroes them (graph-replay safe).
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

// The renormalised top-k weights from the selected logits (sel_logit[0] is the largest): exp(l_k - l_0) / sum,
// times the expert's per_expert_scale; written with the ids. One thread; shared by router_topk and the fused path.
template <int K>
__device__ __forceinline__ void write_topk(const int* sel, const float* sel_logit,
                                           const __nv_bfloat16* __restrict__ per_expert_scale,
                                           int32_t* __restrict__ idx_out, float* __restrict__ w_out) {
  const float m = sel_logit[0];
  float p[K], sum = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) { p[k] = expf(sel_logit[k] - m); sum += p[k]; }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    idx_out[k] = sel[k];
    w_out[k] = p[k] / sum * __bfloat162float(per_expert_scale[sel[k]]);
  }
}

// Top-k of one token's E logits by one warp (lane l holds experts l, l+32, ...): K rounds of a warp max over
// (logit, -id) keys, the winner's owner drops it; lane 0 writes ids and weights exactly as router_topk does. The
// logits were written by other blocks of this launch: read through L2 (ld.cg), after the caller's fence.
// (A block-wide rank count instead of the K rounds measured ~0.9 us slower on the H200: 2 warps, E^2 compares.)
template <int E, int K>
__device__ __forceinline__ void router_topk_warp(const float* lrow, const __nv_bfloat16* __restrict__ per_expert_scale,
                                                 int32_t* __restrict__ idx_out, float* __restrict__ w_out) {
  static_assert(K >= 1 && K <= E && K <= 32, "top-k must lie in 1..min(E, 32)");
  constexpr int PER = (E + 31) / 32;
  const int lane = threadIdx.x & 31;
  unsigned long long key[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = lane + 32 * j;
    key[j] = e < E ? value_index_key(__ldcg(lrow + e), (uint32_t)e) : 0ull;
  }
  int sel[K];
  float sel_logit[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    unsigned long long best = 0ull;
#pragma unroll
    for (int j = 0; j < PER; ++j) best = key[j] > best ? key[j] : best;
    best = warp_max_u64(best);
    const int e = (int)key_index(best);
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (lane + 32 * j == e) key[j] = 0ull;
    sel[k] = e;
    sel_logit[k] = key_value(best);  // the logit's exact bits (the key is a bijection of the float)
  }
  if (lane == 0) {
    write_topk<K>(sel, sel_logit, per_expert_scale, idx_out, w_out);
  }
}

// K == 0: logits only. K > 0 (router_fused): also the top-k of every token, by the token's last block.
template <int H, int E, int THREADS, int K = 0>
__device__ void router_logits(const float* __restrict__ x, const __nv_bfloat16* __restrict__ scale,
                              const __nv_bfloat16* __restrict__ proj, float* logits, int T, float eps,
                              const __nv_bfloat16* __restrict__ per_expert_scale = nullptr,
                              unsigned int* __restrict__ counters = nullptr, int32_t* __restrict__ topk_idx = nullptr,
                              float* __restrict__ topk_w = nullptr) {
  static_assert(H % 8 == 0, "hidden size must be a multiple of 8 (16-byte weight loads)");
  static_assert(THREADS % 32 == 0, "block size must be a multiple of 32");
  constexpr int WARPS = THREADS / 32, CH = H / 8, PER = (CH + 31) / 32;
  static_assert(E % WARPS == 0, "experts must be a multiple of the warps per block");
  __shared__ __align__(16) float xs[H];
  __shared__ float scratch[32];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int e = blockIdx.x * WARPS + warp;
  const bool active = e < E;
  uint4 w[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int c = lane + 32 * j;
    w[j] = (active && c < CH) ? reinterpret_cast<const uint4*>(proj + (long)e * H)[c] : make_uint4(0, 0, 0, 0);
  }
  pdl_wait();  // PDL: the weight row is in flight; x (and the counters) come from earlier kernels
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
    if constexpr (K > 0) {
      __syncthreads();  // this block's logits of token t are written
      if (threadIdx.x == 0) {
        __threadfence();  // ... and visible device-wide (cumulative over the block's writes) before the count
        last = atomicAdd(&counters[t], 1u) == gridDim.x - 1;
      }
      __syncthreads();
      if (last && warp == 0) {
        __threadfence();  // acquire: every other block's logits of token t are visible from here on
        router_topk_warp<E, K>(logits + (long)t * E, per_expert_scale, topk_idx + (long)t * K, topk_w + (long)t * K);
        if (lane == 0) counters[t] = 0u;  // every block of token t has counted: leave it zeroed
      }
    }
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
    if (threadIdx.x == 0) write_topk<K>(sel, sel_logit, per_expert_scale, topk_idx + (long)t * K, topk_w + (long)t * K);
    __syncthreads();
  }
}

}  // namespace thorgen
