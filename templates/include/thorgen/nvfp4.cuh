// thorgen NVFP4 / tensor-core primitives: mma.sync wrappers, streaming loads, in-register E2M1 and E4M3 decode.
// Hand-written; the weight layout these decoders read is documented in runtime/convert/layouts.py ("t16x64"), its
// sizes are model_spec/weight_layout.py's.
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

// ---- weight kinds of the tile engine ------------------------------------------------------------------------
// FP4_SHIFT: NVFP4, "shift" bit order, integer decode (any arch; sm_90 has no E2M1 conversion instruction).
// FP4_NAT  : NVFP4, checkpoint nibble order, hardware cvt.rn.f16x2.e2m1x2 (sm_100a and later, family-specific).
// HALF     : fp16 weights, plain row-major [N][K] (the drafter's bf16 linears converted once at load).
enum WeightKind : int { FP4_SHIFT = 0, FP4_NAT = 1, HALF = 2 };

// ---- the t16x64 tile (model_spec/weight_layout.py): every kernel on it static_asserts its rendered params tile_n and
// tile_k against W_TILE_N and W_TILE_K, so the repack's packing and these loads cannot disagree --------------------
constexpr int W_TILE_N = 16;  // output rows a unit: mma.m16n8k16's two n8 tiles
constexpr int W_TILE_K = 64;  // inputs a step: four k16 tiles
constexpr int W_LANES = 32;   // a warp's lanes split a unit's step
constexpr int FP4_LANE_BYTES = W_TILE_N * W_TILE_K / 2 / W_LANES;     // 16: e2m1 codes
constexpr int SCALE_LANE_BYTES = W_TILE_N * W_TILE_K / 16 / W_LANES;  // 2: e4m3 block scales (one per 16 inputs)
constexpr int HALF_LANE_BYTES = W_TILE_N * W_TILE_K * 2 / W_LANES;    // 64: fp16 weights

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1000) && defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
#define THORGEN_HAS_FP4_CVT 1
#else
#define THORGEN_HAS_FP4_CVT 0
#endif

// Value of a decoded register relative to the true e2m1 * e4m3 product; folded into the fp32 epilogue scale.
template <int KIND> struct DecodeFactor { static constexpr float value = 1.0f; };
template <> struct DecodeFactor<FP4_SHIFT> { static constexpr float value = 16384.0f; };  // regs hold e2m1 * 2^-14

// ---- tensor-core mma (m16n8k16, fp32 accumulate) ---------------------------------------------------------------
__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- loads --------------------------------------------------------------------------------------------------
// Weights are read exactly once per launch: bypass L1 and do not keep them in L2 at the expense of activations.
__device__ __forceinline__ uint4 ldg_stream_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t ldg_stream_u16(const void* p) {
  unsigned short r;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(r) : "l"(p));
  return r;
}
// The same streaming loads without .nc, for the loads a kernel means to issue before griddepcontrol.wait: ptxas
// (CUDA 13.0, sm_90a) may schedule the wait's ACQBULK above ld.global.nc loads that precede it in the PTX (in every
// planned one-row GEMV no weight load issues before it), so those only issue once the previous kernel has finished;
// it keeps coherent loads where they are (a weight, immutable during the step, reads the same either way).
__device__ __forceinline__ uint4 ldg_early_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint32_t ldg_early_u16(const void* p) {
  unsigned short r;
  asm volatile("ld.global.L1::no_allocate.u16 %0, [%1];\n" : "=h"(r) : "l"(p));
  return r;
}
// Activations: small, re-read by every block, so they stay cached.
__device__ __forceinline__ uint4 ldg_v4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// ---- E2M1 / E4M3 decode ------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  uint32_t out;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(out) : "r"(a), "r"(b));
  return out;
}
// "shift" word -> 4 half2 registers holding e2m1 * 2^-14 (exact; layout in runtime/convert/layouts.py SHIFT_POS):
// 8 codes in 9 integer instructions. r[2] = ((v << 6) & 0x0E000E00) | ((v << 1) & 0x80008000) and r[3] likewise
// with shifts 9 and 2, each as one multiply of the masked word (x * 66 = (x << 6) + (x << 1)): the two shifted
// copies land on disjoint kept bits, and their only overlap (bits 20-22 of r[2]) carries no further than bit 23,
// which the final mask drops (tests/test_fp4_decode.py checks every value of the bits that reach the result).
__device__ __forceinline__ void fp4_shift_decode(uint32_t v, uint32_t (&r)[4]) {
  r[0] = v & 0x8E008E00u;
  r[1] = (v << 3) & 0x8E008E00u;
  r[2] = ((v & 0x40384038u) * 66u) & 0x8E008E00u;
  r[3] = ((v & 0x20072007u) * 516u) & 0x8E008E00u;
}

// checkpoint-order word (4 bytes, each = two e2m1 codes, low nibble first) -> 4 half2 registers (exact e2m1).
__device__ __forceinline__ void fp4_nat_decode(uint32_t v, uint32_t (&r)[4]) {
#if THORGEN_HAS_FP4_CVT
  asm("{\n .reg .b8 b0, b1, b2, b3;\n mov.b32 {b0, b1, b2, b3}, %4;\n"
      " cvt.rn.f16x2.e2m1x2 %0, b0;\n cvt.rn.f16x2.e2m1x2 %1, b1;\n"
      " cvt.rn.f16x2.e2m1x2 %2, b2;\n cvt.rn.f16x2.e2m1x2 %3, b3;\n}\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(v));
#else
  // Portable fallback (never selected by the planner on these arches; kept so every kind compiles everywhere).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t byte = (v >> (8 * i)) & 0xFFu;
    const uint32_t x = (byte & 0xFu) | ((byte & 0xF0u) << 12);  // low code -> bits 0-3, high code -> 16-19
    const uint32_t bits = ((x & 0x00070007u) << 9) | ((x & 0x00080008u) << 12);  // e2m1 * 2^-14
    r[i] = hmul2_u32(bits, 0x74007400u);                                          // * 2^14 (exact)
  }
#endif
}

// Two e4m3 bytes (low byte first) -> half2 (exact; cvt.rn.f16x2.e4m3x2 exists from sm_89).
__device__ __forceinline__ uint32_t e4m3x2_to_half2(uint32_t two_bytes) {
  uint32_t out;
  asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}\n" : "=r"(out) : "r"(two_bytes));
  return out;
}
// half2 (lo, hi) -> (lo, lo) and (hi, hi)
__device__ __forceinline__ uint32_t bcast_lo(uint32_t v) { return __byte_perm(v, 0, 0x1010); }
__device__ __forceinline__ uint32_t bcast_hi(uint32_t v) { return __byte_perm(v, 0, 0x3232); }

// ---- one 16x64 step of one lane: raw weights -> B fragments ----------------------------------------------------
// b[tile][ktile][reg]: tile 0 = rows n0..n0+7, tile 1 = rows n0+8..n0+15; k-tile j, register h covers the lane's
// codes 4j+2h, 4j+2h+1 (see runtime/convert/layouts.py).
template <int KIND> struct WStep;
template <> struct WStep<FP4_SHIFT> { uint4 w; uint32_t s; };
template <> struct WStep<FP4_NAT> { uint4 w; uint32_t s; };
template <> struct WStep<HALF> { uint4 q[4]; };

// Weight operand of one launch: base pointers of a [N, K] matrix in its layout.
struct WPtr {
  const uint8_t* w;  // FP4: layout bytes; HALF: fp16 [N][K]
  const uint8_t* s;  // FP4: layout scale bytes; HALF: unused
};

// Bytes of one [N, K] matrix in its layout, weights and block scales (an expert's stride in a stacked slab):
// NVFP4 4 bits a weight and an e4m3 scale a 16-block; fp16 2 bytes a weight and no scales.
template <int KIND> __host__ __device__ constexpr size_t layout_weight_bytes(size_t n, size_t k) {
  return KIND == HALF ? n * k * 2 : n * k / 2;
}
template <int KIND> __host__ __device__ constexpr size_t layout_scale_bytes(size_t n, size_t k) {
  return KIND == HALF ? 0 : n * k / 16;
}

// Step-major layout: unit u, step s at ((s * UNITS + u) * W_LANES + lane) * bytes-per-lane
// (runtime/convert/layouts.py). kEarly: coherent loads (ldg_early_*), kept before a griddepcontrol.wait after them.
template <int KIND, int N, int K, bool kEarly = false>
__device__ __forceinline__ void load_step(WStep<KIND>& st, const WPtr& p, int unit, int step, int lane) {
  static_assert(FP4_LANE_BYTES == sizeof(uint4) && SCALE_LANE_BYTES == 2 && HALF_LANE_BYTES == 4 * sizeof(uint4),
                "a lane's step is one 16-byte load of codes and one u16 of scales, or four 16-byte loads of fp16");
  constexpr int UNITS = N / W_TILE_N;
  const size_t idx = ((size_t)step * UNITS + unit) * W_LANES + lane;
  if constexpr (KIND == HALF) {
    const uint8_t* b = p.w + idx * HALF_LANE_BYTES;
    st.q[0] = ldg_stream_v4(b);
    st.q[1] = ldg_stream_v4(b + 16);
    st.q[2] = ldg_stream_v4(b + 32);
    st.q[3] = ldg_stream_v4(b + 48);
  } else if constexpr (kEarly) {
    st.w = ldg_early_v4(p.w + idx * FP4_LANE_BYTES);
    st.s = ldg_early_u16(p.s + idx * SCALE_LANE_BYTES);
  } else {
    st.w = ldg_stream_v4(p.w + idx * FP4_LANE_BYTES);
    st.s = ldg_stream_u16(p.s + idx * SCALE_LANE_BYTES);
  }
}

template <int KIND>
__device__ __forceinline__ void decode_step(const WStep<KIND>& st, uint32_t (&b)[2][4][2]) {
  if constexpr (KIND == HALF) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const uint4 a = st.q[2 * t], c = st.q[2 * t + 1];
      b[t][0][0] = a.x; b[t][0][1] = a.y; b[t][1][0] = a.z; b[t][1][1] = a.w;
      b[t][2][0] = c.x; b[t][2][1] = c.y; b[t][3][0] = c.z; b[t][3][1] = c.w;
    }
  } else {
    const uint32_t sc = e4m3x2_to_half2(st.s);
    const uint32_t s2[2] = {bcast_lo(sc), bcast_hi(sc)};
    const uint32_t words[4] = {st.w.x, st.w.y, st.w.z, st.w.w};
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int wd = 0; wd < 2; ++wd) {
        uint32_t r[4];
        if constexpr (KIND == FP4_SHIFT) fp4_shift_decode(words[2 * t + wd], r);
        else fp4_nat_decode(words[2 * t + wd], r);
#pragma unroll
        for (int q = 0; q < 4; ++q) b[t][2 * wd + (q >> 1)][q & 1] = hmul2_u32(r[q], s2[t]);
      }
    }
  }
}

// A fragments of one step for rows (gid, gid+8): the lane's 16 contiguous activations of each row (k = 16*t4 ..)
struct AStep { uint4 r0[2]; uint4 r1[2]; };

template <bool kTwoRows>
__device__ __forceinline__ void load_a(AStep& a, const __half* row0, const __half* row1, int step, int t4) {
  const int off = 64 * step + 16 * t4;
  const uint4 z = make_uint4(0, 0, 0, 0);
  if (row0 != nullptr) { a.r0[0] = ldg_v4(row0 + off); a.r0[1] = ldg_v4(row0 + off + 8); }
  else { a.r0[0] = z; a.r0[1] = z; }
  if constexpr (kTwoRows) {
    if (row1 != nullptr) { a.r1[0] = ldg_v4(row1 + off); a.r1[1] = ldg_v4(row1 + off + 8); }
    else { a.r1[0] = z; a.r1[1] = z; }
  }
}

// acc[tile] += A(16 x 64) * B(64 x 8) for both tiles of one step.
template <bool kTwoRows>
__device__ __forceinline__ void mma_step(float (&acc)[2][4], const AStep& a, const uint32_t (&b)[2][4][2]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 q0 = a.r0[j >> 1];
    const uint32_t a0 = (j & 1) ? q0.z : q0.x, a2 = (j & 1) ? q0.w : q0.y;
    uint32_t a1 = 0, a3 = 0;
    if constexpr (kTwoRows) {
      const uint4 q1 = a.r1[j >> 1];
      a1 = (j & 1) ? q1.z : q1.x;
      a3 = (j & 1) ? q1.w : q1.y;
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) mma_f16(acc[t], a0, a1, a2, a3, b[t][j][0], b[t][j][1]);
  }
}

// Swapped form for <= 8 tokens: the unit's 16 weight rows are the mma A operand (16 x k16) and the tokens the B
// operand (k16 x 8), so one mma covers 256 weights instead of 128: half the tensor instructions per byte.
// acc[0] holds C[16 rows][8 tokens]: c0 = (row gid, token 2t4), c1 = (gid, 2t4+1), c2 = (row gid+8, token 2t4),
// c3 = (gid+8, 2t4+1); rows 0-7 = tile 0, rows 8-15 = tile 1 (acc[1] stays zero). One chain over the k-slices in
// order, as mma_step's: every output sums its products in the same order in both forms, so a row gets the same
// bits from the M = 1 GEMV as from the 16- and 32-row GEMMs (batch invariance; two chains, j & 1, summed at the
// end, differed in the last bits).
// k-slice j (16 k) of a swapped step: A = the unit's decoded weight rows (b), B = the tokens' k values, from q = the
// lane's 16-byte half of its token's step row that holds slice j.
__device__ __forceinline__ void mma_swap_k16(float (&c)[4], const uint32_t (&b)[2][4][2], int j, const uint4& q) {
  mma_f16(c, b[0][j][0], b[1][j][0], b[0][j][1], b[1][j][1], (j & 1) ? q.z : q.x, (j & 1) ? q.w : q.y);
}

// The swapped step on one accumulator: c += the unit's 16 weight rows x 8 tokens, x = the lane's token gid (its
// k 16*t4 .. of the step, as AStep::r0); c0 = (row gid, token 2t4), c1 = (gid, 2t4+1), c2 = (gid+8, 2t4),
// c3 = (gid+8, 2t4+1).
__device__ __forceinline__ void mma_step_swap1(float (&c)[4], const uint4 (&x)[2], const uint32_t (&b)[2][4][2]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) mma_swap_k16(c, b, j, x[j >> 1]);
}

__device__ __forceinline__ void mma_step_swap(float (&acc)[2][4], const AStep& a, const uint32_t (&b)[2][4][2]) {
  mma_step_swap1(acc[0], a.r0, b);
}

// One warp: acc[u][rt] += the rows of 16-row tile rt x W[unit0 + u]^T over steps [s0, s1), for UN consecutive
// units, weights prefetched PF steps ahead in registers. Each weight step is decoded once for all RT tiles (a
// 32-row step reads each weight byte once, like 16 rows) and each activation step is loaded once for all UN units
// (UN x fewer activation reads from L1/L2, which bound the 32-row MoE kernels).
// rows[2 * rt + h] is the lane's row gid + 8 h of tile rt (nullptr: zeros). Swapped (kSwap): tile rt is a group of
// 8 tokens, rows[2 * rt] the lane's token gid of it (rows[2 * rt + 1] unused).
// kWait: issue pdl_wait() after the weight prologue (the activations come from the previous kernel). kEarly (with
// kWait, NVFP4): the prologue's loads are coherent ones, which ptxas keeps before the wait (load_step); with PF the
// warp's whole step count, the warp's whole weight slice is then in flight before the wait (the bench-only
// whole-slice GEMVs, codegen/prologue_variants.py). Either way the sums are the same, in the same order.
// between() runs after the prologue (and the wait), before the first step: the smem GEMVs' steps before s0, whose
// sums come first, while the prologue's loads are in flight.
struct NoSteps { __device__ __forceinline__ void operator()() const {} };
template <int KIND, int N, int K, int PF, int RT, int UN, bool kTwoRows, bool kWait = false, bool kSwap = false,
          bool kEarly = false, typename Between = NoSteps>
__device__ __forceinline__ void unit_steps_rows(float (&acc)[UN][RT][2][4], const WPtr& p, int unit0,
                                                const __half* const (&rows)[2 * RT], int s0, int s1,
                                                const Between& between = Between{}) {
  static_assert(K % 64 == 0, "K must be a multiple of 64 (the t16x64 step)");
  static_assert(PF >= 1 && PF <= 16, "prefetch depth out of range");
  static_assert(UN >= 1 && UN <= 4 && (N / 16) % UN == 0, "1..4 units a warp, dividing the matrix's units");
  static_assert(!(kSwap && kTwoRows), "a swapped tile holds 8 tokens");
  static_assert(RT >= 1 && RT <= 2 && (RT == 1 || kTwoRows || kSwap), "1 or 2 tiles: full 16-row or 8-token ones");
  const int lane = threadIdx.x & 31, t4 = lane & 3;
  // Decoding a step before its ring slot is refilled saves the slot's copy (sm_110a's hot loops 8-32 % fewer
  // instructions); with the integer decode (sm_90a) or two row tiles it pushed the 32-row GEMMs and the one-row
  // GELU GEMV into spills, so those refill first.
  constexpr bool kDecodeFirst = KIND == FP4_NAT && RT == 1;
  constexpr bool kEarlyLoads = kEarly && kWait && KIND != HALF;
  WStep<KIND> ring[UN][PF];
#pragma unroll
  for (int i = 0; i < PF; ++i)
#pragma unroll
    for (int u = 0; u < UN; ++u)
      if (s0 + i < s1) load_step<KIND, N, K, kEarlyLoads>(ring[u][i], p, unit0 + u, s0 + i, lane);
  if constexpr (kWait) pdl_wait();
  between();
  for (int base = s0; base < s1; base += PF) {
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      const int s = base + i;
      if (s < s1) {
        AStep a[RT];
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) load_a<kTwoRows>(a[rt], rows[2 * rt], rows[2 * rt + 1], s, t4);
#pragma unroll
        for (int u = 0; u < UN; ++u) {
          uint32_t b[2][4][2];
          if constexpr (kDecodeFirst) {  // decode, then refill the slot: no copy of the raw step
            decode_step<KIND>(ring[u][i], b);
            if (s + PF < s1) load_step<KIND, N, K>(ring[u][i], p, unit0 + u, s + PF, lane);
          } else {  // refill first, from a copy: fewer live registers where the decoded tiles are many
            const WStep<KIND> cur = ring[u][i];
            if (s + PF < s1) load_step<KIND, N, K>(ring[u][i], p, unit0 + u, s + PF, lane);
            decode_step<KIND>(cur, b);
          }
#pragma unroll
          for (int rt = 0; rt < RT; ++rt) {
            if constexpr (kSwap) mma_step_swap(acc[u][rt], a[rt], b);
            else mma_step<kTwoRows>(acc[u][rt], a[rt], b);
          }
        }
      }
    }
  }
}

// One 16-row (or 8-row) tile of one unit: unit_steps_rows with RT = UN = 1.
template <int KIND, int N, int K, int PF, bool kTwoRows, bool kWait = false, bool kSwap = false>
__device__ __forceinline__ void unit_steps(float (&acc)[2][4], const WPtr& p, int unit, const __half* row0,
                                           const __half* row1, int s0, int s1) {
  const __half* const rows[2] = {row0, row1};
  unit_steps_rows<KIND, N, K, PF, 1, 1, kTwoRows, kWait, kSwap>(reinterpret_cast<float (&)[1][1][2][4]>(acc), p,
                                                                unit, rows, s0, s1);
}

__device__ __forceinline__ float gelu_tanh_f(float x) {
  // gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

}  // namespace thorgen
