// ASpT-style tiled SpMM (Hong et al. PPoPP'19; with row clustering: Jiang et al. PPoPP'20) on the
// tile.aspt layout:  Y[row_ids[r], :] = reduce(dense-tile entries of r, remainder entries of r),
// reduce in {sum, max, min} (mean = sum over values pre-scaled by 1 / row length at build time).
//
// Two launches on the caller's stream (the second one ordered after the first):
//
// 1. <NAME>_rows  -- one warp per module row (rows_per_warp consecutive rows per warp), K tile
//    of KT = 32 * VEC * CF columns per blockIdx.y.  It reduces the row's *first* remainder segment
//    (at most max_seg entries; all of them when max_seg = 0) GE-SpMM style (the warp loads 32
//    (column, value) pairs coalesced, broadcasts them by shuffles, streams X rows with CF x VEC
//    wide loads) and writes the row with a plain store: this initialises every output row (rows
//    with no entry at all get 0; rows whose entries all lie elsewhere get the reduction's
//    identity, which the second launch then combines into).
//
// 2. <NAME>_tiles -- blockIdx.x < ntail_blocks: each warp reduces one further remainder segment
//    of a long row (load balance for hub rows) and combines it into Y atomically.
//    Other blocks: one dense *task* each = (row panel, chunk of at most `chunk` of the panel's
//    dense columns, at most max_ent of the chunk's entries: a chunk with more is split into
//    tasks that stage it again, for parallelism).  The block stages X[dense column, K tile] of the chunk in shared memory once
//    (coalesced vector loads, zero beyond K), then its warps split the task's entries evenly
//    (entries are ordered by row, then slot) and read X from shared memory (4 entries of one row
//    at a time where the row does not change: 4 loads in flight); a warp combines its
//    running row result into Y atomically whenever the row changes (so a hub row's dense entries
//    are spread over all warps of the block, and a panel's chunks over many blocks).
//    Atomics: red.add (float4/float2 vector form on sm_90), max/min through the integer order of
//    IEEE floats (signbit-split atomicMax/atomicMin on the int / unsigned bit patterns).
//
// Compile-time: R (0 sum, 1 max, 2 min), VEC (vector width of X loads / Y stores; K % VEC == 0 and
// 16/8-byte aligned pointers, else the launcher runs the VEC = 1 instance), CF (column slices per
// lane).  Run time: K, chunk (dynamic shared memory = chunk * KT * 4 bytes), warps per block,
// rows per warp, the task / segment arrays.
#include <cuda_runtime.h>
#include <math_constants.h>

namespace spc_aspt {

template <int R> __device__ __forceinline__ float red_init() {
  return R == 1 ? -CUDART_INF_F : (R == 2 ? CUDART_INF_F : 0.0f);
}
template <int R> __device__ __forceinline__ float red_op(float acc, float v) {
  if (R == 1) return fmaxf(acc, v);
  if (R == 2) return fminf(acc, v);
  return acc + v;
}

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

// atomic combine of one value into global memory
template <int R> __device__ __forceinline__ void atomic_red1(float* p, float v) {
  if (R == 1) {
    if (!signbit(v)) atomicMax(reinterpret_cast<int*>(p), __float_as_int(v));
    else atomicMin(reinterpret_cast<unsigned int*>(p), __float_as_uint(v));
  } else if (R == 2) {
    if (!signbit(v)) atomicMin(reinterpret_cast<int*>(p), __float_as_int(v));
    else atomicMax(reinterpret_cast<unsigned int*>(p), __float_as_uint(v));
  } else {
    atomicAdd(p, v);
  }
}
template <int R, int VEC> __device__ __forceinline__ void atomic_red(float* p, const float* v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (R == 0 && VEC == 4) { atomicAdd(reinterpret_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3])); return; }
  if (R == 0 && VEC == 2) { atomicAdd(reinterpret_cast<float2*>(p), make_float2(v[0], v[1])); return; }
#endif
#pragma unroll
  for (int u = 0; u < VEC; ++u) atomic_red1<R>(p + u, v[u]);
}

// reduce X rows of entries [lo, hi) of (col, val) into acc, GE-SpMM style (whole warp)
template <int R, int VEC, int CF>
__device__ __forceinline__ void csr_segment(const int* __restrict__ col, const float* __restrict__ val,
                                            int lo, int hi, const float* __restrict__ X, int K, int k0,
                                            int lane, float (&acc)[CF][VEC]) {
  for (int base = lo; base < hi; base += 32) {
    const int n = min(32, hi - base);
    int mc = 0;
    float mv = 0.0f;
    if (lane < n) { mc = col[base + lane]; mv = val[base + lane]; }
#pragma unroll 4
    for (int e = 0; e < n; ++e) {
      const int c_ = __shfl_sync(0xffffffffu, mc, e);
      const float a = __shfl_sync(0xffffffffu, mv, e);
      const float* xr = X + (size_t)c_ * K;
#pragma unroll
      for (int c = 0; c < CF; ++c) {
        const int k = k0 + c * 32 * VEC;
        if (k < K) {
          float v[VEC];
          ld<VEC>(xr + k, v);
#pragma unroll
          for (int u = 0; u < VEC; ++u) acc[c][u] = red_op<R>(acc[c][u], a * v[u]);
        }
      }
    }
  }
}

template <int R, int VEC, int CF>
__device__ __forceinline__ void aspt_rows(
    const int* __restrict__ rem_ptr, const int* __restrict__ rem_end1, const int* __restrict__ row_len,
    const int* __restrict__ rem_col, const float* __restrict__ rem_val, const int* __restrict__ row_ids,
    const float* __restrict__ X, float* __restrict__ Y, int m, int K, int rpw) {
  constexpr int KT = 32 * VEC * CF;
  const int lane = threadIdx.x & 31;
  const long long gw = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int k0 = blockIdx.y * KT + lane * VEC;
  for (int j = 0; j < rpw; ++j) {
    const long long r = gw * rpw + j;
    if (r >= m) return;                                    // uniform per warp
    const int lo = rem_ptr[r], hi = rem_end1[r];
    float acc[CF][VEC];
#pragma unroll
    for (int c = 0; c < CF; ++c)
#pragma unroll
      for (int u = 0; u < VEC; ++u) acc[c][u] = red_init<R>();
    csr_segment<R, VEC, CF>(rem_col, rem_val, lo, hi, X, K, k0, lane, acc);
    const bool empty = row_len[r] == 0;                   // no entry anywhere: 0
    float* yr = Y + (size_t)row_ids[r] * K;
#pragma unroll
    for (int c = 0; c < CF; ++c) {
      const int k = k0 + c * 32 * VEC;
      if (k < K) {
        float o[VEC];
#pragma unroll
        for (int u = 0; u < VEC; ++u) o[u] = empty ? 0.0f : acc[c][u];
        st<VEC>(yr + k, o);
      }
    }
  }
}

template <int R, int VEC, int CF>
__device__ __forceinline__ void flush(float* __restrict__ Y, int out, int K, int k0, float (&acc)[CF][VEC]) {
  float* yr = Y + (size_t)out * K;
#pragma unroll
  for (int c = 0; c < CF; ++c) {
    const int k = k0 + c * 32 * VEC;
    if (k < K) atomic_red<R, VEC>(yr + k, acc[c]);
  }
}

template <int R, int VEC, int CF>
__device__ __forceinline__ void aspt_tiles(
    const int* __restrict__ task_x0, const int* __restrict__ task_nc, const int* __restrict__ task_eptr,
    const int* __restrict__ dense_xrow,
    const int* __restrict__ ent_out, const int* __restrict__ ent_slot, const float* __restrict__ ent_val,
    const int* __restrict__ tail_lo, const int* __restrict__ tail_hi, const int* __restrict__ tail_out,
    const int* __restrict__ rem_col, const float* __restrict__ rem_val,
    const float* __restrict__ X, float* __restrict__ Y, int ntail, int ntail_blocks, int K) {
  extern __shared__ __align__(16) float xs[];             // chunk x KT staged X slices
  constexpr int KT = 32 * VEC * CF;
  constexpr int QV = KT / VEC;                             // vectors per staged row
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nw = blockDim.x >> 5;
  const int kt0 = blockIdx.y * KT;
  const int k0 = kt0 + lane * VEC;
  float acc[CF][VEC];
#pragma unroll
  for (int c = 0; c < CF; ++c)
#pragma unroll
    for (int u = 0; u < VEC; ++u) acc[c][u] = red_init<R>();

  if ((int)blockIdx.x < ntail_blocks) {                    // ---- tail segments of long rows
    const int s = blockIdx.x * nw + warp;
    if (s >= ntail) return;                                // no barrier in this branch
    csr_segment<R, VEC, CF>(rem_col, rem_val, tail_lo[s], tail_hi[s], X, K, k0, lane, acc);
    flush<R, VEC, CF>(Y, tail_out[s], K, k0, acc);
    return;
  }

  // ---- dense task: stage the chunk's X rows once
  const int t = blockIdx.x - ntail_blocks;
  const int x0 = task_x0[t], nc = task_nc[t];
  for (int i = threadIdx.x; i < nc * QV; i += blockDim.x) {
    const int s = i / QV, q = (i - s * QV) * VEC;
    float v[VEC];
#pragma unroll
    for (int u = 0; u < VEC; ++u) v[u] = 0.0f;
    if (kt0 + q < K) ld<VEC>(X + (size_t)dense_xrow[x0 + s] * K + kt0 + q, v);
    st<VEC>(xs + s * KT + q, v);
  }
  __syncthreads();

  // ---- the task's entries, split evenly over the warps
  const int e0 = task_eptr[t], ne = task_eptr[t + 1] - e0;
  const int lo = e0 + (int)(((long long)ne * warp) / nw);
  const int hi = e0 + (int)(((long long)ne * (warp + 1)) / nw);
  int cur = -1;
  for (int base = lo; base < hi; base += 32) {
    const int n = min(32, hi - base);
    int mo = -1, ms = 0;
    float mv = 0.0f;
    if (lane < n) { mo = ent_out[base + lane]; ms = ent_slot[base + lane]; mv = ent_val[base + lane]; }
    // bit e: entry e starts another row (than entry e - 1, or than `cur` for e = 0)
    const int prev = __shfl_up_sync(0xffffffffu, mo, 1);
    const unsigned starts = __ballot_sync(0xffffffffu, lane < n && (lane == 0 ? mo != cur : mo != prev));
    int e = 0;
    while (e < n) {                                        // uniform per warp
      if (e + 4 <= n && ((starts >> e) & 0xFu) == 0u) {    // 4 entries of the current row: 4 loads in flight
        int s4[4];
        float a4[4], v4[4][CF][VEC];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          s4[q] = __shfl_sync(0xffffffffu, ms, e + q);
          a4[q] = __shfl_sync(0xffffffffu, mv, e + q);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
          for (int c = 0; c < CF; ++c) lds<VEC>(xs + s4[q] * KT + lane * VEC + c * 32 * VEC, v4[q][c]);
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
          for (int c = 0; c < CF; ++c)
#pragma unroll
            for (int u = 0; u < VEC; ++u) acc[c][u] = red_op<R>(acc[c][u], a4[q] * v4[q][c][u]);
        e += 4;
        continue;
      }
      const int o = __shfl_sync(0xffffffffu, mo, e);
      const int s = __shfl_sync(0xffffffffu, ms, e);
      const float a = __shfl_sync(0xffffffffu, mv, e);
      if (o != cur) {                                      // uniform per warp
        if (cur >= 0) {
          flush<R, VEC, CF>(Y, cur, K, k0, acc);
#pragma unroll
          for (int c = 0; c < CF; ++c)
#pragma unroll
            for (int u = 0; u < VEC; ++u) acc[c][u] = red_init<R>();
        }
        cur = o;
      }
      const float* xr = xs + s * KT + lane * VEC;
#pragma unroll
      for (int c = 0; c < CF; ++c) {
        float v[VEC];
        lds<VEC>(xr + c * 32 * VEC, v);
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[c][u] = red_op<R>(acc[c][u], a * v[u]);
      }
      ++e;
    }
  }
  if (cur >= 0) flush<R, VEC, CF>(Y, cur, K, k0, acc);
}

}  // namespace spc_aspt

#define SPC_ASPT_SPMM_INSTANCE(NAME, R, VEC, CF)                                                     \
  extern "C" __global__ void __launch_bounds__(1024) NAME##_rows(                                   \
      const int* rem_ptr, const int* rem_end1, const int* row_len, const int* rem_col,              \
      const float* rem_val, const int* row_ids, const float* X, float* Y, int m, int K, int rpw) {  \
    spc_aspt::aspt_rows<R, VEC, CF>(rem_ptr, rem_end1, row_len, rem_col, rem_val, row_ids, X, Y,    \
                                    m, K, rpw);                                                     \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(1024) NAME##_tiles(                                  \
      const int* task_x0, const int* task_nc, const int* task_eptr, const int* dense_xrow,          \
      const int* ent_out, const int* ent_slot, const float* ent_val, const int* tail_lo, const int* tail_hi,            \
      const int* tail_out, const int* rem_col, const float* rem_val, const float* X, float* Y,      \
      int ntail, int ntail_blocks, int K) {                                                         \
    spc_aspt::aspt_tiles<R, VEC, CF>(task_x0, task_nc, task_eptr, dense_xrow, ent_out, ent_slot, ent_val,  \
                                     tail_lo, tail_hi, tail_out, rem_col, rem_val, X, Y, ntail,     \
                                     ntail_blocks, K);                                              \
  }
