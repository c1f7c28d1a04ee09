// thorgen attention prologue: per-head Q/K RMSNorm (weight), V RMSNorm (no weight), RoPE (rotate_half pairing
// (i, i + D/2); default or proportional: pairs >= ROT do not rotate) and the KV-cache write (bf16 or fp8 e4m3).
// One block per token (grid-stride over T), one warp per head; lane holds elements i = lane + 32*j, so the RoPE
// partner i + D/2 sits in the same lane (j + D/64). cos/sin are computed once per token in double precision
// (angles reach 2.6e5 rad) into shared memory, like the NumPy reference (float64 angle, float32 cos/sin).
// KV lanes: the caches hold one lane per sequence, `lane_bytes` apart; token t writes lane lanes[t] (lanes null:
// lane 0), so one launch serves a prefill chunk of one sequence and a batched decode step over many alike.
// Paged caches (PAGE > 0): one pool of PAGE-position pages for all sequences; lanes[t] is the row of the page table
// (`pages`, PITCH entries a lane) that maps its position to a slot, and lane_bytes is unused.
// Inputs: token t's q heads start at q_raw + t * q_stride, its k (v) heads at k_raw (v_raw) + t * kv_stride floats,
// so the target reads the fused q|k|v GEMM's rows in place (every stride = the row width, no split copies).
// The one-row q|k|v GEMV folds this in (rope_kv_last_block): a head's last block runs the same per-unit code, whose
// products and sums are rounded explicitly (__fmul_rn / __fmaf_rn: no contraction left to the compiler), so the
// fold and this kernel give the same bits.
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
  static constexpr int CS = Cfg::ROT > 0 ? Cfg::ROT : 1;  // shared cos / sin entries
  using QT = typename Cfg::QT;
  using KVT = typename Cfg::KVT;

  // normalise a head held as v[PER] across the warp (w may be null: no weight)
  static __device__ __forceinline__ void norm(float (&v)[PER], const __nv_bfloat16* w) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < PER; ++j) ss = __fmaf_rn(v[j], v[j], ss);
    ss = warp_sum(ss);
    const float inv = rsqrtf(__fmaf_rn(ss, 1.0f / D, Cfg::EPS));
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      v[j] = __fmul_rn(v[j], inv);
      if (w != nullptr) v[j] = __fmul_rn(v[j], __bfloat162float(w[lane + 32 * j]));
    }
  }

  static __device__ __forceinline__ void rope(float (&v)[PER], const float* cs, const float* sn) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < HALF; ++j) {
      const int i = lane + 32 * j;
      if (i < Cfg::ROT) {
        const float c = cs[i], s = sn[i], x1 = v[j], x2 = v[j + HALF];
        v[j] = __fmaf_rn(x1, c, -__fmul_rn(x2, s));  // x1 c - x2 s
        v[j + HALF] = __fmaf_rn(x2, c, __fmul_rn(x1, s));  // x2 c + x1 s
      }
    }
  }

  // cos / sin of position pos for the rotating pairs into shared cs, sn, by the block's `threads` threads
  static __device__ __forceinline__ void cos_sin(int pos, float* cs, float* sn, int threads) {
    for (int i = threadIdx.x; i < Cfg::ROT; i += threads) {
      double s, c;
      sincos(__dmul_rn((double)pos, Cfg::inv_freq(i)), &s, &c);
      cs[i] = (float)c;
      sn[i] = (float)s;
    }
  }

  // A token's [HKV][D] rows of the K and V caches: its position's slot (ring, page table or linear) in its lane.
  struct KvRows {
    KVT* k;
    KVT* v;
  };
  static __device__ __forceinline__ KvRows kv_rows(KVT* k_cache, KVT* v_cache, int pos, int lane_id,
                                                   long long lane_bytes, const int32_t* pages) {
    long slot = pos;
    if constexpr (Cfg::SLOTS > 0) slot = pos % Cfg::SLOTS;
    else if constexpr (Cfg::PAGE > 0) slot = page_slot<Cfg::PAGE>(pages + (size_t)lane_id * Cfg::PITCH, pos);
    const long long off = (Cfg::PAGE > 0 ? 0ll : (long long)lane_id * lane_bytes) +
                          (long long)slot * Cfg::HKV * D * (long long)sizeof(KVT);
    return {reinterpret_cast<KVT*>(reinterpret_cast<char*>(k_cache) + off),
            reinterpret_cast<KVT*>(reinterpret_cast<char*>(v_cache) + off)};
  }

  // Unit u of one token (q head u < QH, then k heads, then v heads) by the calling warp: load its D inputs (q_in,
  // k_in, v_in: the token's q, k and v heads; CG: written by other blocks of this launch, so loaded through L2),
  // norm, RoPE (q, k), store into q_dst (the token's q heads) or the cache rows.
  template <bool CG>
  static __device__ __forceinline__ void unit(int u, const float* q_in, const float* k_in, const float* v_in,
                                              const __nv_bfloat16* q_w, const __nv_bfloat16* k_w, const float* cs,
                                              const float* sn, QT* q_dst, KvRows kv) {
    const int lane = threadIdx.x & 31;
    const int kind = u < QH ? 0 : u < QH + Cfg::HKV ? 1 : 2;  // 0 q, 1 k, 2 v
    const int h = kind == 0 ? u : kind == 1 ? u - QH : u - QH - Cfg::HKV;
    const float* src = (kind == 0 ? q_in : kind == 1 ? k_in : v_in) + h * D;
    float v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) v[j] = CG ? __ldcg(src + lane + 32 * j) : __ldg(src + lane + 32 * j);
    if (kind == 2) {
      if (Cfg::V_NORM) norm(v, nullptr);
#pragma unroll
      for (int j = 0; j < PER; ++j) st(kv.v + h * D, lane + 32 * j, v[j]);
      return;
    }
    norm(v, kind == 0 ? q_w : k_w);
    rope(v, cs, sn);
    if (kind == 0) {
#pragma unroll
      for (int j = 0; j < PER; ++j) st(q_dst + h * D, lane + 32 * j, v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < PER; ++j) st(kv.k + h * D, lane + 32 * j, v[j]);
    }
  }

  static __device__ void run(const float* __restrict__ q_raw, const float* __restrict__ k_raw,
                             const float* __restrict__ v_raw, const __nv_bfloat16* __restrict__ q_w,
                             const __nv_bfloat16* __restrict__ k_w, const int32_t* __restrict__ positions,
                             QT* __restrict__ q_out, KVT* __restrict__ k_cache, KVT* __restrict__ v_cache,
                             const int32_t* __restrict__ lanes, long long lane_bytes, const int32_t* __restrict__ pages,
                             int q_stride, int kv_stride, int T) {
    __shared__ float cs[CS], sn[CS];
    const int warp = threadIdx.x >> 5;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
      const int pos = positions[t];
      __syncthreads();  // the previous token's cos/sin may still be in use
      cos_sin(pos, cs, sn, Cfg::THREADS);
      __syncthreads();
      const KvRows kv = kv_rows(k_cache, v_cache, pos, lanes == nullptr ? 0 : lanes[t], lane_bytes, pages);
      const float* k_in = k_raw + (long)t * kv_stride;
      const float* v_in = Cfg::V_FROM_K ? k_in : v_raw + (long)t * kv_stride;
      for (int u = warp; u < UNITS; u += WARPS)
        unit<false>(u, q_raw + (long)t * q_stride, k_in, v_in, q_w, k_w, cs, sn, q_out + (long)t * Cfg::HQ * D, kv);
    }
  }
};

// rope_kv folded into the one-row q|k|v GEMV (nvfp4_gemm.cu.j2, epilogue rope_kv; Cfg::THREADS: its block, one per
// 16 values of the row): every block stored its values of `row` (q heads, k heads, then v heads unless V_FROM_K); the
// block that arrives last at its head's counter (counters[head]: zero at entry, left zeroed) runs that head's units
// (the head itself; with V_FROM_K a k head also feeds its v) with the kernel's per-unit code, one warp a unit.
template <class Cfg>
__device__ __forceinline__ void rope_kv_last_block(const float* row, const __nv_bfloat16* __restrict__ q_w,
                                                   const __nv_bfloat16* __restrict__ k_w,
                                                   const int32_t* __restrict__ positions, typename Cfg::QT* q_out,
                                                   typename Cfg::KVT* k_cache, typename Cfg::KVT* v_cache,
                                                   const int32_t* __restrict__ lanes, long long lane_bytes,
                                                   const int32_t* __restrict__ pages, unsigned int* counters) {
  using K = RopeKv<Cfg>;
  static_assert(Cfg::HAS_Q, "the fold serves the target's q|k|v row");
  constexpr int UPH = Cfg::D / 16, HQ = Cfg::HQ, HKV = Cfg::HKV;  // GEMV blocks a head
  __shared__ float cs[K::CS], sn[K::CS];
  __shared__ int flag;
  const int head = blockIdx.x / UPH;  // its head in the row (as unit index: q, k, then v heads)
  if (!last_arrival(counters + head, UPH, &flag)) return;
  const int pos = positions[0];
  if (head < HQ + HKV) {  // q or k: rotates (the v heads of a v_proj row do not)
    K::cos_sin(pos, cs, sn, Cfg::THREADS);
    __syncthreads();
  }
  const float* k_in = row + HQ * Cfg::D;
  const float* v_in = Cfg::V_FROM_K ? k_in : row + (HQ + HKV) * Cfg::D;
  const typename K::KvRows kv = K::kv_rows(k_cache, v_cache, pos, lanes == nullptr ? 0 : lanes[0], lane_bytes, pages);
  const int units = Cfg::V_FROM_K && head >= HQ ? 2 : 1;  // k head u feeds v unit u + HKV too
  for (int i = threadIdx.x >> 5; i < units; i += K::WARPS)
    K::template unit<true>(head + i * HKV, row, k_in, v_in, q_w, k_w, cs, sn, q_out, kv);
}

}  // namespace thorgen
