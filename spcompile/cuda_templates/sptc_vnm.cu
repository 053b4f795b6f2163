// Sparse-tensor-core SpMM on the 2:4 form of a reordered matrix (SOGRE, PPoPP'25, reorder.vnm):
//   Y[row_ids[w*16 + r], :] = sum over the tiles b of row window w of  A_b (16 x 32, 2:4) @ X[cols_b] (32 x K)
//   then Y[rem_rows[i], :] += sum_p rem_val[p] * X[rem_col[p], :]   (entries the 2:4 form cannot hold)
//
// Tiles: per 16-row window, the nonempty 32-column blocks of the reordered matrix (block-CSR,
// win_ptr).  Each tile is stored as the mma.sp operands, packed at build time in numpy:
//   * tinfo[tile] = (32-column block, mask of the columns some kept entry of the tile uses);
//   * the compressed 16 x 16 values (two kept values per 4-column chunk) in the register order of
//     mma.sp.m16n8k32 (= dense m16n8k16 A: a0,a1 row g cols 2t,2t+1; a2,a3 row g+8; a4..a7 +8 cols),
//     either dense (DENSE_A = 1: frag[tile][lane] = the lane's 4 x .b32) or as a list of the kept
//     entries (DENSE_A = 0: nz[nz_ptr[tile] ..] = fragment position (lane*8 + i) | value bits << 16)
//     that each warp scatters into its own 512-byte shared tile (warp-level barriers only);
//   * meta[tile][g*2 + t] (t = lane % 4 < 2): the lane's 32-bit metadata word (sparsity selector 0):
//     the 2-bit indices of the kept values (low bits first), see sptc_vnm.py for the bit order;
//   * perm: original X row of every current column (padded to a multiple of 32); unused columns
//     of a tile load nothing and stage zeros.
//   * row_scale: per current row a power of two; values are stored divided by it (fp16 range).
// One thread block per (window, slice of K); warp v owns NT 8-column slabs of the output and keeps
// NT m16n8 fp32 accumulators across all tiles of the window.  B fragments (32 x 8 slabs of X, rows
// gathered through perm, converted to fp16 / bf16) are loaded straight from global memory: lane
// (g, t) needs X[perm[32*blk + 8r + 2t + {0,1}]][n0 + g] for r = 0..3, so 8 lanes of a quad-column read one
// 32-byte sector.  Windows without tiles write zeros (every output row is written once).
//
// Compile-time parameters: P (1 fp16, 2 bf16), NT (8-column slabs per warp), DENSE_A.  K, warps per block
// and the window count are launch arguments.  ORDERED selects mma.sp::ordered_metadata (PTX 8.5+).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef SPC_SPTC_ORDERED
#define SPC_SPTC_ORDERED 1
#endif

namespace spc_sptc {

template <int P> struct prec;
template <> struct prec<1> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <> struct prec<2> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <int P>
__device__ __forceinline__ void mma_sp(float (&d)[4], const uint4& a, const uint32_t (&b)[4], uint32_t e) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#if SPC_SPTC_ORDERED
#define SPC_SP "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32."
#else
#define SPC_SP "mma.sp.sync.aligned.m16n8k32.row.col.f32."
#endif
  if (P == 1) {
    asm volatile(SPC_SP "f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, 0x0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
  } else {
    asm volatile(SPC_SP "bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, 0x0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
  }
#undef SPC_SP
#endif
}

template <int P, int NT, int DENSE_A>
__device__ __forceinline__ void sptc_spmm(const int* __restrict__ win_ptr, const int2* __restrict__ tinfo,
                                          const uint4* __restrict__ frag, const int* __restrict__ nz_ptr,
                                          const uint32_t* __restrict__ nz, const uint32_t* __restrict__ meta,
                                          const int* __restrict__ perm, const int* __restrict__ row_ids,
                                          const float* __restrict__ row_scale, const float* __restrict__ X,
                                          float* __restrict__ Y, int m, int K) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int w = blockIdx.x;
  const int n0 = (blockIdx.y * (blockDim.x >> 5) + warp) * 8 * NT;
  if (n0 >= K) return;  // only warp-level barriers below
  uint4* sw = reinterpret_cast<uint4*>(smem) + warp * 32;   // this warp's 16 x 16 compressed tile
  unsigned short* sh = reinterpret_cast<unsigned short*>(sw);
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const int beg = win_ptr[w], end = win_ptr[w + 1];
  for (int b = beg; b < end; ++b) {
    const int2 ti = __ldg(tinfo + b);                      // (32-column block, used-column mask)
    uint4 a;
    if (DENSE_A) {
      a = __ldg(frag + (size_t)b * 32 + lane);
    } else {                                               // scatter the tile's kept entries
      sw[lane] = make_uint4(0u, 0u, 0u, 0u);
      __syncwarp();
      const int p1 = __ldg(nz_ptr + b + 1);
      for (int p = __ldg(nz_ptr + b) + lane; p < p1; p += 32) {
        const uint32_t e = __ldg(nz + p);
        sh[e & 0xFFu] = (unsigned short)(e >> 16);
      }
      __syncwarp();
      a = sw[lane];
      __syncwarp();
    }
    const uint32_t e = t < 2 ? __ldg(meta + (size_t)b * 16 + g * 2 + t) : 0u;
    const int2* cp = reinterpret_cast<const int2*>(perm + ti.x * 32);
    const uint32_t used = (uint32_t)ti.y;
    int2 c[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {                           // tile rows 8r + 2t, 8r + 2t + 1
      const int k = r * 8 + 2 * t;
      c[r] = ((used >> k) & 3u) ? __ldg(cp + r * 4 + t) : make_int2(-1, -1);
      if (!((used >> k) & 1u)) c[r].x = -1;
      if (!((used >> (k + 1)) & 1u)) c[r].y = -1;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int x = n0 + j * 8 + g;
      const bool ok = x < K;
      uint32_t bf[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float lo = (ok && c[r].x >= 0) ? __ldg(X + (size_t)c[r].x * K + x) : 0.f;
        const float hi = (ok && c[r].y >= 0) ? __ldg(X + (size_t)c[r].y * K + x) : 0.f;
        bf[r] = prec<P>::pack(lo, hi);
      }
      mma_sp<P>(acc[j], a, bf, e);
    }
  }
  const int r0 = w * 16 + g, r1 = r0 + 8;
  const long o0 = r0 < m ? (long)row_ids[r0] * K : -1, o1 = r1 < m ? (long)row_ids[r1] * K : -1;
  const float s0 = r0 < m ? row_scale[r0] : 0.f, s1 = r1 < m ? row_scale[r1] : 0.f;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int x = n0 + j * 8 + 2 * t;
    if (o0 >= 0) {
      if (x < K) Y[o0 + x] = acc[j][0] * s0;
      if (x + 1 < K) Y[o0 + x + 1] = acc[j][1] * s0;
    }
    if (o1 >= 0) {
      if (x < K) Y[o1 + x] = acc[j][2] * s1;
      if (x + 1 < K) Y[o1 + x + 1] = acc[j][3] * s1;
    }
  }
}

// CSR remainder on CUDA cores: one warp per remainder row (distinct output rows), lanes over K;
// launched after sptc_spmm on the same stream, adds into Y.
__device__ __forceinline__ void sptc_remainder(const int* __restrict__ rem_ptr, const int* __restrict__ rem_rows,
                                               const int* __restrict__ rem_cols, const float* __restrict__ rem_vals,
                                               const float* __restrict__ X, float* __restrict__ Y, int nrows, int K) {
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= nrows) return;
  const int beg = rem_ptr[wid], end = rem_ptr[wid + 1];
  float* y = Y + (size_t)rem_rows[wid] * K;
  for (int x = blockIdx.y * 128 + lane; x < K && x < (blockIdx.y + 1) * 128; x += 32) {
    float s = 0.f;
    for (int p = beg; p < end; ++p) s += __ldg(rem_vals + p) * __ldg(X + (size_t)__ldg(rem_cols + p) * K + x);
    y[x] += s;
  }
}

}  // namespace spc_sptc

extern "C" __global__ void sptc_remainder_kernel(const int* __restrict__ rem_ptr, const int* __restrict__ rem_rows,
                                                 const int* __restrict__ rem_cols, const float* __restrict__ rem_vals,
                                                 const float* __restrict__ X, float* __restrict__ Y, int nrows, int K) {
  spc_sptc::sptc_remainder(rem_ptr, rem_rows, rem_cols, rem_vals, X, Y, nrows, K);
}

#define SPC_SPTC_INSTANCE(NAME, P, NT, DENSE_A)                                                             \
  extern "C" __global__ void NAME(const int* __restrict__ win_ptr, const int2* __restrict__ tinfo,         \
                                  const uint4* __restrict__ frag, const int* __restrict__ nz_ptr,         \
                                  const uint32_t* __restrict__ nz, const uint32_t* __restrict__ meta,     \
                                  const int* __restrict__ perm, const int* __restrict__ row_ids,          \
                                  const float* __restrict__ row_scale, const float* __restrict__ X,       \
                                  float* __restrict__ Y, int m, int K) {                                  \
    spc_sptc::sptc_spmm<P, NT, DENSE_A>(win_ptr, tinfo, frag, nz_ptr, nz, meta, perm, row_ids, row_scale, \
                                        X, Y, m, K);                                                      \
  }
