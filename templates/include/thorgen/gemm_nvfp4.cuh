// thorgen weight-streaming GEMMs on the t16x64 tile engine (nvfp4.cuh): y[m, n] = sum_k x[m, k] * W[n, k].
//   gemm_small : M <= 16 (decode M = 1, verify M = 2..16). One block per 16-row unit of W, KS warps split K,
//                each weight byte read once for all M rows (mma.m16n8k16, A = activations, B decoded in registers),
//                deterministic shared-memory reduction over the KS warps, fused epilogue.
//   gemm_large : prefill (M up to the chunk size). Block = NWARP units x BM rows; A tiles through shared memory
//                (cp.async, STAGES deep), B decoded in registers straight from the layout.
// Epilogues: STORE (y = acc * inv_global_scale), GELU_MUL / SILU_MUL (fused gate/up interleaved in 8-row tiles:
// y[m, 8u + c] = act(gate) * up, output width N/2).
#pragma once
#include "thorgen/nvfp4.cuh"

namespace thorgen {

enum Epilogue : int { EPI_STORE = 0, EPI_GELU_MUL = 1, EPI_SILU_MUL = 2 };

template <int EPI> __device__ __forceinline__ float act_mul(float g, float u) {
  if constexpr (EPI == EPI_GELU_MUL) return gelu_tanh_f(g) * u;
  else return silu_f(g) * u;
}

// per-8-row-tile fp32 factor: inverse global scale (NVFP4) times the decode factor; 1 for fp16 weights.
template <int KIND> __device__ __forceinline__ float tile_factor(const float* __restrict__ gscale, int tile) {
  if constexpr (KIND == HALF) return 1.0f;
  else return __ldg(gscale + tile) * DecodeFactor<KIND>::value;
}

// Write a warp's two accumulator tiles into a [MR][16] fp32 smem tile (rows >= MR dropped).
template <int MR>
__device__ __forceinline__ void frag_to_smem(float (*dst)[16], const float (&acc)[2][4], int gid, int t4) {
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    dst[gid][8 * t + 2 * t4] = acc[t][0];
    dst[gid][8 * t + 2 * t4 + 1] = acc[t][1];
    if constexpr (MR > 8) {
      dst[gid + 8][8 * t + 2 * t4] = acc[t][2];
      dst[gid + 8][8 * t + 2 * t4 + 1] = acc[t][3];
    }
  }
}

// Swapped accumulators (see mma_step_swap) -> the same [token][16 columns] smem tile as frag_to_smem.
__device__ __forceinline__ void swap_to_smem(float (*dst)[16], const float (&acc)[2][4], int gid, int t4) {
  dst[2 * t4][gid] = acc[0][0] + acc[1][0];
  dst[2 * t4 + 1][gid] = acc[0][1] + acc[1][1];
  dst[2 * t4][8 + gid] = acc[0][2] + acc[1][2];
  dst[2 * t4 + 1][8 + gid] = acc[0][3] + acc[1][3];
}

template <bool SWAP, int MR>
__device__ __forceinline__ void acc_to_smem(float (*dst)[16], const float (&acc)[2][4], int gid, int t4) {
  if constexpr (SWAP) swap_to_smem(dst, acc, gid, t4);
  else frag_to_smem<MR>(dst, acc, gid, t4);
}

// The tensor-core rows of a step of up to MMAX tokens: RT 16-row tiles (one 8-row half for MMAX <= 8); MR rows of
// the shared-memory reduction tile.
template <int MMAX> struct RowTiles {
  static_assert(MMAX >= 1 && MMAX <= 32, "the small kernels handle 1..32 rows");
  static constexpr int RT = MMAX > 16 ? 2 : 1;
  static constexpr bool TWO = MMAX > 8;
  static constexpr int MR = MMAX > 16 ? 32 : TWO ? 16 : 8;
};

// Every tile's accumulators into rows 16 rt.. of a [MR][16] smem tile.
template <bool SWAP, int MR, int RT>
__device__ __forceinline__ void tiles_to_smem(float (*dst)[16], const float (&acc)[RT][2][4], int gid, int t4) {
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) acc_to_smem<SWAP, (MR < 16 ? MR : 16)>(dst + 16 * rt, acc[rt], gid, t4);
}

// The lane's rows (unit_steps_rows order: row 8 j + gid) of x [m][K], nullptr past m.
template <int RT, bool TWO>
__device__ __forceinline__ void lane_rows(const __half* (&rows)[2 * RT], const __half* x, int K, int m, int gid) {
#pragma unroll
  for (int j = 0; j < 2 * RT; ++j) {
    const int r = 8 * j + gid;
    rows[j] = ((j & 1) == 0 || TWO) && r < m ? x + (size_t)r * K : nullptr;
  }
}

// ---- M <= 32 -----------------------------------------------------------------------------------------------
template <int KIND, int N, int K, int KS, int MMAX, int PF, int EPI, typename OutT, bool SWAP = false>
__device__ __forceinline__ void gemm_small(const WPtr p, const float* __restrict__ gscale,
                                           const __half* __restrict__ x, OutT* __restrict__ y, int m) {
  static_assert(N % 16 == 0 && K % 64 == 0, "W must be [N % 16 == 0, K % 64 == 0]");
  static_assert(KS >= 1 && KS <= 32 && KS <= K / 64, "K split must give every warp at least one step");
  using Tiles = RowTiles<MMAX>;
  constexpr int RT = Tiles::RT, MR = Tiles::MR;
  constexpr int STEPS = K / 64;
  __shared__ float red[KS][MR][16];
  pdl_launch_dependents();
  m = m < MMAX ? m : MMAX;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit = blockIdx.x;
  const int s0 = warp * STEPS / KS, s1 = (warp + 1) * STEPS / KS;
  const __half* rows[2 * RT];
  lane_rows<RT, Tiles::TWO>(rows, x, K, m, gid);
  float acc[1][RT][2][4] = {};
  static_assert(!(SWAP && Tiles::TWO), "the swapped form holds at most 8 tokens");
  unit_steps_rows<KIND, N, K, PF, RT, 1, Tiles::TWO, true, SWAP>(acc, p, unit, rows, s0, s1);
  tiles_to_smem<SWAP, MR>(red[warp], acc[0], gid, t4);
  __syncthreads();
  if constexpr (EPI == EPI_STORE) {
    for (int i = threadIdx.x; i < MR * 16; i += KS * 32) {
      const int r = i >> 4, c = i & 15;
      if (r >= m) break;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < KS; ++w) v += red[w][r][c];
      y[(size_t)r * N + 16 * unit + c] = from_f32<OutT>(v * tile_factor<KIND>(gscale, 2 * unit + (c >> 3)));
    }
  } else {
    const float fg = tile_factor<KIND>(gscale, 2 * unit), fu = tile_factor<KIND>(gscale, 2 * unit + 1);
    for (int i = threadIdx.x; i < MR * 8; i += KS * 32) {
      const int r = i >> 3, c = i & 7;
      if (r >= m) break;
      float g = 0.f, u = 0.f;
#pragma unroll
      for (int w = 0; w < KS; ++w) { g += red[w][r][c]; u += red[w][r][8 + c]; }
      y[(size_t)r * (N / 2) + 8 * unit + c] = from_f32<OutT>(act_mul<EPI>(g * fg, u * fu));
    }
  }
}

// ---- grouped MoE, M <= 16 ------------------------------------------------------------------------------------
// The slot (0..TOPK-1) of token r that names expert e, or -1.
template <int TOPK>
__device__ __forceinline__ int slot_of(const int* __restrict__ ids, int r, int e) {
  int k = -1;
#pragma unroll
  for (int kk = 0; kk < TOPK; ++kk)
    if (__ldg(ids + r * TOPK + kk) == e) k = kk;
  return k;
}

// Whether an earlier slot than `slot` names expert e (then that slot's block does the expert): the block's threads
// check the earlier slots together behind one barrier, where one serial scan cost ~64 dependent loads before any
// weight load (16 tokens: 99.9 -> 85.2 us a layer of gate/up). Every thread of the block must call it.
template <int THREADS>
__device__ __forceinline__ bool named_earlier(const int* __restrict__ ids, int slot, int e) {
  bool dup = false;
  for (int i = threadIdx.x; i < slot; i += THREADS) dup |= __ldg(ids + i) == e;
  return __syncthreads_or(dup);
}

// Block (unit group, slot): only the first slot of each distinct expert ("leader") works; it runs the expert's fused
// gate/up (2*IE rows, interleaved 8-row tiles) over ALL m tokens (tensor-core rows are free), then writes
// gelu(gate)*up for the tokens that chose the expert: act[(t*TOPK + k)][IE] fp16. Weights read once per step.
// UN units a block (a warp runs all of them on each activation step it loads).
template <int KIND, int IE, int H, int E, int TOPK, int KS, int MMAX, int PF, bool SWAP = false, int UN = 1>
__device__ __forceinline__ void moe_gateup(const WPtr p, const float* __restrict__ gscale,
                                           const __half* __restrict__ x, const int* __restrict__ ids,
                                           __half* __restrict__ act, int m) {
  static_assert((2 * IE) % 16 == 0 && H % 64 == 0, "expert shapes must fit the t16x64 tile");
  using Tiles = RowTiles<MMAX>;
  constexpr int RT = Tiles::RT, MR = Tiles::MR;
  constexpr int STEPS = H / 64;
  constexpr size_t EW = (size_t)2 * IE * H / 2, ES = (size_t)2 * IE * H / 16;
  __shared__ float red[KS][UN][MR][16];
  pdl_launch_dependents();
  pdl_wait();  // ids and x come from the router / norm kernels
  m = m < MMAX ? m : MMAX;
  const int slot = blockIdx.y;
  if (slot >= m * TOPK) return;
  const int e = __ldg(ids + slot);
  if (e < 0 || e >= E) return;
  // not the leader of this expert when an earlier slot names it (one token: at most 7 earlier slots, which a
  // serial scan checks sooner than a barrier: 9.6 vs 9.9 us)
  if constexpr (MMAX == 1) {
    for (int i = 0; i < slot; ++i)
      if (__ldg(ids + i) == e) return;
  } else if (named_earlier<KS * 32>(ids, slot, e)) {
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit0 = blockIdx.x * UN;
  const int s0 = warp * STEPS / KS, s1 = (warp + 1) * STEPS / KS;
  const __half* rows[2 * RT];
  lane_rows<RT, Tiles::TWO>(rows, x, H, m, gid);
  const WPtr pe{p.w + e * EW, p.s + e * ES};
  float acc[UN][RT][2][4] = {};
  static_assert(!(SWAP && Tiles::TWO), "the swapped form holds at most 8 tokens");
  unit_steps_rows<KIND, 2 * IE, H, PF, RT, UN, Tiles::TWO, false, SWAP>(acc, pe, unit0, rows, s0, s1);
#pragma unroll
  for (int u = 0; u < UN; ++u) tiles_to_smem<SWAP, MR>(red[warp][u], acc[u], gid, t4);
  __syncthreads();
  const float* gs = gscale + (size_t)e * (2 * IE / 8);
  for (int i = threadIdx.x; i < UN * MR * 8; i += KS * 32) {
    const int u = i / (MR * 8), r = (i >> 3) % MR, c = i & 7, unit = unit0 + u;
    if (r >= m) continue;
    const int k = slot_of<TOPK>(ids, r, e);
    if (k < 0) continue;
    float g = 0.f, up = 0.f;
#pragma unroll
    for (int w = 0; w < KS; ++w) { g += red[w][u][r][c]; up += red[w][u][r][8 + c]; }
    const float fg = tile_factor<KIND>(gs, 2 * unit), fu = tile_factor<KIND>(gs, 2 * unit + 1);
    act[(size_t)(r * TOPK + k) * IE + 8 * unit + c] = __float2half_rn(gelu_tanh_f(g * fg) * (up * fu));
  }
}

// Block = one 16-row unit of the down projections (H rows), all experts: NW warps = NG slot groups x KSD K-parts.
// Each warp walks its slots in order, runs the leader expert's down rows over the gathered act rows of the tokens
// that chose it, and accumulates acc * inv_scale * routing weight per token in fp32 registers; a fixed-order
// shared-memory reduction gives y[t][H] (fp32) deterministically: no atomics, no partial buffers.
template <int KIND, int IE, int H, int E, int TOPK, int NW, int KSD, int MMAX, int PF, bool SWAP = false>
__device__ __forceinline__ void moe_down(const WPtr p, const float* __restrict__ gscale,
                                         const __half* __restrict__ act, const int* __restrict__ ids,
                                         const float* __restrict__ wts, float* __restrict__ y, int m) {
  static_assert(IE % 64 == 0 && H % 16 == 0, "expert shapes must fit the t16x64 tile");
  static_assert(NW % KSD == 0 && KSD <= IE / 64, "NW must be a multiple of KSD; KSD at most the step count");
  constexpr bool TWO = MMAX > 8;
  constexpr int MR = TWO ? 16 : 8;
  constexpr int STEPS = IE / 64, NG = NW / KSD, SLOTS = MMAX * TOPK;
  constexpr size_t EW = (size_t)H * IE / 2, ES = (size_t)H * IE / 16;
  __shared__ float red[NW][MR][16];
  __shared__ int lead[SLOTS];
  __shared__ int first[E];  // the first slot naming each expert
  pdl_launch_dependents();
  pdl_wait();
  m = m < MMAX ? m : MMAX;
  const int nslots = m * TOPK;
  // a slot leads when it is the first naming its expert: one shared-memory atomicMin per slot (a serial scan of
  // the earlier slots per thread took up to 127 dependent loads before any weight load)
  for (int i = threadIdx.x; i < E; i += NW * 32) first[i] = SLOTS;
  __syncthreads();
  for (int i = threadIdx.x; i < nslots; i += NW * 32) {
    const int e = __ldg(ids + i);
    if (e >= 0 && e < E) atomicMin(first + e, i);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < SLOTS; i += NW * 32) {
    int ok = 0;
    if (i < nslots) {
      const int e = __ldg(ids + i);
      ok = e >= 0 && e < E && first[e] == i;
    }
    lead[i] = ok;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit = blockIdx.x, group = warp / KSD, kp = warp % KSD;
  const int s0 = kp * STEPS / KSD, s1 = (kp + 1) * STEPS / KSD;
  float tot[2][4] = {};
  for (int slot = group; slot < nslots; slot += NG) {
    if (!lead[slot]) continue;
    const int e = __ldg(ids + slot);
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
      // C[row][token]: tokens 2*t4, 2*t4+1 need their own routing weights for expert e
      float wt[2] = {0.f, 0.f};
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int tok = 2 * t4 + c;
#pragma unroll
        for (int k = 0; k < TOPK; ++k)
          if (tok < m && __ldg(ids + tok * TOPK + k) == e) wt[c] = __ldg(wts + tok * TOPK + k);
      }
      const float f0 = tile_factor<KIND>(gs, 2 * unit), f1 = tile_factor<KIND>(gs, 2 * unit + 1);
      tot[0][0] = fmaf((acc[0][0] + acc[1][0]) * f0, wt[0], tot[0][0]);
      tot[0][1] = fmaf((acc[0][1] + acc[1][1]) * f0, wt[1], tot[0][1]);
      tot[0][2] = fmaf((acc[0][2] + acc[1][2]) * f1, wt[0], tot[0][2]);
      tot[0][3] = fmaf((acc[0][3] + acc[1][3]) * f1, wt[1], tot[0][3]);
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

// Block (unit, slot), as moe_gateup: only the first slot naming an expert works. It runs the expert's down rows of
// this unit over the act rows of the tokens that chose it (gathered; the other rows are zero) and writes each such
// token's routing-weighted part into its pair row, ypair[(t*TOPK + k)][H] fp32; ffn_tail (PAIRS) then sums a
// token's pairs in slot order. One block per (unit, expert) spreads the ~80 experts 16 tokens select over the
// whole GPU, where moe_down's H/16 blocks each walk all of them. Each valid pair row is written by exactly one
// block per unit (no atomics), and a token's sum order is its slot order, whatever else the step holds.
// UN units a block, as moe_gateup.
template <int KIND, int IE, int H, int E, int TOPK, int KS, int MMAX, int PF, int UN = 1>
__device__ __forceinline__ void moe_down_pairs(const WPtr p, const float* __restrict__ gscale,
                                               const __half* __restrict__ act, const int* __restrict__ ids,
                                               const float* __restrict__ wts, float* __restrict__ ypair, int m) {
  static_assert(IE % 64 == 0 && H % 16 == 0, "expert shapes must fit the t16x64 tile");
  static_assert(KS >= 1 && KS <= IE / 64, "K split must give every warp at least one step");
  using Tiles = RowTiles<MMAX>;
  constexpr int RT = Tiles::RT, MR = Tiles::MR;
  constexpr int STEPS = IE / 64;
  constexpr size_t EW = (size_t)H * IE / 2, ES = (size_t)H * IE / 16;
  __shared__ float red[KS][UN][MR][16];
  pdl_launch_dependents();
  pdl_wait();  // ids, wts and act come from the router and gate/up kernels
  m = m < MMAX ? m : MMAX;
  const int slot = blockIdx.y;
  if (slot >= m * TOPK) return;
  const int e = __ldg(ids + slot);
  if (e < 0 || e >= E) return;
  if (named_earlier<KS * 32>(ids, slot, e)) return;  // an earlier slot's block does the expert
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit0 = blockIdx.x * UN;
  const int s0 = warp * STEPS / KS, s1 = (warp + 1) * STEPS / KS;
  const __half* rows[2 * RT];  // the act rows of the lane's tokens (8 j + gid) for expert e, if they chose it
#pragma unroll
  for (int j = 0; j < 2 * RT; ++j) {
    const int r = 8 * j + gid;
    rows[j] = nullptr;
    if (((j & 1) == 0 || Tiles::TWO) && r < m) {
      const int k = slot_of<TOPK>(ids, r, e);
      if (k >= 0) rows[j] = act + (size_t)(r * TOPK + k) * IE;
    }
  }
  const WPtr pe{p.w + e * EW, p.s + e * ES};
  float acc[UN][RT][2][4] = {};
  unit_steps_rows<KIND, H, IE, PF, RT, UN, Tiles::TWO, false, false>(acc, pe, unit0, rows, s0, s1);
#pragma unroll
  for (int u = 0; u < UN; ++u) tiles_to_smem<false, MR>(red[warp][u], acc[u], gid, t4);
  __syncthreads();
  const float* gs = gscale + (size_t)e * (H / 8);
  for (int i = threadIdx.x; i < UN * MR * 16; i += KS * 32) {
    const int u = i / (MR * 16), r = (i >> 4) % MR, c = i & 15, unit = unit0 + u;
    if (r >= m) continue;
    const int k = slot_of<TOPK>(ids, r, e);
    if (k < 0) continue;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < KS; ++w) v += red[w][u][r][c];
    const int pair = r * TOPK + k;
    ypair[(size_t)pair * H + 16 * unit + c] = v * tile_factor<KIND>(gs, 2 * unit + (c >> 3)) * __ldg(wts + pair);
  }
}

// ---- large M (prefill) ---------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <int BM, int STAGES> struct LargeSmem {
  static constexpr int PITCH = 64 + 8;  // halves per row: +16 B keeps the lanes' 16-B reads on distinct banks
  static constexpr int BYTES = STAGES * BM * PITCH * 2;
};

template <int KIND, int N, int K, int BM, int NWARP, int STAGES, int EPI, typename OutT>
__device__ __forceinline__ void gemm_large(const WPtr p, const float* __restrict__ gscale,
                                           const __half* __restrict__ x, OutT* __restrict__ y, int m) {
  static_assert(N % (16 * NWARP) == 0 && K % 64 == 0, "N must be a multiple of 16*NWARP, K of 64");
  static_assert(BM % 16 == 0 && BM <= 128 && STAGES >= 2, "BM in 16..128, at least 2 stages");
  constexpr int STEPS = K / 64, MT = BM / 16, THREADS = NWARP * 32, PITCH = LargeSmem<BM, STAGES>::PITCH;
  extern __shared__ uint4 smem_u4[];
  __half* As = reinterpret_cast<__half*>(smem_u4);
  pdl_launch_dependents();
  const int m0 = blockIdx.y * BM;
  if (m0 >= m) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit = blockIdx.x * NWARP + warp;
  WStep<KIND> wcur, wnext;
  load_step<KIND, N, K>(wcur, p, unit, 0, lane);
  pdl_wait();
  auto load_tile = [&](int stage, int step) {
    for (int c = threadIdx.x; c < BM * 8; c += THREADS) {
      const int r = c >> 3, ch = c & 7;
      const bool ok = m0 + r < m;
      const __half* src = x + (size_t)(ok ? m0 + r : 0) * K + 64 * step + 8 * ch;
      cp_async16(As + ((size_t)stage * BM + r) * PITCH + 8 * ch, src, ok);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < STEPS) load_tile(s, s);
    cp_async_commit();
  }
  float acc[MT][2][4] = {};
  for (int s = 0; s < STEPS; ++s) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (s + STAGES - 1 < STEPS) load_tile((s + STAGES - 1) % STAGES, s + STAGES - 1);
    cp_async_commit();
    if (s + 1 < STEPS) load_step<KIND, N, K>(wnext, p, unit, s + 1, lane);
    uint32_t b[2][4][2];
    decode_step<KIND>(wcur, b);
    const __half* tile = As + (size_t)(s % STAGES) * BM * PITCH;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      AStep a;
      const __half* r0 = tile + (mt * 16 + gid) * PITCH + 16 * t4;
      const __half* r1 = r0 + 8 * PITCH;
      a.r0[0] = *reinterpret_cast<const uint4*>(r0);
      a.r0[1] = *reinterpret_cast<const uint4*>(r0 + 8);
      a.r1[0] = *reinterpret_cast<const uint4*>(r1);
      a.r1[1] = *reinterpret_cast<const uint4*>(r1 + 8);
      mma_step<true>(acc[mt], a, b);
    }
    wcur = wnext;
  }
  const float f0 = tile_factor<KIND>(gscale, 2 * unit), f1 = tile_factor<KIND>(gscale, 2 * unit + 1);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + mt * 16 + gid + 8 * h;
      if (r >= m) continue;
      if constexpr (EPI == EPI_STORE) {
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const float f = t ? f1 : f0;
          OutT* dst = y + (size_t)r * N + 16 * unit + 8 * t + 2 * t4;
          dst[0] = from_f32<OutT>(acc[mt][t][2 * h] * f);
          dst[1] = from_f32<OutT>(acc[mt][t][2 * h + 1] * f);
        }
      } else {
        OutT* dst = y + (size_t)r * (N / 2) + 8 * unit + 2 * t4;
        dst[0] = from_f32<OutT>(act_mul<EPI>(acc[mt][0][2 * h] * f0, acc[mt][1][2 * h] * f1));
        dst[1] = from_f32<OutT>(act_mul<EPI>(acc[mt][0][2 * h + 1] * f0, acc[mt][1][2 * h + 1] * f1));
      }
    }
  }
}

}  // namespace thorgen
