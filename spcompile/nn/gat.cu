// Fused multi-head GAT aggregation (spcompile.nn.gat): for every target row i of a CSR graph
// (columns: source nodes j) and head k,
//   z_ij = a_src[j,k] + a_dst[i,k],  e_ij = leaky_relu(z_ij),  alpha_ij = softmax_j(e_ij),
//   out[i,k,:] = sum_j alpha_ij h[j,k,:]            (h: n_cols x H x C, out: n_rows x H x C)
// and its backward.  Empty rows give 0 (their lse is -inf).
//
// Thread mapping: a *group* of G lanes (G a power of two <= 32, groups aligned inside warps) owns
// one (segment, head) work item; consecutive groups are the heads of one segment, so a warp reads
// the contiguous H x C block of a node.  A segment is a run of at most S entries of ONE row (rows
// longer than S are cut into balanced segments, whose partial results a combine kernel merges in
// segment order: deterministic, no atomics).  The lanes of a group cover C in VEC-wide vector loads
// (column c*G*VEC + lane*VEC of the tile, c < CH; tile width TW = G*VEC*CH); when C > TW,
// blockIdx.y walks the column tiles (the scalar work is repeated per tile, only tile 0 writes the
// per-(row, head) scalars).  Entries are processed G at a time: lane t loads entry base+t's column
// and logit, the group shares them by shuffles, and every lane accumulates its columns.
//
// Kernels (one extern "C" set per (T, VEC, G, CH), see the SPC_GAT_* macros at the end):
//   gat_fwd_*       online softmax (running max m, running sum l, rescaled accumulator) over a
//                   segment; whole rows write out = acc / l and lse = m + log l, split rows write
//                   (acc, m, l) to the partial slots;
//   gat_fwd_merge_* one warp per (split row, head): merges the partial (acc, m, l) of its segments;
//   gat_dot_*       D[i,k] = <dout[i,k,:], out[i,k,:]>, one group per (row, head);
//   gat_bwd_col_*   over the TRANSPOSED graph (one segment: a run of target rows i of one source
//                   j): alpha_ij = exp(e_ij - lse_ik) recomputed, dalpha_ij = <dout_i, h_j> (h_j's
//                   slice is held in registers), dz_ij = alpha_ij (dalpha_ij - D_ik) leaky'(z_ij);
//                   dh[j,k,:] = sum_i alpha_ij dout[i,k,:], da_src[j,k] = sum_i dz_ij, and dz_ij
//                   written per entry (in the CSR entry order, through tperm) for the row sums;
//   gat_sum_merge_* one warp per (split source, head): sums the partial dh / da_src of its segments;
//   gat_row_sum     one warp per row: da_dst[i,k] = sum over row i's entries of dz (CSR order).
//
// T: element type of h, out, dout, dh (float, __half, __nv_bfloat16); a_src, a_dst, lse, D, dz and
// every accumulation are fp32.  C % VEC == 0 and VEC-aligned pointers (the launcher falls back to
// VEC = 1 otherwise).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace spc_gat {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <int BYTES> struct raw_t;
template <> struct raw_t<2> { typedef unsigned short type; };
template <> struct raw_t<4> { typedef unsigned int type; };
template <> struct raw_t<8> { typedef uint2 type; };
template <> struct raw_t<16> { typedef uint4 type; };
template <typename T, int VEC> union pack_t {
  typename raw_t<sizeof(T) * VEC>::type raw;
  T e[VEC];
};

template <typename T, int VEC> __device__ __forceinline__ void load(const T* __restrict__ p, float* v) {
  typedef typename raw_t<sizeof(T) * VEC>::type RT;
  pack_t<T, VEC> u;
  u.raw = __ldg(reinterpret_cast<const RT*>(p));
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = to_f(u.e[i]);
}

template <typename T, int VEC> __device__ __forceinline__ void store(T* __restrict__ p, const float* v) {
  typedef typename raw_t<sizeof(T) * VEC>::type RT;
  pack_t<T, VEC> u;
#pragma unroll
  for (int i = 0; i < VEC; ++i) u.e[i] = from_f<T>(v[i]);
  *reinterpret_cast<RT*>(p) = u.raw;
}

// the lanes of this thread's group inside its warp
template <int G> __device__ __forceinline__ unsigned group_mask() {
  if constexpr (G == 32) return 0xffffffffu;
  else return ((1u << G) - 1u) << (((threadIdx.x & 31u) / G) * G);
}

template <int G> __device__ __forceinline__ float group_sum(float v, unsigned mask) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) v += __shfl_xor_sync(mask, v, off, G);
  return v;
}

template <int G> __device__ __forceinline__ float group_max(float v, unsigned mask) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, off, G));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// this lane's part of <a, b> over all C columns (every tile)
template <typename T, int VEC, int G, int CH>
__device__ __forceinline__ float dot_part(const T* __restrict__ a, const T* __restrict__ b, int C, int lane) {
  constexpr int TW = G * VEC * CH;
  float s = 0.0f;
  for (int t0 = 0; t0 < C; t0 += TW) {
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int col = t0 + (c * G + lane) * VEC;
      if (col < C) {
        float x[VEC], y[VEC];
        load<T, VEC>(a + col, x);
        load<T, VEC>(b + col, y);
#pragma unroll
        for (int v = 0; v < VEC; ++v) s = fmaf(x[v], y[v], s);
      }
    }
  }
  return s;
}

// ---- forward --------------------------------------------------------------------------------
template <typename T, int VEC, int G, int CH>
__device__ __forceinline__ void fwd(const int* __restrict__ seg_ptr, const int* __restrict__ seg_row,
                                    const int* __restrict__ seg_slot, const int* __restrict__ indices,
                                    const T* __restrict__ h, const float* __restrict__ a_src,
                                    const float* __restrict__ a_dst, T* __restrict__ out, float* __restrict__ lse,
                                    float* __restrict__ part_acc, float* __restrict__ part_ml, int nseg, int H,
                                    int C, float slope) {
  constexpr int TW = G * VEC * CH;
  const long long gid = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / G;
  if (gid >= (long long)nseg * H) return;        // whole groups leave together
  const int lane = (int)(threadIdx.x % G);
  const unsigned mask = group_mask<G>();
  const int seg = (int)(gid / H), k = (int)(gid % H);
  const int row = seg_row[seg], lo = seg_ptr[seg], hi = seg_ptr[seg + 1];
  const int t0 = (int)blockIdx.y * TW;
  const float ad = a_dst[(size_t)row * H + k];
  float m = -INFINITY, l = 0.0f;                  // l: this lane's share of the running sum
  float acc[CH][VEC];
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[c][v] = 0.0f;

  int jn = lo + lane < hi ? indices[lo + lane] : 0;   // the next batch's columns, loaded ahead
  for (int base = lo; base < hi; base += G) {
    const bool valid = base + lane < hi;
    const int j = jn;
    if (base + G + lane < hi) jn = indices[base + G + lane];
    float e = -INFINITY;
    if (valid) {
      const float z = a_src[(size_t)j * H + k] + ad;
      e = z > 0.0f ? z : z * slope;
    }
    const float mn = fmaxf(m, group_max<G>(e, mask));  // finite: the batch holds a valid entry
    const float scale = expf(m - mn);                  // 0 on the first batch (m = -inf)
    const float w = valid ? expf(e - mn) : 0.0f;
    l = fmaf(l, scale, w);
    m = mn;
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[c][v] *= scale;
    const int cnt = min(G, hi - base);
#pragma unroll
    for (int t = 0; t < G; ++t) {
      if (t < cnt) {                                   // group-uniform
        const int jt = __shfl_sync(mask, j, t, G);
        const float wt = __shfl_sync(mask, w, t, G);
        const T* hr = h + ((size_t)jt * H + k) * C;
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          const int col = t0 + (c * G + lane) * VEC;
          if (col < C) {
            float x[VEC];
            load<T, VEC>(hr + col, x);
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[c][v] = fmaf(wt, x[v], acc[c][v]);
          }
        }
      }
    }
  }
  const float lsum = group_sum<G>(l, mask);
  const int slot = seg_slot[seg];
  if (slot < 0) {                                     // the whole row: final results
    const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
    T* orow = out + ((size_t)row * H + k) * C;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int col = t0 + (c * G + lane) * VEC;
      if (col < C) {
        float o[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) o[v] = acc[c][v] * inv;
        store<T, VEC>(orow + col, o);
      }
    }
    if (blockIdx.y == 0 && lane == 0) lse[(size_t)row * H + k] = lsum > 0.0f ? m + logf(lsum) : -INFINITY;
  } else {                                            // a segment of a split row: its partials
    float* prow = part_acc + ((size_t)slot * H + k) * C;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int col = t0 + (c * G + lane) * VEC;
      if (col < C) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) prow[col + v] = acc[c][v];
      }
    }
    if (blockIdx.y == 0 && lane == 0) {
      part_ml[((size_t)slot * H + k) * 2] = m;
      part_ml[((size_t)slot * H + k) * 2 + 1] = lsum;
    }
  }
}

// one warp per (split row, head); the segments of a split row are never empty
template <typename T>
__device__ __forceinline__ void fwd_merge(const int* __restrict__ split_ptr, const int* __restrict__ split_row,
                                          const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                          T* __restrict__ out, float* __restrict__ lse, int nsplit, int H, int C) {
  const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (w >= (long long)nsplit * H) return;
  const int lane = (int)(threadIdx.x & 31u);
  const int r = (int)(w / H), k = (int)(w % H);
  const int s0 = split_ptr[r], s1 = split_ptr[r + 1], row = split_row[r];
  float M = -INFINITY;
  for (int s = s0; s < s1; ++s) M = fmaxf(M, part_ml[((size_t)s * H + k) * 2]);
  float L = 0.0f;
  for (int s = s0; s < s1; ++s) {
    const size_t q = ((size_t)s * H + k) * 2;
    L = fmaf(part_ml[q + 1], expf(part_ml[q] - M), L);
  }
  const float inv = 1.0f / L;
  T* orow = out + ((size_t)row * H + k) * C;
  for (int c = lane; c < C; c += 32) {
    float o = 0.0f;
    for (int s = s0; s < s1; ++s)
      o = fmaf(part_acc[((size_t)s * H + k) * C + c], expf(part_ml[((size_t)s * H + k) * 2] - M), o);
    orow[c] = from_f<T>(o * inv);
  }
  if (lane == 0) lse[(size_t)row * H + k] = M + logf(L);
}

// ---- backward -------------------------------------------------------------------------------
// D[r] = <a[r,:], b[r,:]> for r < nrows (rows of C elements): one group per row
template <typename T, int VEC, int G, int CH>
__device__ __forceinline__ void rowdot(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ D,
                                       long long nrows, int C) {
  const long long gid = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / G;
  if (gid >= nrows) return;
  const int lane = (int)(threadIdx.x % G);
  const float s = group_sum<G>(dot_part<T, VEC, G, CH>(a + (size_t)gid * C, b + (size_t)gid * C, C, lane),
                               group_mask<G>());
  if (lane == 0) D[gid] = s;
}

template <typename T, int VEC, int G, int CH>
__device__ __forceinline__ void bwd_col(const int* __restrict__ tseg_ptr, const int* __restrict__ tseg_row,
                                        const int* __restrict__ tseg_slot, const int* __restrict__ t_idx,
                                        const int* __restrict__ t_perm, const T* __restrict__ h,
                                        const float* __restrict__ a_src, const float* __restrict__ a_dst,
                                        const float* __restrict__ lse, const float* __restrict__ D,
                                        const T* __restrict__ dout, T* __restrict__ dh, float* __restrict__ da_src,
                                        float* __restrict__ dz, float* __restrict__ part_acc,
                                        float* __restrict__ part_s, int nseg, int H, int C, float slope) {
  constexpr int TW = G * VEC * CH;
  const long long gid = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / G;
  if (gid >= (long long)nseg * H) return;
  const int lane = (int)(threadIdx.x % G);
  const unsigned mask = group_mask<G>();
  const int seg = (int)(gid / H), k = (int)(gid % H);
  const int j = tseg_row[seg], lo = tseg_ptr[seg], hi = tseg_ptr[seg + 1];
  const int t0 = (int)blockIdx.y * TW;
  const bool one_tile = C <= TW;                      // h_j's whole row is in hreg
  const float as = a_src[(size_t)j * H + k];
  const T* hj = h + ((size_t)j * H + k) * C;
  float hreg[CH][VEC], acc[CH][VEC];
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int col = t0 + (c * G + lane) * VEC;
    if (col < C) load<T, VEC>(hj + col, hreg[c]);
    else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) hreg[c][v] = 0.0f;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[c][v] = 0.0f;
  }
  float das = 0.0f;                                   // this lane's share of da_src
  int in = lo + lane < hi ? t_idx[lo + lane] : 0;
  for (int base = lo; base < hi; base += G) {
    const int q = base + lane;
    const bool valid = q < hi;
    const int i = in;
    if (base + G + lane < hi) in = t_idx[base + G + lane];
    float alpha = 0.0f, zf = 0.0f, Di = 0.0f;
    if (valid) {
      const size_t ik = (size_t)i * H + k;
      const float z = as + a_dst[ik];
      zf = z > 0.0f ? 1.0f : slope;
      alpha = expf(z * zf - lse[ik]);
      Di = D[ik];
    }
    float dal = 0.0f;                                 // <dout_i, h_j> of this lane's entry
    const int cnt = min(G, hi - base);
#pragma unroll
    for (int t = 0; t < G; ++t) {
      if (t < cnt) {                                  // group-uniform
        const int it = __shfl_sync(mask, i, t, G);
        const float at = __shfl_sync(mask, alpha, t, G);
        const T* dr = dout + ((size_t)it * H + k) * C;
        float part = 0.0f;
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          const int col = t0 + (c * G + lane) * VEC;
          if (col < C) {
            float d[VEC];
            load<T, VEC>(dr + col, d);
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
              acc[c][v] = fmaf(at, d[v], acc[c][v]);
              part = fmaf(hreg[c][v], d[v], part);
            }
          }
        }
        if (!one_tile) part = dot_part<T, VEC, G, CH>(dr, hj, C, lane);
        part = group_sum<G>(part, mask);
        if (lane == t) dal = part;
      }
    }
    if (valid) {
      const float g = alpha * (dal - Di) * zf;
      das += g;
      if (blockIdx.y == 0) dz[(size_t)t_perm[q] * H + k] = g;
    }
  }
  das = group_sum<G>(das, mask);
  const int slot = tseg_slot[seg];
  if (slot < 0) {
    T* drow = dh + ((size_t)j * H + k) * C;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int col = t0 + (c * G + lane) * VEC;
      if (col < C) store<T, VEC>(drow + col, acc[c]);
    }
    if (blockIdx.y == 0 && lane == 0) da_src[(size_t)j * H + k] = das;
  } else {
    float* prow = part_acc + ((size_t)slot * H + k) * C;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int col = t0 + (c * G + lane) * VEC;
      if (col < C) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) prow[col + v] = acc[c][v];
      }
    }
    if (blockIdx.y == 0 && lane == 0) part_s[(size_t)slot * H + k] = das;
  }
}

// one warp per (split source, head): dh and da_src as the sums of the segments' partials
template <typename T>
__device__ __forceinline__ void sum_merge(const int* __restrict__ split_ptr, const int* __restrict__ split_row,
                                          const float* __restrict__ part_acc, const float* __restrict__ part_s,
                                          T* __restrict__ dh, float* __restrict__ da_src, int nsplit, int H, int C) {
  const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (w >= (long long)nsplit * H) return;
  const int lane = (int)(threadIdx.x & 31u);
  const int r = (int)(w / H), k = (int)(w % H);
  const int s0 = split_ptr[r], s1 = split_ptr[r + 1], j = split_row[r];
  T* drow = dh + ((size_t)j * H + k) * C;
  for (int c = lane; c < C; c += 32) {
    float o = 0.0f;
    for (int s = s0; s < s1; ++s) o += part_acc[((size_t)s * H + k) * C + c];
    drow[c] = from_f<T>(o);
  }
  if (lane == 0) {
    float o = 0.0f;
    for (int s = s0; s < s1; ++s) o += part_s[(size_t)s * H + k];
    da_src[(size_t)j * H + k] = o;
  }
}

}  // namespace spc_gat

// one warp per row: da_dst[i,k] = sum of dz[p,k] over row i's entries p (CSR order)
extern "C" __global__ void __launch_bounds__(256) gat_row_sum(const int* indptr, const float* dz, float* da_dst,
                                                               int nrows, int H) {
  const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (w >= nrows) return;
  const int lane = (int)(threadIdx.x & 31u);
  const int lo = indptr[w], hi = indptr[w + 1];
  for (int k = 0; k < H; ++k) {
    float s = 0.0f;
    for (int p = lo + lane; p < hi; p += 32) s += dz[(size_t)p * H + k];
    s = spc_gat::warp_sum(s);
    if (lane == 0) da_dst[(size_t)w * H + k] = s;
  }
}

// The extern "C" kernels; T: the element type (float, __half or __nv_bfloat16).
// the merge kernels of element type T (once per translation unit and T)
#define SPC_GAT_MERGE(SFX, T)                                                                           \
  extern "C" __global__ void __launch_bounds__(256) gat_fwd_merge_##SFX(                                \
      const int* split_ptr, const int* split_row, const float* part_acc, const float* part_ml,          \
      T* out, float* lse, int nsplit, int H, int C) {                                                   \
    spc_gat::fwd_merge<T>(split_ptr, split_row, part_acc, part_ml, out, lse, nsplit, H, C);             \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) gat_sum_merge_##SFX(                                \
      const int* split_ptr, const int* split_row, const float* part_acc, const float* part_s,           \
      T* dh, float* da_src, int nsplit, int H, int C) {                                                 \
    spc_gat::sum_merge<T>(split_ptr, split_row, part_acc, part_s, dh, da_src, nsplit, H, C);            \
  }

// the forward, D and transposed-pass kernels of one (T, VEC, G, CH)
#define SPC_GAT_INSTANCE(SFX, T, VEC, G, CH)                                                            \
  extern "C" __global__ void __launch_bounds__(256) gat_fwd_##SFX(                                      \
      const int* seg_ptr, const int* seg_row, const int* seg_slot, const int* indices,                  \
      const T* h, const float* a_src, const float* a_dst, T* out,                                       \
      float* lse, float* part_acc, float* part_ml, int nseg, int H, int C, float slope) {               \
    spc_gat::fwd<T, VEC, G, CH>(seg_ptr, seg_row, seg_slot, indices, h, a_src, a_dst,                   \
                                                out, lse, part_acc, part_ml, nseg, H, C, slope);        \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) gat_dot_##SFX(                                      \
      const T* dout, const T* out, float* D, long long nrows, int C) {                                  \
    spc_gat::rowdot<T, VEC, G, CH>(dout, out, D, nrows, C);                                             \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(256) gat_bwd_col_##SFX(                                  \
      const int* tseg_ptr, const int* tseg_row, const int* tseg_slot, const int* t_idx,                 \
      const int* t_perm, const T* h, const float* a_src, const float* a_dst,                            \
      const float* lse, const float* D, const T* dout, T* dh,                                           \
      float* da_src, float* dz, float* part_acc, float* part_s, int nseg, int H, int C, float slope) {  \
    spc_gat::bwd_col<T, VEC, G, CH>(tseg_ptr, tseg_row, tseg_slot, t_idx, t_perm, h,                    \
                                                    a_src, a_dst, lse, D, dout, dh, da_src, dz,         \
                                                    part_acc, part_s, nseg, H, C, slope);               \
  }
