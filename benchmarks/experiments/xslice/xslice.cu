// Experiment (not part of spcompile; see README.md beside it): X column slice resident in shared
// memory.  Variant "" (xslice8/4): block (b, s): X[:, s*KT : s*KT+KT] is
// copied into shared memory, then the block reduces the nonzeros of rows [row_split[b],
// row_split[b+1]) (nnz-balanced), split evenly by nonzeros over its warps; rows that cross a
// warp boundary are combined through shared memory after a barrier.  fp32, K % KT == 0.
template <int KT>
__device__ __forceinline__ void xslice(const int* __restrict__ indptr, const int* __restrict__ indices,
    const float* __restrict__ vals, const float* __restrict__ X, float* __restrict__ Y,
    const int* __restrict__ row_split, int n, int K) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  constexpr int G = 32 / KT;
  const int b = blockIdx.x, k0 = blockIdx.y * KT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, NW = blockDim.x >> 5;
  const int g = lane / KT, k = lane % KT;
  float* part = xs + (size_t)n * KT;          // [NW][2][KT] partial sums
  int* prow = reinterpret_cast<int*>(part + NW * 2 * KT);   // [NW][2] their rows (-1: none)
  // fill
  constexpr int Q = KT / 4;
  for (int i = threadIdx.x; i < n * Q; i += blockDim.x) {
    const int r = i / Q, q = i - r * Q;
    smem4[i] = __ldg(reinterpret_cast<const float4*>(X + (size_t)r * K + k0) + q);
  }
  const int r0 = row_split[b], r1 = row_split[b + 1];
  const int E0 = indptr[r0], E1 = indptr[r1];
  const long long tot = E1 - E0;
  const int ea = E0 + (int)(tot * warp / NW), eb = E0 + (int)(tot * (warp + 1) / NW);
  // rs = first row in [r0, r1] with indptr >= ea; re likewise for eb (last warp: r1)
  int lo = r0, hi = r1;
  while (lo < hi) { int mid = (lo + hi) >> 1; if (indptr[mid] >= ea) hi = mid; else lo = mid + 1; }
  const int rs = lo;
  int re;
  if (warp == NW - 1) re = r1;
  else { lo = rs; hi = r1; while (lo < hi) { int mid = (lo + hi) >> 1; if (indptr[mid] >= eb) hi = mid; else lo = mid + 1; } re = lo; }
  __syncthreads();
  if (lane == 0) { prow[warp * 2] = -1; prow[warp * 2 + 1] = -1; }
  __syncwarp();
  // leading partial row: rs - 1 when it starts before ea and ends after ea
  auto row_sum = [&](int e, int e1) {
    float acc = 0.f;
    int base = e;
#pragma unroll 1
    for (; base + 32 <= e1; base += 32) {
      const int c = __ldg(indices + base + lane);
      const float v = __ldg(vals + base + lane);
#pragma unroll
      for (int j = 0; j < 32; j += G) {
        const int cj = __shfl_sync(0xffffffffu, c, j + g);
        const float vj = __shfl_sync(0xffffffffu, v, j + g);
        acc = fmaf(vj, xs[cj * KT + k], acc);
      }
    }
    if (base < e1) {
      const int nleft = e1 - base;
      const int c = lane < nleft ? __ldg(indices + base + lane) : 0;
      const float v = lane < nleft ? __ldg(vals + base + lane) : 0.f;
#pragma unroll
      for (int j = 0; j < 32; j += G) {
        const int cj = __shfl_sync(0xffffffffu, c, j + g);
        const float vj = __shfl_sync(0xffffffffu, v, j + g);
        acc = fmaf(vj, xs[cj * KT + k], acc);
      }
    }
#pragma unroll
    for (int o = KT; o < 32; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
  };
  if (rs > r0 && indptr[rs] > ea) {
    const int rp = rs - 1;
    const float a = row_sum(ea, min(indptr[rp + 1], eb));
    if (g == 0) part[(warp * 2) * KT + k] = a;
    if (lane == 0) prow[warp * 2] = rp;
  }
#pragma unroll 1
  for (int r = rs; r < re; ++r) {
    const int e1r = indptr[r + 1];
    const float a = row_sum(indptr[r], min(e1r, eb));
    if (e1r > eb && warp != NW - 1) {
      if (g == 0) part[(warp * 2 + 1) * KT + k] = a;
      if (lane == 0) prow[warp * 2 + 1] = r;
    } else if (g == 0) {
      Y[(size_t)r * K + k0 + k] = a;
    }
  }
  __syncthreads();
  // combine: warp w's trailing partial plus the leading partials of the warps after it
  const int rt = prow[warp * 2 + 1];
  if (rt >= 0 && g == 0) {
    float a = part[(warp * 2 + 1) * KT + k];
    for (int w2 = warp + 1; w2 < NW && prow[w2 * 2] == rt; ++w2) a += part[(w2 * 2) * KT + k];
    Y[(size_t)rt * K + k0 + k] = a;
  }
}

extern "C" __global__ void __launch_bounds__(1024) xslice8(const int* indptr, const int* indices, const float* vals,
    const float* X, float* Y, const int* row_split, int n, int K) {
  xslice<8>(indptr, indices, vals, X, Y, row_split, n, K);
}
extern "C" __global__ void __launch_bounds__(1024) xslice4(const int* indptr, const int* indices, const float* vals,
    const float* X, float* Y, const int* row_split, int n, int K) {
  xslice<4>(indptr, indices, vals, X, Y, row_split, n, K);
}

// Variant g: each group of KT lanes owns an nnz-balanced range of the block's nonzeros and walks
// its rows serially (lane k of the group: column k0 + k), four entries in flight per step; no
// shuffles.  Rows crossing a group boundary are combined through shared memory.
template <int KT>
__device__ __forceinline__ void xslice_g(const int* __restrict__ indptr, const int* __restrict__ indices,
    const float* __restrict__ vals, const float* __restrict__ X, float* __restrict__ Y,
    const int* __restrict__ row_split, int n, int K) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  constexpr int G = 32 / KT;
  const int b = blockIdx.x, k0 = blockIdx.y * KT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, NW = blockDim.x >> 5;
  const int NG = NW * G, gid = warp * G + lane / KT, k = lane % KT;
  float* part = xs + (size_t)n * KT;                 // [NG][2][KT]
  int* prow = reinterpret_cast<int*>(part + NG * 2 * KT);   // [NG][2]
  constexpr int Q = KT / 4;
#pragma unroll 4
  for (int i = threadIdx.x; i < n * Q; i += blockDim.x) {
    const int r = i / Q, q = i - r * Q;
    smem4[i] = __ldg(reinterpret_cast<const float4*>(X + (size_t)r * K + k0) + q);
  }
  for (int i = threadIdx.x; i < NG * 2; i += blockDim.x) prow[i] = -1;
  const int r0 = row_split[b], r1 = row_split[b + 1];
  const int E0 = indptr[r0], E1 = indptr[r1];
  const long long tot = E1 - E0;
  const int ea = E0 + (int)(tot * gid / NG), eb = E0 + (int)(tot * (gid + 1) / NG);
  int lo = r0, hi = r1;
  while (lo < hi) { int mid = (lo + hi) >> 1; if (__ldg(indptr + mid) >= ea) hi = mid; else lo = mid + 1; }
  const int rs = lo;
  int re;
  if (gid == NG - 1) re = r1;
  else { lo = rs; hi = r1; while (lo < hi) { int mid = (lo + hi) >> 1; if (__ldg(indptr + mid) >= eb) hi = mid; else lo = mid + 1; } re = lo; }
  __syncthreads();
  auto seg = [&](int e, int e1) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    for (; e + 4 <= e1; e += 4) {
      const int c0 = __ldg(indices + e), c1 = __ldg(indices + e + 1), c2 = __ldg(indices + e + 2), c3 = __ldg(indices + e + 3);
      const float v0 = __ldg(vals + e), v1 = __ldg(vals + e + 1), v2 = __ldg(vals + e + 2), v3 = __ldg(vals + e + 3);
      a0 = fmaf(v0, xs[c0 * KT + k], a0); a1 = fmaf(v1, xs[c1 * KT + k], a1);
      a2 = fmaf(v2, xs[c2 * KT + k], a2); a3 = fmaf(v3, xs[c3 * KT + k], a3);
    }
    for (; e < e1; ++e) a0 = fmaf(__ldg(vals + e), xs[__ldg(indices + e) * KT + k], a0);
    return (a0 + a1) + (a2 + a3);
  };
  if (rs > r0 && __ldg(indptr + rs) > ea) {
    const int rp = rs - 1;
    part[(gid * 2) * KT + k] = seg(ea, min(__ldg(indptr + rp + 1), eb));
    if (k == 0) prow[gid * 2] = rp;
  }
  int s = __ldg(indptr + rs);
  int t = rs < re ? __ldg(indptr + rs + 1) : 0;
#pragma unroll 1
  for (int r = rs; r < re; ++r) {
    const int tn = r + 1 < re ? __ldg(indptr + r + 2) : 0;
    const float a = seg(s, min(t, eb));
    if (t > eb && gid != NG - 1) {
      part[(gid * 2 + 1) * KT + k] = a;
      if (k == 0) prow[gid * 2 + 1] = r;
    } else {
      Y[(size_t)r * K + k0 + k] = a;
    }
    s = t; t = tn;
  }
  __syncthreads();
  const int rt = prow[gid * 2 + 1];
  if (rt >= 0) {
    float a = part[(gid * 2 + 1) * KT + k];
    for (int g2 = gid + 1; g2 < NG && prow[g2 * 2] == rt; ++g2) a += part[(g2 * 2) * KT + k];
    Y[(size_t)rt * K + k0 + k] = a;
  }
}
extern "C" __global__ void __launch_bounds__(1024) xsliceg8(const int* indptr, const int* indices, const float* vals,
    const float* X, float* Y, const int* row_split, int n, int K) {
  xslice_g<8>(indptr, indices, vals, X, Y, row_split, n, K);
}
extern "C" __global__ void __launch_bounds__(1024) xsliceg4(const int* indptr, const int* indices, const float* vals,
    const float* X, float* Y, const int* row_split, int n, int K) {
  xslice_g<4>(indptr, indices, vals, X, Y, row_split, n, K);
}
// The fill alone (diagnostic): what copying the slice into shared memory costs.
extern "C" __global__ void __launch_bounds__(1024) xfill8(const int* indptr, const int* indices, const float* vals,
    const float* X, float* Y, const int* row_split, int n, int K) {
  extern __shared__ float4 fbuf[];
  constexpr int Q = 2;
  const int k0 = blockIdx.y * 8;
#pragma unroll 4
  for (int i = threadIdx.x; i < n * Q; i += blockDim.x) {
    const int r = i / Q, q = i - r * Q;
    fbuf[i] = __ldg(reinterpret_cast<const float4*>(X + (size_t)r * K + k0) + q);
  }
  __syncthreads();
  if (threadIdx.x < 8) Y[(size_t)blockIdx.x * K + k0 + threadIdx.x] = reinterpret_cast<float*>(fbuf)[threadIdx.x * 97 % (n * 8)];
}
