// thorgen MoE for the small steps (decode M = 1, verify and batched decode M <= 32) on the t16x64 tile engine
// (nvfp4.cuh, gemm_nvfp4.cuh). An item is (one expert, UN consecutive 16-row units of its weights): every selected
// expert's weights are read once per unit, whatever the step's routing, and every output row is written by exactly
// one item (no atomics, deterministic). One token: a block a (unit, slot), the slot's expert unless an earlier slot
// names it. Many rows: a persistent grid (one wave on the device) walks the step's items, so a launch does only the
// work its routing needs. The former grid, a block row per expert the step might select, launched 128 rows of which
// the verify's 16 tokens used ~32: its working blocks overflowed one wave (gate/up 1,408 blocks on 1,056 slots,
// down_pairs 2,816 on 2,772) behind ~4,000-8,000 blocks that only found they had nothing to do.
// Gate/up and the many-row down run over the expert's own tokens only (expert_tokens), PW (8 or 16) a pass, as the
// B operand of the swapped mma (the 16 weight rows are A): at 32 random tokens an expert has ~2.3 of them, and
// the former form (all m rows as A tiles) re-read every token row from L1/L2 for each (unit, expert) block, 90-180
// KB a block, more than the block's weights.
#pragma once
#include "thorgen/gemm_nvfp4.cuh"

namespace thorgen {

// The slot (0..TOPK-1) of token r that names expert e, or -1.
template <int TOPK>
__device__ __forceinline__ int slot_of(const int* __restrict__ ids, int r, int e) {
  int k = -1;
#pragma unroll
  for (int kk = 0; kk < TOPK; ++kk)
    if (__ldg(ids + r * TOPK + kk) == e) k = kk;
  return k;
}

// The step's distinct experts in expert-id order into list[0 .. n) (shared memory, E entries); returns n. The
// block's threads mark its slots in a shared bitmap behind one barrier. Every thread must call it.
template <int E, int TOPK, int THREADS>
__device__ __forceinline__ int step_experts(const int* __restrict__ ids, int m, int* list) {
  static_assert(THREADS >= 32, "a warp at least: thread b places bit b of each bitmap word");
  constexpr int WORDS = (E + 31) / 32;
  __shared__ unsigned present[WORDS];
  for (int i = threadIdx.x; i < WORDS; i += THREADS) present[i] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < m * TOPK; i += THREADS) {
    const int x = __ldg(ids + i);
    if (x >= 0 && x < E) atomicOr(present + (x >> 5), 1u << (x & 31));
  }
  __syncthreads();
  int n = 0;
#pragma unroll
  for (int w = 0; w < WORDS; ++w) {
    const unsigned bits = present[w];
    const int b = threadIdx.x;
    if (b < 32 && ((bits >> b) & 1u)) list[n + __popc(bits & ((1u << b) - 1u))] = 32 * w + b;
    n += __popc(bits);
  }
  __syncthreads();
  return n;
}

// One token's TOPK expert ids in registers, loaded together (moe_down: its warps' slots checked without the shared
// leader table and its three barriers; H200 2026-12-02, 7.6 -> 7.5 us a layer).
template <int TOPK>
__device__ __forceinline__ void token_ids(const int* __restrict__ ids, int (&id)[TOPK]) {
#pragma unroll
  for (int k = 0; k < TOPK; ++k) id[k] = __ldg(ids + k);
}

// Whether slot s of one token (its ids in registers) leads: a valid expert that no earlier slot names; e = the expert.
template <int E, int TOPK>
__device__ __forceinline__ bool slot_leads(const int (&id)[TOPK], int s, int& e) {
  e = -1;
#pragma unroll
  for (int k = 0; k < TOPK; ++k)
    if (k == s) e = id[k];
  bool dup = false;
#pragma unroll
  for (int k = 0; k < TOPK; ++k) dup |= k < s && id[k] == e;
  return !dup && e >= 0 && e < E;
}

// One token: the expert of grid row (slot) blockIdx.y, or false when an earlier slot names it (a scan of at most 7
// slots; every thread loading all 8 ids instead measured 9.3 -> 9.6 us a layer on the H200, a barrier 9.9).
template <int E, int TOPK>
__device__ __forceinline__ bool slot_expert(const int* __restrict__ ids, int m, int& e) {
  const int slot = blockIdx.y;
  if (slot >= m * TOPK) return false;
  e = __ldg(ids + slot);
  if (e < 0 || e >= E) return false;
  for (int i = 0; i < slot; ++i)
    if (__ldg(ids + i) == e) return false;
  return true;
}

// The step's pairs (token r, slot k) that chose expert e, compacted in token order: pair[i] = r * TOPK + k for
// i < the returned count. One ballot over the warp's lanes (lane r checks token r); each warp fills its own copy,
// so no block barrier is needed. One token: the slot itself.
template <int TOPK, int MMAX>
__device__ __forceinline__ int expert_tokens(const int* __restrict__ ids, int e, int m, int* pair) {
  static_assert(MMAX >= 1 && MMAX <= 32, "one warp's ballot covers at most 32 tokens");
  if constexpr (MMAX == 1) {
    pair[0] = blockIdx.y;
    return 1;
  } else {
    const int lane = threadIdx.x & 31;
    const int k = lane < m ? slot_of<TOPK>(ids, lane, e) : -1;
    const unsigned chose = __ballot_sync(0xffffffffu, k >= 0);
    if (k >= 0) pair[__popc(chose & ((1u << lane) - 1u))] = lane * TOPK + k;
    __syncwarp();
    return __popc(chose);
  }
}

// One pass over UN units of an expert's weights for its pairs c0 .. c0 + 8 TG - 1 (fewer past n): each pair's row
// of `base` ([pairs or tokens][K], row pair / DIV) is a token column of the swapped mma; the warp's partial sums go
// to red[u][i][16] for pair c0 + i (the unit's 16 weight rows; for gate/up: gate 0-7, up 8-15).
// RING > 0: the weight and activation steps come through the warp's shared-memory ring (unit_steps_ring), else PF
// deep in registers (AHEAD: the activations too).
template <int KIND, int N, int K, int PF, int RING, int UN, int TG, int DIV, int PW, bool AHEAD>
__device__ __forceinline__ void expert_pass(float (*red)[PW][16], RingSlot<UN, TG>* ring, const WPtr& pe, int unit0,
                                            const __half* base, const int* pair, int c0, int n, int s0, int s1) {
  static_assert(8 * TG <= PW, "the pass must fit the reduction tile");
  const int lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const __half* rows[2 * TG];
#pragma unroll
  for (int g = 0; g < TG; ++g) {
    const int i = c0 + 8 * g + gid;
    rows[2 * g] = i < n ? base + (size_t)(pair[i] / DIV) * K : nullptr;
    rows[2 * g + 1] = nullptr;
  }
  float acc[UN][TG][2][4] = {};
  if constexpr (RING > 0) unit_steps_ring<KIND, N, K, RING, TG, UN>(acc, ring, pe, unit0, rows, s0, s1);
  else unit_steps_rows<KIND, N, K, PF, TG, UN, false, false, true, AHEAD>(acc, pe, unit0, rows, s0, s1);
#pragma unroll
  for (int u = 0; u < UN; ++u)
#pragma unroll
    for (int g = 0; g < TG; ++g) swap_to_smem(red[u] + 8 * g, acc[u][g], gid, t4);
}

// One gate/up item: the fused gate|up (2*IE rows, gate/up interleaved in 8-row tiles) of expert e's units
// unit0 .. unit0 + UN - 1 over the expert's pairs, PW (8 or 16) a pass (a further pass re-streams the units' weights,
// from L2), KS warps splitting H: act[(t*TOPK + k)][IE] = gelu(gate) * up in fp16. A token's result depends neither
// on the other tokens of the step, nor on its column in the pass, nor on which block runs the item.
template <int KIND, int IE, int H, int TOPK, int KS, int MMAX, int PF, int RING, int UN, int PW, bool AHEAD>
__device__ __forceinline__ void gateup_item(float (*red)[UN][PW][16], int (*pairs)[MMAX], RingSlot<UN, PW / 8>* ring,
                                            const WPtr& p,
                                            const float* __restrict__ gscale, const __half* __restrict__ x,
                                            const int* __restrict__ ids, __half* __restrict__ act, int m, int e,
                                            int unit0) {
  constexpr int STEPS = H / 64;
  constexpr size_t EW = (size_t)2 * IE * H / 2, ES = (size_t)2 * IE * H / 16;
  const int warp = threadIdx.x >> 5;
  const int s0 = warp * STEPS / KS, s1 = (warp + 1) * STEPS / KS;
  const int n = expert_tokens<TOPK, MMAX>(ids, e, m, pairs[warp]);
  const WPtr pe{p.w + e * EW, p.s + e * ES};
  const float* gs = gscale + (size_t)e * (2 * IE / 8);
  for (int c0 = 0; c0 < n; c0 += PW) {
    expert_pass<KIND, 2 * IE, H, PF, RING, UN, PW / 8, TOPK, PW, AHEAD>(red[warp], ring, pe, unit0, x, pairs[warp], c0, n,
                                                                 s0, s1);
    __syncthreads();
    for (int i = threadIdx.x; i < UN * PW * 8; i += KS * 32) {
      const int u = i / (PW * 8), r = (i >> 3) % PW, c = i & 7, unit = unit0 + u;
      if (c0 + r >= n) continue;
      float g = 0.f, up = 0.f;
#pragma unroll
      for (int w = 0; w < KS; ++w) { g += red[w][u][r][c]; up += red[w][u][r][8 + c]; }
      const float fg = tile_factor<KIND>(gs, 2 * unit), fu = tile_factor<KIND>(gs, 2 * unit + 1);
      act[(size_t)pairs[0][c0 + r] * IE + 8 * unit + c] = __float2half_rn(gelu_tanh_f(g * fg) * (up * fu));
    }
    __syncthreads();  // red and pairs are rewritten by the next pass or item
  }
}

// Gate/up. One token: block (unit, slot). Many rows, WALK: block b of the persistent grid runs items b,
// b + gridDim.x, .. of the step's (expert, UN units) items, expert-major (list: step_experts); else block (units x,
// y) runs the step's y-th expert (a block row an expert the step may select). RING > 0: weights through a
// shared-memory ring of RING steps a warp.
template <int KIND, int IE, int H, int E, int TOPK, int KS, int MMAX, int PF, int UN = 1, int PW = 8, int RING = 0,
          bool WALK = false, bool AHEAD = false>
__device__ __forceinline__ void moe_gateup(const WPtr p, const float* __restrict__ gscale,
                                           const __half* __restrict__ x, const int* __restrict__ ids,
                                           __half* __restrict__ act, int m) {
  static_assert((2 * IE) % (16 * UN) == 0 && H % 64 == 0, "expert shapes must fit the t16x64 tile and UN");
  static_assert(PW == 8 || (PW == 16 && MMAX > 8), "a pass holds 8 pairs, or 16 (two token groups)");
  __shared__ float red[KS][UN][PW][16];
  __shared__ int pairs[KS][MMAX];
  __shared__ RingSlot<UN, PW / 8> ring[KS][RING > 0 ? RING : 1];
  pdl_launch_dependents();
  pdl_wait();  // ids and x come from the router / norm kernels
  m = m < MMAX ? m : MMAX;
  RingSlot<UN, PW / 8>* mine = ring[threadIdx.x >> 5];
  if constexpr (MMAX == 1) {
    int e;
    if (!slot_expert<E, TOPK>(ids, m, e)) return;
    gateup_item<KIND, IE, H, TOPK, KS, MMAX, PF, RING, UN, PW, AHEAD>(red, pairs, mine, p, gscale, x, ids, act, m, e,
                                                               blockIdx.x * UN);
  } else {
    constexpr int U = 2 * IE / 16 / UN;
    __shared__ int list[E];
    const int n = step_experts<E, TOPK, KS * 32>(ids, m, list);
    if constexpr (WALK) {
      for (int item = blockIdx.x; item < n * U; item += gridDim.x)
        gateup_item<KIND, IE, H, TOPK, KS, MMAX, PF, RING, UN, PW, AHEAD>(red, pairs, mine, p, gscale, x, ids, act, m,
                                                                   list[item / U], (item % U) * UN);
    } else if (blockIdx.y < n) {
      gateup_item<KIND, IE, H, TOPK, KS, MMAX, PF, RING, UN, PW, AHEAD>(red, pairs, mine, p, gscale, x, ids, act, m,
                                                                 list[blockIdx.y], blockIdx.x * UN);
    }
  }
}

// One token (the many-row steps run moe_down_pairs). Block = one 16-row unit of the down projections (H rows), all
// experts: NW warps = NG slot groups x KSD K-parts. Each warp walks its slots in order, runs the leader expert's
// down rows over the gathered act rows of the tokens that chose it, and accumulates acc * inv_scale * routing
// weight per token in fp32 registers; a fixed-order shared-memory reduction gives y[t][H] (fp32)
// deterministically: no atomics, no partial buffers.
template <int KIND, int IE, int H, int E, int TOPK, int NW, int KSD, int MMAX, int PF, bool SWAP = false>
__device__ __forceinline__ void moe_down(const WPtr p, const float* __restrict__ gscale,
                                         const __half* __restrict__ act, const int* __restrict__ ids,
                                         const float* __restrict__ wts, float* __restrict__ y, int m) {
  static_assert(IE % 64 == 0 && H % 16 == 0, "expert shapes must fit the t16x64 tile");
  static_assert(NW % KSD == 0 && KSD <= IE / 64, "NW must be a multiple of KSD; KSD at most the step count");
  static_assert(MMAX == 1, "one token: its slots' leaders come from its ids in registers (slot_leads)");
  constexpr bool TWO = MMAX > 8;
  constexpr int MR = TWO ? 16 : 8;
  constexpr int STEPS = IE / 64, NG = NW / KSD;
  constexpr size_t EW = (size_t)H * IE / 2, ES = (size_t)H * IE / 16;
  __shared__ float red[NW][MR][16];
  pdl_launch_dependents();
  pdl_wait();
  m = m < MMAX ? m : MMAX;
  const int nslots = m * TOPK;
  int id[TOPK];  // the token's ids in registers: each warp checks its own slots (slot_leads, no barrier)
  token_ids<TOPK>(ids, id);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit = blockIdx.x, group = warp / KSD, kp = warp % KSD;
  const int s0 = kp * STEPS / KSD, s1 = (kp + 1) * STEPS / KSD;
  float tot[2][4] = {};
  for (int slot = group; slot < nslots; slot += NG) {
    int e;
    if (!slot_leads<E, TOPK>(id, slot, e)) continue;
    const __half* row0 = nullptr;
    const __half* row1 = nullptr;
    float w0 = 0.f, w1 = 0.f;
#pragma unroll
    for (int k = 0; k < TOPK; ++k) {
      if (gid < m && __ldg(ids + gid * TOPK + k) == e) {
        row0 = act + (size_t)(gid * TOPK + k) * IE;
        w0 = __ldg(wts + gid * TOPK + k);
      }
      if (TWO && gid + 8 < m && __ldg(ids + (gid + 8) * TOPK + k) == e) {
        row1 = act + (size_t)((gid + 8) * TOPK + k) * IE;
        w1 = __ldg(wts + (gid + 8) * TOPK + k);
      }
    }
    const WPtr pe{p.w + e * EW, p.s + e * ES};
    float acc[2][4] = {};
    unit_steps<KIND, H, IE, PF, TWO, false, SWAP>(acc, pe, unit, row0, row1, s0, s1);
    const float* gs = gscale + (size_t)e * (H / 8);
    if constexpr (SWAP) {
      // C[row][token] in acc[0] (mma_step_swap's one chain): tokens 2*t4, 2*t4+1 need their own routing weights
      float wt[2] = {0.f, 0.f};
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int tok = 2 * t4 + c;
#pragma unroll
        for (int k = 0; k < TOPK; ++k)
          if (tok < m && __ldg(ids + tok * TOPK + k) == e) wt[c] = __ldg(wts + tok * TOPK + k);
      }
      const float f0 = tile_factor<KIND>(gs, 2 * unit), f1 = tile_factor<KIND>(gs, 2 * unit + 1);
      tot[0][0] = fmaf(acc[0][0] * f0, wt[0], tot[0][0]);
      tot[0][1] = fmaf(acc[0][1] * f0, wt[1], tot[0][1]);
      tot[0][2] = fmaf(acc[0][2] * f1, wt[0], tot[0][2]);
      tot[0][3] = fmaf(acc[0][3] * f1, wt[1], tot[0][3]);
    } else {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const float f = tile_factor<KIND>(gs, 2 * unit + t);
        tot[t][0] = fmaf(acc[t][0] * f, w0, tot[t][0]);
        tot[t][1] = fmaf(acc[t][1] * f, w0, tot[t][1]);
        tot[t][2] = fmaf(acc[t][2] * f, w1, tot[t][2]);
        tot[t][3] = fmaf(acc[t][3] * f, w1, tot[t][3]);
      }
    }
  }
  if constexpr (SWAP) {
    red[warp][2 * t4][gid] = tot[0][0];
    red[warp][2 * t4 + 1][gid] = tot[0][1];
    red[warp][2 * t4][8 + gid] = tot[0][2];
    red[warp][2 * t4 + 1][8 + gid] = tot[0][3];
  } else {
    frag_to_smem<MR>(red[warp], tot, gid, t4);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < MR * 16; i += NW * 32) {
    const int r = i >> 4, c = i & 15;
    if (r >= m) break;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][r][c];
    y[(size_t)r * H + 16 * unit + c] = v;
  }
}

// Many rows: the expert's down rows of UN units over the act rows of its pairs, PW a pass, each pair's
// routing-weighted part into its own row ypair[(t*TOPK + k)][H] fp32; ffn_tail (its PAIRS form) then sums a token's
// pairs in slot order, whatever else the step holds. The K split is DOWN_KS = 1 (moe.py): a pair's row is one
// accumulator chain, as in the one-token moe_down, so an item is a warp's own. WALK: each warp of the persistent grid
// walks the step's (expert, UN units) items; else warp w of block (x, y) runs the step's y-th expert's unit group
// x * WARPS + w. RING as moe_gateup.
template <int KIND, int IE, int H, int E, int TOPK, int WARPS, int MMAX, int PF, int UN = 1, int PW = 8,
          int RING = 0, bool WALK = false, bool AHEAD = false>
__device__ __forceinline__ void moe_down_pairs(const WPtr p, const float* __restrict__ gscale,
                                               const __half* __restrict__ act, const int* __restrict__ ids,
                                               const float* __restrict__ wts, float* __restrict__ ypair, int m) {
  static_assert(IE % 64 == 0 && H % (16 * UN * (WALK ? 1 : WARPS)) == 0, "expert shapes must fit the tile and grid");
  static_assert(MMAX > 1, "one token runs moe_down");
  static_assert(PW == 8 || (PW == 16 && MMAX > 8), "a pass holds 8 pairs, or 16 (two token groups)");
  constexpr int STEPS = IE / 64, U = H / 16 / UN;
  constexpr size_t EW = (size_t)H * IE / 2, ES = (size_t)H * IE / 16;
  __shared__ float red[WARPS][UN][PW][16];
  __shared__ int pairs[WARPS][MMAX];
  __shared__ int list[E];
  __shared__ RingSlot<UN, PW / 8> ring[WARPS][RING > 0 ? RING : 1];
  pdl_launch_dependents();
  pdl_wait();  // ids, wts and act come from the router and gate/up kernels
  m = m < MMAX ? m : MMAX;
  const int n = step_experts<E, TOPK, WARPS * 32>(ids, m, list);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first = WALK ? blockIdx.x * WARPS + warp : blockIdx.y * U + blockIdx.x * WARPS + warp;
  const int last = WALK ? n * U : (blockIdx.y < n ? first + 1 : 0);
  for (int item = first; item < last; item += gridDim.x * WARPS) {
    const int e = list[item / U], unit0 = (item % U) * UN;
    const int cnt = expert_tokens<TOPK, MMAX>(ids, e, m, pairs[warp]);
    const WPtr pe{p.w + e * EW, p.s + e * ES};
    const float* gs = gscale + (size_t)e * (H / 8);
    for (int c0 = 0; c0 < cnt; c0 += PW) {
      expert_pass<KIND, H, IE, PF, RING, UN, PW / 8, 1, PW, AHEAD>(red[warp], ring[warp], pe, unit0, act, pairs[warp], c0,
                                                            cnt, 0, STEPS);
      __syncwarp();
      for (int i = lane; i < UN * PW * 16; i += 32) {
        const int u = i / (PW * 16), r = (i >> 4) % PW, c = i & 15, unit = unit0 + u;
        if (c0 + r >= cnt) continue;
        const float v = 0.f + red[warp][u][r][c];  // as a sum over one warp's part (the one-token form's order)
        const int pair = pairs[warp][c0 + r];
        ypair[(size_t)pair * H + 16 * unit + c] = v * tile_factor<KIND>(gs, 2 * unit + (c >> 3)) * __ldg(wts + pair);
      }
      __syncwarp();  // red and pairs are rewritten by the next pass or item
    }
  }
}

}  // namespace thorgen
