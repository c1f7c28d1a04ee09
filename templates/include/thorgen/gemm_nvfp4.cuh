// thorgen weight-streaming GEMMs on the t16x64 tile engine (nvfp4.cuh): y[m, n] = sum_k x[m, k] * W[n, k].
//   gemm_small : M <= 32 (decode M = 1, verify M = 2..16, batched decode). A block per UN 16-row units of W, KS
//                warps split K, each weight byte read once for all M rows (mma.m16n8k16, A = activations, B
//                decoded in registers), deterministic shared-memory reduction over the KS warps, fused epilogue.
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

// Swapped accumulators (see mma_step_swap: acc[0]) -> the same [token][16 columns] smem tile as frag_to_smem.
__device__ __forceinline__ void swap_to_smem(float (*dst)[16], const float (&acc)[2][4], int gid, int t4) {
  dst[2 * t4][gid] = acc[0][0];
  dst[2 * t4 + 1][gid] = acc[0][1];
  dst[2 * t4][8 + gid] = acc[0][2];
  dst[2 * t4 + 1][8 + gid] = acc[0][3];
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

// ---- asynchronous copies into shared memory (cp.async.cg, 16 bytes, L2 only) ----------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The bench-only "smem" GEMVs (codegen/prologue_variants.py): a block's weight slice in dynamic shared memory, in
// step slots [slot][UN units][32 lanes] of 16 code bytes, then [slot][UN][32] of 2 scale bytes (UN * 576 B a slot).
// A warp's steps [s0, s0 + P) live in slots from min(s0, warp * P): its own K range when the block's whole slice
// fits (P >= every warp's step count), P slots a warp when the budget cuts it (P <= every warp's step count).
template <int UN> struct SliceSmem {
  static constexpr int SLOT_BYTES = UN * W_LANES * (FP4_LANE_BYTES + SCALE_LANE_BYTES);
  static __device__ __forceinline__ uint4* codes(uint4* base, int slot, int u) {
    return base + (slot * UN + u) * W_LANES;
  }
  static __device__ __forceinline__ uint8_t* scales(uint4* base, int slots, int slot, int u) {
    return reinterpret_cast<uint8_t*>(base + slots * UN * W_LANES) + (slot * UN + u) * W_LANES * SCALE_LANE_BYTES;
  }
};

// One warp issues the copies of its steps [s0, s1) of units unit0.. into slots from slot0 (one commit group): each
// lane its 16 code bytes a step and unit, lanes 0-3 the unit's 64 scale bytes of the step in 16-byte pieces.
template <int N, int UN>
__device__ __forceinline__ void stage_slice(uint4* base, int slots, const WPtr& p, int unit0, int s0, int s1,
                                            int slot0, int lane) {
  constexpr int UNITS = N / W_TILE_N;
  for (int s = s0; s < s1; ++s) {
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const size_t first = ((size_t)s * UNITS + unit0 + u) * W_LANES;  // the unit's step: lane 0's index
      const int slot = slot0 + s - s0;
      cp_async16(SliceSmem<UN>::codes(base, slot, u) + lane, p.w + (first + lane) * FP4_LANE_BYTES, true);
      if (lane < W_LANES * SCALE_LANE_BYTES / 16)
        cp_async16(SliceSmem<UN>::scales(base, slots, slot, u) + 16 * lane, p.s + first * SCALE_LANE_BYTES + 16 * lane,
                   true);
    }
  }
  cp_async_commit();
}

// unit_steps_rows over steps [s0, s1) with the weights read from the warp's staged slots (slot0 ..): the same
// decode and the same mma chain per unit and tile, so the same sums in the same order.
template <int KIND, int RT, int UN, bool kTwoRows, bool kSwap>
__device__ __forceinline__ void unit_steps_smem(float (&acc)[UN][RT][2][4], uint4* base, int slots,
                                                const __half* const (&rows)[2 * RT], int s0, int s1, int slot0) {
  const int lane = threadIdx.x & 31, t4 = lane & 3;
  for (int s = s0; s < s1; ++s) {
    AStep a[RT];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) load_a<kTwoRows>(a[rt], rows[2 * rt], rows[2 * rt + 1], s, t4);
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      WStep<KIND> st;
      st.w = SliceSmem<UN>::codes(base, slot0 + s - s0, u)[lane];
      st.s = reinterpret_cast<const uint16_t*>(SliceSmem<UN>::scales(base, slots, slot0 + s - s0, u))[lane];
      uint32_t b[2][4][2];
      decode_step<KIND>(st, b);
#pragma unroll
      for (int rt = 0; rt < RT; ++rt) {
        if constexpr (kSwap) mma_step_swap(acc[u][rt], a[rt], b);
        else mma_step<kTwoRows>(acc[u][rt], a[rt], b);
      }
    }
  }
}

// ---- M <= 32 -----------------------------------------------------------------------------------------------
// Block = UN consecutive 16-row units, KS warps splitting K. Each activation step a warp loads serves its UN units:
// at 16-32 rows the activations are 4-8 bytes of L1 reads per weight byte, which bound the kernel at UN = 1 (the
// 32-row q|k|v GEMM took 17.0 us against 8.1 at 16 rows on the H200). The KS partial tiles go through one shared
// tile a unit after another, so the reduction's shared memory does not grow with UN.
// EARLY: the weight prologue's loads issue before griddepcontrol.wait (unit_steps_rows' kEarly).
// SMEM_STEPS > 0 (NVFP4, the bench-only "smem" form): before the wait each warp copies its first SMEM_STEPS steps
// of the block's units into dynamic shared memory (SliceSmem), then computes them from there and streams the rest
// of its K range as unit_steps_rows does (its first loads issued before the wait, as the planned prologue's); the
// same sums in the same order as SMEM_STEPS = 0.
template <int KIND, int N, int K, int KS, int MMAX, int PF, int EPI, typename OutT, bool SWAP = false, int UN = 1,
          bool EARLY = false, int SMEM_STEPS = 0>
__device__ __forceinline__ void gemm_small(const WPtr p, const float* __restrict__ gscale,
                                           const __half* __restrict__ x, OutT* __restrict__ y, int m) {
  static_assert(N % 16 == 0 && K % 64 == 0, "W must be [N % 16 == 0, K % 64 == 0]");
  static_assert(KS >= 1 && KS <= 32 && KS <= K / 64, "K split must give every warp at least one step");
  static_assert(UN >= 1 && UN <= 4 && (N / 16) % UN == 0, "1..4 units a block, dividing the matrix's units");
  using Tiles = RowTiles<MMAX>;
  constexpr int RT = Tiles::RT, MR = Tiles::MR;
  constexpr int STEPS = K / 64;
  __shared__ float red[KS][MR][16];
  pdl_launch_dependents();
  m = m < MMAX ? m : MMAX;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit0 = blockIdx.x * UN;
  const int s0 = warp * STEPS / KS, s1 = (warp + 1) * STEPS / KS;
  const __half* rows[2 * RT];
  lane_rows<RT, Tiles::TWO>(rows, x, K, m, gid);
  float acc[UN][RT][2][4] = {};
  static_assert(!(SWAP && Tiles::TWO), "the swapped form holds at most 8 tokens");
  if constexpr (SMEM_STEPS > 0) {
    static_assert(KIND != HALF && !EARLY, "the smem form stages NVFP4 codes and scales");
    constexpr int MOST = (STEPS + KS - 1) / KS;  // the most steps a warp has
    constexpr int SLOTS = STEPS < KS * SMEM_STEPS ? STEPS : KS * SMEM_STEPS;
    extern __shared__ uint4 slice_smem[];
    const int staged = s0 + (s1 - s0 < SMEM_STEPS ? s1 - s0 : SMEM_STEPS);
    const int slot0 = s0 < warp * SMEM_STEPS ? s0 : warp * SMEM_STEPS;
    stage_slice<N, UN>(slice_smem, SLOTS, p, unit0, s0, staged, slot0, lane);
    auto from_smem = [&]() {
      pdl_wait();
      cp_async_wait<0>();
      __syncwarp();  // lanes 0-3 copied the warp's scales
      unit_steps_smem<KIND, RT, UN, Tiles::TWO, SWAP>(acc, slice_smem, SLOTS, rows, s0, staged, slot0);
    };
    if constexpr (SMEM_STEPS < MOST) {  // past the budget: the rest streams, its first steps loading meanwhile
      constexpr int REST = 1;  // a step ahead: a deeper ring, live through the staged steps, spilled at 64 regs
      unit_steps_rows<KIND, N, K, REST, RT, UN, Tiles::TWO, false, SWAP>(acc, p, unit0, rows, staged, s1, from_smem);
    } else {
      from_smem();
    }
  } else {
    unit_steps_rows<KIND, N, K, PF, RT, UN, Tiles::TWO, true, SWAP, EARLY>(acc, p, unit0, rows, s0, s1);
  }
#pragma unroll
  for (int u = 0; u < UN; ++u) {
    if (u > 0) __syncthreads();  // the previous unit's sums have been read
    tiles_to_smem<SWAP, MR>(red[warp], acc[u], gid, t4);
    __syncthreads();
    const int unit = unit0 + u;
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
        float g = 0.f, u2 = 0.f;
#pragma unroll
        for (int w = 0; w < KS; ++w) { g += red[w][r][c]; u2 += red[w][r][8 + c]; }
        y[(size_t)r * (N / 2) + 8 * unit + c] = from_f32<OutT>(act_mul<EPI>(g * fg, u2 * fu));
      }
    }
  }
}

// ---- large M (prefill) ---------------------------------------------------------------------------------------

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
