"""benchmarks/hot_cache.py's host side: the segments (degree order, at most SEG nonzeros, empty rows
written, split rows' partial slots), the staged columns and the ids the kernel reads, what its
arrays compute against A @ X in float64, the matrix without the staged columns (``--bound``), the
shapes, and its CUDA source compiled for sm_90 and sm_80 (the GPU part runs on the device, where
every result is checked against float64 on NaN-poisoned outputs before it is timed)."""
import os
import sys

import numpy as np
import pytest
import scipy.sparse as sp

from conftest import needs_nvcc, nvcc_cubin

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import hot_cache as hc  # noqa: E402


def _matrix(seed=0, m=90, n=70):
    """Non-square, with empty rows, a row of every column, a hub column and rows of 1-3 entries."""
    rng = np.random.default_rng(seed)
    A = sp.random(m, n, density=0.04, random_state=seed, format="lil")
    A[5, :] = rng.standard_normal(n)            # a long row: cut into several segments
    A[:, 3] = rng.standard_normal((m, 1))       # a column used by every row
    A[10, :] = 0                                # empty rows
    A[m - 1, :] = 0
    A = A.tocsr()
    A.eliminate_zeros()
    return A


@pytest.mark.parametrize("seg", [1, 4, 16, 64])
def test_segments(seg):
    A = _matrix(seg)
    arr = hc.segments(A, seg=seg)
    lens = np.diff(A.indptr)
    ptr, rows = arr["seg_ptr"], arr["seg_row"]
    assert ptr[0] == 0 and ptr[-1] == A.nnz and np.all(np.diff(ptr) >= 0)
    assert np.diff(ptr).max() <= seg
    # every row once or more, in degree order (long rows first, ties in row order)
    first = np.r_[True, rows[1:] != rows[:-1]]
    order = rows[first]
    assert sorted(order.tolist()) == list(range(A.shape[0]))
    assert np.array_equal(order, np.argsort(-lens, kind="stable"))
    # each row's segments hold exactly its nonzeros, ids and values, in column order
    for r in (5, 10, A.shape[0] - 1, int(order[-1])):
        s = np.flatnonzero(rows == r)
        got = np.concatenate([arr["cols"][ptr[i]:ptr[i + 1]] for i in s])
        assert np.array_equal(got, A.indices[A.indptr[r]:A.indptr[r + 1]])
        assert s.size == max(1, -(-lens[r] // seg))
    # split rows: slots consecutive from sp_first, one per segment, -1 for whole rows
    split = arr["seg_sp"] >= 0
    assert np.array_equal(split, np.isin(rows, np.flatnonzero(lens > seg)))
    assert np.all(arr["seg_slot"][~split] == -1)
    slots = np.sort(arr["seg_slot"][split])
    assert np.array_equal(slots, np.arange(int(arr["sp_n"].sum())))
    for r in range(arr["sp_n"].size):
        s = np.flatnonzero(arr["seg_sp"] == r)
        assert np.array_equal(arr["seg_slot"][s], arr["sp_first"][r] + np.arange(arr["sp_n"][r]))


def test_hot_columns_and_ids():
    A = _matrix(3)
    arr = hc.segments(A)
    cnt = np.bincount(A.indices, minlength=A.shape[1])
    for h_max, blocks in ((0, 1), (5, 1), (40, 2), (70, 4), (70, 10**6)):
        hot = hc.hot_columns(arr["cols"], arr["n"], h_max, blocks)
        assert hot.size <= h_max and np.unique(hot).size == hot.size
        assert np.all(cnt[hot] >= blocks)
        # the most used: nothing left out is used more than anything staged
        rest = np.setdiff1d(np.flatnonzero(cnt >= blocks), hot)
        if hot.size and rest.size:
            assert cnt[rest].max() <= cnt[hot].min()
            assert hot.size == h_max
        ids = hc.remap(arr["cols"], hot, arr["n"])
        neg = ids < 0
        assert np.array_equal(neg, np.isin(arr["cols"], hot))
        assert np.all(ids[neg] >= -hot.size)
        assert np.array_equal(hot[ids[neg] + hot.size], arr["cols"][neg])
        assert np.array_equal(ids[~neg], arr["cols"][~neg])
    assert hc.hot_columns(arr["cols"], arr["n"], 3, 1).tolist() == np.argsort(-cnt, kind="stable")[:3].tolist()


@pytest.mark.parametrize("K", [1, 7, 64])
def test_arrays_compute_the_product(K):
    A = _matrix(K)
    rng = np.random.default_rng(K)
    X = rng.standard_normal((A.shape[1], K))
    ref = A.astype(np.float32).astype(np.float64) @ X      # the kernel's values are float32
    arr = hc.segments(A, seg=8)
    for h in (0, 1, 12, A.shape[1]):
        hot = hc.hot_columns(arr["cols"], arr["n"], h, 1)
        Y = hc.emulate(arr, hot, X)
        assert Y.shape == ref.shape and not np.isnan(Y).any()
        np.testing.assert_allclose(Y, ref, rtol=1e-12, atol=1e-12)


def test_without_columns():
    A = _matrix(5)
    hot = np.array([3, 0, 17])
    B = hc.without_columns(A, hot)
    assert B.shape == A.shape and A.nnz > B.nnz
    keep = np.ones(A.shape[1])
    keep[hot] = 0
    np.testing.assert_array_equal(B.toarray(), A.toarray() * keep)
    assert not np.isin(B.indices, hot).any()


def test_no_nonzeros():
    A = sp.csr_matrix((6, 4), dtype=np.float32)
    arr = hc.segments(A)
    assert arr["seg_row"].size == 6 and arr["seg_ptr"].tolist() == [0] * 7 and arr["sp_n"].size == 0
    hot = hc.hot_columns(arr["cols"], arr["n"], 10, 1)
    assert hot.size == 0
    assert np.array_equal(hc.emulate(arr, hot, np.ones((4, 3))), np.zeros((6, 3)))


def test_shapes():
    for K, eb in ((64, 4), (128, 4), (256, 4), (64, 2), (128, 2), (8, 2)):
        for s in hc.shapes(K, eb):
            words = K * eb // 16
            assert s["G"] * s["CF"] >= words and s["G"] <= 32 and s["G"] & (s["G"] - 1) == 0
        assert {(s["T"], s["hot"]) for s in hc.shapes(K, eb)} == {(512, 0), (512, 1), (1024, 0), (1024, 1)}
    assert hc.shapes(12, 4) == []      # rows of X not a whole number of 16-byte words


@needs_nvcc
def test_hot_cache_kernel_compiles(tmp_path):
    for arch, tb, G, CF, U, T, MB in (("sm_90", 4, 16, 1, 4, 512, 2), ("sm_90", 2, 8, 1, 8, 1024, 1),
                                      ("sm_90", 4, 32, 2, 4, 512, 2), ("sm_80", 4, 32, 1, 8, 1024, 1)):
        nvcc_cubin(tmp_path, hc.SOURCE, {"HC_TB": tb, "HC_G": G, "HC_CF": CF, "HC_U": U, "HC_T": T, "HC_MB": MB},
                   arch, ["-std=c++17"])
