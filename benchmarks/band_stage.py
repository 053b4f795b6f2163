"""Row windows with a narrow column band staged whole: a prototype SpMM, timed next to ``build()``.

In a batch of small graphs (molecules, reply threads: PyG's batching keeps each graph's nodes
consecutive) and in meshes stored in a banded order, the rows of a window of W consecutive rows
reference columns in a narrow range [lo, lo + span).  Those rows of X are *contiguous* in memory,
so a block can copy them to shared memory with coalesced 16-byte copies that depend on nothing but
the window's ``lo`` / ``span`` (no column list, no gather), together with the window's row
pointers, column ids and values; after one wait every row of the window is summed from shared
memory and written once.  Each block's chain of dependent global reads is two deep (window bounds,
then the copies) instead of a gather kernel's three (row pointers, column ids, X rows), and X is
read in whole cache lines about once (sum of spans / n) instead of one row a nonzero.

Two ways to cut the windows (shape key ``win``, ``--kinds``): ``fixed``, W consecutive rows; or
``comp``, whole runs of one connected component packed about W rows a window (a batch's small
graphs whole, a larger graph a window of its own).  Two forms (shape key ``pipe``; the persistent
one with fixed windows only): one window a block (``band_stage``), or persistent blocks that
take every grid-th window and copy window i + 1 into their second stage while they sum window i
(``band_pipe``; one wave of blocks).

A window whose span is above ``smax`` rows, or whose nonzeros are above ``nmax``, reads that part
from global memory instead (same kernel, a branch per window), so every matrix runs; the report
says how much of the matrix was staged.  Nothing is permuted: the order is the matrix's own, since
a module computes A @ X in the caller's order and permuting X would cost a pass over it.

For every graph and K it reports cuSPARSE, the ``default`` module of a committed table rebuilt
through ``build_from_config`` and the kernels' shapes (form, W, threads, U), each checked against the
float64 reference on NaN-poisoned outputs before it is timed (``prototype.run``).

    python benchmarks/band_stage.py GRAPH ... --table docs/benchmarks/h200_spmm_fp32_default_big_v3.json
        [--K 64 128] [--dtype float32|float16] [--kinds fixed comp] [--out DIR] [--name NAME] [--build-only]
"""
from __future__ import annotations

import os
import sys

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prototype  # noqa: E402

#: window heights tried
WINDOWS = (32, 64, 128)
#: shared memory a block may use for its band of X (bytes)
BAND_BYTES = 96 * 1024
#: nonzeros of a window staged at most (ids and values)
NMAX = 2048

SOURCE = prototype.CUDA_ELEM_HELPERS + prototype.CUDA_ROW_SUM + prototype.CUDA_CP_ASYNC + r"""

// the rows of one window, X read through XS (shared band or global X, both indexed by the column
// minus lo) and ids / values through CS / VS (shared or global, indexed from the window's first
// nonzero)
template <int TB, int G, int CF, int U, int T, typename XP, typename IP, typename FP>
__device__ __forceinline__ void window_rows(XP xs, IP cs, FP vs, const int* rp, int r0, int r1, int lo,
                                            uint4* __restrict__ Y, int W16)
{
    const int pb = rp[0];
    for (int r = r0 + threadIdx.x / G; r < r1; r += T / G)
        row_sum<TB, G, CF, U>(xs, cs, vs, rp[r - r0] - pb, rp[r - r0 + 1] - pb, lo, Y, r, W16);
}

// BS_TB: bytes of an element; BS_G lanes a row (BS_CF words a lane); BS_U rows of X in flight a
// lane; BS_T threads a block; BS_SMAX: band rows a block stages at most, BS_NMAX: nonzeros,
// BS_RMAX: row pointers (a window of more rows reads them from global memory).  Window b holds
// rows w_row[b] .. w_row[b + 1] - 1.
extern "C" __global__ void __launch_bounds__(BS_T) band_stage(
    const int* __restrict__ indptr, const int* __restrict__ cols, const float* __restrict__ vals,
    const int* __restrict__ w_row, const int* __restrict__ w_lo, const int* __restrict__ w_span,
    const uint4* __restrict__ X, uint4* __restrict__ Y, int K)
{
    constexpr int TB = BS_TB, G = BS_G, CF = BS_CF, U = BS_U, T = BS_T, EPW = 16 / TB;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int s_rp[BS_RMAX + 1];
    const int W16 = K / EPW;
    const int b = blockIdx.x, r0 = w_row[b], r1 = w_row[b + 1];
    const int lo = w_lo[b], span = w_span[b];
    const int pb = indptr[r0], pe = indptr[r1];
    const bool band = span <= BS_SMAX, ids = pe - pb <= BS_NMAX;
    uint4* xs = reinterpret_cast<uint4*>(smem);
    int* cs = reinterpret_cast<int*>(smem + (size_t)BS_SMAX * W16 * 16);
    float* vs = reinterpret_cast<float*>(cs + BS_NMAX);
    if (band) {
        const uint4* src = X + (size_t)lo * W16;
        for (int t = threadIdx.x; t < span * W16; t += T) cp16(xs + t, src + t);
    }
    if (ids)
        for (int t = threadIdx.x; t < pe - pb; t += T) { cp4(cs + t, cols + pb + t); cp4(vs + t, vals + pb + t); }
    if (r1 - r0 <= BS_RMAX)
        for (int t = threadIdx.x; t <= r1 - r0; t += T) s_rp[t] = indptr[r0 + t];
    asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
    __syncthreads();
    const int* rp = r1 - r0 <= BS_RMAX ? s_rp : indptr + r0;
    const uint4* xg = X + (size_t)lo * W16;
    if (band) {
        if (ids) window_rows<TB, G, CF, U, T>((const uint4*)xs, (const int*)cs, (const float*)vs, rp, r0, r1, lo, Y, W16);
        else window_rows<TB, G, CF, U, T>((const uint4*)xs, cols + pb, vals + pb, rp, r0, r1, lo, Y, W16);
    } else {
        if (ids) window_rows<TB, G, CF, U, T>(xg, (const int*)cs, (const float*)vs, rp, r0, r1, lo, Y, W16);
        else window_rows<TB, G, CF, U, T>(xg, cols + pb, vals + pb, rp, r0, r1, lo, Y, W16);
    }
}

// The same windows, persistent and double-buffered: a block takes windows blockIdx.x,
// blockIdx.x + gridDim.x, ... and copies window i + 1 (band, row pointers, ids, values) into its
// other stage while it sums window i.  Stage layout: band (BS_SMAX x row words), ids, values
// (BS_NMAX each), row pointers (BS_RMAX + 1).
__device__ __forceinline__ void stage_window(unsigned char* st, int b, const int* __restrict__ indptr,
    const int* __restrict__ cols, const float* __restrict__ vals, const int* __restrict__ w_row,
    const int* __restrict__ w_lo, const int* __restrict__ w_span, const uint4* __restrict__ X, int W16, int T)
{
    const int r0 = w_row[b], r1 = w_row[b + 1];
    const int lo = w_lo[b], span = w_span[b], pb = indptr[r0], pe = indptr[r1];
    uint4* xs = reinterpret_cast<uint4*>(st);
    int* cs = reinterpret_cast<int*>(st + (size_t)BS_SMAX * W16 * 16);
    float* vs = reinterpret_cast<float*>(cs + BS_NMAX);
    int* rp = reinterpret_cast<int*>(vs + BS_NMAX);
    if (span <= BS_SMAX) {
        const uint4* src = X + (size_t)lo * W16;
        for (int t = threadIdx.x; t < span * W16; t += T) cp16(xs + t, src + t);
    }
    if (pe - pb <= BS_NMAX)
        for (int t = threadIdx.x; t < pe - pb; t += T) { cp4(cs + t, cols + pb + t); cp4(vs + t, vals + pb + t); }
    if (r1 - r0 <= BS_RMAX)
        for (int t = threadIdx.x; t <= r1 - r0; t += T) cp4(rp + t, indptr + r0 + t);
}

extern "C" __global__ void __launch_bounds__(BS_T) band_pipe(
    const int* __restrict__ indptr, const int* __restrict__ cols, const float* __restrict__ vals,
    const int* __restrict__ w_row, const int* __restrict__ w_lo, const int* __restrict__ w_span,
    const uint4* __restrict__ X, uint4* __restrict__ Y, int K, int nw)
{
    constexpr int TB = BS_TB, G = BS_G, CF = BS_CF, U = BS_U, T = BS_T, EPW = 16 / TB;
    extern __shared__ __align__(16) unsigned char smem[];
    const int W16 = K / EPW;
    const size_t stage_bytes = (size_t)BS_SMAX * W16 * 16 + (size_t)BS_NMAX * 8 + (size_t)(BS_RMAX + 1 + 3) / 4 * 16;
    int b = blockIdx.x;
    if (b < nw) stage_window(smem, b, indptr, cols, vals, w_row, w_lo, w_span, X, W16, T);
    asm volatile("cp.async.commit_group;" ::: "memory");
    for (int i = 0; b < nw; ++i) {
        const int nb = b + gridDim.x;
        if (nb < nw) stage_window(smem + ((i + 1) & 1) * stage_bytes, nb, indptr, cols, vals, w_row, w_lo, w_span, X, W16, T);
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 1;" ::: "memory");
        __syncthreads();
        unsigned char* st = smem + (i & 1) * stage_bytes;
        const int r0 = w_row[b], r1 = w_row[b + 1];
        const int lo = w_lo[b], span = w_span[b], pb = indptr[r0], pe = indptr[r1];
        const uint4* xs = reinterpret_cast<const uint4*>(st);
        const int* cs = reinterpret_cast<const int*>(st + (size_t)BS_SMAX * W16 * 16);
        const float* vs = reinterpret_cast<const float*>(cs + BS_NMAX);
        const int* rp = r1 - r0 <= BS_RMAX ? reinterpret_cast<const int*>(vs + BS_NMAX) : indptr + r0;
        const uint4* xg = X + (size_t)lo * W16;
        if (span <= BS_SMAX) {
            if (pe - pb <= BS_NMAX) window_rows<TB, G, CF, U, T>(xs, cs, vs, rp, r0, r1, lo, Y, W16);
            else window_rows<TB, G, CF, U, T>(xs, cols + pb, vals + pb, rp, r0, r1, lo, Y, W16);
        } else {
            if (pe - pb <= BS_NMAX) window_rows<TB, G, CF, U, T>(xg, cs, vs, rp, r0, r1, lo, Y, W16);
            else window_rows<TB, G, CF, U, T>(xg, cols + pb, vals + pb, rp, r0, r1, lo, Y, W16);
        }
        __syncthreads();        // the stage is free for the window after next
        b = nb;
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
}
"""


def fixed_windows(m: int, W: int) -> np.ndarray:
    """Window row bounds of windows of W consecutive rows (the last may be shorter): int32,
    ceil(m / W) + 1 entries."""
    return np.append(np.arange(0, m, W), m).astype(np.int32)


def component_windows(A, W: int) -> np.ndarray:
    """Window row bounds that cut only where a run of rows of one connected component (weak, of
    A's pattern) begins: every run starting in the same W-row block of the stored order joins the
    window of the block's first run, so a batch's small graphs are packed whole, about W rows a
    window, and a graph of more rows is one window of its own.  Vectorised
    (``scipy.sparse.csgraph.connected_components``)."""
    from scipy.sparse.csgraph import connected_components

    A = A.tocsr()
    m, n = A.shape
    if m == 0:
        return np.zeros(1, np.int32)
    if m != n:       # the bipartite row / column graph's components, restricted to the rows
        B = sp.bmat([[None, A], [A.T, None]], format="csr")
        lab = connected_components(B, directed=False)[1][:m]
    else:
        lab = connected_components(A, directed=True, connection="weak")[1]
    runs = np.flatnonzero(np.r_[True, lab[1:] != lab[:-1]])
    block = runs // W
    first = runs[np.r_[True, block[1:] != block[:-1]]]
    return np.append(first, m).astype(np.int32)


def windows(A, w_row) -> tuple[np.ndarray, np.ndarray]:
    """Each window (rows ``w_row[b]`` .. ``w_row[b+1] - 1``): the smallest column its nonzeros
    reference (``lo``) and the width of their column range (``span``; 0 and lo 0 for a window
    without nonzeros).  Vectorised: one reduceat over the window starts."""
    A = A.tocsr()
    w_row = np.asarray(w_row, np.int64)
    nw = w_row.size - 1
    starts = A.indptr[w_row[:-1]].astype(np.int64)
    ends = A.indptr[w_row[1:]].astype(np.int64)
    lo = np.zeros(nw, np.int64)
    span = np.zeros(nw, np.int64)
    ne = ends > starts
    if ne.any():
        cols = A.indices.astype(np.int64)
        s = starts[ne]
        # reduceat over the non-empty windows' starts: each segment ends where the next begins,
        # and the empty windows between them add no nonzeros
        lo[ne] = np.minimum.reduceat(cols, s)
        span[ne] = np.maximum.reduceat(cols, s) - lo[ne] + 1
    return lo.astype(np.int32), span.astype(np.int32)


#: how windows are cut: W consecutive rows, or whole runs of connected components
KINDS = {"fixed": lambda A, W: fixed_windows(A.shape[0], W), "comp": component_windows}


def band_arrays(A) -> dict:
    """The prototype's arrays: the CSR (sorted, int32 ids, float32 values) and, for each window
    kind of ``KINDS`` and height of ``WINDOWS``, ``{kind}_row{W}`` / ``{kind}_lo{W}`` /
    ``{kind}_span{W}``."""
    A = A.tocsr().copy()
    A.sum_duplicates()
    A.sort_indices()
    out = {"indptr": A.indptr.astype(np.int32), "cols": A.indices.astype(np.int32), "vals": A.data.astype(np.float32)}
    for kind, cut in KINDS.items():
        for W in WINDOWS:
            w_row = cut(A, W)
            out[f"{kind}_row{W}"] = w_row
            out[f"{kind}_lo{W}"], out[f"{kind}_span{W}"] = windows(A, w_row)
    return out


def band_rows(K: int, eb: int) -> int:
    """Rows of X a block's band holds at most: ``BAND_BYTES`` of them, at least 1."""
    return max(1, BAND_BYTES // (K * eb))


def shapes(K: int, eb: int) -> list[dict]:
    """(win, pipe, W, T, U) tried: fixed windows with one window a block (``pipe`` 0) or
    persistent double-buffered blocks (``pipe`` 1), and component windows one a block; window
    heights of ``WINDOWS``, 128 / 256 threads, 2 / 4 rows of X in flight a lane; one 16-byte word
    a lane over the row (G = words, at most 32; CF words a lane beyond)."""
    words = K * eb // 16
    G = min(32, words)
    CF = -(-words // G)
    return [{"win": win, "pipe": P, "W": W, "T": T, "U": U, "G": G, "CF": CF}
            for win, pipes in (("fixed", (0, 1)), ("comp", (0,)))
            for P in pipes for W in WINDOWS for T in (128, 256) for U in (2, 4)]


def stage_bytes(smax: int, nmax: int, rmax: int, K: int, eb: int) -> int:
    """Bytes of one stage of the persistent kernel: band, ids and values, row pointers (16-byte
    aligned; ``nmax`` a multiple of 2)."""
    return smax * K * eb + nmax * 8 + -(-(rmax + 1) // 4) * 16


def staged_share(indptr, w_row, span, smax: int) -> tuple[float, float]:
    """(share of the nonzeros in the windows whose band of ``span`` rows is staged, rows of X
    staged)."""
    span = np.asarray(span, np.int64)
    ip = np.asarray(indptr, np.int64)
    w_row = np.asarray(w_row, np.int64)
    nnz_w = ip[w_row[1:]] - ip[w_row[:-1]]
    ok = span <= smax
    total = max(1, int(ip[-1]))
    return float(nnz_w[ok].sum() / total), float(span[ok].sum())


def limits(indptr, w_row, span, K: int, eb: int) -> tuple[int, int, int]:
    """(band rows, nonzeros, row pointers) a block stages at most: the 99th-percentile window's
    (a few wide windows read global memory instead of costing every block its occupancy), the
    band within ``BAND_BYTES``, the nonzeros within ``NMAX`` and a multiple of 4."""
    ip = np.asarray(indptr, np.int64)
    w_row = np.asarray(w_row, np.int64)
    if w_row.size < 2:
        return 1, 4, 1
    q = lambda v: int(np.ceil(np.quantile(v, 0.99)))  # noqa: E731
    smax = max(1, min(band_rows(K, eb), q(span)))
    nmax = max(4, min(NMAX, q(ip[w_row[1:]] - ip[w_row[:-1]])))
    rmax = max(1, min(1024, q(np.diff(w_row))))
    return smax, -(-nmax // 4) * 4, rmax


def launch(s: dict, A, arr: dict, dev: dict, K: int, eb: int) -> dict | None:
    """One shape's kernel and launch (``prototype.run``'s ``launch_of``): ``kern``, ``grid``,
    ``block``, ``smem``, ``args(X, Y)`` and ``info``; None where a row of X is not whole 16-byte
    words or the persistent kernel's two stages do not fit."""
    import cupy as cp

    if (K * eb) % 16:
        return None
    key = f"{s['win']}_%s{s['W']}"
    w_row, span = arr[key % "row"], arr[key % "span"]
    nw = int(span.size)
    smax, nmax, rmax = limits(arr["indptr"], w_row, span, K, eb)
    opts = (f"-DBS_TB={eb}", f"-DBS_G={s['G']}", f"-DBS_CF={s['CF']}", f"-DBS_U={s['U']}", f"-DBS_T={s['T']}",
            f"-DBS_SMAX={smax}", f"-DBS_NMAX={nmax}", f"-DBS_RMAX={rmax}", "-std=c++17")
    share, rows = staged_share(arr["indptr"], w_row, span, smax)
    info = {"windows": nw, "smax": smax, "nmax": nmax, "rmax": rmax, "staged_nnz": round(share, 3),
            "staged_rows_over_n": round(rows / max(1, A.shape[1]), 3)}
    head = [dev["indptr"], dev["cols"], dev["vals"], dev[key % "row"], dev[key % "lo"], dev[key % "span"]]
    if not s["pipe"]:
        return {"kern": cp.RawKernel(SOURCE, "band_stage", options=opts), "grid": (max(1, nw),), "block": (s["T"],),
                "smem": smax * K * eb + nmax * 8, "info": info,
                "args": lambda X, Y: (*head, X, Y, np.int32(K))}
    smem = 2 * stage_bytes(smax, nmax, rmax, K, eb)
    if smem > 200 * 1024:
        return None
    kern = cp.RawKernel(SOURCE, "band_pipe", options=opts)
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    blocks = min(nw, sms * prototype.resident_blocks(s["T"] // 32, smem, int(kern.num_regs)))
    info["blocks"] = blocks
    return {"kern": kern, "grid": (max(1, blocks),), "block": (s["T"],), "smem": smem, "info": info,
            "args": lambda X, Y: (*head, X, Y, np.int32(K), np.int32(nw))}


def main(argv=None) -> int:
    ap = prototype.arg_parser(__doc__, "band_stage")
    ap.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=sorted(KINDS), help="window kinds measured")
    a = ap.parse_args(argv)
    prototype.run(a, argv, "band_stage.py", band_arrays,
                  lambda K, eb: [x for x in shapes(K, eb) if x["win"] in a.kinds], launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
