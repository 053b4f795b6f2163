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
// 1: scalar loads, any K; for TI = 1 the vector width is 8 elements, needs K % 8 == 0).  Warps per block, K and the window count are launch arguments.
// TI (input type): 0 = fp32 X / Y (converted to the MMA type in registers), 1 = X and Y in P's
// 16-bit type (fp16 for P = 1, bf16 for P = 2; X staged without conversion, Y rounded once).
// One parametrised body; Python emits one extern "C" wrapper per variant (SPC_TC_SPMM_INSTANCE).
#include "tc_frag.cuh"
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

template <int P, int BW, int TPW, int DENSE_A, int VEC, int TI>
__device__ __forceinline__ void tc_spmm(
    const int* __restrict__ win_block_ptr, const int* __restrict__ blk_cols,
    const typename prec<P>::stor* __restrict__ tiles, const int* __restrict__ nz_ptr,
    const unsigned char* __restrict__ nz_pos, const float* __restrict__ nz_val,
    const int* __restrict__ row_ids, const void* __restrict__ Xv, void* __restrict__ Yv,
    int m, int K) {
  typedef typename prec<P>::stor T;
  static_assert(!TI || P != 0, "16-bit inputs run with the MMA of their own type");
  const float* __restrict__ X = reinterpret_cast<const float*>(Xv);
  const T* __restrict__ Xh = reinterpret_cast<const T*>(Xv);
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
        if (TI) {                                    // 16-bit X: staged as loaded
          if (VEC == 8) {
            uint4 t = make_uint4(0u, 0u, 0u, 0u);
            if (c >= 0 && col < K) t = __ldg(reinterpret_cast<const uint4*>(Xh + (size_t)c * K + col));
            *reinterpret_cast<uint4*>(Xs + r * L::LDX + q) = t;
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              Xs[r * L::LDX + q + e] = (c >= 0 && col + e < K) ? Xh[(size_t)c * K + col + e] : prec<P>::cvt(0.0f);
          }
          continue;
        }
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
      if (row < m && col < K) {
        if (TI) reinterpret_cast<T*>(Yv)[(size_t)row_ids[row] * K + col] = prec<P>::cvt(Os[i]);
        else reinterpret_cast<float*>(Yv)[(size_t)row_ids[row] * K + col] = Os[i];
      }
    }
    __syncwarp();
  }
}

}  // namespace spc_tc

#define SPC_TC_SPMM_INSTANCE(NAME, P, BW, TPW, DENSE_A, VEC, TI)                                    \
  extern "C" __global__ void __launch_bounds__(512) NAME(                                           \
      const int* win_block_ptr, const int* blk_cols, const void* tiles, const int* nz_ptr,          \
      const unsigned char* nz_pos, const float* nz_val, const int* row_ids, const void* X,          \
      void* Y, int m, int K) {                                                                      \
    spc_tc::tc_spmm<P, BW, TPW, DENSE_A, VEC, TI>(                                                  \
        win_block_ptr, blk_cols, reinterpret_cast<const typename spc_tc::prec<P>::stor*>(tiles),    \
        nz_ptr, nz_pos, nz_val, row_ids, X, Y, m, K);                                               \
  }

// =============================================================================================
// Register-direct variant (impl "mma"): raw mma.sync, no shared memory, no block barriers, and
// window splitting for load balance.
//
// Work items: a row window's TC blocks are cut into balanced runs of at most max_blocks blocks
// (built in Python, longest first); one thread block per (item, slice of K).  Warp v of the block
// owns CG groups of SPAN output columns starting at kbase = (blockIdx.y * warps + v) * SPAN * CG;
// SPAN = 32 for fp32 X (TI = 0), 64 for 16-bit X (TI = 1).
//
// Fragments (PTX ISA, mma.m16n8k8 tf32 / m16n8k16 f16|bf16, g = lane / 4, t = lane % 4):
//   * A (the 16 x KS sparse tile of one MMA k-step) is stored in fragment order at build time
//     (one 16-byte load per lane; tf32 values pre-rounded);
//   * blk_cols is stored permuted so that a lane loads the X row ids it needs with one int2
//     (tf32: tile columns t, t+4) or int4 (16-bit: tile columns 2t, 2t+1, 2t+8, 2t+9);
//   * B = X[cols, SPAN columns]: the MMA's n index is mapped to output columns so that lane (g, t)
//     loads ONE 16-byte vector per X row, NJ = 4 floats (TI = 0) or NJ = 8 16-bit values (TI = 1)
//     X[c][base + NJ g .. NJ g + NJ-1], element j feeding n-tile j (n index g of n-tile j <->
//     column base + NJ g + j); 8 lanes read 128 contiguous bytes of a row.  fp32 X is converted
//     in registers; 16-bit X is only re-paired (byte permutes: rows 2t / 2t+1 of one register);
//   * C: lane (g, t) then holds rows g and g + 8, columns base + 2 NJ t .. + 2 NJ - 1 (c0 of
//     n-tiles 0..NJ-1, then c1 of n-tiles 0..NJ-1), written as 16-byte vectors per row (fp32 Y,
//     or 16-bit Y rounded once from the fp32 accumulators).
// P = 3 (split tf32, "3xtf32"): fp32-level results from tf32 MMAs.  afrag holds per k-step the 32
// lanes' hi fragments, then their lo fragments (a = hi + lo, each tf32, split at build time); each
// X value is split in registers (hi = cvt.rna(x), lo = cvt.rna(x - hi)), and three MMAs accumulate
// lo(A) hi(X) + hi(A) lo(X) + hi(A) hi(X) in fp32 (the lo x lo term is below fp32 rounding).
// A split window's items write 16 x K fp32 partials to part[slot]; the last warp to finish a
// (window, column slice) -- per-warp atomic counter, threadfence-reduction pattern -- adds the
// partials in slot order (deterministic, fp32), writes Y (rounded once for 16-bit Y) and resets
// the counter for the next call.
// =============================================================================================
namespace spc_tc {
using namespace spc_tcf;

template <int P, int BW, int CG, int U, int VEC, int TI>
__device__ __forceinline__ void tc_mma_spmm(
    const int4* __restrict__ items, const int* __restrict__ slot_grp, const int* __restrict__ grp_ptr,
    const int* __restrict__ pcols, const uint4* __restrict__ afrag, const int* __restrict__ row_ids,
    const void* __restrict__ Xv, void* __restrict__ Yv, float* part, int* counters, int m, int K) {
  constexpr bool X3 = (P == 3);                      // split tf32: three tf32 MMAs per product
  constexpr int PM = X3 ? 0 : P;                     // the MMA's operand type
  constexpr int KS = (PM == 0) ? 8 : 16;
  constexpr int S = BW / KS;                         // MMA k-steps per TC block
  constexpr int NR = (PM == 0) ? 2 : 4;              // X rows a lane loads per k-step
  constexpr int NJ = TI ? 8 : 4;                     // n-tiles per column group (elements per load)
  constexpr int SPAN = 8 * NJ;                       // output columns per column group
  constexpr int AF = X3 ? 2 : 1;                     // A fragments per k-step and lane (hi, lo)
  static_assert(BW % KS == 0, "TC block width must be a multiple of the MMA k");
  static_assert(!TI || PM != 0, "16-bit inputs run with the MMA of their own type");
  typedef typename std::conditional<TI != 0, uint4, float4>::type vec_t;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int kbase = (blockIdx.y * nw + warp) * SPAN * CG;
  if (kbase >= K) return;                            // uniform per warp; no block barriers below
  const int4 it = __ldg(items + blockIdx.x);         // first block, end block, window, slot (-1)

  float acc[CG][NJ][4];
#pragma unroll
  for (int c = 0; c < CG; ++c)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[c][j][r] = 0.0f;

  // X row ids of the next U blocks are loaded one iteration ahead (software pipelining): the X
  // loads of an iteration then wait for one memory latency, not two (ids, then rows).
  int cn[U][S][NR];
  auto load_cols = [&](int b) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const long long step = (long long)(b + u) * S + s;
        const bool ok = b + u < it.y;
        if (PM == 0) {
          int2 cc = make_int2(-1, -1);
          if (ok) cc = __ldg(reinterpret_cast<const int2*>(pcols + step * 8) + t);
          cn[u][s][0] = cc.x; cn[u][s][1] = cc.y;
        } else {
          int4 cc = make_int4(-1, -1, -1, -1);
          if (ok) cc = __ldg(reinterpret_cast<const int4*>(pcols + step * 16) + t);
          cn[u][s][0] = cc.x; cn[u][s][1] = cc.y; cn[u][s][NR > 2 ? 2 : 0] = cc.z; cn[u][s][NR > 3 ? 3 : 0] = cc.w;
        }
      }
  };
  auto load_x = [&](int c, int col) -> vec_t {
    if constexpr (TI != 0) return ld8h<VEC>(reinterpret_cast<const unsigned short*>(Xv), c, col, K);
    else return ld4<VEC>(reinterpret_cast<const float*>(Xv), c, col, K);
  };
  load_cols(it.x);
  for (int b = it.x; b < it.y; b += U) {
    unsigned a[U][S][4];
    unsigned al[X3 ? U : 1][X3 ? S : 1][4];          // lo fragments of split tf32
    vec_t xv[U][S][NR][CG];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int bb = b + u;
      const bool ok = bb < it.y;
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const long long step = (long long)bb * S + s;
        uint4 av = make_uint4(0u, 0u, 0u, 0u);
        if (ok) av = __ldg(afrag + step * AF * 32 + lane);
        a[u][s][0] = av.x; a[u][s][1] = av.y; a[u][s][2] = av.z; a[u][s][3] = av.w;
        if constexpr (X3) {
          uint4 lv = make_uint4(0u, 0u, 0u, 0u);
          if (ok) lv = __ldg(afrag + step * AF * 32 + 32 + lane);
          al[u][s][0] = lv.x; al[u][s][1] = lv.y; al[u][s][2] = lv.z; al[u][s][3] = lv.w;
        }
#pragma unroll
        for (int q = 0; q < NR; ++q)
#pragma unroll
          for (int cg = 0; cg < CG; ++cg) xv[u][s][q][cg] = load_x(cn[u][s][q], kbase + SPAN * cg + NJ * g);
      }
    }
    load_cols(b + U);                                // ids of the next iteration (-1 past the end)
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int cg = 0; cg < CG; ++cg)
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            unsigned b0, b1;
            if constexpr (TI != 0) {                 // rows (2t, 2t+1) and (2t+8, 2t+9), element j
              b0 = sel16(xv[u][s][0][cg], xv[u][s][1 % NR][cg], j);
              b1 = sel16(xv[u][s][2 % NR][cg], xv[u][s][3 % NR][cg], j);
            } else if (PM == 0) {                    // B rows t and t + 4 of the k-step
              const float x0 = el(xv[u][s][0][cg], j), x1 = el(xv[u][s][1][cg], j);
              b0 = f2tf32(x0);
              b1 = f2tf32(x1);
              if constexpr (X3) {                    // small terms first: lo(A) hi(X), hi(A) lo(X)
                const unsigned l0 = f2tf32(x0 - __uint_as_float(b0)), l1 = f2tf32(x1 - __uint_as_float(b1));
                mma16816<0>(acc[cg][j], al[u][s], b0, b1);
                mma16816<0>(acc[cg][j], a[u][s], l0, l1);
              }
            } else {                                 // B rows (2t, 2t+1) and (2t+8, 2t+9)
              b0 = pack2<PM == 0 ? 1 : PM>(el(xv[u][s][0][cg], j), el(xv[u][s][1 % NR][cg], j));
              b1 = pack2<PM == 0 ? 1 : PM>(el(xv[u][s][2 % NR][cg], j), el(xv[u][s][3 % NR][cg], j));
            }
            mma16816<PM>(acc[cg][j], a[u][s], b0, b1);
          }
  }

  // lane's results: row g + 8h, columns col0 .. col0 + NJ - 1 with col0 = kbase + SPAN cg + 2 NJ t + NJ q
  auto vals = [&](int cg, int h, int q, float (&v)[NJ]) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) v[j] = acc[cg][j][2 * h + q];
  };
  auto store_y = [&](long long row, int col, const float (&v)[NJ]) {
    if constexpr (TI != 0) st_h<PM == 0 ? 1 : PM, NJ, VEC>(reinterpret_cast<unsigned short*>(Yv) + row * K, col, K, v);
    else st_f32<NJ, VEC>(reinterpret_cast<float*>(Yv) + row * K, col, K, v);
  };
  const int win = it.z, slot = it.w;
  if (slot < 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = win * 16 + g + 8 * h;
      if (row < m) {
        const long long yr = __ldg(row_ids + row);
#pragma unroll
        for (int cg = 0; cg < CG; ++cg)
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            float v[NJ];
            vals(cg, h, q, v);
            store_y(yr, kbase + SPAN * cg + 2 * NJ * t + NJ * q, v);
          }
      }
    }
    return;
  }
  {
    float* pp = part + (long long)slot * 16 * K;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int cg = 0; cg < CG; ++cg)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          float v[NJ];
          vals(cg, h, q, v);
          st_f32<NJ, VEC>(pp + (long long)(g + 8 * h) * K, kbase + SPAN * cg + 2 * NJ * t + NJ * q, K, v);
        }
  }
  __threadfence();
  __syncwarp();
  const int grp = __ldg(slot_grp + slot);
  const int first = __ldg(grp_ptr + grp), nslots = __ldg(grp_ptr + grp + 1) - first;
  const long long cnt_idx = ((long long)grp * gridDim.y + blockIdx.y) * nw + warp;
  int old = 0;
  if (lane == 0) old = atomicAdd(counters + cnt_idx, 1);
  old = __shfl_sync(0xffffffffu, old, 0);
  if (old != nslots - 1) return;
  __threadfence();                                   // last arriver: combine in slot order (fp32)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = win * 16 + g + 8 * h;
    if (row >= m) continue;
    const long long yr = __ldg(row_ids + row);
#pragma unroll
    for (int cg = 0; cg < CG; ++cg)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int col = kbase + SPAN * cg + 2 * NJ * t + NJ * q;
        float o[NJ];
#pragma unroll
        for (int j = 0; j < NJ; ++j) o[j] = 0.0f;
        for (int z = 0; z < nslots; ++z) {
          float v[NJ];
          ld_f32_cg<NJ, VEC>(part + (long long)(first + z) * 16 * K + (long long)(g + 8 * h) * K, col, K, v);
#pragma unroll
          for (int j = 0; j < NJ; ++j) o[j] += v[j];
        }
        store_y(yr, col, o);
      }
  }
  if (lane == 0) counters[cnt_idx] = 0;             // ready for the next call (stream-ordered)
}

}  // namespace spc_tc

#define SPC_TC_MMA_INSTANCE(NAME, P, BW, CG, U, VEC, TI)                                            \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                           \
      const int4* items, const int* slot_grp, const int* grp_ptr, const int* pcols, const uint4* afrag, \
      const int* row_ids, const void* X, void* Y, float* part, int* counters, int m, int K) {       \
    spc_tc::tc_mma_spmm<P, BW, CG, U, VEC, TI>(items, slot_grp, grp_ptr, pcols, afrag, row_ids, X, Y, part, \
                                               counters, m, K);                                     \
  }
