// Shared device helpers of the tensor-core templates tc.wmma_sgt (tc_wmma_sgt.cu) and
// tc.wmma_sgt_sddmm (tc_wmma_sddmm.cu): operand conversion / packing, the mma.sync wrappers
// (tf32 m16n8k8, fp16 / bf16 m16n8k16, fp32 accumulate) and the guarded vector loads / stores of
// fp32 and 16-bit rows.  The templates' render() inlines this file in place of its #include, so
// the generated source is self-contained (nvcc compiles it from a temporary directory).
//
// Precision codes P: 0 tf32, 1 fp16, 2 bf16.  16-bit data travels as raw 16-bit patterns
// (unsigned short) and packed pairs (unsigned: low half = lower k index / lower column).
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <type_traits>

namespace spc_tcf {

__device__ __forceinline__ unsigned f2tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// two floats -> packed fp16 (P = 1) or bf16 (P = 2) pair, round to nearest even
template <int P> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
  if (P == 2) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// one float -> 16-bit pattern of P's type (rounded once)
template <int P> __device__ __forceinline__ unsigned short f2h(float x) {
  if (P == 2) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  return __half_as_ushort(__float2half_rn(x));
}

// D += A B, A 16 x k (4 registers), B k x 8 (2 registers), D 16 x 8 fp32 (PTX fragment layouts)
template <int P> __device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                                          unsigned b1) {
  if (P == 0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else if (P == 1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// element j of a float4 / word i of a uint4 (compile-time j / i after unrolling)
__device__ __forceinline__ float el(const float4& v, int j) {
  return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
}
__device__ __forceinline__ unsigned wd(const uint4& v, int i) {
  return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// 16-bit element j (0..7) of row a (low half of the result) and of row b (high half)
__device__ __forceinline__ unsigned sel16(const uint4& a, const uint4& b, int j) {
  return __byte_perm(wd(a, j >> 1), wd(b, j >> 1), (j & 1) ? 0x7632 : 0x5410);
}

// 4 consecutive floats of row r (r < 0: zeros) from column col, zero beyond K.  VEC = 4: one
// 16-byte load (K % 4 == 0 and a 16-byte aligned base); VEC = 1: guarded scalar loads.  CGL:
// load through L2 only (data written by other thread blocks of the same launch).
template <int VEC, bool CGL = false>
__device__ __forceinline__ float4 ld4(const float* __restrict__ base, long long r, int col, int K) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (r < 0 || col >= K) return v;
  const float* p = base + r * (long long)K + col;
  if (VEC == 4) {
    v = CGL ? __ldcg(reinterpret_cast<const float4*>(p)) : __ldg(reinterpret_cast<const float4*>(p));
  } else {
    v.x = CGL ? __ldcg(p) : __ldg(p);
    if (col + 1 < K) v.y = CGL ? __ldcg(p + 1) : __ldg(p + 1);
    if (col + 2 < K) v.z = CGL ? __ldcg(p + 2) : __ldg(p + 2);
    if (col + 3 < K) v.w = CGL ? __ldcg(p + 3) : __ldg(p + 3);
  }
  return v;
}

// 8 consecutive 16-bit elements of row r (r < 0: zeros) from column col, zero beyond K.  VEC = 8:
// one 16-byte load (K % 8 == 0 and a 16-byte aligned base); VEC = 1: guarded scalar loads.
template <int VEC>
__device__ __forceinline__ uint4 ld8h(const unsigned short* __restrict__ base, long long r, int col, int K) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (r < 0 || col >= K) return v;
  const unsigned short* p = base + r * (long long)K + col;
  if (VEC == 8) return __ldg(reinterpret_cast<const uint4*>(p));
  unsigned e[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = (col + i < K) ? (unsigned)__ldg(p + i) : 0u;
  v.x = e[0] | (e[1] << 16); v.y = e[2] | (e[3] << 16); v.z = e[4] | (e[5] << 16); v.w = e[6] | (e[7] << 16);
  return v;
}

// N (multiple of 4) consecutive floats v to p[col ..], nothing at or beyond K.  VEC > 1: the
// caller guarantees col + N <= K whenever col < K and 16-byte alignment (float4 stores).
template <int N, int VEC> __device__ __forceinline__ void st_f32(float* __restrict__ p, int col, int K,
                                                                const float (&v)[N]) {
  if (col >= K) return;
  if (VEC > 1) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
      *reinterpret_cast<float4*>(p + col + 4 * i) = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (col + i < K) p[col + i] = v[i];
  }
}

// N consecutive floats from p[col ..] (zero at or beyond K), through L2 (CGL loads).
template <int N, int VEC> __device__ __forceinline__ void ld_f32_cg(const float* p, int col, int K, float (&v)[N]) {
  if (VEC > 1 && col < K) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float4 q = __ldcg(reinterpret_cast<const float4*>(p + col + 4 * i));
      v[4 * i] = q.x; v[4 * i + 1] = q.y; v[4 * i + 2] = q.z; v[4 * i + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = (col + i < K) ? __ldcg(p + col + i) : 0.0f;
  }
}

// N (multiple of 8) consecutive floats, rounded once to P's 16-bit type, to p[col ..].  VEC = 8:
// 16-byte stores (col + N <= K when col < K, aligned); VEC = 1: guarded scalar stores.
template <int P, int N, int VEC> __device__ __forceinline__ void st_h(unsigned short* __restrict__ p, int col, int K,
                                                                     const float (&v)[N]) {
  if (col >= K) return;
  if (VEC == 8) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
      *reinterpret_cast<uint4*>(p + col + 8 * i) =
          make_uint4(pack2<P>(v[8 * i], v[8 * i + 1]), pack2<P>(v[8 * i + 2], v[8 * i + 3]),
                     pack2<P>(v[8 * i + 4], v[8 * i + 5]), pack2<P>(v[8 * i + 6], v[8 * i + 7]));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (col + i < K) p[col + i] = f2h<P>(v[i]);
  }
}

}  // namespace spc_tcf
