"""The most used rows of X kept in shared memory: a prototype SpMM, timed next to ``build()``.

On graphs whose X fits in L2 many times over (social graphs, dense heterophily graphs: 5k-20k
nodes, 30-90 entries a row), every kernel that gathers one row of X per nonzero is bound by the
rate at which the L2 serves those gathers, and `build()` runs at that floor.  Their columns are
used very unevenly: on wiki_squirrel the 1600 most used columns (of 5201) hold 88% of the
nonzeros, on blogcatalog 69%.  This kernel runs one wave of persistent blocks; each first copies
the rows of X of the H most used columns into its shared memory with ``cp.async`` (H by the
shared memory it is given, and only columns used at least once a block on average, so that the
copies cost no more L2 reads than the gathers they replace), then its row groups take segments
of at most ``SEG`` nonzeros in turn (rows in degree order, long rows first) and sum them, reading
X from shared memory where the column is staged (its id stored as ``slot - H``, negative) and
from global memory otherwise.  A row cut into several segments is combined in the same launch:
each writes an fp32 partial, and the last to finish (atomic counter per row) adds them in order,
U partials' loads in flight at a time, and writes the row (deterministic), resetting its counter.
Shapes with no staged columns are the same kernel without the cache: the A/B of the cache alone.

For every graph and K it reports cuSPARSE, the ``default`` module of a committed table rebuilt
through ``build_from_config`` and the kernel's shapes (threads, rows in flight, staged columns),
each checked against the float64 reference on NaN-poisoned outputs before it is timed
(``prototype.run``).

    python benchmarks/hot_cache.py GRAPH ... --table docs/benchmarks/h200_spmm_fp32_default_big_v3.json
        [--K 64 128] [--dtype float32|float16] [--out DIR] [--name NAME] [--build-only] [--bound]

``--bound`` also times the ``default`` module's configuration on the matrix without the entries of
the columns a cache would stage (``bound``): what its kernel could gain at most if those gathers
cost nothing.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prototype  # noqa: E402

#: nonzeros of a segment at most (a longer row is cut and combined)
SEG = 64
#: SMs of the GPU when none is visible (--build-only)
DEFAULT_SMS = 132

SOURCE = prototype.CUDA_ELEM_HELPERS + prototype.CUDA_ROW_SUM + prototype.CUDA_CP_ASYNC + r"""
// word i (negative: a staged row, counted from the end of the shared copy) of X
struct HotX {
    const uint4* sh;
    const uint4* __restrict__ x;
    long long hw;
    __device__ __forceinline__ uint4 operator[](size_t i) const {
        const long long j = (long long)i;
        return j < 0 ? sh[j + hw] : x[j];
    }
};

// HC_TB bytes of an element; HC_G lanes a segment (HC_CF words a lane); HC_U rows of X in flight
// a lane; HC_T threads a block, HC_MB blocks an SM (launch bounds).  Segment s: nonzeros
// seg_ptr[s] .. seg_ptr[s + 1] - 1 of output row seg_row[s]; seg_sp[s] -1 (the whole row) or the
// split row it is a slice of, whose partials are slots sp_first[r] .. + sp_n[r] - 1 (this one:
// seg_slot[s]).
extern "C" __global__ void __launch_bounds__(HC_T, HC_MB) hot_cache(
    const int* __restrict__ seg_ptr, const int* __restrict__ seg_row, const int* __restrict__ seg_slot,
    const int* __restrict__ seg_sp, const int* __restrict__ sp_first, const int* __restrict__ sp_n,
    const int* __restrict__ cols, const float* __restrict__ vals, const int* __restrict__ hot, int H,
    const uint4* __restrict__ X, uint4* __restrict__ Y, float* __restrict__ part, int* __restrict__ cnt,
    int nseg, int K)
{
    constexpr int G = HC_G, CF = HC_CF, U = HC_U, T = HC_T, TB = HC_TB, EPW = 16 / TB;
    extern __shared__ uint4 sh[];
    const int W16 = K / EPW;
    for (int i = threadIdx.x; i < H * W16; i += T) cp16(sh + i, X + (size_t)hot[i / W16] * W16 + i % W16);
    asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
    __syncthreads();
    const HotX xs{sh, X, (long long)H * W16};
    const int lane = threadIdx.x % G;
    const int gl = (threadIdx.x % 32) / G * G;
    const unsigned gmask = G == 32 ? 0xffffffffu : (((1u << G) - 1u) << gl);
    const int ng = gridDim.x * (T / G);
    for (int s = blockIdx.x * (T / G) + threadIdx.x / G; s < nseg; s += ng) {
        float acc[CF][EPW];
        row_acc<TB, G, CF, U>(acc, xs, cols, vals, seg_ptr[s], seg_ptr[s + 1], 0, W16);
        const int out = seg_row[s];
        const int sl = seg_slot[s];
        if (sl >= 0) {
            float* pp = part + (size_t)sl * K;
#pragma unroll
            for (int c = 0; c < CF; ++c) {
                const int w = lane + c * G;
                if (w < W16)
#pragma unroll
                    for (int v = 0; v < EPW; v += 4)
                        *(float4*)(pp + w * EPW + v) = make_float4(acc[c][v], acc[c][v + 1], acc[c][v + 2], acc[c][v + 3]);
            }
            __threadfence();
            __syncwarp(gmask);
            const int r = seg_sp[s];
            int last = 0;
            if (lane == 0) last = atomicAdd(cnt + r, 1) == sp_n[r] - 1;
            if (!__shfl_sync(gmask, last, gl)) continue;
            __threadfence();
#pragma unroll
            for (int c = 0; c < CF; ++c)
#pragma unroll
                for (int v = 0; v < EPW; ++v) acc[c][v] = 0.0f;
            const int nq = sp_n[r];
            const float* p0 = part + (size_t)sp_first[r] * K;
            for (int q0 = 0; q0 < nq; q0 += U) {         // U partials' loads in flight, added in slot order
                float4 f[U][CF][EPW / 4];
#pragma unroll
                for (int u = 0; u < U; ++u)
#pragma unroll
                    for (int c = 0; c < CF; ++c) {
                        const int w = lane + c * G;
#pragma unroll
                        for (int v = 0; v < EPW; v += 4)
                            f[u][c][v / 4] = q0 + u < nq && w < W16 ? __ldcg((const float4*)(p0 + (size_t)(q0 + u) * K + w * EPW + v))
                                                                    : make_float4(0.f, 0.f, 0.f, 0.f);
                    }
#pragma unroll
                for (int u = 0; u < U; ++u)
#pragma unroll
                    for (int c = 0; c < CF; ++c)
#pragma unroll
                        for (int v = 0; v < EPW; v += 4) {
                            acc[c][v] += f[u][c][v / 4].x; acc[c][v + 1] += f[u][c][v / 4].y;
                            acc[c][v + 2] += f[u][c][v / 4].z; acc[c][v + 3] += f[u][c][v / 4].w;
                        }
            }
            if (lane == 0) cnt[r] = 0;
        }
#pragma unroll
        for (int c = 0; c < CF; ++c) {
            const int w = lane + c * G;
            if (w < W16) Y[(size_t)out * W16 + w] = pack<TB>(acc[c]);
        }
    }
}
"""


def segments(A, seg: int = SEG) -> dict:
    """Host arrays of the kernel but the staged columns: rows in degree order (long rows first,
    stable), each cut into segments of at most ``seg`` nonzeros (an empty row: one empty segment,
    so its output is written); ``cols`` / ``vals`` the nonzeros in that order (original ids),
    ``seg_ptr`` / ``seg_row`` / ``seg_slot`` / ``seg_sp`` per segment and ``sp_first`` / ``sp_n``
    per row of several segments (their partial slots).  Vectorised."""
    A = sp.csr_matrix(A)
    A.sort_indices()
    m = A.shape[0]
    lens = np.diff(A.indptr).astype(np.int64)
    order = np.argsort(-lens, kind="stable")
    B = A[order]
    ol = lens[order]
    nsr = np.maximum(1, -(-ol // seg))                     # segments a row
    nseg = int(nsr.sum())
    first = np.concatenate([[0], np.cumsum(nsr)[:-1]])    # first segment of each row
    row_of = np.repeat(np.arange(m), nsr)
    k = np.arange(nseg) - first[row_of]                   # segment's index within its row
    start = B.indptr[:-1][row_of] + k * seg
    seg_ptr = np.concatenate([start, [B.nnz]]).astype(np.int64)
    seg_ptr[:-1] = np.minimum(start, B.indptr[1:][row_of])
    split = nsr > 1
    sp_id = np.full(m, -1, np.int64)
    sp_id[split] = np.arange(int(split.sum()))
    sp_n = nsr[split]
    sp_first = np.concatenate([[0], np.cumsum(sp_n)[:-1]])
    seg_sp = sp_id[row_of]
    seg_slot = np.where(seg_sp >= 0, sp_first[np.maximum(seg_sp, 0)] + k, -1)
    return {"seg_ptr": seg_ptr.astype(np.int32), "seg_row": order[row_of].astype(np.int32),
            "seg_slot": seg_slot.astype(np.int32), "seg_sp": seg_sp.astype(np.int32),
            "sp_first": sp_first.astype(np.int32), "sp_n": sp_n.astype(np.int32),
            "cols": B.indices.astype(np.int32), "vals": B.data.astype(np.float32), "n": int(A.shape[1])}


def hot_columns(cols: np.ndarray, n: int, h_max: int, blocks: int) -> np.ndarray:
    """The columns staged: the most used (ties: lower id first), at most ``h_max``, each used at
    least ``blocks`` times (once a block on average: a block copies every staged row once)."""
    if h_max <= 0:
        return np.zeros(0, np.int32)
    cnt = np.bincount(cols, minlength=n)
    top = np.argsort(-cnt, kind="stable")[:h_max]
    return top[cnt[top] >= max(1, blocks)].astype(np.int32)


def remap(cols: np.ndarray, hot: np.ndarray, n: int) -> np.ndarray:
    """Column ids as the kernel reads them: a staged column's ``slot - H`` (negative), others
    their own id."""
    slot = np.full(n, -1, np.int64)
    slot[hot] = np.arange(hot.size)
    s = slot[cols]
    return np.where(s >= 0, s - hot.size, cols).astype(np.int32)


def emulate(arr: dict, hot: np.ndarray, X: np.ndarray) -> np.ndarray:
    """What the kernel computes, in float64 from its arrays: the ids as it reads them decoded
    through the staged list, each segment's sum, a whole row's segment written as the row and a
    split row's partials (slots ``seg_slot``) added in slot order."""
    c = remap(arr["cols"], hot, arr["n"]).astype(np.int64)
    ids = np.where(c < 0, hot[np.where(c < 0, c + hot.size, 0)] if hot.size else 0, c)
    contrib = arr["vals"][:, None].astype(np.float64) * X[ids]
    nseg = arr["seg_row"].size
    seg_sum = np.zeros((nseg, X.shape[1]))
    np.add.at(seg_sum, np.repeat(np.arange(nseg), np.diff(arr["seg_ptr"])), contrib)
    Y = np.full((int(arr["seg_row"].max(initial=-1)) + 1, X.shape[1]), np.nan)
    whole = arr["seg_slot"] < 0
    Y[arr["seg_row"][whole]] = seg_sum[whole]
    if arr["sp_n"].size:
        part = np.full((int(arr["sp_n"].sum()), X.shape[1]), np.nan)
        part[arr["seg_slot"][~whole]] = seg_sum[~whole]
        sp_row = np.full(arr["sp_n"].size, -1, np.int64)
        sp_row[arr["seg_sp"][~whole]] = arr["seg_row"][~whole]
        Y[sp_row] = np.add.reduceat(part, arr["sp_first"], axis=0)
    return Y


def shapes(K: int, eb: int) -> list[dict]:
    """(G, CF, T, U, hot) shapes: one 16-byte word a lane (G = words of a row, at most 32);
    512 or 1024 threads (launch bounds of 2 / 1 blocks an SM: at most 64 registers, 32 warps an
    SM, with or without the cache); 4 or 8 rows of X in flight a lane; no staged columns, or as
    many as the shared memory of a block holds (a whole SM's at 1024 threads, half at 512)."""
    words = K * eb // 16
    G, CF = min(32, words), max(1, words // 32)
    if G * CF < words or G & (G - 1):
        return []
    return [{"G": G, "CF": CF, "T": T, "U": U, "hot": hot} for T in (512, 1024) for U in (4, 8) for hot in (0, 1)]


def cache_rows(per_sm: int, K: int, eb: int) -> int:
    """Rows of X (``K`` elements of ``eb`` bytes) that the shared memory of one of ``per_sm``
    blocks an SM holds (1 KB a block reserved); 0 for no cache (``per_sm`` 0)."""
    return (prototype.SM_SMEM // per_sm - 1024) // (K * eb) if per_sm else 0


def without_columns(A, hot: np.ndarray):
    """A with the entries of the columns ``hot`` removed (same shape; rows may become empty)."""
    A = sp.csr_matrix(A, copy=True)
    keep = np.ones(A.shape[1], bool)
    keep[hot] = False
    A.data = A.data * keep[A.indices]
    A.eliminate_zeros()
    return A


def bound(a, argv) -> list[dict]:
    """``--bound``: for every graph and K, the ``default`` module's configuration built and timed
    (``build_from_config``, the Timer rule) on the matrix and on the matrix without the entries of
    the columns each cache size would stage (as ``hot_columns`` picks them for one wave of 1 or 2
    blocks an SM): what that kernel would gain if those gathers cost nothing, staging included
    as free.  Written to ``<name>_bound.json``."""
    import bench
    from spcompile.core.config import Config

    cfgs = prototype.default_configs(a.table)
    eb = prototype.ELEM_BYTES[a.dtype]
    timer, sms = None, DEFAULT_SMS
    if not a.build_only:
        import cupy as cp

        from spcompile.autotune.measure import Timer

        timer = Timer("cuda")
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = []
    for name, path, _ in prototype.common.find_graphs(a.graphs):
        A = prototype.common.load_matrix(path)
        cols = A.tocsr().indices
        for K in a.K:
            cfg = cfgs.get((name, K))
            if not cfg:
                continue
            res = {"graph": name, "nnz": int(A.nnz), "K": K, "dtype": a.dtype, "config": cfg, "cells": []}
            for per_sm in (0, 1, 2):
                hot = hot_columns(cols, A.shape[1], cache_rows(per_sm, K, eb), sms * per_sm)
                B = without_columns(A, hot) if hot.size else A
                if a.build_only:
                    bench.build_from_config(bench.make_op(B, "spmm", K, "sum", a.dtype), Config.from_dict(cfg))
                    continue
                w = bench.Workload(B, "spmm", "sum", K, a.dtype, "cuda")
                t = bench.time_config(w, Config.from_dict(cfg), timer)
                w.release()
                res["cells"].append({"blocks_per_sm": per_sm, "H": int(hot.size), "nnz_left": int(B.nnz),
                                     "covered": round(1 - B.nnz / max(A.nnz, 1), 3), "us": t.get("us"),
                                     "status": t.get("status")})
            if a.build_only:
                print(f"{name} K={K}: bound built", flush=True)
                continue
            print(f"{name:24s} K={K:3d} default without staged columns: "
                  + "  ".join(f"H={c['H']} cov={c['covered']} {c['us']:.1f} us" for c in res["cells"]), flush=True)
            out.append(res)
            prototype.common.write_rows(a.out, a.name + "_bound", "hot_cache.py", argv, out)
    return out


def main(argv=None) -> int:
    ap = prototype.arg_parser(__doc__, "hot_cache")
    ap.add_argument("--bound", action="store_true", help="also time the default module without the staged columns' entries")
    a = ap.parse_args(argv)

    def launch(s, A, arr, dev, K, eb):
        import cupy as cp

        # blocks an SM with the cache (its shared memory), also the launch bounds with or without
        # it: at most 64 registers
        per_sm = 1 if s["T"] == 1024 else 2
        h_max = cache_rows(per_sm, K, eb) if s["hot"] else 0
        opts = (f"-DHC_TB={eb}", f"-DHC_G={s['G']}", f"-DHC_CF={s['CF']}", f"-DHC_U={s['U']}", f"-DHC_T={s['T']}",
                f"-DHC_MB={per_sm}", "-std=c++17")
        kern = cp.RawKernel(SOURCE, "hot_cache", options=opts)
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        blocks = sms * prototype.resident_blocks(s["T"] // 32, h_max * K * eb, kern.num_regs)
        hot = hot_columns(arr["cols"], arr["n"], h_max, blocks)
        cols = cp.asarray(remap(arr["cols"], hot, arr["n"]))
        dhot = cp.asarray(hot if hot.size else np.zeros(1, np.int32))
        part = cp.zeros(max(1, int(arr["sp_n"].sum())) * K, np.float32)
        cnt = cp.zeros(max(1, arr["sp_n"].size), np.int32)
        covered = float(np.isin(arr["cols"], hot).mean()) if hot.size else 0.0
        return {"kern": kern, "grid": (blocks,), "block": (s["T"],), "smem": int(hot.size * K * eb),
                "info": {"H": int(hot.size), "covered": round(covered, 3), "blocks": blocks},
                "args": lambda X, Y: (dev["seg_ptr"], dev["seg_row"], dev["seg_slot"], dev["seg_sp"], dev["sp_first"],
                                      dev["sp_n"], cols, dev["vals"], dhot, np.int32(hot.size), X, Y, part, cnt,
                                      np.int32(arr["seg_row"].size), np.int32(K))}

    prototype.run(a, argv, "hot_cache.py", segments, shapes, launch)
    if a.bound:
        bound(a, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
