"""tile.sgt: TC-GNN sparse graph translation (hand-checked cases, a loop reference of Algorithm 1,
losslessness through the numpy executors and through build())."""
import os

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.passes import get_pass, list_passes, run
from spcompile.passes.tile_sgt import SGTFormat, sgt_translate

GRAPHS = os.environ.get("SPCOMPILE_GRAPHS", os.path.join(os.path.dirname(__file__), "..", "..", "..",
                                                         "shared", "data", "graphs"))


def _csr(rows, cols, shape, vals=None):
    vals = np.arange(1, len(rows) + 1, dtype=np.float32) if vals is None else vals
    return sp.csr_matrix((vals, (rows, cols)), shape=shape)


def _random(m, n, density, seed, int_values=True):
    rng = np.random.default_rng(seed)
    A = sp.random(m, n, density=density, format="csr", random_state=rng, dtype=np.float64)
    if int_values:
        A.data = rng.integers(-4, 5, size=A.nnz).astype(np.float64)
    return A.astype(np.float32)


def _loop_sgt(A, BLK_H, BLK_W):
    """Algorithm 1 of the paper written as loops (the reference the vectorised pass must match)."""
    A = sp.csr_matrix(A)
    A.sort_indices()
    m, n = A.shape
    nwin = -(-m // BLK_H)
    win_partition, edge_to_col, col_map, before = [], np.zeros(A.nnz, np.int64), [], 0
    for w in range(nwin):
        s, e = A.indptr[w * BLK_H], A.indptr[min((w + 1) * BLK_H, m)]
        clean = sorted(set(A.indices[s:e].tolist()))          # Sort + Deduplication
        win_partition.append(-(-len(clean) // BLK_W))
        pos = {c: i for i, c in enumerate(clean)}
        for p in range(s, e):
            edge_to_col[p] = pos[A.indices[p]]
        col_map.extend(clean)
        before += len({c // BLK_W for c in clean})
    return np.array(win_partition, np.int64), edge_to_col, np.array(col_map, np.int64), before


# ---------------------------------------------------------------- hand-checked example

def test_hand_checked_2x2():
    #       col: 0 1 2 3 4 5 6 7
    # row 0:     x . . . . x . .     window 0 = rows 0,1: unique cols [0, 5, 7] -> 2 blocks
    # row 1:     . . . . . x . x
    # row 2:     . . . x . . . .     window 1 = rows 2,3: unique cols [1, 3, 6] -> 2 blocks
    # row 3:     . x . x . . x .
    A = _csr([0, 0, 1, 1, 2, 3, 3, 3], [0, 5, 5, 7, 3, 1, 3, 6], (4, 8))
    mod = run("tile.sgt", A, BLK_H=2, BLK_W=2)
    f = mod.formats["sgt"]
    assert isinstance(f, SGTFormat) and (f.BLK_H, f.BLK_W, f.shape) == (2, 2, (4, 8))
    assert f.win_partition.tolist() == [2, 2]
    assert f.win_block_ptr.tolist() == [0, 2, 4]
    assert f.win_col_ptr.tolist() == [0, 3, 6]
    assert f.col_map.tolist() == [0, 5, 7, 1, 3, 6]
    assert f.edge_to_col.tolist() == [0, 1, 1, 2, 1, 0, 1, 2]
    assert f.block_id.tolist() == [0, 0, 0, 1, 2, 2, 2, 3]
    assert f.block_row.tolist() == [0, 0, 1, 1, 0, 1, 1, 1]
    assert f.block_col.tolist() == [0, 1, 1, 0, 1, 0, 1, 0]
    assert f.block_cols.tolist() == [[0, 5], [7, -1], [1, 3], [6, -1]]
    assert f.block_window.tolist() == [0, 0, 1, 1]
    assert f.block_nnz_ptr.tolist() == [0, 3, 4, 7, 8]
    # block 0 holds (r0,c0), (r0,c5), (r1,c5): grouped by column then row
    assert f.block_nnz_order[:3].tolist() == [0, 1, 2]
    tiles = f.dense_tiles(mod.A.data)
    assert tiles[0].tolist() == [[1, 2], [0, 3]]
    assert tiles[3].tolist() == [[0, 0], [8, 0]]
    m = mod.metrics["tile.sgt"]
    # without SGT: window 0 touches column groups {0, 2, 3}, window 1 {0, 1, 3} -> 6 blocks
    assert (m["blocks_before"], m["blocks_after"]) == (6, 4)
    assert m["reduction"] == pytest.approx(1 / 3)
    assert m["density_before"] == pytest.approx(8 / 24) and m["density_after"] == pytest.approx(8 / 16)
    assert isinstance(m["seconds"], float)
    # lossless, and no permutation
    assert mod.row_perm is None and mod.col_perm is None and mod.nnz_perm is None
    X = np.arange(16, dtype=np.float64).reshape(8, 2)
    np.testing.assert_array_equal(f.spmm(mod.A.data, X), A.toarray() @ X)


def test_figure4_like_density_doubles():
    # The paper's Fig. 4 idea (its numbers are only in the figure): a 16-row window whose
    # neighbours are scattered over 8 column blocks condenses into one 16x8 TC block.
    rows = np.repeat(np.arange(16), 2)
    cols = np.tile([0, 8, 16, 24, 32, 40, 48, 56], 4)
    A = _csr(rows, cols, (16, 64), np.ones(32, np.float32))
    m = run("tile.sgt", A).metrics["tile.sgt"]
    assert (m["blocks_before"], m["blocks_after"]) == (8, 1)
    assert m["density_after"] == pytest.approx(8 * m["density_before"])


def test_partial_and_empty_windows():
    # 37 rows: windows of 16, 16, 5 rows; the middle window is empty
    A = _csr([0, 3, 15, 32, 36, 36], [2, 2, 9, 0, 40, 1], (37, 41))
    mod = run("tile.sgt", A)
    f = mod.formats["sgt"]
    assert f.num_windows == 3
    assert f.win_partition.tolist() == [1, 0, 1]
    assert f.win_block_ptr.tolist() == [0, 1, 1, 2]
    assert f.block_window.tolist() == [0, 2]
    assert f.block_cols.tolist() == [[2, 9, -1, -1, -1, -1, -1, -1], [0, 1, 40, -1, -1, -1, -1, -1]]
    assert f.block_row.tolist() == [0, 3, 15, 0, 4, 4]
    assert mod.metrics["tile.sgt"]["blocks_before"] == 2 + 2   # groups {0, 1} and {0, 5}
    X = np.random.default_rng(0).integers(-3, 4, size=(41, 3)).astype(np.float64)
    np.testing.assert_array_equal(f.spmm(mod.A.data, X), A.toarray() @ X)


def test_empty_matrix_and_explicit_zeros():
    A = sp.csr_matrix((5, 7), dtype=np.float32)
    mod = run("tile.sgt", A)
    f, m = mod.formats["sgt"], mod.metrics["tile.sgt"]
    assert f.num_blocks == 0 and f.win_partition.tolist() == [0] and f.nnz == 0
    assert (m["blocks_before"], m["blocks_after"], m["reduction"]) == (0, 0, 0.0)
    np.testing.assert_array_equal(f.spmm(np.zeros(0, np.float32), np.ones((7, 2))), np.zeros((5, 2)))
    # a stored zero is an entry: it occupies a slot
    Z = sp.csr_matrix((np.array([0.0, 1.0], np.float32), np.array([3, 6]), np.array([0, 2, 2])), shape=(2, 7))
    f = run("tile.sgt", Z).formats["sgt"]
    assert f.col_map.tolist() == [3, 6] and f.edge_to_col.tolist() == [0, 1]


# ---------------------------------------------------------------- options

def test_shape_presets_and_overrides():
    A = _random(40, 50, 0.1, 1)
    assert (lambda f: (f.BLK_H, f.BLK_W))(run("tile.sgt", A).formats["sgt"]) == (16, 8)
    assert (lambda f: (f.BLK_H, f.BLK_W))(run("tile.sgt", A, op="sddmm").formats["sgt"]) == (16, 16)
    assert (lambda f: (f.BLK_H, f.BLK_W))(run("tile.sgt", A, shape="fp16").formats["sgt"]) == (16, 16)
    assert (lambda f: (f.BLK_H, f.BLK_W))(run("tile.sgt", A, shape="tf32", BLK_W=4).formats["sgt"]) == (16, 4)
    f = run("tile.sgt", A, BLK_H=1, BLK_W=4).formats["sgt"]  # the paper's CPU/AVX setting
    assert (f.BLK_H, f.BLK_W) == (1, 4) and f.num_windows == 40
    with pytest.raises(ValueError, match="shape"):
        run("tile.sgt", A, shape="int4")
    with pytest.raises(ValueError, match="BLK_W"):
        run("tile.sgt", A, BLK_W=0)
    with pytest.raises(TypeError, match="unknown option"):
        get_pass("tile.sgt", blk_h=16)


def test_registered_with_info():
    info = list_passes()["tile.sgt"]
    assert info.produces == ("sgt",)
    assert set(info.options) == {"shape", "BLK_H", "BLK_W"}


# ---------------------------------------------------------------- properties

CASES = [(1, 1, 1.0, 16, 8), (17, 5, 0.5, 16, 8), (64, 64, 0.05, 16, 8), (100, 300, 0.02, 16, 16),
         (250, 90, 0.1, 8, 4), (33, 33, 0.3, 1, 4), (48, 1000, 0.003, 16, 8), (129, 77, 0.2, 3, 5)]


@pytest.mark.parametrize("m,n,density,H,W", CASES)
def test_matches_loop_reference_and_invariants(m, n, density, H, W):
    A = _random(m, n, density, seed=m * 1000 + n)
    mod = run("tile.sgt", A, BLK_H=H, BLK_W=W)
    f, met = mod.formats["sgt"], mod.metrics["tile.sgt"]
    wp, e2c, cmap, before = _loop_sgt(A, H, W)
    np.testing.assert_array_equal(f.win_partition, wp)
    np.testing.assert_array_equal(f.edge_to_col, e2c)
    np.testing.assert_array_equal(f.col_map, cmap)
    assert met["blocks_before"] == before and met["blocks_after"] == wp.sum() <= before
    C = mod.A
    rows = np.repeat(np.arange(m), np.diff(C.indptr))
    win = rows // H
    # every nonzero finds its column through both maps, and sits in a block of its window
    np.testing.assert_array_equal(f.col_map[f.win_col_ptr[win] + f.edge_to_col], C.indices)
    np.testing.assert_array_equal(f.block_cols[f.block_id, f.block_col], C.indices)
    np.testing.assert_array_equal(f.block_window[f.block_id], win)
    np.testing.assert_array_equal(f.block_row, rows % H)
    # (block, row, col) positions are distinct: the scatter into dense tiles loses nothing
    pos = (f.block_id.astype(np.int64) * H + f.block_row) * W + f.block_col
    assert np.unique(pos).size == C.nnz
    # block grouping
    np.testing.assert_array_equal(np.diff(f.block_nnz_ptr), np.bincount(f.block_id, minlength=f.num_blocks))
    np.testing.assert_array_equal(np.sort(f.block_nnz_order), np.arange(C.nnz))
    grouped = f.block_id[f.block_nnz_order]
    assert np.all(np.diff(grouped) >= 0)
    # every block but a window's last one is full
    full = (f.block_cols >= 0).sum(axis=1)
    last = np.zeros(f.num_blocks, bool)
    last[f.win_block_ptr[1:][f.win_partition > 0] - 1] = True
    assert np.all(full[~last] == W) and np.all(full >= 1)
    for a in f.arrays().values():
        assert not a.flags.writeable


@pytest.mark.parametrize("m,n,density,H,W", CASES)
def test_executors_reproduce_exactly(m, n, density, H, W):
    A = _random(m, n, density, seed=7 + m + n)
    rng = np.random.default_rng(m)
    mod = run("tile.sgt", A, BLK_H=H, BLK_W=W)
    f, C = mod.formats["sgt"], mod.A
    X = rng.integers(-8, 9, size=(n, 6)).astype(np.float64)   # integers: every sum is exact
    np.testing.assert_array_equal(f.spmm(C.data.astype(np.float64), X), C.to_scipy().toarray() @ X)
    Xs = rng.integers(-8, 9, size=(m, 5)).astype(np.float64)
    Ys = rng.integers(-8, 9, size=(n, 5)).astype(np.float64)
    rows = np.repeat(np.arange(m), np.diff(C.indptr))
    expect = C.data * np.einsum("pk,pk->p", Xs[rows], Ys[C.indices])
    np.testing.assert_array_equal(f.sddmm(C.data.astype(np.float64), Xs, Ys), expect)


def test_executor_float32_close():
    A = _random(300, 200, 0.05, 3, int_values=False)
    f = run("tile.sgt", A).formats["sgt"]
    X = np.random.default_rng(0).standard_normal((200, 16)).astype(np.float32)
    np.testing.assert_allclose(f.spmm(run("tile.sgt", A).A.data, X), A @ X, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pipeline", [["tile.sgt"], ["reorder.rcm", "tile.sgt"], [("tile.sgt", {"shape": "fp16"})]])
def test_build_with_sgt_pipeline_is_lossless(pipeline):
    A = _random(90, 90, 0.08, 11)
    X = np.random.default_rng(1).standard_normal((90, 8)).astype(np.float32)
    mod = spcompile.build(A, op="spmm", K=8, target="cpu", pipeline=pipeline)
    np.testing.assert_allclose(mod(X), A.astype(np.float64) @ X.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_after_reordering_the_format_describes_the_current_order():
    A = _random(70, 70, 0.06, 5)
    from spcompile.core.ir import SparseModule, SparseOp
    from spcompile.core.formats import as_csr
    from spcompile.passes import Pipeline

    mod = Pipeline(["reorder.rcm", "tile.sgt"])(SparseModule.from_op(SparseOp("spmm", None, as_csr(A), 4)))
    f = mod.formats["sgt"]
    X = np.random.default_rng(2).integers(-3, 4, size=(70, 4)).astype(np.float64)
    Y = f.spmm(mod.A.data.astype(np.float64), X[mod.col_perm])   # in the permuted order
    out = np.empty_like(Y)
    out[mod.row_perm] = Y
    np.testing.assert_array_equal(out, A.toarray().astype(np.float64) @ X)


def test_shared_graph_reduction():
    path = os.path.join(GRAPHS, "cora.npz")
    if not os.path.exists(path):
        pytest.skip("shared graphs not available")
    A = sp.load_npz(path)
    met = run("tile.sgt", A).metrics["tile.sgt"]
    # cora: 8078 nonempty 16x8 blocks in the original layout, 1268 after SGT
    assert (met["blocks_before"], met["blocks_after"]) == (8078, 1268)
    assert met["reduction"] > 0.8
    f, ref = run("tile.sgt", A).formats["sgt"], _loop_sgt(A, 16, 8)
    np.testing.assert_array_equal(f.edge_to_col, ref[1])


def test_direct_function_matches_pass():
    A = _random(50, 60, 0.1, 9)
    C = sp.csr_matrix(A)
    f, before = sgt_translate(C.indptr, C.indices, C.shape, 16, 8)
    met = run("tile.sgt", A).metrics["tile.sgt"]
    assert before == met["blocks_before"] and f.num_blocks == met["blocks_after"]


def test_arrays_round_trip(tmp_path):
    A = _random(40, 30, 0.2, 4)
    mod = run("tile.sgt", A, shape="sddmm")
    f = mod.formats["sgt"]
    np.savez(tmp_path / "sgt.npz", **f.arrays())
    with np.load(tmp_path / "sgt.npz") as z:
        g = SGTFormat.from_arrays(f.BLK_H, f.BLK_W, f.shape, z)
    for k, v in f.arrays().items():
        np.testing.assert_array_equal(getattr(g, k), v)
        assert getattr(g, k).dtype == v.dtype
    X = np.arange(60, dtype=np.float64).reshape(30, 2)
    np.testing.assert_array_equal(g.spmm(mod.A.data.astype(np.float64), X), f.spmm(mod.A.data.astype(np.float64), X))
