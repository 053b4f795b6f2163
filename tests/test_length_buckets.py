"""benchmarks/length_buckets.py's host side: the length buckets its prototype kernel reads (each
row's nonzeros found from its bucket alone, as the kernel finds them), the shapes it tries, and
its CUDA source compiled for sm_90 and sm_80 (the GPU part runs on the device)."""
import os
import sys

import numpy as np
import pytest
import scipy.sparse as sp

from conftest import needs_nvcc, nvcc_cubin

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import length_buckets as lb  # noqa: E402


def _emulate(arr, X):
    """Y as the kernel computes it: row i of the bucket order finds its bucket (the last one
    starting at or before i), starts at that bucket's first nonzero + (i - its first row) * L, sums
    its L products in order and writes output row rows[i]."""
    nrows = arr["rows"].size
    Y = np.full((nrows, X.shape[1]), np.nan)
    starts = arr["b_row"][:-1]
    for i in range(nrows):
        b = int(np.searchsorted(starts, i, side="right")) - 1
        L = int(arr["b_len"][b])
        p0 = int(arr["b_nnz"][b]) + (i - int(arr["b_row"][b])) * L
        cols, vals = arr["cols"][p0:p0 + L], arr["vals"][p0:p0 + L].astype(np.float64)
        Y[arr["rows"][i]] = vals @ X[cols] if L else 0.0
    return Y


def test_buckets_reproduce_the_product():
    rng = np.random.default_rng(7)
    m, n = 300, 170                                   # non-square
    lens = rng.integers(0, 9, m)
    lens[[3, 40, 41]] = 0                             # empty rows
    lens[17] = lb.LMAX                                # the longest row allowed
    rows = np.repeat(np.arange(m), lens)
    cols = np.concatenate([rng.choice(n, k, replace=False) for k in lens])
    A = sp.csr_matrix((rng.standard_normal(rows.size), (rows, cols)), shape=(m, n))
    arr = lb.bucket_rows(A)
    assert np.array_equal(np.sort(arr["rows"]), np.arange(m))       # every row once
    assert np.all(np.diff(arr["b_len"]) < 0)                        # one bucket a length, longest first
    counts = np.diff(arr["b_row"])
    assert arr["b_row"][-1] == m and int((counts * arr["b_len"]).sum()) == A.nnz
    assert np.array_equal(arr["b_nnz"], np.concatenate([[0], np.cumsum(counts * arr["b_len"])[:-1]]))
    X = rng.standard_normal((n, 5))
    np.testing.assert_allclose(_emulate(arr, X), A @ X, rtol=1e-6, atol=1e-6)


def test_rows_beyond_lmax_are_refused():
    A = sp.csr_matrix(np.ones((2, lb.LMAX + 1)))
    with pytest.raises(ValueError, match="at most"):
        lb.bucket_rows(A)


def test_shapes_cover_the_row():
    for K, eb in ((64, 4), (128, 4), (256, 4), (64, 2), (128, 2), (8, 2)):
        words = K * eb // 16
        for s in lb.shapes(K, eb):
            assert s["G"] & (s["G"] - 1) == 0 and s["G"] <= 32
            assert s["G"] * s["CF"] >= words
        assert lb.shapes(K, eb)                       # at least the whole-row shape


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_length_bucket_kernel_compiles(tmp_path, arch):
    for tb, g, cf, u, mb in ((4, 16, 1, 2, 8), (2, 4, 2, 4, 4), (4, 32, 2, 8, 1)):
        nvcc_cubin(tmp_path, lb.SOURCE, {"LB_LMAX": lb.LMAX, "LB_TB": tb, "LB_G": g, "LB_CF": cf, "LB_U": u, "LB_MB": mb},
                   arch)
