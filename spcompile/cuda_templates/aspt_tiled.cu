// ASpT-style tiled SpMM (Hong et al. PPoPP'19; with row clustering: Jiang et al. PPoPP'20) on the
// tile.aspt layout:  Y[row_ids[r], :] = sum_dense A[r, c] X[c, :] + sum_remainder A[r, c] X[c, :].
//
// One thread block per (row panel, K slice of KT = 32 * VEC * CF columns).  Warp w owns the panel
// rows w, w + nwarps, ... (RPW of them) and keeps their KT-column slices in registers.
//   Dense phase: the panel's dense columns are processed in chunks of `chunk` columns; for each
//   chunk the block stages X[dense column, K slice] in shared memory once (coalesced vector loads),
//   then every dense entry of the panel reads its X row from shared memory (each row's dense
//   entries are sorted by slot, so a per-row cursor walks them chunk by chunk).
//   Remainder phase: each row's other entries, CRC style (GE-SpMM): the warp loads 32 (column,
//   value) pairs coalesced, broadcasts them by shuffles and streams the X rows from global memory
//   with CF x VEC-wide loads (CWM).
// Each output row is written once (no atomics, no read-modify-write); rows without entries get 0.
//
// Compile-time: VEC (vector width of X loads / Y stores; K % VEC == 0 and aligned pointers, else
// the VEC=1 instance is launched), CF (column slices per lane), RPW (rows per warp).
// Run time: panel height H (= tile.aspt's panel_height; nwarps = ceil(H / RPW)), chunk, K.
#include <cuda_runtime.h>

namespace spc_aspt {

template <int VEC> __device__ __forceinline__ void ld(const float* p, float* v) {
  if (VEC == 4) { float4 t = __ldg(reinterpret_cast<const float4*>(p)); v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; }
  else if (VEC == 2) { float2 t = __ldg(reinterpret_cast<const float2*>(p)); v[0] = t.x; v[1] = t.y; }
  else v[0] = __ldg(p);
}
template <int VEC> __device__ __forceinline__ void lds(const float* p, float* v) {
  if (VEC == 4) { float4 t = *reinterpret_cast<const float4*>(p); v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; }
  else if (VEC == 2) { float2 t = *reinterpret_cast<const float2*>(p); v[0] = t.x; v[1] = t.y; }
  else v[0] = *p;
}
template <int VEC> __device__ __forceinline__ void st(float* p, const float* v) {
  if (VEC == 4) *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  else if (VEC == 2) *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
  else p[0] = v[0];
}

template <int VEC, int CF, int RPW>
__device__ __forceinline__ void aspt_spmm(
    const int* __restrict__ dense_ptr, const int* __restrict__ dense_xrow,
    const int* __restrict__ tile_ptr, const int* __restrict__ tile_slot, const float* __restrict__ tile_val,
    const int* __restrict__ rem_ptr, const int* __restrict__ rem_col, const float* __restrict__ rem_val,
    const int* __restrict__ row_ids, const float* __restrict__ X, float* __restrict__ Y,
    int m, int K, int H, int chunk) {
  extern __shared__ __align__(16) float xs[];      // chunk x KT staged X slices
  constexpr int KT = 32 * VEC * CF;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nwarps = blockDim.x >> 5;
  const int panel = blockIdx.x;
  const int kt0 = blockIdx.y * KT;
  float acc[RPW][CF][VEC];
  int cur[RPW], end[RPW];
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    const int i = warp + j * nwarps;
    const int row = panel * H + i;
    const bool ok = i < H && row < m;
    cur[j] = ok ? tile_ptr[row] : 0;
    end[j] = ok ? tile_ptr[row + 1] : 0;
#pragma unroll
    for (int c = 0; c < CF; ++c)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[j][c][v] = 0.0f;
  }

  // ---- dense tiles: X rows staged in shared memory, chunk by chunk
  const int d0 = dense_ptr[panel], nd = dense_ptr[panel + 1] - d0;
  for (int c0 = 0; c0 < nd; c0 += chunk) {
    const int nc = min(chunk, nd - c0);
    __syncthreads();                                 // previous chunk no longer read
    for (int i = threadIdx.x; i < nc * (KT / VEC); i += blockDim.x) {
      const int s = i / (KT / VEC), q = (i % (KT / VEC)) * VEC;
      const int col = kt0 + q;
      float v[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[e] = 0.0f;
      if (col < K) ld<VEC>(X + (size_t)dense_xrow[d0 + c0 + s] * K + col, v);
      st<VEC>(xs + s * KT + q, v);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < RPW; ++j) {
      int p = cur[j];
      const int e = end[j];
      while (p < e) {
        const int s = tile_slot[p] - c0;
        if (s >= nc) break;
        const float a = tile_val[p];
#pragma unroll
        for (int c = 0; c < CF; ++c) {
          float v[VEC];
          lds<VEC>(xs + s * KT + c * 32 * VEC + lane * VEC, v);
#pragma unroll
          for (int u = 0; u < VEC; ++u) acc[j][c][u] += a * v[u];
        }
        ++p;
      }
      cur[j] = p;
    }
  }

  // ---- remainder: CSR rows, coalesced row caching through shuffles, X from global memory
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    const int i = warp + j * nwarps;
    const int row = panel * H + i;
    if (i >= H || row >= m) continue;                // uniform per warp
    const int lo = rem_ptr[row], hi = rem_ptr[row + 1];
    for (int base = lo; base < hi; base += 32) {
      const int n = min(32, hi - base);
      int mc = 0;
      float mv = 0.0f;
      if (lane < n) { mc = rem_col[base + lane]; mv = rem_val[base + lane]; }
#pragma unroll 4
      for (int e = 0; e < n; ++e) {
        const int col = __shfl_sync(0xffffffffu, mc, e);
        const float a = __shfl_sync(0xffffffffu, mv, e);
        const float* xr = X + (size_t)col * K;
#pragma unroll
        for (int c = 0; c < CF; ++c) {
          const int k = kt0 + c * 32 * VEC + lane * VEC;
          if (k < K) {
            float v[VEC];
            ld<VEC>(xr + k, v);
#pragma unroll
            for (int u = 0; u < VEC; ++u) acc[j][c][u] += a * v[u];
          }
        }
      }
    }
  }

  // ---- write each row once, caller's order
#pragma unroll
  for (int j = 0; j < RPW; ++j) {
    const int i = warp + j * nwarps;
    const int row = panel * H + i;
    if (i >= H || row >= m) continue;
    float* yr = Y + (size_t)row_ids[row] * K;
#pragma unroll
    for (int c = 0; c < CF; ++c) {
      const int k = kt0 + c * 32 * VEC + lane * VEC;
      if (k < K) st<VEC>(yr + k, acc[j][c]);
    }
  }
}

}  // namespace spc_aspt

#define SPC_ASPT_SPMM_INSTANCE(NAME, VEC, CF, RPW)                                                  \
  extern "C" __global__ void __launch_bounds__(1024) NAME(                                          \
      const int* dense_ptr, const int* dense_xrow, const int* tile_ptr, const int* tile_slot,       \
      const float* tile_val, const int* rem_ptr, const int* rem_col, const float* rem_val,          \
      const int* row_ids, const float* X, float* Y, int m, int K, int H, int chunk) {               \
    spc_aspt::aspt_spmm<VEC, CF, RPW>(dense_ptr, dense_xrow, tile_ptr, tile_slot, tile_val,         \
                                      rem_ptr, rem_col, rem_val, row_ids, X, Y, m, K, H, chunk);    \
  }
