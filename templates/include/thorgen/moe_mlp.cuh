// thorgen feed-forward block of the one-token decode step: Gemma-4's dense MLP and its MoE, both fed by the same
// residual, in two launches a layer (gate|up, then down) instead of four on two streams.
//   moe_mlp_gateup: grid (2 IE / 16, DY + TOPK), KS warps a block. Block rows y < DY run the dense gate|up's 16-row
//     units (unit y * gridDim.x + x), rows DY.. the MoE slots (moe_small.cuh moe_gateup, row y - DY).
//   moe_mlp_down:   grid (H / 16), a warp a slot: each block runs one 16-row unit of the MoE down (the slot's expert,
//     routing-weighted, slots summed in order) and of the dense down (DenseUnit's K parts, spread over the warps).
// Why the dense blocks need no griddepcontrol.wait, and the down reads the expert ids before its own: a kernel's
// dependents launch only once all of its blocks have called griddepcontrol.launch_dependents (or exited).
// router_fused calls it after its own wait, so once moe_mlp_gateup runs, o_proj's tail (a1, the dense input) is done;
// moe_mlp_gateup's MoE blocks call it after their wait, so once moe_mlp_down runs, the router (ids, weights) is done.
// What each kernel still waits for is its direct predecessor's output: the router's ids (gate/up's MoE blocks) and
// the gate/up's act rows (down). Weights never wait: the dense ones stream into shared memory (cp.async) and the
// experts' into registers before it.
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

  // Warp w's parts over the row x (f16 [K], read through L2: see the header) into sm.red. After issue().
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

// Gate|up of the one-token step: dense blocks (rows < DY) write dy[DN / 2] = gelu(gate) * up of the dense MLP from
// dx (a1); MoE blocks write act[slot][IE] from x (a2) as moe_gateup<MMAX = 1> does.
template <int KIND, int IE, int H, int E, int TOPK, int KS, int PF, int DN, int DPARTS>
__device__ __forceinline__ void moe_mlp_gateup(const WPtr p, const float* __restrict__ gscale,
                                               const __half* __restrict__ x, const int* __restrict__ ids,
                                               __half* __restrict__ act, int m, const WPtr dp,
                                               const float* __restrict__ dgscale, const __half* __restrict__ dx,
                                               __half* __restrict__ dy) {
  using Dense = DenseUnit<KIND, DN, H, DPARTS, KS>;
  constexpr int UNITS = 2 * IE / 16, DY = (Dense::UNITS + UNITS - 1) / UNITS;
  if (blockIdx.y >= DY) {
    pdl_wait();  // the router's ids (and a2, before it)
    pdl_launch_dependents();  // after the wait: moe_mlp_down reads the ids before its own
    moe_gateup<KIND, IE, H, E, TOPK, KS, 1, PF, 1, 8, false>(p, gscale, x, ids, act, m, blockIdx.y - DY);
    return;
  }
  pdl_launch_dependents();  // the MoE blocks hold the dependents back until the router is done
  const int unit = blockIdx.y * UNITS + blockIdx.x;
  if (unit >= Dense::UNITS) return;
  __shared__ typename Dense::Smem sm;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  Dense::issue(sm, dp, unit, warp, lane);
  Dense::compute(sm, dx, warp, lane);
  __syncthreads();
  if (threadIdx.x < 8) {  // gemm_small's GELU_MUL epilogue: gate rows 0-7, up rows 8-15 of the unit
    const int c = threadIdx.x;
    const float g = Dense::sum(sm, c), u = Dense::sum(sm, 8 + c);
    const float fg = tile_factor<KIND>(dgscale, 2 * unit), fu = tile_factor<KIND>(dgscale, 2 * unit + 1);
    dy[8 * unit + c] = __float2half_rn(act_mul<EPI_GELU_MUL>(g * fg, u * fu));
  }
}

// Down of the one-token step, block = 16-row unit blockIdx.x of both: y[H] (f32) = sum over the slots, in slot
// order, of wts[k] * down_{ids[k]}(act[k]) (warp k runs slot k's expert unless an earlier slot names it, the whole
// expert slab in flight, PF = its steps); dy[H] (f32) = the dense down of dx (mlp_act).
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
  Dense::issue(sm, dp, unit, warp, lane);
  int id[TOPK];  // the router's, done (see the header); every warp checks its own slot (slot_leads, no barrier)
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
        wt = __ldcg(wts + k);
      }
    float acc[2][4] = {};
    // the slab's loads, then griddepcontrol.wait (act comes from the gate/up), then the steps
    unit_steps<KIND, H, IE, PF, false, true, true>(acc, WPtr{p.w + e * EW, p.s + e * ES}, unit, row, nullptr, 0,
                                                   STEPS);
    const float* gs = gscale + (size_t)e * (H / 8);
    t0 = fmaf(acc[0][0] * tile_factor<KIND>(gs, 2 * unit), wt, 0.f);
    t2 = fmaf(acc[0][2] * tile_factor<KIND>(gs, 2 * unit + 1), wt, 0.f);
  }
  if (t4 == 0) {
    red[warp][gid] = t0;
    red[warp][8 + gid] = t2;
  }
  pdl_wait();  // mlp_act (a no-op where unit_steps waited)
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
