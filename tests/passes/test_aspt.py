"""tile.aspt: the paper's Fig. 3 / Fig. 4b tiling, format layout invariants, the numpy executor
(exact on integer data), remainder reordering, metrics and losslessness through spcompile.build."""
import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile import passes
from spcompile.core import numerics, reference  # noqa: F401
from spcompile.core.formats import as_csr
from spcompile.passes.tile_aspt import ASpTFormat, aspt_sddmm, aspt_spmm, build_aspt, dense_mask, dense_ratio

FIG1_ROWS = [[0, 4], [1, 2, 3], [4, 5], [2], [0, 3, 4], [1, 5]]  # see test_lsh.py for the reconstruction


def csr_from_rows(rows, n):
    r = np.repeat(np.arange(len(rows)), [len(x) for x in rows])
    c = np.concatenate(rows)
    return as_csr(sp.csr_matrix((np.arange(1.0, len(c) + 1), (r, c)), shape=(len(rows), n)))


def test_fig3_original_matrix():
    A = csr_from_rows(FIG1_ROWS, 6)
    f = build_aspt(A, panel_height=3, dense_threshold=2)
    assert f.n_panels == 2
    assert f.dense_ptr.tolist() == [0, 1, 1]  # panel 0: one dense column, panel 1: none
    assert f.dense_cols.tolist() == [4]
    assert f.tile_indptr.tolist() == [0, 1, 1, 2, 2, 2, 2]  # rows 0 and 2 hold column 4
    assert f.tile_slots.tolist() == [0, 0]
    assert f.tile_pos.tolist() == [1, 5]
    assert f.dense_nnz == 2 and f.dense_ratio == pytest.approx(2 / 13)
    assert f.rem_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert f.rem_indices.tolist() == [0, 1, 2, 3, 5, 2, 0, 3, 4, 1, 5]


def test_fig4b_reordered_matrix():
    A = csr_from_rows([FIG1_ROWS[i] for i in (0, 2, 4, 1, 3, 5)], 6)
    f = build_aspt(A, 3, 2)
    assert f.dense_ptr.tolist() == [0, 2, 4]
    assert f.dense_cols.tolist() == [0, 4, 1, 2]
    assert f.dense_nnz == 9
    # remainder: row 1 keeps column 5, row 2 column 3, row 3 column 3, row 5 column 5
    assert f.rem_rows.tolist() == [1, 2, 3, 5]
    assert f.rem_indices.tolist() == [5, 3, 3, 5]
    # slots point into the panel's dense column list
    rows = np.repeat(np.arange(6), np.diff(f.tile_indptr))
    cols = f.dense_cols[f.dense_ptr[rows // 3] + f.tile_slots]
    np.testing.assert_array_equal(cols, A.indices[f.tile_pos])


def random_int_matrix(seed, m=83, n=61, density=0.12):
    rng = np.random.default_rng(seed)
    S = sp.random(m, n, density=density, format="csr", random_state=seed)
    S.data = rng.integers(-4, 5, size=S.nnz).astype(np.float64)  # explicit zeros stay stored
    # a few heavy columns so that dense tiles exist
    S = sp.lil_matrix(S)
    S[rng.choice(m, m // 2, replace=False), 7] = 2.0
    S[rng.choice(m, m // 3, replace=False), 19] = -1.0
    S[5, :] = 0
    S = S.tocsr()
    S.eliminate_zeros()
    return as_csr(S)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ph,thr", [(4, 2), (8, 3), (32, 2), (1, 1), (16, 1000)])
def test_layout_invariants_and_exact_execution(seed, ph, thr):
    A = random_int_matrix(seed)
    f = build_aspt(A, ph, thr)
    m, n = A.shape
    # every entry exactly once, dense or remainder, values and positions consistent
    pos = np.sort(np.concatenate([f.tile_pos, f.rem_pos]))
    np.testing.assert_array_equal(pos, np.arange(A.nnz))
    np.testing.assert_array_equal(f.tile_data, A.data[f.tile_pos])
    np.testing.assert_array_equal(f.rem_data, A.data[f.rem_pos])
    np.testing.assert_array_equal(f.rem_indices, A.indices[f.rem_pos])
    mask = dense_mask(A, ph, thr)
    assert np.flatnonzero(mask).tolist() == f.tile_pos.tolist()
    assert f.dense_ratio == pytest.approx(dense_ratio(A, ph, thr))
    np.testing.assert_array_equal(f.row_lengths(), A.row_lengths)
    # dense columns have >= thr entries in their panel, remainder columns < thr
    D = A.to_scipy().toarray() != 0
    stored = np.zeros((m, n), dtype=bool)
    stored[np.repeat(np.arange(m), A.row_lengths), A.indices] = True
    for p in range(f.n_panels):
        cnt = stored[p * ph:(p + 1) * ph].sum(axis=0)
        assert f.dense_cols[f.dense_ptr[p]:f.dense_ptr[p + 1]].tolist() == np.flatnonzero(cnt >= thr).tolist()
    assert D.sum() <= A.nnz
    rng = np.random.default_rng(seed)
    X = rng.integers(-3, 4, size=(n, 5)).astype(np.float64)
    for red in ("sum", "max", "min", "mean"):
        np.testing.assert_array_equal(aspt_spmm(f, X, red), reference.spmm(A, X, red))
    Xs = rng.integers(-3, 4, size=(m, 5)).astype(np.float64)
    Ys = rng.integers(-3, 4, size=(n, 5)).astype(np.float64)
    np.testing.assert_array_equal(aspt_sddmm(f, Xs, Ys), reference.sddmm(A, Xs, Ys))


def test_threshold_extremes():
    A = random_int_matrix(1)
    assert build_aspt(A, 8, 1).dense_ratio == 1.0
    f = build_aspt(A, 8, 10 ** 6)
    assert f.dense_nnz == 0 and f.dense_cols.size == 0 and f.rem_data.shape[0] == A.nnz
    with pytest.raises(ValueError):
        build_aspt(A, 0, 2)


def test_reorder_remainder_keeps_results():
    A = random_int_matrix(2)
    f = build_aspt(A, 8, 2)
    perm = np.random.default_rng(0).permutation(f.rem_rows.shape[0])
    g = f.reorder_remainder(perm)
    np.testing.assert_array_equal(g.rem_rows, f.rem_rows[perm])
    np.testing.assert_array_equal(g.dense_cols, f.dense_cols)
    X = np.arange(A.shape[1] * 3, dtype=np.float64).reshape(-1, 3) % 5
    for red in ("sum", "max", "min", "mean"):
        np.testing.assert_array_equal(aspt_spmm(g, X, red), aspt_spmm(f, X, red))
    R = g.remainder_csr()
    assert R.shape == (g.rem_rows.shape[0], A.shape[1])
    with pytest.raises(ValueError):
        f.reorder_remainder(np.zeros(f.rem_rows.shape[0], dtype=int))


def test_empty_matrix():
    A = as_csr(sp.csr_matrix((5, 4)))
    f = build_aspt(A, 2, 2)
    assert f.nnz == 0 and f.dense_ratio == 0.0 and f.n_panels == 3
    np.testing.assert_array_equal(aspt_spmm(f, np.ones((4, 2))), np.zeros((5, 2)))


def test_pass_metrics_and_format():
    A = random_int_matrix(3)
    mod = passes.run("tile.aspt", A, panel_height=8, dense_threshold=2)
    f = mod.formats["aspt"]
    assert isinstance(f, ASpTFormat)
    met = mod.metrics["tile.aspt"]
    assert isinstance(met, dict) and met["dense_ratio"] == pytest.approx(f.dense_ratio) and met["seconds"] >= 0
    assert mod.row_perm is None and mod.col_perm is None
    for name, arr in f.arrays().items():
        assert isinstance(arr, np.ndarray), name


def test_aspt_rr_pipeline_improves_dense_ratio():
    """ASpT-RR vs ASpT-NR on scrambled row groups: dense ratio up (paper §5)."""
    rng = np.random.default_rng(0)
    rows, cols = [], []
    for g in range(150):
        base = rng.choice(3000, 12, replace=False)
        for r in range(8):
            rows += [g * 8 + r] * 12
            cols += base.tolist()
    S = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(1200, 3000))[rng.permutation(1200)]
    nr = passes.run("tile.aspt", S, panel_height=8).metrics["tile.aspt"]["dense_ratio"]
    from spcompile.core.ir import SparseModule, SparseOp
    from spcompile.passes import Pipeline

    mod = SparseModule.from_op(SparseOp("spmm", "sum", as_csr(S), 4))
    out = Pipeline([("cluster.lsh", {"panel_height": 8}), ("tile.aspt", {"panel_height": 8}), "cluster.lsh"])(mod)
    rr = out.metrics["tile.aspt"]["dense_ratio"]
    assert nr < 0.1 and rr > 0.9


@pytest.mark.parametrize("op,reduce", [("spmm", "sum"), ("spmm", "max"), ("sddmm", None)])
def test_lossless_through_build(op, reduce):
    A = random_int_matrix(4)
    S = A.to_scipy()
    mod = spcompile.build(S, op=op, K=4, reduce=reduce, target="cpu",
                          pipeline=[("cluster.lsh", {"skip": False}), "tile.aspt", ("cluster.lsh", {"skip": False})])
    rng = np.random.default_rng(0)
    if op == "spmm":
        X = rng.standard_normal((S.shape[1], 4)).astype(np.float32)
        np.testing.assert_allclose(mod(X), reference.spmm(A, X, reduce), rtol=1e-5, atol=1e-5)
    else:
        X = rng.standard_normal((S.shape[0], 4)).astype(np.float32)
        Y = rng.standard_normal((S.shape[1], 4)).astype(np.float32)
        np.testing.assert_allclose(mod(X, Y), reference.sddmm(A, X, Y), rtol=1e-5, atol=1e-5)
