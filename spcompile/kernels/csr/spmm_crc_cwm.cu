// GE-SpMM style CSR SpMM (Huang et al., SC'20): coalesced row caching (CRC) + coarse-grained
// warp merging (CWM), for Y = reduce_j A[i,j] * X[j,:] with reduce in {sum, max, min, mean}.
//
// One parametrised kernel body; the Python side (spcompile/kernels/csr/template.py) emits one
// extern "C" wrapper per parameter set with SPC_SPMM_INSTANCE, so a single source serves every
// variant (no copy-pasted kernels, no configuration #defines).
//
// Compile-time parameters (they shape registers and unrolled loops):
//   T    element type of X and Y: float, __half or __nv_bfloat16 (A's values stay float and every
//        product and sum is fp32; Y is rounded to T once, at the end -- partials of split rows
//        stay fp32)
//   R    reduction: 0 sum, 1 max, 2 min, 3 mean
//   CF   coarsening factor of CWM: each lane produces CF column slices (CF x VEC outputs)
//   VEC  vector width of X loads / Y stores in elements of T (1, 2, 4, and 8 for 16-bit T: at most
//        16 bytes; needs K % VEC == 0 and aligned pointers, the launcher falls back to the VEC=1
//        instance otherwise)
//   G    lanes per row group (32 = one warp per row as in the paper; 4/8/16 for narrow K)
//   U    nonzeros whose X rows are loaded before any is accumulated (U x CF vector loads in
//        flight per lane: latency hiding on short/long rows of small graphs); accumulation order
//        stays the nonzero order.  U <= 8 reads a chunk of G nonzeros' ids at a time (at most G
//        loads in flight); U = 16 reads chunks of max(G, 16) (CH below: a 16-bit row of 64
//        columns is an 8-lane group, so 16 rows in flight need two ids a lane), and its split-row
//        combine is always capped as with CQ = 16
//   FL   0: a row group takes its segments one after another (each its own chain of dependent
//        loads: segment bounds, column ids, X rows); 1 (flat): its consecutive segments
//        grp_seg[g] .. grp_seg[g+1]-1 are one run of nonzeros, cached a chunk at a time, with the U X
//        loads in flight across segment ends and the segment bounds / outputs read G at a time
//        (the packer makes the groups either `segs_per_group` segments each, or runs of about
//        equal nonzeros: many short rows or one slice of a long one); 2 (staged): as 1, but a
//        chunk's X slices are copied to shared memory with cp.async (all CH x CF of a lane in
//        flight, no register holds them) and accumulated from there; U then only sets CH
//        (U nonzeros, at least 4: fewer than G where a row of X is wide); 3 (staged segments): as 0,
//        each chunk staged as in 2 (a row's chunk of gathers in flight at once, few registers);
//        4 (ELL rows): every segment is a whole row of at most U nonzeros, and `indices` holds U
//        column ids a segment (ELL, -1 after the row's own), so a row group reads its row's ids
//        at s * U with no row pointer before them (segment bounds, ids and output row load at
//        once); the values stay in CSR order (call-time values), read at seg_ptr[s] beside the
//        X loads; all U x CF X loads of the row in flight, no row cache
//   CQ   0: the split-row combine loads U partials of VEC fp32 values per lane at a time; > 0: at
//        most CQ values (parameter combine_vals; instance macros *_CQ)
// Launch bounds (the instance macro, not the body): SPC_SPMM_INSTANCE_MB's MB resident 256-thread
// blocks per SM cap the registers at 65536 / (256 MB) a thread, so more warps keep gathers in
// flight (parameter min_blocks; graphs of sparse rows wait on DRAM latency)
// Run-time parameters: K, block size (warps per block), segments per group (rows per warp; FL=0),
// the number of groups and their first segments (grp_seg, FL=1), and the row partition computed
// at build time:
//   seg_ptr[s]..seg_ptr[s+1]  nonzeros of segment s (a whole row, or a bounded slice of a long row)
//   seg_out[s]                output row (caller's order) of a whole-row segment
//   seg_slot[s]               -1 for a whole row; else its slot in the partial-result workspace,
//                             with bit 30 (SPC_WARP_SLICES) set where the W groups of a combine
//                             unit (one segment each; the warp's 32 / G groups for G < 32, the
//                             block's warps for G = 32) hold slices of one row that share the
//                             slot; -2 (SPC_WARP_ROW) where they hold all of one row (written
//                             directly)
// Split rows (load balance for very long rows) are combined in the same launch: every slice writes
// its partial to part[slot*K ...], and the last slice to finish (atomic counter per row group and
// column tile, classic threadfence-reduction pattern) combines all partials in slot order
// (deterministic) and resets the counter for the next call.  No second launch, no memset.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

namespace spc {

// seg_slot bit of a slice whose combine unit (warp, or block of 32-lane groups) reduces its
// groups' accumulators before writing one partial
#define SPC_WARP_SLICES (1 << 30)
// seg_slot of a slice whose combine unit holds the whole row: the unit's sum is written as the row
#define SPC_WARP_ROW (-2)

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
// element conversion (fp32 arithmetic everywhere; one rounding on the final store)
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// raw storage of BYTES bytes (one vector memory instruction)
template <int BYTES> struct raw_t;
template <> struct raw_t<2> { typedef unsigned short type; };
template <> struct raw_t<4> { typedef unsigned int type; };
template <> struct raw_t<8> { typedef uint2 type; };
template <> struct raw_t<16> { typedef uint4 type; };
template <typename T, int VEC> union pack_t {
  typename raw_t<sizeof(T) * VEC>::type raw;
  T e[VEC];
};

template <typename T, int VEC> __device__ __forceinline__ void load_vec(const T* __restrict__ p, float* v) {
  typedef typename raw_t<sizeof(T) * VEC>::type RT;
  pack_t<T, VEC> u;
  u.raw = __ldg(reinterpret_cast<const RT*>(p));
#pragma unroll
  for (int i = 0; i < VEC; ++i) v[i] = to_f(u.e[i]);
}
template <typename T, int VEC>
__device__ __forceinline__ void load_raw(const T* __restrict__ p, pack_t<T, VEC>& u) {
  typedef typename raw_t<sizeof(T) * VEC>::type RT;
  u.raw = __ldg(reinterpret_cast<const RT*>(p));
}
template <typename T, int VEC> __device__ __forceinline__ void store_vec(T* p, const float* v) {
  typedef typename raw_t<sizeof(T) * VEC>::type RT;
  pack_t<T, VEC> u;
#pragma unroll
  for (int i = 0; i < VEC; ++i) u.e[i] = from_f<T>(v[i]);
  *reinterpret_cast<RT*>(p) = u.raw;
}
// fp32 partials of split rows
template <int VEC> __device__ __forceinline__ void store_part(float* p, const float* v) {
  if (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
  } else if (VEC == 2) { *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]); }
  else { p[0] = v[0]; }
}
template <int VEC> __device__ __forceinline__ void load_part_cg(const float* p, float* v) {
  // partials written by other blocks in this launch: read through L2, never a stale L1 line
  if (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      float4 t = __ldcg(reinterpret_cast<const float4*>(p + i));
      v[i] = t.x; v[i + 1] = t.y; v[i + 2] = t.z; v[i + 3] = t.w;
    }
  } else if (VEC == 2) { float2 t = __ldcg(reinterpret_cast<const float2*>(p)); v[0] = t.x; v[1] = t.y; }
  else { v[0] = __ldcg(p); }
}

// The pieces of a row group's chunk loop that both segment layouts share.  Plain functions with
// __restrict__ parameters (a lambda's captures would drop the restrict, and with it the
// read-only loads of X).
template <int R, int CF, int VEC> __device__ __forceinline__ void reset_acc(float (&acc)[CF][VEC]) {
#pragma unroll
  for (int c = 0; c < CF; ++c)
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[c][v] = red_init<R>();
}
// nonzeros of one chunk of the coalesced row cache: G (one id a lane) for U <= 8, else max(G, U)
// (FL = 2 / 3: U nonzeros, at least 4, whatever G: the stage holds the X slices of a chunk)
template <int FL> struct staged_of { static constexpr bool value = FL == 2 || FL == 3; };
template <int G, int U, int FL = 0> struct chunk_of {
  static constexpr int value = staged_of<FL>::value ? (U < 4 ? 4 : U) : ((U > 8 && U > G) ? U : G);
};
// coalesced row caching: the group's lanes copy n <= CH column ids and values to shared memory
template <int G, int CH>
__device__ __forceinline__ void cache_chunk(const int* __restrict__ indices, const float* __restrict__ data,
                                            int* s_idx, float* s_val, const int base, const int n,
                                            const int lane, const unsigned gmask) {
#pragma unroll
  for (int j = 0; j < CH; j += G) {
    if (lane + j < n) {
      s_idx[lane + j] = indices[base + lane + j];
      s_val[lane + j] = data[base + lane + j];
    }
  }
  __syncwarp(gmask);
}
// Segment layout (FL = 0), unroll 8 in 8-lane groups (lean instances; among build()'s modules,
// the 16-bit K = 64 ones): a chunk's column ids and values are fetched into registers one chunk
// ahead (one of each a lane), so the next chunk's id loads are in flight while this chunk's X
// rows load; put_chunk writes them to the row cache.  +2 registers (153 -> 155 on sm_90, the same
// warps an SM).  The unroll 16 instances keep cache_chunk: fetching ahead took them from 128
// registers to 142-146 (fewer warps an SM) or to spills, and quick selection then lost more than
// it gained (experiments section 31)
template <int G, int CH>
__device__ __forceinline__ void fetch_chunk(const int* __restrict__ indices, const float* __restrict__ data,
                                            const int base, const int end, const int lane, int (&pi)[CH / G],
                                            float (&pv)[CH / G]) {
#pragma unroll
  for (int j = 0; j < CH / G; ++j) {
    const int e = base + lane + j * G;
    if (e < end) {
      pi[j] = indices[e];
      pv[j] = data[e];
    }
  }
}
template <int G, int CH>
__device__ __forceinline__ void put_chunk(int* s_idx, float* s_val, const int n, const int lane, const int (&pi)[CH / G],
                                          const float (&pv)[CH / G], const unsigned gmask) {
#pragma unroll
  for (int j = 0; j < CH / G; ++j) {
    if (lane + j * G < n) {
      s_idx[lane + j * G] = pi[j];
      s_val[lane + j * G] = pv[j];
    }
  }
  __syncwarp(gmask);
}
// U nonzeros' X slices (chunk entries e0 .. e0 + U - 1 of n) are loaded first (U x CF loads in
// flight, kept packed: a 16-byte load is 4 registers whatever T is), with their values.
// Lean instances (lean_of: 16 rows in flight, or 8 in an 8-lane group -- the narrow 16-bit rows
// of K <= 128): a slice's address is one 32 x 32 -> 64-bit multiply-add (column ids are
// non-negative, and a row of X, K <= MAX_K = 2^20 elements, is at most 4 MiB), and FULL (a full
// chunk: all U entries exist) drops the bound checks.  The other instances keep the 64-bit index
// arithmetic they were measured with (identical SASS): with fewer rows in flight the compiler
// unrolls their chunk loop for more loads in flight, and the wider groups of unroll 8 took 22-38%
// more registers in the lean form (measured, section 30 of the experiments document)
template <int U, int G> struct lean_of { static constexpr bool value = U == 16 || (U == 8 && G == 8); };
// the lane's CF slices of row `col` of X, lean: xb is X + col_base as bytes and the row's address
// one 32 x 32 -> 64-bit multiply-add (column ids are non-negative, a row of X is at most 4 MiB)
template <typename T, int CF, int VEC, int G>
__device__ __forceinline__ void load_row_lean(const char* xb, const int col, const unsigned row_bytes, const int K,
                                              const int col_base, pack_t<T, VEC> (&xv)[CF]) {
  const T* xrow = reinterpret_cast<const T*>(xb + (size_t)(unsigned)col * row_bytes);
#pragma unroll
  for (int c = 0; c < CF; ++c) {
    if (col_base + c * G * VEC < K) load_raw<T, VEC>(xrow + c * G * VEC, xv[c]);
  }
}
template <typename T, int CF, int VEC, int G, int U, bool FULL = false>
__device__ __forceinline__ void load_x(const T* __restrict__ X, const int* s_idx, const float* s_val,
                                       const int e0, const int n, const int K, const int col_base,
                                       pack_t<T, VEC> (&xv)[U][CF], float (&a)[U]) {
  const char* xb = reinterpret_cast<const char*>(X + col_base);
  const unsigned row_bytes = (unsigned)K * (unsigned)sizeof(T);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int e = e0 + u;
    if (FULL || e < n) {
      a[u] = s_val[e];
      if constexpr (lean_of<U, G>::value) {
        // col_base folded into the base (xb); through the loop below it compiles to other SASS
        // than the measured one
        load_row_lean<T, CF, VEC, G>(xb, s_idx[e], row_bytes, K, col_base, xv[u]);
      } else {
        const T* xrow = X + (size_t)s_idx[e] * K;
#pragma unroll
        for (int c = 0; c < CF; ++c) {
          const int col = col_base + c * G * VEC;
          if (col < K) load_raw<T, VEC>(xrow + col, xv[u][c]);
        }
      }
    }
  }
}
// acc op= a * x for one nonzero's loaded slices (converted to fp32 here)
template <typename T, int R, int CF, int VEC, int G>
__device__ __forceinline__ void accumulate(float (&acc)[CF][VEC], const float a, const pack_t<T, VEC> (&xv)[CF],
                                           const int K, const int col_base) {
#pragma unroll
  for (int c = 0; c < CF; ++c) {
    const int col = col_base + c * G * VEC;
    if (col < K) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[c][v] = red_op<R>(acc[c][v], a * to_f(xv[c].e[v]));
    }
  }
}

// FL = 2: the stage of X slices starts after the row cache (column ids and values of CH nonzeros
// a row group), in ints; 16-byte aligned (CH is a multiple of 4)
template <int G, int CH> __device__ __forceinline__ int stage_offset_ints(const int groups_per_block) {
  return 2 * groups_per_block * CH;
}
// BYTES of global memory to shared memory.  sm_80+: cp.async (.ca: cached in L1 as the __ldg
// loads are), no register holds the data in flight; 2-byte copies (a 16-bit VEC 1 instance) and
// older GPUs: a load and a store
template <int BYTES> __device__ __forceinline__ void copy_async(void* dst, const void* src) {
  typedef typename raw_t<BYTES>::type RT;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (BYTES >= 4) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(BYTES) : "memory");
    return;
  }
#endif
  *reinterpret_cast<RT*>(dst) = __ldg(reinterpret_cast<const RT*>(src));
}
// the calling lane's copies have landed (each lane reads back only the slices it copied)
__device__ __forceinline__ void copy_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}
// FL = 2 / 3 lean staging (one column slice a lane): a slice's address is one 32 x 32 -> 64-bit
// multiply-add (as in load_x's lean instances), and a full chunk (n == CH) reads its column ids
// first and then issues its copies with no per-nonzero bound (the copies' "memory" clobber would
// otherwise order each id's shared-memory read after the previous copy); FL = 3 also accumulates
// a full chunk without per-entry bounds.  Instances of two slices a lane keep the code they were
// measured with: under min_blocks 4's 64 registers the lean form spilled and ran 1.5-2% slower
// (16-bit tu_nci1, section 31 of the experiments document)
template <int CF> struct staged_lean_of { static constexpr bool value = CF == 1; };
// FL = 2 / 3: the X slices of a chunk's n nonzeros (the column ids in s_idx), CF a lane, copied
// to the lane's part of its row group's stage (n x CF copies in flight, no registers held);
// returns the stage once the lane's copies have landed
template <typename T, int CF, int VEC, int G, int CH>
__device__ __forceinline__ const pack_t<T, VEC>* stage_chunk(int* smem, const int groups_per_block, const int gib,
                                                            const T* __restrict__ X, const int* s_idx, const int n,
                                                            const int K, const int col_base, const int lane) {
  typedef pack_t<T, VEC> PK;
  PK* stage = reinterpret_cast<PK*>(smem + stage_offset_ints<G, CH>(groups_per_block)) + gib * (CH * CF * G);
  if constexpr (!staged_lean_of<CF>::value) {
#pragma unroll 4
    for (int e = 0; e < n; ++e) {
      const T* xrow = X + (size_t)s_idx[e] * K;
#pragma unroll
      for (int c = 0; c < CF; ++c) {
        const int col = col_base + c * G * VEC;
        if (col < K) copy_async<sizeof(PK)>(&stage[(e * CF + c) * G + lane], xrow + col);
      }
    }
    copy_async_wait_all();
    return stage;
  }
  PK* mine = stage + lane;
  const char* xb = reinterpret_cast<const char*>(X + col_base);
  const unsigned row_bytes = (unsigned)K * (unsigned)sizeof(T);
  if (n == CH) {
    unsigned col[CH];
#pragma unroll
    for (int e = 0; e < CH; ++e) col[e] = (unsigned)s_idx[e];
#pragma unroll
    for (int c = 0; c < CF; ++c) {
      if (col_base + c * G * VEC < K) {
#pragma unroll
        for (int e = 0; e < CH; ++e)
          copy_async<sizeof(PK)>(&mine[(e * CF + c) * G], xb + (size_t)col[e] * row_bytes + c * G * VEC * sizeof(T));
      }
    }
  } else {
#pragma unroll 4
    for (int e = 0; e < n; ++e) {
      const char* xrow = xb + (size_t)(unsigned)s_idx[e] * row_bytes;
#pragma unroll
      for (int c = 0; c < CF; ++c) {
        if (col_base + c * G * VEC < K) copy_async<sizeof(PK)>(&mine[(e * CF + c) * G], xrow + c * G * VEC * sizeof(T));
      }
    }
  }
  copy_async_wait_all();
  return stage;
}
// FL = 2 / 3: acc op= a * x for entry e of a staged chunk, its CF slices read back from the lane's
// part of the stage (stage_chunk)
template <typename T, int R, int CF, int VEC, int G>
__device__ __forceinline__ void accumulate_staged(float (&acc)[CF][VEC], const float a, const pack_t<T, VEC>* stage,
                                                  const int e, const int K, const int col_base, const int lane) {
#pragma unroll
  for (int c = 0; c < CF; ++c) {
    const int col = col_base + c * G * VEC;
    if (col < K) {
      const pack_t<T, VEC> x = stage[(e * CF + c) * G + lane];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[c][v] = red_op<R>(acc[c][v], a * to_f(x.e[v]));
    }
  }
}
// FL = 3: accumulate_staged over a full chunk's CH entries in nonzero order, the values read
// first and the column bound tested once a slice (not once an entry)
template <typename T, int R, int CF, int VEC, int G, int CH>
__device__ __forceinline__ void accumulate_staged_full(float (&acc)[CF][VEC], const float* s_val,
                                                       const pack_t<T, VEC>* stage, const int K, const int col_base,
                                                       const int lane) {
  float a[CH];
#pragma unroll
  for (int e = 0; e < CH; ++e) a[e] = s_val[e];
#pragma unroll
  for (int c = 0; c < CF; ++c) {
    if (col_base + c * G * VEC < K) {
#pragma unroll
      for (int e = 0; e < CH; ++e) {
        const pack_t<T, VEC> x = stage[(e * CF + c) * G + lane];
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[c][v] = red_op<R>(acc[c][v], a[e] * to_f(x.e[v]));
      }
    }
  }
}
template <typename T, int R, int CF, int VEC, int G, int U, int FL, int CQ = 0>
__device__ __forceinline__ void spmm_crc_cwm(
    const int* __restrict__ seg_ptr, const int* __restrict__ seg_out, const int* __restrict__ seg_slot,
    const int* __restrict__ indices, const float* __restrict__ data, const T* __restrict__ X,
    T* __restrict__ Y, float* part, int* counters, const int* __restrict__ grp_ptr,
    const int* __restrict__ slot_grp, const int* __restrict__ grp_out, const int* __restrict__ grp_len,
    const int* __restrict__ grp_seg, int nseg, int ngroups, int K, int segs_per_group) {
  extern __shared__ int smem[];
  constexpr int CH = chunk_of<G, U, FL>::value;    // nonzeros a chunk (G for U <= 8, FL < 2)
  const int lane = threadIdx.x % G;
  const int gib = threadIdx.x / G;                 // group in block
  const int groups_per_block = blockDim.x / G;
  int* s_idx = smem + gib * CH;                    // CRC cache: column ids of CH nonzeros
  float* s_val = reinterpret_cast<float*>(smem + (CH == G ? (int)blockDim.x : groups_per_block * CH)) + gib * CH;
  const unsigned gmask = (G == 32) ? 0xffffffffu : (((1u << G) - 1u) << ((threadIdx.x % 32) / G * G));
  const int tile_w = G * VEC * CF;                 // columns of one column tile (CWM)
  const int col_base = blockIdx.y * tile_w + lane * VEC;
  const long long group = (long long)blockIdx.x * groups_per_block + gib;

  // what a segment's accumulator becomes: its output row (whole row) or its partial slot (slice
  // of a split row; the last slice of the row group combines).  Group-uniform control flow.
  auto finish = [&](const int seg_slot_value, const int out_row, float (&acc)[CF][VEC], const int seg_len) {
    int slot = seg_slot_value, len = seg_len;
    if (slot == SPC_WARP_ROW || (slot >= 0 && (slot & SPC_WARP_SLICES))) {
      // the combine unit's row groups (one segment each, aligned by the packer's warp_combine:
      // the warp's 32 / G groups for G < 32, the block's warps for G = 32) hold consecutive
      // slices of one row: their accumulators are reduced in a fixed order and the unit's first
      // group goes on with the sum -- as the whole row (SPC_WARP_ROW: the unit holds all of it)
      // or as one partial of the shared slot, so a hub's combine reads W times fewer partials
      if constexpr (G == 32) {
        // through shared memory (the launch sizes it for [warp][c][v][lane] floats and the
        // warps' lengths): every warp of the block is here (the packer fills whole blocks with
        // flagged slices and puts them first; the artifact check refuses anything else)
        const int nw = blockDim.x / 32, w = threadIdx.x / 32;
        float* red = reinterpret_cast<float*>(smem);
        int* red_len = reinterpret_cast<int*>(red + nw * CF * VEC * 32);
        __syncthreads();                            // every warp is done with its row cache
#pragma unroll
        for (int c = 0; c < CF; ++c)
#pragma unroll
          for (int v = 0; v < VEC; ++v) red[((w * CF + c) * VEC + v) * 32 + lane] = acc[c][v];
        if (lane == 0) red_len[w] = len;
        __syncthreads();
        if (w != 0) return;
#pragma unroll 1
        for (int j = 1; j < nw; ++j) {              // warp order: deterministic
#pragma unroll
          for (int c = 0; c < CF; ++c)
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[c][v] = red_op<R>(acc[c][v], red[((j * CF + c) * VEC + v) * 32 + lane]);
          len += red_len[j];
        }
      } else {
        // across the warp by shuffles (butterfly, a fixed order)
#pragma unroll
        for (int off = G; off < 32; off *= 2)
#pragma unroll
          for (int c = 0; c < CF; ++c)
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[c][v] = red_op<R>(acc[c][v], __shfl_xor_sync(0xffffffffu, acc[c][v], off));
        if (slot == SPC_WARP_ROW) {
#pragma unroll
          for (int off = G; off < 32; off *= 2) len += __shfl_xor_sync(0xffffffffu, len, off);
        }
      }
      if (slot == SPC_WARP_ROW) slot = -1;
      else slot &= ~SPC_WARP_SLICES;
      if (threadIdx.x % 32 >= G) return;
    }
    if (slot < 0) {                                 // whole row: finish and write
      const float scale = (R == 3 && len > 0) ? 1.0f / (float)len : 1.0f;
      T* yrow = Y + (size_t)out_row * K;
#pragma unroll
      for (int c = 0; c < CF; ++c) {
        const int col = col_base + c * G * VEC;
        if (col < K) {
          float o[VEC];
#pragma unroll
          for (int v = 0; v < VEC; ++v) o[v] = (len == 0) ? 0.0f : acc[c][v] * scale;
          store_vec<T, VEC>(yrow + col, o);
        }
      }
    } else {                                        // slice of a split row
      float* prow = part + (size_t)slot * K;
#pragma unroll
      for (int c = 0; c < CF; ++c) {
        const int col = col_base + c * G * VEC;
        if (col < K) store_part<VEC>(prow + col, acc[c]);
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
        T* yrow = Y + (size_t)grp_out[g] * K;
        // per column slice, QB = U partials loaded per batch (U x VEC values in flight per lane; the
        // combine shares the kernel's register budget, so U sets both its and the main loop's depth),
        // added in slot order.  CQ > 0 caps the values in flight at CQ (QB = CQ / VEC, at least 1):
        // fewer registers for the whole kernel (16-bit T at VEC 8, U 8: 91 instead of 151 on sm_90)
        // at the price of a longer chain of loads in the combine
        // (FL = 2 keeps no X rows in registers: its U sets only the chunk, and its combine loads
        // 2 partials at a time)
        constexpr int UQ = staged_of<FL>::value ? 2 : U;
        constexpr int CQE = (UQ > 8 && CQ == 0) ? 16 : CQ;   // U = 16: always capped
        constexpr int QB = (CQE > 0 && UQ * VEC > CQE) ? (CQE / VEC > 0 ? CQE / VEC : 1) : UQ;
#pragma unroll
        for (int c = 0; c < CF; ++c) {
          const int col = col_base + c * G * VEC;
          if (col < K) {
            float o[VEC];
#pragma unroll
            for (int v = 0; v < VEC; ++v) o[v] = red_init<R>();
            for (int q0 = 0; q0 < nslots; q0 += QB) {
              float t[QB][VEC];
#pragma unroll
              for (int u = 0; u < QB; ++u)
                if (q0 + u < nslots) load_part_cg<VEC>(part + (size_t)(first + q0 + u) * K + col, t[u]);
#pragma unroll
              for (int u = 0; u < QB; ++u) {         // slot order: deterministic, run to run
                if (q0 + u < nslots) {
#pragma unroll
                  for (int v = 0; v < VEC; ++v) o[v] = red_op<R>(o[v], t[u][v]);
                }
              }
            }
#pragma unroll
            for (int v = 0; v < VEC; ++v) o[v] *= scale;
            store_vec<T, VEC>(yrow + col, o);
          }
        }
        if (lane == 0) counters[cnt_idx] = 0;       // ready for the next call (stream-ordered)
      }
    }
  };

  if constexpr (FL == 1 || FL == 2) {
    // flat: the group's segments [s0, s0 + ns) are one stream of nonzeros (consecutive in
    // seg_ptr), cached a chunk at a time with U X loads in flight across segment boundaries; a segment
    // is finished when the stream passes its end.  The segment pointers are read G at a time: lane
    // i holds seg_ptr[s0 + wb + i].
    if (group >= ngroups) return;                   // uniform within the group
    const int s0 = grp_seg[group];
    const int ns = grp_seg[group + 1] - s0;
    const int gl = (threadIdx.x % 32) / G * G;      // first lane of the group in its warp
    // lane i holds seg_ptr / seg_slot / seg_out of segment s0 + wb + i; the window moves when
    // the pointer after the current segment leaves it (the current segment stays in it)
    int wb = 0, myptr = 0, myslot = -1, myout = 0;
    auto load_window = [&]() {
      myptr = wb + lane <= ns ? seg_ptr[s0 + wb + lane] : 0;
      myslot = wb + lane < ns ? seg_slot[s0 + wb + lane] : -1;
      myout = wb + lane < ns ? seg_out[s0 + wb + lane] : 0;
    };
    load_window();
    auto ptr_at = [&](const int j) {                // seg_ptr[s0 + j], 0 < j <= ns, group-uniform
      if (j - wb >= G) {
        wb = j - 1;
        load_window();
      }
      return __shfl_sync(gmask, myptr, gl + j - wb);
    };
    auto finish_cur = [&](const int j, float (&acc)[CF][VEC], const int len) {
      finish(__shfl_sync(gmask, myslot, gl + j - wb), __shfl_sync(gmask, myout, gl + j - wb), acc, len);
    };
    const int e_end = seg_ptr[s0 + ns];
    int cur = 0, seg_lo = __shfl_sync(gmask, myptr, gl), seg_hi = ptr_at(1);
    float acc[CF][VEC];
    reset_acc<R>(acc);
    auto reach = [&](const int e) {                 // the stream is at nonzero e: finish the
      while (e >= seg_hi) {                         // segments it left (and empty ones)
        finish_cur(cur, acc, seg_hi - seg_lo);
        reset_acc<R>(acc);
        ++cur;
        seg_lo = seg_hi;
        seg_hi = ptr_at(cur + 1);
      }
    };
    for (int base = seg_lo; base < e_end; base += CH) {
      const int n = min(CH, e_end - base);
      cache_chunk<G, CH>(indices, data, s_idx, s_val, base, n, lane, gmask);
      if constexpr (FL == 2) {
        // staged: every X slice of the chunk is copied to the lane's part of the group's stage
        // (cp.async: n x CF copies in flight, no registers held), then the chunk is accumulated
        // from shared memory in nonzero order by a loop that is not unrolled (one copy of the
        // segment-end code, few registers)
        typedef pack_t<T, VEC> PK;
        const PK* stage = stage_chunk<T, CF, VEC, G, CH>(smem, groups_per_block, gib, X, s_idx, n, K, col_base, lane);
#pragma unroll 1
        for (int e = 0; e < n; ++e) {
          reach(base + e);
          accumulate_staged<T, R, CF, VEC, G>(acc, s_val[e], stage, e, K, col_base, lane);
        }
      } else {
        for (int e0 = 0; e0 < n; e0 += U) {
          pack_t<T, VEC> xv[U][CF];
          float a[U];
          load_x<T, CF, VEC, G, U>(X, s_idx, s_val, e0, n, K, col_base, xv, a);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (e0 + u < n) {
              reach(base + e0 + u);
              accumulate<T, R, CF, VEC, G>(acc, a[u], xv[u], K, col_base);
            }
          }
        }
      }
      __syncwarp(gmask);
    }
    for (; cur < ns; ++cur) {                       // the last segment and trailing empty ones
      finish_cur(cur, acc, seg_hi - seg_lo);
      reset_acc<R>(acc);
      seg_lo = seg_hi;
      if (cur + 1 < ns) seg_hi = ptr_at(cur + 2);
    }
  } else if constexpr (FL == 4) {
    // ELL rows: the row's U column ids at s * U (lane j holds entries j, j + G, ...), its bounds
    // and output row all load at once; then its X rows (every slice of the row in flight) while
    // its values load from seg_ptr[s]; accumulated in nonzero order, as the CSR kernels do.  A
    // group of several rows (segs_per_group) loads the next row's ids, bounds and output row
    // while this row's X rows load.  Groups narrower than a warp step through their rows
    // together, so that ids and values pass between lanes by full-warp shuffles (a group past its
    // last row idles: no loads, no output): with the group's mask the compiler checks
    // convergence at every shuffle (8 MATCH / BRA.DIV pairs, 424 -> 312 SASS instructions, 10-16%
    // faster on the H200); 32-lane groups keep the group's own loop, 4-9% faster than that
    // (experiments section 32)
    constexpr int PL = (U + G - 1) / G;             // ids (and values) a lane loads
    constexpr bool STEP = G < 32;                   // the warp's groups step together
    constexpr unsigned FULL = 0xffffffffu;
    const int gl = (threadIdx.x % 32) / G * G;      // first lane of the group in its warp
    long long s = group * segs_per_group;
    if (!STEP && s >= nseg) return;                   // group-uniform
    const long long s_end = min(s + (long long)segs_per_group, (long long)nseg);
    if (STEP && !__any_sync(FULL, s < s_end)) return; // warp-uniform
    const char* xb = reinterpret_cast<const char*>(X + col_base);
    const unsigned row_bytes = (unsigned)K * (unsigned)sizeof(T);
    int ci[PL], lo = 0, len = 0, out = 0;
    auto fetch_row = [&](const long long r, int (&ids)[PL], int& rlo, int& rlen, int& rout) {
      const int* ell = indices + (size_t)r * U;
#pragma unroll
      for (int j = 0; j < PL; ++j) ids[j] = (lane + j * G < U) ? ell[lane + j * G] : 0;
      rlo = seg_ptr[r];
      rlen = seg_ptr[r + 1] - rlo;
      rout = seg_out[r];
    };
    if (STEP) {
#pragma unroll
      for (int j = 0; j < PL; ++j) ci[j] = 0;
      if (s < s_end) fetch_row(s, ci, lo, len, out);
    } else {
      fetch_row(s, ci, lo, len, out);
    }
    for (int it = 0; STEP ? it < segs_per_group : s < s_end; ++it, ++s) {
      if (STEP && !__any_sync(FULL, s < s_end)) return;   // every group of the warp is done
      const bool live = !STEP || s < s_end;           // the group has this row
      pack_t<T, VEC> xv[U][CF];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int col = STEP ? __shfl_sync(FULL, ci[u / G], gl + u % G) : __shfl_sync(gmask, ci[u / G], u % G, G);
        if (u < len) load_row_lean<T, CF, VEC, G>(xb, col, row_bytes, K, col_base, xv[u]);
      }
      float cv[PL];
#pragma unroll
      for (int j = 0; j < PL; ++j) cv[j] = (lane + j * G < len) ? data[lo + lane + j * G] : 0.0f;
      const int this_len = len, this_out = out;
      if (STEP) len = 0;                              // past the group's last row: nothing to load
      if (s + 1 < s_end) fetch_row(s + 1, ci, lo, len, out);
      float acc[CF][VEC];
      reset_acc<R>(acc);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float a = STEP ? __shfl_sync(FULL, cv[u / G], gl + u % G) : __shfl_sync(gmask, cv[u / G], u % G, G);
        if (u < this_len) accumulate<T, R, CF, VEC, G>(acc, a, xv[u], K, col_base);
      }
      if (live) finish(-1, this_out, acc, this_len);
    }
  } else {
    for (int r = 0; r < segs_per_group; ++r) {
      const long long s = group * segs_per_group + r;
      if (s >= nseg) return;                          // uniform within the group
      const int lo = seg_ptr[s], hi = seg_ptr[s + 1], slot = seg_slot[s], out = seg_out[s];
      float acc[CF][VEC];
      reset_acc<R>(acc);
      constexpr bool PF = FL == 0 && U == 8 && G == 8;   // ids fetched a chunk ahead (fetch_chunk)
      int pi[PF ? CH / G : 1];
      float pv[PF ? CH / G : 1];
      if constexpr (PF) fetch_chunk<G, CH>(indices, data, lo, hi, lane, pi, pv);
      for (int base = lo; base < hi; base += CH) {
        const int n = min(CH, hi - base);
        if constexpr (PF) {
          put_chunk<G, CH>(s_idx, s_val, n, lane, pi, pv, gmask);
          if (base + CH < hi) fetch_chunk<G, CH>(indices, data, base + CH, hi, lane, pi, pv);
        } else {
          cache_chunk<G, CH>(indices, data, s_idx, s_val, base, n, lane, gmask);
        }
        if constexpr (FL == 3) {
          // staged: the chunk's X slices copied to shared memory (all in flight), then
          // accumulated from there in nonzero order
          typedef pack_t<T, VEC> PK;
          const PK* stage = stage_chunk<T, CF, VEC, G, CH>(smem, groups_per_block, gib, X, s_idx, n, K, col_base, lane);
          if (staged_lean_of<CF>::value && n == CH) {
            accumulate_staged_full<T, R, CF, VEC, G, CH>(acc, s_val, stage, K, col_base, lane);
          } else {
#pragma unroll 4
            for (int e = 0; e < n; ++e) accumulate_staged<T, R, CF, VEC, G>(acc, s_val[e], stage, e, K, col_base, lane);
          }
        } else if (lean_of<U, G>::value && CH % U == 0 && n == CH) {
          // a full chunk (most chunks of long rows) of a lean instance: the same loop without
          // per-nonzero bounds (about 40% fewer instructions a chunk)
#pragma unroll 1
          for (int e0 = 0; e0 < CH; e0 += U) {
            pack_t<T, VEC> xv[U][CF];
            float a[U];
            load_x<T, CF, VEC, G, U, true>(X, s_idx, s_val, e0, CH, K, col_base, xv, a);
#pragma unroll
            for (int u = 0; u < U; ++u) accumulate<T, R, CF, VEC, G>(acc, a[u], xv[u], K, col_base);
          }
        } else {
          for (int e0 = 0; e0 < n; e0 += U) {          // U loads in flight, accumulated in nonzero order
            pack_t<T, VEC> xv[U][CF];
            float a[U];
            load_x<T, CF, VEC, G, U>(X, s_idx, s_val, e0, n, K, col_base, xv, a);
            // accumulate<>() written out: through the helper ptxas schedules this path's most used
            // instance (fp32, unroll 2) differently, and its SASS is the one measured on the H100
#pragma unroll
            for (int u = 0; u < U; ++u) {
              if (e0 + u < n) {
#pragma unroll
                for (int c = 0; c < CF; ++c) {
                  const int col = col_base + c * G * VEC;
                  if (col < K) {
#pragma unroll
                    for (int v = 0; v < VEC; ++v) acc[c][v] = red_op<R>(acc[c][v], a[u] * to_f(xv[u][c].e[v]));
                  }
                }
              }
            }
          }
        }
        __syncwarp(gmask);
      }

      finish(slot, out, acc, hi - lo);
    }
  }
}

}  // namespace spc

// TN: 0 float, 1 __half, 2 __nv_bfloat16 (the element type of X and Y)
#define SPC_ELEM_0 float
#define SPC_ELEM_1 __half
#define SPC_ELEM_2 __nv_bfloat16
#define SPC_ELEM(TN) SPC_ELEM_##TN

// LB: the kernel's launch bounds.  SPC_SPMM_INSTANCE: at most 256 threads per block (the compiler
// picks the registers); SPC_SPMM_INSTANCE_MB: also MB resident 256-thread blocks per SM, i.e. at
// most 65536 / (256 MB) registers per thread -- more warps in flight for the latency-bound gathers
// of sparse graphs, at the price of spills in the (cold) split-row combine
#define SPC_SPMM_INSTANCE_LB(NAME, LB, TN, R, CF, VEC, G, U, FL, CQ)                                 \
  extern "C" __global__ void LB NAME(                                                                \
      const int* seg_ptr, const int* seg_out, const int* seg_slot, const int* indices,               \
      const float* data, const SPC_ELEM(TN)* X, SPC_ELEM(TN)* Y, float* part, int* counters,         \
      const int* grp_ptr, const int* slot_grp, const int* grp_out, const int* grp_len,               \
      const int* grp_seg, int nseg, int ngroups, int K, int segs_per_group) {                        \
    spc::spmm_crc_cwm<SPC_ELEM(TN), R, CF, VEC, G, U, FL, CQ>(seg_ptr, seg_out, seg_slot, indices, data, X, \
                                                      Y, part, counters, grp_ptr, slot_grp, grp_out, \
                                                      grp_len, grp_seg, nseg, ngroups, K,            \
                                                      segs_per_group);                               \
  }
#define SPC_SPMM_INSTANCE(NAME, TN, R, CF, VEC, G, U, FL) \
  SPC_SPMM_INSTANCE_LB(NAME, __launch_bounds__(256), TN, R, CF, VEC, G, U, FL, 0)
#define SPC_SPMM_INSTANCE_MB(NAME, TN, R, CF, VEC, G, U, FL, MB) \
  SPC_SPMM_INSTANCE_LB(NAME, __launch_bounds__(256, MB), TN, R, CF, VEC, G, U, FL, 0)
// CQ: at most CQ partial values a lane in flight in the split-row combine (parameter combine_vals)
#define SPC_SPMM_INSTANCE_CQ(NAME, TN, R, CF, VEC, G, U, FL, CQ) \
  SPC_SPMM_INSTANCE_LB(NAME, __launch_bounds__(256), TN, R, CF, VEC, G, U, FL, CQ)
#define SPC_SPMM_INSTANCE_MB_CQ(NAME, TN, R, CF, VEC, G, U, FL, MB, CQ) \
  SPC_SPMM_INSTANCE_LB(NAME, __launch_bounds__(256, MB), TN, R, CF, VEC, G, U, FL, CQ)
