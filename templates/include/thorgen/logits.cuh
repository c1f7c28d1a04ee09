// thorgen logits processing and logprobs, between the lm_head GEMM and the token pick.
//
// (a) logits_process: out = the processed *softcapped* logits, in vLLM's order on the float32 softcapped value c:
//     repetition (c > 0 ? c / r : c * r, tokens of prompt + output), frequency * count + presence (output tokens),
//     logit_bias, then the grammar mask (disallowed -> -inf); one float32 rounding at the end, every step in
//     float64 with no contraction (__d*_rn), so the result is float32(runtime/reference/logits.py process(c)).
//     Why softcapped outputs: processing is defined on softcapped values, and the bias (up to +-100) can leave
//     (-cap, cap), where no pre-softcap value maps to it; so the pick runs with softcap 0 over `out`
//     (lm_pick.cu.j2: the same argmax / sampler code, exact on -inf entries).
// (b) LmLogprobs: log-softmax of the softcapped logits (before processing): top TOPN ids (descending, ties ->
//     lower id) with their logprobs, and the logprob of the id the pick wrote into out_ids, all in float64.
// Host-side packing of the structs below: runtime/cuda/logits_params.py (its dtypes must keep these layouts).
#pragma once
#include <stddef.h>
#include "thorgen/sample.cuh"
#include "thorgen/sort.cuh"

namespace thorgen {

struct LogitRow {             // one row's processing, 48 bytes (runtime/cuda/logits_params.py LOGIT_ROW)
  double repetition_penalty;  // 1: off
  double frequency_penalty;
  double presence_penalty;
  int counts_offset, n_counts;  // TokenCount entries [offset, offset + n): sorted by token, distinct
  int bias_offset, n_bias;      // TokenBias entries, sorted by token, distinct
  int mask_row;                 // row of masks [*, V / 32] (bit v % 32 of word v / 32: token v allowed); -1: none
  int pad;
};
struct TokenCount {  // a token of prompt + output (repetition applies); count: its occurrences in the output
  int token;
  int count;
};
struct TokenBias {
  int token;
  int pad;
  double bias;  // already clamped to +-100 by SamplingParams
};
static_assert(sizeof(LogitRow) == 48 && offsetof(LogitRow, repetition_penalty) == 0 &&
              offsetof(LogitRow, frequency_penalty) == 8 && offsetof(LogitRow, presence_penalty) == 16 &&
              offsetof(LogitRow, counts_offset) == 24 && offsetof(LogitRow, n_counts) == 28 &&
              offsetof(LogitRow, bias_offset) == 32 && offsetof(LogitRow, n_bias) == 36 &&
              offsetof(LogitRow, mask_row) == 40, "LogitRow layout differs from runtime/cuda/logits_params.py");
static_assert(sizeof(TokenCount) == 8 && offsetof(TokenCount, token) == 0 && offsetof(TokenCount, count) == 4,
              "TokenCount layout differs from runtime/cuda/logits_params.py");
static_assert(sizeof(TokenBias) == 16 && offsetof(TokenBias, token) == 0 && offsetof(TokenBias, bias) == 8,
              "TokenBias layout differs from runtime/cuda/logits_params.py");

template <typename E>
__device__ __forceinline__ int lower_bound_token(const E* e, int n, int token) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (e[mid].token < token) lo = mid + 1; else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ bool token_allowed(const uint32_t* mask, int v) {
  return mask == nullptr || ((mask[v >> 5] >> (v & 31)) & 1u);
}

template <int THREADS>
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // scratch may still be read by a previous call
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < THREADS / 32; ++w) s += scratch[w];
  return s;
}

// ---- (a) processing: grid (V / CHUNK, rows) ----------------------------------------------------------------------
// counters: 2 zeroed u32 per row (blocks done, allowed count | bit 31 "a +inf/NaN value"), left zeroed;
// status[row] (written by the row's last block): bit 0 = no token allowed (a grammar bug: the pick then returns
// some id, never NaN), bit 1 = a processed value is +inf or NaN (e.g. a tiny repetition_penalty overflowed).
template <int V, int CHUNK, int THREADS, bool EXACT>
__device__ void logits_process(const float* __restrict__ logits, const LogitRow* __restrict__ rows,
                               const TokenCount* __restrict__ counts, const TokenBias* __restrict__ biases,
                               const uint32_t* __restrict__ masks, float* __restrict__ out,
                               unsigned int* __restrict__ counters, int32_t* __restrict__ status, int T, float cap) {
  static_assert(V % CHUNK == 0 && CHUNK % (4 * THREADS) == 0 && CHUNK % 32 == 0 && THREADS % 32 == 0,
                "CHUNK must divide V and be a multiple of 4*THREADS and of 32");
  __shared__ __align__(16) float buf[CHUNK];
  __shared__ int range[4];
  __shared__ unsigned int red[THREADS / 32];
  __shared__ bool last;
  for (int row = blockIdx.y; row < T; row += gridDim.y) {
    const LogitRow d = rows[row];
    const int lo = blockIdx.x * CHUNK;
    const uint32_t* mask = d.mask_row >= 0 ? masks + (long)d.mask_row * (V / 32) : nullptr;
    const TokenCount* cnt = counts + d.counts_offset;
    const TokenBias* bs = biases + d.bias_offset;
    const long base = (long)row * V + lo;
    for (int i = threadIdx.x * 4; i < CHUNK; i += THREADS * 4) {
      const float4 l = *reinterpret_cast<const float4*>(logits + base + i);
      const uint32_t bits = mask == nullptr ? 0xfu : mask[(lo + i) >> 5] >> ((lo + i) & 31);  // 4 | 32: one word
      *reinterpret_cast<float4*>(buf + i) = make_float4(
          (bits & 1u) ? softcap<EXACT>(l.x, cap) : -INFINITY, (bits & 2u) ? softcap<EXACT>(l.y, cap) : -INFINITY,
          (bits & 4u) ? softcap<EXACT>(l.z, cap) : -INFINITY, (bits & 8u) ? softcap<EXACT>(l.w, cap) : -INFINITY);
    }
    if (threadIdx.x == 0) {
      range[0] = lower_bound_token(cnt, d.n_counts, lo);
      range[1] = lower_bound_token(cnt, d.n_counts, lo + CHUNK);
      range[2] = lower_bound_token(bs, d.n_bias, lo);
      range[3] = lower_bound_token(bs, d.n_bias, lo + CHUNK);
    }
    __syncthreads();
    // Each token is rewritten once, from its float32 capped value, so it is rounded once: the counted tokens
    // (with their bias, if any) here, the biased tokens that are not counted below; disjoint, so no barrier.
    const double r = d.repetition_penalty, f = d.frequency_penalty, p = d.presence_penalty;
    for (int j = range[0] + threadIdx.x; j < range[1]; j += THREADS) {
      const TokenCount e = cnt[j];
      if (!token_allowed(mask, e.token)) continue;  // stays -inf: the mask comes last
      double z = (double)buf[e.token - lo];
      if (r != 1.0) z = z > 0.0 ? __ddiv_rn(z, r) : __dmul_rn(z, r);
      // count 0 (prompt only): the reference subtracts f * 0 + p * 0, which leaves every value but -0.0 as is
      if (e.count > 0) z = __dsub_rn(z, __dadd_rn(__dmul_rn(f, (double)e.count), p));
      const int b = range[2] + lower_bound_token(bs + range[2], range[3] - range[2], e.token);
      if (b < range[3] && bs[b].token == e.token) z = __dadd_rn(z, bs[b].bias);
      buf[e.token - lo] = (float)z;
    }
    for (int j = range[2] + threadIdx.x; j < range[3]; j += THREADS) {
      const TokenBias e = bs[j];
      if (!token_allowed(mask, e.token)) continue;
      const int c = range[0] + lower_bound_token(cnt + range[0], range[1] - range[0], e.token);
      if (c < range[1] && cnt[c].token == e.token) continue;  // done above
      buf[e.token - lo] = (float)__dadd_rn((double)buf[e.token - lo], e.bias);
    }
    __syncthreads();
    unsigned int ok = 0, bad = 0;
    for (int i = threadIdx.x * 4; i < CHUNK; i += THREADS * 4) {
      const float4 v = *reinterpret_cast<const float4*>(buf + i);
      *reinterpret_cast<float4*>(out + base + i) = v;
      const float w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ok += w[k] > -INFINITY;
        bad |= (isnan(w[k]) || w[k] == INFINITY) ? 1u : 0u;
      }
    }
    ok = __reduce_add_sync(0xffffffffu, ok);
    bad = __reduce_or_sync(0xffffffffu, bad);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ok | (bad << 31);  // ok <= CHUNK < 2^31
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned int total = 0, any_bad = 0;
      for (int w = 0; w < THREADS / 32; ++w) { total += red[w] & 0x7fffffffu; any_bad |= red[w] >> 31; }
      atomicAdd(&counters[2 * row + 1], total);  // <= V < 2^31: never carries into bit 31
      if (any_bad) atomicOr(&counters[2 * row + 1], 0x80000000u);
      __threadfence();
      last = atomicAdd(&counters[2 * row], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
      __threadfence();
      const unsigned int w = atomicExch(&counters[2 * row + 1], 0u);
      status[row] = ((w & 0x7fffffffu) == 0u ? 1 : 0) | ((w >> 31) ? 2 : 0);
      counters[2 * row] = 0u;
    }
    __syncthreads();
  }
}

// ---- (b) logprobs: prep grid (V / CHUNK, rows), finish grid (1, rows) ------------------------------------------
// prep: each chunk's top K keys (value, -id) and its (max, sum exp(c - max)) into the row's workspace;
// finish: the exact top TOPN of the NCH * K candidates, log Z from the merged partials, and the chosen id's logprob.
// logprob(v) = (c_v - M) - log(S), S = sum_u exp(c_u - M), M the row max: the reference's formula, float64
// (the fast arches take exp in float32 of the float64 difference: ~1e-7 relative per term).
constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

template <int V, int CHUNK, int K, int TOPN, int THREADS, bool EXACT>
struct LmLogprobs {
  static constexpr int NCH = V / CHUNK, NC = NCH * K;
  static constexpr int NCP = pow2_at_least(NC);  // the finish sort's length (zero keys pad: they sort last)
  static constexpr long OFF_CAND = 0, OFF_PART = 8L * NC, WS_ROW_BYTES = OFF_PART + 16L * NCH;
  static constexpr int SMEM_FINISH = 8 * NCP;
  static_assert(V % CHUNK == 0 && (CHUNK & (CHUNK - 1)) == 0 && (K & (K - 1)) == 0, "CHUNK, K: powers of two");
  static_assert(TOPN <= K && K <= CHUNK, "each chunk keeps K >= TOPN candidates");

  static __device__ __forceinline__ double term(double x) {
    if (EXACT) return exp(x);
    return (double)expf((float)x);
  }

  static __device__ void prep(const float* __restrict__ logits, unsigned char* __restrict__ ws, int T, float cap) {
    __shared__ unsigned long long keys[CHUNK];
    __shared__ double scratch[32];
    for (int row = blockIdx.y; row < T; row += gridDim.y) {
      const long base = (long)row * V + (long)blockIdx.x * CHUNK;
      for (int i = threadIdx.x; i < CHUNK; i += THREADS)
        keys[i] = value_index_key(softcap<EXACT>(logits[base + i], cap), (uint32_t)(blockIdx.x * CHUNK + i));
      __syncthreads();
      block_sort_desc<THREADS>(keys, CHUNK);
      const double m = (double)key_value(keys[0]);
      double s = 0.0;
      for (int i = threadIdx.x; i < CHUNK; i += THREADS) s += term((double)key_value(keys[i]) - m);
      s = block_sum_f64<THREADS>(s, scratch);
      unsigned char* w = ws + (long)row * WS_ROW_BYTES;
      unsigned long long* cand = reinterpret_cast<unsigned long long*>(w + OFF_CAND) + (long)blockIdx.x * K;
      for (int i = threadIdx.x; i < K; i += THREADS) cand[i] = keys[i];
      if (threadIdx.x == 0) {
        double* part = reinterpret_cast<double*>(w + OFF_PART) + 2L * blockIdx.x;
        part[0] = m;
        part[1] = s;
      }
      __syncthreads();
    }
  }

  static __device__ void finish(const float* __restrict__ logits, const unsigned char* __restrict__ ws,
                                const int32_t* __restrict__ out_ids, int32_t* __restrict__ top_ids,
                                double* __restrict__ top_lps, double* __restrict__ chosen_lp, int T, float cap) {
    extern __shared__ unsigned long long cands[];  // NCP
    __shared__ double logz[2];                     // M, log(S)
    for (int row = blockIdx.y; row < T; row += gridDim.y) {
      const unsigned char* w = ws + (long)row * WS_ROW_BYTES;
      const unsigned long long* cand = reinterpret_cast<const unsigned long long*>(w + OFF_CAND);
      for (int i = threadIdx.x; i < NCP; i += THREADS) cands[i] = i < NC ? cand[i] : 0ull;
      if (threadIdx.x == 0) {
        const double* part = reinterpret_cast<const double*>(w + OFF_PART);
        double m = part[0];
        for (int c = 1; c < NCH; ++c) m = fmax(m, part[2 * c]);
        double s = 0.0;
        for (int c = 0; c < NCH; ++c) s += part[2 * c + 1] * exp(part[2 * c] - m);
        logz[0] = m;
        logz[1] = log(s);
      }
      __syncthreads();
      block_sort_desc<THREADS>(cands, NCP);
      const double m = logz[0], ls = logz[1];
      for (int i = threadIdx.x; i < TOPN; i += THREADS) {
        top_ids[(long)row * TOPN + i] = (int32_t)key_index(cands[i]);
        top_lps[(long)row * TOPN + i] = ((double)key_value(cands[i]) - m) - ls;
      }
      if (threadIdx.x == 0) {
        const int id = out_ids[row];
        chosen_lp[row] = (id >= 0 && id < V)
            ? ((double)softcap<EXACT>(logits[(long)row * V + id], cap) - m) - ls : -INFINITY;  // a bad id: a bug
      }
      __syncthreads();
    }
  }
};

}  // namespace thorgen
