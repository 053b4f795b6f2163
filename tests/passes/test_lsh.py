"""cluster.lsh: the paper's worked example (Fig. 1a / Fig. 6), Algorithm 3 details, skip rules,
metrics, ASpT-RR composition and losslessness through spcompile.build."""
import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile import passes
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule, SparseOp
from spcompile.passes import PassContext, Pipeline
from spcompile.passes.cluster_lsh import (cluster_rows, consecutive_similarity, jaccard_pairs, lsh_candidate_pairs,
                                          lsh_order, minhash_signatures)
from spcompile.passes.tile_aspt import aspt_spmm, dense_ratio
from spcompile.core import numerics, reference  # noqa: F401

# Fig. 1a of Jiang et al. (PPoPP'20), reconstructed from every fact the text states: 6 x 6, 13
# nonzeros, row 0 = {0, 4}, row 4 = {0, 3, 4}, rowptr[1] = 2 and rowptr[2] = 5, no two consecutive
# rows share a column, ASpT (panel 3, threshold 2) finds only column 4 of panel 0 dense (2 of 13
# entries), J(0,4) = 2/3, J(2,4) = 1/4, row 1 shares one column with row 5, and after reordering to
# [0, 2, 4, 1, 3, 5] the dense tiles hold 9 entries; the remainder pairs (1,4) and (2,5) are similar.
FIG1_ROWS = [[0, 4], [1, 2, 3], [4, 5], [2], [0, 3, 4], [1, 5]]


def fig1():
    r = np.repeat(np.arange(6), [len(x) for x in FIG1_ROWS])
    c = np.concatenate(FIG1_ROWS)
    return as_csr(sp.csr_matrix((np.arange(1.0, 14.0), (r, c)), shape=(6, 6)))


def test_fig1_reconstruction_matches_paper_facts():
    A = fig1()
    assert A.nnz == 13 and list(A.indptr[:3]) == [0, 2, 5]
    assert consecutive_similarity(A) == 0.0  # "no identical columns between two consecutive rows"
    assert dense_ratio(A, 3, 2) == pytest.approx(2 / 13)
    np.testing.assert_allclose(jaccard_pairs(A, [0, 2, 1], [4, 4, 5]), [2 / 3, 1 / 4, 1 / 4])


def test_paper_worked_example_fig6():
    """Candidate pairs (0,4) and (2,4) -> merge 4 into 0, re-queue (2,0), merge 2 -> [0,2,4,1,3,5]."""
    A = fig1()
    pi, pj = np.array([0, 2]), np.array([4, 4])
    requeued = []

    def sim(a, b):
        requeued.append((a, b))
        return float(jaccard_pairs(A, [a], [b])[0])

    order = cluster_rows(6, pi, pj, jaccard_pairs(A, pi, pj), 256, sim)
    assert order.tolist() == [0, 2, 4, 1, 3, 5]
    assert requeued == [(2, 0)]  # the paper's third step: pair (2, 0) put back in the queue
    B = as_csr(A.to_scipy()[order])
    assert dense_ratio(B, 3, 2) == pytest.approx(9 / 13)  # Fig. 4b: 9 of 13 in dense tiles


def test_fig1_full_pass_improves_dense_ratio_and_similarity():
    A = fig1()
    mod = passes.run("cluster.lsh", A, skip=False, panel_height=3, dense_threshold=2)
    m = mod.metrics["cluster.lsh"]
    assert isinstance(m, dict)
    for k in ("dense_ratio_before", "dense_ratio_after", "avg_similarity_before", "avg_similarity_after", "seconds"):
        assert k in m
    assert m["dense_ratio_before"] == pytest.approx(2 / 13)
    assert m["dense_ratio_after"] >= 9 / 13 - 1e-12
    assert m["avg_similarity_after"] > m["avg_similarity_before"]
    assert isinstance(mod.row_perm, np.ndarray) and mod.col_perm is None
    assert sorted(mod.row_perm.tolist()) == list(range(6))
    np.testing.assert_array_equal(mod.A.to_scipy().toarray(), A.to_scipy().toarray()[mod.row_perm])


def test_threshold_size_closes_clusters():
    # 12 identical rows, all pairs similar: clusters stop growing at threshold_size
    m = 12
    i, j = np.triu_indices(m, 1)
    order = cluster_rows(m, i, j, np.ones(i.shape[0]), threshold_size=4)
    assert sorted(order.tolist()) == list(range(m))
    # with a large threshold everything is one cluster (in index order)
    assert cluster_rows(m, i, j, np.ones(i.shape[0]), threshold_size=256).tolist() == list(range(m))


def sequential_algorithm3(m, pi, pj, sims, threshold_size, similarity):
    """Algorithm 3 as the paper states it, one heap pop at a time (the oracle of the rounds)."""
    import heapq

    heap = [(-s, k, i, j) for k, (i, j, s) in enumerate(zip(pi, pj, sims)) if s > 0]
    heapq.heapify(heap)
    cand = {(min(i, j), max(i, j)) for i, j in zip(pi, pj)}
    parent, size, closed, seq = list(range(m)), [1] * m, [False] * m, len(heap)

    def root(x):
        while parent[x] != x:
            x = parent[x]
        return x

    while heap:
        _, _, i, j = heapq.heappop(heap)
        if parent[i] == i and parent[j] == j:
            if i == j or closed[i] or closed[j]:
                continue
            keep, gone = (i, j) if (size[i] > size[j] or (size[i] == size[j] and i < j)) else (j, i)
            parent[gone] = keep
            size[keep] += size[gone]
            closed[keep] = size[keep] >= threshold_size
            continue
        i, j = root(i), root(j)
        if i == j or closed[i] or closed[j] or (min(i, j), max(i, j)) in cand:
            continue
        cand.add((min(i, j), max(i, j)))
        s = similarity(i, j)
        if s > 0:
            heapq.heappush(heap, (-s, seq, i, j))
            seq += 1
    return np.argsort([root(x) for x in range(m)], kind="stable")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [3, 8, 256])
def test_rounds_merge_as_the_heap_does(seed, threshold):
    """Distinct similarities, re-queued pairs scored 0: every round's merges are the heap's, so the
    rounds give Algorithm 3's clusters exactly (the oracle pops one pair at a time)."""
    rng = np.random.default_rng(seed)
    m = 300
    pi, pj = rng.integers(0, m, 900), rng.integers(0, m, 900)
    keep = pi != pj
    pi, pj = pi[keep], pj[keep]
    key = np.minimum(pi, pj) * m + np.maximum(pi, pj)
    _, first = np.unique(key, return_index=True)
    pi, pj = pi[first], pj[first]
    sims = rng.permutation(pi.shape[0]) / pi.shape[0] + 1e-3      # distinct, all > 0
    stats = {}
    got = cluster_rows(m, pi, pj, sims, threshold, lambda a, b: 0.0, stats=stats)
    want = sequential_algorithm3(m, pi.tolist(), pj.tolist(), sims.tolist(), threshold, lambda a, b: 0.0)
    assert got.tolist() == want.tolist()
    assert stats["pairs_left"] == 0 and 1 <= stats["rounds"] < pi.shape[0]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold", [4, 8, 256])
def test_rounds_cluster_as_well_as_the_heap(seed, threshold):
    """Re-queued pairs scored with exact Jaccard and many equal similarities: the rounds order
    equal similarities by a random priority, the heap by arrival, so the clusters may differ; the
    order they give is as good (consecutive-row similarity within 10 % of the heap's, both far
    above the scrambled input's)."""
    from spcompile.passes.cluster_lsh import _Similarity

    A, _ = scrambled_groups(groups=30, size=6, n=600, seed=seed)
    sig = minhash_signatures(A, 64, seed=0)
    pi, pj, _ = lsh_candidate_pairs(sig, bsize=2, window=4)
    sims = jaccard_pairs(A, pi, pj)
    sim = _Similarity(A, sig, True)
    got = cluster_rows(A.shape[0], pi, pj, sims, threshold, sim)
    want = sequential_algorithm3(A.shape[0], pi.tolist(), pj.tolist(), sims.tolist(), threshold, sim)
    assert sorted(got.tolist()) == list(range(A.shape[0]))
    q = lambda order: consecutive_similarity(as_csr(A.to_scipy()[order]))  # noqa: E731
    assert q(got) >= 0.9 * q(want) and q(want) > consecutive_similarity(A) + 0.2


def test_max_rounds_bounds_a_monotone_chain():
    """A chain of decreasing similarities merges one pair a round (each pair waits for the one
    before it): ``max_rounds`` stops there, the pairs left unmerged, the order still a permutation."""
    m = 400
    pi, pj = np.arange(m - 1), np.arange(1, m)
    sims = 1.0 - np.arange(m - 1) / m
    stats = {}
    order = cluster_rows(m, pi, pj, sims, 256, lambda a, b: 0.0, stats=stats)
    assert stats["rounds"] >= m // 2 - 1 and stats["pairs_left"] == 0
    assert order.tolist() == sequential_algorithm3(m, pi.tolist(), pj.tolist(), sims.tolist(), 256,
                                                   lambda a, b: 0.0).tolist()
    stats = {}
    order = cluster_rows(m, pi, pj, sims, 256, lambda a, b: 0.0, max_rounds=5, stats=stats)
    assert stats["rounds"] == 5 and stats["pairs_left"] > 0
    assert sorted(order.tolist()) == list(range(m))
    # the work bound: rounds stop once they looked at 10x the pairs
    stats = {}
    order = cluster_rows(m, pi, pj, sims, 256, lambda a, b: 0.0, max_work=10, stats=stats)
    assert 10 * (m - 1) <= stats["visits"] < 11 * (m - 1) and stats["pairs_left"] > 0
    assert sorted(order.tolist()) == list(range(m))


def test_zero_similarity_pairs_are_not_merged():
    assert cluster_rows(4, [0, 1], [2, 3], [0.0, 0.5]).tolist() == [0, 1, 3, 2]


def scrambled_groups(groups=100, size=8, n=4000, per_row=10, seed=0):
    """Groups of rows sharing (mostly) the same columns, rows scrambled: what LSH should undo."""
    rng = np.random.default_rng(seed)
    rows, cols = [], []
    for g in range(groups):
        base = rng.choice(n, per_row, replace=False)
        for r in range(size):
            cs = base.copy()
            cs[rng.integers(per_row)] = rng.integers(n)  # one column differs per row
            rows += [g * size + r] * per_row
            cols += cs.tolist()
    S = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(groups * size, n))
    S.data[:] = 1
    perm = rng.permutation(groups * size)
    return as_csr(S[perm]), perm


def test_recovers_clusters_dense_ratio_and_similarity_up():
    A, _ = scrambled_groups()
    mod = passes.run("cluster.lsh", A, panel_height=8)
    m = mod.metrics["cluster.lsh"]
    assert not m["skipped"] and m["reordered"]
    assert m["dense_ratio_before"] < 0.1
    assert m["dense_ratio_after"] > 0.6  # paper §5 direction: both criteria up
    assert m["avg_similarity_after"] > m["avg_similarity_before"] + 0.3


def test_minhash_estimates_jaccard():
    A, _ = scrambled_groups(groups=5, size=4)
    sig = minhash_signatures(A, 256, seed=1)
    i, j = np.triu_indices(A.shape[0], 1)
    est = (sig[i] == sig[j]).mean(axis=1)
    assert np.abs(est - jaccard_pairs(A, i, j)).max() < 0.15
    pi, pj, hits = lsh_candidate_pairs(sig, bsize=2)
    assert np.all(pi < pj) and hits.min() >= 1


def test_oph_signatures_estimate_jaccard_and_order():
    from spcompile.passes.cluster_lsh import oph_signatures

    A, _ = scrambled_groups(groups=5, size=4, per_row=40)
    sig = oph_signatures(A, 64, seed=2)
    assert not (sig == 0xFFFFFFFF).any()  # densified: no empty bins on non-empty rows
    i, j = np.triu_indices(A.shape[0], 1)
    est = (sig[i] == sig[j]).mean(axis=1)
    assert np.abs(est - jaccard_pairs(A, i, j)).mean() < 0.1
    B, _ = scrambled_groups(seed=9)
    order, info = lsh_order(B, signatures="oph")
    assert info["signatures"] == "oph" and sorted(order.tolist()) == list(range(B.shape[0]))
    assert consecutive_similarity(as_csr(B.to_scipy()[order])) > consecutive_similarity(B) + 0.3


def test_candidate_pairs_bounded_per_bucket():
    # 500 identical rows: one bucket per band; the window keeps pairs linear, not 500^2/2
    S = sp.csr_matrix(np.ones((500, 3)))
    sig = minhash_signatures(as_csr(S), 16)
    pi, pj, _ = lsh_candidate_pairs(sig, bsize=2, window=4)
    assert pi.shape[0] <= 500 * 4 * 8
    pi2, _, _ = lsh_candidate_pairs(sig, bsize=2, window=4, max_pairs=100)
    assert pi2.shape[0] == 100


def test_skip_round1_when_dense_ratio_high():
    A = as_csr(sp.diags([1.0, 1.0, 1.0], [-1, 0, 1], shape=(64, 64), format="csr"))
    mod = passes.run("cluster.lsh", A)
    m = mod.metrics["cluster.lsh"]
    assert m["skipped"] and m["dense_ratio_before"] > 0.1 and mod.row_perm is None
    assert m["dense_ratio_after"] == m["dense_ratio_before"]


def test_skip_round2_when_similarity_high():
    A = as_csr(sp.csr_matrix(np.ones((16, 4))))
    mod = passes.run("cluster.lsh", A, round=2)
    m = mod.metrics["cluster.lsh"]
    assert m["skipped"] and m["avg_similarity_before"] == 1.0 and mod.row_perm is None


def test_seed_reproducible_and_options_checked():
    A, _ = scrambled_groups(seed=3)
    with PassContext(seed=5):
        a = passes.run("cluster.lsh", A, skip=False).row_perm
        b = passes.run("cluster.lsh", A, skip=False).row_perm
    np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError):
        passes.run("cluster.lsh", A, bogus=1)
    with pytest.raises(ValueError):
        passes.run("cluster.lsh", A, round=3)
    order, info = lsh_order(A, similarity="minhash")
    assert sorted(order.tolist()) == list(range(A.shape[0])) and not info["exact_similarity"]


def test_aspt_rr_round2_reorders_remainder_only():
    A, _ = scrambled_groups(groups=30, size=6, seed=4)
    mod = SparseModule.from_op(SparseOp("spmm", "sum", A, 4))
    out = Pipeline([("cluster.lsh", {"panel_height": 8}), ("tile.aspt", {"panel_height": 8}),
                    ("cluster.lsh", {"skip": False})])(mod)
    r1, tile, r2 = (rec.metrics for rec in out.log)
    assert r1["round"] == 1 and r2["round"] == 2 and r2["target"] == "aspt_remainder"
    tiled = Pipeline([("cluster.lsh", {"panel_height": 8}), ("tile.aspt", {"panel_height": 8})])(mod)
    f0, f1 = tiled.formats["aspt"], out.formats["aspt"]
    np.testing.assert_array_equal(out.row_perm, tiled.row_perm)  # round 2 does not permute A
    np.testing.assert_array_equal(f0.dense_cols, f1.dense_cols)  # dense tiles untouched
    np.testing.assert_array_equal(np.sort(f0.rem_rows), np.sort(f1.rem_rows))
    assert r2["avg_similarity_after"] >= r2["avg_similarity_before"]
    X = np.random.default_rng(0).integers(-3, 4, size=(A.shape[1], 4)).astype(np.float64)
    for red in ("sum", "max", "min", "mean"):
        np.testing.assert_array_equal(aspt_spmm(f1, X, red), reference.spmm(out.A, X, red))


def test_round1_after_tile_retiles():
    A, _ = scrambled_groups(seed=6)
    mod = SparseModule.from_op(SparseOp("spmm", "sum", A, 4))
    out = Pipeline([("tile.aspt", {"panel_height": 8}), ("cluster.lsh", {"round": 1, "skip": False})])(mod)
    assert out.row_perm is not None and out.formats["aspt"].panel_height == 8
    X = np.ones((A.shape[1], 2))
    np.testing.assert_array_equal(aspt_spmm(out.formats["aspt"], X), reference.spmm(out.A, X))


def random_matrix(seed, m=70, n=50):
    rng = np.random.default_rng(seed)
    S = sp.random(m, n, density=0.08, format="csr", random_state=seed)
    S.data = rng.integers(-4, 5, size=S.nnz).astype(np.float64)  # explicit zeros included
    S[3] = 0  # an empty row
    S.eliminate_zeros()
    return S


@pytest.mark.parametrize("op,reduce", [("spmm", "sum"), ("spmm", "max"), ("spmm", "min"), ("spmm", "mean"),
                                       ("sddmm", None)])
def test_lossless_through_build(op, reduce):
    S = random_matrix(11)
    pipeline = [("cluster.lsh", {"skip": False, "threshold_size": 8})]
    mod = spcompile.build(S, op=op, K=8, reduce=reduce, target="cpu", pipeline=pipeline)
    assert mod is not None
    rng = np.random.default_rng(1)
    A = as_csr(S)
    if op == "spmm":
        X = rng.standard_normal((S.shape[1], 8)).astype(np.float32)
        out, ref = mod(X), reference.spmm(A, X, reduce)
    else:
        X = rng.standard_normal((S.shape[0], 8)).astype(np.float32)
        Y = rng.standard_normal((S.shape[1], 8)).astype(np.float32)
        out, ref = mod(X, Y), reference.sddmm(A, X, Y)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_pass_permutes_on_random_matrices():
    for seed in range(4):
        A = as_csr(random_matrix(seed))
        mod = passes.run("cluster.lsh", A, skip=False, threshold_size=8)
        p = mod.row_perm if mod.row_perm is not None else np.arange(A.shape[0])
        np.testing.assert_array_equal(mod.A.to_scipy().toarray(), A.to_scipy().toarray()[p])
        X = np.arange(A.shape[1] * 3, dtype=np.float64).reshape(-1, 3) % 7
        Y = reference.spmm(mod.A, X)
        back = np.empty_like(Y)
        back[p] = Y
        np.testing.assert_array_equal(back, reference.spmm(A, X))


@pytest.mark.parametrize("max_pairs", [None, 50])
def test_signatures_and_bands_on_threads_are_the_same(monkeypatch, max_pairs):
    """minhash_signatures and lsh_candidate_pairs on several threads give the same bits as on one
    (hash tables drawn in the same order; bands merged in band order, the early stop included)."""
    import spcompile.passes.cluster_lsh as L

    A, _ = scrambled_groups(groups=40, size=8, n=900, seed=3)
    monkeypatch.setattr(L, "_pass_threads", lambda work: 1)
    sig1 = minhash_signatures(A, 64, seed=2, chunk_nnz=1 << 8)
    pairs1 = lsh_candidate_pairs(sig1, bsize=2, window=4, max_pairs=max_pairs)
    monkeypatch.setattr(L, "_pass_threads", lambda work: 3)
    sig3 = minhash_signatures(A, 64, seed=2, chunk_nnz=1 << 8)
    pairs3 = lsh_candidate_pairs(sig3, bsize=2, window=4, max_pairs=max_pairs)
    assert np.array_equal(sig1, sig3)
    assert all(np.array_equal(a, b) for a, b in zip(pairs1, pairs3)) and pairs1[0].size > 0


def test_in_order_yields_in_order_and_stops_early():
    from spcompile.passes.cluster_lsh import _in_order

    started = []

    def slow(i):
        started.append(i)
        import time
        time.sleep(0.01 * (5 - i % 5))
        return i * i

    assert list(_in_order(slow, range(12), 3)) == [i * i for i in range(12)]
    started.clear()
    gen = _in_order(slow, range(100), 3)
    assert [next(gen) for _ in range(4)] == [0, 1, 4, 9]
    gen.close()
    assert len(started) <= 4 + 3          # at most `threads` items ahead of the consumer
