// thorgen RMSNorm family: plain-weight Gemma/Qwen RMSNorm  y = x * (mean(x^2) + eps)^-0.5 * w  (fp32 math),
// fused with residual adds, norm-of-sum and layer_scalar. One block per row (grid-stride over the T rows);
// each thread keeps H/THREADS elements in registers (element i = tid + j*THREADS: coalesced).
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

template <int H, int THREADS>
struct RowShape {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, at most 1024");
  static_assert(H % THREADS == 0, "hidden size must be a multiple of the block size");
  static constexpr int PER = H / THREADS;
};

template <int H, int THREADS, typename T>
__device__ __forceinline__ void load_row(const T* p, float (&v)[H / THREADS]) {
#pragma unroll
  for (int j = 0; j < H / THREADS; ++j) v[j] = ld(p, threadIdx.x + j * THREADS);
}

template <int H, int THREADS, typename T>
__device__ __forceinline__ void store_row(T* p, const float (&v)[H / THREADS]) {
#pragma unroll
  for (int j = 0; j < H / THREADS; ++j) st(p, threadIdx.x + j * THREADS, v[j]);
}

// v <- v * rsqrt(mean(v^2) + eps) [* w]
template <int H, int THREADS>
__device__ __forceinline__ void norm_row(float (&v)[H / THREADS], const __nv_bfloat16* w, float eps, float* scratch) {
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < H / THREADS; ++j) ss = fmaf(v[j], v[j], ss);
  ss = block_sum<THREADS>(ss, scratch);
  const float inv = rsqrtf(ss * (1.0f / H) + eps);
#pragma unroll
  for (int j = 0; j < H / THREADS; ++j) {
    v[j] *= inv;
    if (w != nullptr) v[j] *= __bfloat162float(w[threadIdx.x + j * THREADS]);
  }
}

// y = norm(x) * w
template <int H, int THREADS, typename TI, typename TO>
__device__ void rmsnorm_rows(const TI* __restrict__ x, const __nv_bfloat16* __restrict__ w, TO* __restrict__ y,
                             int T, float eps) {
  (void)RowShape<H, THREADS>::PER;
  __shared__ float scratch[32];
  for (int row = blockIdx.x; row < T; row += gridDim.x) {
    float v[H / THREADS];
    load_row<H, THREADS>(x + (long)row * H, v);
    norm_row<H, THREADS>(v, w, eps, scratch);
    store_row<H, THREADS>(y + (long)row * H, v);
  }
}

// x += y ; a = norm(x) * w     (residual add then the next norm: the drafter's Qwen3-style layers)
template <int H, int THREADS, typename TY, typename TA>
__device__ void add_rmsnorm_rows(float* __restrict__ x, const TY* __restrict__ y, const __nv_bfloat16* __restrict__ w,
                                 TA* __restrict__ a, int T, float eps) {
  (void)RowShape<H, THREADS>::PER;
  __shared__ float scratch[32];
  for (int row = blockIdx.x; row < T; row += gridDim.x) {
    float v[H / THREADS], d[H / THREADS];
    load_row<H, THREADS>(x + (long)row * H, v);
    load_row<H, THREADS>(y + (long)row * H, d);
#pragma unroll
    for (int j = 0; j < H / THREADS; ++j) v[j] += d[j];
    store_row<H, THREADS>(x + (long)row * H, v);
    norm_row<H, THREADS>(v, w, eps, scratch);
    store_row<H, THREADS>(a + (long)row * H, v);
  }
}

// ---- one row in another block size's arithmetic ------------------------------------------------------------------
// A block of BLOCK threads computes a row exactly as a row kernel of VT threads would: virtual thread vt holds
// elements vt + j*VT (load_row's layout), and real warp w plays virtual warps w, w + BLOCK/32, ... (slots q) with its
// lanes as theirs, so every per-thread chain and every shuffle tree sees the same operands in the same order. The
// folded o_proj GEMV (nvfp4_gemm.cu.j2, epilogue attn_tail) replays attn_tail's block this way with its own size.
template <int H, int VT, int BLOCK>
struct VRow {
  static_assert(VT % 32 == 0 && VT <= 1024 && BLOCK % 32 == 0 && BLOCK <= 1024,
                "block sizes must be multiples of 32, at most 1024");
  static_assert(H % VT == 0, "hidden size must be a multiple of the virtual block size");
  static constexpr int PER = H / VT, VW = VT / 32, RW = BLOCK / 32, Q = (VW + RW - 1) / RW;
  // The virtual thread this thread plays in slot q, or -1 (its warp has no virtual warp there).
  static __device__ __forceinline__ int vt(int q) {
    const int vw = (int)(threadIdx.x >> 5) + q * RW;
    return vw < VW ? 32 * vw + (int)(threadIdx.x & 31) : -1;
  }
};

// rsqrt(mean(v^2) + eps) of a virtual row (norm_row's sum: each virtual thread's fma chain, then block_sum<VT>'s
// tree). Every thread of the block calls it; idle slots hold zeros.
template <int H, int VT, int BLOCK>
__device__ __forceinline__ float vrow_inv_rms(const float (&v)[VRow<H, VT, BLOCK>::Q][H / VT], float eps,
                                              float* scratch) {
  using R = VRow<H, VT, BLOCK>;
  float ss[R::Q];
#pragma unroll
  for (int q = 0; q < R::Q; ++q) {
    ss[q] = 0.f;
#pragma unroll
    for (int j = 0; j < R::PER; ++j) ss[q] = fmaf(v[q][j], v[q][j], ss[q]);
    ss[q] = warp_sum(ss[q]);
  }
  float tot = ss[0];
  if constexpr (R::VW > 1) {
    const int lane = threadIdx.x & 31;
    __syncthreads();  // scratch may still be read by a previous call
#pragma unroll
    for (int q = 0; q < R::Q; ++q)
      if (lane == 0 && R::vt(q) >= 0) scratch[R::vt(q) >> 5] = ss[q];
    __syncthreads();
    tot = warp_sum(lane < R::VW ? scratch[lane] : 0.f);
  }
  return rsqrtf(fmaf(tot, 1.0f / H, eps));
}

// Gemma attention tail of one row: x += norm(o) * w_post ; a1 = norm(x) * w_pre1 ; a2 = norm(x) * w_pre2 (one sum of
// squares serves both pre-FF norms), in a VT-thread block's arithmetic. Products and sums are rounded explicitly
// (__fmul_rn / __fadd_rn: never fused into an fma), so the standalone kernel and the folded GEMV give the same bits
// whatever the compiler does around them. CG: o was written by other blocks of this launch (loads through L2).
template <int H, int VT, int BLOCK, bool CG, typename TO_IN, typename TA>
__device__ __forceinline__ void attn_tail_row(const TO_IN* o, float* x, const __nv_bfloat16* __restrict__ w_post,
                                              const __nv_bfloat16* __restrict__ w_pre1,
                                              const __nv_bfloat16* __restrict__ w_pre2, TA* a1, TA* a2, float eps,
                                              float* scratch) {
  using R = VRow<H, VT, BLOCK>;
  // the residual and w_post load beside o and w_pre1 / w_pre2 beside the second sum (in flight across its barriers):
  // one memory round trip less on the row's path than loading each just before its use
  float v[R::Q][R::PER], xr[R::Q][R::PER];
  __nv_bfloat16 wp[R::Q][R::PER], w1[R::Q][R::PER], w2[R::Q][R::PER];
#pragma unroll
  for (int q = 0; q < R::Q; ++q) {
    const int t = R::vt(q);
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      const int i = t + j * VT;
      if (t < 0) {
        v[q][j] = 0.f;
        continue;
      }
      if constexpr (CG) v[q][j] = to_f32<TO_IN>(__ldcg(o + i));
      else v[q][j] = ld(o, i);
      xr[q][j] = x[i];
      wp[q][j] = w_post[i];
    }
  }
  const float inv_o = vrow_inv_rms<H, VT, BLOCK>(v, eps, scratch);
#pragma unroll
  for (int q = 0; q < R::Q; ++q) {
    const int t = R::vt(q);
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      if (t < 0) continue;
      const int i = t + j * VT;
      v[q][j] = __fadd_rn(xr[q][j], __fmul_rn(__fmul_rn(v[q][j], inv_o), __bfloat162float(wp[q][j])));
      x[i] = v[q][j];
      w1[q][j] = w_pre1[i];
      w2[q][j] = w_pre2[i];
    }
  }
  const float inv_x = vrow_inv_rms<H, VT, BLOCK>(v, eps, scratch);
#pragma unroll
  for (int q = 0; q < R::Q; ++q) {
    const int t = R::vt(q);
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      if (t < 0) continue;
      const int i = t + j * VT;
      const float n = __fmul_rn(v[q][j], inv_x);
      st(a1, i, __fmul_rn(n, __bfloat162float(w1[q][j])));
      st(a2, i, __fmul_rn(n, __bfloat162float(w2[q][j])));
    }
  }
}

// The attn_tail kernel: attn_tail_row on each of its rows (grid-stride), every thread its own virtual thread.
template <int H, int THREADS, typename TO_IN, typename TA>
__device__ void attn_tail_rows(const TO_IN* __restrict__ o, float* __restrict__ x, const __nv_bfloat16* __restrict__ w_post,
                               const __nv_bfloat16* __restrict__ w_pre1, const __nv_bfloat16* __restrict__ w_pre2,
                               TA* __restrict__ a1, TA* __restrict__ a2, int T, float eps) {
  __shared__ float scratch[32];
  for (int row = blockIdx.x; row < T; row += gridDim.x)
    attn_tail_row<H, THREADS, THREADS, false>(o + (long)row * H, x + (long)row * H, w_post, w_pre1, w_pre2,
                                              a1 + (long)row * H, a2 + (long)row * H, eps, scratch);
}

// The attention tail folded into the o_proj GEMV (one row): every block stored its 16 values of o; the block that
// arrives last at counters[0] (zero at entry, left zeroed) runs the tail with attn_tail's VT-thread arithmetic.
template <int H, int VT, int BLOCK, typename TA>
__device__ __forceinline__ void attn_tail_last_block(const float* o, float* x, const __nv_bfloat16* __restrict__ w_post,
                                                     const __nv_bfloat16* __restrict__ w_pre1,
                                                     const __nv_bfloat16* __restrict__ w_pre2, TA* a1, TA* a2,
                                                     unsigned int* counters, float eps) {
  __shared__ float scratch[32];
  __shared__ int flag;
  if (!last_arrival(counters, gridDim.x, &flag)) return;
  attn_tail_row<H, VT, BLOCK, true>(o, x, w_post, w_pre1, w_pre2, a1, a2, eps, scratch);
}

// Gemma feed-forward tail (norm-of-sum + residual + layer_scalar, then the next layer's input norm):
//   h = norm(norm(mlp)*w1 + norm(moe)*w2) * w ; x = (x + h) * layer_scalar ; a = norm(x) * w_next (w_next != null)
//   tap[row*tap_stride + tap_col + i] = x (the DFlash context feature; tap != null)
// `moe`: PAIRS = 0, the row's MoE output (moe_down, the one-row step, sums its slots itself, from 0 in slot order
// in f32); PAIRS = K > 0, the MoE's per-slot rows [T*K][H] (moe_down_pairs, moe_grouped_down), summed here over the
// slots with a valid expert id (ids [T][K], E experts), from 0 in slot order in f32: the same operations, so a row's
// bits do not depend on which form its step ran (batch invariance), and one launch a layer fewer than a combine.
// One row function for both forms: every input is in flight before the sums that need it, one memory round trip on
// the row's path instead of four (H200: decode 464 -> 480 tok/s), rounded explicitly (the norms' block sums as
// attn_tail_row's). The slot-row form once ran another loop (block sums in another order, so a sequence's row
// differed in the last bits between a one-row and a batched step); the in-flight form in a 512-row prefill chunk
// measured the same TTFT (2,048 tokens: 129.4 against 128.2 ms, within noise).
template <int H, int THREADS, int PAIRS, int E, typename TI, typename TA, typename TT>
__device__ __forceinline__ void ffn_tail_row(const TI* mlp, const TI* moe, const int* __restrict__ ids, float* x,
                                             const __nv_bfloat16* __restrict__ w1,
                                             const __nv_bfloat16* __restrict__ w2,
                                             const __nv_bfloat16* __restrict__ w, float ls,
                                             const __nv_bfloat16* __restrict__ w_next, TA* a, TT* tap, float eps,
                                             float* scratch) {
  static_assert(PAIRS >= 0 && PAIRS <= 32, "0 (one MoE row) or 1..32 slot rows a row");
  constexpr int VT = THREADS;
  using R = VRow<H, VT, VT>;
  unsigned valid = 0;  // the slots whose ids name an expert
#pragma unroll
  for (int k = 0; k < PAIRS; ++k) {
    const int e = __ldg(ids + k);
    if (e >= 0 && e < E) valid |= 1u << k;
  }
  float h1[R::Q][R::PER], h2[R::Q][R::PER], xr[R::Q][R::PER];
  __nv_bfloat16 b1[R::Q][R::PER], b2[R::Q][R::PER], bw[R::Q][R::PER], bn[R::Q][R::PER];
  // what the first two sums read; the rest loads after them, in flight across the third sum's barriers (one
  // memory round trip on the row's path, about half the registers of loading it all up front)
  // Slot rows: every slot of every column loads before the first sum (an invalid slot's row exists, its value
  // unused), so the loads wait neither on the ids nor on each other; the sums then take the valid slots in slot
  // order. Loading and summing a column at a time let the compiler hold one column's slots in flight: PER dependent
  // L2 round trips, ~8 us a 16-row verify step's launch on the H200 (ncu).
  float slot[PAIRS > 0 ? R::Q : 1][PAIRS > 0 ? R::PER : 1][PAIRS > 0 ? PAIRS : 1];
#pragma unroll
  for (int q = 0; q < R::Q; ++q) {
    const int t = R::vt(q);
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      const int i = t + j * VT;
      h1[q][j] = h2[q][j] = xr[q][j] = 0.f;
      if (t < 0) continue;
      h1[q][j] = ld(mlp, i);
      if constexpr (PAIRS == 0) {
        h2[q][j] = ld(moe, i);
      } else {
#pragma unroll
        for (int k = 0; k < PAIRS; ++k) slot[q][j][k] = ld(moe + (long)k * H, i);
      }
      b1[q][j] = w1[i];
      b2[q][j] = w2[i];
    }
  }
  if constexpr (PAIRS > 0) {
#pragma unroll
    for (int q = 0; q < R::Q; ++q)
#pragma unroll
      for (int j = 0; j < R::PER; ++j)
#pragma unroll
        for (int k = 0; k < PAIRS; ++k)
          if (R::vt(q) >= 0 && (valid >> k & 1u)) h2[q][j] = __fadd_rn(h2[q][j], slot[q][j][k]);
  }
  const float inv1 = vrow_inv_rms<H, VT, VT>(h1, eps, scratch);
  const float inv2 = vrow_inv_rms<H, VT, VT>(h2, eps, scratch);
#pragma unroll
  for (int q = 0; q < R::Q; ++q) {
    const int t = R::vt(q);
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      if (t < 0) continue;
      const int i = t + j * VT;
      xr[q][j] = x[i];
      bw[q][j] = w[i];
      if (w_next != nullptr) bn[q][j] = w_next[i];
    }
  }
#pragma unroll
  for (int q = 0; q < R::Q; ++q)
#pragma unroll
    for (int j = 0; j < R::PER; ++j)
      if (R::vt(q) >= 0)
        h1[q][j] = __fadd_rn(__fmul_rn(__fmul_rn(h1[q][j], inv1), __bfloat162float(b1[q][j])),
                             __fmul_rn(__fmul_rn(h2[q][j], inv2), __bfloat162float(b2[q][j])));
  const float inv = vrow_inv_rms<H, VT, VT>(h1, eps, scratch);
#pragma unroll
  for (int q = 0; q < R::Q; ++q) {
    const int t = R::vt(q);
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      if (t < 0) continue;
      const int i = t + j * VT;
      const float h = __fmul_rn(__fmul_rn(h1[q][j], inv), __bfloat162float(bw[q][j]));
      xr[q][j] = __fmul_rn(__fadd_rn(xr[q][j], h), ls);
      x[i] = xr[q][j];
      if (tap != nullptr) st(tap, i, xr[q][j]);
    }
  }
  if (w_next == nullptr) return;
  const float inv_n = vrow_inv_rms<H, VT, VT>(xr, eps, scratch);
#pragma unroll
  for (int q = 0; q < R::Q; ++q) {
    const int t = R::vt(q);
#pragma unroll
    for (int j = 0; j < R::PER; ++j)
      if (t >= 0) st(a, t + j * VT, __fmul_rn(__fmul_rn(xr[q][j], inv_n), __bfloat162float(bn[q][j])));
  }
}

template <int H, int THREADS, int PAIRS, int E, typename TI, typename TA, typename TT>
__device__ void ffn_tail_rows(const TI* __restrict__ mlp, const TI* __restrict__ moe, const int* __restrict__ ids,
                              float* __restrict__ x,
                              const __nv_bfloat16* __restrict__ w1, const __nv_bfloat16* __restrict__ w2,
                              const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ layer_scalar,
                              const __nv_bfloat16* __restrict__ w_next, TA* __restrict__ a, TT* __restrict__ tap,
                              int tap_stride, int tap_col, int T, float eps) {
  constexpr int K = PAIRS > 0 ? PAIRS : 1;  // MoE rows a token
  __shared__ float scratch[32];
  const float ls = __bfloat162float(layer_scalar[0]);
  for (int row = blockIdx.x; row < T; row += gridDim.x)
    ffn_tail_row<H, THREADS, PAIRS, E>(mlp + (long)row * H, moe + (long)row * K * H, ids + (long)row * PAIRS,
                                       x + (long)row * H, w1, w2, w, ls, w_next, a + (long)row * H,
                                       tap != nullptr ? tap + (long)row * tap_stride + tap_col : nullptr, eps,
                                       scratch);
}

}  // namespace thorgen
