"""benchmarks/bulk_stream.py's host side: which rows each stream of its prototype kernel owns (every
row exactly once, runs of about nnz / streams nonzeros, empty rows before, between and after the
nonzeros), the shapes and block sizes it launches, and its CUDA source compiled for sm_90 (the
GPU part runs on the device; bulk copies are Hopper instructions)."""
import os
import sys

import numpy as np
import pytest
import scipy.sparse as sp

from conftest import needs_nvcc, nvcc_cubin

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bulk_stream as bs  # noqa: E402


def _emulate(A, X, streams):
    """Y as the kernel computes it: each stream sums its rows' nonzeros in order and writes each of
    its rows once (empty rows as zeros); a row written twice or never raises."""
    arr = bs.csr_arrays(A)
    srow = bs.stream_rows(arr["indptr"], streams)
    Y = np.full((A.shape[0], X.shape[1]), np.nan)
    for k in range(streams):
        for r in range(srow[k], srow[k + 1]):
            assert np.isnan(Y[r]).all(), f"row {r} written twice"
            lo, hi = arr["indptr"][r], arr["indptr"][r + 1]
            Y[r] = arr["data"][lo:hi].astype(np.float64) @ X[arr["indices"][lo:hi]] if hi > lo else 0.0
    assert not np.isnan(Y).any(), "a row no stream owns"
    return Y, srow, arr


@pytest.mark.parametrize("streams", [1, 7, 64, 5000])
def test_streams_own_every_row_once(streams):
    rng = np.random.default_rng(streams)
    m, n = 400, 230                                   # non-square
    lens = rng.integers(0, 6, m)
    lens[:5] = 0                                      # empty rows before the first nonzero
    lens[-9:] = 0                                     # and after the last
    lens[[50, 51, 200]] = 0
    lens[120] = 150                                   # a long row: its stream reads past its run
    rows = np.repeat(np.arange(m), lens)
    cols = np.concatenate([rng.choice(n, k, replace=False) for k in lens])
    A = sp.csr_matrix((rng.standard_normal(rows.size), (rows, cols)), shape=(m, n))
    X = rng.standard_normal((n, 3))
    Y, srow, arr = _emulate(A, X, streams)
    np.testing.assert_allclose(Y, A @ X, rtol=1e-6, atol=1e-6)
    assert srow[0] == 0 and srow[-1] == m and np.all(np.diff(srow) >= 0)
    E = -(-A.nnz // streams)
    owned = arr["indptr"][srow[1:]] - arr["indptr"][srow[:-1]]
    assert owned.max() <= E + 150                      # a run, plus the rest of a row started in it
    # the stream whose run holds the last nonzero owns the empty rows after it; later streams none
    last = (A.nnz - 1) // E
    assert srow[last] <= m - 9 and srow[last + 1] == m and np.all(srow[last + 1:] == m)


def test_no_nonzeros():
    A = sp.csr_matrix((5, 4))
    Y, srow, _ = _emulate(A, np.ones((4, 2)), 3)
    assert np.all(Y == 0) and list(srow) == [0, 5, 5, 5]


def test_shapes_fit_and_need_whole_words():
    for K, eb in ((64, 4), (128, 4), (256, 4), (64, 2), (128, 2), (256, 2)):
        G = bs.lanes(K, eb)
        assert G & (G - 1) == 0 and G <= 32 and G * -(-(K * eb // 16) // G) >= K * eb // 16
        for s in bs.shapes(K, eb):
            nw, smem = bs.block_shape(K, eb, s["S"], s["C"])
            assert 1 <= nw <= 4 and smem <= bs.SMEM_CAP and s["C"] <= G
            # the stages alone: warps x streams a warp x stages x rows a chunk x a row of X
            assert smem >= nw * (32 // G) * s["S"] * s["C"] * K * eb
        assert {s["C"] for s in bs.shapes(K, eb)} >= {min(2, G), min(4, G)}
    assert bs.shapes(33, 4) == [] and bs.shapes(60, 2) == []      # rows of X not whole 16-byte words
    assert bs.block_shape(1024, 4, 4, 64) is None


def test_one_wave():
    assert bs.resident_blocks(4, 16 * 1024, 40) == 12               # registers: 65536 / (40 x 128)
    assert bs.resident_blocks(4, 66 * 1024, 40) == 3                # shared memory
    assert bs.resident_blocks(1, 1024, 16) == 32                    # at most 32 blocks
    assert bs.resident_blocks(4, 200 * 1024, 255) == 1


@needs_nvcc
def test_bulk_stream_kernel_compiles(tmp_path):
    for tb, K, S, c, nw in ((4, 64, 2, 16, 4), (4, 256, 4, 32, 1), (2, 64, 4, 4, 4), (2, 128, 8, 8, 3), (4, 64, 2, 32, 2)):
        nvcc_cubin(tmp_path, bs.SOURCE, {"BS_TB": tb, "BS_K": K, "BS_S": S, "BS_C": c, "BS_NW": nw})
