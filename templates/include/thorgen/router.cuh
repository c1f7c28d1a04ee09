// thorgen MoE router (Gemma-4): logits[t, e] = (rmsnorm_noweight(x_t) * scale * H^-0.5) . W[e, :]   (W bf16 [E, H])
// then softmax -> top-k (ties -> lower expert id) -> renormalise -> * per_expert_scale[idx].
// router_logits: grid (E / warps, token groups): a warp per expert holds its W row in registers and loops over its
// block's tokens (staged in shared memory); W comes from DRAM once per step, the other token groups hit L2.
// router_topk: one warp per token. The renormalised top-k weights equal exp(l_k - l_max) / sum_k exp(...):
// the softmax denominator over all experts cancels, so only the selected logits are exponentiated.
// router_fused (one launch instead of two on the decode critical path): router_logits with K > 0; each block bumps
// a per-token counter after writing its logits and the token's last block runs the top-k on that row with one warp
// (router_topk_warp, router_topk's own per-token body, so the two give bit-identical ids and weights).
// The counters start zeroed (the runtime zeroes them once) and the last block re-zeroes them (graph-replay safe).
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

// The renormalised top-k weights from the selected logits (sel_logit[0] is the largest): exp(l_k - l_0) / sum,
// times the expert's per_expert_scale; written with the ids. One thread (router_topk_warp's lane 0).
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
// (logit, -id) keys (warp_max_key: two redux.sync a round), the winner's owner drops it; lane 0 writes ids and
// weights. The body of router_topk (a warp a token) and of router_fused's last block, whose logits were written by
// other blocks of its own launch: so they are read through L2 (ld.cg), after the caller's fence.
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
    best = warp_max_key(best);
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

// The logits' factor from a token's sum of squares: rmsnorm without weight, times H^-0.5. One expression for
// router_logits and router_logits_tiled, which must round alike (the top-k flips an expert on a near-tie).
template <int H>
__device__ __forceinline__ float router_inv_norm(float ss, float eps) {
  return rsqrtf(ss * (1.0f / H) + eps) * rsqrtf((float)H);
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
  // router_fused (the one-row decode step): a thread's x columns i = threadIdx.x + k THREADS, with the scale (a
  // weight) loaded before the wait and all of the token's x loads issued before the first is used. The loop form
  // leaves three dependent L2 round trips after the wait (ncu, H200): the decode graph replay measured 49 us
  // faster this way. The many-row router_logits keeps the loop (153 registers, not 220: it runs beside the dense
  // MLP's GEMM, and the verify graph was 90 us slower with the preload there). Both keep the sum
  // of squares' order (fmaf over the columns in turn), as router_logits_tiled expects.
  constexpr bool PRELOAD = K > 0;
  constexpr int XI = PRELOAD ? (H + THREADS - 1) / THREADS : 1;
  float sc[XI];
#pragma unroll
  for (int k = 0; k < XI; ++k) {
    const int i = threadIdx.x + k * THREADS;
    sc[k] = PRELOAD && i < H ? __bfloat162float(scale[i]) : 0.f;
  }
  pdl_wait();  // PDL: the weight row is in flight; x (and the counters) come from earlier kernels
  for (int t = blockIdx.y; t < T; t += gridDim.y) {  // tokens spread over grid.y
    float ss = 0.f;
    __syncthreads();  // xs of the previous token is no longer read
    if constexpr (PRELOAD) {
      float xv[XI];
#pragma unroll
      for (int k = 0; k < XI; ++k) {
        const int i = threadIdx.x + k * THREADS;
        xv[k] = i < H ? x[(long)t * H + i] : 0.f;
      }
#pragma unroll
      for (int k = 0; k < XI; ++k) {
        const int i = threadIdx.x + k * THREADS;
        if (i < H) {
          ss = fmaf(xv[k], xv[k], ss);
          xs[i] = xv[k] * sc[k];
        }
      }
    } else {
      for (int i = threadIdx.x; i < H; i += THREADS) {
        const float v = x[(long)t * H + i];
        ss = fmaf(v, v, ss);
        xs[i] = v * __bfloat162float(scale[i]);
      }
    }
    ss = block_sum<THREADS>(ss, scratch);
    __syncthreads();  // the xs writes are visible to every warp
    const float inv = router_inv_norm<H>(ss, eps);
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

// One step of router_logits_tiled's recursive-halving warp sum: of the 2 O live pairs (acc[0 .. 2 O)), a lane keeps
// the half whose index bit log2(O) equals its lane's bit and adds the partner lane's partials of them (the butterfly's
// add, a + b == b + a); then the next step on acc[0 .. O).
template <int O>
__device__ __forceinline__ void halve_pairs(float (&acc)[64], int lane) {
  if constexpr (O > 0) {
    const bool up = lane & O;
#pragma unroll
    for (int k = 0; k < 2 * O; ++k) {
      const float keep = up ? acc[k + 2 * O] : acc[k], send = up ? acc[k] : acc[k + 2 * O];
      acc[k] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    halve_pairs<O / 2>(acc, lane);
  }
}

// router_logits_tiled (a prefill chunk): the logits as a small fp32 GEMM, [T, H] x [H, E] -> [T, E], bit-identical to
// router_logits (the <= 16-row form, 2 warps a block) on the same inputs: the top-k after it flips an expert on a
// near-tie if the logits' rounding differs, so every sum runs in that kernel's order.
//  - dot products: router_logits' lane l sums, with sequential fmaf, the 8-column chunks l, l + 32, ... of H: i.e. the
//    columns 8l..8l+7 of every KC = 256-column chunk in turn. Here too: a block computes BT tokens x BE experts
//    (grid: E / BE, ceil(T / BT)); its warps each own 8 tokens x 8 experts (64 pairs), and lane l of every warp runs
//    the same fmaf chain (8 columns of a chunk, chunk after chunk) for each of its warp's 64 pairs; at the end the 32
//    lanes' partials of a pair are summed in warp_sum's butterfly (as a recursive halving: the same adds, each pair
//    ends in one lane), then * the token's norm.
//  - sum of squares: router_logits' block_sum<64> (thread i sums x[i], x[i + 64], ... with fmaf; warp_sum over
//    threads 0..31, over 32..63, the two added). Here the staging thread of a token's columns 4q..4q+3 (mod 64) keeps
//    those 4 classes (columns come chunk by chunk in increasing order); the epilogue combines the 64 the same way.
// Staging: x * scale (fp32, as router_logits) and W (bf16) of a chunk go to shared memory; the next chunk's x / W are
// loaded into registers while the current one is computed. The x rows are stored as two half rows (lane l's columns
// 8l..8l+3 at floats 4l.. of the first, 8l+4..8l+7 of the second; 16 floats of padding), so a warp's float4 reads
// and the staging's float4 writes are conflict-free; W rows stay bf16 (one 16-byte read a lane and expert).
template <int H, int E, int BT, int BE, int THREADS>
__device__ void router_logits_tiled(const float* __restrict__ x, const __nv_bfloat16* __restrict__ scale,
                                    const __nv_bfloat16* __restrict__ proj, float* __restrict__ logits, int T,
                                    float eps) {
  constexpr int KC = 256;                                // H columns a chunk: 8 a lane
  constexpr int NC = H / KC, TG = BT / 8, EG = BE / 8;   // chunks; the warps' token groups x expert groups
  constexpr int XH = KC / 2 + 16, XROW = 2 * XH;         // a staged x half row / row (floats), see above
  constexpr int XI = BT * (KC / 16) / THREADS;           // x staging items a thread: (token, q): 4 float4, m = 0..3
  constexpr int WI = BE * (KC / 8) / THREADS;            // W staging items a thread: 8 bf16 each
  static_assert(H % KC == 0, "hidden size must be a multiple of the 256-column chunk (router_logits' lane order)");
  static_assert(E % BE == 0 && BT % 8 == 0 && BE % 8 == 0, "the tile is 8 x 8 pairs a warp");
  static_assert(THREADS == 32 * TG * EG, "a warp per 8 tokens x 8 experts of the tile");
  static_assert(XI >= 1 && XI * THREADS == BT * (KC / 16) && WI >= 1 && WI * THREADS == BE * (KC / 8),
                "the staging items must divide among the threads");
  __shared__ __align__(16) float xs[BT * XROW];          // x * scale of the chunk
  __shared__ __align__(16) uint4 ws[BE * (KC / 8)];       // W of the chunk (bf16)
  __shared__ __align__(16) __nv_bfloat16 ssc[H];          // the scale
  __shared__ float sq[BT * 64];                           // the tokens' 64 sum-of-squares classes
  __shared__ float inv_s[BT];                             // the tokens' norms * H^-0.5

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tg = warp % TG, eg = warp / TG;               // this warp's tokens 8 tg + i, experts 8 eg + j
  const int t0 = blockIdx.y * BT, e0 = blockIdx.x * BE;
  const __nv_bfloat16* wblk = proj + (long)e0 * H;

  uint4 wv[WI];
  float4 xv[XI][4];
  auto load_w = [&](int kc) {
#pragma unroll
    for (int r = 0; r < WI; ++r) {
      const int u = threadIdx.x + THREADS * r;            // expert u / 32, columns 8 (u % 32) ..
      wv[r] = __ldg(reinterpret_cast<const uint4*>(wblk + (long)(u / (KC / 8)) * H + kc) + u % (KC / 8));
    }
  };
  auto load_x = [&](int kc) {
#pragma unroll
    for (int r = 0; r < XI; ++r) {
      const int u = threadIdx.x + THREADS * r, t = t0 + u / 16, q = u % 16;  // columns 4q + 64m .. +3
#pragma unroll
      for (int m = 0; m < 4; ++m)
        xv[r][m] = t < T ? *reinterpret_cast<const float4*>(x + (long)t * H + kc + 4 * q + 64 * m)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load_w(0);
  for (int i = threadIdx.x; i < H / 8; i += THREADS)
    reinterpret_cast<uint4*>(ssc)[i] = __ldg(reinterpret_cast<const uint4*>(scale) + i);
  pdl_wait();  // PDL: the first W chunk and the scale are in flight; x comes from earlier kernels
  load_x(0);

  float acc[64] = {};                                     // pair 8 i + j: token 8 tg + i, expert 8 eg + j
  float ss[XI][4] = {};                                   // classes 4q + k of the staged token u / 16
  for (int c = 0; c < NC; ++c) {
    const int kc = c * KC;
    __syncthreads();  // every warp is done with the previous chunk's xs / ws (c == 0: ssc is written)
#pragma unroll
    for (int r = 0; r < XI; ++r) {
      const int u = threadIdx.x + THREADS * r, tt = u / 16, q = u % 16;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float4 v = xv[r][m];
        ss[r][0] = fmaf(v.x, v.x, ss[r][0]); ss[r][1] = fmaf(v.y, v.y, ss[r][1]);
        ss[r][2] = fmaf(v.z, v.z, ss[r][2]); ss[r][3] = fmaf(v.w, v.w, ss[r][3]);
        const uint2 sv = *reinterpret_cast<const uint2*>(ssc + kc + 4 * q + 64 * m);
        const float2 sa = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sv.x));
        const float2 sb = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&sv.y));
        // column 4q + 64m = 8l + 4h: lane l = q / 2 + 8m's half h = q % 2
        reinterpret_cast<float4*>(xs + tt * XROW + (q % 2) * XH)[q / 2 + 8 * m] =
            make_float4(v.x * sa.x, v.y * sa.y, v.z * sb.x, v.w * sb.y);
      }
    }
#pragma unroll
    for (int r = 0; r < WI; ++r) ws[threadIdx.x + THREADS * r] = wv[r];
    __syncthreads();  // the chunk is staged
    if (c + 1 < NC) {  // the next chunk's loads fly while this one is computed
      load_w(kc + KC);
      load_x(kc + KC);
    }
    float4 xa[8], xb[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xa[i] = reinterpret_cast<const float4*>(xs + (8 * tg + i) * XROW)[lane];
      xb[i] = reinterpret_cast<const float4*>(xs + (8 * tg + i) * XROW + XH)[lane];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint4 wr = ws[(8 * eg + j) * (KC / 8) + lane];
      const float2 w01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wr.x));
      const float2 w23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wr.y));
      const float2 w45 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wr.z));
      const float2 w67 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wr.w));
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // router_logits' order: columns 8l .. 8l + 7 of the chunk
        float a = acc[8 * i + j];
        a = fmaf(xa[i].x, w01.x, a); a = fmaf(xa[i].y, w01.y, a); a = fmaf(xa[i].z, w23.x, a);
        a = fmaf(xa[i].w, w23.y, a); a = fmaf(xb[i].x, w45.x, a); a = fmaf(xb[i].y, w45.y, a);
        a = fmaf(xb[i].z, w67.x, a); a = fmaf(xb[i].w, w67.y, a);
        acc[8 * i + j] = a;
      }
    }
  }
  // the tokens' norms: block_sum<64>'s order over the 64 classes
#pragma unroll
  for (int r = 0; r < XI; ++r) {
    const int u = threadIdx.x + THREADS * r;
#pragma unroll
    for (int k = 0; k < 4; ++k) sq[(u / 16) * 64 + 4 * (u % 16) + k] = ss[r][k];
  }
  __syncthreads();
  for (int tt = warp; tt < BT; tt += THREADS / 32) {
    const float s0 = warp_sum(sq[tt * 64 + lane]), s1 = warp_sum(sq[tt * 64 + 32 + lane]);
    const float ssum = s0 + s1;
    if (lane == 0) inv_s[tt] = router_inv_norm<H>(ssum, eps);
  }
  // warp_sum of every pair as a recursive halving: at the step of offset o a lane keeps the half of its pairs whose
  // index has bit log2(o) equal to its lane's and adds the partner's partials of them: the butterfly's adds (a + b
  // == b + a), 63 shuffles instead of 320; lane l ends with pairs 2l and 2l + 1
  halve_pairs<16>(acc, lane);
  __syncthreads();  // inv_s is written
  const int i = lane >> 2, t = t0 + 8 * tg + i;
  if (t < T) {
    const float inv = inv_s[8 * tg + i];
    *reinterpret_cast<float2*>(logits + (long)t * E + e0 + 8 * eg + 2 * (lane & 3)) =
        make_float2(acc[0] * inv, acc[1] * inv);
  }
}

// A warp a token (router_topk_warp: the keys, tie rule and weight math of router_fused's top-k, so the two agree bit
// for bit), WARPS tokens a block, blocks grid-stride. K rounds of a warp max with no block barrier: the block-wide
// form (a thread an expert, K rounds of block_max_u64, 2 barriers each) took ~8 us a layer at 32 rows on the H200.
template <int E, int K, int THREADS>
__device__ void router_topk(const float* __restrict__ logits, const __nv_bfloat16* __restrict__ per_expert_scale,
                            int32_t* __restrict__ topk_idx, float* __restrict__ topk_w, int T) {
  static_assert(THREADS % 32 == 0, "whole warps");
  constexpr int WARPS = THREADS / 32;
  const int warp = threadIdx.x >> 5;
  for (int t = blockIdx.x * WARPS + warp; t < T; t += gridDim.x * WARPS)
    router_topk_warp<E, K>(logits + (long)t * E, per_expert_scale, topk_idx + (long)t * K, topk_w + (long)t * K);
}

}  // namespace thorgen
