// CSR SDDMM: out[nnz_ids[p]] = data[p] * dot(X[row(p)], Y[indices[p]]).
//
// One parametrised body; Python emits one extern "C" wrapper per parameter set (SPC_SDDMM_INSTANCE).
// Data reuse, in the spirit of GE-SpMM's row caching: a warp owns one segment (a bounded run of
// nonzeros of ONE row, so the X row is shared by all of them), the X row slice each lane needs is
// held in registers when K fits one tile (else it is re-read per nonzero, hot in L1), and the warp's
// 32 lanes are cut into groups of G lanes, each group computing one nonzero's dot product with
// coalesced VEC-wide loads of the Y row and a shuffle reduction inside the group.
//
// Compile-time: T (element type of X, Y and out: float, __half or __nv_bfloat16; A's values stay
// float, products and sums are fp32, out is rounded to T once), G (lanes per nonzero: 4/8/16/32),
// VEC (elements per load: 1/2/4, and 8 for 16-bit T -- at most 16 bytes; K % VEC == 0 and aligned
// pointers, the launcher falls back to VEC=1), XC (column chunks per lane = K tile width G*VEC*XC;
// the unrolled chunks give that many independent loads in flight), FLAT (the segment layout, below),
// U (entries a group has in flight, parameter unroll: 1, 2 or 4; below the segments' loop).
// Run-time: K, warps per block, the segment partition (nonzeros per warp) built in Python.
//
// FLAT = 0: a segment is a run of at most nnz_per_warp nonzeros of ONE row (seg_xrow names its X
// row; nnz_row is unused).  FLAT = 1 (nonzero-parallel, for short rows: with ~5 nonzeros per row
// most groups of a one-row segment would idle): seg_ptr cuts [0, nnz) into plain runs of
// nnz_per_warp stored entries that may span rows, and each group reads the X row of ITS nonzero,
// nnz_row[p] (consecutive nonzeros mostly share a row, so those X loads hit L1); the X row is
// never held in registers (K is always tiled by G*VEC*XC); seg_xrow is unused.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace spc {
namespace sddmm_detail {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f(float x, float* o) { *o = x; }
__device__ __forceinline__ void from_f(float x, __half* o) { *o = __float2half_rn(x); }
__device__ __forceinline__ void from_f(float x, __nv_bfloat16* o) { *o = __float2bfloat16_rn(x); }

template <int BYTES> struct raw_t;
template <> struct raw_t<2> { typedef unsigned short type; };
template <> struct raw_t<4> { typedef unsigned int type; };
template <> struct raw_t<8> { typedef uint2 type; };
template <> struct raw_t<16> { typedef uint4 type; };
template <typename T, int VEC> union pack_t {
  typename raw_t<sizeof(T) * VEC>::type raw;
  T e[VEC];
};

}  // namespace sddmm_detail

template <typename T, int VEC> __device__ __forceinline__ void ld(const T* __restrict__ p, float* v) {
  typedef typename sddmm_detail::raw_t<sizeof(T) * VEC>::type RT;
  sddmm_detail::pack_t<T, VEC> u;
  u.raw = __ldg(reinterpret_cast<const RT*>(p));
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = sddmm_detail::to_f(u.e[i]);
}

// one VEC-wide load kept packed (a 16-byte load is 4 registers whatever T is), converted where used
template <typename T, int VEC> __device__ __forceinline__ void ld_raw(const T* __restrict__ p, sddmm_detail::pack_t<T, VEC>& u) {
  typedef typename sddmm_detail::raw_t<sizeof(T) * VEC>::type RT;
  u.raw = __ldg(reinterpret_cast<const RT*>(p));
}

template <typename T, int G, int VEC, int XC, int FLAT, int U>
__device__ __forceinline__ void sddmm_csr(
    const int* __restrict__ seg_ptr, const int* __restrict__ seg_xrow, const int* __restrict__ nnz_row,
    const int* __restrict__ indices, const float* __restrict__ data, const int* __restrict__ nnz_ids,
    const T* __restrict__ X, const T* __restrict__ Y, T* __restrict__ out, int nseg, int K) {
  const int warp = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32);
  if (warp >= nseg) return;
  const int lane = threadIdx.x % G;
  const int grp = (threadIdx.x % 32) / G;
  constexpr int NG = 32 / G;                       // nonzeros in flight per warp
  constexpr int TILE = G * VEC * XC;
  const unsigned gmask = (G == 32) ? 0xffffffffu : (((1u << G) - 1u) << (grp * G));
  const int lo = seg_ptr[warp], hi = seg_ptr[warp + 1];
  const T* xrow = FLAT ? X : X + (size_t)seg_xrow[warp] * K;   // FLAT: set per nonzero below
  const bool one_tile = !FLAT && K <= TILE;

  float xr[XC][VEC];                               // X row slice kept in registers (one tile)
  if (one_tile) {
#pragma unroll
    for (int c = 0; c < XC; ++c) {
      const int col = c * G * VEC + lane * VEC;
      if (col < K) ld<T, VEC>(xrow + col, xr[c]);
      else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) xr[c][v] = 0.0f;
      }
    }
  }
  if constexpr (U == 1) {
    // one entry at a time a group: its column id, then its Y row
    for (int p = lo + grp; p - grp < hi; p += NG) {  // every group runs the same trip count
      const bool valid = p < hi;
      const T* yrow = Y + (size_t)(valid ? indices[p] : 0) * K;
      float acc = 0.0f;
      if (valid) {
        if (one_tile) {
#pragma unroll
          for (int c = 0; c < XC; ++c) {
            const int col = c * G * VEC + lane * VEC;
            if (col < K) {
              float yv[VEC];
              ld<T, VEC>(yrow + col, yv);
#pragma unroll
              for (int v = 0; v < VEC; ++v) acc = fmaf(xr[c][v], yv[v], acc);
            }
          }
        } else {
          if (FLAT) xrow = X + (size_t)nnz_row[p] * K;
          for (int t = 0; t < K; t += TILE) {
#pragma unroll
            for (int c = 0; c < XC; ++c) {
              const int col = t + c * G * VEC + lane * VEC;
              if (col < K) {
                float yv[VEC], xv[VEC];
                ld<T, VEC>(yrow + col, yv);
                ld<T, VEC>(xrow + col, xv);
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc = fmaf(xv[v], yv[v], acc);
              }
            }
          }
        }
      }
#pragma unroll
      for (int off = G / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(gmask, acc, off, G);
      if (valid && lane == 0) sddmm_detail::from_f(data[p] * acc, out + nnz_ids[p]);
    }
  } else {
    // The segment is read 32 entries at a time: lane l of the warp loads entry base + l's column
    // id, value and output position (one coalesced load each; with FLAT its X row), and every group
    // takes its entries from there by shuffles, U of them at once (parameter unroll): U entries'
    // rows are loaded before any is used (U x XC loads in flight a lane instead of one entry's chain
    // of an id load then a row load).  Each entry's dot product is summed in the same order
    // whatever U is.
    const int wl = threadIdx.x % 32;
    for (int base = lo; base < hi; base += 32) {     // warp-uniform
      const int nc = min(32, hi - base);
      const bool mine = wl < nc;
      const int c_col = mine ? indices[base + wl] : 0;
      const float c_val = mine ? data[base + wl] : 0.0f;
      const int c_id = mine ? nnz_ids[base + wl] : 0;
      const int c_row = (FLAT && mine) ? nnz_row[base + wl] : 0;
      for (int j0 = 0; j0 < nc; j0 += NG * U) {      // warp-uniform: every group runs the same trip count
        int ycol[U], xr_row[U];                      // the entries' Y row (column id) and, with FLAT, X row
        bool valid[U];
        float acc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int j = j0 + u * NG + grp;
          valid[u] = j < nc;
          ycol[u] = __shfl_sync(0xffffffffu, c_col, j & 31);
          xr_row[u] = FLAT ? __shfl_sync(0xffffffffu, c_row, j & 31) : 0;
          acc[u] = 0.0f;
        }
        typedef sddmm_detail::pack_t<T, VEC> PK;
        if (one_tile) {
          PK yv[U][XC];
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int c = 0; c < XC; ++c) {
              const int col = c * G * VEC + lane * VEC;
              if (valid[u] && col < K) ld_raw<T, VEC>(Y + (size_t)ycol[u] * K + col, yv[u][c]);
            }
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int c = 0; c < XC; ++c) {
              const int col = c * G * VEC + lane * VEC;
              if (valid[u] && col < K) {
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[u] = fmaf(xr[c][v], sddmm_detail::to_f(yv[u][c].e[v]), acc[u]);
              }
            }
        } else {
          // K over several tiles (or FLAT): X and Y slices per tile; UG entries' loads in flight
          // (FLAT: all U, the only path of short rows; one-row segments wider than their tile: one,
          // so that this rare path does not set the registers of the common one)
          constexpr int UG = FLAT ? U : 1;
#pragma unroll
          for (int u0 = 0; u0 < U; u0 += UG) {
            for (int t = 0; t < K; t += TILE) {
              PK yv[UG][XC], xv[UG][XC];
#pragma unroll
              for (int uu = 0; uu < UG; ++uu)
#pragma unroll
                for (int c = 0; c < XC; ++c) {
                  const int u = u0 + uu, col = t + c * G * VEC + lane * VEC;
                  if (valid[u] && col < K) {
                    ld_raw<T, VEC>(Y + (size_t)ycol[u] * K + col, yv[uu][c]);
                    ld_raw<T, VEC>((FLAT ? X + (size_t)xr_row[u] * K : xrow) + col, xv[uu][c]);
                  }
                }
#pragma unroll
              for (int uu = 0; uu < UG; ++uu)
#pragma unroll
                for (int c = 0; c < XC; ++c) {
                  const int u = u0 + uu, col = t + c * G * VEC + lane * VEC;
                  if (valid[u] && col < K) {
#pragma unroll
                    for (int v = 0; v < VEC; ++v)
                      acc[u] = fmaf(sddmm_detail::to_f(xv[uu][c].e[v]), sddmm_detail::to_f(yv[uu][c].e[v]), acc[u]);
                  }
                }
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int off = G / 2; off > 0; off >>= 1) acc[u] += __shfl_xor_sync(gmask, acc[u], off, G);
          const int j = (j0 + u * NG + grp) & 31;
          const float a = __shfl_sync(0xffffffffu, c_val, j);
          const int id = __shfl_sync(0xffffffffu, c_id, j);
          if (valid[u] && lane == 0) sddmm_detail::from_f(a * acc[u], out + id);
        }
      }
    }
  }
}

}  // namespace spc

// TN: 0 float, 1 __half, 2 __nv_bfloat16
#define SPC_SDDMM_ELEM_0 float
#define SPC_SDDMM_ELEM_1 __half
#define SPC_SDDMM_ELEM_2 __nv_bfloat16
#define SPC_SDDMM_ELEM(TN) SPC_SDDMM_ELEM_##TN

// U: entries in flight a group (parameter unroll; SPC_SDDMM_INSTANCE: one)
#define SPC_SDDMM_INSTANCE_U(NAME, TN, G, VEC, XC, FLAT, U)                                         \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                           \
      const int* seg_ptr, const int* seg_xrow, const int* nnz_row, const int* indices,              \
      const float* data, const int* nnz_ids, const SPC_SDDMM_ELEM(TN)* X,                           \
      const SPC_SDDMM_ELEM(TN)* Y, SPC_SDDMM_ELEM(TN)* out, int nseg, int K) {                      \
    spc::sddmm_csr<SPC_SDDMM_ELEM(TN), G, VEC, XC, FLAT, U>(seg_ptr, seg_xrow, nnz_row, indices,    \
                                                            data, nnz_ids, X, Y, out, nseg, K);     \
  }
#define SPC_SDDMM_INSTANCE(NAME, TN, G, VEC, XC, FLAT) SPC_SDDMM_INSTANCE_U(NAME, TN, G, VEC, XC, FLAT, 1)
