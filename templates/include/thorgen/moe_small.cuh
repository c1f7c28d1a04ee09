// thorgen MoE for the small steps (decode M = 1, verify and batched decode M <= 32) on the t16x64 tile engine
// (nvfp4.cuh, gemm_nvfp4.cuh). Grid (16-row unit groups, one block row per expert the step may select): block row y
// runs one distinct expert (block_expert), so every selected expert's weights are read once per unit, whatever the
// step's routing, and every output row is written by exactly one block (no atomics, deterministic).
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

// The blockIdx.y-th distinct expert that the step's slots name, in expert-id order; false past the last. Many rows
// launch min(E, m * TOPK) block rows (the ROW_GRID cap), one per expert a step can select, not one per slot: at 32
// tokens the slots name ~111 distinct experts in 256 slots, and the blocks that only found they led nothing cost, in
// the kernel bench, ~20 us a layer of gate/up and ~18 of down (16 experts over 32 tokens took 40 and 37 us, over 16
// tokens 21 and 19); in a 32-row step this form saved 3.2 and 6.1 us a layer (H200, 2026-12-02). The block's threads
// mark its slots in a shared bitmap behind one barrier. Every thread must call it.
template <int E, int TOPK, int THREADS>
__device__ __forceinline__ bool nth_expert(const int* __restrict__ ids, int m, int& e) {
  constexpr int WORDS = (E + 31) / 32;
  __shared__ unsigned present[WORDS];
  for (int i = threadIdx.x; i < WORDS; i += THREADS) present[i] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < m * TOPK; i += THREADS) {
    const int x = __ldg(ids + i);
    if (x >= 0 && x < E) atomicOr(present + (x >> 5), 1u << (x & 31));
  }
  __syncthreads();
  int n = blockIdx.y;
#pragma unroll
  for (int w = 0; w < WORDS; ++w) {
    unsigned bits = present[w];
    const int c = __popc(bits);
    if (n < c) {
      for (int j = 0; j < n; ++j) bits &= bits - 1u;  // drop the n lower experts of this word
      e = 32 * w + __ffs(bits) - 1;
      return true;
    }
    n -= c;
  }
  return false;
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

// The expert this block runs, or false (nothing to do). One token: grid row = its slot, which runs its expert unless
// an earlier slot names it (a scan of at most 7 slots; every thread loading all 8 ids instead measured 9.3 -> 9.6 us a
// layer on the H200, a barrier 9.9). Many rows: nth_expert. Every thread must call it.
template <int E, int TOPK, int MMAX, int THREADS>
__device__ __forceinline__ bool block_expert(const int* __restrict__ ids, int m, int& e) {
  if constexpr (MMAX == 1) {
    const int slot = blockIdx.y;
    if (slot >= m * TOPK) return false;
    e = __ldg(ids + slot);
    if (e < 0 || e >= E) return false;
    for (int i = 0; i < slot; ++i)
      if (__ldg(ids + i) == e) return false;
    return true;
  } else {
    return nth_expert<E, TOPK, THREADS>(ids, m, e);
  }
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
template <int KIND, int N, int K, int PF, int UN, int TG, int DIV, int PW>
__device__ __forceinline__ void expert_pass(float (*red)[PW][16], const WPtr& pe, int unit0, const __half* base,
                                            const int* pair, int c0, int n, int s0, int s1) {
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
  unit_steps_rows<KIND, N, K, PF, TG, UN, false, false, true>(acc, pe, unit0, rows, s0, s1);
#pragma unroll
  for (int u = 0; u < UN; ++u)
#pragma unroll
    for (int g = 0; g < TG; ++g) swap_to_smem(red[u] + 8 * g, acc[u][g], gid, t4);
}

// Block (UN units, block_expert's expert): the expert's fused gate|up (2*IE rows, gate/up interleaved in 8-row tiles)
// over its tokens, PW (8 or 16) a pass (a further pass re-streams the unit's weights, from L2), KS warps
// splitting H: act[(t*TOPK + k)][IE] = gelu(gate) * up in fp16. A token's result depends neither on the other
// tokens of the step nor on its column in the pass.
template <int KIND, int IE, int H, int E, int TOPK, int KS, int MMAX, int PF, int UN = 1, int PW = 8>
__device__ __forceinline__ void moe_gateup(const WPtr p, const float* __restrict__ gscale,
                                           const __half* __restrict__ x, const int* __restrict__ ids,
                                           __half* __restrict__ act, int m) {
  static_assert((2 * IE) % 16 == 0 && H % 64 == 0, "expert shapes must fit the t16x64 tile");
  constexpr int STEPS = H / 64;
  constexpr size_t EW = layout_weight_bytes<KIND>(2 * IE, H), ES = layout_scale_bytes<KIND>(2 * IE, H);
  static_assert(PW == 8 || (PW == 16 && MMAX > 8), "a pass holds 8 pairs, or 16 (two token groups)");
  __shared__ float red[KS][UN][PW][16];
  __shared__ int pairs[KS][MMAX];
  pdl_launch_dependents();
  pdl_wait();  // ids and x come from the router / norm kernels
  m = m < MMAX ? m : MMAX;
  int e;
  if (!block_expert<E, TOPK, MMAX, KS * 32>(ids, m, e)) return;
  const int warp = threadIdx.x >> 5, unit0 = blockIdx.x * UN;
  const int s0 = warp * STEPS / KS, s1 = (warp + 1) * STEPS / KS;
  const int n = expert_tokens<TOPK, MMAX>(ids, e, m, pairs[warp]);
  const WPtr pe{p.w + e * EW, p.s + e * ES};
  const float* gs = gscale + (KIND == HALF ? (size_t)0 : (size_t)e) * (2 * IE / 8);
  for (int c0 = 0; c0 < n; c0 += PW) {
    expert_pass<KIND, 2 * IE, H, PF, UN, PW / 8, TOPK, PW>(red[warp], pe, unit0, x, pairs[warp], c0, n, s0, s1);
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
    __syncthreads();  // red is rewritten by the next pass
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
  constexpr size_t EW = layout_weight_bytes<KIND>(H, IE), ES = layout_scale_bytes<KIND>(H, IE);
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
    const float* gs = gscale + (KIND == HALF ? (size_t)0 : (size_t)e) * (H / 8);
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

// Block (UN units, block_expert's expert), as moe_gateup: the expert's down rows of these units over the act rows of
// its pairs, PW a pass, each pair's routing-weighted part into its own row ypair[(t*TOPK + k)][H] fp32; ffn_tail
// (its PAIRS form) then sums a token's pairs in slot order, whatever else the step holds. One block per (unit,
// expert) spreads the ~80 experts 16 tokens select over the whole GPU, where moe_down's H/16 blocks each walk all
// of them.
template <int KIND, int IE, int H, int E, int TOPK, int KS, int MMAX, int PF, int UN = 1, int PW = 8>
__device__ __forceinline__ void moe_down_pairs(const WPtr p, const float* __restrict__ gscale,
                                               const __half* __restrict__ act, const int* __restrict__ ids,
                                               const float* __restrict__ wts, float* __restrict__ ypair, int m) {
  static_assert(IE % 64 == 0 && H % 16 == 0, "expert shapes must fit the t16x64 tile");
  static_assert(KS >= 1 && KS <= IE / 64, "K split must give every warp at least one step");
  constexpr int STEPS = IE / 64;
  constexpr size_t EW = layout_weight_bytes<KIND>(H, IE), ES = layout_scale_bytes<KIND>(H, IE);
  static_assert(PW == 8 || (PW == 16 && MMAX > 8), "a pass holds 8 pairs, or 16 (two token groups)");
  __shared__ float red[KS][UN][PW][16];
  __shared__ int pairs[KS][MMAX];
  pdl_launch_dependents();
  pdl_wait();  // ids, wts and act come from the router and gate/up kernels
  m = m < MMAX ? m : MMAX;
  int e;
  if (!block_expert<E, TOPK, MMAX, KS * 32>(ids, m, e)) return;
  const int warp = threadIdx.x >> 5, unit0 = blockIdx.x * UN;
  const int s0 = warp * STEPS / KS, s1 = (warp + 1) * STEPS / KS;
  const int n = expert_tokens<TOPK, MMAX>(ids, e, m, pairs[warp]);
  const WPtr pe{p.w + e * EW, p.s + e * ES};
  const float* gs = gscale + (KIND == HALF ? (size_t)0 : (size_t)e) * (H / 8);
  for (int c0 = 0; c0 < n; c0 += PW) {
    expert_pass<KIND, H, IE, PF, UN, PW / 8, 1, PW>(red[warp], pe, unit0, act, pairs[warp], c0, n, s0, s1);
    __syncthreads();
    for (int i = threadIdx.x; i < UN * PW * 16; i += KS * 32) {
      const int u = i / (PW * 16), r = (i >> 4) % PW, c = i & 15, unit = unit0 + u;
      if (c0 + r >= n) continue;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < KS; ++w) v += red[w][u][r][c];
      const int pair = pairs[0][c0 + r];
      ypair[(size_t)pair * H + 16 * unit + c] = v * tile_factor<KIND>(gs, 2 * unit + (c >> 3)) * __ldg(wts + pair);
    }
    __syncthreads();
  }
}

}  // namespace thorgen
