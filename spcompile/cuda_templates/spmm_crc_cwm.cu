// GE-SpMM style CSR SpMM (Huang et al., SC'20): coalesced row caching (CRC) + coarse-grained
// warp merging (CWM), for Y = reduce_j A[i,j] * X[j,:] with reduce in {sum, max, min, mean}.
//
// One parametrised kernel body; the Python side (spcompile/cuda_templates/templates.py) emits one
// extern "C" wrapper per parameter set with SPC_SPMM_INSTANCE, so a single source serves every
// variant (no copy-pasted kernels, no configuration #defines).
//
// Compile-time parameters (they shape registers and unrolled loops):
//   R    reduction: 0 sum, 1 max, 2 min, 3 mean
//   CF   coarsening factor of CWM: each lane produces CF column slices (CF x VEC outputs)
//   VEC  vector width of X loads / Y stores (1, 2 or 4 floats; needs K % VEC == 0 and aligned
//        pointers, the launcher falls back to the VEC=1 instance otherwise)
//   G    lanes per row group (32 = one warp per row as in the paper; 4/8/16 for narrow K)
// Run-time parameters: K, block size (warps per block), segments per group (rows per warp), and
// the row partition computed at build time:
//   seg_ptr[s]..seg_ptr[s+1]  nonzeros of segment s (a whole row, or a bounded slice of a long row)
//   seg_out[s]                output row (caller's order) of a whole-row segment
//   seg_slot[s]               -1 for a whole row; else its slot in the partial-result workspace.
// Split rows (load balance for very long rows) are combined in the same launch: every slice writes
// its partial to part[slot*K ...], and the last slice to finish (atomic counter per row group and
// column tile, classic threadfence-reduction pattern) combines all partials in slot order
// (deterministic) and resets the counter for the next call.  No second launch, no memset.
#include <cuda_runtime.h>
#include <math_constants.h>

namespace spc {

template <int R> __device__ __forceinline__ float red_init() {
  return R == 1 ? -CUDART_INF_F : (R == 2 ? CUDART_INF_F : 0.0f);
}
template <int R> __device__ __forceinline__ float red_op(float acc, float v) {
  if (R == 1) return fmaxf(acc, v);
  if (R == 2) return fminf(acc, v);
  return acc + v;
}
template <int VEC> struct vec_t;
template <> struct vec_t<1> { typedef float type; };
template <> struct vec_t<2> { typedef float2 type; };
template <> struct vec_t<4> { typedef float4 type; };

template <int VEC> __device__ __forceinline__ void load_vec(const float* __restrict__ p, float* v) {
  if (VEC == 4) { float4 t = __ldg(reinterpret_cast<const float4*>(p)); v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; }
  else if (VEC == 2) { float2 t = __ldg(reinterpret_cast<const float2*>(p)); v[0] = t.x; v[1] = t.y; }
  else { v[0] = __ldg(p); }
}
template <int VEC> __device__ __forceinline__ void store_vec(float* p, const float* v) {
  if (VEC == 4) { *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]); }
  else if (VEC == 2) { *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]); }
  else { p[0] = v[0]; }
}
template <int VEC> __device__ __forceinline__ void load_vec_cg(const float* p, float* v) {
  // partials written by other blocks in this launch: read through L2, never a stale L1 line
  if (VEC == 4) { float4 t = __ldcg(reinterpret_cast<const float4*>(p)); v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w; }
  else if (VEC == 2) { float2 t = __ldcg(reinterpret_cast<const float2*>(p)); v[0] = t.x; v[1] = t.y; }
  else { v[0] = __ldcg(p); }
}

template <int R, int CF, int VEC, int G>
__device__ __forceinline__ void spmm_crc_cwm(
    const int* __restrict__ seg_ptr, const int* __restrict__ seg_out, const int* __restrict__ seg_slot,
    const int* __restrict__ indices, const float* __restrict__ data, const float* __restrict__ X,
    float* __restrict__ Y, float* part, int* counters, const int* __restrict__ grp_ptr,
    const int* __restrict__ slot_grp, const int* __restrict__ grp_out, const int* __restrict__ grp_len,
    int nseg, int K, int segs_per_group) {
  extern __shared__ int smem[];
  const int lane = threadIdx.x % G;
  const int gib = threadIdx.x / G;                 // group in block
  const int groups_per_block = blockDim.x / G;
  int* s_idx = smem + gib * G;                     // CRC cache: column ids of G nonzeros
  float* s_val = reinterpret_cast<float*>(smem + blockDim.x) + gib * G;
  const unsigned gmask = (G == 32) ? 0xffffffffu : (((1u << G) - 1u) << ((threadIdx.x % 32) / G * G));
  const int tile_w = G * VEC * CF;                 // columns of one column tile (CWM)
  const int col_base = blockIdx.y * tile_w + lane * VEC;
  const long long group = (long long)blockIdx.x * groups_per_block + gib;

  for (int r = 0; r < segs_per_group; ++r) {
    const long long s = group * segs_per_group + r;
    if (s >= nseg) return;                          // uniform within the group
    const int lo = seg_ptr[s], hi = seg_ptr[s + 1];
    float acc[CF][VEC];
#pragma unroll
    for (int c = 0; c < CF; ++c)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[c][v] = red_init<R>();

    for (int base = lo; base < hi; base += G) {
      const int n = min(G, hi - base);
      if (lane < n) {                               // coalesced row caching
        s_idx[lane] = indices[base + lane];
        s_val[lane] = data[base + lane];
      }
      __syncwarp(gmask);
#pragma unroll 4
      for (int e = 0; e < n; ++e) {
        const float a = s_val[e];
        const float* xrow = X + (size_t)s_idx[e] * K;
#pragma unroll
        for (int c = 0; c < CF; ++c) {
          const int col = col_base + c * G * VEC;
          if (col < K) {
            float xv[VEC];
            load_vec<VEC>(xrow + col, xv);
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[c][v] = red_op<R>(acc[c][v], a * xv[v]);
          }
        }
      }
      __syncwarp(gmask);
    }

    const int slot = seg_slot[s];
    if (slot < 0) {                                 // whole row: finish and write
      const int len = hi - lo;
      const float scale = (R == 3 && len > 0) ? 1.0f / (float)len : 1.0f;
      float* yrow = Y + (size_t)seg_out[s] * K;
#pragma unroll
      for (int c = 0; c < CF; ++c) {
        const int col = col_base + c * G * VEC;
        if (col < K) {
          float o[VEC];
#pragma unroll
          for (int v = 0; v < VEC; ++v) o[v] = (len == 0) ? 0.0f : acc[c][v] * scale;
          store_vec<VEC>(yrow + col, o);
        }
      }
    } else {                                        // slice of a split row
      float* prow = part + (size_t)slot * K;
#pragma unroll
      for (int c = 0; c < CF; ++c) {
        const int col = col_base + c * G * VEC;
        if (col < K) store_vec<VEC>(prow + col, acc[c]);
      }
      __threadfence();
      __syncwarp(gmask);
      const int g = slot_grp[slot];
      const int cnt_idx = g * gridDim.y + blockIdx.y;
      const int first = grp_ptr[g], nslots = grp_ptr[g + 1] - first;
      int old = 0;
      if (lane == 0) old = atomicAdd(counters + cnt_idx, 1);
      old = __shfl_sync(gmask, old, (threadIdx.x % 32) / G * G);
      if (old == nslots - 1) {                      // last slice: combine in slot order
        __threadfence();
        const int len = grp_len[g];
        const float scale = (R == 3 && len > 0) ? 1.0f / (float)len : 1.0f;
        float* yrow = Y + (size_t)grp_out[g] * K;
#pragma unroll
        for (int c = 0; c < CF; ++c) {
          const int col = col_base + c * G * VEC;
          if (col < K) {
            float o[VEC], t[VEC];
#pragma unroll
            for (int v = 0; v < VEC; ++v) o[v] = red_init<R>();
            for (int q = 0; q < nslots; ++q) {
              load_vec_cg<VEC>(part + (size_t)(first + q) * K + col, t);
#pragma unroll
              for (int v = 0; v < VEC; ++v) o[v] = red_op<R>(o[v], t[v]);
            }
#pragma unroll
            for (int v = 0; v < VEC; ++v) o[v] *= scale;
            store_vec<VEC>(yrow + col, o);
          }
        }
        if (lane == 0) counters[cnt_idx] = 0;       // ready for the next call (stream-ordered)
      }
    }
  }
}

}  // namespace spc

#define SPC_SPMM_INSTANCE(NAME, R, CF, VEC, G)                                                       \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                            \
      const int* seg_ptr, const int* seg_out, const int* seg_slot, const int* indices,               \
      const float* data, const float* X, float* Y, float* part, int* counters, const int* grp_ptr,   \
      const int* slot_grp, const int* grp_out, const int* grp_len, int nseg, int K,                  \
      int segs_per_group) {                                                                          \
    spc::spmm_crc_cwm<R, CF, VEC, G>(seg_ptr, seg_out, seg_slot, indices, data, X, Y, part,          \
                                     counters, grp_ptr, slot_grp, grp_out, grp_len, nseg, K,         \
                                     segs_per_group);                                                \
  }
