"""benchmarks/band_stage.py's host side: each window's column band (smallest column and width, empty
windows and a short last window included), what share of the matrix the staged windows hold, the
shapes it launches, and its CUDA source compiled for sm_90 and sm_80 (the GPU part runs on the
device, where every result is checked against float64 before it is timed)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp

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
    lo, span = bs.windows(A, W)
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
    lo, span = bs.windows(A, 8)
    np.testing.assert_array_equal(lo, np.arange(20) * 8)
    np.testing.assert_array_equal(span, np.full(20, 8))
    share, rows = bs.staged_share(A.indptr, span, 8, 8)
    assert share == 1.0 and rows == 160
    share, rows = bs.staged_share(A.indptr, span, 8, 7)         # no band fits: nothing staged
    assert share == 0.0 and rows == 0


def test_no_nonzeros():
    A = sp.csr_matrix((5, 4))
    lo, span = bs.windows(A, 2)
    assert list(lo) == [0, 0, 0] and list(span) == [0, 0, 0]
    assert bs.staged_share(A.indptr, span, 2, 1) == (0.0, 0.0)
    arr = bs.band_arrays(A)
    assert all(arr[f"span{W}"].sum() == 0 for W in bs.WINDOWS)


def test_shapes():
    for K, eb in ((64, 4), (128, 4), (256, 4), (64, 2), (128, 2), (256, 2)):
        words = K * eb // 16
        for s in bs.shapes(K, eb):
            assert s["G"] & (s["G"] - 1) == 0 and s["G"] <= 32 and s["G"] * s["CF"] >= words
            assert s["T"] % 32 == 0 and s["W"] in bs.WINDOWS and s["pipe"] in (0, 1)
            # the persistent kernel's second stage starts 16-byte aligned (nmax a multiple of 4)
            assert bs.stage_bytes(37, 12, s["W"], K, eb) % 16 == 0
        assert {s["pipe"] for s in bs.shapes(K, eb)} == {0, 1}
        assert bs.band_rows(K, eb) * K * eb <= bs.BAND_BYTES
    assert bs.band_rows(1 << 20, 4) == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_band_stage_kernel_compiles(tmp_path):
    src = tmp_path / "bs.cu"
    src.write_text(bs.SOURCE)
    for arch, tb, G, CF, U, W, T in (("sm_90", 4, 16, 1, 2, 64, 128), ("sm_90", 2, 8, 1, 4, 128, 256),
                                     ("sm_90", 4, 32, 2, 4, 32, 256), ("sm_80", 4, 32, 1, 2, 64, 128)):
        subprocess.run(["nvcc", "-cubin", "-O3", f"-arch={arch}", "-std=c++17", f"-DBS_TB={tb}", f"-DBS_G={G}",
                        f"-DBS_CF={CF}", f"-DBS_U={U}", f"-DBS_W={W}", f"-DBS_T={T}", "-DBS_SMAX=100",
                        "-DBS_NMAX=300", str(src), "-o", str(tmp_path / "bs.cubin")], check=True)
