"""Rows grouped by length: a prototype SpMM for graphs of short rows, timed next to ``build()``.

The fp32 modules furthest from the floor (meshes, batches of molecules) run rows of 1-4 nonzeros
through ``csr.crc_cwm``, whose every row is a chain of three dependent loads (row pointers,
column ids, X rows) and a segment's bookkeeping (Nsight Compute on the H200: 37 warp
instructions a nonzero on dimacs10_wing at K=64, about 60% of the issue slots busy).  This script
measures a kernel without either: the rows are ordered by length (as ``reorder.degree`` does) and
cut into buckets of rows of one length L, so a row's nonzeros start at ``bucket start + i * L``
and no row pointer is read; one row a group of G lanes, its L column ids and values read by the
group's lanes at once (one coalesced load), then its L X rows loaded (up to U in flight a lane)
and summed in nonzero order; the output row is written once.  Only graphs whose rows hold at
most ``LMAX`` nonzeros (no split rows) are measured.

For every graph and K it reports cuSPARSE, the ``default`` module of a committed benchmark table
rebuilt through the product's ``build_from_config`` and this kernel's shapes, every result checked
against the float64 reference on NaN-poisoned outputs before it is timed by the product's Timer
rule (CUDA-graph replay between events, median; three input sets).

    python benchmarks/length_buckets.py GRAPH ... --table docs/benchmarks/h200_spmm_fp32_default_big_v3.json
        [--K 64 128] [--dtype float32|float16] [--out DIR] [--name NAME] [--build-only]
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prototype  # noqa: E402

#: rows longer than this are not handled by the prototype
LMAX = 64

SOURCE = prototype.CUDA_ELEM_HELPERS + prototype.CUDA_ROW_SUM + r"""
// LB_TB: bytes of an element of X / Y (4: float, 2: half)
extern "C" __global__ void __launch_bounds__(256, LB_MB) length_buckets(
    const int* __restrict__ b_row, const int* __restrict__ b_nnz, const int* __restrict__ b_len, int nb,
    const int* __restrict__ rows, const int* __restrict__ cols, const float* __restrict__ vals,
    const uint4* __restrict__ X, uint4* __restrict__ Y, int nrows, int K)
{
    constexpr int G = LB_G, U = LB_U, CF = LB_CF;
    constexpr int EPW = 16 / LB_TB;                  // elements a 16-byte word
    __shared__ int s_row[LB_LMAX + 2], s_nnz[LB_LMAX + 2], s_len[LB_LMAX + 2];
    for (int t = threadIdx.x; t <= nb; t += blockDim.x) { s_row[t] = b_row[t]; s_nnz[t] = t < nb ? b_nnz[t] : 0; s_len[t] = t < nb ? b_len[t] : 0; }
    __syncthreads();
    const int i = (blockIdx.x * blockDim.x + threadIdx.x) / G;
    if (i >= nrows) return;
    int b = 0, hi = nb - 1;                          // the last bucket starting at or before row i
    while (b < hi) {
        const int mid = (b + hi + 1) >> 1;
        if (s_row[mid] <= i) b = mid; else hi = mid - 1;
    }
    const int L = s_len[b];
    const int p0 = s_nnz[b] + (i - s_row[b]) * L;
    const int out = rows[i];
    row_sum<LB_TB, G, CF, U>(X, cols, vals, p0, p0 + L, 0, Y, out, K / EPW);   // K / EPW: words of a row of X / Y
}
"""


def bucket_rows(A) -> dict:
    """The prototype's arrays: rows ordered by length (descending, stable), cut into buckets of
    one length; ``rows`` the output row of each, ``cols`` / ``vals`` their nonzeros in that order,
    ``b_row`` / ``b_nnz`` / ``b_len`` each bucket's first row (one more: the end), first nonzero
    and length.  Vectorised."""
    A = A.tocsr()
    A.sort_indices()
    lens = np.diff(A.indptr).astype(np.int64)
    if lens.size and lens.max() > LMAX:
        raise ValueError(f"a row of {lens.max()} nonzeros: the prototype handles at most {LMAX}")
    order = np.argsort(-lens, kind="stable")
    ol = lens[order]
    starts = A.indptr[:-1][order].astype(np.int64)
    idx = np.repeat(starts - np.concatenate([[0], np.cumsum(ol)[:-1]]), ol) + np.arange(int(ol.sum()))
    edges = np.flatnonzero(np.diff(ol)) + 1
    b_row = np.concatenate([[0], edges, [ol.size]]).astype(np.int32)
    b_len = ol[b_row[:-1]].astype(np.int32)
    b_nnz = np.concatenate([[0], np.cumsum(ol)])[b_row[:-1]].astype(np.int32)
    return {"rows": order.astype(np.int32), "cols": A.indices[idx].astype(np.int32),
            "vals": A.data[idx].astype(np.float32), "b_row": b_row, "b_nnz": b_nnz, "b_len": b_len}


def shapes(K: int, eb: int) -> list[dict]:
    """(G, CF, U, MB) shapes tried: one 16-byte word a lane over the row (G = words, at most 32),
    or half the lanes with two words each; U 2 / 4 / 8; launch bounds of 1 / 4 / 8 blocks."""
    words = K * eb // 16
    out = []
    for G, CF in ((min(32, words), max(1, words // 32)), (max(4, min(32, words) // 2), max(1, words // 32) * 2)):
        if G * CF < words or G & (G - 1):
            continue
        for U in (2, 4, 8):
            for MB in (1, 4, 8):
                out.append({"G": G, "CF": CF, "U": U, "MB": MB})
    return out


def main(argv=None) -> int:
    a = prototype.arg_parser(__doc__, "length_buckets").parse_args(argv)

    def launch(s, A, arr, dev, K, eb):
        import cupy as cp

        opts = (f"-DLB_LMAX={LMAX}", f"-DLB_TB={eb}", f"-DLB_G={s['G']}", f"-DLB_U={s['U']}", f"-DLB_CF={s['CF']}",
                f"-DLB_MB={s['MB']}")
        nrows = int(arr["rows"].size)
        return {"kern": cp.RawKernel(SOURCE, "length_buckets", options=opts), "grid": (-(-nrows * s["G"] // 256),),
                "block": (256,), "smem": 0, "info": {"buckets": int(arr["b_len"].size)},
                "args": lambda X, Y: (dev["b_row"], dev["b_nnz"], dev["b_len"], np.int32(arr["b_len"].size), dev["rows"],
                                      dev["cols"], dev["vals"], X, Y, np.int32(nrows), np.int32(K))}

    prototype.run(a, argv, "length_buckets.py", bucket_rows, shapes, launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
