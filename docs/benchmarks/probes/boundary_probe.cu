// Probe ("persistent kernel vs fused multi-kernel step"): what a dependency boundary between two
// memory-bound phases costs on this GPU. Variants: a kernel boundary inside a CUDA graph; the same with programmatic
// dependent launch; the same with a phase's first loads issued before it waits; a grid-wide barrier inside one
// persistent kernel; the same with the next phase's first loads issued before the barrier; and the persistent kernel
// without barriers (the streaming bound). Not part of the engine: a measurement for docs/benchmarks/NOTES.md.
//   nvcc -O3 -std=c++17 -arch=sm_90a -o boundary_probe boundary_probe.cu && ./boundary_probe > probe.json
// Each phase streams its own weight-like buffer (distinct buffers, far more bytes than L2 holds over a run) with
// 16-byte cache-streaming loads, 4 in flight a thread, and every block writes one checksum.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));          \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

constexpr int THREADS = 256;

// A thread's first group of loads of a phase (zeros past the end): issued before a boundary, consumed after it,
// so they are in flight while the boundary waits (weights never depend on the phase before).
struct First {
  uint4 v[4];
};
__device__ __forceinline__ First issue_first(const uint4* __restrict__ w, size_t n16, int block, int blocks) {
  const size_t stride = (size_t)blocks * THREADS, i = (size_t)block * THREADS + threadIdx.x;
  First f;
#pragma unroll
  for (int k = 0; k < 4; ++k) f.v[k] = i + k * stride < n16 ? __ldcs(w + i + k * stride) : make_uint4(0, 0, 0, 0);
  return f;
}

// The phase from its second group on (the first one given), 4 loads in flight a thread; one checksum a block.
__device__ __forceinline__ void finish_phase(const uint4* __restrict__ w, size_t n16, unsigned* out, int block,
                                             int blocks, const First& f) {
  const size_t stride = (size_t)blocks * THREADS;
  size_t i = (size_t)block * THREADS + threadIdx.x + 4 * stride;
  unsigned acc = f.v[0].x ^ f.v[1].y ^ f.v[2].z ^ f.v[3].w;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = __ldcs(w + i), b = __ldcs(w + i + stride), c = __ldcs(w + i + 2 * stride),
                d = __ldcs(w + i + 3 * stride);
    acc ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n16; i += stride) acc ^= __ldcs(w + i).x;
  acc = __reduce_xor_sync(0xffffffffu, acc);
  __shared__ unsigned warp_acc[THREADS / 32];
  if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned s = 0;
    for (int k = 0; k < THREADS / 32; ++k) s ^= warp_acc[k];
    out[block] = s;
  }
  __syncthreads();
}

// One phase a launch. pdl 1: let the next launch start at once, and wait for the previous one's completion (and
// memory) before this phase's work: the launch latency overlaps, the drain does not. pdl 2: the same, with the
// first group of loads issued before the wait.
__global__ void __launch_bounds__(THREADS) phase_kernel(const uint4* w, size_t n16, unsigned* out, int pdl) {
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  First f;
  if (pdl == 2) f = issue_first(w, n16, blockIdx.x, gridDim.x);
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (pdl != 2) f = issue_first(w, n16, blockIdx.x, gridDim.x);
  finish_phase(w, n16, out, blockIdx.x, gridDim.x, f);
}

// Every phase in one launch. barrier 1: a grid-wide barrier (monotonic device counter) between phases; 2: the
// same, with the next phase's first group of loads issued before the barrier; 0: no barrier (the streaming bound).
__global__ void __launch_bounds__(THREADS) persistent_kernel(const uint4* const* ws, size_t n16, unsigned* out,
                                                             int phases, unsigned* count, int barrier) {
  First f = issue_first(ws[0], n16, blockIdx.x, gridDim.x);
  for (int p = 0; p < phases; ++p) {
    finish_phase(ws[p], n16, out + (size_t)p * gridDim.x, blockIdx.x, gridDim.x, f);
    const bool next = p + 1 < phases;
    if (next && barrier == 2) f = issue_first(ws[p + 1], n16, blockIdx.x, gridDim.x);
    if (barrier) {
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        const unsigned target = (unsigned)(p + 1) * gridDim.x;
        unsigned v;
        do {
          asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
        } while (v < target);
      }
      __syncthreads();
    }
    if (next && barrier != 2) f = issue_first(ws[p + 1], n16, blockIdx.x, gridDim.x);
  }
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  constexpr int PHASES = 300, REPS = 15;  // ~ a decode step: 30 layers x ~10 launches
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, persistent_kernel, THREADS, 0));
  const int blocks = prop.multiProcessorCount * std::min(occ, 4);  // all co-resident: the barrier needs that
  const size_t sizes[] = {512u << 10, 2u << 20, 8u << 20};
  const size_t max_bytes = 8u << 20;
  std::vector<uint4*> bufs(PHASES);
  for (auto& b : bufs) {
    CK(cudaMalloc(&b, max_bytes));
    CK(cudaMemset(b, 0x5a, max_bytes));
  }
  uint4** d_bufs;
  CK(cudaMalloc(&d_bufs, PHASES * sizeof(uint4*)));
  CK(cudaMemcpy(d_bufs, bufs.data(), PHASES * sizeof(uint4*), cudaMemcpyHostToDevice));
  unsigned *out, *count;
  CK(cudaMalloc(&out, (size_t)PHASES * blocks * sizeof(unsigned)));
  CK(cudaMalloc(&count, sizeof(unsigned)));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::printf("{\"gpu\": \"%s\", \"sms\": %d, \"blocks\": %d, \"threads\": %d, \"phases\": %d, \"results\": [\n",
              prop.name, prop.multiProcessorCount, blocks, THREADS, PHASES);
  bool first = true;
  for (size_t bytes : sizes) {
    const size_t n16 = bytes / 16;
    // graphs of PHASES launches, without and with PDL
    cudaGraphExec_t execs[3];
    for (int pdl = 0; pdl < 3; ++pdl) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int p = 0; p < PHASES; ++p) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks);
        cfg.blockDim = dim3(THREADS);
        cfg.stream = s;
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = pdl ? 1 : 0;
        CK(cudaLaunchKernelEx(&cfg, phase_kernel, (const uint4*)bufs[p], n16, out + (size_t)p * blocks, pdl));
      }
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&execs[pdl], g, 0));
      CK(cudaGraphDestroy(g));
    }
    const char* names[] = {"graph", "graph_pdl", "graph_pdl_prefetch", "persistent_barrier",
                           "persistent_barrier_prefetch", "persistent_no_barrier"};
    const int barrier_of[] = {0, 0, 0, 1, 2, 0};
    for (int v = 0; v < 6; ++v) {
      std::vector<float> ms;
      for (int r = 0; r < REPS + 3; ++r) {
        if (v >= 3) CK(cudaMemsetAsync(count, 0, sizeof(unsigned), s));
        CK(cudaEventRecord(e0, s));
        if (v < 3) {
          CK(cudaGraphLaunch(execs[v], s));
        } else {
          persistent_kernel<<<blocks, THREADS, 0, s>>>(d_bufs, n16, out, PHASES, count, barrier_of[v]);
          CK(cudaGetLastError());
        }
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (r >= 3) ms.push_back(t);
      }
      const float m = median(ms);
      std::printf("%s  {\"variant\": \"%s\", \"phase_bytes\": %zu, \"step_ms\": %.4f, \"us_per_phase\": %.3f, "
                  "\"gb_s\": %.1f}",
                  first ? "" : ",\n", names[v], bytes, m, 1e3f * m / PHASES, (double)bytes * PHASES / (m * 1e6));
      first = false;
    }
    for (auto& e : execs) CK(cudaGraphExecDestroy(e));
  }
  std::printf("\n]}\n");
  CK(cudaDeviceSynchronize());
  return 0;
}
