// thorgen bidirectional attention of one image's patches (the vision tower): every query attends every key, scale
// 1, no mask, one KV head a query head, flash-attention style: a warp owns 16 query rows and keeps its scores,
// running max / sum and output in registers (online softmax, exp2), K/V tiles of TK keys double-buffered through
// shared memory by cp.async. Only the head's first DC channels are computed (DC = head_dim rounded up to the mma's
// k16, e.g. 72 -> 80); the rows are stored with pitch DP (the padded width the GEMMs use), channels DC..DP-1 zero.
// q, k, v: bf16 [T][NH][DP] (channels past head_dim zero); out: f16 [T][NH][DP]. Grid (ceil(T / (16 WARPS)), NH).
#pragma once
#include "thorgen/attention.cuh"

namespace thorgen {

template <int DC, int TK> struct BidirSmem {
  static constexpr int PITCH = DC + 8;            // bf16 a row: +16 B puts ldmatrix's 8 rows on distinct banks
  static constexpr int TILE = TK * PITCH;         // elements of one K (or V) tile
  static constexpr int BYTES = 2 * 2 * TILE * 2;  // K and V, two stages
};

template <int NH, int DP, int DC, int WARPS, int TK>
__device__ __forceinline__ void attn_bidir(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                                           const __nv_bfloat16* __restrict__ v, __half* __restrict__ out, int T) {
  static_assert(DC % 16 == 0 && DC <= DP && DP % 8 == 0, "computed channels in k16 slices, within the pitch");
  static_assert(TK % 16 == 0 && TK <= 128, "key tiles of whole k16 slices");
  using S = BidirSmem<DC, TK>;
  constexpr int KS = DC / 16;     // k16 slices of a q / k row
  constexpr int NT = TK / 8;      // n8 score tiles a key tile
  constexpr int OT = DC / 8;      // n8 output tiles
  constexpr int CH = DC / 8;      // 16-byte chunks a row
  constexpr int ROW = NH * DP;    // elements between a patch's rows
  constexpr float LOG2E = 1.4426950408889634f;
  extern __shared__ uint4 smem_u4[];
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(smem_u4);
  __nv_bfloat16* vs = ks + 2 * S::TILE;
  pdl_launch_dependents();
  const int head = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int q0 = (blockIdx.x * WARPS + warp) * 16;
  const size_t hoff = (size_t)head * DP;
  pdl_wait();  // q, k, v come from the previous kernel

  auto load_tile = [&](int stage, int key0) {
    for (int c = threadIdx.x; c < TK * CH; c += WARPS * 32) {
      const int r = c / CH, ch = c % CH, key = key0 + r;
      const bool ok = key < T;
      const size_t src = (size_t)(ok ? key : 0) * ROW + hoff + 8 * ch;
      cp_async16_zfill(ks + stage * S::TILE + r * S::PITCH + 8 * ch, k + src, ok);
      cp_async16_zfill(vs + stage * S::TILE + r * S::PITCH + 8 * ch, v + src, ok);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  load_tile(0, 0);

  // the warp's 16 query rows as mma A fragments (rows past T: zeros, never stored)
  uint32_t qa[KS][4];
  {
    const int r0 = q0 + gid, r1 = r0 + 8;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const int c = 16 * s + 2 * t4;
      auto at = [&](int r, int col) {
        return r < T ? *reinterpret_cast<const uint32_t*>(q + (size_t)r * ROW + hoff + col) : 0u;
      };
      qa[s][0] = at(r0, c);
      qa[s][1] = at(r1, c);
      qa[s][2] = at(r0, c + 8);
      qa[s][3] = at(r1, c + 8);
    }
  }
  float o[OT][4] = {};
  float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f};  // rows gid, gid + 8 (this lane's part of the sum)

  const int tiles = (T + TK - 1) / TK;
  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) load_tile((t + 1) & 1, (t + 1) * TK);
    else asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    __syncthreads();
    const __nv_bfloat16* kt = ks + (t & 1) * S::TILE;
    const __nv_bfloat16* vt = vs + (t & 1) * S::TILE;

    float sc[NT][4] = {};
#pragma unroll
    for (int s = 0; s < KS; ++s) {
#pragma unroll
      for (int p = 0; p < NT / 2; ++p) {  // keys 16 p ..: matrix i = lane / 8 is (keys + 8 (i >> 1), k + 8 (i & 1))
        uint32_t b[4];
        const int mi = lane >> 3;
        ldsm_x4(b, kt + (16 * p + 8 * (mi >> 1) + (lane & 7)) * S::PITCH + 16 * s + 8 * (mi & 1));
        mma_bf16(sc[2 * p], qa[s][0], qa[s][1], qa[s][2], qa[s][3], b[0], b[1]);
        mma_bf16(sc[2 * p + 1], qa[s][0], qa[s][1], qa[s][2], qa[s][3], b[2], b[3]);
      }
    }
    const int valid = T - t * TK;  // keys of this tile that exist
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = 8 * n + 2 * t4 + (e & 1);
        sc[n][e] = key < valid ? sc[n][e] * LOG2E : -INFINITY;
        tmax[e >> 1] = fmaxf(tmax[e >> 1], sc[n][e]);
      }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 1));
      tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 2));
      const float m_new = fmaxf(mx[h], tmax[h]);  // finite: every tile holds at least one key
      alpha[h] = exp2f(mx[h] - m_new);
      mx[h] = m_new;
      sum[h] *= alpha[h];
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[n][e] = exp2f(sc[n][e] - mx[e >> 1]);
        sum[e >> 1] += sc[n][e];
      }
#pragma unroll
    for (int n = 0; n < OT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];

    // O += P V: P's k16 slice j is score tiles 2j, 2j + 1 as bf16 A fragments; V through ldmatrix.trans
#pragma unroll
    for (int j = 0; j < TK / 16; ++j) {
      const uint32_t a0 = MmaT<KV_BF16>::pack(sc[2 * j][0], sc[2 * j][1]);
      const uint32_t a1 = MmaT<KV_BF16>::pack(sc[2 * j][2], sc[2 * j][3]);
      const uint32_t a2 = MmaT<KV_BF16>::pack(sc[2 * j + 1][0], sc[2 * j + 1][1]);
      const uint32_t a3 = MmaT<KV_BF16>::pack(sc[2 * j + 1][2], sc[2 * j + 1][3]);
#pragma unroll
      for (int p = 0; p < OT / 2; ++p) {  // matrix i = lane / 8 is (keys + 8 (i & 1), channels + 8 (i >> 1))
        uint32_t b[4];
        const int mi = lane >> 3;
        ldsm_x4_t(b, vt + (16 * j + 8 * (mi & 1) + (lane & 7)) * S::PITCH + 16 * p + 8 * (mi >> 1));
        mma_bf16(o[2 * p], a0, a1, a2, a3, b[0], b[1]);
        mma_bf16(o[2 * p + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next tile's copies land in it
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
    const int r = q0 + gid + 8 * h;
    if (r >= T) continue;
    const float inv = 1.0f / sum[h];
    __half* dst = out + (size_t)r * ROW + hoff;
#pragma unroll
    for (int n = 0; n < OT; ++n)
      *reinterpret_cast<__half2*>(dst + 8 * n + 2 * t4) = __floats2half2_rn(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    for (int c = DC + 2 * t4; c < DP; c += 8) *reinterpret_cast<__half2*>(dst + c) = __floats2half2_rn(0.f, 0.f);
  }
}

}  // namespace thorgen
