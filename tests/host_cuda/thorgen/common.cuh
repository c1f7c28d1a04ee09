// Test support (not shipped): a host-C++ stand-in for templates/include/thorgen/common.cuh, so that the lm_head /
// lm_logits headers and their rendered kernels compile with g++ and run on the CPU (tests/host_kernels.py).
// One std::thread per CUDA thread, the blocks of a grid one after another; __syncthreads is a std::barrier over the
// block, and the warp intrinsics exchange through memory between two block-wide barriers, so they require (as the
// kernels here do) that every thread of the block reaches them. The thorgen:: helpers below copy common.cuh's.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <barrier>
#include <cmath>

using std::isnan;

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct dim3_ { unsigned int x, y, z; };
extern thread_local dim3_ threadIdx, blockIdx;
extern dim3_ gridDim, blockDim;
extern std::barrier<>* host_block_barrier;
extern uint64_t host_exchange[1024];
extern unsigned char host_dyn_smem[];  // the block's dynamic shared memory (headers rewritten to point here)

struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

inline void __syncthreads() { host_block_barrier->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned int tid_() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

template <typename T>
T __shfl_xor_sync(unsigned int, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "exchange slots are 8 bytes");
  const unsigned int t = tid_();
  memcpy(&host_exchange[t], &v, sizeof(T));
  __syncthreads();
  T r;
  memcpy(&r, &host_exchange[t ^ (unsigned int)lane_mask], sizeof(T));
  __syncthreads();
  return r;
}
template <typename Op>
unsigned int warp_reduce_(unsigned int v, Op op) {
  const unsigned int t = tid_(), base = t & ~31u;
  host_exchange[t] = v;
  __syncthreads();
  unsigned int r = (unsigned int)host_exchange[base];
  for (unsigned int i = 1; i < 32; ++i) r = op(r, (unsigned int)host_exchange[base + i]);
  __syncthreads();
  return r;
}
inline unsigned int __reduce_add_sync(unsigned int, unsigned int v) {
  return warp_reduce_(v, [](unsigned int a, unsigned int b) { return a + b; });
}
inline unsigned int __reduce_or_sync(unsigned int, unsigned int v) {
  return warp_reduce_(v, [](unsigned int a, unsigned int b) { return a | b; });
}

template <typename T> T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <typename T> T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <typename T> T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  unsigned long long cur = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return cur;
}

// no contraction: the test builds with -ffp-contract=off, so these are the plain IEEE operations
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }

namespace thorgen {

inline void pdl_launch_dependents() {}
inline void pdl_wait() {}

inline unsigned long long warp_max_u64(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) {
    unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}
template <int THREADS>
inline unsigned long long block_max_u64(unsigned long long v, unsigned long long* scratch) {
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

inline uint32_t ordered_f32(float f) {
  uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
inline float unordered_f32(uint32_t u) { return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u); }
inline unsigned long long value_index_key(float value, uint32_t index) {
  return ((unsigned long long)ordered_f32(value) << 32) | (unsigned long long)(0xffffffffu - index);
}
inline uint32_t key_index(unsigned long long key) { return 0xffffffffu - (uint32_t)(key & 0xffffffffu); }
inline float key_value(unsigned long long key) { return unordered_f32((uint32_t)(key >> 32)); }

}  // namespace thorgen
