"""Passes with super-linear cost: reorder.rcm on non-square and hub-heavy matrices and
cluster.lsh on many short rows, measured at three sizes (tracemalloc peak and time), must grow
about linearly; where a documented cap applies the pass is skipped with a reason."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.sparse.csgraph import reverse_cuthill_mckee

import spcompile
from spcompile.compile import make_op
from spcompile.core import reference
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule
from spcompile.passes import Pipeline
from spcompile.passes.reorder_simple import RCM_MAX_LEVELS, RCMSkipped, _rcm_vectorised

from conftest import inputs_for


def _hub(nnz: int, square: bool, seed: int = 0) -> sp.csr_matrix:
    """nnz/2 rows, every row holding column 0 (one dense column) plus random entries."""
    m = nnz // 2
    n = m if square else 500
    rng = np.random.default_rng(seed)
    rows = np.concatenate([np.arange(m), rng.integers(0, m, nnz - m)])
    cols = np.concatenate([np.zeros(m, dtype=np.int64), rng.integers(1, n, nnz - m)])
    A = sp.csr_matrix((np.ones(nnz, np.float32), (rows, cols)), shape=(m, n))
    A.sum_duplicates()
    return A


def _measure(A, pipeline):
    mod = SparseModule.from_op(make_op(A, "spmm", 4, "sum"))
    tracemalloc.start()
    t = time.perf_counter()
    out = Pipeline(pipeline)(mod)
    secs = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, peak, secs


def _near_linear(sizes, peaks, secs, what):
    """Doubling the input at most ~doubles memory (x2.6 allowed) and time (x3.5 allowed, plus
    noise on a shared machine); a quadratic step would give x4."""
    for i in range(1, len(sizes)):
        f = sizes[i] / sizes[i - 1]
        assert peaks[i] <= 1.3 * f * peaks[i - 1], (what, "memory", sizes, peaks)
        assert secs[i] <= 1.75 * f * secs[i - 1] + 0.3, (what, "time", sizes, secs)


@pytest.mark.parametrize("square", [False, True], ids=["non-square", "square"])
def test_rcm_scales_linearly_with_a_dense_column(square):
    sizes, peaks, secs = [], [], []
    for nnz in (100_000, 200_000, 400_000):
        A = _hub(nnz, square)
        out, peak, s = _measure(A, ["reorder.rcm"])
        met = out.log[-1].metrics
        assert met["skipped"] is False and met["graph"] == ("symmetric" if square else "bipartite")
        assert met["bandwidth_after"] < met["bandwidth_before"]
        sizes.append(A.nnz)
        peaks.append(peak)
        secs.append(s)
        # far below what A A^T (or scipy's quadratic insertion sort) would take
        assert peak < 200 * A.nnz + (8 << 20), (peak, A.nnz)
    _near_linear(sizes, peaks, secs, "reorder.rcm")


def test_rcm_non_square_result_is_exact():
    A = _hub(4_000, square=False)
    mod = spcompile.build(A, "spmm", K=6, reduce="max", target="cpu", pipeline=["reorder.rcm"])
    assert mod.pass_log[0]["metrics"]["graph"] == "bipartite"
    X = inputs_for("spmm", A.shape, 6)[0]
    np.testing.assert_allclose(mod(X), reference.run("spmm", "max", as_csr(A), X), rtol=1e-5, atol=1e-5)


def test_vectorised_rcm_is_a_cuthill_mckee_order():
    """A permutation, as good as scipy's on bandwidth (same algorithm, other tie-breaking), and
    exactly scipy's where no ties exist (a path)."""
    rng = np.random.default_rng(1)
    for t in range(20):
        n = int(rng.integers(1, 250))
        M = sp.random(n, n, density=float(rng.uniform(0.002, 0.05)), random_state=t, format="csr")
        S = ((M + M.T) != 0).astype(np.int8).tocsr()
        p = _rcm_vectorised(S)
        assert np.array_equal(np.sort(p), np.arange(n))

        def bandwidth(perm):
            inv = np.empty(n, dtype=np.int64)
            inv[perm] = np.arange(n)
            C = S.tocoo()
            return int(np.abs(inv[C.row] - inv[C.col]).max(initial=0))

        assert bandwidth(p) <= 1.25 * bandwidth(reverse_cuthill_mckee(S, symmetric_mode=True)) + 2
    path = sp.diags([np.ones(9), np.ones(9)], [-1, 1], shape=(10, 10), format="csr", dtype=np.int8)
    assert np.array_equal(_rcm_vectorised(path), reverse_cuthill_mckee(path, symmetric_mode=True))


def test_rcm_level_cap_skips_with_a_reason(monkeypatch):
    from spcompile.passes import reorder_simple

    path = sp.diags([np.ones(99), np.ones(99)], [-1, 1], shape=(100, 100), format="csr", dtype=np.int8)
    with pytest.raises(RCMSkipped, match="BFS levels"):
        _rcm_vectorised(path, max_levels=10)
    assert RCM_MAX_LEVELS >= 1000
    # a hub-heavy graph with a long path: the pass is skipped, with its reason, not run for minutes
    monkeypatch.setattr(reorder_simple, "SCIPY_RCM_MAX_WORK", 0)
    monkeypatch.setattr(reorder_simple, "RCM_MAX_LEVELS", 10)
    monkeypatch.setattr(reorder_simple, "_rcm_vectorised",
                        lambda P, max_levels=10: _rcm_vectorised(P, max_levels=max_levels))
    A = sp.csr_matrix(path, dtype=np.float32)
    out, _, _ = _measure(A, ["reorder.rcm"])
    met = out.log[-1].metrics
    assert met["skipped"] is True and "BFS levels" in met["skip_reason"]
    assert out.row_perm is None


def test_lsh_scales_linearly_on_many_short_rows():
    sizes, peaks, secs = [], [], []
    for n in (50_000, 100_000, 200_000):
        A = sp.identity(n, dtype=np.float32, format="csr")
        out, peak, s = _measure(A, [{"name": "cluster.lsh", "options": {"skip": False}}])
        assert out.log[-1].metrics["siglen"] == 128
        sizes.append(n)
        peaks.append(peak)
        secs.append(s)
    _near_linear(sizes, peaks, secs, "cluster.lsh")


def test_lsh_signature_cap_shortens_then_skips():
    A = sp.identity(100_000, dtype=np.float32, format="csr")
    out, peak, _ = _measure(A, [{"name": "cluster.lsh", "options": {"skip": False, "max_signature_bytes": 16 << 20}}])
    met = out.log[-1].metrics
    assert met["siglen"] == 40 and not met["skipped"]     # 16 MiB / (4 bytes x 100k rows), even
    out, peak, _ = _measure(A, [{"name": "cluster.lsh", "options": {"skip": False, "max_signature_bytes": 1 << 20}}])
    met = out.log[-1].metrics
    assert met["skipped"] and "max_signature_bytes" in met["skip_reason"] and out.row_perm is None
    assert peak < 64 << 20
