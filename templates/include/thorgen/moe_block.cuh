// thorgen MoE block of one token (decode): the router (logits + top-k), the selected experts' gate|up and their
// down rows in one persistent launch, where router_fused, moe_gateup and moe_down_pairs (M = 1) took three: blocks
// wait on device counters instead of kernel boundaries, and a block's down weights are in flight while it waits
// for the other gate|up blocks of its expert.
// Work items of KS warps: items 0 .. R-1 are router_logits' blocks (its arithmetic: bit-identical logits, ids and
// weights to router_fused); item R + u * K + k does gate|up unit u (16 rows) of slot k's expert into act[k] and
// counts it in done[k], then down units UD u .. UD u + UD - 1 of that expert, once done[k] says all UG gate|up units
// of slot k are written: ypair[k][H] = routing weight * down(act[k]) (ffn_tail's PAIRS form sums them).
// The per-unit arithmetic is moe_gateup's and moe_down_pairs' (expert_pass, gateup_out, down_pairs_out).
// Deadlock freedom: the whole grid must be resident at once (the planner marks the kernel `coresident`; the runtime
// shrinks the grid to what the GPU holds) and a block waits only after the work others wait for (below). With PDL
// the next kernel starts only once every block has triggered, i.e. is resident, so it cannot take a needed slot.
// sync (u32, zero at entry, left zeroed): [0] router arrivals, [1] top-k published, [2] blocks finished,
// [3 .. 3 + K) gate|up units written per slot.
#pragma once
#include "thorgen/moe_small.cuh"
#include "thorgen/router.cuh"

namespace thorgen {

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every calling thread spins until *p >= target; acquire: what the counted blocks wrote is visible to it after.
struct CounterWait {
  const unsigned* p;
  unsigned target;
  __device__ __forceinline__ void operator()() const {
    while (ld_acquire_gpu(p) < target) {
    }
  }
};

// Thread 0, after a barrier behind the block's writes: make them visible device-wide, then count (release).
__device__ __forceinline__ unsigned block_count(unsigned* p) {
  unsigned before = 0;
  if (threadIdx.x == 0) {
    __threadfence();
    before = atomicAdd(p, 1u);
  }
  return before;
}

template <int KIND, int H, int IE, int E, int K, int R, int KS, int PF_GU, int PF_D>
__device__ __forceinline__ void moe_block(const float* __restrict__ x, const __nv_bfloat16* __restrict__ scale,
                                          const __nv_bfloat16* __restrict__ proj,
                                          const __nv_bfloat16* __restrict__ per_expert_scale, float* logits,
                                          int32_t* ids, float* wts, const __half* __restrict__ xe,
                                          const WPtr gu, const float* __restrict__ gu_gscale, const WPtr dn,
                                          const float* __restrict__ dn_gscale, __half* act, float* __restrict__ ypair,
                                          unsigned* sync, float eps) {
  constexpr int UG = 2 * IE / 16, UD = (H / 16) / UG, THREADS = KS * 32, VB = R + UG * K;
  constexpr int S_GU = H / 64, S_D = IE / 64;
  static_assert((H / 16) % UG == 0 && UD >= 1 && UD <= 4, "the down units must split evenly over the gate|up units");
  static_assert(KS <= S_D && KS <= S_GU, "every warp needs a K step of each matrix");
  constexpr size_t EW_GU = (size_t)2 * IE * H / 2, ES_GU = (size_t)2 * IE * H / 16;
  constexpr size_t EW_D = (size_t)H * IE / 2, ES_D = (size_t)H * IE / 16;
  unsigned* const arrivals = sync;
  unsigned* const ready = sync + 1;
  unsigned* const finished = sync + 2;
  unsigned* const done = sync + 3;
  __shared__ float red[KS][UD][8][16];
  __shared__ int slot_pair[1];
  __shared__ int expert;
  pdl_launch_dependents();
  // Work items v = 0 .. VB-1 (router blocks first), item v on block v % gridDim.x: a block runs its router items,
  // then its gate|up items, then its down items, so it waits (for the top-k, for a slot's gate|up) only once it has
  // done all the work others may wait for: any grid that is resident at once finishes (the planned grid runs one
  // item a block; a GPU that holds fewer blocks gets a smaller grid, its blocks loop).
  const int G = gridDim.x, warp = threadIdx.x >> 5;
  int v = blockIdx.x;
  for (; v < R; v += G)
    if (router_logits<H, E, THREADS, K>(x, scale, proj, logits, 1, eps, per_expert_scale, arrivals, ids, wts, v, R))
      block_count(ready);  // (thread 0 wrote the ids and weights)
  const int first = v;
  if (first < VB) pdl_wait();  // xe comes from the previous kernel
  // the slot's expert of item v (-1: the slot leads none), in `expert`, after the top-k is published
  auto lead = [&](int k) {
    if (threadIdx.x == 0) {
      CounterWait{ready, 1}();
      const int e = __ldcg(ids + k);
      bool ok = e >= 0 && e < E;
      for (int j = 0; j < k; ++j) ok = ok && __ldcg(ids + j) != e;  // (corrupt ids: an expert's first slot only)
      expert = ok ? e : -1;
      slot_pair[0] = k;
    }
    __syncthreads();
    return expert;
  };
  for (v = first; v < VB; v += G) {  // gate|up unit u of slot k's expert -> act[k], counted in done[k]
    const int k = (v - R) % K, u = (v - R) / K, e = lead(k);
    if (e >= 0) {
      auto* red_gu = reinterpret_cast<float (*)[1][8][16]>(&red[0][0][0][0]);
      const WPtr pe{gu.w + e * EW_GU, gu.s + e * ES_GU};
      expert_pass<KIND, 2 * IE, H, PF_GU, 1, 1, K, 8>(red_gu[warp], pe, u, xe, slot_pair, 0, 1, warp * S_GU / KS,
                                                      (warp + 1) * S_GU / KS);
      __syncthreads();
      gateup_out<KIND, IE, KS, 1, 8>(red_gu, gu_gscale + (size_t)e * (2 * IE / 8), slot_pair, 0, 1, u, act);
    }
    __syncthreads();  // the block's act rows are written (and red, expert and slot_pair are free again)
    block_count(done + k);
  }
  for (v = first; v < VB; v += G) {  // down units UD u .. of slot k's expert -> ypair[k], once act[k] is whole
    const int k = (v - R) % K, u = (v - R) / K, e = lead(k);
    if (e >= 0) {
      const WPtr pd{dn.w + e * EW_D, dn.s + e * ES_D};
      // the weights' first PF_D steps are loaded before the wait; act is read through L2 after it
      expert_pass<KIND, H, IE, PF_D, UD, 1, 1, 8, CounterWait, true, true>(
          red[warp], pd, UD * u, act, slot_pair, 0, 1, warp * S_D / KS, (warp + 1) * S_D / KS, CounterWait{done + k, UG});
      __syncthreads();
      down_pairs_out<KIND, H, KS, UD, 8>(red, dn_gscale + (size_t)e * (H / 8), slot_pair, 0, 1, UD * u,
                                         [wts](int pr) { return __ldcg(wts + pr); }, ypair);
    } else {  // a slot that leads no expert: its row is zero (ffn_tail sums every slot naming a valid expert)
      for (int i = threadIdx.x; i < UD * 16; i += THREADS) ypair[(size_t)k * H + 16 * UD * u + i] = 0.f;
    }
    __syncthreads();  // red, expert and slot_pair are rewritten by the next item
  }
  __syncthreads();
  if (threadIdx.x == 0 && block_count(finished) == (unsigned)G - 1) {  // the last block out: every wait is over
    *ready = 0u;
    *finished = 0u;
    for (int k = 0; k < K; ++k) done[k] = 0u;
  }
}

}  // namespace thorgen
