// CSR SDDMM: out[nnz_ids[p]] = data[p] * dot(X[row(p)], Y[indices[p]]).
//
// One parametrised body; Python emits one extern "C" wrapper per parameter set (SPC_SDDMM_INSTANCE).
// Data reuse, in the spirit of GE-SpMM's row caching: a warp owns one segment (a bounded run of
// nonzeros of ONE row, so the X row is shared by all of them), the X row slice each lane needs is
// held in registers when K fits one tile (else it is re-read per nonzero, hot in L1), and the warp's
// 32 lanes are cut into groups of G lanes, each group computing one nonzero's dot product with
// coalesced VEC-wide loads of the Y row and a shuffle reduction inside the group.
//
// Compile-time: G (lanes per nonzero: 4/8/16/32), VEC (1/2/4 floats per load, K % VEC == 0 and
// aligned pointers; the launcher falls back to VEC=1), XC (column chunks per lane = K tile width
// G*VEC*XC; the unrolled chunks give that many independent loads in flight).
// Run-time: K, warps per block, the segment partition (nonzeros per warp) built in Python.
#include <cuda_runtime.h>

namespace spc {

template <int VEC> __device__ __forceinline__ void ld(const float* __restrict__ p, float* v) {
  if (VEC == 4) { float4 t = __ldg(reinterpret_cast<const float4*>(p)); v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; }
  else if (VEC == 2) { float2 t = __ldg(reinterpret_cast<const float2*>(p)); v[0] = t.x; v[1] = t.y; }
  else { v[0] = __ldg(p); }
}

template <int G, int VEC, int XC>
__device__ __forceinline__ void sddmm_csr(
    const int* __restrict__ seg_ptr, const int* __restrict__ seg_xrow, const int* __restrict__ indices,
    const float* __restrict__ data, const int* __restrict__ nnz_ids, const float* __restrict__ X,
    const float* __restrict__ Y, float* __restrict__ out, int nseg, int K) {
  const int warp = (int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32);
  if (warp >= nseg) return;
  const int lane = threadIdx.x % G;
  const int grp = (threadIdx.x % 32) / G;
  constexpr int NG = 32 / G;                       // nonzeros in flight per warp
  constexpr int TILE = G * VEC * XC;
  const unsigned gmask = (G == 32) ? 0xffffffffu : (((1u << G) - 1u) << (grp * G));
  const int lo = seg_ptr[warp], hi = seg_ptr[warp + 1];
  const float* xrow = X + (size_t)seg_xrow[warp] * K;
  const bool one_tile = K <= TILE;

  float xr[XC][VEC];                               // X row slice kept in registers (one tile)
  if (one_tile) {
#pragma unroll
    for (int c = 0; c < XC; ++c) {
      const int col = c * G * VEC + lane * VEC;
      if (col < K) ld<VEC>(xrow + col, xr[c]);
      else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) xr[c][v] = 0.0f;
      }
    }
  }
  for (int p = lo + grp; p - grp < hi; p += NG) {  // every group runs the same trip count
    const bool valid = p < hi;
    const float* yrow = Y + (size_t)(valid ? indices[p] : 0) * K;
    float acc = 0.0f;
    if (valid) {
      if (one_tile) {
#pragma unroll
        for (int c = 0; c < XC; ++c) {
          const int col = c * G * VEC + lane * VEC;
          if (col < K) {
            float yv[VEC];
            ld<VEC>(yrow + col, yv);
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc = fmaf(xr[c][v], yv[v], acc);
          }
        }
      } else {
        for (int t = 0; t < K; t += TILE) {
#pragma unroll
          for (int c = 0; c < XC; ++c) {
            const int col = t + c * G * VEC + lane * VEC;
            if (col < K) {
              float yv[VEC], xv[VEC];
              ld<VEC>(yrow + col, yv);
              ld<VEC>(xrow + col, xv);
#pragma unroll
              for (int v = 0; v < VEC; ++v) acc = fmaf(xv[v], yv[v], acc);
            }
          }
        }
      }
    }
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(gmask, acc, off, G);
    if (valid && lane == 0) out[nnz_ids[p]] = data[p] * acc;
  }
}

}  // namespace spc

#define SPC_SDDMM_INSTANCE(NAME, G, VEC, XC)                                                        \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                           \
      const int* seg_ptr, const int* seg_xrow, const int* indices, const float* data,               \
      const int* nnz_ids, const float* X, const float* Y, float* out, int nseg, int K) {            \
    spc::sddmm_csr<G, VEC, XC>(seg_ptr, seg_xrow, indices, data, nnz_ids, X, Y, out, nseg, K);      \
  }
