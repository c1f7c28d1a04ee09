// thorgen MoE router (Gemma-4): logits[t, e] = (rmsnorm_noweight(x_t) * scale * H^-0.5) . W[e, :]   (W bf16 [E, H])
// then softmax -> top-k (ties -> lower expert id) -> renormalise -> * per_expert_scale[idx].
// router_logits: grid (E / warps, token groups): a warp per expert holds its W row in registers and loops over its
// block's tokens (staged in shared memory); W comes from DRAM once per step, the other token groups hit L2.
// router_topk: one block per token. The renormalised top-k weights equal exp(l_k - l_max) / sum_k exp(...):
// the softmax denominator over all experts cancels, so only the selected logits are exponentiated.
// router_fused (one launch instead of two on the decode critical path): router_logits with K > 0; each block bumps
// a per-token counter after writing its logits and the token's last block runs the top-k on that row with one warp
// (router_topk_warp: the same keys, tie rule and fp32 weight math as router_topk, so the results are bit-identical).
// The counters start zeroed (the runtime zeroes them once) and the last block re-zeroes them (graph-replay safe).
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

// The renormalised top-k weights from the selected logits (sel_logit[0] is the largest): exp(l_k - l_0) / sum,
// times the expert's per_expert_scale; written with the ids. One thread; shared by router_topk and the fused path.
template <int K>
__device__ __forceinline__ void write_topk(const int* sel, const float* sel_logit,
                                           const __nv_bfloat16* __restrict__ per_expert_scale,
                                           int32_t* __restrict__ idx_out, float* __restrict__ w_out) {
  const float m = sel_logit[0];
  float p[K], sum = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) { p[k] = expf(sel_logit[k] - m); sum += p[k]; }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    idx_out[k] = sel[k];
    w_out[k] = p[k] / sum * __bfloat162float(per_expert_scale[sel[k]]);
  }
}

// Top-k of one token's E logits by one warp (lane l holds experts l, l+32, ...): K rounds of a warp max over
// (logit, -id) keys, the winner's owner drops it; lane 0 writes ids and weights exactly as router_topk does. The
// logits were written by other blocks of this launch: read through L2 (ld.cg), after the caller's fence.
// (A block-wide rank count instead of the K rounds measured ~0.9 us slower on the H200: 2 warps, E^2 compares.)
template <int E, int K>
__device__ __forceinline__ void router_topk_warp(const float* lrow, const __nv_bfloat16* __restrict__ per_expert_scale,
                                                 int32_t* __restrict__ idx_out, float* __restrict__ w_out) {
  static_assert(K >= 1 && K <= E && K <= 32, "top-k must lie in 1..min(E, 32)");
  constexpr int PER = (E + 31) / 32;
  const int lane = threadIdx.x & 31;
  unsigned long long key[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = lane + 32 * j;
    key[j] = e < E ? value_index_key(__ldcg(lrow + e), (uint32_t)e) : 0ull;
  }
  int sel[K];
  float sel_logit[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    unsigned long long best = 0ull;
#pragma unroll
    for (int j = 0; j < PER; ++j) best = key[j] > best ? key[j] : best;
    best = warp_max_u64(best);
    const int e = (int)key_index(best);
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (lane + 32 * j == e) key[j] = 0ull;
    sel[k] = e;
    sel_logit[k] = key_value(best);  // the logit's exact bits (the key is a bijection of the float)
  }
  if (lane == 0) {
    write_topk<K>(sel, sel_logit, per_expert_scale, idx_out, w_out);
  }
}

// K == 0: logits only. K > 0 (router_fused): also the top-k of every token, by the token's last block.
template <int H, int E, int THREADS, int K = 0>
__device__ void router_logits(const float* __restrict__ x, const __nv_bfloat16* __restrict__ scale,
                              const __nv_bfloat16* __restrict__ proj, float* logits, int T, float eps,
                              const __nv_bfloat16* __restrict__ per_expert_scale = nullptr,
                              unsigned int* __restrict__ counters = nullptr, int32_t* __restrict__ topk_idx = nullptr,
                              float* __restrict__ topk_w = nullptr) {
  static_assert(H % 8 == 0, "hidden size must be a multiple of 8 (16-byte weight loads)");
  static_assert(THREADS % 32 == 0, "block size must be a multiple of 32");
  constexpr int WARPS = THREADS / 32, CH = H / 8, PER = (CH + 31) / 32;
  static_assert(E % WARPS == 0, "experts must be a multiple of the warps per block");
  __shared__ __align__(16) float xs[H];
  __shared__ float scratch[32];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int e = blockIdx.x * WARPS + warp;
  const bool active = e < E;
  uint4 w[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int c = lane + 32 * j;
    w[j] = (active && c < CH) ? reinterpret_cast<const uint4*>(proj + (long)e * H)[c] : make_uint4(0, 0, 0, 0);
  }
  pdl_wait();  // PDL: the weight row is in flight; x (and the counters) come from earlier kernels
  for (int t = blockIdx.y; t < T; t += gridDim.y) {  // tokens spread over grid.y
    float ss = 0.f;
    __syncthreads();  // xs of the previous token is no longer read
    for (int i = threadIdx.x; i < H; i += THREADS) {
      const float v = x[(long)t * H + i];
      ss = fmaf(v, v, ss);
      xs[i] = v * __bfloat162float(scale[i]);
    }
    ss = block_sum<THREADS>(ss, scratch);
    __syncthreads();  // the xs writes are visible to every warp
    const float inv = rsqrtf(ss * (1.0f / H) + eps) * rsqrtf((float)H);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int c = lane + 32 * j;
      if (c < CH) {
        const __nv_bfloat16* wb = reinterpret_cast<const __nv_bfloat16*>(&w[j]);
        const float4 a = reinterpret_cast<const float4*>(xs)[2 * c], b = reinterpret_cast<const float4*>(xs)[2 * c + 1];
        acc = fmaf(a.x, __bfloat162float(wb[0]), acc); acc = fmaf(a.y, __bfloat162float(wb[1]), acc);
        acc = fmaf(a.z, __bfloat162float(wb[2]), acc); acc = fmaf(a.w, __bfloat162float(wb[3]), acc);
        acc = fmaf(b.x, __bfloat162float(wb[4]), acc); acc = fmaf(b.y, __bfloat162float(wb[5]), acc);
        acc = fmaf(b.z, __bfloat162float(wb[6]), acc); acc = fmaf(b.w, __bfloat162float(wb[7]), acc);
      }
    }
    acc = warp_sum(acc);
    if (active && lane == 0) logits[(long)t * E + e] = acc * inv;
    if constexpr (K > 0) {
      __syncthreads();  // this block's logits of token t are written
      if (threadIdx.x == 0) {
        __threadfence();  // ... and visible device-wide (cumulative over the block's writes) before the count
        last = atomicAdd(&counters[t], 1u) == gridDim.x - 1;
      }
      __syncthreads();
      if (last && warp == 0) {
        __threadfence();  // acquire: every other block's logits of token t are visible from here on
        router_topk_warp<E, K>(logits + (long)t * E, per_expert_scale, topk_idx + (long)t * K, topk_w + (long)t * K);
        if (lane == 0) counters[t] = 0u;  // every block of token t has counted: leave it zeroed
      }
    }
  }
}

// router_logits_tiled (a prefill chunk): the logits as a small fp32 GEMM, [T, H] x [H, E] -> [T, E], with a long
// K = H. A block computes BT tokens x BE experts (grid: E / BE, ceil(T / BT)); each of its warps owns a K-slice of
// every KC-column chunk and keeps the whole BT x BE tile in registers (lane: TT = BT / 4 tokens x TE = BE / 8
// experts), so every staged x column serves BE experts and every staged W column BT tokens, instead of the staged
// forms' one token row per barrier. The warps' partial tiles are summed in shared memory in warp order (fixed, so
// the result does not depend on timing). Staging folds in the rest: x * scale goes to shared memory while each token's
// sum of squares accumulates from the raw x (one pass over x), and the norm (* H^-0.5) scales the epilogue's sums,
// the same order of operations as router_logits. The next chunk's x / scale / W are loaded into registers while the
// current one is computed. FP32 FMAs only: the top-k after it is sensitive to the logits' rounding.
// Shared-memory rows are KC + 4 floats (4 banks apart mod 32): the 4 adjacent token rows or 8 adjacent expert rows
// that a warp's float4 loads touch at one column start in distinct bank quads, so each load is one wavefront.
template <int H, int E, int BT, int BE, int THREADS>
__device__ void router_logits_tiled(const float* __restrict__ x, const __nv_bfloat16* __restrict__ scale,
                                    const __nv_bfloat16* __restrict__ proj, float* __restrict__ logits, int T,
                                    float eps) {
  constexpr int KC = 128;                                  // H columns a chunk: one float4 of x per lane and row
  constexpr int WARPS = THREADS / 32, NC = H / KC, KW = KC / WARPS;
  constexpr int TT = BT / 4, TE = BE / 8;                  // a lane's tokens x experts (4 x 8 lanes a warp)
  constexpr int XR = BT / WARPS;                           // token rows each warp stages a chunk
  constexpr int WN = BE * (KC / 8), WR = (WN + THREADS - 1) / THREADS;  // 8-bf16 W pieces a chunk; a thread's (<=)
  constexpr int SX = KC + 4;                               // shared row stride (floats), see above
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "block size must be a multiple of 32, at most 1024");
  static_assert(H % KC == 0, "hidden size must be a multiple of the 128-column chunk");
  static_assert(E % BE == 0, "the expert tiles must cover the experts");
  static_assert(BT % 4 == 0 && BE % 8 == 0 && TT >= 1 && TE >= 1, "the tile is 4 x 8 lanes of TT x TE outputs");
  static_assert(KC % (4 * WARPS) == 0, "each warp takes whole float4 columns of a chunk");
  static_assert(BT % WARPS == 0, "each warp stages whole token rows");
  constexpr int STAGE = (BT + BE) * SX, RED = WARPS * BT * BE;
  __shared__ __align__(16) float sm[STAGE > RED ? STAGE : RED];  // x*scale | W chunk; then the warps' partial tiles
  __shared__ float ssum[BT];
  float* xs = sm;
  float* ws = sm + BT * SX;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tq = lane >> 3, eq = lane & 7;                 // this lane's tokens tq + 4 i, experts eq + 8 j
  const int t0 = blockIdx.y * BT, e0 = blockIdx.x * BE;
  const __nv_bfloat16* wblk = proj + (long)e0 * H;

  float4 xv[XR];
  uint2 sv;
  uint4 wv[WR];
  auto load_w = [&](int kc) {
    sv = __ldg(reinterpret_cast<const uint2*>(scale + kc) + lane);
#pragma unroll
    for (int r = 0; r < WR; ++r) {
      const int u = threadIdx.x + THREADS * r;
      if (WN % THREADS == 0 || u < WN)
        wv[r] = __ldg(reinterpret_cast<const uint4*>(wblk + (long)(u / (KC / 8)) * H + kc) + u % (KC / 8));
    }
  };
  auto load_x = [&](int kc) {
#pragma unroll
    for (int r = 0; r < XR; ++r) {
      const int t = t0 + warp + WARPS * r;
      xv[r] = t < T ? reinterpret_cast<const float4*>(x + (long)t * H + kc)[lane] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load_w(0);
  pdl_wait();  // PDL: the first W chunk is in flight; x comes from earlier kernels
  load_x(0);

  float acc[TT][TE] = {};
  float ss[XR] = {};
  for (int c = 0; c < NC; ++c) {
    if (c > 0) __syncthreads();  // every warp is done with the previous chunk's xs / ws
    const __nv_bfloat162* s2 = reinterpret_cast<const __nv_bfloat162*>(&sv);
    const float2 sa = __bfloat1622float2(s2[0]), sb = __bfloat1622float2(s2[1]);
#pragma unroll
    for (int r = 0; r < XR; ++r) {
      const float4 v = xv[r];
      ss[r] = fmaf(v.x, v.x, ss[r]); ss[r] = fmaf(v.y, v.y, ss[r]);
      ss[r] = fmaf(v.z, v.z, ss[r]); ss[r] = fmaf(v.w, v.w, ss[r]);
      reinterpret_cast<float4*>(xs + (warp + WARPS * r) * SX)[lane] =
          make_float4(v.x * sa.x, v.y * sa.y, v.z * sb.x, v.w * sb.y);
    }
#pragma unroll
    for (int r = 0; r < WR; ++r) {
      const int u = threadIdx.x + THREADS * r;
      if (WN % THREADS != 0 && u >= WN) break;
      const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv[r]);
      const float2 a = __bfloat1622float2(w2[0]), b = __bfloat1622float2(w2[1]);
      const float2 p = __bfloat1622float2(w2[2]), q = __bfloat1622float2(w2[3]);
      float4* dst = reinterpret_cast<float4*>(ws + (u / (KC / 8)) * SX + 8 * (u % (KC / 8)));
      dst[0] = make_float4(a.x, a.y, b.x, b.y);
      dst[1] = make_float4(p.x, p.y, q.x, q.y);
    }
    __syncthreads();  // the chunk is staged
    if (c + 1 < NC) {  // the next chunk's loads fly while this one is computed
      load_w((c + 1) * KC);
      load_x((c + 1) * KC);
    }
#pragma unroll
    for (int k = warp * KW; k < warp * KW + KW; k += 4) {
      float4 a[TT], b[TE];
#pragma unroll
      for (int i = 0; i < TT; ++i) a[i] = *reinterpret_cast<const float4*>(xs + (tq + 4 * i) * SX + k);
#pragma unroll
      for (int j = 0; j < TE; ++j) b[j] = *reinterpret_cast<const float4*>(ws + (eq + 8 * j) * SX + k);
#pragma unroll
      for (int i = 0; i < TT; ++i)
#pragma unroll
        for (int j = 0; j < TE; ++j) {
          acc[i][j] = fmaf(a[i].x, b[j].x, acc[i][j]); acc[i][j] = fmaf(a[i].y, b[j].y, acc[i][j]);
          acc[i][j] = fmaf(a[i].z, b[j].z, acc[i][j]); acc[i][j] = fmaf(a[i].w, b[j].w, acc[i][j]);
        }
    }
  }
#pragma unroll
  for (int r = 0; r < XR; ++r) {
    const float s = warp_sum(ss[r]);
    if (lane == 0) ssum[warp + WARPS * r] = s;
  }
  __syncthreads();  // every warp is done with the last chunk: sm now holds the partial tiles
  float* red = sm + warp * BT * BE;
#pragma unroll
  for (int i = 0; i < TT; ++i)
#pragma unroll
    for (int j = 0; j < TE; ++j) red[(tq + 4 * i) * BE + eq + 8 * j] = acc[i][j];
  __syncthreads();
  for (int o = threadIdx.x; o < BT * BE; o += THREADS) {
    const int t = o / BE, e = o % BE;
    if (t0 + t >= T) continue;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += sm[w * BT * BE + o];
    const float inv = rsqrtf(ssum[t] * (1.0f / H) + eps) * rsqrtf((float)H);
    logits[(long)(t0 + t) * E + e0 + e] = s * inv;
  }
}

template <int E, int K, int THREADS>
__device__ void router_topk(const float* __restrict__ logits, const __nv_bfloat16* __restrict__ per_expert_scale,
                            int32_t* __restrict__ topk_idx, float* __restrict__ topk_w, int T) {
  static_assert(K >= 1 && K <= E && K <= 32, "top-k must lie in 1..min(E, 32)");
  static_assert(THREADS >= E && THREADS % 32 == 0, "one thread per expert");
  __shared__ unsigned long long scratch[32];
  __shared__ int sel[K];
  __shared__ float sel_logit[K];
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    const int e = threadIdx.x;
    const float l = e < E ? logits[(long)t * E + e] : 0.f;
    bool taken = false;
    for (int k = 0; k < K; ++k) {
      const unsigned long long key = (e < E && !taken) ? value_index_key(l, (uint32_t)e) : 0ull;
      const unsigned long long best = block_max_u64<THREADS>(key, scratch);
      const int idx = (int)key_index(best);
      if (e == idx) { taken = true; sel[k] = e; sel_logit[k] = l; }
    }
    __syncthreads();
    if (threadIdx.x == 0) write_topk<K>(sel, sel_logit, per_expert_scale, topk_idx + (long)t * K, topk_w + (long)t * K);
    __syncthreads();
  }
}

}  // namespace thorgen
