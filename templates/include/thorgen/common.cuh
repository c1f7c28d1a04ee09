// thorgen common device functions: element load/store by type, fp8 e4m3, warp/block reductions, last-block arrival,
// orderable keys.
// Hand-written; included by the generated kernels as "thorgen/common.cuh".
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace thorgen {

// ---- programmatic dependent launch (PDL, sm_90+) ---------------------------------------------------------
// Kernels are launched inside CUDA graphs with programmatic stream serialization, so one may start while the
// kernel before it still runs. pdl_launch_dependents() (alias pdl_trigger) lets the next kernel launch now: its
// blocks take free SM slots and park in pdl_wait(), which returns once the earlier kernels have finished and their
// writes are visible. So every kernel calls pdl_wait() before it reads anything an earlier kernel writes
// (activations, ids, KV, counters) and before its first global write; immutable weights may be loaded before it,
// which is the point: the weight stream starts under the previous kernel's tail. No-ops without the attribute.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { pdl_launch_dependents(); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// ---- paged KV caches (the attention and rope_kv kernels) --------------------------------------------------------
// Slot of position j in a paged cache: page table entry j / PAGE of the sequence's row `tab`, then the offset in it.
template <int PAGE>
__device__ __forceinline__ int page_slot(const int* __restrict__ tab, int j) {
  static_assert(PAGE > 0 && (PAGE & (PAGE - 1)) == 0, "pages hold a power-of-two count of positions");
  return __ldg(tab + j / PAGE) * PAGE + (j & (PAGE - 1));
}

// ---- element conversion: every kernel computes in fp32 and converts at the memory boundary -------------------
template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// fp8 e4m3 (no scale), round-to-nearest-even, saturating at +-448 like the NumPy reference's f32_to_e4m3.
struct fp8e4m3 { __nv_fp8_storage_t bits; };
template <> __device__ __forceinline__ float to_f32<fp8e4m3>(fp8e4m3 v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.bits, __NV_E4M3)));
}
template <> __device__ __forceinline__ fp8e4m3 from_f32<fp8e4m3>(float v) {
  return fp8e4m3{__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)};
}

template <typename T> __device__ __forceinline__ float ld(const T* p, long i) { return to_f32<T>(p[i]); }
template <typename T> __device__ __forceinline__ void st(T* p, long i, float v) { p[i] = from_f32<T>(v); }

// ---- reductions ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

// Block-wide sum; `scratch` holds >= 32 floats; every thread gets the result. THREADS must be a multiple of 32.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "block size must be a multiple of 32, at most 1024");
  constexpr int WARPS = THREADS / 32;
  v = warp_sum(v);
  if (WARPS == 1) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < WARPS ? scratch[lane] : 0.f;
  return warp_sum(r);
}

template <int THREADS>
__device__ __forceinline__ unsigned long long block_max_u64(unsigned long long v, unsigned long long* scratch) {
  constexpr int WARPS = THREADS / 32;
  v = warp_max_u64(v);
  if (WARPS == 1) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  unsigned long long r = lane < WARPS ? scratch[lane] : 0ull;
  return warp_max_u64(r);
}

// ---- cross-block completion: the last block of a launch (or of a group) merges what the others wrote --------
// `inc` arrivals (of `n` in all) at a u32 counter by the calling block (every thread calls it); true in every thread
// of the block that completes the count, which re-zeroes the counter and may then read what the others wrote.
// flag: a shared int. The caller's global writes precede the call.
__device__ __forceinline__ bool last_arrival(unsigned int* counter, unsigned int n, int* flag, unsigned int inc = 1u) {
  __syncthreads();  // the block's writes are done
  if (threadIdx.x == 0) {
    __threadfence();  // ... and visible device-wide (cumulative over the block's writes) before the count
    const bool l = atomicAdd(counter, inc) == n - inc;
    if (l) *counter = 0u;  // all n have counted: nobody touches it again in this launch
    *flag = l;
  }
  __syncthreads();
  const bool l = *flag != 0;
  if (l) __threadfence();  // acquire: the other blocks' writes are visible from here on
  return l;
}

// ---- L2 prefetch hints -----------------------------------------------------------------------------------------
// Pull the 128-B line holding ptrs[i] + col toward L2, one thread per pointer (null ones skipped). A hint, safe
// before the data's producer has run: L2 is where global memory is coherent, so a later load still sees the write.
// The o_proj GEMV with the attention tail folded in uses it: every block prefetches its own columns of the tail's
// row inputs before its GEMV work, so the one block that runs the tail reads them from L2 rather than DRAM.
template <int N>
__device__ __forceinline__ void prefetch_l2_columns(const void* const (&ptrs)[N], int col_bytes) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (threadIdx.x == i && ptrs[i] != nullptr)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(ptrs[i]) + col_bytes));
}

// ---- orderable keys: larger value first, ties -> lower index (the NumPy argmax / stable-sort rule) ----------
__device__ __forceinline__ uint32_t ordered_f32(float f) {
  uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unordered_f32(uint32_t u) {
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}
__device__ __forceinline__ unsigned long long value_index_key(float value, uint32_t index) {
  return ((unsigned long long)ordered_f32(value) << 32) | (unsigned long long)(0xffffffffu - index);
}
// The warp's largest key (warp_max_u64's result) in two 32-bit warp reductions (redux.sync, sm_80+) instead of five
// 64-bit shuffle rounds: the high words' maximum, then the largest low word among the lanes holding it.
__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long v) {
  const uint32_t hi = __reduce_max_sync(0xffffffffu, (uint32_t)(v >> 32));
  const uint32_t lo = __reduce_max_sync(0xffffffffu, (uint32_t)(v >> 32) == hi ? (uint32_t)v : 0u);
  return ((unsigned long long)hi << 32) | lo;
}
__device__ __forceinline__ uint32_t key_index(unsigned long long key) { return 0xffffffffu - (uint32_t)(key & 0xffffffffu); }
__device__ __forceinline__ float key_value(unsigned long long key) { return unordered_f32((uint32_t)(key >> 32)); }

}  // namespace thorgen
