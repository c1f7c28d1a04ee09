// thorgen grouped-MoE GEMMs for prefill chunks on Hopper's warpgroup tensor cores (sm_90a only): the tiles and
// pairs of moe_grouped_plan (moe_grouped.cuh), each tile's rows times its expert's weights through WgmmaLoop
// (gemm_wgmma.cuh). An expert averages 32 rows of a 512-row chunk, so the weights are the wgmma A operand (64 rows a
// warpgroup) and the tile's up to 64 gathered token rows the B operand (m64n64k16): one weight read serves them all.
// acc[4 i + h] = (weight row 16 wq + gid + 8 (h >> 1) of the warpgroup's 64, token 8 i + 2 t4 + (h & 1)): a lane
// holds rows gid and gid + 8 of one 16-row unit, i.e. the gate (tile 0) and up (tile 1) of the same output column.
// Same outputs as the mma.sync forms (act_sorted f16 rows; routing-weighted f32 pair rows), other fp32 sum order.
#pragma once
#include "thorgen/gemm_wgmma.cuh"
#include "thorgen/moe_grouped.cuh"

namespace thorgen {

// The thread's 16-byte chunks of the tile's token rows: src[r] (shared) = row r's K activations, nullptr = padding.
template <class Loop>
__device__ __forceinline__ void tile_chunks(const __half* const* src, const __half* (&gp)[Loop::CH],
                                            uint32_t (&nb)[Loop::CH]) {
#pragma unroll
  for (int i = 0; i < Loop::CH; ++i) {
    const int c = threadIdx.x + i * Loop::THREADS, r = c >> 3;
    nb[i] = src[r] != nullptr ? 16u : 0u;
    gp[i] = (src[r] != nullptr ? src[r] : src[0]) + 8 * (c & 7);
  }
}

template <int KIND, int IE, int H, int E, int TOPK, int TR, int NWG, int STAGES, int PF>
__device__ __forceinline__ void moe_wgmma_gateup(const WPtr p, const float* __restrict__ gscale,
                                                 const __half* __restrict__ x, const int* __restrict__ pairs,
                                                 const int4* __restrict__ tiles, __half* __restrict__ act) {
  constexpr int N = 2 * IE, WR = 64 * NWG;
  constexpr size_t EW = (size_t)N * H / 2, ES = (size_t)N * H / 16;
  using Loop = WgmmaLoop<KIND, N, H, WR, TR, NWG, STAGES, PF, true>;
  __shared__ const __half* src[TR];
  pdl_trigger();
  pdl_wait();  // tiles / pairs come from the plan kernel, x from the norm kernel
  int e, start, rows;
  if (!load_tile_record(tiles, E, e, start, rows)) return;
  rows = rows < TR ? rows : TR;
  for (int r = threadIdx.x; r < TR; r += Loop::THREADS)
    src[r] = r < rows ? x + (size_t)(__ldg(pairs + start + r) / TOPK) * H : nullptr;
  __syncthreads();
  const int warp = threadIdx.x >> 5, gid = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
  const __half* gp[Loop::CH];
  uint32_t nb[Loop::CH];
  tile_chunks<Loop>(src, gp, nb);
  const int unit = blockIdx.x * (WR / 16) + warp;  // Loop::UPW == 1: a warp's 16 accumulator rows are its unit
  float acc[Loop::ACC];
  Loop::k_loop(acc, WPtr{p.w + e * EW, p.s + e * ES}, unit, gp, nb);
  const float* gs = gscale + (size_t)e * (N / 8);
  const float fg = tile_factor<KIND>(gs, 2 * unit), fu = tile_factor<KIND>(gs, 2 * unit + 1);
#pragma unroll
  for (int i = 0; i < TR / 8; ++i) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = 8 * i + 2 * t4 + c;
      if (r < rows)
        act[(size_t)(start + r) * IE + 8 * unit + gid] =
            __float2half_rn(gelu_tanh_f(acc[4 * i + c] * fg) * (acc[4 * i + 2 + c] * fu));
    }
  }
}

template <int KIND, int IE, int H, int E, int TOPK, int TR, int NWG, int STAGES, int PF>
__device__ __forceinline__ void moe_wgmma_down(const WPtr p, const float* __restrict__ gscale,
                                               const __half* __restrict__ act, const int* __restrict__ pairs,
                                               const int4* __restrict__ tiles, const float* __restrict__ wts,
                                               float* __restrict__ ypair) {
  constexpr int WR = 64 * NWG;
  constexpr size_t EW = (size_t)H * IE / 2, ES = (size_t)H * IE / 16;
  using Loop = WgmmaLoop<KIND, H, IE, WR, TR, NWG, STAGES, PF, true>;
  __shared__ const __half* src[TR];
  __shared__ int spair[TR];
  __shared__ float swt[TR];
  pdl_trigger();
  pdl_wait();  // tiles / pairs from the plan kernel, act from the grouped gate/up, wts from the router
  int e, start, rows;
  if (!load_tile_record(tiles, E, e, start, rows)) return;
  rows = rows < TR ? rows : TR;
  for (int r = threadIdx.x; r < TR; r += Loop::THREADS) {
    const int pr = r < rows ? __ldg(pairs + start + r) : 0;
    src[r] = r < rows ? act + (size_t)(start + r) * IE : nullptr;
    spair[r] = pr;
    swt[r] = r < rows ? __ldg(wts + pr) : 0.f;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, gid = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
  const __half* gp[Loop::CH];
  uint32_t nb[Loop::CH];
  tile_chunks<Loop>(src, gp, nb);
  const int unit = blockIdx.x * (WR / 16) + warp;
  float acc[Loop::ACC];
  Loop::k_loop(acc, WPtr{p.w + e * EW, p.s + e * ES}, unit, gp, nb);
  const float* gs = gscale + (size_t)e * (H / 8);
  const float f0 = tile_factor<KIND>(gs, 2 * unit), f1 = tile_factor<KIND>(gs, 2 * unit + 1);
#pragma unroll
  for (int i = 0; i < TR / 8; ++i) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int r = 8 * i + 2 * t4 + c;
      if (r < rows) {
        float* dst = ypair + (size_t)spair[r] * H + 16 * unit + gid;
        dst[0] = acc[4 * i + c] * f0 * swt[r];
        dst[8] = acc[4 * i + 2 + c] * f1 * swt[r];
      }
    }
  }
}

}  // namespace thorgen
