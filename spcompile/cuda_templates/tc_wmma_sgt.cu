// TC-GNN style tensor-core SpMM (Wang et al., ATC'23, Algorithm 2) on the tile.sgt layout:
//   Y[row_ids[w*16 + r], :] = sum over the TC blocks b of row window w of  ATile_b (16 x BW) @ X[cols_b] (BW x K)
//
// One thread block per (row window, slice of the K dimension).  Warp v of the block owns TPW
// 16-column tiles of the output (the "dimension split"); it keeps TPW WMMA accumulators for its
// 16 x (16*TPW) output slab across all TC blocks of the window.  Per TC block:
//   * the sparse tile ATile_b: either (DENSE_A = 0, TC-GNN's scheme) CUDA-core threads zero a
//     shared 16 x BW tile and scatter the block's nonzeros into it, or (DENSE_A = 1) the tile is
//     stored dense in global memory at build time and each warp loads its A fragments directly;
//   * the gathered rows X[cols_b, warp's columns] are staged by the warp's lanes in shared memory
//     (coalesced vector loads, converted to the MMA input type), then loaded as B fragments.
// Padding columns of a window's last block (cols_b = -1) stage zero rows.
//
// Compile-time parameters: P (0 tf32 m16n16k8, 1 fp16 m16n16k16, 2 bf16 m16n16k16; accumulation
// is fp32 in all cases), BW (TC block width: 8 or 16, a multiple of the MMA k), TPW (16-column
// tiles per warp), DENSE_A, VEC (4: float4 loads of X, needs K % 4 == 0 and 16-byte aligned X;
// 1: scalar loads, any K).  Warps per block, K and the window count are launch arguments.
// One parametrised body; Python emits one extern "C" wrapper per variant (SPC_TC_SPMM_INSTANCE).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>

namespace spc_tc {
using namespace nvcuda;

template <int P> struct prec;
template <> struct prec<0> {
  typedef float stor;
  typedef wmma::precision::tf32 frag;
  enum { KS = 8, PAD = 4 };
  static __device__ __forceinline__ stor cvt(float x) { return x; }
};
template <> struct prec<1> {
  typedef __half stor;
  typedef __half frag;
  enum { KS = 16, PAD = 8 };
  static __device__ __forceinline__ stor cvt(float x) { return __float2half_rn(x); }
};
template <> struct prec<2> {
  typedef __nv_bfloat16 stor;
  typedef __nv_bfloat16 frag;
  enum { KS = 16, PAD = 8 };
  static __device__ __forceinline__ stor cvt(float x) { return __float2bfloat16_rn(x); }
};

template <int P, typename F> __device__ __forceinline__ void round_frag(F& f) {
  if (P == 0) {
#pragma unroll
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = wmma::__float_to_tf32(f.x[i]);
  }
}

__host__ __device__ constexpr int round_up(int x, int a) { return (x + a - 1) / a * a; }

// shared-memory layout (bytes), all parts 128-byte aligned (WMMA needs 256-bit aligned pointers)
template <int P, int BW, int TPW> struct layout {
  typedef typename prec<P>::stor T;
  enum {
    LDX = 16 * TPW + prec<P>::PAD,                                  // staged X row pitch (elements)
    XS_BYTES = round_up(BW * LDX * (int)sizeof(T), 128),            // per warp
    OS_BYTES = 16 * 16 * 4,                                         // per warp: one fp32 16x16 tile
    AS_BYTES = round_up(16 * BW * (int)sizeof(T), 128),             // per block (scatter mode)
  };
};

template <int P, int BW, int TPW, int DENSE_A, int VEC>
__device__ __forceinline__ void tc_spmm(
    const int* __restrict__ win_block_ptr, const int* __restrict__ blk_cols,
    const typename prec<P>::stor* __restrict__ tiles, const int* __restrict__ nz_ptr,
    const unsigned char* __restrict__ nz_pos, const float* __restrict__ nz_val,
    const int* __restrict__ row_ids, const float* __restrict__ X, float* __restrict__ Y,
    int m, int K) {
  typedef typename prec<P>::stor T;
  typedef layout<P, BW, TPW> L;
  constexpr int KS = prec<P>::KS;
  static_assert(BW % KS == 0, "TC block width must be a multiple of the MMA k");
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nwarps = blockDim.x >> 5;
  T* As = reinterpret_cast<T*>(smem);
  T* Xs = reinterpret_cast<T*>(smem + (DENSE_A ? 0 : L::AS_BYTES) + warp * L::XS_BYTES);
  float* Os = reinterpret_cast<float*>(smem + (DENSE_A ? 0 : L::AS_BYTES) + nwarps * L::XS_BYTES +
                                       warp * L::OS_BYTES);
  const int win = blockIdx.x;
  const int kbase = ((blockIdx.y * nwarps + warp) * TPW) * 16;
  const bool active = kbase < K;                     // uniform per warp
  const int b0 = win_block_ptr[win], b1 = win_block_ptr[win + 1];

  wmma::fragment<wmma::accumulator, 16, 16, KS, float> acc[TPW];
#pragma unroll
  for (int t = 0; t < TPW; ++t) wmma::fill_fragment(acc[t], 0.0f);

  for (int b = b0; b < b1; ++b) {
    if (!DENSE_A) {                                  // CUDA cores build the sparse tile
      __syncthreads();                               // previous tile no longer read
      for (int i = threadIdx.x; i < 16 * BW; i += blockDim.x) As[i] = prec<P>::cvt(0.0f);
      __syncthreads();
      const int lo = nz_ptr[b], hi = nz_ptr[b + 1];
      for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) As[nz_pos[i]] = prec<P>::cvt(nz_val[i]);
      __syncthreads();
    }
    if (active) {
      // stage X[cols_b, kbase : kbase + 16*TPW] (converted) in the warp's buffer
      constexpr int W = 16 * TPW;                    // columns staged per row
      constexpr int NV = BW * W / VEC;               // vector loads per TC block
#pragma unroll
      for (int i = lane; i < NV; i += 32) {
        const int r = i / (W / VEC), q = (i % (W / VEC)) * VEC;
        const int c = __ldg(blk_cols + (size_t)b * BW + r);
        const int col = kbase + q;
        float v[VEC];
        if (VEC == 4) {
          float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
          if (c >= 0 && col < K) t = __ldg(reinterpret_cast<const float4*>(X + (size_t)c * K + col));
          v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) v[e] = (c >= 0 && col + e < K) ? __ldg(X + (size_t)c * K + col + e) : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) Xs[r * L::LDX + q + e] = prec<P>::cvt(v[e]);
      }
      __syncwarp();
#pragma unroll
      for (int kk = 0; kk < BW / KS; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, KS, typename prec<P>::frag, wmma::row_major> a;
        if (DENSE_A) wmma::load_matrix_sync(a, tiles + (size_t)b * 16 * BW + kk * KS, BW);
        else wmma::load_matrix_sync(a, As + kk * KS, BW);
        round_frag<P>(a);
#pragma unroll
        for (int t = 0; t < TPW; ++t) {
          wmma::fragment<wmma::matrix_b, 16, 16, KS, typename prec<P>::frag, wmma::row_major> x;
          wmma::load_matrix_sync(x, Xs + kk * KS * L::LDX + t * 16, L::LDX);
          round_frag<P>(x);
          wmma::mma_sync(acc[t], a, x, acc[t]);
        }
      }
      __syncwarp();                                  // Xs is rewritten by the next block
    }
  }
  if (!active) return;
#pragma unroll
  for (int t = 0; t < TPW; ++t) {
    wmma::store_matrix_sync(Os, acc[t], 16, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < 256; i += 32) {
      const int r = i >> 4, c = i & 15;
      const int row = win * 16 + r, col = kbase + t * 16 + c;
      if (row < m && col < K) Y[(size_t)row_ids[row] * K + col] = Os[i];
    }
    __syncwarp();
  }
}

}  // namespace spc_tc

#define SPC_TC_SPMM_INSTANCE(NAME, P, BW, TPW, DENSE_A, VEC)                                        \
  extern "C" __global__ void __launch_bounds__(512) NAME(                                           \
      const int* win_block_ptr, const int* blk_cols, const void* tiles, const int* nz_ptr,          \
      const unsigned char* nz_pos, const float* nz_val, const int* row_ids, const float* X,         \
      float* Y, int m, int K) {                                                                     \
    spc_tc::tc_spmm<P, BW, TPW, DENSE_A, VEC>(                                                      \
        win_block_ptr, blk_cols, reinterpret_cast<const typename spc_tc::prec<P>::stor*>(tiles),    \
        nz_ptr, nz_pos, nz_val, row_ids, X, Y, m, K);                                               \
  }
