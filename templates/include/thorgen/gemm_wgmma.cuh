// thorgen prefill GEMM on Hopper's warpgroup tensor cores (sm_90a only): y[m, n] = sum_k x[m, k] * W[n, k].
// gemm_large (gemm_nvfp4.cuh) runs mma.sync with one warp per 16 weight rows and reached ~180 of the H200's ~790
// bf16 TFLOP/s on the prefill shapes; this form issues wgmma.mma_async instead: 352 TFLOP/s for the q|k|v GEMM of a
// 512-row prefill chunk (67 against 126 us a layer on the H200, docs/BENCHMARKS.md).
//   Block: BM = 128 tokens (two consumer warpgroups of 64) x BN weight rows, 8 warps. Both operands are K-major in
//   shared memory with the 128-byte swizzle: a stage holds the 64-wide k slice of BM activation rows (cp.async,
//   STAGES - 2 steps ahead) and of BN weight rows, which the warps decode from the t16x64 NVFP4 layout into fp16
//   (each warp UPW units, PF steps of raw weights in flight in registers, loaded before griddepcontrol.wait).
//   Per step each warpgroup issues four m64nBNk16 wgmmas (k = 16 j) and waits only for the step before, so the
//   tensor cores run while the warps decode the next step and copy the one after.
// A lane's decoded t16x64 registers are 16 contiguous k of one weight row (nvfp4.cuh, b[t][j][h] = codes 4j+2h..+1
// of row 8t + gid at k = 16 t4 ..): two 16-byte stores a row put them in natural k order, so the weight and
// activation tiles share one smem layout and one descriptor form.
#pragma once
#include "thorgen/gemm_nvfp4.cuh"

namespace thorgen {

// ---- wgmma primitives ----------------------------------------------------------------------------------------
// Shared-memory matrix descriptor, K-major with the 128-byte swizzle: rows of 128 B (64 halves), 8-row groups
// 1024 B apart (stride byte offset), the leading offset unused for this layout; start address >> 4 in bits 0-13.
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_addr) {
  return (uint64_t)((smem_addr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to the async proxy that wgmma reads with.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads or writes across an in-flight wgmma.
template <int R> __device__ __forceinline__ void wgmma_fence_acc(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x BN] += A[64 x 16] * B[BN x 16]^T, fp16 inputs from shared memory (both K-major), fp32 accumulators.
// Only BN = 128 is instantiated (below).
template <int BN> __device__ __forceinline__ void wgmma_f16(float (&d)[BN / 2], uint64_t da, uint64_t db);

#define THORGEN_WGMMA_REGS8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
    "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
template <> __device__ __forceinline__ void wgmma_f16<128>(float (&d)[64], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : THORGEN_WGMMA_REGS8(0), THORGEN_WGMMA_REGS8(8), THORGEN_WGMMA_REGS8(16), THORGEN_WGMMA_REGS8(24),
        THORGEN_WGMMA_REGS8(32), THORGEN_WGMMA_REGS8(40), THORGEN_WGMMA_REGS8(48), THORGEN_WGMMA_REGS8(56)
      : "l"(da), "l"(db), "r"(1));
}
#undef THORGEN_WGMMA_REGS8

// The smem byte offset of 16-byte chunk c (0..7) of row r in a 128-byte-swizzled tile (1024-byte aligned).
__device__ __forceinline__ uint32_t sw128_offset(int r, int c) { return (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4)); }

// ---- the pipelined K loop -------------------------------------------------------------------------------------
// Block: two warpgroups (8 warps) over TR = 128 tokens x WR = 128 weight rows. Each K step (64 inputs) lands in one
// stage: the weight tile (units unit0.., UPW a warp, decoded from the t16x64 layout) and the token tile (cp.async
// from this thread's CH fixed 16-byte chunks gp[i] + 64 step, nb[i] = 16 or 0 for a zero-filled padding row). Then
// each warpgroup issues four wgmmas (k = 16 j) on it: A = its 64 tokens, B = all WR weight rows; acc = [64 x WR].
// Ordering: copies run STAGES - 2 steps ahead and the decode one step ahead, into stages whose wgmmas every
// warpgroup has retired (wgmma_wait<1> before each barrier); raw NVFP4 weights are loaded PF steps ahead, fp16
// weights copied with the tokens (no decode).
// (Tried and removed: the grouped prefill MoE through this loop, weights as the A operand of m64n64k16 over an
// expert's <= 64 rows: no faster than its mma.sync form, 202-217 vs 191-199 us a layer for gate/up on the H200.)
template <int KIND, int N, int K, int STAGES, int PF>
struct WgmmaLoop {
  static constexpr int WR = 128, TR = 128, NWG = 2;            // the one wgmma shape instantiated: m64n128k16
  static constexpr int THREADS = 128 * NWG, WARPS = 4 * NWG, STEPS = K / 64, UPW = WR / 16 / WARPS;
  static constexpr int CH = TR * 8 / THREADS;                 // 16-byte token chunks a thread copies per step
  static constexpr int ACC = WR / 2;
  static constexpr int W_BYTES = WR * 128, STAGE = W_BYTES + TR * 128;
  static constexpr int SMEM = STAGES * STAGE + 1024;         // + slack to align the tiles to 1024 B
  static_assert(N % WR == 0 && K % 64 == 0, "W must be [N % WR == 0, K % 64 == 0]");
  static_assert(UPW >= 1 && WR % (16 * WARPS) == 0, "every warp decodes whole 16-row units");
  static_assert(CH >= 1 && (TR * 8) % THREADS == 0, "the token tile's chunks split evenly over the threads");
  static_assert(TR == 64 * NWG, "each warpgroup owns 64 token rows (the A operand)");
  static_assert(STAGES >= 3 && PF >= 1 && PF <= 8, "at least three stages (one computing, one landing, one free)");
  // fp16 weights (KIND == HALF) need no decode: each lane's 64 bytes a step are 16-byte runs of 8 k of its rows, so
  // they go to shared memory by cp.async, in the token copies' commit groups, with no registers in flight.
  static constexpr bool RAW = KIND == HALF;

  __device__ static void k_loop(float (&acc)[ACC], const WPtr pe, int unit0, const __half* const (&gp)[CH],
                                const uint32_t (&nb)[CH]) {
    extern __shared__ uint4 smem_u4[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, t4 = lane & 3, wg = warp >> 2;
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(smem_u4) + 1023u) & ~1023u;
    auto w_tile = [&](int s) { return base + (uint32_t)((s % STAGES) * STAGE); };
    auto t_tile = [&](int s) { return w_tile(s) + (uint32_t)W_BYTES; };
    // fp16 weights: lane chunk i of its step (layout.py's half layout: rows 8 (i >> 1) + gid of the warp's unit,
    // k 16 t4 + 8 (i & 1) ..) straight to its swizzled place; committed with the next token copies
    auto copy_weights = [&](int s) {
      if constexpr (RAW) {
        constexpr int UNITS = N / 16;
#pragma unroll
        for (int u = 0; u < UPW; ++u) {
          const uint8_t* src = pe.w + (((size_t)s * UNITS + unit0 + u) * W_LANES + lane) * HALF_LANE_BYTES;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = 16 * (warp * UPW + u) + 8 * (i >> 1) + gid;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(w_tile(s) + sw128_offset(r, 2 * t4 + (i & 1))),
                         "l"(src + 16 * i));
          }
        }
      }
    };
    auto copy_tokens = [&](int s) {
      copy_weights(s);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const int c = tid + i * THREADS;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(t_tile(s) + sw128_offset(c >> 3, c & 7)),
                     "l"(gp[i] + 64 * s), "r"(nb[i]));
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    // a lane's decoded registers are 16 contiguous k of rows 8t + gid (nvfp4.cuh): two 16-byte stores a row
    auto store_weights = [&](int s, const WStep<KIND>& st, int u) {
      uint32_t b[2][4][2];
      decode_step<KIND>(st, b);
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int r = 16 * (warp * UPW + u) + 8 * t + gid;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(w_tile(s) + sw128_offset(r, 2 * t4)),
                     "r"(b[t][0][0]), "r"(b[t][0][1]), "r"(b[t][1][0]), "r"(b[t][1][1]) : "memory");
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(w_tile(s) + sw128_offset(r, 2 * t4 + 1)),
                     "r"(b[t][2][0]), "r"(b[t][2][1]), "r"(b[t][3][0]), "r"(b[t][3][1]) : "memory");
      }
    };

    constexpr int RING = RAW ? 1 : PF;  // fp16 weights keep no registers in flight
    WStep<KIND> ring[RING][UPW];        // ring[i] holds raw step i mod PF
    if constexpr (RAW) {
      // the first stages' weights before the wait (they do not depend on the previous kernel), committed with
      // step 0's tokens
#pragma unroll
      for (int s = 0; s < STAGES - 2; ++s)
        if (s < STEPS) copy_weights(s);
    } else {
#pragma unroll
      for (int i = 0; i < PF; ++i)
#pragma unroll
        for (int u = 0; u < UPW; ++u)
          if (i < STEPS) load_step<KIND, N, K>(ring[i][u], pe, unit0 + u, i, lane);
    }
    pdl_wait();  // the tokens come from the previous kernel
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
      if (s < STEPS) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {  // the tokens only: (fp16) weights of these steps are in flight already
          const int c = tid + i * THREADS;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(t_tile(s) + sw128_offset(c >> 3, c & 7)),
                       "l"(gp[i] + 64 * s), "r"(nb[i]));
        }
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    if constexpr (!RAW) {
#pragma unroll
      for (int u = 0; u < UPW; ++u) {
        store_weights(0, ring[0][u], u);
        if (PF < STEPS) load_step<KIND, N, K>(ring[0][u], pe, unit0 + u, PF, lane);
      }
    }
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    for (int sb = 0; sb < STEPS; sb += PF) {
#pragma unroll
      for (int i = 0; i < PF; ++i) {
        const int s = sb + i;
        if (s < STEPS) {
          asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 3) : "memory");  // step s's tokens (own copies)
          fence_proxy_async();
          __syncthreads();  // every thread's step-s writes are in; every warpgroup is done with step s - 2
          wgmma_fence();
          wgmma_fence_acc(acc);
          const uint32_t a0 = t_tile(s) + (uint32_t)(wg * 64 * 128), b0 = w_tile(s);
#pragma unroll
          for (int j = 0; j < 4; ++j) wgmma_f16<WR>(acc, wgmma_desc_sw128(a0 + 32 * j), wgmma_desc_sw128(b0 + 32 * j));
          wgmma_commit();
          wgmma_fence_acc(acc);
          if (s + STAGES - 2 < STEPS) copy_tokens(s + STAGES - 2);  // into the stage step s - 2 used
          else asm volatile("cp.async.commit_group;\n" ::: "memory");
          if constexpr (!RAW) {
            if (s + 1 < STEPS) {
              const int next = (i + 1) % RING;  // a constant once the loop over i is unrolled
#pragma unroll
              for (int u = 0; u < UPW; ++u) {
                store_weights(s + 1, ring[next][u], u);
                if (s + 1 + PF < STEPS) load_step<KIND, N, K>(ring[next][u], pe, unit0 + u, s + 1 + PF, lane);
              }
            }
          }
          wgmma_wait<1>();  // step s - 1's wgmmas are retired: its stage may be refilled after the next barrier
          wgmma_fence_acc(acc);
        }
      }
    }
    wgmma_wait<0>();
    wgmma_fence_acc(acc);
  }
};

// ---- dense prefill GEMM --------------------------------------------------------------------------------------
// Block: 128 tokens (two warpgroups of 64) x BN weight rows. acc[4 i + h] = (token 16 wq + gid + 8 (h >> 1) of the
// warpgroup's 64, weight row 8 i + 2 t4 + (h & 1) of the block's BN).
template <int KIND, int N, int K, int BN, int STAGES, int PF, int EPI, typename OutT>
__device__ __forceinline__ void gemm_large_wgmma(const WPtr p, const float* __restrict__ gscale,
                                                 const __half* __restrict__ x, OutT* __restrict__ y, int m) {
  using Loop = WgmmaLoop<KIND, N, K, STAGES, PF>;
  constexpr int BM = Loop::TR;
  static_assert(BN == Loop::WR, "the planner's tile is the loop's");
  pdl_launch_dependents();
  const int m0 = blockIdx.y * BM;
  if (m0 >= m) return;
  const int tid = threadIdx.x, warp = tid >> 5, gid = (tid & 31) >> 2, t4 = tid & 3, wg = warp >> 2, wq = warp & 3;
  const __half* gp[Loop::CH];
  uint32_t nb[Loop::CH];
#pragma unroll
  for (int i = 0; i < Loop::CH; ++i) {  // row r, chunk c of the token tile; rows past m read row 0's address, 0 B
    const int c = tid + i * Loop::THREADS, r = c >> 3;
    nb[i] = m0 + r < m ? 16u : 0u;
    gp[i] = x + (size_t)(m0 + r < m ? m0 + r : 0) * K + 8 * (c & 7);
  }
  float acc[Loop::ACC];
  Loop::k_loop(acc, p, blockIdx.x * (BN / 16) + warp * Loop::UPW, gp, nb);

  const int tile0 = blockIdx.x * (BN / 8);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = m0 + 64 * wg + 16 * wq + gid + 8 * h;
    if (r >= m) continue;
    if constexpr (EPI == EPI_STORE) {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        const float f = tile_factor<KIND>(gscale, tile0 + i);
        OutT* dst = y + (size_t)r * N + 8 * (tile0 + i) + 2 * t4;
        dst[0] = from_f32<OutT>(acc[4 * i + 2 * h] * f);
        dst[1] = from_f32<OutT>(acc[4 * i + 2 * h + 1] * f);
      }
    } else {  // gate/up interleaved in 8-row tiles: tile 2u is unit u's gate, 2u + 1 its up
#pragma unroll
      for (int i = 0; i < BN / 8; i += 2) {
        const float fg = tile_factor<KIND>(gscale, tile0 + i), fu = tile_factor<KIND>(gscale, tile0 + i + 1);
        OutT* dst = y + (size_t)r * (N / 2) + 4 * (tile0 + i) + 2 * t4;
        dst[0] = from_f32<OutT>(act_mul<EPI>(acc[4 * i + 2 * h] * fg, acc[4 * (i + 1) + 2 * h] * fu));
        dst[1] = from_f32<OutT>(act_mul<EPI>(acc[4 * i + 2 * h + 1] * fg, acc[4 * (i + 1) + 2 * h + 1] * fu));
      }
    }
  }
}

}  // namespace thorgen
