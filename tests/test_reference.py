"""The float64 references and the tuner's random inputs on several threads: the same bits as on
one thread (each row is summed in its stored order either way), every row covered once."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.autotune import measure
from spcompile.compile import make_op
from spcompile.core import reference
from spcompile.core.formats import as_csr


def matrix(m=700, n=500, seed=0):
    rng = np.random.default_rng(seed)
    A = sp.random(m, n, density=0.02, format="csr", random_state=seed, dtype=np.float64)
    A = A.tolil()
    A[3, :] = 0                                        # empty rows
    A[10:15, :] = 0
    A[7, :] = rng.standard_normal(n)                   # one full (very long) row
    return as_csr(A.tocsr().astype(np.float32))


@pytest.fixture
def threaded(monkeypatch):
    monkeypatch.setattr(reference, "PARALLEL_WORK", 1)
    monkeypatch.setattr(reference, "host_threads", lambda: 4)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("K", [1, 33])
def test_threaded_spmm_reference_is_bit_identical(threaded, reduce, K):
    A = matrix()
    X = np.random.default_rng(1).standard_normal((A.shape[1], K)).astype(np.float32)
    S = sp.csr_matrix((A.data.astype(np.float64), A.indices, A.indptr), shape=A.shape)
    want = np.asarray(S @ X.astype(np.float64))
    if reduce == "mean":
        want = want / np.maximum(A.row_lengths, 1)[:, None]
    got = reference.spmm(A, X, reduce)
    assert got.shape == (700, K) and np.array_equal(got, want)


@pytest.mark.parametrize("parts", [1, 3, 8, 64, 2000])
def test_row_blocks_cover_every_row_once(parts):
    A = matrix()
    blocks = reference.row_blocks(A.indptr, parts)
    assert blocks[0][0] == 0 and blocks[-1][1] == A.shape[0]
    assert all(b0[1] == b1[0] for b0, b1 in zip(blocks, blocks[1:])) and all(b > a for a, b in blocks)
    assert len(blocks) <= parts
    if parts == 8:   # balanced by nonzeros: no block holds more than its share plus the longest row
        per = [int(A.indptr[b] - A.indptr[a]) for a, b in blocks]
        assert max(per) <= A.nnz / 8 + A.row_lengths.max()


def test_row_blocks_of_an_empty_matrix():
    assert reference.row_blocks(np.zeros(6, dtype=np.int64), 4) == [(0, 5)]


def test_inputs_on_threads_are_the_same_and_fewer_sets_a_prefix(monkeypatch):
    op = make_op(matrix(), "spmm", 17)
    one = measure.make_inputs(op, 3, seed=5)
    monkeypatch.setattr(reference, "PARALLEL_WORK", 1)
    monkeypatch.setattr(reference, "host_threads", lambda: 3)
    many = measure.make_inputs(op, 3, seed=5)
    assert all(np.array_equal(a, b) for s, t in zip(one, many) for a, b in zip(s, t))
    assert np.array_equal(measure.make_inputs(op, 1, seed=5)[0][0], one[0][0])
    assert not np.array_equal(one[0][0], one[1][0])                  # independent sets
    assert not np.array_equal(measure.make_inputs(op, 1, seed=6)[0][0], one[0][0])
    assert one[0][0].dtype == np.float32 and one[0][0].shape == (500, 17)
