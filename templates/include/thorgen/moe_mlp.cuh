// thorgen feed-forward block of the one-token decode step: Gemma-4's dense MLP runs inside the launches of its MoE
// (both read the same residual), not on a side stream.
//   dense_gateup_block: the dense gate|up's 16-row units as more blocks of router_fused (router.cuh), which waits
//     for o_proj's tail (a1's writer) itself: the dense gate|up runs beside the router's latency-bound blocks.
//   moe_mlp_down: grid (H / 16), a warp a slot: each block runs one 16-row unit of the MoE down (the slot's expert,
//     routing-weighted, slots summed in order) and of the dense down (DenseUnit's K parts, spread over the warps).
// Every block waits (griddepcontrol.wait) before it reads any earlier kernel's output; only weights stream before the
// wait. Reads of what a kernel two launches back wrote, without a wait (a dependent launched only after the
// kernel in between had waited), raced on the H200: docs/benchmarks/NOTES.md, session 28.
#pragma once
#include "thorgen/moe_small.cuh"

namespace thorgen {

// One 16-row unit of a dense NVFP4 GEMV of one row, run by NW warps exactly as gemm_small<KS = PARTS, M = 1> runs it:
// part j covers steps [j STEPS / PARTS, (j + 1) STEPS / PARTS) in one accumulator chain from zero (the swapped mma),
// and the unit's outputs sum the parts in order from zero. So the dense MLP has the standalone GEMV's bits here,
// which the 16- and 32-row GEMMs share (batch invariance). Warp w runs parts [w PARTS / NW, (w + 1) PARTS / NW).
template <int KIND, int N, int K, int PARTS, int NW>
struct DenseUnit {
  static_assert(KIND != HALF && N % 16 == 0 && K % 64 == 0, "NVFP4 weights in the t16x64 layout");
  static constexpr int STEPS = K / 64, UNITS = N / 16;
  static_assert(PARTS >= 1 && PARTS <= STEPS && NW >= 1, "every part needs a step");
  __host__ __device__ static constexpr int part_lo(int w) { return w * PARTS / NW; }
  __host__ __device__ static constexpr int step_lo(int part) { return part * STEPS / PARTS; }
  __host__ __device__ static constexpr int max_steps() {
    int most = 0;
    for (int w = 0; w < NW; ++w) {
      const int n = step_lo(part_lo(w + 1)) - step_lo(part_lo(w));
      most = n > most ? n : most;
    }
    return most;
  }
  static constexpr int MAXS = max_steps() > 0 ? max_steps() : 1;  // a warp's steps, at most
  struct Smem {
    uint4 w[NW][MAXS][32];  // a warp's weight steps: lane l's 16 bytes
    uint4 s[NW][MAXS][4];   // and their scales: lane l's 2 bytes at byte 2 l
    float red[PARTS][16];   // each part's sums of the unit's 16 rows
  };

  // Stream warp w's weight steps of `unit` into shared memory (one cp.async group; weights never wait).
  static __device__ __forceinline__ void issue(Smem& sm, const WPtr& p, int unit, int warp, int lane) {
    const int s0 = step_lo(part_lo(warp)), s1 = step_lo(part_lo(warp + 1));
    for (int s = s0; s < s1; ++s) {
      const size_t idx = ((size_t)s * UNITS + unit) * 32;
      cp_async16(&sm.w[warp][s - s0][lane], p.w + (idx + lane) * 16, true);
      if (lane < 4) cp_async16(&sm.s[warp][s - s0][lane], p.s + idx * 2 + 16 * lane, true);
    }
    cp_async_commit();
  }

  // Warp w's parts over the row x (f16 [K], read through L2) into sm.red. After issue() and the wait.
  static __device__ __forceinline__ void compute(Smem& sm, const __half* x, int warp, int lane) {
    cp_async_wait<0>();
    __syncwarp();  // the scales were copied by lanes 0-3
    const int gid = lane >> 2, t4 = lane & 3, s0 = step_lo(part_lo(warp));
    for (int part = part_lo(warp); part < part_lo(warp + 1); ++part) {
      float acc[2][4] = {};
      for (int s = step_lo(part); s < step_lo(part + 1); ++s) {
        WStep<KIND> st;
        st.w = sm.w[warp][s - s0][lane];
        st.s = reinterpret_cast<const unsigned short*>(sm.s[warp][s - s0])[lane];
        uint32_t b[2][4][2];
        decode_step<KIND>(st, b);
        AStep a{};  // the token is the swapped mma's column 0: lanes gid 0 hold its k 16 t4 .. of the step
        if (gid == 0) {
          const uint4* q = reinterpret_cast<const uint4*>(x + 64 * s + 16 * t4);
          a.r0[0] = __ldcg(q);
          a.r0[1] = __ldcg(q + 1);
        }
        mma_step_swap(acc, a, b);
      }
      if (t4 == 0) {  // token 0: rows gid and gid + 8 of the unit (swap_to_smem's row 0)
        sm.red[part][gid] = acc[0][0];
        sm.red[part][8 + gid] = acc[0][2];
      }
    }
  }

  // Output c (0..15) of the unit, before its scale: the parts in order. After a barrier behind every warp's compute().
  static __device__ __forceinline__ float sum(const Smem& sm, int c) {
    float v = 0.f;
#pragma unroll
    for (int j = 0; j < PARTS; ++j) v += sm.red[j][c];
    return v;
  }
};

// One dense gate|up unit (16 rows, gate rows 0-7 and up rows 8-15) of one row: dy[8 unit + c] = gelu(gate) * up,
// as gemm_small's GELU_MUL epilogue. The weights stream before the wait; dx is the previous kernel's output.
template <int KIND, int DN, int H, int DPARTS, int NW>
__device__ __forceinline__ void dense_gateup_block(const WPtr dp, const float* __restrict__ dgscale,
                                                   const __half* __restrict__ dx, __half* __restrict__ dy, int unit) {
  using Dense = DenseUnit<KIND, DN, H, DPARTS, NW>;
  __shared__ typename Dense::Smem sm;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  Dense::issue(sm, dp, unit, warp, lane);
  pdl_wait();
  Dense::compute(sm, dx, warp, lane);
  __syncthreads();
  if (threadIdx.x < 8) {
    const int c = threadIdx.x;
    const float g = Dense::sum(sm, c), u = Dense::sum(sm, 8 + c);
    const float fg = tile_factor<KIND>(dgscale, 2 * unit), fu = tile_factor<KIND>(dgscale, 2 * unit + 1);
    dy[8 * unit + c] = __float2half_rn(act_mul<EPI_GELU_MUL>(g * fg, u * fu));
  }
}

// Down of the one-token step, block = 16-row unit blockIdx.x of both: y[H] (f32) = sum over the slots, in slot
// order, of wts[k] * down_{ids[k]}(act[k]) (warp k runs slot k's expert unless an earlier slot names it, the whole
// expert slab in flight, PF = its steps); dy[H] (f32) = the dense down of dx (mlp_act, router_fused's).
template <int KIND, int IE, int H, int E, int TOPK, int PF, int DK, int DPARTS>
__device__ __forceinline__ void moe_mlp_down(const WPtr p, const float* __restrict__ gscale,
                                             const __half* __restrict__ act, const int* __restrict__ ids,
                                             const float* __restrict__ wts, float* __restrict__ y, int m,
                                             const WPtr dp, const float* __restrict__ dgscale,
                                             const __half* __restrict__ dx, float* __restrict__ dy) {
  static_assert(IE % 64 == 0 && H % 16 == 0, "expert shapes must fit the t16x64 tile");
  constexpr int NW = TOPK, STEPS = IE / 64;  // a warp a slot
  constexpr size_t EW = (size_t)H * IE / 2, ES = (size_t)H * IE / 16;
  using Dense = DenseUnit<KIND, H, DK, DPARTS, NW>;
  __shared__ typename Dense::Smem sm;
  __shared__ float red[NW][16];
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit = blockIdx.x;
  Dense::issue(sm, dp, unit, warp, lane);  // weights: before the wait
  pdl_wait();  // act (gate/up), and the router's ids and weights before it
  int id[TOPK];  // every warp checks its own slot (slot_leads, no barrier)
  token_ids<TOPK>(ids, id);
  float t0 = 0.f, t2 = 0.f;  // token 0's routing-weighted rows gid, gid + 8 of the unit (lanes t4 == 0)
  int e;
  if (m >= 1 && slot_leads<E, TOPK>(id, warp, e)) {
    const __half* row = nullptr;
    float wt = 0.f;
#pragma unroll
    for (int k = 0; k < TOPK; ++k)
      if (id[k] == e) {
        row = gid == 0 ? act + (size_t)k * IE : nullptr;
        wt = __ldg(wts + k);
      }
    float acc[2][4] = {};
    unit_steps<KIND, H, IE, PF, false, false, true>(acc, WPtr{p.w + e * EW, p.s + e * ES}, unit, row, nullptr, 0,
                                                   STEPS);
    const float* gs = gscale + (size_t)e * (H / 8);
    t0 = fmaf(acc[0][0] * tile_factor<KIND>(gs, 2 * unit), wt, 0.f);
    t2 = fmaf(acc[0][2] * tile_factor<KIND>(gs, 2 * unit + 1), wt, 0.f);
  }
  if (t4 == 0) {
    red[warp][gid] = t0;
    red[warp][8 + gid] = t2;
  }
  Dense::compute(sm, dx, warp, lane);
  __syncthreads();
  if (threadIdx.x < 16) {
    const int c = threadIdx.x;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][c];
    y[16 * unit + c] = v;
  } else if (threadIdx.x >= 32 && threadIdx.x < 48) {
    const int c = threadIdx.x - 32;
    dy[16 * unit + c] = Dense::sum(sm, c) * tile_factor<KIND>(dgscale, 2 * unit + (c >> 3));
  }
}

}  // namespace thorgen
