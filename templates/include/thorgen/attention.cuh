// thorgen attention over the KV cache: decode (M = 1), verify (M <= 16), prefill chunks and the DFlash drafter
// block, one kernel. Queries are m consecutive positions p0 .. p0+m-1 (p0 = positions[0]); their keys are already
// in the cache ([slot][HKV][D]; slot = pos % RING for sliding-window rings, page_slot(pos) for paged caches, pos for
// linear ones).
//
// Block = (query block of QB queries x all G = HQ/HKV query heads of one KV head, one key split): R = QB*G = 16*MT
// rows, so each K/V tile is loaded once for every query head that reads it (GQA). Warps split the head dim
// (64 columns each, NWARP = D/64): each warp forms partial scores Q[:, dchunk] K[:, dchunk]^T with mma.m16n8k16,
// a shared-memory sum gives the scores, one online-softmax pass (fp32, exp2) per row, then each warp accumulates
// its 64 output columns O += P V. K/V tiles of TK keys are double-buffered with cp.async (fp8: raw bytes staged,
// then converted to fp16). Keys outside [lo, hi] are zero-filled so that garbage never meets a zero probability.
// Only the block's valid rows (its queries x G heads) run mma tiles and softmax rows. EARLY (the target's layers):
// a one-sequence launch loads its first key tile's rows older than the step before griddepcontrol.wait.
// Masks: key j visible to query position P iff j <= (CAUSAL ? P : p0+m-1) and (WINDOW == 0 or P - j < WINDOW).
// KV_HI (a prefill chunk holding an image on a sliding layer): query i's upper key bound is max(P, kv_hi[i])
// instead, kv_hi[i] >= P the last position of the image span holding it (the span sees itself both ways).
// SEG > 0 (a batched draft step: several sequences' DFlash blocks): the m queries are blocks of SEG consecutive
// positions, block b (queries b SEG ..) of its own sequence, at positions[b SEG] .. in lane lanes[b SEG]; each block
// sees its own lane's keys, its mask within itself (the bidirectional bound is its own last position). A query
// block (QB queries, QB dividing SEG) lies in one of them, so each is computed as it would be alone.
// KV lanes: the caches hold one lane per sequence, `lane_bytes` apart (lanes null: lane 0). rowwise == 0: the m
// queries are consecutive positions of the sequence in lane lanes[0]; rowwise != 0 (batched decode): query i is
// its own sequence's token, at position positions[i] in lane lanes[i], one query per block (grid.x = m).
// Paged caches (PAGE > 0, the full-attention layers): one pool of pages of PAGE positions shared by all sequences;
// a lane is then a row of the page table (`pages`, PITCH entries a lane) and lane_bytes is unused.
// NSPLIT > 1 (flash-decoding): a query's key range is cut into tile-aligned parts; each part's unnormalised O and
// (max, sum) per row go to a workspace. With `counters` the block that completes a (query block, KV head) group's
// count merges its parts into out (attn_split.cuh: attn_split_count, counters zeroed at entry and left zeroed; no
// second launch); one query (a decode, a batched step's row) then has its chunks of TPP key tiles as parts, whose
// partials and merge depend on its own key range only: a rowwise launch (a batched step, whose rows fill the SMs
// already) has gridDim.z <= NSPLIT blocks a query, each running parts z, z + gridDim.z, ..., so a sequence's
// attention has the same bits alone and in any batch (batch invariance). With counters == nullptr an attn_combine
// launch merges NSPLIT parts (faster for 16 queries: one block per row).
#pragma once
#include <climits>

#include "thorgen/attn_split.cuh"
#include "thorgen/nvfp4.cuh"

namespace thorgen {

enum KvType : int { KV_BF16 = 0, KV_FP8 = 1 };

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}

template <int D, int G, int MT, int TK, int KVT, int NWARP_ = D / 64>
struct AttnSmem {
  static constexpr int NWARP = NWARP_;
  static constexpr int R = 16 * MT;
  static constexpr int TPITCH = D + 8;           // 16-bit elements per K/V smem row (+16 B: ldmatrix without conflicts)
  static constexpr int SPITCH = D + 16;          // bytes per fp8 staging row
  static constexpr int RPITCH = TK + 8;          // floats per partial-score row
  static constexpr int PPITCH = TK + 8;          // 16-bit elements per probability row
  static constexpr int TILE = TK * TPITCH * 2;   // bytes of one K (or V) tile
  static constexpr int COMPUTE_STAGES = KVT == KV_FP8 ? 1 : 2;
  static constexpr int KV_BYTES = COMPUTE_STAGES * 2 * TILE;
  static constexpr int STAGE_BYTES = KVT == KV_FP8 ? 2 * 2 * TK * SPITCH : 0;
  static constexpr int RED_BYTES = NWARP * R * RPITCH * 4;
  static constexpr int P_BYTES = R * PPITCH * 2;
  static constexpr int STAT_BYTES = 3 * R * 4;   // running max, running sum, rescale factor
  static constexpr int BYTES = KV_BYTES + STAGE_BYTES + RED_BYTES + P_BYTES + STAT_BYTES;
};

template <int KVT> struct MmaT;
template <> struct MmaT<KV_BF16> {
  __device__ static __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) { mma_bf16(c, a0, a1, a2, a3, b0, b1); }
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static __forceinline__ uint32_t from_bf16x2(uint32_t v) { return v; }
};
template <> struct MmaT<KV_FP8> {
  __device__ static __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) { mma_f16(c, a0, a1, a2, a3, b0, b1); }
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static __forceinline__ uint32_t from_bf16x2(uint32_t v) {
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&v);
    return pack(__low2float(b), __high2float(b));
  }
};

template <int D, int G, int HKV, int MT, int TK, int WINDOW, int RING, bool CAUSAL, int KVT, int NSPLIT, int MMAX,
          int NSUB = 1, int PAGE = 0, int PITCH = 0, bool EARLY = false, int TPP = 1, bool KV_HI = false,
          int SEG = 0>
__device__ __forceinline__ void attn_fwd(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kc,
                                         const uint8_t* __restrict__ vc, const int* __restrict__ positions, int m,
                                         __half* __restrict__ out, float* ws, unsigned int* counters,
                                         const int* __restrict__ lanes, long long lane_bytes,
                                         const int* __restrict__ pages, int rowwise, float scale_log2,
                                         const int* __restrict__ kv_hi = nullptr) {
  using S = AttnSmem<D, G, MT, TK, KVT>;
  using Mm = MmaT<KVT>;
  static_assert(D % 64 == 0 && D <= 512, "head dim must be a multiple of 64, at most 512");
  static_assert(G >= 1 && 16 % G == 0, "query heads per KV head must divide 16");
  static_assert(TK == 16 || TK == 32 || TK == 64, "key tile must be 16, 32 or 64");
  static_assert(PAGE == 0 || (RING == 0 && PITCH > 0), "a paged cache is not a ring, and has a page-table pitch");
  constexpr int NWARP = S::NWARP, R = S::R, QB = R / G, HQ = HKV * G, THREADS = NWARP * 32;
  constexpr int EB = KVT == KV_FP8 ? 1 : 2;  // bytes per cached element
  constexpr int NT = TK / 8;                 // n8 key tiles per score tile
  extern __shared__ uint4 smem_u4[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(smem_u4);
  uint16_t* kv_t = reinterpret_cast<uint16_t*>(smem);                           // [stage][K|V][TK][TPITCH]
  uint8_t* stg = smem + S::KV_BYTES;                                             // fp8: [stage][K|V][TK][SPITCH]
  float* red = reinterpret_cast<float*>(smem + S::KV_BYTES + S::STAGE_BYTES);    // [NWARP][R][RPITCH]
  uint16_t* pbuf = reinterpret_cast<uint16_t*>(smem + S::KV_BYTES + S::STAGE_BYTES + S::RED_BYTES);
  float* st_m = reinterpret_cast<float*>(smem + S::KV_BYTES + S::STAGE_BYTES + S::RED_BYTES + S::P_BYTES);
  float* st_l = st_m + R;
  float* st_a = st_l + R;

  pdl_launch_dependents();
  // q and the cache rows of this step's positions come from the rope/KV-write kernel. EARLY (the target's layers,
  // whose earlier positions no kernel of the step writes), one sequence's consecutive queries (not rowwise: a
  // scoring pass's slices attend rows an earlier slice's step wrote): the first key tile's rows below the step's
  // first position load before the wait, under the previous kernel's tail (positions, lanes and the page table
  // are the host's staging, final before the forward's first kernel).
  const bool early = EARLY && rowwise == 0;
  if (!early) pdl_wait();
  // A prefill chunk's causal query blocks grow in keys with their position (up to the window): the last blocks run
  // first, so that the short ones fill the last wave instead of the long ones trailing alone (blocks are independent)
  static_assert(SEG == 0 || (SEG % QB == 0 && !EARLY), "a query block lies in one segment");
  const int qb = MMAX > 16 && !rowwise && SEG == 0 ? gridDim.x - 1 - blockIdx.x : blockIdx.x, hkv = blockIdx.y;
  // the blocks of a query block's parts: NSPLIT, or for a rowwise launch gridDim.z <= NSPLIT (a batched step's rows
  // already fill the SMs, and fewer blocks pay each block's fixed cost fewer times), each running several parts
  const int nblocks = NSPLIT > 1 && rowwise ? min((int)gridDim.z, NSPLIT) : NSPLIT;
  if ((int)blockIdx.z >= nblocks) return;  // (a grid with more splits than planned)
  const int qpb = rowwise ? 1 : QB;  // queries of this block
  const int q0 = qb * qpb;
  if (q0 >= m) return;
  const int nq = min(qpb, m - q0);
  // the block's valid rows (nq queries x G heads): 16-row tiles past them skip their mma, and the softmax skips
  // rows past them, whose probabilities and outputs nothing reads (a decode or batched-step block has G of R).
  // Prefill blocks (MMAX > 16) are full but for a chunk's last; they keep all R rows (with the early load gone from
  // prefill too: TTFT at 2,048 tokens 130.5 -> 128.4 ms on the H200)
  const int vrows = MMAX <= 16 || SEG > 0 ? nq * G : R;
  // the first query of this block's sequence, and the end of its queries (SEG: its segment's)
  const int s0 = SEG > 0 ? q0 / SEG * SEG : rowwise ? qb : 0, s_end = SEG > 0 ? min(m, s0 + SEG) : m;
  // rowwise, SEG: p0 + q0 is this block's query position (p0 itself is not a position then)
  const int p0 = rowwise ? __ldg(positions + qb) - q0 : __ldg(positions + s0) - s0;
  const int lane_id = lanes != nullptr ? __ldg(lanes + s0) : 0;
  const int* tab = PAGE > 0 ? pages + (size_t)lane_id * PITCH : nullptr;  // this sequence's page-table row
  if (PAGE == 0 && lanes != nullptr) {
    const long long off = (long long)lane_id * lane_bytes;
    kc += off;
    vc += off;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, t4 = lane & 3;
  const int last_vis = CAUSAL ? p0 + q0 + nq - 1 : p0 + s_end - 1;
  const int lo = WINDOW > 0 ? max(0, p0 + q0 - WINDOW + 1) : 0;
  int hi = last_vis;
  if constexpr (KV_HI) {
    static_assert(CAUSAL && NSPLIT == 1, "per-query key bounds are for causal prefill kernels");
    for (int i = 0; i < nq; ++i) hi = max(hi, __ldg(kv_hi + q0 + i));
  }
  const int t_lo = lo / TK, ntiles = hi / TK - t_lo + 1;
  // The parts: with at most NSPLIT chunks of TPP key tiles (chunk c = tiles [c TPP, (c + 1) TPP), aligned absolutely,
  // so that every query cuts its keys at the same boundaries) part z is the range's z-th chunk; past that, part z is
  // tiles [t_lo + z ntiles / NSPLIT, t_lo + (z + 1) ntiles / NSPLIT). With the merge in this launch (counters) one
  // query (a decode, or a row of a batched step) has only its nonempty parts, a function of its own key range: its
  // partials and their merge (split_tree) are the same alone and in any batch (batch invariance), whichever blocks
  // run them; a verify row's nonempty partials are the same too (masked tiles change nothing). TPP trades the
  // one-query decode's parallelism against a batched step's cost a part (partial write, restart, a longer merge),
  // where the rows fill the SMs already. Other launches (attn_combine, counters null) have NSPLIT parts.
  static_assert(TPP >= 1, "a part holds at least one key tile");
  const bool merged = NSPLIT > 1 && counters != nullptr;
  const int c_lo = t_lo / TPP, nchunks = (t_lo + ntiles - 1) / TPP - c_lo + 1;
  const bool chunked = nchunks <= NSPLIT;
  const int nparts = merged && (rowwise || m == 1) && chunked ? nchunks : NSPLIT;
  auto part_begin = [&](int z) {
    return chunked ? min(max(t_lo, (c_lo + z) * TPP), t_lo + ntiles) : t_lo + z * ntiles / NSPLIT;
  };
  int part = blockIdx.z;
  if (part >= nparts) return;
  int tb = part_begin(part), te = part_begin(part + 1);

  // a part's online-softmax state: running max, running sum, rescale factor a row
  auto reset_state = [&] {
    for (int r = threadIdx.x; r < R; r += THREADS) { st_m[r] = -INFINITY; st_l[r] = 0.f; st_a[r] = 1.f; }
  };
  reset_state();

  // cp.async of key tile `tile` (absolute index) into buffer `buf`: rows of K and V for keys j in [lo, hi] (the
  // others zero-filled), of the tile's rows with from <= j < to; `issue` commits the whole tile as one group.
  // A thread keeps one 16-byte column chunk and walks rows THREADS / CH apart, loading a row's K and V chunks from
  // one slot (a ring slot: one modulo a tile, not one a chunk). The one-query decode blocks (few warps an SM) are
  // bound by their instruction count, and a per-chunk index computation cost ~60 instructions a cp.async (ncu,
  // H200, docs/benchmarks/NOTES.md).
  constexpr int CH = D * EB / 16;  // 16-B chunks per row
  static_assert(THREADS % CH == 0 && TK % (THREADS / CH) == 0, "a pass of the block covers whole K/V rows");
  constexpr int RSTEP = THREADS / CH;
  const int my_ch = threadIdx.x % CH, my_row = threadIdx.x / CH;
  const size_t col = (size_t)hkv * D * EB + 16 * my_ch;  // this thread's chunk in a cache row
  static_assert(RING == 0 || RING >= TK, "a key tile wraps the ring at most once");
  auto issue_rows = [&](int tile, int buf, int from, int to) {
    const int ring0 = RING > 0 ? (tile * TK) % RING : 0;
    uint8_t* dst0 = KVT == KV_FP8 ? stg + (size_t)(buf * 2) * TK * S::SPITCH + 16 * my_ch
                                  : reinterpret_cast<uint8_t*>(kv_t) + (size_t)(buf * 2) * S::TILE + 16 * my_ch;
    constexpr size_t ROW_BYTES = KVT == KV_FP8 ? S::SPITCH : S::TPITCH * 2;  // smem bytes a row
    constexpr size_t V_OFF = KVT == KV_FP8 ? (size_t)TK * S::SPITCH : S::TILE;  // the V tile after the K tile
#pragma unroll
    for (int row = my_row; row < TK; row += RSTEP) {
      const int j = tile * TK + row;
      if (j < from || j >= to) continue;
      const bool ok = j >= lo && j <= hi;
      int slot = 0;
      if (ok) {
        if constexpr (RING > 0) slot = ring0 + row < RING ? ring0 + row : ring0 + row - RING;  // (RING >= TK)
        else if constexpr (PAGE > 0) slot = page_slot<PAGE>(tab, j);
        else slot = j;
      }
      const size_t off = (size_t)slot * HKV * D * EB + col;
      uint8_t* dst = dst0 + row * ROW_BYTES;
      cp_async16_zfill(dst, kc + off, ok);
      cp_async16_zfill(dst + V_OFF, vc + off, ok);
    }
  };
  auto issue = [&](int tile, int buf) {
    issue_rows(tile, buf, INT_MIN, INT_MAX);
    asm volatile("cp.async.commit_group;\n" ::);
  };

  if (early) {  // the step writes the cache rows from p0 on
    if (tb < te) issue_rows(tb, 0, INT_MIN, p0);
    pdl_wait();
    if (tb < te) issue_rows(tb, 0, p0, INT_MAX);
    asm volatile("cp.async.commit_group;\n" ::);
  } else if (tb < te) {
    issue(tb, 0);
  }
  // Q fragments (rows r = mt*16 + gid (+8): query q0 + r / G, head hkv*G + r % G), this warp's 64 columns.
  uint32_t qa[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + gid + 8 * h, qi = q0 + r / G;
      const bool ok = r / G < nq;
      const __nv_bfloat16* src = q + ((size_t)(qi < m ? qi : 0) * HQ + hkv * G + r % G) * D + 64 * warp + 2 * t4;
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        const uint32_t lo2 = ok ? __ldg(reinterpret_cast<const unsigned int*>(src + 16 * kt)) : 0u;
        const uint32_t hi2 = ok ? __ldg(reinterpret_cast<const unsigned int*>(src + 16 * kt + 8)) : 0u;
        qa[mt][kt][h] = Mm::from_bf16x2(lo2);
        qa[mt][kt][2 + h] = Mm::from_bf16x2(hi2);
      }
    }
  }
  // Parts one after another (a rowwise block runs parts part, part + nblocks, ...): K/V tiles double-buffered across
  // the part boundaries too (the next part's first tile loads under this part's last), by a running tile count.
  // With a two-level merge a part's end may merge a subgroup in the K/V tiles' shared memory, so there the next part
  // loads after it (long contexts of the full layers only).
  const bool tree = merged && split_tree<D, NSUB>(nparts, nq * G);
  int it = 0, done = 0;  // tiles run by this block; parts counted into the current merge group
  for (;;) {
    const int next = part + nblocks < nparts ? part + nblocks : -1;  // this block's next part
    float o[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.f;
    for (int tile = tb; tile < te; ++tile, ++it) {
      asm volatile("cp.async.wait_group 0;\n" ::);
      __syncthreads();
      int cbuf = it & 1;
      if constexpr (KVT == KV_FP8) {
        // fp8 staging -> fp16 compute tile (exact: e4m3 values are fp16 values), 16 bytes a thread a pass
        constexpr int C16 = D / 16;
        for (int c = threadIdx.x; c < 2 * TK * C16; c += THREADS) {
          const int row = c / C16, k = c % C16;  // row: K rows 0..TK-1, then V rows
          const uint4 raw = *reinterpret_cast<const uint4*>(stg + ((size_t)cbuf * 2 * TK + row) * S::SPITCH + 16 * k);
          const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
          uint32_t h[8];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            h[2 * i] = e4m3x2_to_half2(w[i] & 0xFFFFu);
            h[2 * i + 1] = e4m3x2_to_half2(w[i] >> 16);
          }
          uint4* dst = reinterpret_cast<uint4*>(kv_t + (size_t)(row / TK) * (S::TILE / 2) +
                                                (size_t)(row % TK) * S::TPITCH + 16 * k);
          dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
          dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
        }
        __syncthreads();
        cbuf = 0;
      }
      if (tile + 1 < te) issue(tile + 1, (it + 1) & 1);
      else if (next >= 0 && !tree && part_begin(next) < part_begin(next + 1)) issue(part_begin(next), (it + 1) & 1);
      const uint16_t* kt_s = kv_t + (size_t)(cbuf * 2) * (S::TILE / 2);
      const uint16_t* vt_s = kt_s + S::TILE / 2;

      // ---- partial scores over this warp's 64 columns
      float sc[MT][NT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) sc[mt][nt][i] = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int kp = 0; kp < 2; ++kp) {  // two k16 tiles per ldmatrix.x4
          uint32_t b[4];
          ldsm_x4(b, kt_s + (size_t)(nt * 8 + (lane & 7)) * S::TPITCH + 64 * warp + 32 * kp + 8 * (lane >> 3));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            if (16 * mt >= vrows) break;
            Mm::mma(sc[mt][nt], qa[mt][2 * kp][0], qa[mt][2 * kp][1], qa[mt][2 * kp][2], qa[mt][2 * kp][3], b[0], b[1]);
            Mm::mma(sc[mt][nt], qa[mt][2 * kp + 1][0], qa[mt][2 * kp + 1][1], qa[mt][2 * kp + 1][2],
                    qa[mt][2 * kp + 1][3], b[2], b[3]);
          }
        }
      }
      float* myred = red + (size_t)warp * R * S::RPITCH;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (16 * mt >= vrows) break;
          *reinterpret_cast<float2*>(myred + (mt * 16 + gid) * S::RPITCH + nt * 8 + 2 * t4) =
              make_float2(sc[mt][nt][0], sc[mt][nt][1]);
          *reinterpret_cast<float2*>(myred + (mt * 16 + gid + 8) * S::RPITCH + nt * 8 + 2 * t4) =
              make_float2(sc[mt][nt][2], sc[mt][nt][3]);
        }
      __syncthreads();

      // ---- online softmax: warp w owns rows w, w + NWARP, ...; lane owns keys lane (+32)
      for (int r = warp; r < vrows; r += NWARP) {
        const int qi = q0 + r / G, P = p0 + qi;
        const int hv = KV_HI ? (qi < m ? max(P, __ldg(kv_hi + qi)) : P) : CAUSAL ? P : p0 + s_end - 1;
        constexpr int KPL = (TK + 31) / 32;  // keys per lane (a 16-key tile leaves lanes 16..31 idle)
        float s[KPL];
        float mx = -INFINITY;
#pragma unroll
        for (int h = 0; h < KPL; ++h) {
          const int kk = lane + 32 * h, j = tile * TK + kk;
          float v = 0.f;
          if (kk < TK) {
#pragma unroll
            for (int w = 0; w < NWARP; ++w) v += red[((size_t)w * R + r) * S::RPITCH + kk];
          }
          const bool vis = kk < TK && (r / G < nq) && j >= lo && j <= hv && (WINDOW == 0 || P - j < WINDOW);
          s[h] = vis ? v * scale_log2 : -INFINITY;
          mx = fmaxf(mx, s[h]);
        }
        mx = warp_max(mx);
        const float m_old = st_m[r], m_new = fmaxf(m_old, mx);
        float sum = 0.f;
#pragma unroll
        for (int h = 0; h < KPL; ++h) {
          const float pv = s[h] == -INFINITY ? 0.f : exp2f(s[h] - m_new);
          sum += pv;
          if (lane + 32 * h < TK) {
            if constexpr (KVT == KV_FP8) pbuf[r * S::PPITCH + lane + 32 * h] = __half_as_ushort(__float2half_rn(pv));
            else pbuf[r * S::PPITCH + lane + 32 * h] = __bfloat16_as_ushort(__float2bfloat16_rn(pv));
          }
        }
        sum = warp_sum(sum);
        // every lane has read st_m[r] above before lane 0 rewrites it (shuffles order no shared memory access:
        // compute-sanitizer's racecheck flagged this pair in every prefill and vision attention launch)
        __syncwarp();
        if (lane == 0) {
          const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_old - m_new);
          st_a[r] = alpha;
          st_l[r] = st_l[r] * alpha + sum;
          st_m[r] = m_new;
        }
      }
      __syncthreads();

      // ---- O = O * alpha + P V over this warp's 64 columns
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float a0 = st_a[mt * 16 + gid], a1 = st_a[mt * 16 + gid + 8];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          o[mt][nt][0] *= a0; o[mt][nt][1] *= a0; o[mt][nt][2] *= a1; o[mt][nt][3] *= a1;
        }
      }
#pragma unroll
      for (int kt = 0; kt < TK / 16; ++kt) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          if (16 * mt < vrows)
            ldsm_x4(pa[mt], pbuf + (size_t)(mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * S::PPITCH + kt * 16 +
                                8 * (lane >> 4));
#pragma unroll
        for (int np = 0; np < 4; ++np) {  // pairs of n8 column tiles
          uint32_t b[4];
          ldsm_x4_t(b, vt_s + (size_t)(kt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * S::TPITCH + 64 * warp +
                           16 * np + 8 * (lane >> 4));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            if (16 * mt >= vrows) break;
            Mm::mma(o[mt][2 * np], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b[0], b[1]);
            Mm::mma(o[mt][2 * np + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();

    // ---- write out: normalised (NSPLIT == 1) or partial O + (max, sum), merged by the group's last split block
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = mt * 16 + gid + 8 * h;
        if (r / G >= nq) continue;
        const int qi = q0 + r / G, head = hkv * G + r % G;
        const size_t row = (size_t)qi * HQ + head;
        if constexpr (NSPLIT == 1) {
          const float l = st_l[r], inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            __half2 v = __floats2half2_rn(o[mt][nt][2 * h] * inv, o[mt][nt][2 * h + 1] * inv);
            *reinterpret_cast<__half2*>(out + row * D + 64 * warp + nt * 8 + 2 * t4) = v;
          }
        } else {
          float* wo = ws + ((size_t)part * MMAX * HQ + row) * D;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
            *reinterpret_cast<float2*>(wo + 64 * warp + nt * 8 + 2 * t4) =
                make_float2(o[mt][nt][2 * h], o[mt][nt][2 * h + 1]);
          if (warp == 0 && t4 == 0) {
            float* ml = ws + (size_t)NSPLIT * MMAX * HQ * D + ((size_t)part * MMAX * HQ + row) * 2;
            ml[0] = st_m[r];
            ml[1] = st_l[r];
          }
        }
      }
    }
    // st_a (the rescale factors) now holds the arrival flag, the K/V tiles the merge scratch
    if constexpr (NSPLIT > 1) {
      static_assert(split_scratch_bytes(D, R, NSPLIT, NSUB) <= S::KV_BYTES, "split merge scratch exceeds the tiles");
      static_assert(merge_scratch_bytes(NSPLIT, G) <= S::KV_BYTES, "a one-query one-level merge exceeds the tiles");
      // counted once a block (one level), or when the block leaves a level-1 subgroup (two levels): one fence and
      // atomic for all its parts there, not one a part
      constexpr int S1 = NSPLIT / NSUB;
      ++done;
      if (merged && (next < 0 || (tree && next / S1 != part / S1))) {
        attn_split_count<D, HQ, G, MMAX, THREADS, NSPLIT, NSUB>(ws, counters, out, qb * HKV + hkv, nparts, part / S1,
                                                                done, q0, nq, hkv, reinterpret_cast<int*>(st_a), smem);
        done = 0;
      }
    }
    if (next < 0) break;
    part = next;
    tb = part_begin(part);
    te = part_begin(part + 1);
    __syncthreads();  // the write-out's (max, sum) reads and any merge are done before the next part's state
    reset_state();
    if (tree && tb < te) issue(tb, it & 1);  // after the subgroup merge that may have used the K/V tiles
  }
}

}  // namespace thorgen
