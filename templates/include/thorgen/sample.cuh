// thorgen lm_head epilogue: final-logit softcap fused with (a) argmax and (b) seeded sampling that reproduces
// runtime/reference/sampling.py: filters top-k -> top-p -> min-p on z = softcap(logits) / temperature, then
// Gumbel-max with the counter-based splitmix64 noise keyed by (seed, position, token id).
//
// Softcap: with EXACT the capped value is float(cap * tanh(double(l) / cap)) (bit-equal to the NumPy reference's
// float64 tanh rounded to float32); otherwise cap * tanhf(l / cap) (arches with slow fp64).
// Cross-block reductions use the "last block finishes" pattern on per-row counters: the runtime zeroes the
// counter buffers once at allocation and the kernels leave them zeroed (graph-replay safe).
#pragma once
#include <type_traits>
#include "thorgen/common.cuh"
#include "thorgen/sort.cuh"

namespace thorgen {

struct SampleParams {          // 40 bytes per row, in device memory so a captured graph can change them per request
  double temperature;          // <= 0: greedy
  double top_p;                // 1: off
  double min_p;                // 0: off
  unsigned long long seed;
  int top_k;                   // 0: off
  int pad;
};

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__device__ __forceinline__ unsigned long long position_key(unsigned long long seed, long long position) {
  return splitmix64(splitmix64(seed) ^ (unsigned long long)position);
}
// g_v = -log(-log(u_v)), u_v = ((h >> 41) + 0.5) * 2^-23 (float32-exact), h = splitmix64(key ^ v)
__device__ __forceinline__ double gumbel(unsigned long long key, unsigned int v) {
  const unsigned long long h = splitmix64(key ^ (unsigned long long)v);
  const float u = ((float)(unsigned int)(h >> 41) + 0.5f) * 1.1920928955078125e-07f;
  return -log(-log((double)u));
}

template <bool EXACT>
__device__ __forceinline__ float softcap(float l, float cap) {
  if (cap <= 0.f) return l;
  if (EXACT) return (float)((double)cap * tanh((double)l / (double)cap));
  return cap * tanhf(l / cap);
}

// ---- (a) softcap + argmax -------------------------------------------------------------------------------------
// grid (V / CHUNK, rows): block max of (capped value, -index) keys, atomicMax into best[row]; the last block of a
// row writes out_ids[row] and re-zeroes best[row] / counters[row]. capped (optional) receives the softcapped logits.
template <int V, int CHUNK, int THREADS, bool EXACT>
__device__ void softcap_argmax(const float* __restrict__ logits, float* __restrict__ capped,
                               unsigned long long* __restrict__ best, unsigned int* __restrict__ counters,
                               int32_t* __restrict__ out_ids, int T, float cap) {
  static_assert(V % CHUNK == 0 && CHUNK % (4 * THREADS) == 0, "CHUNK must divide V and be a multiple of 4*THREADS");
  __shared__ unsigned long long scratch[32];
  __shared__ bool last;
  for (int row = blockIdx.y; row < T; row += gridDim.y) {
    const long base = (long)row * V + (long)blockIdx.x * CHUNK;
    unsigned long long key = 0ull;
    for (int i = threadIdx.x * 4; i < CHUNK; i += THREADS * 4) {
      float4 l = *reinterpret_cast<const float4*>(logits + base + i);
      float c[4] = {softcap<EXACT>(l.x, cap), softcap<EXACT>(l.y, cap), softcap<EXACT>(l.z, cap), softcap<EXACT>(l.w, cap)};
      if (capped != nullptr) *reinterpret_cast<float4*>(capped + base + i) = make_float4(c[0], c[1], c[2], c[3]);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const unsigned long long kk = value_index_key(c[k], (uint32_t)(blockIdx.x * CHUNK + i + k));
        key = kk > key ? kk : key;
      }
    }
    key = block_max_u64<THREADS>(key, scratch);
    if (threadIdx.x == 0) {
      atomicMax(&best[row], key);
      __threadfence();
      last = atomicAdd(&counters[row], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
      __threadfence();
      const unsigned long long b = atomicExch(&best[row], 0ull);
      out_ids[row] = (int32_t)key_index(b);
      counters[row] = 0u;
    }
    __syncthreads();
  }
}

// ---- (b) seeded sampling -------------------------------------------------------------------------------------
// Three launches over a per-row workspace (WS_ROW_BYTES each):
//   prep   grid (NCH, rows): each chunk's top-C keys (bitonic sort in shared memory) + online-softmax (max, sum)
//   select grid (1, rows)  : exact global top-C from the NCH*C candidates; applies top-k/top-p/min-p; when the kept
//                            set lies within the top C it samples right there (Gumbel-max over <= C tokens)
//   finish grid (NCH, rows): otherwise (no filter binds, or only min-p) Gumbel-max over the whole vocabulary
// Exact w.r.t. the reference whenever top_k <= C, or the top-p / min-p cut falls within the top C, or no filter
// binds. Otherwise (top_k > C or a nucleus wider than C tokens) the top C tokens are sampled and status[row] = 1.
template <int V, int CHUNK, int C, int THREADS, bool EXACT>
struct LmSample {
  static constexpr int NCH = V / CHUNK, NC = NCH * C;
  static_assert(V % CHUNK == 0, "CHUNK must divide V");
  static_assert((CHUNK & (CHUNK - 1)) == 0 && (NC & (NC - 1)) == 0, "CHUNK and NCH*C must be powers of two");
  static_assert(C <= CHUNK && C <= 1024, "C candidates per chunk must fit the chunk");
  using R = typename std::conditional<EXACT, double, float>::type;
  // workspace row layout (bytes)
  static constexpr long OFF_CAND = 0;                       // u64 [NC]
  static constexpr long OFF_PART = OFF_CAND + 8L * NC;      // R (max, sum) [NCH] as double pairs
  static constexpr long OFF_PSCORE = OFF_PART + 16L * NCH;  // double [NCH]
  static constexpr long OFF_PIDX = OFF_PSCORE + 8L * NCH;   // int [NCH]
  static constexpr long OFF_MODE = (OFF_PIDX + 4L * NCH + 15) / 16 * 16;  // int mode, pad, double z0, min_p
  static constexpr long WS_ROW_BYTES = (OFF_MODE + 32 + 15) / 16 * 16;

  static __device__ __forceinline__ void merge(double& m, double& s, double m2, double s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    const double mm = fmax(m, m2);
    s = s * exp(m - mm) + s2 * exp(m2 - mm);
    m = mm;
  }

  static __device__ void prep(const float* __restrict__ logits, const SampleParams* __restrict__ sp,
                              unsigned char* __restrict__ ws, int T, float cap) {
    __shared__ unsigned long long keys[CHUNK];
    __shared__ double red_m[32], red_s[32];
    for (int row = blockIdx.y; row < T; row += gridDim.y) {
      const double temp = sp[row].temperature;  // per row: a batched step samples each sequence its own way
      const long base = (long)row * V + (long)blockIdx.x * CHUNK;
      double m = -INFINITY, s = 0.0;
      for (int i = threadIdx.x; i < CHUNK; i += THREADS) {
        const float c = softcap<EXACT>(logits[base + i], cap);
        keys[i] = value_index_key(c, (uint32_t)(blockIdx.x * CHUNK + i));
        if (temp > 0.0) merge(m, s, (double)(R)((R)c / (R)temp), 1.0);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const double m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        merge(m, s, m2, s2);
      }
      if ((threadIdx.x & 31) == 0) { red_m[threadIdx.x >> 5] = m; red_s[threadIdx.x >> 5] = s; }
      __syncthreads();
      block_sort_desc<THREADS>(keys, CHUNK);
      unsigned char* w = ws + (long)row * WS_ROW_BYTES;
      unsigned long long* cand = reinterpret_cast<unsigned long long*>(w + OFF_CAND) + (long)blockIdx.x * C;
      for (int i = threadIdx.x; i < C; i += THREADS) cand[i] = keys[i];
      if (threadIdx.x == 0) {
        double bm = -INFINITY, bs = 0.0;
        for (int k = 0; k < THREADS / 32; ++k) merge(bm, bs, red_m[k], red_s[k]);
        double* part = reinterpret_cast<double*>(w + OFF_PART) + 2L * blockIdx.x;
        part[0] = bm;
        part[1] = bs;
      }
      __syncthreads();
    }
  }

  static __device__ void select(const SampleParams* __restrict__ sp, const int32_t* __restrict__ positions,
                                unsigned char* __restrict__ ws, int32_t* __restrict__ out_ids,
                                int32_t* __restrict__ status, int T) {
    extern __shared__ unsigned long long keys[];  // NC
    for (int row = blockIdx.y; row < T; row += gridDim.y) {
      unsigned char* w = ws + (long)row * WS_ROW_BYTES;
      const unsigned long long* cand = reinterpret_cast<const unsigned long long*>(w + OFF_CAND);
      for (int i = threadIdx.x; i < NC; i += THREADS) keys[i] = cand[i];
      __syncthreads();
      block_sort_desc<THREADS>(keys, NC);
      if (threadIdx.x == 0) {
        const double temp = sp[row].temperature, top_p = sp[row].top_p, min_p = sp[row].min_p;
        const int top_k = sp[row].top_k;
        int* mode = reinterpret_cast<int*>(w + OFF_MODE);
        double* z0p = reinterpret_cast<double*>(w + OFF_MODE + 8);
        int st = 0;
        if (!(temp > 0.0)) {  // greedy: the first key is the argmax (ties -> lower id)
          out_ids[row] = (int32_t)key_index(keys[0]);
          *mode = 0;
        } else {
          const long n_k = (top_k > 0 && top_k < V) ? top_k : V;
          const int known = (int)(n_k < C ? n_k : C);
          double z[C];
          for (int i = 0; i < known; ++i) z[i] = (double)key_value(keys[i]) / temp;
          long L = n_k;        // kept count (may exceed C)
          bool open = false;   // the kept set extends past the top C candidates
          if (top_p < 1.0 || min_p > 0.0) {
            double den = 0.0;
            if (n_k <= C) {
              for (int i = 0; i < known; ++i) den += exp(z[i] - z[0]);
            } else {
              double m = -INFINITY, s = 0.0;
              const double* part = reinterpret_cast<const double*>(w + OFF_PART);
              for (int c = 0; c < NCH; ++c) merge(m, s, part[2 * c], part[2 * c + 1]);
              den = s * exp(m - z[0]);
              if (n_k < V && top_p < 1.0) st = 1;  // top_k in (C, V): the top-p denominator is not known exactly
            }
            double p[C];
            int Lk = known;
            if (top_p < 1.0) {
              double cum = 0.0;
              Lk = 0;
              for (int i = 0; i < known; ++i) {
                p[i] = exp(z[i] - z[0]) / den;
                cum += p[i];
                if (i == 0 || cum - p[i] < top_p) Lk = i + 1; else break;
              }
              open = (Lk == known) && (n_k > known);
              double ps = 0.0;
              for (int i = 0; i < Lk; ++i) ps += p[i];
              for (int i = 0; i < Lk; ++i) p[i] /= ps;
            } else {
              open = n_k > known;
            }
            L = open ? n_k : Lk;
            if (min_p > 0.0) {
              int Lm = 0;
              const int lim = (int)(L < known ? L : known);
              for (int i = 0; i < lim; ++i) {
                if (exp(z[i] - z[0]) >= min_p) Lm = i + 1; else break;
              }
              if (Lm < lim) { L = Lm; open = false; }
            }
          } else {
            open = n_k > known;
          }
          if (!open) {
            const unsigned long long key = position_key(sp[row].seed, positions[row]);
            double best = -INFINITY;
            int bi = (int)key_index(keys[0]);
            for (int i = 0; i < (int)L; ++i) {
              const unsigned int v = key_index(keys[i]);
              const double sc = z[i] + gumbel(key, v);
              if (sc > best || (sc == best && (int)v < bi)) { best = sc; bi = (int)v; }
            }
            out_ids[row] = bi;
            *mode = 0;
          } else if (n_k == V && top_p >= 1.0) {
            *mode = 1;  // Gumbel-max over the whole vocabulary (min-p as a value filter)
            z0p[0] = z[0];
            z0p[1] = min_p;
          } else {
            st = 1;  // approximate: sample within the top C
            const unsigned long long key = position_key(sp[row].seed, positions[row]);
            double best = -INFINITY;
            int bi = (int)key_index(keys[0]);
            for (int i = 0; i < known; ++i) {
              const unsigned int v = key_index(keys[i]);
              const double sc = z[i] + gumbel(key, v);
              if (sc > best || (sc == best && (int)v < bi)) { best = sc; bi = (int)v; }
            }
            out_ids[row] = bi;
            *mode = 0;
          }
        }
        status[row] = st;
      }
      __syncthreads();
    }
  }

  static __device__ void finish(const float* __restrict__ logits, const SampleParams* __restrict__ sp,
                                const int32_t* __restrict__ positions, unsigned char* __restrict__ ws,
                                unsigned int* __restrict__ counters, int32_t* __restrict__ out_ids, int T, float cap) {
    __shared__ double red_s[32];
    __shared__ int red_i[32];
    __shared__ bool last;
    for (int row = blockIdx.y; row < T; row += gridDim.y) {
      unsigned char* w = ws + (long)row * WS_ROW_BYTES;
      if (*reinterpret_cast<const int*>(w + OFF_MODE) == 0) continue;  // uniform over the block
      const double z0 = reinterpret_cast<const double*>(w + OFF_MODE + 8)[0];
      const double min_p = reinterpret_cast<const double*>(w + OFF_MODE + 8)[1];
      const double temp = sp[row].temperature;
      const unsigned long long key = position_key(sp[row].seed, positions[row]);
      const long base = (long)row * V + (long)blockIdx.x * CHUNK;
      double best = -INFINITY;
      int bi = 0x7fffffff;
      for (int i = threadIdx.x; i < CHUNK; i += THREADS) {
        const unsigned int v = blockIdx.x * CHUNK + i;
        const double z = (double)softcap<EXACT>(logits[base + i], cap) / temp;
        if (min_p > 0.0 && !(exp(z - z0) >= min_p)) continue;
        const double sc = z + gumbel(key, v);
        if (sc > best || (sc == best && (int)v < bi)) { best = sc; bi = (int)v; }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const double s2 = __shfl_xor_sync(0xffffffffu, best, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        if (s2 > best || (s2 == best && i2 < bi)) { best = s2; bi = i2; }
      }
      if ((threadIdx.x & 31) == 0) { red_s[threadIdx.x >> 5] = best; red_i[threadIdx.x >> 5] = bi; }
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int k = 1; k < THREADS / 32; ++k)
          if (red_s[k] > best || (red_s[k] == best && red_i[k] < bi)) { best = red_s[k]; bi = red_i[k]; }
        // (lane 0 of warp 0 already holds warp 0's result in best/bi)
        reinterpret_cast<double*>(w + OFF_PSCORE)[blockIdx.x] = best;
        reinterpret_cast<int*>(w + OFF_PIDX)[blockIdx.x] = bi;
        __threadfence();
        last = atomicAdd(&counters[row], 1u) == gridDim.x - 1;
      }
      __syncthreads();
      if (last && threadIdx.x == 0) {
        __threadfence();
        const volatile double* ps = reinterpret_cast<const volatile double*>(w + OFF_PSCORE);
        const volatile int* pi = reinterpret_cast<const volatile int*>(w + OFF_PIDX);
        double b = -INFINITY;
        int id = 0x7fffffff;
        for (int c = 0; c < NCH; ++c)
          if (ps[c] > b || (ps[c] == b && pi[c] < id)) { b = ps[c]; id = pi[c]; }
        out_ids[row] = id;
        counters[row] = 0u;
      }
      __syncthreads();
    }
  }
};

}  // namespace thorgen
