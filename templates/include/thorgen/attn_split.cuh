// thorgen flash-decoding split merge: the NSPLIT key splits of attn_fwd write unnormalised partial O [D] and
// (max, sum) per (query, head) row into a workspace; merging part z with weight e_z = 2^(m_z - M), M = the max of
// the parts with l_z > 0, gives out = sum_z e_z O_z / sum_z e_z l_z (parts with l_z = 0 skipped, split order).
//   attn_combine: a separate kernel, one block per row (16-query steps: verify, the drafter's block).
//   merge_parts:  the same math inside attn_fwd (attn_split_count): the last split block of a (query block, KV
//                 head) group merges its rows, so decode/verify need no second launch. When a group's parts are
//                 large (> SPLIT_FLAT_BYTES, e.g. head dim 512 or 16 queries), one block reading them all would take
//                 microseconds, so the merge is two-level: the last block of each of NSUB subgroups of NSPLIT/NSUB
//                 consecutive splits merges those into a level-1 part (O, M, l unnormalised, in the workspace after
//                 the partials), and the last of those merges the level-1 parts (same formula) into out.
// Counters (u32, per group: NSUB level-1 + 1 final) start zeroed and are re-zeroed by the block that finishes them.
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

constexpr int SPLIT_FLAT_BYTES = 128 * 1024;  // a group's partials up to this size: one block merges them (one level)

// Bytes of shared scratch merge_parts needs for NZ parts of up to NROWS rows: (m, l) and the weight per (part, row),
// then (max, sum) per row.
__host__ __device__ constexpr int merge_scratch_bytes(int nz, int nrows) { return nz * nrows * 12 + nrows * 8; }

// Merge parts z0 .. z0+nz-1 of the group's nrows valid rows (block rows r: query q0 + r / G, head hkv*G + r % G).
// FINAL: fp16 out [row][D] = merged / l; else level-1 part `slot` of o_dst / ml_dst = (merged O, (M, l)).
// Parts were written by other blocks of this launch: loads go through L2 (ld.cg), after the caller's fence.
// The (m, l) pairs are staged in shared memory and each row's max and weights computed once (one thread per row,
// attn_combine's order), so the O loads of the main loop depend on nothing and stay in flight together.
template <int D, int HQ, int G, int MMAX, int THREADS, bool FINAL>
__device__ __forceinline__ void merge_parts(const float* o_src, const float* ml_src, int z0, int nz, int q0, int nrows,
                                            int hkv, float* o_dst, float* ml_dst, int slot, __half* out,
                                            uint8_t* scratch) {
  static_assert(D % 4 == 0, "head dim must be a multiple of 4");
  constexpr int C4 = D / 4;
  constexpr size_t ZS = (size_t)MMAX * HQ;  // rows per part
  float2* mls = reinterpret_cast<float2*>(scratch);          // [nz][nrows] (m, l)
  float* wts = reinterpret_cast<float*>(mls + nz * nrows);   // [nz][nrows] 2^(m - M), 0 for skipped parts
  float2* rows = reinterpret_cast<float2*>(wts + nz * nrows);  // [nrows] (M, sum of l * weight)
  auto row_of = [&](int r) { return (size_t)(q0 + r / G) * HQ + hkv * G + r % G; };
  __syncthreads();  // the scratch may still be read by a previous merge
  for (int i = threadIdx.x; i < nz * nrows; i += THREADS) {
    const int z = i / nrows, r = i % nrows;
    mls[i] = __ldcg(reinterpret_cast<const float2*>(ml_src + ((z0 + z) * ZS + row_of(r)) * 2));
  }
  __syncthreads();
  for (int r = threadIdx.x; r < nrows; r += THREADS) {
    float mx = -INFINITY;
    for (int z = 0; z < nz; ++z)
      if (mls[z * nrows + r].y > 0.f) mx = fmaxf(mx, mls[z * nrows + r].x);
    float lsum = 0.f;
    for (int z = 0; z < nz; ++z) {
      const float2 ml = mls[z * nrows + r];
      float e = 0.f;
      if (ml.y > 0.f) { e = exp2f(ml.x - mx); lsum += ml.y * e; }
      wts[z * nrows + r] = e;
    }
    rows[r] = make_float2(mx, lsum);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nrows * C4; i += THREADS) {
    const int r = i / C4, c = (i % C4) * 4;
    const size_t row = row_of(r);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int z = 0; z < nz; ++z) {
      const float4 o = __ldcg(reinterpret_cast<const float4*>(o_src + ((z0 + z) * ZS + row) * D + c));
      if (!(mls[z * nrows + r].y > 0.f)) continue;  // skipped parts add nothing (attn_combine's rule)
      const float e = wts[z * nrows + r];
      acc.x += o.x * e; acc.y += o.y * e; acc.z += o.z * e; acc.w += o.w * e;
    }
    const float lsum = rows[r].y;
    if constexpr (FINAL) {
      const __half2 lo = __floats2half2_rn(lsum > 0.f ? acc.x / lsum : 0.f, lsum > 0.f ? acc.y / lsum : 0.f);
      const __half2 hi = __floats2half2_rn(lsum > 0.f ? acc.z / lsum : 0.f, lsum > 0.f ? acc.w / lsum : 0.f);
      uint2 v;
      v.x = *reinterpret_cast<const uint32_t*>(&lo);
      v.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(out + row * D + c) = v;
    } else {
      *reinterpret_cast<float4*>(o_dst + (slot * ZS + row) * D + c) = acc;
      if (c == 0) *reinterpret_cast<float2*>(ml_dst + (slot * ZS + row) * 2) = rows[r];
    }
  }
}

// Whether a group of `nparts` parts of `nrows` rows merges in two levels: its partials exceed SPLIT_FLAT_BYTES (one
// block reading them all would take microseconds) and the kernel has level-1 subgroups. A function of the query's
// parts and rows only, so a query merges alike alone and in a batch.
template <int D, int NSUB>
__device__ __forceinline__ bool split_tree(int nparts, int nrows) {
  return NSUB > 1 && (size_t)nrows * D * nparts * 4 > (size_t)SPLIT_FLAT_BYTES;
}

// ws: [NSPLIT][MMAX][HQ][D] O, [NSPLIT][MMAX][HQ][2] (m, l), then [NSUB][MMAX][HQ][D] + [NSUB][MMAX][HQ][2] level 1.
// scratch: split_scratch_bytes(...) bytes of shared memory no longer in use.
__host__ __device__ constexpr int split_scratch_bytes(int d, int r, int nsplit, int nsub) {
  // one level: every row of a group whose partials fit SPLIT_FLAT_BYTES (or all R rows when NSUB == 1)
  const int flat = nsub == 1 ? r : (SPLIT_FLAT_BYTES / (d * 4 * nsplit) < r ? SPLIT_FLAT_BYTES / (d * 4 * nsplit) : r);
  const int level = nsplit / nsub > nsub ? nsplit / nsub : nsub;  // parts per two-level merge step (at most)
  const int a = merge_scratch_bytes(nsplit, flat), b = merge_scratch_bytes(level, r);
  return a > b ? a : b;
}

// A split attn_fwd block counts `inc` of its finished parts (their partials written) into the group of `nparts`
// parts (one level), or into level-1 subgroup `sub` (two levels: subgroups of NSPLIT / NSUB consecutive parts, the
// last one shorter when nparts < NSPLIT); the block that completes a count merges (parts in order).
template <int D, int HQ, int G, int MMAX, int THREADS, int NSPLIT, int NSUB>
__device__ __forceinline__ void attn_split_count(float* ws, unsigned int* counters, __half* out, int group, int nparts,
                                                 int sub, int inc, int q0, int nq, int hkv, int* flag,
                                                 uint8_t* scratch) {
  static_assert(NSUB >= 1 && NSPLIT % NSUB == 0, "level-1 subgroups must divide the splits");
  constexpr int S1 = NSPLIT / NSUB;
  constexpr size_t PART = (size_t)MMAX * HQ;
  const float* o_ws = ws;
  const float* ml_ws = ws + NSPLIT * PART * D;
  float* o1 = ws + NSPLIT * PART * (D + 2);
  float* ml1 = o1 + NSUB * PART * D;
  unsigned int* cnt = counters + (size_t)group * (NSUB + 1);
  const int nrows = nq * G;
  if (!split_tree<D, NSUB>(nparts, nrows)) {
    if (last_arrival(cnt + NSUB, nparts, flag, inc))
      merge_parts<D, HQ, G, MMAX, THREADS, true>(o_ws, ml_ws, 0, nparts, q0, nrows, hkv, nullptr, nullptr, 0, out,
                                                 scratch);
    return;
  }
  const int size = min(S1, nparts - sub * S1), nsubs = (nparts + S1 - 1) / S1;
  if (!last_arrival(cnt + sub, size, flag, inc)) return;
  merge_parts<D, HQ, G, MMAX, THREADS, false>(o_ws, ml_ws, sub * S1, size, q0, nrows, hkv, o1, ml1, sub, nullptr,
                                              scratch);
  if (last_arrival(cnt + NSUB, nsubs, flag))
    merge_parts<D, HQ, G, MMAX, THREADS, true>(o1, ml1, 0, nsubs, q0, nrows, hkv, nullptr, nullptr, 0, out, scratch);
}

// Merge NSPLIT partial results: one block per (query, head) row, THREADS threads over the head dim (C columns
// each). The (m, l) pairs are staged in shared memory first (a thread a part); then each thread issues the O loads of
// all its columns for up to ZB parts together, predicated on the staged l, and skips the batches of ZB parts that
// hold no part with keys (a query's parts with keys are a range of the splits). The former loop, which read l, then
// m, then O part after part, waited on L2 about 2 NSPLIT times (ncu, H200: 7.5 us a 16-query launch, 65 %
// long-scoreboard stalls). Same arithmetic, in part order.
template <int D, int HQ, int NSPLIT, int MMAX, int THREADS>
__device__ __forceinline__ void attn_combine(const float* __restrict__ ws, int m, __half* __restrict__ out) {
  constexpr int ZB = NSPLIT < 16 ? NSPLIT : 16, C = D / THREADS;
  static_assert(NSPLIT % ZB == 0 && NSPLIT / ZB <= 32, "the parts come in whole batches of ZB, a bit each");
  static_assert(D % THREADS == 0 && C <= 4, "a thread merges 1..4 whole columns");
  __shared__ float2 mls[NSPLIT];  // (m, l) of each part
  pdl_launch_dependents();
  pdl_wait();
  const int row = blockIdx.x;  // qi * HQ + head
  if (row >= m * HQ) return;
  const float* ml = ws + (size_t)NSPLIT * MMAX * HQ * D;
  for (int z = threadIdx.x; z < NSPLIT; z += THREADS)
    mls[z] = *reinterpret_cast<const float2*>(ml + ((size_t)z * MMAX * HQ + row) * 2);
  __syncthreads();
  float mx = -INFINITY;
  unsigned batches = 0;  // bit b: batch b holds a part with keys
#pragma unroll
  for (int z = 0; z < NSPLIT; ++z)
    if (mls[z].y > 0.f) {
      mx = fmaxf(mx, mls[z].x);
      batches |= 1u << (z / ZB);
    }
  float acc[C], lsum = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) acc[c] = 0.f;
  for (int z0 = 0; z0 < NSPLIT; z0 += ZB) {
    if (!(batches >> (z0 / ZB) & 1u)) continue;
    float o[ZB][C];
#pragma unroll
    for (int k = 0; k < ZB; ++k)
#pragma unroll
      for (int c = 0; c < C; ++c)
        o[k][c] = mls[z0 + k].y > 0.f ? ws[((size_t)(z0 + k) * MMAX * HQ + row) * D + threadIdx.x + c * THREADS]
                                      : 0.f;
#pragma unroll
    for (int k = 0; k < ZB; ++k) {
      const float2 p = mls[z0 + k];
      if (!(p.y > 0.f)) continue;
      const float e = exp2f(p.x - mx);
      lsum += p.y * e;
#pragma unroll
      for (int c = 0; c < C; ++c) acc[c] += o[k][c] * e;
    }
  }
#pragma unroll
  for (int c = 0; c < C; ++c)
    out[(size_t)row * D + threadIdx.x + c * THREADS] = __float2half_rn(lsum > 0.f ? acc[c] / lsum : 0.f);
}

}  // namespace thorgen
