// thorgen embedding gather: out[t, :] = float(table[ids[t], :]) * scale   (bf16 table -> fp32 or bf16 rows).
// mask_id >= 0 builds DFlash blocks of `block` rows: a block's row 0 embeds its ids entry (the last committed token
// of its sequence), its other rows embed mask_id (a batched draft step holds several blocks, one a sequence).
// Out-of-range ids write NaN rows (the runtime validates ids; NaN makes a missed check visible, never a wild read).
#pragma once
#include "thorgen/common.cuh"

namespace thorgen {

template <int H, int THREADS, typename TO>
__device__ void embed_rows(const int32_t* __restrict__ ids, const __nv_bfloat16* __restrict__ table, TO* __restrict__ out,
                           int T, int V, float scale, int mask_id, int block = 1) {
  static_assert(H % 8 == 0, "hidden size must be a multiple of 8 (16-byte row loads)");
  static_assert(THREADS % 32 == 0, "block size must be a multiple of 32");
  for (int row = blockIdx.x; row < T; row += gridDim.x) {
    const int id = (mask_id >= 0 && row % block > 0) ? mask_id : ids[row];
    const bool ok = id >= 0 && id < V;
    const uint4* src = reinterpret_cast<const uint4*>(table + (long)(ok ? id : 0) * H);
    for (int c = threadIdx.x; c < H / 8; c += THREADS) {
      uint4 raw = src[c];
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        st(out + (long)row * H, c * 8 + k, ok ? __bfloat162float(e[k]) * scale : __int_as_float(0x7fc00000));
    }
  }
}

}  // namespace thorgen
