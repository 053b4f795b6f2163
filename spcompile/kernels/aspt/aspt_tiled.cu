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
// max / min propagate NaN like the float64 reference (numpy's maximum / minimum): once the
// accumulator is NaN it stays NaN (v > NaN is false); fmaxf / fminf would drop it
template <int R> __device__ __forceinline__ float red_op(float acc, float v) {
  if (R == 1) return (v > acc || isnan(v)) ? v : acc;
  if (R == 2) return (v < acc || isnan(v)) ? v : acc;
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

// a NaN as the bit pattern that wins every later integer-order max (0x7fffffff: the largest int,
// and smaller than any negative float's unsigned pattern) or min (0xffffffff: -1 as an int, the
// largest unsigned): once stored, a NaN stays in Y whatever is combined after it
template <int R> __device__ __forceinline__ float sticky_nan(float v) {
  if (R == 0 || !isnan(v)) return v;
  return __int_as_float(R == 1 ? 0x7fffffff : (int)0xffffffffu);
}

// atomic combine of one value into global memory
template <int R> __device__ __forceinline__ void atomic_red1(float* p, float v) {
  v = sticky_nan<R>(v);
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
        for (int u = 0; u < VEC; ++u) o[u] = empty ? 0.0f : sticky_nan<R>(acc[c][u]);
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


// ================================================================================================
// scheme "panel" (v4): one launch, no global atomics, every output element written once.
//
// One thread block per (block descriptor b, K tile of KT = 32 * VEC columns).  Block b owns the
// rows [blk_row0[b], blk_row0[b] + blk_nrows[b]) of one row panel and a contiguous range of the
// panel's *steps* [blk_s0[b], blk_s1[b]): first gather steps (remainder entries, X rows read from
// global / L2 like a CSR kernel), then staged steps (a chunk of the panel's dense columns: its X
// rows are copied into shared memory with cp.async, the next chunk's copy in flight while the
// current one is used when NBUF = 2).  The block's rows' results live in shared memory
// (acc: H x KT floats, initialised to the reduction's identity); a step's entries (ordered by
// row, then column) are split evenly over the warps, each warp accumulates a running row result
// in registers (4 entries of one row in flight where the row does not change) and folds it into
// acc when the row changes: a plain shared-memory read-modify-write when no other warp can hold
// the row in this step (it is neither the first nor the last row of the warp's slice), else a
// shared-memory atomic.  Steps are separated by barriers.  At the end the block writes its rows
// once: into Y (rows with no entries at all get 0), or -- for a panel whose work was split over
// several blocks (blk_slot >= 0) -- into the fp32 scratch `part`; the last of the panel's blocks
// to finish (atomic counter per (group, K tile), reset afterwards) combines the partials in slot
// order (deterministic) and writes Y.
// ================================================================================================
template <int VEC> __device__ __forceinline__ void cp_async(float* dst, const float* src) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(VEC * 4));
#else
  float v[VEC];
  ld<VEC>(src, v);
  st<VEC>(dst, v);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// stage X[dense_xrow[x0 + s], kt0 : kt0 + KT] for s < nc into xs (zero beyond K); one commit group
template <int VEC>
__device__ __forceinline__ void stage_chunk(float* xs, const int* __restrict__ dense_xrow, int x0, int nc,
                                            const float* __restrict__ X, int K, int kt0) {
  constexpr int KT = 32 * VEC, QV = 32;
  for (int i = threadIdx.x; i < nc * QV; i += blockDim.x) {
    const int s = i / QV, q = (i - s * QV) * VEC;
    float* dst = xs + s * KT + q;
    if (kt0 + q < K) {
      cp_async<VEC>(dst, X + (size_t)dense_xrow[x0 + s] * K + kt0 + q);
    } else {
      float z[VEC];
#pragma unroll
      for (int u = 0; u < VEC; ++u) z[u] = 0.0f;
      st<VEC>(dst, z);
    }
  }
  cp_async_commit();
}

// shared-memory atomic combine (another warp may hold the same row in this step)
template <int R> __device__ __forceinline__ void smem_red1(float* p, float v) {
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

template <int R, int VEC>
__device__ __forceinline__ void fold(float* acc_row, bool shared_row, float (&a)[VEC]) {
  if (shared_row) {
#pragma unroll
    for (int u = 0; u < VEC; ++u) smem_red1<R>(acc_row + u, a[u]);
  } else {
    float o[VEC];
    lds<VEC>(acc_row, o);
#pragma unroll
    for (int u = 0; u < VEC; ++u) o[u] = red_op<R>(o[u], a[u]);
    st<VEC>(acc_row, o);
  }
#pragma unroll
  for (int u = 0; u < VEC; ++u) a[u] = red_init<R>();
}

// one warp: entries [lo, hi) (ordered by row), X rows from `src` (global X: GLOBAL, row stride K,
// lane offset k0, loads only where k0 < K; staged chunk: row stride KT; `stride`), folded into acc
template <int R, int VEC, bool GLOBAL>
__device__ __forceinline__ void panel_slice(const int* __restrict__ ent_row, const int* __restrict__ ent_col,
                                            const float* __restrict__ ent_val, int lo, int hi,
                                            const float* src, int stride, int off, bool active, float* acc, int lane) {
  constexpr int KT = 32 * VEC;
  if (lo >= hi) return;                                   // uniform per warp
  const int rfirst = ent_row[lo], rlast = ent_row[hi - 1];
  float a[VEC];
#pragma unroll
  for (int u = 0; u < VEC; ++u) a[u] = red_init<R>();
  int cur = -1;
  for (int base = lo; base < hi; base += 32) {
    const int n = min(32, hi - base);
    int mo = -1, mc = 0;
    float mv = 0.0f;
    if (lane < n) { mo = ent_row[base + lane]; mc = ent_col[base + lane]; mv = ent_val[base + lane]; }
    const int prev = __shfl_up_sync(0xffffffffu, mo, 1);
    const unsigned starts = __ballot_sync(0xffffffffu, lane < n && (lane == 0 ? mo != cur : mo != prev));
    int e = 0;
    while (e < n) {                                       // uniform per warp
      if (e + 4 <= n && ((starts >> e) & 0xFu) == 0u) {   // 4 entries of the current row
        float a4[4], v4[4][VEC];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int c_ = __shfl_sync(0xffffffffu, mc, e + q);
          a4[q] = __shfl_sync(0xffffffffu, mv, e + q);
          if (GLOBAL) {
            if (active) ld<VEC>(src + (size_t)c_ * stride + off, v4[q]);
            else {
#pragma unroll
              for (int u = 0; u < VEC; ++u) v4[q][u] = 0.0f;
            }
          } else {
            lds<VEC>(src + c_ * stride + off, v4[q]);
          }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
          for (int u = 0; u < VEC; ++u) a[u] = red_op<R>(a[u], a4[q] * v4[q][u]);
        e += 4;
        continue;
      }
      const int o = __shfl_sync(0xffffffffu, mo, e);
      const int c_ = __shfl_sync(0xffffffffu, mc, e);
      const float w = __shfl_sync(0xffffffffu, mv, e);
      if (o != cur) {                                     // uniform per warp
        if (cur >= 0) fold<R, VEC>(acc + cur * KT + lane * VEC, cur == rfirst || cur == rlast, a);
        cur = o;
      }
      float v[VEC];
      if (GLOBAL) {
        if (active) ld<VEC>(src + (size_t)c_ * stride + off, v);
        else {
#pragma unroll
          for (int u = 0; u < VEC; ++u) v[u] = 0.0f;
        }
      } else {
        lds<VEC>(src + c_ * stride + off, v);
      }
#pragma unroll
      for (int u = 0; u < VEC; ++u) a[u] = red_op<R>(a[u], w * v[u]);
      ++e;
    }
  }
  fold<R, VEC>(acc + cur * KT + lane * VEC, cur == rfirst || cur == rlast, a);
}

template <int VEC> __device__ __forceinline__ void ldcg(const float* p, float* v) {
  if (VEC == 4) { float4 t = __ldcg(reinterpret_cast<const float4*>(p)); v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; }
  else if (VEC == 2) { float2 t = __ldcg(reinterpret_cast<const float2*>(p)); v[0] = t.x; v[1] = t.y; }
  else v[0] = __ldcg(p);
}

template <int R, int VEC, int NBUF>
__device__ __forceinline__ void aspt_panels(
    const int* __restrict__ blk_row0, const int* __restrict__ blk_nrows, const int* __restrict__ blk_s0,
    const int* __restrict__ blk_sf, const int* __restrict__ blk_s1, const int* __restrict__ blk_slot,
    const int* __restrict__ blk_grp, const int* __restrict__ st_x0, const int* __restrict__ st_nc,
    const int* __restrict__ st_eptr, const int* __restrict__ dense_xrow, const int* __restrict__ ent_row,
    const int* __restrict__ ent_col, const float* __restrict__ ent_val, const int* __restrict__ row_len,
    const int* __restrict__ row_ids, const int* __restrict__ grp_first, const int* __restrict__ grp_n,
    const float* __restrict__ X, float* __restrict__ Y, float* part, int* counters, int K, int H, int chunk) {
  extern __shared__ __align__(16) float sm[];
  __shared__ int s_last;
  constexpr int KT = 32 * VEC, QV = 32;
  float* acc = sm;                                         // H x KT
  float* xs = sm + H * KT;                                 // NBUF x chunk x KT
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nw = blockDim.x >> 5;
  const int b = blockIdx.x;
  const int kt0 = blockIdx.y * KT;
  const int k0 = kt0 + lane * VEC;
  const int row0 = blk_row0[b], nrows = blk_nrows[b];
  const int s0 = blk_s0[b], sf = blk_sf[b], s1 = blk_s1[b];
  {
    float z[VEC];
#pragma unroll
    for (int u = 0; u < VEC; ++u) z[u] = red_init<R>();
    for (int i = threadIdx.x; i < nrows * QV; i += blockDim.x) st<VEC>(acc + i * VEC, z);
  }
  if (sf < s1) stage_chunk<VEC>(xs, dense_xrow, st_x0[sf], st_nc[sf], X, K, kt0);   // in flight during gathers
  int buf = 0;
  for (int s = s0; s < s1; ++s) {
    __syncthreads();                                       // previous step done (buffers, acc rows)
    const int e0 = st_eptr[s], ne = st_eptr[s + 1] - e0;
    const int lo = e0 + (int)(((long long)ne * warp) / nw);
    const int hi = e0 + (int)(((long long)ne * (warp + 1)) / nw);
    if (s < sf) {                                          // gather step (remainder entries)
      panel_slice<R, VEC, true>(ent_row, ent_col, ent_val, lo, hi, X, K, k0, k0 < K, acc, lane);
      continue;
    }
    if (NBUF == 1) {
      if (s > sf) stage_chunk<VEC>(xs, dense_xrow, st_x0[s], st_nc[s], X, K, kt0);
      cp_async_wait<0>();
    } else {
      if (s + 1 < s1) {
        stage_chunk<VEC>(xs + (buf ^ 1) * chunk * KT, dense_xrow, st_x0[s + 1], st_nc[s + 1], X, K, kt0);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    }
    __syncthreads();                                       // the chunk is in shared memory
    panel_slice<R, VEC, false>(ent_row, ent_col, ent_val, lo, hi, xs + buf * chunk * KT, KT, lane * VEC, true,
                               acc, lane);
    if (NBUF == 2) buf ^= 1;
  }
  cp_async_wait<0>();
  __syncthreads();

  const int slot = blk_slot[b];
  if (slot < 0) {                                          // the whole panel's rows: write Y once
    for (int i = threadIdx.x; i < nrows * QV; i += blockDim.x) {
      const int r = i / QV, q = (i - r * QV) * VEC;
      if (kt0 + q < K) {
        float o[VEC];
        lds<VEC>(acc + r * KT + q, o);
        if (row_len[row0 + r] == 0) {
#pragma unroll
          for (int u = 0; u < VEC; ++u) o[u] = 0.0f;
        }
        st<VEC>(Y + (size_t)row_ids[row0 + r] * K + kt0 + q, o);
      }
    }
    return;
  }
  // split panel: partial to the scratch, the last block of the group combines in slot order
  float* pp = part + (size_t)slot * H * K;
  for (int i = threadIdx.x; i < nrows * QV; i += blockDim.x) {
    const int r = i / QV, q = (i - r * QV) * VEC;
    if (kt0 + q < K) {
      float o[VEC];
      lds<VEC>(acc + r * KT + q, o);
      st<VEC>(pp + (size_t)r * K + kt0 + q, o);
    }
  }
  __threadfence();
  __syncthreads();
  const int g = blk_grp[b];
  const int cidx = g * gridDim.y + blockIdx.y;
  const int first = grp_first[g], ns = grp_n[g];
  if (threadIdx.x == 0) s_last = atomicAdd(counters + cidx, 1) == ns - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int i = threadIdx.x; i < nrows * QV; i += blockDim.x) {
    const int r = i / QV, q = (i - r * QV) * VEC;
    if (kt0 + q < K) {
      float o[VEC];
#pragma unroll
      for (int u = 0; u < VEC; ++u) o[u] = red_init<R>();
      const float* pr = part + (size_t)first * H * K + (size_t)r * K + kt0 + q;
      for (int j0 = 0; j0 < ns; j0 += 4) {                 // 4 partials in flight, slot order
        float t[4][VEC];
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j0 + j < ns) ldcg<VEC>(pr + (size_t)(j0 + j) * H * K, t[j]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (j0 + j < ns) {
#pragma unroll
            for (int u = 0; u < VEC; ++u) o[u] = red_op<R>(o[u], t[j][u]);
          }
      }
      if (row_len[row0 + r] == 0) {
#pragma unroll
        for (int u = 0; u < VEC; ++u) o[u] = 0.0f;
      }
      st<VEC>(Y + (size_t)row_ids[row0 + r] * K + kt0 + q, o);
    }
  }
  if (threadIdx.x == 0) counters[cidx] = 0;                // ready for the next call (stream order)
}

}  // namespace spc_aspt

#define SPC_ASPT_INST_0(NAME, R, VEC, CF)                                                     \
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

#define SPC_ASPT_INST_1(NAME, R, VEC, NBUF)                                                        \
  extern "C" __global__ void __launch_bounds__(1024) NAME##_panels(                                 \
      const int* blk_row0, const int* blk_nrows, const int* blk_s0, const int* blk_sf,              \
      const int* blk_s1, const int* blk_slot, const int* blk_grp, const int* st_x0,                 \
      const int* st_nc, const int* st_eptr, const int* dense_xrow, const int* ent_row,              \
      const int* ent_col, const float* ent_val, const int* row_len, const int* row_ids,             \
      const int* grp_first, const int* grp_n, const float* X, float* Y, float* part,                \
      int* counters, int K, int H, int chunk) {                                                     \
    spc_aspt::aspt_panels<R, VEC, NBUF>(blk_row0, blk_nrows, blk_s0, blk_sf, blk_s1, blk_slot,      \
                                        blk_grp, st_x0, st_nc, st_eptr, dense_xrow, ent_row,        \
                                        ent_col, ent_val, row_len, row_ids, grp_first, grp_n, X, Y, \
                                        part, counters, K, H, chunk);                               \
  }

// S = 0: scheme "tasks" (v3: <NAME>_rows + <NAME>_tiles, A = CF); S = 1: scheme "panel" (v4:
// <NAME>_panels, A = NBUF shared-memory chunk buffers)
#define SPC_ASPT_CAT(a, b) a##b
#define SPC_ASPT_SPMM_INSTANCE(NAME, S, R, VEC, A) SPC_ASPT_CAT(SPC_ASPT_INST_, S)(NAME, R, VEC, A)
