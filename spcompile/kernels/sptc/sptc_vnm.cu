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
// Compile-time parameters: P (1 fp16, 2 bf16), NT (8-column slabs per warp), E (X / Y element type:
// 0 float, converted to P in registers; 1 half / 2 bfloat16 = P, loaded as is, half the gather bytes).
// K, warps per block and the item count are launch arguments.  ORDERED selects mma.sp::ordered_metadata (PTX 8.5+).
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

// X / Y element type: E = 0 float, 1 half, 2 bfloat16 (16-bit X must match the operand precision P).
template <int E> struct elem;
template <> struct elem<0> {
  typedef float T;
  static __device__ __forceinline__ float to_f(T v) { return v; }
  static __device__ __forceinline__ T from_f(float v) { return v; }
};
template <> struct elem<1> {
  typedef __half T;
  static __device__ __forceinline__ float to_f(T v) { return __half2float(v); }
  static __device__ __forceinline__ T from_f(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) { return prec<1>::pack(lo, hi); }
};
template <> struct elem<2> {
  typedef __nv_bfloat16 T;
  static __device__ __forceinline__ float to_f(T v) { return __bfloat162float(v); }
  static __device__ __forceinline__ T from_f(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ uint32_t pack2(float lo, float hi) { return prec<2>::pack(lo, hi); }
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

// 16-bit X (fp16 / bf16, already the operand type): NT consecutive values of X row c from column x0
// as (NT + 1) / 2 words, two columns per word (low half first; NT = 1: the value in the low half);
// zeros for c < 0 or past K.  No conversion: the B fragments are byte permutations of these words.
template <int NT>
__device__ __forceinline__ void load_x16(uint32_t (&w)[(NT + 1) / 2], const uint16_t* __restrict__ X, int c,
                                         int x0, int K, bool vec) {
  constexpr int NW = (NT + 1) / 2;
  if (c < 0) {
#pragma unroll
    for (int j = 0; j < NW; ++j) w[j] = 0u;
    return;
  }
  const uint16_t* p = X + (size_t)c * K + x0;
  if (vec) {
    if constexpr (NT == 8) {
      const uint4 f = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = f.x; w[1] = f.y; w[2] = f.z; w[3] = f.w;
    } else if constexpr (NT == 4) {
      const uint2 f = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = f.x; w[1] = f.y;
    } else if constexpr (NT == 2) {
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    } else {
      w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    }
  } else {
#pragma unroll
    for (int j = 0; j < NW; ++j) {
      const uint32_t lo = (x0 + 2 * j < K) ? (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p) + 2 * j) : 0u;
      const uint32_t hi = (NT > 1 && x0 + 2 * j + 1 < K)
                              ? (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p) + 2 * j + 1) : 0u;
      w[j] = lo | (hi << 16);
    }
  }
}

template <int P, int NT>
__device__ __forceinline__ void tile_mma16(float (&acc)[NT][4], const TileRegs& r, const uint16_t* __restrict__ X,
                                           int x0, int K, bool vec) {
  constexpr int NW = (NT + 1) / 2;
  uint32_t w[8][NW];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    load_x16<NT>(w[2 * q], X, r.c[q].x, x0, K, vec);
    load_x16<NT>(w[2 * q + 1], X, r.c[q].y, x0, K, vec);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    uint32_t bf[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)   // low half: tile row 2q's value of column j, high half: row 2q + 1's
      bf[q] = __byte_perm(w[2 * q][j >> 1], w[2 * q + 1][j >> 1], (j & 1) ? 0x7632 : 0x5410);
    mma_sp<P>(acc[j], r.a, bf, r.e);
  }
}

// E = 0: X / Y float.  E = 1 / 2: X / Y half / bfloat16 (P must equal E); the items of split windows
// (items[i].w = split-window index + 1) add into the fp32 scratch S (row (w - 1) * 16 + window row,
// zeroed first), which sptc_finish converts into Y; fp32 builds add into Y directly.
template <int P, int NT, int E>
__device__ __forceinline__ void sptc_spmm2(const int4* __restrict__ items, const uint4* __restrict__ frag,
                                           const uint32_t* __restrict__ meta, const int* __restrict__ ccol,
                                           const int* __restrict__ row_ids, const float* __restrict__ row_scale,
                                           const void* __restrict__ Xv, void* __restrict__ Yv, float* __restrict__ S,
                                           int m, int K) {
  static_assert(E == 0 || E == P, "16-bit X must be in the operand precision");
  typedef typename elem<E>::T T;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = (blockIdx.y * (blockDim.x >> 5) + warp) * 8 * NT;
  if (n0 >= K) return;
  const int4 it = __ldg(items + blockIdx.x);
  // vector width (elements) of the Y stores; the X loads are NT elements at a multiple of NT
  constexpr int VW = E == 0 ? (NT >= 4 ? 4 : NT) : (2 * NT < 8 ? 2 * NT : 8);
  constexpr int EB = E == 0 ? 4 : 2;
  const bool vec = (n0 + 8 * NT <= K) && (K % VW == 0) &&
                   (((reinterpret_cast<uintptr_t>(Xv) | reinterpret_cast<uintptr_t>(Yv)) & (EB * VW - 1)) == 0);
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
    if constexpr (E == 0) {
      const float* X = static_cast<const float*>(Xv);
      tile_mma<P, NT>(acc, r0, X, x0, K, vec);
      if (b + 1 < end) tile_mma<P, NT>(acc, r1, X, x0, K, vec);
    } else {
      const uint16_t* X = static_cast<const uint16_t*>(Xv);
      tile_mma16<P, NT>(acc, r0, X, x0, K, vec);
      if (b + 1 < end) tile_mma16<P, NT>(acc, r1, X, x0, K, vec);
    }
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
    T* y = static_cast<T*>(Yv) + (size_t)__ldg(row_ids + row) * K;
    const float s = __ldg(row_scale + row);
    float o[2 * NT];                                        // columns n0 + 2t*NT + [0, 2NT)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      o[j] = accf[j * 4 + 2 * h] * s;
      o[NT + j] = accf[j * 4 + 2 * h + 1] * s;
    }
    const int xs = n0 + 2 * t * NT;
    if (it.w) {
      float* ya = E == 0 ? reinterpret_cast<float*>(y) : S + ((size_t)(it.w - 1) * 16 + g + 8 * h) * K;
#pragma unroll
      for (int j = 0; j < 2 * NT; ++j)
        if (xs + j < K) atomicAdd(ya + xs + j, o[j]);
    } else if (vec) {
      if constexpr (E == 0) {
        float* yf = reinterpret_cast<float*>(y);
        if (NT >= 2) {
#pragma unroll
          for (int q = 0; q < (2 * NT) / VW; ++q) {
            if (VW == 4) {
              reinterpret_cast<float4*>(yf + xs)[q] = make_float4(o[4 * q], o[4 * q + 1], o[(4 * q + 2) % (2 * NT)],
                                                                  o[(4 * q + 3) % (2 * NT)]);
            } else {
              reinterpret_cast<float2*>(yf + xs)[q] = make_float2(o[2 * q], o[2 * q + 1]);
            }
          }
        } else {
          yf[xs] = o[0];
          yf[xs + 1] = o[1];
        }
      } else {
        uint32_t wd[NT];                                    // 2 NT values -> NT words
#pragma unroll
        for (int k = 0; k < NT; ++k) wd[k] = elem<E>::pack2(o[2 * k], o[2 * k + 1]);
        if constexpr (NT == 8) {
          reinterpret_cast<uint4*>(y + xs)[0] = make_uint4(wd[0], wd[1], wd[2], wd[3]);
          reinterpret_cast<uint4*>(y + xs)[1] = make_uint4(wd[4], wd[5], wd[6], wd[7]);
        } else if constexpr (NT == 4) {
          reinterpret_cast<uint4*>(y + xs)[0] = make_uint4(wd[0], wd[1], wd[2], wd[3]);
        } else if constexpr (NT == 2) {
          reinterpret_cast<uint2*>(y + xs)[0] = make_uint2(wd[0], wd[1]);
        } else {
          reinterpret_cast<uint32_t*>(y + xs)[0] = wd[0];
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 2 * NT; ++j)
        if (xs + j < K) y[xs + j] = elem<E>::from_f(o[j]);
    }
  }
}

// Zero the output rows of windows split into several items (they are accumulated with atomics).
__device__ __forceinline__ void sptc_zero(const int* __restrict__ rows, int nrows, float* __restrict__ Y, int K) {
  const size_t total = (size_t)nrows * K;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
    Y[(size_t)__ldg(rows + i / K) * K + i % K] = 0.f;
}

// 16-bit builds: the split windows' fp32 scratch rows -> Y (one rounding).
template <int E>
__device__ __forceinline__ void sptc_finish(const int* __restrict__ rows, int nrows, const float* __restrict__ S,
                                            typename elem<E>::T* __restrict__ Y, int K) {
  const size_t total = (size_t)nrows * K;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
    Y[(size_t)__ldg(rows + i / K) * K + i % K] = elem<E>::from_f(S[i]);
}

// CSR remainder on CUDA cores: one warp per remainder row (distinct output rows), lanes over K;
// launched after sptc_spmm on the same stream, adds into Y (16-bit Y: read, add in fp32, round).
template <int E>
__device__ __forceinline__ void sptc_remainder(const int* __restrict__ rem_ptr, const int* __restrict__ rem_rows,
                                               const int* __restrict__ rem_cols, const float* __restrict__ rem_vals,
                                               const typename elem<E>::T* __restrict__ X,
                                               typename elem<E>::T* __restrict__ Y, int nrows, int K) {
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= nrows) return;
  const int beg = rem_ptr[wid], end = rem_ptr[wid + 1];
  typename elem<E>::T* y = Y + (size_t)rem_rows[wid] * K;
  for (int x = blockIdx.y * 128 + lane; x < K && x < (blockIdx.y + 1) * 128; x += 32) {
    float s = 0.f;
    for (int p = beg; p < end; ++p)
      s += __ldg(rem_vals + p) * elem<E>::to_f(X[(size_t)__ldg(rem_cols + p) * K + x]);
    y[x] = elem<E>::from_f(elem<E>::to_f(y[x]) + s);
  }
}

}  // namespace spc_sptc

#define SPC_SPTC_AUX(SUFFIX, E)                                                                             \
  extern "C" __global__ void sptc_remainder##SUFFIX(                                                        \
      const int* __restrict__ rem_ptr, const int* __restrict__ rem_rows, const int* __restrict__ rem_cols,  \
      const float* __restrict__ rem_vals, const spc_sptc::elem<E>::T* __restrict__ X,                       \
      spc_sptc::elem<E>::T* __restrict__ Y, int nrows, int K) {                                             \
    spc_sptc::sptc_remainder<E>(rem_ptr, rem_rows, rem_cols, rem_vals, X, Y, nrows, K);                     \
  }
SPC_SPTC_AUX(_kernel, 0)
SPC_SPTC_AUX(_h, 1)
SPC_SPTC_AUX(_b, 2)

extern "C" __global__ void sptc_finish_h(const int* __restrict__ rows, int nrows, const float* __restrict__ S,
                                         __half* __restrict__ Y, int K) {
  spc_sptc::sptc_finish<1>(rows, nrows, S, Y, K);
}
extern "C" __global__ void sptc_finish_b(const int* __restrict__ rows, int nrows, const float* __restrict__ S,
                                         __nv_bfloat16* __restrict__ Y, int K) {
  spc_sptc::sptc_finish<2>(rows, nrows, S, Y, K);
}

extern "C" __global__ void sptc_zero_rows(const int* __restrict__ rows, int nrows, float* __restrict__ Y, int K) {
  spc_sptc::sptc_zero(rows, nrows, Y, K);
}

// (nrows x K) contiguous fp32 scratch -> 0 (the split windows' rows of a 16-bit build)
extern "C" __global__ void sptc_zero_scratch(float* __restrict__ S, int nrows, int K) {
  const size_t total = (size_t)nrows * K;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x)
    S[i] = 0.f;
}

#define SPC_SPTC_INSTANCE(NAME, P, NT, E)                                                                   \
  extern "C" __global__ void NAME(const int4* __restrict__ items, const uint4* __restrict__ frag,           \
                                  const uint32_t* __restrict__ meta, const int* __restrict__ ccol,         \
                                  const int* __restrict__ row_ids, const float* __restrict__ row_scale,   \
                                  const void* __restrict__ X, void* __restrict__ Y, float* __restrict__ S, \
                                  int m, int K) {                                                          \
    spc_sptc::sptc_spmm2<P, NT, E>(items, frag, meta, ccol, row_ids, row_scale, X, Y, S, m, K);           \
  }
