"""Tests of the reorder.vnm pass (SOGRE N:M / V:N:M sparsity-oriented graph reordering)."""
import os

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.core.formats import as_csr
from spcompile.passes import reorder_vnm as R
from spcompile.passes import run

from conftest import graphs_dir

GRAPHS = str(graphs_dir())  # $SPCOMPILE_GRAPHS, else shared/data/graphs beside the checkout


def dense_violations(D, N=2, M=4):
    """Reference count of N:M-violating segment vectors of a dense 0/1 matrix."""
    m, n = D.shape
    nseg = -(-n // M)
    P = np.zeros((m, nseg * M), dtype=bool)
    P[:, :n] = D != 0
    return int(np.count_nonzero(P.reshape(m, nseg, M).sum(axis=2) > N))


def dense_mbscore(D, V, N, M, k=4):
    m, n = D.shape
    nseg, nblk = -(-n // M), -(-m // V)
    P = np.zeros((nblk * V, nseg * M), dtype=bool)
    P[:m, :n] = D != 0
    T = P.reshape(nblk, V, nseg, M)
    horiz = (T.sum(axis=3) > N).any(axis=1)
    vert = T.any(axis=1).sum(axis=2) > k
    return int(np.count_nonzero(horiz | vert))


def rand_sym(n, density, seed):
    A = sp.random(n, n, density=density, random_state=seed, format="csr", dtype=np.float32)
    A = (A + A.T).tocsr()
    A.setdiag(0)
    A.eliminate_zeros()
    return A


# ---------------------------------------------------------------- paper's worked examples
def test_hamming_order_two_bits():
    # the Hamming-distance order of 2-bit strings is 00, 01, 11, 10 -> code(11) = 2
    codes = R.hamming_position_code([0b00, 0b01, 0b11, 0b10], 2)
    assert codes.tolist() == [0, 1, 2, 3]
    assert int(R.hamming_position_code([0b11], 2)[0]) == 2


@pytest.mark.parametrize("M", [2, 3, 4, 8, 16])
def test_hamming_order_is_gray_code(M):
    # sorting all M-bit strings by their code gives cumulative Hamming distance 2^M - 1 (minimal)
    x = np.arange(2 ** M, dtype=np.uint64)
    order = x[np.argsort(R.hamming_position_code(x, M))]
    assert np.unique(R.hamming_position_code(x, M)).size == 2 ** M
    d = np.bitwise_count(order[1:] ^ order[:-1])
    assert np.all(d == 1) and int(d.sum()) == 2 ** M - 1


def test_paper_example_minus_25():
    # Figure 3: a 2:8 segment vector with three non-zeros, 00010101, is encoded -25
    assert int(R.hamming_position_code([0b00010101], 8)[0]) == 25
    A = as_csr(sp.csr_matrix(([1.0, 1.0, 1.0, 1.0], ([0, 0, 0, 1], [3, 5, 7, 3])), shape=(2, 8)))
    rows, seg, code = R.stage1_codes(A, N=2, M=8)
    assert rows.tolist() == [0, 1] and seg.tolist() == [0, 0]
    assert code[0] == -25
    assert code[1] == int(R.hamming_position_code([0b00010000], 8)[0]) == 31


def test_figure1_style_swap_fixes_a_row():
    # vertex 0 links to 4, 5, 6: row 0 has 3 non-zeros in segment 1 (violates 2:4); renumbering
    # one of them into segment 0 fixes it and keeps the matrix symmetric
    r = [0, 0, 0, 4, 5, 6]
    c = [4, 5, 6, 0, 0, 0]
    A = sp.csr_matrix((np.ones(6, np.float32), (r, c)), shape=(8, 8))
    assert dense_violations(A.toarray()) == 1
    mod = run("reorder.vnm", A)
    m = mod.metrics["reorder.vnm"]
    assert m["violations_before"] == 1 and m["violations_after"] == 0
    assert m["improvement_rate"] == 1.0 and m["conforms"] and not m["conforms_before"]
    B = mod.A.to_scipy().toarray()
    assert dense_violations(B) == 0
    assert np.array_equal(B, B.T)
    assert np.array_equal(mod.row_perm, mod.col_perm)
    assert np.array_equal(B, A.toarray()[mod.row_perm][:, mod.col_perm])


def test_mbscore_hand_example():
    # rows use columns {0,1}, {2,3}, {4,5}, {6,7} of one 8-wide segment
    D = np.zeros((4, 8))
    for i in range(4):
        D[i, 2 * i:2 * i + 2] = 1
    A = as_csr(sp.csr_matrix(D))
    rows, seg, bits = R.segment_vectors(A.row_ids, A.indices, 8, 1)
    assert R.mbscore(rows, seg, bits, V=2, N=2, M=8, nseg=1) == 0   # 4 columns per 2x8 block
    assert R.mbscore(rows, seg, bits, V=4, N=2, M=8, nseg=1) == 1   # 8 columns > k = 4
    assert R.mbscore(rows, seg, bits, V=1, N=1, M=8, nseg=1) == 4   # every row has 2 > N = 1
    assert dense_mbscore(D, 4, 2, 8) == 1 and dense_mbscore(D, 2, 2, 8) == 0


# ---------------------------------------------------------------- building blocks vs brute force
def test_lexicographic_row_sort_matches_dense():
    rng = np.random.default_rng(0)
    for _ in range(30):
        m, nseg = int(rng.integers(1, 40)), int(rng.integers(1, 7))
        Dc = rng.integers(-3, 4, size=(m, nseg)) * (rng.random((m, nseg)) < 0.5)
        Dc[rng.integers(0, m, size=m // 3)] = Dc[0]  # duplicate rows
        rows, seg = np.nonzero(Dc)
        order = R._lex_row_order(m, rows.astype(np.int64), seg.astype(np.int64), Dc[rows, seg].astype(np.int64))
        ref = np.lexsort(Dc.T[::-1])
        assert np.array_equal(Dc[order], Dc[ref])
        assert np.array_equal(np.sort(order), np.arange(m))


def test_swap_gains_are_exact():
    rng = np.random.default_rng(1)
    for trial in range(40):
        n = int(rng.integers(8, 30))
        M = int(rng.choice([4, 8]))
        A = sp.random(n, n, density=rng.uniform(0.1, 0.5), random_state=trial, format="csr")
        A = as_csr((A + A.T).tocsr() if trial % 2 else A)
        st = R._State(A, 1, 2, M, 4, True)
        st.rperm = rng.permutation(n)
        st.cperm = st.rperm
        if st.nseg < 2:
            continue
        before = st.seg_pscore()
        perm0 = st.rperm.copy()
        best = 0
        for a in range(M):
            for c in range(M):
                u, v = a, (st.nseg - 1) * M + c
                if v >= n:
                    continue
                p = perm0.copy()
                p[u], p[v] = p[v], p[u]
                st.rperm = st.cperm = p
                best = max(best, int(before.sum() - st.seg_pscore().sum()))
        st.rperm = perm0.copy()
        st.cperm = st.rperm
        ps = before.copy()
        R._subround(st, np.array([0]), np.array([st.nseg - 1]), ps)
        after = st.seg_pscore()
        assert np.array_equal(after, ps)  # incremental per-segment PScore update is exact
        assert before.sum() - after.sum() == best  # the best pair was taken


def test_segment_vectors_and_format_match_dense():
    A = rand_sym(37, 0.2, 3)
    mod = run("reorder.vnm", A, V=2, M=8)
    f = mod.formats["vnm"]
    B = mod.A.to_scipy().toarray() != 0
    assert (f["V"], f["N"], f["M"], f["k"]) == (2, 2, 8, 4)
    assert f["nseg"] == 5 and f["nblk"] == 19 and tuple(f["shape"]) == (37, 37)
    P = np.zeros((37, 40), bool)
    P[:, :37] = B
    for r, s, mask, cnt, bad in zip(f["sv_row"], f["sv_seg"], f["sv_mask"], f["sv_nnz"], f["sv_violates"]):
        want = sum(1 << c for c in range(8) if P[r, s * 8 + c])
        assert int(mask) == want and cnt == bin(want).count("1") and bad == (cnt > 2)
    assert len(f["sv_row"]) == np.count_nonzero(P.reshape(37, 5, 8).any(axis=2))
    assert f["violations"] == dense_violations(B, 2, 8) == mod.metrics["reorder.vnm"]["violations_after"]
    assert f["mb_violating"].shape[0] == dense_mbscore(B, 2, 2, 8) == mod.metrics["reorder.vnm"]["mbscore_after"]
    assert f["conforms"] == (f["mb_violating"].shape[0] == 0)


# ---------------------------------------------------------------- pass behaviour and metrics
METRIC_KEYS = {"V", "N", "M", "k", "violations_before", "violations_after", "improvement_rate",
               "mbscore_before", "mbscore_after", "conforms", "conforms_before", "seconds",
               "iterations", "symmetric", "violations_lower_bound"}


@pytest.mark.parametrize("seed", range(6))
def test_random_symmetric_metrics_and_symmetry(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(20, 300))
    A = rand_sym(n, float(rng.uniform(0.01, 0.15)), seed)
    V, M = [(1, 4), (1, 8), (2, 8), (4, 16), (1, 4), (8, 8)][seed]
    mod = run("reorder.vnm", A, V=V, M=M, max_iter=5)
    m = mod.metrics["reorder.vnm"]
    assert METRIC_KEYS <= set(m)
    D0, D1 = A.toarray(), mod.A.to_scipy().toarray()
    assert m["violations_before"] == dense_violations(D0, 2, M)
    assert m["violations_after"] == dense_violations(D1, 2, M)
    assert m["mbscore_before"] == dense_mbscore(D0, V, 2, M)
    assert m["mbscore_after"] == dense_mbscore(D1, V, 2, M) <= m["mbscore_before"]
    assert m["violations_lower_bound"] <= m["violations_after"]
    if V == 1:
        assert m["violations_after"] <= m["violations_before"]
    assert m["conforms"] == (m["mbscore_after"] == 0)
    if mod.row_perm is not None:
        assert np.array_equal(mod.row_perm, mod.col_perm)
        assert np.array_equal(D1, D0[mod.row_perm][:, mod.row_perm])
    assert np.array_equal(D1, D1.T)  # symmetric stays symmetric
    assert np.isclose(D1.sum(), D0.sum())


def test_non_square_falls_back_to_column_permutation():
    A = sp.random(60, 45, density=0.2, random_state=5, format="csr", dtype=np.float32)
    mod = run("reorder.vnm", A)
    m = mod.metrics["reorder.vnm"]
    assert not m["symmetric"] and mod.row_perm is None  # V = 1: the row order does not matter
    assert mod.col_perm is not None and np.array_equal(np.sort(mod.col_perm), np.arange(45))
    assert m["violations_after"] < m["violations_before"]
    assert m["violations_after"] == dense_violations(mod.A.to_scipy().toarray())
    mod2 = run("reorder.vnm", A, V=4, M=8)
    assert mod2.metrics["reorder.vnm"]["mbscore_after"] <= mod2.metrics["reorder.vnm"]["mbscore_before"]


def test_trivial_inputs():
    for A in (sp.csr_matrix((0, 0), dtype=np.float32), sp.csr_matrix((5, 5), dtype=np.float32),
              sp.identity(3, format="csr", dtype=np.float32), sp.csr_matrix(np.ones((2, 7), np.float32))):
        mod = run("reorder.vnm", A)
        m = mod.metrics["reorder.vnm"]
        assert m["violations_after"] <= m["violations_before"]
        assert "vnm" in mod.formats


def test_bad_options():
    A = sp.identity(8, format="csr", dtype=np.float32)
    with pytest.raises(ValueError):
        run("reorder.vnm", A, N=4, M=4)
    with pytest.raises(ValueError):
        run("reorder.vnm", A, V=0)
    with pytest.raises(TypeError):
        run("reorder.vnm", A, bogus=1)


def test_already_conforming_is_unchanged():
    A = sp.identity(16, format="csr", dtype=np.float32)
    mod = run("reorder.vnm", A)
    assert mod.row_perm is None and mod.col_perm is None
    assert mod.metrics["reorder.vnm"]["conforms_before"] and mod.metrics["reorder.vnm"]["improvement_rate"] == 1.0


def test_best_vnm_identity():
    # the identity conforms to 1:2:M for every M; with M = 32 > k a V x 32 meta-block of it uses
    # V distinct columns, so V = 4 is the largest conforming V
    A = sp.identity(128, format="csr", dtype=np.float32)
    res = R.best_vnm(A)
    assert (res["V"], res["N"], res["M"]) == (4, 2, 32) and res["pattern"] == "4:2:32"
    assert [t["pattern"] for t in res["tried"]] == ["1:2:4", "1:2:8", "1:2:16", "1:2:32", "2:2:32",
                                                    "4:2:32", "8:2:32"]
    mod = run("reorder.vnm", A, search_best=True)
    m = mod.metrics["reorder.vnm"]
    assert m["best_vnm"]["pattern"] == "4:2:32" and (m["V"], m["M"]) == (4, 32) and m["conforms"]
    assert mod.formats["vnm"]["M"] == 32 and mod.formats["vnm"]["V"] == 4


def test_best_vnm_none_when_impossible():
    A = sp.csr_matrix(np.ones((8, 8), np.float32))  # every row has 8 > 2 * 2 entries
    res = R.best_vnm(A)
    assert res["pattern"] is None and not res["conforms"] and res["tried"][0]["pattern"] == "1:2:4"


# ---------------------------------------------------------------- lossless through build()
@pytest.mark.parametrize("kind", ["symmetric", "directed", "rect"])
def test_compiled_module_is_lossless(kind):
    import spcompile

    rng = np.random.default_rng({"symmetric": 0, "directed": 1, "rect": 2}[kind])
    if kind == "symmetric":
        A = rand_sym(90, 0.08, 7)
    elif kind == "directed":
        A = sp.random(70, 70, density=0.1, random_state=8, format="csr", dtype=np.float32)
    else:
        A = sp.random(50, 83, density=0.1, random_state=9, format="csr", dtype=np.float32)
    A.data = rng.standard_normal(A.nnz).astype(np.float32)
    K = 8
    mod = spcompile.build(A, op="spmm", K=K, target="cpu", pipeline=[("reorder.vnm", {"V": 2, "M": 8})])
    X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
    np.testing.assert_allclose(mod(X), A @ X, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- real graphs (when available)
@pytest.mark.skipif(not os.path.exists(f"{GRAPHS}/cora.npz"), reason="shared graphs not available")
def test_cora_reaches_2_4():
    A = sp.load_npz(f"{GRAPHS}/cora.npz")
    m = run("reorder.vnm", A).metrics["reorder.vnm"]
    assert m["violations_before"] > 0 and m["violations_after"] == 0 and m["conforms"]
