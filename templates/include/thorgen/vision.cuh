// thorgen vision tower row kernels (Gemma-4 ViT, fp32 math): the patch input (2p - 1), the x/y position-table add
// with the first norm, per-head q/k RMSNorm with 2-D RoPE and the weightless v norm into zero-padded heads, the
// sandwich norms, and the 3x3 pool / x sqrt(H) / standardize / weightless RMSNorm tail. Widths need not divide the
// block: element i = tid + j*THREADS for j < PER, masked past H. GEMM inputs are written with a row pitch HP >= H
// (HP a multiple of 64 for the GEMM tiles), columns H..HP-1 zero, so the zero-padded weights keep the GEMMs exact.
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

template <int H, int THREADS>
struct VisRow {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, at most 1024");
  static constexpr int PER = (H + THREADS - 1) / THREADS;
  static __device__ __forceinline__ bool has(int j) { return threadIdx.x + j * THREADS < H; }
  static __device__ __forceinline__ int at(int j) { return threadIdx.x + j * THREADS; }
};

// 1 / sqrt(mean(v^2) + eps) over the row's H elements
template <int H, int THREADS>
__device__ __forceinline__ float vis_inv_rms(const float (&v)[VisRow<H, THREADS>::PER], float eps, float* scratch) {
  using R = VisRow<H, THREADS>;
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < R::PER; ++j)
    if (R::has(j)) ss = fmaf(v[j], v[j], ss);
  ss = block_sum<THREADS>(ss, scratch);
  return rsqrtf(ss * (1.0f / H) + eps);
}

// a[row][0..HP) = (v * inv [* w]) as f16, zeros past H
template <int H, int HP, int THREADS>
__device__ __forceinline__ void vis_store_act(__half* a, const float (&v)[VisRow<H, THREADS>::PER], float inv,
                                              const __nv_bfloat16* w) {
  using R = VisRow<H, THREADS>;
#pragma unroll
  for (int j = 0; j < R::PER; ++j)
    if (R::has(j)) a[R::at(j)] = __float2half_rn(w ? v[j] * inv * __bfloat162float(w[R::at(j)]) : v[j] * inv);
  for (int i = H + threadIdx.x; i < HP; i += THREADS) a[i] = __float2half_rn(0.f);
}

// out[t][i] = 2 * (v / 255 - 0.5) as f16 from uint8 pixels v (the model's input scaling of [0, 1] pixels). v / 255 is
// v * (1 / 255) in double rounded once to float, as the HF processor's float64 rescale gives it: the host uploads the
// uint8 patches (a quarter of the bytes) and does no per-pixel work.
template <int PD, int THREADS>
__device__ void vis_patch_prep_rows(const unsigned char* __restrict__ p, __half* __restrict__ out, int T) {
  for (int row = blockIdx.x; row < T; row += gridDim.x)
    for (int i = threadIdx.x; i < PD; i += THREADS) {
      const float unit = __double2float_rn(static_cast<double>(p[(long)row * PD + i]) * (1.0 / 255.0));
      out[(long)row * PD + i] = __float2half_rn(2.f * (unit - 0.5f));
    }
}

// x[t] += table[0][pos[t].x] + table[1][pos[t].y];  a[t] = rmsnorm(x[t]) * w  (f16, pitch HP)
template <int H, int HP, int P, int THREADS>
__device__ void vis_embed_norm_rows(float* __restrict__ x, const __nv_bfloat16* __restrict__ table,
                                    const int* __restrict__ pos, const __nv_bfloat16* __restrict__ w,
                                    __half* __restrict__ a, int T, float eps) {
  using R = VisRow<H, THREADS>;
  __shared__ float scratch[32];
  for (int row = blockIdx.x; row < T; row += gridDim.x) {
    const long px = pos[2 * row], py = pos[2 * row + 1];
    float v[R::PER];
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      if (!R::has(j)) { v[j] = 0.f; continue; }
      const int i = R::at(j);
      const float pe = __bfloat162float(table[px * H + i]) + __bfloat162float(table[((long)P + py) * H + i]);
      v[j] = x[(long)row * H + i] + pe;
      x[(long)row * H + i] = v[j];
    }
    vis_store_act<H, HP, THREADS>(a + (long)row * HP, v, vis_inv_rms<H, THREADS>(v, eps, scratch), w);
  }
}

// x[t] += rmsnorm(y[t]) * w_post;  then, given w_next, a[t] = rmsnorm(x[t]) * w_next (f16, pitch HP)
template <int H, int HP, int THREADS>
__device__ void vis_sandwich_rows(float* __restrict__ x, const float* __restrict__ y,
                                  const __nv_bfloat16* __restrict__ w_post, const __nv_bfloat16* __restrict__ w_next,
                                  __half* __restrict__ a, int T, float eps) {
  using R = VisRow<H, THREADS>;
  __shared__ float scratch[32];
  for (int row = blockIdx.x; row < T; row += gridDim.x) {
    float v[R::PER], d[R::PER];
#pragma unroll
    for (int j = 0; j < R::PER; ++j) d[j] = R::has(j) ? y[(long)row * H + R::at(j)] : 0.f;
    const float inv = vis_inv_rms<H, THREADS>(d, eps, scratch);
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      if (!R::has(j)) { v[j] = 0.f; continue; }
      v[j] = x[(long)row * H + R::at(j)] + d[j] * inv * __bfloat162float(w_post[R::at(j)]);
      x[(long)row * H + R::at(j)] = v[j];
    }
    if (w_next != nullptr)
      vis_store_act<H, HP, THREADS>(a + (long)row * HP, v, vis_inv_rms<H, THREADS>(v, eps, scratch), w_next);
  }
}

// One token's q|k|v row (f32 [3][NH][D]) -> q, k, v bf16 [NH][DP] (zeros past D): q and k RMSNorm'd with their
// weights then rotated by 2-D RoPE (channels [0, D/2) by the patch x, [D/2, D) by y; in each half rotate_half pairs
// (i, i + D/4) at inv_freq[i mod D/4]), v RMSNorm'd without a weight. A warp per head; cos/sin once per token
// into shared memory (angles in double precision, as the NumPy reference computes them).
template <int NH, int D, int DP>
__device__ void vis_qkv_rope_rows(const float* __restrict__ qkv, const __nv_bfloat16* __restrict__ qw,
                                  const __nv_bfloat16* __restrict__ kw, const int* __restrict__ pos,
                                  __nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
                                  __nv_bfloat16* __restrict__ v, int T, float eps, const double* inv_freq) {
  static_assert(D % 4 == 0 && DP >= D, "head dim: two rotate-half halves, padded to DP");
  constexpr int Q4 = D / 4, PER = (D + 31) / 32;
  __shared__ float cs[2][Q4], sn[2][Q4];
  __shared__ float buf[NH][D];
  const int lane = threadIdx.x & 31, h = threadIdx.x >> 5;
  for (int row = blockIdx.x; row < T; row += gridDim.x) {
    __syncthreads();  // the previous row's cos/sin are no longer read
    for (int i = threadIdx.x; i < 2 * Q4; i += blockDim.x) {
      // the angle in double, reduced to [-pi, pi] there; then the fast float sine (abs error ~4e-7 on that range,
      // far below the bf16 store; the double sincos's slow path cost a stack frame and spills)
      const double ang = (double)pos[2 * row + i / Q4] * inv_freq[i % Q4];
      const float r = (float)(ang - rint(ang * 0.15915494309189535) * 6.283185307179586);
      float s, c;
      __sincosf(r, &s, &c);
      cs[i / Q4][i % Q4] = c;
      sn[i / Q4][i % Q4] = s;
    }
    __syncthreads();
#pragma unroll
    for (int part = 0; part < 3; ++part) {
      const float* src = qkv + ((long)row * 3 + part) * NH * D + h * D;
      const __nv_bfloat16* w = part == 0 ? qw : part == 1 ? kw : nullptr;
      __nv_bfloat16* dst = (part == 0 ? q : part == 1 ? k : v) + ((long)row * NH + h) * DP;
      float x[PER], ss = 0.f;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int c = lane + 32 * j;
        x[j] = c < D ? src[c] : 0.f;
        ss = fmaf(x[j], x[j], ss);
      }
      const float inv = rsqrtf(warp_sum(ss) * (1.0f / D) + eps);
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int c = lane + 32 * j;
        if (c < D) buf[h][c] = x[j] * inv * (w ? __bfloat162float(w[c]) : 1.f);
      }
      __syncwarp();
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int c = lane + 32 * j;
        if (c >= D) continue;
        float o = buf[h][c];
        if (part < 2) {
          const int half = c / (2 * Q4), i = c % (2 * Q4), f = i % Q4;
          const float co = cs[half][f], si = sn[half][f];
          o = i < Q4 ? o * co - buf[h][c + Q4] * si : o * co + buf[h][c - Q4] * si;
        }
        dst[c] = __float2bfloat16_rn(o);
      }
      for (int c = D + lane; c < DP; c += 32) dst[c] = __float2bfloat16_rn(0.f);
      __syncwarp();  // buf is reused by the next part
    }
  }
}

// Pooled row n of T, over images of TI pooled rows back to back (each image's L = POOL^2 * TI patches row-major
// over one grid gw wide, gw = the first image's last patch's x + 1): the mean of its POOL x POOL patches, x sqrt(H), (s - std_bias) * std_scale, weightless RMSNorm -> f16 (pitch HP).
// All in fp32: the scaled values reach ~1e5 (fp16 overflows).
template <int H, int HP, int POOL, int THREADS>
__device__ void vis_pool_rows(const float* __restrict__ x, const int* __restrict__ pos,
                              const float* __restrict__ std_bias, const float* __restrict__ std_scale,
                              __half* __restrict__ out, int T, int TI, float eps, float root_h) {
  using R = VisRow<H, THREADS>;
  __shared__ float scratch[32];
  const long L = (long)TI * POOL * POOL;  // an image's patches
  const int gw = pos[2 * (L - 1)] + 1, pw = gw / POOL;  // the images of one encode share one grid (the first's)
  const long gh = L / gw;                               // an image's patch rows
  for (int n = blockIdx.x; n < T; n += gridDim.x) {
    const int image = n / TI, m = n - image * TI;
    const long y0 = (long)(m / pw) * POOL + image * gh, x0 = (long)(m % pw) * POOL;
    float v[R::PER];
#pragma unroll
    for (int j = 0; j < R::PER; ++j) {
      if (!R::has(j)) { v[j] = 0.f; continue; }
      const int i = R::at(j);
      float s = 0.f;
      for (int dy = 0; dy < POOL; ++dy)
        for (int dx = 0; dx < POOL; ++dx) s += x[((y0 + dy) * gw + x0 + dx) * H + i];
      v[j] = (s * (1.f / (POOL * POOL)) * root_h - std_bias[i]) * std_scale[i];
    }
    vis_store_act<H, HP, THREADS>(out + (long)n * HP, v, vis_inv_rms<H, THREADS>(v, eps, scratch), nullptr);
  }
}

}  // namespace thorgen
