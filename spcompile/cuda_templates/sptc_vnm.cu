// Sparse-tensor-core SpMM on 2:4 tiles (SOGRE, PPoPP'25; window-condensed columns as in TC-GNN's SGT):
//   Y[row_ids[w*16 + r], :] = sum over the tiles b of row window w of  A_b (16 x 32, 2:4) @ X[ccol_b] (32 x K)
//   then Y[rem_rows[i], :] += sum_p rem_val[p] * X[rem_col[p], :]   (entries the 2:4 form cannot hold)
//
// Tiles are packed at build time in numpy (sptc_vnm.py), per 16-row window, either over the
// window's 32-column blocks of the current order (block packing, after reorder.vnm: the first two
// entries of each 4-column chunk, the rest in the CSR remainder) or over the window's distinct
// columns grouped 2:4 by construction (condensed packing, no remainder).  Each tile is stored as
// the mma.sp operands:
//   * frag[tile][lane]: the lane's compressed A fragment (4 x .b32, fp16 / bf16 pairs) in the
//     register order of mma.sp.m16n8k32 (= dense m16n8k16 A: a0,a1 row g cols 2t,2t+1; a2,a3 row
//     g+8; a4..a7 +8 cols);
//   * meta[tile][g*2 + t] (t = lane % 4 < 2): the lane's 32-bit metadata word (sparsity selector 0),
//     the 2-bit indices of the kept values (low bits first), see sptc_vnm.py for the bit order;
//   * ccol[tile][k]: the original X row of the tile's column k, -1 when no entry uses it (loads
//     nothing, stages zeros);
//   * row_scale: per current row a power of two; values are stored divided by it (fp16 range).
// Work items (sptc_spmm2 below) split long windows; split windows accumulate with atomics into rows
// zeroed by sptc_zero_rows.  Launch order on one stream: zero rows, tiles, remainder.
//
// Compile-time parameters: P (1 fp16, 2 bf16), NT (8-column slabs per warp).  K, warps per block
// and the item count are launch arguments.  ORDERED selects mma.sp::ordered_metadata (PTX 8.5+).
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

// Tile-list SpMM (v2).  A work item (blockIdx.x) is a range of tiles of one 16-row window
// (items[i] = {window, first tile, end tile, atomic}); a window with more tiles than the split
// limit has several items, which add their partial sums into Y with atomics (its rows are zeroed
// first by sptc_zero_rows); otherwise the item stores its rows.  Warp v of the block owns the NT
// 8-column output slabs starting at n0 = (blockIdx.y * W + v) * 8 * NT.  Slab j's logical column
// g (the mma's n index) is the physical column n0 + g * NT + j, so that lane (g, t) reads NT
// consecutive floats of each gathered X row (one 16-byte load per 4 slabs) and writes 2 * NT
// consecutive floats of each of its two output rows.
// Per tile: frag (the lane's 4 x .b32 A fragment), meta (lane (g, t < 2)'s metadata word), ccol
// (the 32 X rows of the tile's columns, -1 = unused: loads nothing).  Tiles are processed in pairs
// (16 gathered rows of X in flight per lane) and the next pair's fragments / metadata / column
// ids are loaded before the current pair's X rows (software pipelining of the index chain).
struct TileRegs {
  uint4 a;
  uint32_t e;
  int2 c[4];
};

__device__ __forceinline__ void load_tile(TileRegs& r, int b, bool valid, const uint4* __restrict__ frag,
                                          const uint32_t* __restrict__ meta, const int* __restrict__ ccol,
                                          int lane, int g, int t) {
  if (valid) {
    r.a = __ldg(frag + (size_t)b * 32 + lane);
    r.e = t < 2 ? __ldg(meta + (size_t)b * 16 + g * 2 + t) : 0u;
    const int2* cp = reinterpret_cast<const int2*>(ccol + (size_t)b * 32);
#pragma unroll
    for (int q = 0; q < 4; ++q) r.c[q] = __ldg(cp + q * 4 + t);   // tile rows 8q + 2t, 8q + 2t + 1
  } else {
    r.a = make_uint4(0u, 0u, 0u, 0u);
    r.e = 0u;
#pragma unroll
    for (int q = 0; q < 4; ++q) r.c[q] = make_int2(-1, -1);
  }
}

// NT consecutive floats of X row c from column x0 (zeros for c < 0 or past K).
template <int NT>
__device__ __forceinline__ void load_x(float (&v)[NT], const float* __restrict__ X, int c, int x0, int K, bool vec) {
  if (c < 0) {
#pragma unroll
    for (int j = 0; j < NT; ++j) v[j] = 0.f;
    return;
  }
  const float* p = X + (size_t)c * K + x0;
  if (vec) {
    if (NT >= 4) {
#pragma unroll
      for (int q = 0; q < NT / 4; ++q) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(p) + q);
        v[4 * q] = f.x; v[4 * q + 1] = f.y; v[4 * q + 2] = f.z; v[4 * q + 3] = f.w;
      }
    } else if (NT == 2) {
      const float2 f = __ldg(reinterpret_cast<const float2*>(p));
      v[0] = f.x; v[NT - 1] = f.y;
    } else {
      v[0] = __ldg(p);
    }
  } else {
#pragma unroll
    for (int j = 0; j < NT; ++j) v[j] = (x0 + j < K) ? __ldg(p + j) : 0.f;
  }
}

template <int P, int NT>
__device__ __forceinline__ void tile_mma(float (&acc)[NT][4], const TileRegs& r, const float* __restrict__ X,
                                         int x0, int K, bool vec) {
  float v[8][NT];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    load_x<NT>(v[2 * q], X, r.c[q].x, x0, K, vec);
    load_x<NT>(v[2 * q + 1], X, r.c[q].y, x0, K, vec);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    uint32_t bf[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) bf[q] = prec<P>::pack(v[2 * q][j], v[2 * q + 1][j]);
    mma_sp<P>(acc[j], r.a, bf, r.e);
  }
}

template <int P, int NT>
__device__ __forceinline__ void sptc_spmm2(const int4* __restrict__ items, const uint4* __restrict__ frag,
                                           const uint32_t* __restrict__ meta, const int* __restrict__ ccol,
                                           const int* __restrict__ row_ids, const float* __restrict__ row_scale,
                                           const float* __restrict__ X, float* __restrict__ Y, int m, int K) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = (blockIdx.y * (blockDim.x >> 5) + warp) * 8 * NT;
  if (n0 >= K) return;
  const int4 it = __ldg(items + blockIdx.x);
  constexpr int VW = NT >= 4 ? 4 : NT;
  const bool vec = (n0 + 8 * NT <= K) && (K % VW == 0) &&
                   (((reinterpret_cast<uintptr_t>(X) | reinterpret_cast<uintptr_t>(Y)) & (4 * VW - 1)) == 0);
  const int x0 = n0 + g * NT;
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const int beg = it.y, end = it.z;
  TileRegs r0, r1;
  load_tile(r0, beg, beg < end, frag, meta, ccol, lane, g, t);
  load_tile(r1, beg + 1, beg + 1 < end, frag, meta, ccol, lane, g, t);
  for (int b = beg; b < end; b += 2) {
    TileRegs n0r, n1r;                                      // next pair (prefetch)
    load_tile(n0r, b + 2, b + 2 < end, frag, meta, ccol, lane, g, t);
    load_tile(n1r, b + 3, b + 3 < end, frag, meta, ccol, lane, g, t);
    tile_mma<P, NT>(acc, r0, X, x0, K, vec);
    if (b + 1 < end) tile_mma<P, NT>(acc, r1, X, x0, K, vec);
    r0 = n0r;
    r1 = n1r;
  }
  const int w = it.x;
  const int ra = w * 16 + g, rb = ra + 8;
  const float* accf = &acc[0][0];
#pragma unroll
  for (int h = 0; h < 2; ++h) {                              // h = 0: row g, h = 1: row g + 8
    const int row = h ? rb : ra;
    if (row >= m) continue;
    float* y = Y + (size_t)__ldg(row_ids + row) * K;
    const float s = __ldg(row_scale + row);
    float o[2 * NT];                                        // columns n0 + 2t*NT + [0, 2NT)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      o[j] = accf[j * 4 + 2 * h] * s;
      o[NT + j] = accf[j * 4 + 2 * h + 1] * s;
    }
    const int xs = n0 + 2 * t * NT;
    if (it.w) {
#pragma unroll
      for (int j = 0; j < 2 * NT; ++j)
        if (xs + j < K) atomicAdd(y + xs + j, o[j]);
    } else if (vec) {
      if (NT >= 2) {
#pragma unroll
        for (int q = 0; q < (2 * NT) / VW; ++q) {
          if (VW == 4) {
            reinterpret_cast<float4*>(y + xs)[q] = make_float4(o[4 * q], o[4 * q + 1], o[(4 * q + 2) % (2 * NT)],
                                                               o[(4 * q + 3) % (2 * NT)]);
          } else {
            reinterpret_cast<float2*>(y + xs)[q] = make_float2(o[2 * q], o[2 * q + 1]);
          }
        }
      } else {
        y[xs] = o[0];
        y[xs + 1] = o[1];
      }
    } else {
#pragma unroll
      for (int j = 0; j < 2 * NT; ++j)
        if (xs + j < K) y[xs + j] = o[j];
    }
  }
}

// Zero the output rows of windows split into several items (they are accumulated with atomics).
__device__ __forceinline__ void sptc_zero(const int* __restrict__ rows, int nrows, float* __restrict__ Y, int K) {
  const size_t total = (size_t)nrows * K;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
    Y[(size_t)__ldg(rows + i / K) * K + i % K] = 0.f;
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

extern "C" __global__ void sptc_zero_rows(const int* __restrict__ rows, int nrows, float* __restrict__ Y, int K) {
  spc_sptc::sptc_zero(rows, nrows, Y, K);
}

#define SPC_SPTC_INSTANCE(NAME, P, NT)                                                                      \
  extern "C" __global__ void NAME(const int4* __restrict__ items, const uint4* __restrict__ frag,           \
                                  const uint32_t* __restrict__ meta, const int* __restrict__ ccol,         \
                                  const int* __restrict__ row_ids, const float* __restrict__ row_scale,   \
                                  const float* __restrict__ X, float* __restrict__ Y, int m, int K) {     \
    spc_sptc::sptc_spmm2<P, NT>(items, frag, meta, ccol, row_ids, row_scale, X, Y, m, K);                 \
  }
