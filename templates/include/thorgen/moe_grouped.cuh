// thorgen grouped (sorted-by-expert) MoE for prefill chunks: each expert's weights are streamed once per chunk and
// multiplied against every row that chose it. Hand-written; the planner is codegen/families/moe_grouped.py.
//   moe_grouped_plan    one block: topk ids [T, K] -> per-expert offsets [E+1], the (row*K + slot) pair ids grouped
//                       by expert in ascending pair order (deterministic), and a tile list of up to BM rows per tile
//                       (int4: expert, first sorted index, rows, 0; unused entries expert = -1).
//   moe_grouped_gateup  grid (2*IE/16/NWARP, MAX_TILES): a tile's gathered x rows (A, cp.async through shared memory)
//                       x the expert's fused gate|up (t16x64, decoded in registers) -> gelu_tanh(gate) * up, f16,
//                       into act_sorted[sorted index][IE].
//   moe_grouped_down    grid (H/16/NWARP, MAX_TILES): act_sorted rows x the expert's down weights, times the routing
//                       weight -> f32 per-pair rows ypair[row*K + slot][H].
// The ffn_tail after them sums each row's valid slots 0..K-1 in slot order (f32; norm.cuh, ffn_tail_row).
// Every output element is one fixed sequence of fp32 operations on its own row's data: no atomics in the math, no
// dependence on scheduling or on which other rows share a tile.
#pragma once
#include "thorgen/gemm_nvfp4.cuh"

namespace thorgen {

// ---- plan ---------------------------------------------------------------------------------------------------------
// Exclusive scans of counts c[e] and tiles ceil(c[e] / BM), run by one warp (lane l owns a contiguous run of experts).
template <int E, int BM>
__device__ __forceinline__ void plan_scan(const int* cnt, int* off, int* toff, int lane) {
  constexpr int PER = (E + 31) / 32;
  int s = 0, st = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane * PER + i;
    if (e < E) { s += cnt[e]; st += (cnt[e] + BM - 1) / BM; }
  }
  int is = s, ist = st;  // inclusive warp scan
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, is, o), b = __shfl_up_sync(0xffffffffu, ist, o);
    if (lane >= o) { is += a; ist += b; }
  }
  int xs = is - s, xt = ist - st;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane * PER + i;
    if (e < E) {
      off[e] = xs; toff[e] = xt;
      xs += cnt[e]; xt += (cnt[e] + BM - 1) / BM;
    }
  }
  if (lane == 31) { off[E] = is; toff[E] = ist; }
}

template <int E, int TOPK, int BM, int MAX_ROWS, int MAX_TILES, int THREADS>
__device__ __forceinline__ void moe_grouped_plan(const int* __restrict__ ids, int T, int* __restrict__ offsets,
                                                 int* __restrict__ pairs, int4* __restrict__ tiles) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024 && E >= 1 && TOPK >= 1 && BM >= 16, "plan shape");
  constexpr int WARPS = THREADS / 32;
  __shared__ int wcnt[WARPS][E + 1];  // per chunk: a warp's count of each expert, then its base position (+1: banks)
  constexpr int PAIRS = MAX_ROWS * TOPK, PER = (PAIRS + THREADS - 1) / THREADS;
  __shared__ int cnt[E], run[E], off[E + 1], toff[E + 1];
  pdl_trigger();
  pdl_wait();  // ids come from the router's top-k kernel; every write below follows the wait
  T = T < 0 ? 0 : (T > MAX_ROWS ? MAX_ROWS : T);
  const int n = T * TOPK, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int v[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) v[i] = tid + i * THREADS < n ? __ldg(ids + tid + i * THREADS) : -1;
  for (int e = tid; e < E; e += THREADS) { cnt[e] = 0; run[e] = 0; }
  __syncthreads();
  // pass 1: counts (integer shared-memory adds: the totals do not depend on their order)
#pragma unroll
  for (int i = 0; i < PER; ++i)
    if (v[i] >= 0 && v[i] < E) atomicAdd(&cnt[v[i]], 1);
  __syncthreads();
  if (warp == 0) plan_scan<E, BM>(cnt, off, toff, lane);
  __syncthreads();
  // pass 2: stable positions. Chunk ch holds pairs ch*THREADS + tid (each thread's ids stay in v[], registers: the
  // loop is unrolled, so a chunk of 2048 x 8 ids needs no shared copy); lanes naming the same expert rank themselves
  // by lane order (match_any), warps by warp order (a per-expert scan over the warps), chunks by chunk order.
  const unsigned lt = (1u << lane) - 1u;
#pragma unroll
  for (int ch = 0; ch < PER; ++ch) {
    if (ch * THREADS >= n) continue;  // uniform over the block (not break: the loop must unroll to keep v[] in registers)
    const int p = ch * THREADS + tid;
    const int e = v[ch];
    const bool ok = e >= 0 && e < E;
    const unsigned same = __match_any_sync(0xffffffffu, ok ? e : -1);
    for (int i = tid; i < WARPS * (E + 1); i += THREADS) (&wcnt[0][0])[i] = 0;
    __syncthreads();
    if (ok && (__ffs(same) - 1) == lane) wcnt[warp][e] = __popc(same);
    __syncthreads();
    for (int x = warp; x < E; x += WARPS) {  // expert x: lane w scans warp w's count (a warp-wide prefix sum)
      const int c = lane < WARPS ? wcnt[lane][x] : 0, b = off[x] + run[x];
      int inc = c;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += v;
      }
      if (lane < WARPS) wcnt[lane][x] = b + inc - c;
      if (lane == 31) run[x] += inc;  // every lane read run[x] before the shuffles above
    }
    __syncthreads();
    if (ok) pairs[wcnt[warp][e] + __popc(same & lt)] = p;
    __syncthreads();  // wcnt is cleared by the next chunk
  }
  for (int e = tid; e <= E; e += THREADS) offsets[e] = off[e];
  const int total = toff[E];
  for (int i = tid; i < MAX_TILES; i += THREADS) {
    int4 t = make_int4(-1, 0, 0, 0);
    if (i < total) {
      int lo = 0, hi = E - 1;  // the expert e with toff[e] <= i < toff[e + 1]
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (toff[mid] <= i) lo = mid; else hi = mid - 1;
      }
      const int start = off[lo] + (i - toff[lo]) * BM, left = off[lo + 1] - start;
      t = make_int4(lo, start, left < BM ? left : BM, 0);
    }
    tiles[i] = t;
  }
}

// ---- grouped GEMM core ------------------------------------------------------------------------------------------
// acc[u][mt] += rows(mt) . W[unit0 + u]^T over all K steps, u < UPW units per warp (the A fragments read from
// shared memory once serve all of them). `src[r]` (shared) = row r's K activations, nullptr = padding (zero-filled
// by cp.async). Only the m-tiles holding real rows (`rows` of them) issue tensor-core work.
// SWAP: the decoded weights are the mma's A operand and each 8-row half of an m-tile its B operand (mma_step_swap1;
// acc[u][mt][h] = C[16 weight rows][rows mt*16 + 8h ..]): the activations then go to the mma as loaded, where the
// non-swapped A operand needs its registers regrouped (ncu on the H200: half the loop's instructions were MOVs).
template <int KIND, int N, int K, int BM, int NWARP, int UPW, int STAGES, int PF, bool SWAP = false>
__device__ __forceinline__ void grouped_mainloop(float (&acc)[UPW][BM / 16][2][4], const WPtr pe, int unit0,
                                                 const __half* const* src, __half* As, int rows) {
  const int mts = (rows + 15) >> 4, halves = (rows + 7) >> 3;
  static_assert(N % (16 * NWARP * UPW) == 0 && K % 64 == 0, "N must be a multiple of 16*NWARP*UPW, K of 64");
  static_assert(BM % 16 == 0 && BM <= 128 && STAGES >= 2 && PF >= 1 && UPW >= 1, "BM in 16..128, >= 2 stages");
  constexpr int STEPS = K / 64, MT = BM / 16, THREADS = NWARP * 32, PITCH = LargeSmem<BM, STAGES>::PITCH;
  static_assert((BM * 8) % THREADS == 0, "the A tile's 16-B chunks must split evenly over the threads");
  constexpr int CH = BM * 8 / THREADS;  // 16-B chunks of one A stage per thread
  const int lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  // this thread's chunks: fixed rows and columns for every step, so the gather addresses, the shared-memory offsets
  // and the zero-fill sizes are computed once (a padding row reads nothing from a valid address: row 0's)
  const __half* gp[CH];
  uint32_t sdst[CH], nbytes[CH];
  const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(As);
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const int c = threadIdx.x + i * THREADS, r = c >> 3, ch = c & 7;
    gp[i] = (src[r] != nullptr ? src[r] : src[0]) + 8 * ch;
    nbytes[i] = src[r] != nullptr ? 16u : 0u;
    sdst[i] = sbase + 2u * (uint32_t)(r * PITCH + 8 * ch);
  }
  auto load_tile = [&](int stage, int step) {
#pragma unroll
    for (int i = 0; i < CH; ++i)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sdst[i] + stage * (2u * BM * PITCH)),
                   "l"(gp[i] + 64 * step), "r"(nbytes[i]));
  };
  WStep<KIND> ring[PF][UPW];
#pragma unroll
  for (int i = 0; i < PF; ++i)
#pragma unroll
    for (int u = 0; u < UPW; ++u)
      if (i < STEPS) load_step<KIND, N, K>(ring[i][u], pe, unit0 + u, i, lane);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < STEPS) load_tile(s, s);
    cp_async_commit();
  }
  int rd = 0, wr = STAGES - 1;  // stages read (s % STAGES) and refilled ((s + STAGES - 1) % STAGES), no modulo
  for (int base = 0; base < STEPS; base += PF) {
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      const int s = base + i;
      if (s < STEPS) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage s landed for all threads; stage (s-1) % STAGES is free again
        if (s + STAGES - 1 < STEPS) load_tile(wr, s + STAGES - 1);
        cp_async_commit();
        wr = wr + 1 == STAGES ? 0 : wr + 1;
        uint32_t b[UPW][2][4][2];
#pragma unroll
        for (int u = 0; u < UPW; ++u) {
          const WStep<KIND> cur = ring[i][u];
          if (s + PF < STEPS) load_step<KIND, N, K>(ring[i][u], pe, unit0 + u, s + PF, lane);
          decode_step<KIND>(cur, b[u]);
        }
        const __half* tile = As + rd * (BM * PITCH);
        rd = rd + 1 == STAGES ? 0 : rd + 1;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (mt < mts) {
            AStep a;
            const __half* r0 = tile + (mt * 16 + gid) * PITCH + 16 * t4;
            const __half* r1 = r0 + 8 * PITCH;
            a.r0[0] = *reinterpret_cast<const uint4*>(r0);
            a.r0[1] = *reinterpret_cast<const uint4*>(r0 + 8);
            a.r1[0] = *reinterpret_cast<const uint4*>(r1);
            a.r1[1] = *reinterpret_cast<const uint4*>(r1 + 8);
            if constexpr (SWAP) {
              const bool second = 2 * mt + 1 < halves;  // rows mt*16 + 8 .. hold a real row
#pragma unroll
              for (int u = 0; u < UPW; ++u) {
                mma_step_swap1(acc[u][mt][0], a.r0, b[u]);
                if (second) mma_step_swap1(acc[u][mt][1], a.r1, b[u]);
              }
            } else {
#pragma unroll
              for (int u = 0; u < UPW; ++u) mma_step<true>(acc[u][mt], a, b[u]);
            }
          }
        }
      }
    }
  }
}

// A tile's record; false when this block has no tile (the grid is sized for the largest possible tile count).
__device__ __forceinline__ bool load_tile_record(const int4* __restrict__ tiles, int E, int& e, int& start, int& rows) {
  const int4 t = tiles[blockIdx.y];
  e = t.x; start = t.y; rows = t.z;
  return e >= 0 && e < E && rows > 0;
}

template <int KIND, int IE, int H, int E, int TOPK, int BM, int NWARP, int UPW, int STAGES, int PF, bool SWAP = false>
__device__ __forceinline__ void moe_grouped_gateup(const WPtr p, const float* __restrict__ gscale,
                                                   const __half* __restrict__ x, const int* __restrict__ pairs,
                                                   const int4* __restrict__ tiles, __half* __restrict__ act) {
  constexpr int N = 2 * IE, MT = BM / 16;
  constexpr size_t EW = layout_weight_bytes<KIND>(N, H), ES = layout_scale_bytes<KIND>(N, H);
  extern __shared__ uint4 smem_u4[];
  __shared__ const __half* src[BM];
  pdl_trigger();
  pdl_wait();  // tiles / pairs come from the plan kernel, x from the norm kernel
  int e, start, rows;
  if (!load_tile_record(tiles, E, e, start, rows)) return;
  rows = rows < BM ? rows : BM;
  for (int r = threadIdx.x; r < BM; r += NWARP * 32)
    src[r] = r < rows ? x + (size_t)(__ldg(pairs + start + r) / TOPK) * H : nullptr;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit0 = (blockIdx.x * NWARP + warp) * UPW;
  float acc[UPW][MT][2][4] = {};
  grouped_mainloop<KIND, N, H, BM, NWARP, UPW, STAGES, PF, SWAP>(acc, WPtr{p.w + e * EW, p.s + e * ES}, unit0, src,
                                                                  reinterpret_cast<__half*>(smem_u4), rows);
  const float* gs = gscale + (KIND == HALF ? (size_t)0 : (size_t)e) * (N / 8);
#pragma unroll
  for (int u = 0; u < UPW; ++u) {
    const int unit = unit0 + u;
    const float fg = tile_factor<KIND>(gs, 2 * unit), fu = tile_factor<KIND>(gs, 2 * unit + 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (SWAP) {  // c: (gate col gid, rows r, r + 1), then up
          const float(&c)[4] = acc[u][mt][h];
          const int r = mt * 16 + 8 * h + 2 * t4;
          __half* dst = act + (size_t)(start + r) * IE + 8 * unit + gid;
          if (r < rows) dst[0] = __float2half_rn(gelu_tanh_f(c[0] * fg) * (c[2] * fu));
          if (r + 1 < rows) dst[IE] = __float2half_rn(gelu_tanh_f(c[1] * fg) * (c[3] * fu));
          continue;
        }
        const int r = mt * 16 + gid + 8 * h;
        if (r >= rows) continue;
        const float(&c)[2][4] = acc[u][mt];
        const __half2 v = __halves2half2(__float2half_rn(gelu_tanh_f(c[0][2 * h] * fg) * (c[1][2 * h] * fu)),
                                         __float2half_rn(gelu_tanh_f(c[0][2 * h + 1] * fg) * (c[1][2 * h + 1] * fu)));
        *reinterpret_cast<__half2*>(act + (size_t)(start + r) * IE + 8 * unit + 2 * t4) = v;
      }
    }
  }
}

template <int KIND, int IE, int H, int E, int TOPK, int BM, int NWARP, int UPW, int STAGES, int PF, bool SWAP = false>
__device__ __forceinline__ void moe_grouped_down(const WPtr p, const float* __restrict__ gscale,
                                                 const __half* __restrict__ act, const int* __restrict__ pairs,
                                                 const int4* __restrict__ tiles, const float* __restrict__ wts,
                                                 float* __restrict__ ypair) {
  constexpr int MT = BM / 16;
  constexpr size_t EW = layout_weight_bytes<KIND>(H, IE), ES = layout_scale_bytes<KIND>(H, IE);
  extern __shared__ uint4 smem_u4[];
  __shared__ const __half* src[BM];
  __shared__ int spair[BM];
  __shared__ float swt[BM];
  pdl_trigger();
  pdl_wait();  // tiles / pairs from the plan kernel, act from the grouped gate/up, wts from the router
  int e, start, rows;
  if (!load_tile_record(tiles, E, e, start, rows)) return;
  rows = rows < BM ? rows : BM;
  for (int r = threadIdx.x; r < BM; r += NWARP * 32) {
    const int pr = r < rows ? __ldg(pairs + start + r) : 0;
    src[r] = r < rows ? act + (size_t)(start + r) * IE : nullptr;
    spair[r] = pr;
    swt[r] = r < rows ? __ldg(wts + pr) : 0.f;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int unit0 = (blockIdx.x * NWARP + warp) * UPW;
  float acc[UPW][MT][2][4] = {};
  grouped_mainloop<KIND, H, IE, BM, NWARP, UPW, STAGES, PF, SWAP>(acc, WPtr{p.w + e * EW, p.s + e * ES}, unit0, src,
                                                                   reinterpret_cast<__half*>(smem_u4), rows);
  const float* gs = gscale + (KIND == HALF ? (size_t)0 : (size_t)e) * (H / 8);
#pragma unroll
  for (int u = 0; u < UPW; ++u) {
    const int unit = unit0 + u;
    const float f0 = tile_factor<KIND>(gs, 2 * unit), f1 = tile_factor<KIND>(gs, 2 * unit + 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (SWAP) {  // c: (col gid, rows r, r + 1), then col 8 + gid
          const float(&c)[4] = acc[u][mt][h];
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const int r = mt * 16 + 8 * h + 2 * t4 + q;
            if (r >= rows) continue;
            float* dst = ypair + (size_t)spair[r] * H + 16 * unit + gid;
            dst[0] = c[q] * f0 * swt[r];
            dst[8] = c[2 + q] * f1 * swt[r];
          }
          continue;
        }
        const int r = mt * 16 + gid + 8 * h;
        if (r >= rows) continue;
        const float w = swt[r];
        float* dst = ypair + (size_t)spair[r] * H + 16 * unit + 2 * t4;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const float f = t ? f1 : f0;
          *reinterpret_cast<float2*>(dst + 8 * t) =
              make_float2(acc[u][mt][t][2 * h] * f * w, acc[u][mt][t][2 * h + 1] * f * w);
        }
      }
    }
  }
}

}  // namespace thorgen
