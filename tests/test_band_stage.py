"""benchmarks/band_stage.py's host side: each window's column band (smallest column and width, empty
windows and a short last window included), what share of the matrix the staged windows hold, the
shapes it launches, and its CUDA source compiled for sm_90 and sm_80 (the GPU part runs on the
device, where every result is checked against float64 before it is timed)."""
import os
import sys

import numpy as np
import pytest
import scipy.sparse as sp

from conftest import needs_nvcc, nvcc_cubin

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import band_stage as bs  # noqa: E402


def _loop_windows(A, W):
    m = A.shape[0]
    lo, span = [], []
    for r0 in range(0, m, W):
        c = A.indices[A.indptr[r0]:A.indptr[min(r0 + W, m)]]
        lo.append(int(c.min()) if c.size else 0)
        span.append(int(c.max() - c.min() + 1) if c.size else 0)
    return np.array(lo), np.array(span)


@pytest.mark.parametrize("W", [1, 3, 32, 64])
def test_windows_match_a_loop(W):
    rng = np.random.default_rng(W)
    m, n = 301, 190                                   # non-square, a short last window
    lens = rng.integers(0, 5, m)
    lens[:70] = 0                                     # whole empty windows, before the first nonzero
    lens[150:230] = 0                                 # and between
    lens[-1] = 0
    lens[100] = 120                                   # a long row
    rows = np.repeat(np.arange(m), lens)
    cols = np.concatenate([rng.choice(n, k, replace=False) for k in lens])
    A = sp.csr_matrix((rng.standard_normal(rows.size), (rows, cols)), shape=(m, n))
    A.sort_indices()
    w_row = bs.fixed_windows(m, W)
    assert w_row[0] == 0 and w_row[-1] == m and np.all(np.diff(w_row) == np.minimum(W, m - w_row[:-1]))
    lo, span = bs.windows(A, w_row)
    elo, espan = _loop_windows(A, W)
    assert lo.dtype == np.int32 and span.dtype == np.int32
    np.testing.assert_array_equal(lo, elo)
    np.testing.assert_array_equal(span, espan)
    assert span.size == -(-m // W) and (span == 0).any()


def test_band_of_a_block_diagonal_batch():
    # a batch of 20 graphs of 8 nodes each: a window of 8 rows aligned to a graph spans its 8 columns
    blocks = [sp.random(8, 8, density=0.5, random_state=k, format="csr") + sp.eye(8) for k in range(20)]
    A = sp.block_diag(blocks, format="csr")
    A.sort_indices()
    w_row = bs.fixed_windows(160, 8)
    lo, span = bs.windows(A, w_row)
    np.testing.assert_array_equal(lo, np.arange(20) * 8)
    np.testing.assert_array_equal(span, np.full(20, 8))
    share, rows = bs.staged_share(A.indptr, w_row, span, 8)
    assert share == 1.0 and rows == 160
    share, rows = bs.staged_share(A.indptr, w_row, span, 7)         # no band fits: nothing staged
    assert share == 0.0 and rows == 0


def test_component_windows_cut_between_graphs():
    rng = np.random.default_rng(3)
    sizes = rng.integers(2, 30, 60)                   # a path of 2 or more nodes: no empty row
    sizes[10] = 200                                   # a graph taller than a window
    blocks = []
    for k, n in enumerate(sizes):                     # each graph connected: a path plus random edges
        P = sp.diags([np.ones(n - 1)], [1], shape=(n, n)) + sp.random(n, n, density=0.1, random_state=k)
        blocks.append((P + P.T).tocsr())
    A = sp.block_diag(blocks, format="csr")
    A.sort_indices()
    starts = np.r_[0, np.cumsum(sizes)]
    m = int(starts[-1])
    for W in (1, 16, 64):
        w_row = bs.component_windows(A, W)
        assert w_row[0] == 0 and w_row[-1] == m and np.all(np.diff(w_row) > 0)
        assert set(w_row) <= set(starts)              # windows cut only between graphs
        # every graph start in a W-row block joins the window of the block's first graph
        assert len(w_row) - 1 == len(np.unique(starts[:-1] // W))
        lo, span = bs.windows(A, w_row)
        np.testing.assert_array_equal(lo, w_row[:-1])          # square, symmetric: the band is the window
        np.testing.assert_array_equal(span, np.diff(w_row))
    w = bs.component_windows(A, 16)                   # the tall graph ends its window
    k = np.searchsorted(w, starts[10], side="right") - 1
    assert w[k + 1] == starts[11] and w[k + 1] - w[k] >= 200
    # rows of a non-square matrix: components of the bipartite row / column graph
    B = sp.csr_matrix(np.array([[1, 0, 0], [0, 0, 1], [0, 1, 1], [1, 0, 0]], dtype=np.float32))
    assert list(bs.component_windows(B, 1)) == [0, 1, 3, 4]
    assert list(bs.component_windows(sp.csr_matrix((0, 3)), 4)) == [0]


def test_limits():
    ip = np.array([0, 5, 5, 300, 310])
    w_row = np.array([0, 1, 2, 3, 4])
    smax, nmax, rmax = bs.limits(ip, w_row, np.array([3, 0, 900, 2]), 64, 4)
    assert smax <= bs.band_rows(64, 4) and nmax % 4 == 0 and 4 <= nmax <= bs.NMAX and rmax == 1
    assert bs.limits(np.array([0]), np.array([0]), np.array([], np.int32), 64, 4) == (1, 4, 1)


def test_no_nonzeros():
    A = sp.csr_matrix((5, 4))
    w_row = bs.fixed_windows(5, 2)
    lo, span = bs.windows(A, w_row)
    assert list(lo) == [0, 0, 0] and list(span) == [0, 0, 0]
    assert bs.staged_share(A.indptr, w_row, span, 1) == (0.0, 0.0)
    arr = bs.band_arrays(A)
    assert all(arr[f"{k}_span{W}"].sum() == 0 for k in bs.KINDS for W in bs.WINDOWS)


def test_shapes():
    for K, eb in ((64, 4), (128, 4), (256, 4), (64, 2), (128, 2), (256, 2)):
        words = K * eb // 16
        for s in bs.shapes(K, eb):
            assert s["G"] & (s["G"] - 1) == 0 and s["G"] <= 32 and s["G"] * s["CF"] >= words
            assert s["T"] % 32 == 0 and s["W"] in bs.WINDOWS and s["pipe"] in (0, 1) and s["win"] in bs.KINDS
            # the persistent kernel's second stage starts 16-byte aligned (nmax a multiple of 4)
            assert bs.stage_bytes(37, 12, s["W"], K, eb) % 16 == 0
        assert {s["pipe"] for s in bs.shapes(K, eb)} == {0, 1}
        assert bs.band_rows(K, eb) * K * eb <= bs.BAND_BYTES
    assert bs.band_rows(1 << 20, 4) == 1


@needs_nvcc
def test_band_stage_kernel_compiles(tmp_path):
    for arch, tb, G, CF, U, R, T in (("sm_90", 4, 16, 1, 2, 64, 128), ("sm_90", 2, 8, 1, 4, 900, 256),
                                     ("sm_90", 4, 32, 2, 4, 32, 256), ("sm_80", 4, 32, 1, 2, 64, 128)):
        nvcc_cubin(tmp_path, bs.SOURCE, {"BS_TB": tb, "BS_G": G, "BS_CF": CF, "BS_U": U, "BS_RMAX": R, "BS_T": T,
                                         "BS_SMAX": 100, "BS_NMAX": 300}, arch, ["-std=c++17"])
