// Row-window SpMM with the window's X rows staged in shared memory:
//   Y[row_ids[i], :] = reduce over the entries p of row i of  data[p] * X[ucols[win_ptr[w] + lidx[p]], :]
// for the kernel rows i of window w = i / W (W = warps per block x RPW consecutive rows), reduce in
// {sum, max, min, mean}.
//
// A window's distinct columns (ucols[win_ptr[w] .. win_ptr[w+1]), sorted) are each loaded ONCE per
// column tile into shared memory and then read by every row of the window that has an entry in that
// column: a column shared by r rows of the window costs one L2 gather instead of r (GE-SpMM's plain
// mapping gathers it r times; L1 does not keep it across the window's rows, measured on the H100).
// Entries store their column as lidx, the index into the window's distinct columns, and each row's
// entries are sorted by it.
//
// One thread block per (window, column tile of KT = 32 * VEC elements): warp v of the block's NW
// warps owns the RPW rows v, v + NW, v + 2 NW, ... of the window (interleaved, so that rows of
// similar length -- consecutive after a degree order -- spread over the warps), lane l the VEC
// columns at tile * KT + l * VEC.  The window's
// distinct columns are staged in chunks of `chunk` columns (chunk x KT elements of T per buffer,
// cp.async, NBUF = 2: the next chunk's copy in flight while the current one is reduced).  Per
// chunk, each warp goes over its rows: 32 (lidx, value) pairs of the row are loaded coalesced
// (the first batch of all RPW rows at once), a ballot finds how many of them fall in the chunk (a
// prefix: the row's entries are sorted), and those are broadcast by shuffles and reduced against
// the staged rows (conflict-free 4 / 8 / 16-byte shared loads, 8 in flight).  The row's cursor and its RPW x VEC accumulators stay in registers across
// chunks; rows are written once, with plain stores, after the last chunk (no atomics, no
// workspace: the output is deterministic).
//
// Compile-time: T (element type of X and Y; A's values and all arithmetic are fp32, Y rounded once),
// R (0 sum, 1 max, 2 min, 3 mean), VEC (elements per lane: at most 16 bytes; K % VEC == 0 and
// aligned X / Y, else the launcher runs the VEC = 1 instance), RPW (rows per warp), NBUF (1 or 2
// staging buffers).  Run time: K, m (kernel rows), chunk (columns per buffer: dynamic shared
// memory = NBUF * chunk * KT * sizeof(T)).
//
// The element helpers (to_f / from_f, packed vector loads and stores, reductions) are the ones of
// ../csr/spmm_crc_cwm.cu, included here (its kernel is not instantiated).

#include "../csr/spmm_crc_cwm.cu"

namespace spc {

// one piece of BYTES bytes global -> shared: cp.async where the size allows it (4 / 8 / 16
// bytes; 16 bypasses L1, the row is read from shared memory only), else a plain copy
template <int BYTES> __device__ __forceinline__ void stage_piece(void* dst, const void* src) {
  if (BYTES >= 4) {
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    if (BYTES == 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
    else
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(BYTES));
  } else {
    *reinterpret_cast<unsigned short*>(dst) = __ldg(reinterpret_cast<const unsigned short*>(src));
  }
}
__device__ __forceinline__ void stage_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void stage_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// stage the distinct columns [c0, c1) of the window (global ids in cols) into buf, KT elements each
template <typename T, int VEC>
__device__ __forceinline__ void stage_chunk(T* buf, const int* __restrict__ cols, int c0, int c1,
                                            const T* __restrict__ X, int K, int k0) {
  constexpr int KT = 32 * VEC;
  const int pieces = (c1 - c0) * 32;
  for (int q = threadIdx.x; q < pieces; q += blockDim.x) {
    const int i = q >> 5, l = q & 31, k = k0 + l * VEC;
    if (k < K) stage_piece<sizeof(T) * VEC>(buf + i * KT + l * VEC, X + (size_t)cols[c0 + i] * K + k);
  }
}

template <typename T, int R, int VEC, int RPW, int NBUF>
__device__ __forceinline__ void spmm_window(
    const int* __restrict__ win_ptr, const int* __restrict__ ucols, const int* __restrict__ indptr,
    const int* __restrict__ lidx, const float* __restrict__ data, const int* __restrict__ row_ids,
    const T* __restrict__ X, T* __restrict__ Y, int m, int K, int chunk) {
  static_assert(NBUF == 1 || NBUF == 2, "one or two staging buffers");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* stage = reinterpret_cast<T*>(smem_raw);
  constexpr int KT = 32 * VEC;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int NW = blockDim.x >> 5, W = NW * RPW;
  const int w = blockIdx.x;
  const int k0 = blockIdx.y * KT, col = k0 + lane * VEC;
  const int row0 = w * W + warp;             // the warp's rows: row0 + r * NW
  const int u0 = win_ptr[w], D = win_ptr[w + 1] - u0;
  const int* __restrict__ wcols = ucols + u0;
  const int nch = (D + chunk - 1) / chunk;

  int cur[RPW], end[RPW];
  float acc[RPW][VEC];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int i = row0 + r * NW;
    cur[r] = i < m ? indptr[i] : 0;
    end[r] = i < m ? indptr[i + 1] : 0;
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[r][v] = red_init<R>();
  }
  int len[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) len[r] = end[r] - cur[r];

  if (nch > 0) {
    stage_chunk<T, VEC>(stage, wcols, 0, min(chunk, D), X, K, k0);
    stage_commit();
  }
  for (int c = 0; c < nch; ++c) {
    T* buf = stage + (NBUF == 2 ? (c & 1) : 0) * chunk * KT;
    if (NBUF == 1) {                           // one buffer: stage this chunk, then reduce it
      if (c > 0) {
        stage_chunk<T, VEC>(stage, wcols, c * chunk, min((c + 1) * chunk, D), X, K, k0);
        stage_commit();
      }
      stage_wait<0>();
    } else if (c + 1 < nch) {                  // two: the next chunk's copy in flight during this one
      stage_chunk<T, VEC>(stage + ((c + 1) & 1) * chunk * KT, wcols, (c + 1) * chunk, min((c + 2) * chunk, D), X, K, k0);
      stage_commit();
      stage_wait<1>();
    } else {
      stage_wait<0>();
    }
    __syncthreads();
    const int base = c * chunk, cend = min(base + chunk, D);
    // the first 32 (lidx, value) pairs of every row of the warp, loaded together (RPW loads in
    // flight instead of one row's latency after another)
    int ml[RPW];
    float mv[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int q = cur[r] + lane;
      ml[r] = q < end[r] ? lidx[q] : 0x7fffffff;
      mv[r] = q < end[r] ? data[q] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      int p = cur[r];
      const int e = end[r];
      int my_l = ml[r];
      float my_v = mv[r];
      while (p < e) {
        const int n = __popc(__ballot_sync(0xffffffffu, my_l < cend));   // a prefix: lidx rises along the row
        // U = 8 staged rows loaded before any is accumulated (independent shared loads in flight),
        // then reduced in entry order
        for (int j0 = 0; j0 < n; j0 += 8) {
          pack_t<T, VEC> x[8];
          float a[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const int l = __shfl_sync(0xffffffffu, my_l, (j0 + u) & 31) - base;
            a[u] = __shfl_sync(0xffffffffu, my_v, (j0 + u) & 31);
            if (j0 + u < n && col < K)
              x[u].raw = *reinterpret_cast<const typename raw_t<sizeof(T) * VEC>::type*>(buf + l * KT + lane * VEC);
          }
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            if (j0 + u < n && col < K) {
#pragma unroll
              for (int v = 0; v < VEC; ++v) acc[r][v] = red_op<R>(acc[r][v], a[u] * to_f(x[u].e[v]));
            }
          }
        }
        p += n;
        if (n < 32) break;                         // the row's end or the chunk's
        const int q = p + lane;
        my_l = q < e ? lidx[q] : 0x7fffffff;
        my_v = q < e ? data[q] : 0.0f;
      }
      cur[r] = p;
    }
    if (c + 1 < nch) __syncthreads();              // the buffer is refilled next
  }

  if (col < K) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int i = row0 + r * NW;
      if (i < m) {
        const float scale = (R == 3 && len[r] > 0) ? 1.0f / (float)len[r] : 1.0f;
        float o[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) o[v] = len[r] == 0 ? 0.0f : acc[r][v] * scale;
        store_vec<T, VEC>(Y + (size_t)row_ids[i] * K + col, o);
      }
    }
  }
}

}  // namespace spc

#define SPC_WINDOW_INSTANCE(NAME, TN, R, VEC, RPW, NBUF)                                             \
  extern "C" __global__ void __launch_bounds__(512) NAME(                                            \
      const int* win_ptr, const int* ucols, const int* indptr, const int* lidx, const float* data,   \
      const int* row_ids, const SPC_ELEM(TN)* X, SPC_ELEM(TN)* Y, int m, int K, int chunk) {         \
    spc::spmm_window<SPC_ELEM(TN), R, VEC, RPW, NBUF>(win_ptr, ucols, indptr, lidx, data, row_ids, X, \
                                                      Y, m, K, chunk);                               \
  }
