"""reorder.community: Leiden communities (igraph) as runs of consecutive rows, RCM inside each;
a permutation of rows and columns, deterministic, vectorised, lossless through spcompile.build."""
import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.core import reference
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule, SparseOp
from spcompile.passes import Pipeline
from spcompile.passes.reorder_community import community_order, leiden_membership


def planted(blocks=(40, 60, 50, 30), p_in=0.3, p_out=0.003, seed=0):
    """A symmetric graph of dense blocks with few edges between them, vertices shuffled; the
    block of each shuffled vertex."""
    rng = np.random.default_rng(seed)
    lab = np.repeat(np.arange(len(blocks)), blocks)
    n = lab.size
    P = np.where(lab[:, None] == lab[None, :], p_in, p_out)
    U = np.triu(rng.random((n, n)) < P, 1)
    S = U | U.T
    shuffle = rng.permutation(n)
    S = S[shuffle][:, shuffle]
    A = sp.csr_matrix(S.astype(np.float32) * rng.uniform(0.5, 2.0, (n, n)).astype(np.float32))
    A.eliminate_zeros()
    return A, lab[shuffle]


def _runs(labels):
    """Number of maximal runs of equal labels."""
    return int(1 + np.count_nonzero(labels[1:] != labels[:-1])) if labels.size else 0


def test_communities_become_runs_of_rows():
    A, truth = planted()
    mod = SparseModule.from_op(SparseOp("spmm", "sum", as_csr(A), 8))
    out = Pipeline([("reorder.community", {})])(mod)
    perm = out.row_perm
    assert np.array_equal(np.sort(perm), np.arange(A.shape[0])) and np.array_equal(out.col_perm, perm)
    # the planted blocks are found and each is one run of consecutive rows (shuffled: ~n runs)
    assert _runs(truth[perm]) == 4 and _runs(truth) > 100
    m = out.log[-1].metrics
    assert m["communities"] == 4 and not m["skipped"]
    assert m["bandwidth_after"] < m["bandwidth_before"]
    # the permuted matrix is A in the new order
    B = out.A
    dense = A.toarray()[perm][:, perm]
    got = sp.csr_matrix((B.data, B.indices, B.indptr), shape=B.shape).toarray()
    np.testing.assert_array_equal(got, dense)


def test_deterministic_and_leaves_global_rng():
    import random

    A, _ = planted(seed=3)
    S = sp.csr_matrix((A + A.T) != 0, dtype=np.int8)
    random.seed(123)
    before = random.random()
    random.seed(123)
    m1 = leiden_membership(S)
    after = random.random()
    assert before == after                     # igraph drew from its own seeded generator
    assert np.array_equal(m1, leiden_membership(S)) and np.array_equal(community_order(S, m1)[0],
                                                                      community_order(S, m1)[0])


def test_order_keeps_each_community_contiguous_and_rcm_inside():
    # two paths (communities given), vertices interleaved: each community is one run, and inside
    # it RCM walks the path (consecutive vertices adjacent)
    n = 20
    path = [(i, i + 2) for i in range(n - 2)]          # evens form one path, odds another
    r, c = np.array(path).T
    S = sp.csr_matrix((np.ones(r.size * 2, np.int8), (np.r_[r, c], np.r_[c, r])), shape=(n, n))
    member = np.arange(n) % 2
    order, _ = community_order(S, member)
    assert _runs(member[order]) == 2
    assert np.all(np.abs(np.diff(order[:n // 2])) == 2) and np.all(np.abs(np.diff(order[n // 2:])) == 2)


def test_non_square_is_left_alone():
    A = sp.random(30, 50, density=0.1, format="csr", random_state=0, dtype=np.float32)
    mod = SparseModule.from_op(SparseOp("spmm", "sum", as_csr(A), 4))
    out = Pipeline([("reorder.community", {})])(mod)
    assert out.row_perm is None or np.array_equal(out.row_perm, np.arange(30))
    metrics = out.log[-1].metrics
    assert metrics["skipped"] and metrics["skip_reason"] == "not square"


@pytest.mark.parametrize("K", [1, 7])
def test_lossless_through_build(K):
    A, _ = planted(seed=1)
    A = A.tolil()
    A[5, :] = 0                                        # an empty row
    A = A.tocsr()
    A.eliminate_zeros()
    X = np.random.default_rng(2).standard_normal((A.shape[1], K)).astype(np.float32)
    mod = spcompile.build(A, "spmm", K, target="cpu", pipeline=["reorder.community"])
    ref = reference.run("spmm", "sum", as_csr(A), X.astype(np.float64))
    np.testing.assert_allclose(mod(X), ref, rtol=1e-5, atol=1e-5)
