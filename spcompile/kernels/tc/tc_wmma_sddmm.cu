// Tensor-core SDDMM on the tile.sgt layout (TC-GNN's SDDMM, Wang et al. ATC'23):
//   out[nz_out[i]] = nz_val[i] * C_b[nz_pos[i]]   for the nonzeros i of TC block b, where
//   C_b (16 x BW) = X[row_ids of the window's 16 rows] (16 x K) @ Y[blk_cols_b]^T (K x BW).
//
// One warp per TC block (consecutive warps take consecutive blocks, so the blocks of one window
// share the X rows in L1).  The K dimension is walked in chunks of 32 features; inside a chunk the
// MMA's k index is mapped to features so that every lane loads whole float4s:
//   lane (g = lane / 4, t = lane % 4) loads X[row g], X[row g + 8] and Y[block column g of each
//   n-tile] at features kc + 4t .. 4t+3 (q = 0) and kc + 16 + 4t .. 4t+3 (q = 1);
//   tf32 (m16n8k8), k-step j = 0..3: MMA k index t <-> element j of q = 0, k index t + 4 <->
//     element j of q = 1 (A: a0 = X[g], a1 = X[g+8], a2 / a3 the same rows at k + 4; B: b0, b1);
//   fp16 / bf16 (m16n8k16), k-step j = 0..1: k indices 2t, 2t+1 <-> elements 2j, 2j+1 of q = 0,
//     k indices 2t+8, 2t+9 <-> elements 2j, 2j+1 of q = 1.
// A and B use the same mapping, so every feature is multiplied exactly once.  The 16 x BW result
// (fp32 accumulate) goes through shared memory, then the warp's lanes write the block's nonzeros.
//
// Compile-time: P (0 tf32, 1 fp16, 2 bf16), BW (8 or 16), KU (feature chunks per iteration, for
// loads in flight), VEC (4: float4 loads, needs K % 4 == 0 and 16-byte aligned X and Y; 1: any K;
// 8 for TI = 1), TI (0: fp32 X / Y / out; 1: X, Y and out in P's 16-bit type).
//
// 16-bit inputs (TI = 1, P = 1 fp16 / 2 bf16): the K dimension is walked in chunks of 64
// features; lane (g, t) loads 8 consecutive 16-bit values (one 16-byte load) of X[row g],
// X[row g + 8] and Y[block column g of each n-tile] at features kc + 8t .. 8t+7 (q = 0) and
// kc + 32 + 8t .. 8t+7 (q = 1); k-step j = 0..3 uses 32-bit word j of each load: k indices 2t, 2t+1
// <-> features kc + 8t + 2j, +1 (q = 0), k indices 2t+8, 2t+9 <-> the same of q = 1.  The loaded
// words are the MMA operands as they are (no conversion); the output is rounded once.
#include "tc_frag.cuh"

namespace spc_tcs {
using namespace spc_tcf;

template <int P, int BW, int KU, int VEC, int TI>
__device__ __forceinline__ void tc_sddmm(
    const int* __restrict__ blk_win, const int* __restrict__ blk_cols, const int* __restrict__ nz_ptr,
    const unsigned char* __restrict__ nz_pos, const float* __restrict__ nz_val, const int* __restrict__ nz_out,
    const int* __restrict__ row_ids, const void* __restrict__ Xv, const void* __restrict__ Yv,
    void* __restrict__ outv, int nblk, int m, int K) {
  static_assert(!TI || P != 0, "16-bit inputs run with the MMA of their own type");
  constexpr int NT = BW / 8;                         // n-tiles (8 block columns each)
  __shared__ float Cs[8][16 * BW];                   // per warp (at most 8 warps per block)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const long long b = (long long)blockIdx.x * (blockDim.x >> 5) + warp;
  if (b >= nblk) return;                             // uniform per warp; no block barriers
  const int win = __ldg(blk_win + b);
  const int r0 = win * 16 + g, r1 = r0 + 8;
  const int xr0 = r0 < m ? __ldg(row_ids + r0) : -1, xr1 = r1 < m ? __ldg(row_ids + r1) : -1;
  int yc[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) yc[n] = __ldg(blk_cols + b * BW + 8 * n + g);

  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[n][r] = 0.0f;

  if constexpr (TI != 0) {
    const unsigned short* X = reinterpret_cast<const unsigned short*>(Xv);
    const unsigned short* Y = reinterpret_cast<const unsigned short*>(Yv);
    for (int kc0 = 0; kc0 < K; kc0 += 64 * KU) {
      uint4 xa[KU][2][2], yb[KU][NT][2];
#pragma unroll
      for (int u = 0; u < KU; ++u)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int col = kc0 + 64 * u + 32 * q + 8 * t;
          xa[u][0][q] = ld8h<VEC>(X, xr0, col, K);
          xa[u][1][q] = ld8h<VEC>(X, xr1, col, K);
#pragma unroll
          for (int n = 0; n < NT; ++n) yb[u][n][q] = ld8h<VEC>(Y, yc[n], col, K);
        }
#pragma unroll
      for (int u = 0; u < KU; ++u)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const unsigned a[4] = {wd(xa[u][0][0], j), wd(xa[u][1][0], j), wd(xa[u][0][1], j), wd(xa[u][1][1], j)};
#pragma unroll
          for (int n = 0; n < NT; ++n) mma16816<P == 0 ? 1 : P>(acc[n], a, wd(yb[u][n][0], j), wd(yb[u][n][1], j));
        }
    }
  } else {
  const float* X = reinterpret_cast<const float*>(Xv);
  const float* Y = reinterpret_cast<const float*>(Yv);
  for (int kc0 = 0; kc0 < K; kc0 += 32 * KU) {
    float4 xa[KU][2][2], yb[KU][NT][2];
#pragma unroll
    for (int u = 0; u < KU; ++u)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int col = kc0 + 32 * u + 16 * q + 4 * t;
        xa[u][0][q] = ld4<VEC>(X, xr0, col, K);
        xa[u][1][q] = ld4<VEC>(X, xr1, col, K);
#pragma unroll
        for (int n = 0; n < NT; ++n) yb[u][n][q] = ld4<VEC>(Y, yc[n], col, K);
      }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      if (P == 0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const unsigned a[4] = {f2tf32(el(xa[u][0][0], j)), f2tf32(el(xa[u][1][0], j)),
                                 f2tf32(el(xa[u][0][1], j)), f2tf32(el(xa[u][1][1], j))};
#pragma unroll
          for (int n = 0; n < NT; ++n)
            mma16816<0>(acc[n], a, f2tf32(el(yb[u][n][0], j)), f2tf32(el(yb[u][n][1], j)));
        }
      } else {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const unsigned a[4] = {pack2<P>(el(xa[u][0][0], 2 * j), el(xa[u][0][0], 2 * j + 1)),
                                 pack2<P>(el(xa[u][1][0], 2 * j), el(xa[u][1][0], 2 * j + 1)),
                                 pack2<P>(el(xa[u][0][1], 2 * j), el(xa[u][0][1], 2 * j + 1)),
                                 pack2<P>(el(xa[u][1][1], 2 * j), el(xa[u][1][1], 2 * j + 1))};
#pragma unroll
          for (int n = 0; n < NT; ++n)
            mma16816<P>(acc[n], a, pack2<P>(el(yb[u][n][0], 2 * j), el(yb[u][n][0], 2 * j + 1)),
                   pack2<P>(el(yb[u][n][1], 2 * j), el(yb[u][n][1], 2 * j + 1)));
        }
      }
    }
  }
  }
  // C fragment: c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g + 8, same cols) of each n-tile
  float* cs = Cs[warp];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int c = 8 * n + 2 * t;
    cs[g * BW + c] = acc[n][0];
    cs[g * BW + c + 1] = acc[n][1];
    cs[(g + 8) * BW + c] = acc[n][2];
    cs[(g + 8) * BW + c + 1] = acc[n][3];
  }
  __syncwarp();
  const int lo = __ldg(nz_ptr + b), hi = __ldg(nz_ptr + b + 1);
  for (int i = lo + lane; i < hi; i += 32) {
    const float v = __ldg(nz_val + i) * cs[nz_pos[i]];
    if constexpr (TI != 0) reinterpret_cast<unsigned short*>(outv)[__ldg(nz_out + i)] = f2h<P == 0 ? 1 : P>(v);
    else reinterpret_cast<float*>(outv)[__ldg(nz_out + i)] = v;
  }
}

}  // namespace spc_tcs

#define SPC_TC_SDDMM_INSTANCE(NAME, P, BW, KU, VEC, TI)                                             \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                           \
      const int* blk_win, const int* blk_cols, const int* nz_ptr, const unsigned char* nz_pos,      \
      const float* nz_val, const int* nz_out, const int* row_ids, const void* X, const void* Y,     \
      void* out, int nblk, int m, int K) {                                                          \
    spc_tcs::tc_sddmm<P, BW, KU, VEC, TI>(blk_win, blk_cols, nz_ptr, nz_pos, nz_val, nz_out, row_ids, X, Y, \
                                      out, nblk, m, K);                                             \
  }
