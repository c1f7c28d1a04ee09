// thorgen attention prologue: per-head Q/K RMSNorm (weight), V RMSNorm (no weight), RoPE (rotate_half pairing
// (i, i + D/2); default or proportional: pairs >= ROT do not rotate) and the KV-cache write (bf16 or fp8 e4m3).
// One block per token (grid-stride over T), one warp per head; lane holds elements i = lane + 32*j, so the RoPE
// partner i + D/2 sits in the same lane (j + D/64). cos/sin are computed once per token in double precision
// (angles reach 2.6e5 rad) into shared memory, like the NumPy reference (float64 angle, float32 cos/sin); the
// block's first token's before griddepcontrol.wait, under the q|k|v GEMM (positions are the host's staging, final
// before a step's first kernel, as the attention's early key loads assume).
// KV lanes: the caches hold one lane per sequence, `lane_bytes` apart; token t writes lane lanes[t] (lanes null:
// lane 0), so one launch serves a prefill chunk of one sequence and a batched decode step over many alike.
// Paged caches (PAGE > 0): one pool of PAGE-position pages for all sequences; lanes[t] is the row of the page table
// (`pages`, PITCH entries a lane) that maps its position to a slot, and lane_bytes is unused.
// Inputs: token t's q heads start at q_raw + t * q_stride, its k (v) heads at k_raw (v_raw) + t * kv_stride floats,
// so the target reads the fused q|k|v GEMM's rows in place (every stride = the row width, no split copies).
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

// Cfg provides: HQ, HKV, D, ROT, SLOTS (0: linear or paged cache), PAGE, PITCH (0: not paged), HAS_Q, V_FROM_K,
// V_NORM, EPS, THREADS, types QT (queries) and KVT (cache), and `static __device__ double inv_freq(int pair)`.
template <class Cfg>
struct RopeKv {
  static constexpr int D = Cfg::D, PER = D / 32, HALF = PER / 2;
  static_assert(D % 64 == 0, "head_dim must be a multiple of 64 (RoPE partners in the same lane)");
  static_assert(Cfg::ROT >= 0 && Cfg::ROT <= D / 2, "rotating pairs must lie in 0..D/2");
  static_assert(Cfg::THREADS % 32 == 0, "block size must be a multiple of 32");
  static_assert(Cfg::PAGE == 0 || (Cfg::SLOTS == 0 && Cfg::PITCH > 0), "a paged cache is not a ring, and has a pitch");
  static constexpr int WARPS = Cfg::THREADS / 32;
  static constexpr int QH = Cfg::HAS_Q ? Cfg::HQ : 0;
  static constexpr int UNITS = QH + 2 * Cfg::HKV;  // q heads, k heads, v heads

  // normalise a head held as v[PER] across the warp (w may be null: no weight)
  static __device__ __forceinline__ void norm(float (&v)[PER], const __nv_bfloat16* w) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) ss = fmaf(v[j], v[j], ss);
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss * (1.0f / D) + Cfg::EPS);
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      v[j] *= inv;
      if (w != nullptr) v[j] *= __bfloat162float(w[lane + 32 * j]);
    }
  }

  // (the compiler contracts these into fmas alike in the rope_kv kernel and the GEMV with it folded in: the GPU test
  // test_gemv_rope_kv checks the two give the same bits. Rounding each product explicitly, as the NumPy reference
  // does, moved the tiny preset's greedy tokens: fact_004 of the prompt suite then crossed a reference gap of 0.0188
  // against TIE_TOL 0.01 at token 49, so the arithmetic stays as it was.)
  static __device__ __forceinline__ void rope(float (&v)[PER], const float* cs, const float* sn) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < HALF; ++j) {
      const int i = lane + 32 * j;
      if (i < Cfg::ROT) {
        const float c = cs[i], s = sn[i], x1 = v[j], x2 = v[j + HALF];
        v[j] = x1 * c - x2 * s;
        v[j + HALF] = x2 * c + x1 * s;
      }
    }
  }

  // cos/sin of position `pos` for the rotating pairs into shared cs / sn, by the block's threads
  static __device__ __forceinline__ void trig(int pos, float* cs, float* sn) {
    for (int i = threadIdx.x; i < Cfg::ROT; i += Cfg::THREADS) {
      double s, c;
      sincos((double)pos * Cfg::inv_freq(i), &s, &c);
      cs[i] = (float)c;
      sn[i] = (float)s;
    }
  }

  // Head unit u (q heads, then k heads, then v heads) of token t at `pos`, by one warp: load, norm, RoPE, store
  // (queries to q_out, keys and values to the caches of lane lanes[t]). cs / sn hold the position's cos/sin.
  // CG: the inputs were written by other blocks of this launch (loads through L2, never the read-only path).
  template <bool CG = false>
  static __device__ __forceinline__ void unit(int t, int u, int pos, const float* __restrict__ q_raw,
                                              const float* __restrict__ k_raw, const float* __restrict__ v_raw,
                                              const __nv_bfloat16* __restrict__ q_w,
                                              const __nv_bfloat16* __restrict__ k_w, const float* cs, const float* sn,
                                              typename Cfg::QT* __restrict__ q_out, typename Cfg::KVT* k_cache,
                                              typename Cfg::KVT* v_cache, const int32_t* __restrict__ lanes,
                                              long long lane_bytes, const int32_t* __restrict__ pages, int q_stride,
                                              int kv_stride) {
    const int lane = threadIdx.x & 31;
    const int lane_id = lanes == nullptr ? 0 : lanes[t];
    long slot = pos;
    if constexpr (Cfg::SLOTS > 0) slot = pos % Cfg::SLOTS;
    else if constexpr (Cfg::PAGE > 0) slot = page_slot<Cfg::PAGE>(pages + (size_t)lane_id * Cfg::PITCH, pos);
    const long long lane_off = Cfg::PAGE > 0 ? 0ll : (long long)lane_id * lane_bytes;
    typename Cfg::KVT* kc = reinterpret_cast<typename Cfg::KVT*>(reinterpret_cast<char*>(k_cache) + lane_off);
    typename Cfg::KVT* vc = reinterpret_cast<typename Cfg::KVT*>(reinterpret_cast<char*>(v_cache) + lane_off);
    float v[PER];
    const float* src;
    int kind, h;  // 0 q, 1 k, 2 v
    if (u < QH) { kind = 0; h = u; src = q_raw + (long)t * q_stride + h * D; }
    else if (u < QH + Cfg::HKV) { kind = 1; h = u - QH; src = k_raw + (long)t * kv_stride + h * D; }
    else { kind = 2; h = u - QH - Cfg::HKV; src = (Cfg::V_FROM_K ? k_raw : v_raw) + (long)t * kv_stride + h * D; }
#pragma unroll
    for (int j = 0; j < PER; ++j) v[j] = CG ? __ldcg(src + lane + 32 * j) : src[lane + 32 * j];
    if (kind == 2) {
      if (Cfg::V_NORM) norm(v, nullptr);
      typename Cfg::KVT* dst = vc + (slot * Cfg::HKV + h) * D;
#pragma unroll
      for (int j = 0; j < PER; ++j) st(dst, lane + 32 * j, v[j]);
      return;
    }
    norm(v, kind == 0 ? q_w : k_w);
    rope(v, cs, sn);
    if (kind == 0) {
      typename Cfg::QT* dst = q_out + ((long)t * Cfg::HQ + h) * D;
#pragma unroll
      for (int j = 0; j < PER; ++j) st(dst, lane + 32 * j, v[j]);
    } else {
      typename Cfg::KVT* dst = kc + (slot * Cfg::HKV + h) * D;
#pragma unroll
      for (int j = 0; j < PER; ++j) st(dst, lane + 32 * j, v[j]);
    }
  }

  static __device__ void run(const float* __restrict__ q_raw, const float* __restrict__ k_raw,
                             const float* __restrict__ v_raw, const __nv_bfloat16* __restrict__ q_w,
                             const __nv_bfloat16* __restrict__ k_w, const int32_t* __restrict__ positions,
                             typename Cfg::QT* __restrict__ q_out, typename Cfg::KVT* __restrict__ k_cache,
                             typename Cfg::KVT* __restrict__ v_cache, const int32_t* __restrict__ lanes,
                             long long lane_bytes, const int32_t* __restrict__ pages, int q_stride, int kv_stride,
                             int T) {
    __shared__ float cs[Cfg::ROT > 0 ? Cfg::ROT : 1], sn[Cfg::ROT > 0 ? Cfg::ROT : 1];
    const int warp = threadIdx.x >> 5;
    if (blockIdx.x < T) trig(positions[blockIdx.x], cs, sn);
    pdl_wait();  // everything below reads earlier kernels' outputs
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
      const int pos = positions[t];
      if (t != blockIdx.x) {
        __syncthreads();  // the previous token's cos/sin may still be in use
        trig(pos, cs, sn);
      }
      __syncthreads();
      for (int u = warp; u < UNITS; u += WARPS)
        unit(t, u, pos, q_raw, k_raw, v_raw, q_w, k_w, cs, sn, q_out, k_cache, v_cache, lanes, lane_bytes, pages,
             q_stride, kv_stride);
    }
  }
};

}  // namespace thorgen
