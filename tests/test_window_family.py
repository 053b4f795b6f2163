"""The csr.window family (row-window SpMM staging each window's distinct X rows in shared memory)
on the nvcc template base (CPU: no GPU, no nvcc needed).

* The packed arrays run through the numpy emulation of the kernel (``kernels/window/emulate.py``:
  which window's staged columns each entry reads, where each row is written, which columns the
  launch covers, into a NaN-filled output) reproduce the float64 reference: SpMM sum / max / min
  / mean on matrices with empty rows, a row holding every column, non-square and all-empty
  matrices, K from 1 to 130, after the template's own pipelines (RCM, RCM + LSH) and the generic
  reorderings, for every seed parameter set and small staging chunks, the vector instance and its
  VEC = 1 fallback; 16-bit inputs within their dtype's tolerance.
* The kernel's chunk scan (per staged chunk, each warp takes the prefix of a row's entries whose
  ``lidx`` falls in the chunk, 32 at a time) replayed in Python over the packed arrays: every
  entry is reduced exactly once, from the chunk and shared-memory slot holding its column.
* The packer: every nonzero once (a row's entries in stable column order), each window's columns
  sorted and distinct and exactly those its rows use, ``lidx`` rising along each row, one window
  per ``warps x rows_per_warp`` rows, sizes and memory linear in the nonzeros.
* ``check_arrays`` (what loading an artifact runs): genuine arrays pass; altered ones -- an
  ``lidx`` outside its window or falling along a row, the permutation, the pattern or values, the
  compiled instances, a staging chunk too large for the arch, bad parameters -- are refused.
* Launch plans bind every parameter by name; grid, block and dynamic shared memory follow the
  windows, column tiles, warps and staging buffers; each call picks the aligned or fallback launch.
"""
import copy
import itertools
import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.compile import make_op
from spcompile.core import numerics, reference
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule, values_hash
from spcompile.kernels import get_template
from spcompile.kernels.aspt.template import smem_cap
from spcompile.kernels.window import emulate as em
from spcompile.kernels.window.packer import pack_window, window_partition
from spcompile.kernels.window.template import CHUNKS, stage_chunk
from spcompile.passes import Pipeline
from spcompile.passes.recipes import WINDOW_REUSE, pipelines_for
from spcompile.runtime import cuda as rt

from conftest import close_scaled as _close, random_matrix

NAME = "csr.window"
REDUCES = ("sum", "max", "min", "mean")
PIPES = {"none": [], "rcm": ["reorder.rcm"], "degree": ["reorder.degree"],
         "rcm+lsh": [copy.deepcopy(p) for p in WINDOW_REUSE]}
KS = (1, 3, 33, 64, 130)
#: small staging chunks (windows span many of them), one and two buffers, every window height
SMALL_CHUNKS = ({"chunk": 1, "nbuf": 1, "warps": 1, "rows_per_warp": 1},
                {"chunk": 2, "nbuf": 2, "warps": 1, "rows_per_warp": 8},
                {"chunk": 16, "nbuf": 2, "warps": 16, "rows_per_warp": 8, "vec": 2},
                {"chunk": 16, "nbuf": 1, "warps": 2, "rows_per_warp": 2, "vec": 1})


def _matrices():
    return {
        "random": random_matrix(300, 257, density=0.03, seed=0),          # empty rows + a 257-long row
        "long": random_matrix(60, 3000, density=0.002, seed=9),           # one 3000-long row: many chunks
        "tall": random_matrix(700, 40, density=0.05, seed=1, long_row=False),   # high window reuse
        "tiny": sp.csr_matrix(np.array([[0, 2.0, 0], [0, 0, 0], [1.0, 0, -3.0]], dtype=np.float32)),
        "nothing": sp.csr_matrix((6, 5), dtype=np.float32),
    }


def _tpl():
    return get_template(NAME)


def _mod(A, K, reduce="sum", pipe="none", dtype="float32"):
    return Pipeline(copy.deepcopy(PIPES[pipe]))(SparseModule.from_op(make_op(A, "spmm", K, reduce, dtype=dtype)))


def _param_sets(t, mod):
    d = t.default_params(mod)
    return t.seed_params(mod) + [{**d, **p} for p in SMALL_CHUNKS]


def _W(k) -> int:
    return int(k.params["warps"]) * int(k.params["rows_per_warp"])


def _scipy(A) -> sp.csr_matrix:
    """``A`` canonical (as the workload sees it), as a scipy CSR."""
    C = as_csr(A)
    return sp.csr_matrix((C.data, C.indices, C.indptr), shape=C.shape)


def _window_sizes(k) -> np.ndarray:
    return np.diff(k.arrays["win_ptr"].astype(np.int64))


# ------------------------------------------------------------------------------------------
# emulation against the float64 reference
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_emulation_matches_reference(reduce, pipe):
    t = _tpl()
    rng = np.random.default_rng(7)
    seen = {"multi_chunk": 0, "fallback": 0, "nbuf": set(), "W": set()}
    for (name, A), K in itertools.product(_matrices().items(), KS):
        mod = _mod(A, K, reduce, pipe)
        X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
        ref = reference.spmm(as_csr(A), X, reduce)
        psets = _param_sets(t, mod)
        assert all(p in psets for p in t.seed_params(mod))
        for p in psets:
            k = t.build(mod, p, compile=False)
            m = A.shape[0]
            assert k.arrays["win_ptr"].size - 1 == -(-m // _W(k))
            seen["multi_chunk"] += int(np.any(_window_sizes(k) > k.chunk(int(k.meta["vec"]))))
            seen["nbuf"].add(int(k.params["nbuf"]))
            seen["W"].add(_W(k))
            seen["fallback"] += int(len(k.meta["instances"]) == 2)
            for fallback in (False, True):
                _close(em.emulate_kernel(k, X, fallback=fallback), ref)
    # windows spanning several staging chunks, both buffer counts, vector instances with their
    # fallback and windows of 1 .. 128 rows were all exercised
    assert seen["multi_chunk"] > 0 and seen["fallback"] > 0
    assert seen["nbuf"] == {1, 2} and {1, 4, 8, 32, 128} <= seen["W"]


def _half_case(dtype):
    """A 200 x 150 matrix (empty rows, a 150-long row), K = 40, X exact in ``dtype``."""
    A = random_matrix(200, 150, density=0.04, seed=2)
    rng = np.random.default_rng(3)
    return A, 40, numerics.round_to(rng.standard_normal((150, 40)), dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_emulation_within_dtype_tolerance(dtype):
    A, K, X = _half_case(dtype)
    tol = numerics.DTYPES[dtype].tolerance
    short = numerics.DTYPES[dtype].short
    t = _tpl()
    for reduce, pipe in zip(REDUCES, ("none", "rcm", "rcm+lsh", "degree")):
        mod = _mod(A, K, reduce, pipe, dtype=dtype)
        ref = reference.spmm(as_csr(A), X, reduce)
        for p in [t.default_params(mod), *({**t.default_params(mod), **q} for q in SMALL_CHUNKS)]:
            k = t.build(mod, p, compile=False)
            assert k.meta["dtype"] == dtype and k.meta["instances"][0][0].startswith(f"spmm_window_{short}_")
            assert k.arrays["data"].dtype == np.float32          # A's values stay fp32 (fp32 arithmetic)
            if p["vec"] == 8:
                assert k.meta["vec"] == 8                        # 16-byte lanes of 8 elements
            for fallback in (False, True):
                y = em.emulate_kernel(k, X, fallback=fallback)
                assert np.isfinite(y).all()
                assert reference.rel_error(y, ref) < tol, (reduce, p)


def test_emulation_catches_broken_packing():
    """The emulation the tests above rely on refuses (or leaves NaN) what the kernel would get
    wrong: an entry whose lidx is outside its window or falls along its row, a row written
    nowhere, a column tile too few."""
    A = random_matrix(120, 90, density=0.05, seed=4)
    K = 16
    X = np.random.default_rng(0).standard_normal((90, K)).astype(np.float32)
    t = _tpl()
    mod = _mod(A, K, "sum", "rcm")
    k = t.build(mod, {**t.default_params(mod), "warps": 4, "rows_per_warp": 2, "vec": 4}, compile=False)
    W, m = _W(k), A.shape[0]
    _close(em.emulate_kernel(k, X), reference.spmm(as_csr(A), X, "sum"))
    a = {n: np.array(v, copy=True) for n, v in k.arrays.items()}
    indptr, lidx = a["indptr"], a["lidx"]
    lens = np.diff(indptr)
    i = int(np.flatnonzero(lens >= 2)[0])
    w = i // W
    # lidx one past its window's columns (the last entry of row i: the row stays sorted)
    bad = dict(a, lidx=lidx.copy())
    bad["lidx"][indptr[i + 1] - 1] = a["win_ptr"][w + 1] - a["win_ptr"][w]
    with pytest.raises(ValueError, match="outside its window"):
        em.window_columns(bad, m, W)
    # the first two entries of row i swapped: lidx falls along the row
    bad = dict(a, lidx=lidx.copy())
    p = indptr[i]
    bad["lidx"][[p, p + 1]] = bad["lidx"][[p + 1, p]]
    with pytest.raises(ValueError, match="not sorted"):
        em.window_columns(bad, m, W)
    # two kernel rows write one output row: another row stays NaN
    bad = dict(a, row_ids=a["row_ids"].copy())
    bad["row_ids"][1] = bad["row_ids"][0]
    assert np.isnan(em.emulate_window(bad, X, "sum", m, W)).any()
    # a column tile too few (a VEC = 4 launch with no tile; K = 160 with one 128-wide tile of two)
    assert np.isnan(em.emulate_window(a, X, "sum", m, W, em.spmm_columns(K, 32, 4, 1, 0))).all()
    X2 = np.random.default_rng(1).standard_normal((90, 160)).astype(np.float32)
    Y2 = em.emulate_window(a, X2, "sum", m, W, em.spmm_columns(160, 32, 4, 1, 1))
    assert np.isfinite(Y2[:, :128]).all() and np.isnan(Y2[:, 128:]).all()


# ------------------------------------------------------------------------------------------
# the kernel's chunk scan, replayed over the packed arrays
# ------------------------------------------------------------------------------------------
def _replay_chunk_scan(k):
    """What every warp of ``spmm_window`` reduces: per window, per staged chunk [base, cend), per
    row of the window, 32 (lidx, value) pairs at a time from the row's cursor, the ballot of those
    below ``cend`` (which must be a prefix), each taken from shared-memory slot ``lidx - base``.
    Returns per stored entry how often it was reduced and the column the slot held."""
    a = k.arrays
    m, chunk, W = int(k.meta["m"]), k.chunk(int(k.meta["vec"])), _W(k)
    win_ptr, ucols = a["win_ptr"].astype(np.int64), a["ucols"].astype(np.int64)
    indptr, lidx = a["indptr"].astype(np.int64), a["lidx"].astype(np.int64)
    times = np.zeros(lidx.size, np.int64)
    read_col = np.full(lidx.size, -1, np.int64)
    for w in range(win_ptr.size - 1):
        u0, D = int(win_ptr[w]), int(win_ptr[w + 1] - win_ptr[w])
        rows = range(w * W, min((w + 1) * W, m))
        cur = {i: int(indptr[i]) for i in rows}
        for c in range(-(-D // chunk)):
            base, cend = c * chunk, min((c + 1) * chunk, D)
            staged = ucols[u0 + base:u0 + cend]          # what stage_chunk copied for this chunk
            for i in rows:
                p, e = cur[i], int(indptr[i + 1])
                while p < e:
                    batch = lidx[p:min(p + 32, e)]
                    below = batch < cend
                    n = int(below.sum())
                    assert below[:n].all(), f"ballot of row {i} in chunk {c} is not a prefix"
                    slots = batch[:n] - base
                    assert n == 0 or (slots.min() >= 0 and slots.max() < cend - base), (i, c)
                    times[p:p + n] += 1
                    read_col[p:p + n] = staged[slots]
                    p += n
                    if n < 32:
                        break
                cur[i] = p
        for i in rows:     # every row's cursor reached its end
            assert cur[i] == indptr[i + 1], f"row {i}: entries left after the window's last chunk"
    return times, read_col


@pytest.mark.parametrize("pipe", ["none", "rcm+lsh"])
def test_chunk_scan_reduces_every_entry_once_from_its_column(pipe):
    t = _tpl()
    mats = _matrices()
    # a window of 40 rows sharing a 33-column block: more than 32 entries of one row per chunk
    dense = sp.random(80, 300, density=0.02, random_state=5, format="lil", dtype=np.float32)
    dense[3:43, 100:133] = 1.0
    mats["block"] = dense.tocsr()
    n_multi = n_full = 0
    for name in ("random", "long", "tall", "block", "nothing"):
        A = mats[name]
        mod = _mod(A, 33, "sum", pipe)
        d = t.default_params(mod)
        for p in [d, {**d, "chunk": 64, "warps": 16, "rows_per_warp": 4}, *({**d, **q} for q in SMALL_CHUNKS)]:
            k = t.build(mod, p, compile=False)
            times, read_col = _replay_chunk_scan(k)
            assert np.all(times == 1)
            # the slot read holds the entry's own column (the original id)
            assert np.array_equal(read_col, em.window_columns(k.arrays, A.shape[0], _W(k)))
            got = sp.csr_matrix((k.arrays["data"], read_col, k.arrays["indptr"]), shape=A.shape)
            got = sp.csr_matrix(got[np.argsort(k.arrays["row_ids"])])      # back to the caller's order
            assert got.nnz == A.nnz and (got != _scipy(A)).nnz == 0
            n_multi += int(np.any(_window_sizes(k) > k.chunk(int(k.meta["vec"]))))
            n_full += int(np.any(np.diff(k.arrays["indptr"]) > 32))
    assert n_multi > 0 and n_full > 0


# ------------------------------------------------------------------------------------------
# the packer
# ------------------------------------------------------------------------------------------
def _check_partition(indptr, indices, data, n, W, part):
    indptr = np.asarray(indptr, np.int64)
    indices = np.asarray(indices, np.int64)
    m, nnz = indptr.size - 1, indices.size
    win_ptr, ucols, lidx = (part[k].astype(np.int64) for k in ("win_ptr", "ucols", "lidx"))
    for k in ("win_ptr", "ucols", "indptr", "lidx"):
        assert part[k].dtype == np.int32 and part[k].flags.c_contiguous, k
    nwin = -(-m // W)
    assert win_ptr.size == nwin + 1 and win_ptr[0] == 0 and win_ptr[-1] == ucols.size
    assert np.all(np.diff(win_ptr) >= 0)
    assert np.array_equal(part["indptr"], indptr)
    # sizes linear in the nonzeros: one lidx / value per entry, at most one column per entry
    assert lidx.size == part["data"].size == nnz and ucols.size <= nnz
    row = np.repeat(np.arange(m), np.diff(indptr))
    w = row // W
    D = np.diff(win_ptr)
    assert np.all((lidx >= 0) & (lidx < D[w]))
    if nnz > 1:
        same_row = row[1:] == row[:-1]
        assert np.all(np.diff(lidx)[same_row] >= 0)                       # lidx rises along each row
    # each window's columns: sorted, distinct, within [0, n), exactly those its rows use
    win_of_col = np.repeat(np.arange(nwin), D)
    if ucols.size > 1:
        same_win = win_of_col[1:] == win_of_col[:-1]
        assert np.all(np.diff(ucols)[same_win] > 0)
    assert ucols.size == 0 or (ucols.min() >= 0 and ucols.max() < max(n, 1))
    used = np.unique(w * max(n, 1) + indices)
    assert np.array_equal(used, win_of_col * max(n, 1) + ucols)
    # every nonzero exactly once: the row's entries in stable column order
    cols = ucols[win_ptr[w] + lidx]
    order = np.lexsort((indices, row))
    assert np.array_equal(cols, indices[order])
    assert np.array_equal(part["data"], np.asarray(data)[order])


def test_partition_unsorted_and_repeated_columns():
    """Rows with columns out of order and a repeated column (a non-canonical CSR): entries sorted
    by column within the row, the repeated ones in their stored order, both reading one column."""
    indptr = np.array([0, 4, 4, 7, 8, 11])
    indices = np.array([5, 1, 5, 0, 2, 9, 1, 5, 7, 3, 7])
    data = np.arange(1, 12, dtype=np.float32)
    for W in (1, 2, 3, 5, 8):
        part = window_partition(indptr, indices, data, 10, W)
        _check_partition(indptr, indices, data, 10, W, part)
    part = window_partition(indptr, indices, data, 10, 2)          # windows {0, 1}, {2, 3}, {4}
    assert part["win_ptr"].tolist() == [0, 3, 7, 9]
    assert part["ucols"].tolist() == [0, 1, 5, 1, 2, 5, 9, 3, 7]
    assert part["lidx"].tolist() == [0, 1, 2, 2, 0, 1, 3, 2, 0, 1, 1]
    assert part["data"].tolist() == [4, 2, 1, 3, 7, 5, 6, 8, 10, 9, 11]
    empty = window_partition(np.zeros(5, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32), 7, 3)
    assert empty["win_ptr"].tolist() == [0, 0, 0] and empty["ucols"].size == 0 and empty["lidx"].size == 0


@pytest.mark.parametrize("W", [1, 3, 8, 32, 128])
def test_partition_invariants(W):
    mats = _matrices()
    for name, A in mats.items():
        C = sp.csr_matrix(A)
        _check_partition(C.indptr, C.indices, C.data, A.shape[1], W,
                         window_partition(C.indptr, C.indices, C.data, A.shape[1], W))


@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_pack_window_rebuilds_the_matrix(pipe):
    """pack_window after the passes: one window per warps x rows_per_warp kernel rows, row_ids a
    permutation, the arrays rebuild A in the caller's order (values in fp32)."""
    t = _tpl()
    for name, A in _matrices().items():
        mod = _mod(A, 16, "sum", pipe)
        for warps, rpw in ((1, 1), (4, 2), (8, 4), (16, 8)):
            W = warps * rpw
            a = pack_window(mod, W)
            k = t.build(mod, {**t.default_params(mod), "warps": warps, "rows_per_warp": rpw}, compile=False)
            assert set(a) == set(k.arrays) and all(np.array_equal(a[n], k.arrays[n]) for n in a)
            m, n = A.shape
            assert a["win_ptr"].size == -(-m // W) + 1
            assert a["row_ids"].dtype == np.int32 and sorted(a["row_ids"].tolist()) == list(range(m))
            cols = em.window_columns(a, m, W)
            rows = a["row_ids"][np.repeat(np.arange(m), np.diff(a["indptr"]))]
            got = sp.csr_matrix((a["data"], (rows, cols)), shape=A.shape)
            assert got.nnz == A.nnz and (got != _scipy(A)).nnz == 0


def test_pack_large_matrix_vectorised():
    """1e5 nonzeros over 20000 rows and a million columns: a dense per-window column map would
    need 20000 x 10^6 cells; the packer's memory stays linear in the nonzeros."""
    rng = np.random.default_rng(11)
    m, n, nnz = 20000, 1_000_000, 100_000
    A = sp.csr_matrix((rng.standard_normal(nnz).astype(np.float32),
                       (rng.integers(0, m, nnz), rng.integers(0, n, nnz))), shape=(m, n))
    A.sum_duplicates()
    for W in (1, 32, 128):
        tracemalloc.start()
        try:
            part = window_partition(A.indptr, A.indices, A.data, n, W)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 400 * A.nnz + 64 * m, peak          # bytes: O(nnz + m), not O(windows x n)
        _check_partition(A.indptr, A.indices, A.data, n, W, part)


# ------------------------------------------------------------------------------------------
# parameters, seeds, staging chunk, rendered source
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("K", [1, 6, 40, 64, 130])
def test_seeds_are_valid_and_distinct(dtype, K):
    t = _tpl()
    A = random_matrix(100, 80, density=0.05, seed=1)
    mod = _mod(A, K, "max", dtype=dtype)
    seeds = t.seed_params(mod)
    assert seeds[0] == t.default_params(mod)
    assert len({tuple(sorted(p.items())) for p in seeds}) == len(seeds)
    space = t.space(mod)
    for p in seeds:
        assert set(p) == set(space)
        for name, v in p.items():
            assert v in space[name].choices, (name, v)
        k = t.build(mod, p, compile=False)
        assert K % k.meta["vec"] == 0 and k.meta["vec"] <= p["vec"]
        assert k.launch_spec(k.meta["vec"]).smem <= smem_cap(k.meta["arch"])
    assert {p["nbuf"] for p in seeds} == {1, 2}
    assert len({p["warps"] * p["rows_per_warp"] for p in seeds}) >= 3


def test_invalid_parameters_are_named():
    A = random_matrix(30, 20, density=0.2, seed=1)
    t = _tpl()
    mod = _mod(A, 8, "sum")
    with pytest.raises(ValueError, match=r"vec=3 .*rows_per_warp=16 .*nbuf=3"):
        t.build(mod, {"vec": 3, "rows_per_warp": 16, "nbuf": 3}, compile=False)
    with pytest.raises(ValueError, match=r"vec=8"):                   # fp32: at most 16 bytes = 4
        t.build(mod, {"vec": 8}, compile=False)
    with pytest.raises(ValueError, match=r"chunk=0"):
        t.build(mod, {"chunk": 0}, compile=False)
    with pytest.raises(ValueError, match=r"warps=32"):
        t.build(mod, {"warps": 32}, compile=False)
    with pytest.raises(ValueError, match="unknown parameter"):
        t.build(mod, {"max_seg": 4}, compile=False)
    h = _mod(A, 8, "sum", dtype="float16")
    assert t.build(h, {"vec": 8}, compile=False).meta["vec"] == 8
    with pytest.raises(ValueError, match="dtype"):
        t.build(_mod(A, 8, "sum", dtype="float64"), {}, compile=False)


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_stage_chunk_fits_the_arch(arch):
    cap = smem_cap(arch)
    for elem, vec, nbuf, chunk in itertools.product((2, 4), (1, 2, 4, 8), (1, 2), (*CHUNKS, 1, 3, 1000, 10**6)):
        c = stage_chunk(chunk, vec, nbuf, elem, arch)
        row = 32 * vec * elem
        assert 1 <= c <= chunk
        assert nbuf * c * row <= cap
        assert c == chunk or nbuf * (c + 1) * row > cap           # the largest chunk that fits


def test_built_chunk_is_capped_for_the_build_arch():
    t = _tpl()
    A = random_matrix(100, 80, density=0.05, seed=1)
    mod = _mod(A, 64, "sum")
    arch = rt.device_arch()
    for vec, nbuf, chunk in itertools.product((1, 2, 4), (1, 2), (16, 256, 4096)):
        k = t.build(mod, {"vec": vec, "nbuf": nbuf, "chunk": chunk}, compile=False)
        assert k.meta["arch"] == arch and k.meta["vec"] == vec
        assert "chunk" not in k.meta     # the launch caps it for the arch the binary is for
        assert k.chunk(vec) == stage_chunk(chunk, vec, nbuf, 4, arch)
        for v in (vec, 1):
            assert k.launch_spec(v).smem <= smem_cap(arch)


def test_rendered_source_inlines_the_csr_helpers():
    t = _tpl()
    a = t.render(t.instances("sum", 4, 1, 1, "float32"))
    b = t.render(t.instances("max", 8, 8, 2, "bfloat16"))
    assert '#include "../csr/' not in a and "store_vec" in a and "spmm_window" in a
    # variants differ only by their instantiation lines (no copy-pasted bodies)
    assert a.split("SPC_WINDOW_INSTANCE(spmm_window")[0] == b.split("SPC_WINDOW_INSTANCE(spmm_window")[0]
    names = [n for n, _ in t.instances("mean", 2, 4, 2, "float16")]
    assert names == ["spmm_window_f16_r3_v2_rpw4_b2", "spmm_window_f16_r3_v1_rpw4_b2"]
    assert t.instances("min", 1, 2, 1) == [("spmm_window_f32_r2_v1_rpw2_b1", (0, 2, 1, 2, 1))]


def test_pipelines_are_the_window_recipe():
    t = _tpl()
    A = random_matrix(100, 80, density=0.05, seed=1)
    mod0 = SparseModule.from_op(make_op(A, "spmm", 16, "sum"))
    pipes = t.pipelines(mod0)
    for recipe in pipelines_for("window", "spmm"):
        assert recipe in pipes
    for pipe in pipes:
        mod = Pipeline(pipe)(mod0)
        assert t.supports(mod)
        k = t.build(mod, t.default_params(mod), compile=False)
        X = np.random.default_rng(1).standard_normal((80, 16)).astype(np.float32)
        _close(em.emulate_kernel(k, X), reference.spmm(as_csr(A), X, "sum"))


# ------------------------------------------------------------------------------------------
# check_arrays: what loading an artifact runs before any kernel sees its arrays
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["random", "long", "tall", "tiny", "nothing"])
def test_genuine_arrays_pass(name, dtype):
    t = _tpl()
    A = _matrices()[name]
    vh = values_hash(as_csr(A))
    n = 0
    for K in (1, 40):
        sop = make_op(A, "spmm", K, "mean", dtype=dtype)
        mod0 = SparseModule.from_op(sop)
        for pipe in t.pipelines(mod0) + [["reorder.degree"]]:
            mod = Pipeline(pipe)(mod0)
            for p in _param_sets(t, mod):
                k = t.build(mod, p, compile=False)
                t.check_arrays(sop.key(), k.params, k.arrays, k.meta, vh)
                t.check_arrays(sop.key(), k.params, k.arrays, k.meta)       # no values hash given
                n += 1
    assert n > 0


@pytest.fixture(scope="module")
def tamper_case():
    """A kernel with 38 windows of 8 rows, its staging chunk (4096 asked) capped by the arch's
    shared memory (fp32, 4-wide lanes, 2 buffers), rows reordered (row_ids not the identity)."""
    t = _tpl()
    A = random_matrix(300, 257, density=0.03, seed=0)
    sop = make_op(A, "spmm", 64, "max")
    mod = Pipeline(["reorder.rcm"])(SparseModule.from_op(sop))
    k = t.build(mod, {"vec": 4, "warps": 4, "rows_per_warp": 2, "chunk": 4096, "nbuf": 2}, compile=False)
    assert k.chunk(4) < 4096 and not np.array_equal(k.arrays["row_ids"], np.arange(300))
    return t, sop, k, values_hash(as_csr(A))


def _refused(case, message, arrays=None, meta=None, params=None):
    """The genuine arrays pass; with ``arrays`` / ``meta`` / ``params`` changed they are refused."""
    t, sop, k, vh = case
    t.check_arrays(sop.key(), k.params, k.arrays, k.meta, vh)
    arr = {n: np.array(a, copy=True) for n, a in k.arrays.items()}
    for n, f in (arrays or {}).items():
        arr[n] = f(arr[n], k)
    m = copy.deepcopy(dict(k.meta))
    m.update(meta or {})
    with pytest.raises(ValueError, match=message):
        t.check_arrays(sop.key(), {**k.params, **(params or {})}, arr, m, vh)


def _row_with(k, n_entries):
    """A kernel row with at least ``n_entries`` entries of distinct lidx, and its first entry."""
    ip, lidx = k.arrays["indptr"], k.arrays["lidx"]
    for i in range(ip.size - 1):
        if ip[i + 1] - ip[i] >= n_entries and lidx[ip[i]] != lidx[ip[i + 1] - 1]:
            return i, int(ip[i])
    raise AssertionError("no such row")


def _lidx_past_window(a, k):
    i, _ = _row_with(k, 1)
    w = i // _W(k)
    a[k.arrays["indptr"][i + 1] - 1] = k.arrays["win_ptr"][w + 1] - k.arrays["win_ptr"][w]
    return a


def _lidx_falls(a, k):
    _, p = _row_with(k, 2)
    a[[p, p + 1]] = a[[p + 1, p]]
    return a


def _swap_first_two(a, k):
    """The first two entries of a row swapped (applied to lidx and data: the same matrix)."""
    _, p = _row_with(k, 2)
    a[[p, p + 1]] = a[[p + 1, p]]
    return a


def _bump_max(a, k):
    a[int(np.argmax(a))] += 1
    return a


def _set(i, v):
    def f(a, k):
        a[i] = v
        return a
    return f


def _fall(a, k):
    j = int(np.flatnonzero(np.diff(a) > 0)[0]) + 1       # the first pointer that rises ...
    a[j] = a[j - 1] - 1 if a[j - 1] > 0 else 0           # ... falls below the one before (or stays 0)
    if a[j] == a[j - 1]:
        a[j - 1] = a[j] + 1
    return a


def _instances_with(k, **change):
    t = _tpl()
    args = {"reduce": "max", "vec": int(k.meta["vec"]), "rpw": int(k.params["rows_per_warp"]),
            "nbuf": int(k.params["nbuf"]), "dtype": "float32", **change}
    return [[n, list(a)] for n, a in t.instances(**args)]


ARRAY_CASES = [
    # (what, {array: change}, message)
    ("lidx past its window's columns", {"lidx": _lidx_past_window}, "outside its window"),
    ("negative lidx", {"lidx": _set(0, -1)}, "'lidx'"),
    ("lidx falls along a row", {"lidx": _lidx_falls}, "not sorted"),
    ("lidx falls, values swapped too (same matrix)", {"lidx": _swap_first_two,
                                                     "data": _swap_first_two}, "not sorted"),
    ("lidx truncated", {"lidx": lambda a, k: a[:-1]}, "'lidx'"),
    ("lidx as floats", {"lidx": lambda a, k: a.astype(np.float32)}, "'lidx'"),
    ("column past n", {"ucols": _bump_max}, "'ucols'"),
    ("negative column", {"ucols": _set(0, -1)}, "'ucols'"),
    ("columns truncated", {"ucols": lambda a, k: a[:-1]}, "'ucols'|'win_ptr'"),
    ("another column", {"ucols": lambda a, k: (a + 1) % 257}, "pattern hash|order"),
    ("window pointer falls", {"win_ptr": _fall}, "'win_ptr'"),
    ("window pointer one short", {"win_ptr": lambda a, k: a[:-1]}, "'win_ptr'"),
    ("window pointer one long", {"win_ptr": lambda a, k: np.append(a, a[-1])}, "'win_ptr'"),
    ("window pointer past the columns", {"win_ptr": lambda a, k: np.append(a[:-1], a[-1] + 1)}, "'win_ptr'|'ucols'"),
    ("window pointer not from 0", {"win_ptr": _set(0, 1)}, "'win_ptr'|lidx"),
    ("row pointer overruns", {"indptr": lambda a, k: np.append(a[:-1], a[-1] + 1)}, "'indptr'"),
    ("row pointer falls", {"indptr": _fall}, "'indptr'"),
    ("output row repeated", {"row_ids": _set(1, 0)}, "permutation"),
    ("output row past m", {"row_ids": _bump_max}, "'row_ids'"),
    ("rows relabelled", {"row_ids": lambda a, k: np.roll(a, 1)}, "pattern hash|order"),
    ("another value", {"data": lambda a, k: a * np.float32(1.5)}, "values hash"),
    ("values truncated", {"data": lambda a, k: a[:-1]}, "'data'"),
]


@pytest.mark.parametrize("what, arrays, message", ARRAY_CASES, ids=[c[0] for c in ARRAY_CASES])
def test_altered_arrays_are_refused(tamper_case, what, arrays, message):
    _refused(tamper_case, message, arrays=arrays)


META_CASES = [
    ("another rows_per_warp compiled", lambda k: {"instances": _instances_with(k, rpw=4)}, "instances"),
    ("another nbuf compiled", lambda k: {"instances": _instances_with(k, nbuf=1)}, "instances"),
    ("another reduction compiled", lambda k: {"instances": _instances_with(k, reduce="sum")}, "instances"),
    ("another vector width compiled", lambda k: {"instances": _instances_with(k, vec=2)}, "instances"),
    ("fallback instance missing", lambda k: {"instances": k.meta["instances"][:1]}, "instances"),
    ("vector width of the meta", lambda k: {"vec": 2}, "'vec'"),
    ("an arch without cp.async", lambda k: {"arch": 75}, "'arch'"),
    ("arch missing", lambda k: {"arch": None}, "'arch'"),
    ("K of the meta", lambda k: {"K": 128}, "'K'"),
    ("rows of the meta", lambda k: {"m": 299}, "'m'"),
    ("dtype of the meta", lambda k: {"dtype": "float16"}, "dtype"),
]


@pytest.mark.parametrize("what, change, message", META_CASES, ids=[c[0] for c in META_CASES])
def test_altered_meta_is_refused(tamper_case, what, change, message):
    _refused(tamper_case, message, meta=change(tamper_case[2]))


PARAM_CASES = [
    ("vec=3", {"vec": 3}, r"vec=3"),
    ("vec=8 for fp32", {"vec": 8}, r"vec=8"),
    ("rows_per_warp=16", {"rows_per_warp": 16}, r"rows_per_warp=16"),
    ("rows_per_warp=True", {"rows_per_warp": True}, r"rows_per_warp=True"),
    ("warps=True", {"warps": True}, r"warps=True"),
    ("warps=3", {"warps": 3}, r"warps=3"),
    ("nbuf=3", {"nbuf": 3}, r"nbuf=3"),
    ("nbuf=True", {"nbuf": True}, r"nbuf=True"),
    ("chunk=0", {"chunk": 0}, r"chunk=0"),
    ("chunk=2.0", {"chunk": 2.0}, r"chunk=2\.0"),
    ("vec missing", {"vec": None}, r"vec=None"),
    ("another window height (warps)", {"warps": 8}, "'win_ptr'"),
    ("another rows_per_warp than compiled", {"rows_per_warp": 4}, "instances|'win_ptr'"),
    ("another nbuf than compiled", {"nbuf": 1}, "instances|'chunk'"),
]


@pytest.mark.parametrize("what, params, message", PARAM_CASES, ids=[c[0] for c in PARAM_CASES])
def test_altered_params_are_refused(tamper_case, what, params, message):
    _refused(tamper_case, message, params=params)


ELEMENT_CASES = [
    # the kernel reads int32 pointers / indices and fp32 values: another element type is read as
    # other values, and a narrower one past the end of its device buffer
    ("lidx", np.int64), ("win_ptr", np.int64), ("ucols", np.int64), ("indptr", np.int64), ("row_ids", np.int64),
    ("data", np.float16), ("data", np.float64),
]


@pytest.mark.parametrize("array, dtype", ELEMENT_CASES, ids=[f"{a}-{np.dtype(d).name}" for a, d in ELEMENT_CASES])
def test_arrays_of_another_element_type_are_refused(array, dtype):
    t = _tpl()
    A = random_matrix(120, 90, density=0.05, seed=4)
    A.data = A.data.astype(np.float16).astype(np.float32)       # values exact in every float type
    sop = make_op(A, "spmm", 16, "sum")
    mod = SparseModule.from_op(sop)
    k = t.build(mod, {"warps": 4, "rows_per_warp": 2}, compile=False)
    vh = values_hash(as_csr(A))
    t.check_arrays(sop.key(), k.params, k.arrays, k.meta, vh)
    arr = {**k.arrays, array: k.arrays[array].astype(dtype)}
    with pytest.raises(ValueError, match=array):
        t.check_arrays(sop.key(), k.params, arr, k.meta, vh)


# ------------------------------------------------------------------------------------------
# launch plans: every parameter bound by name; grid, block, shared memory
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("K", [1, 33, 64, 130])
def test_plan_arguments_follow_the_signature(dtype, K):
    A = random_matrix(300, 257, density=0.03, seed=5)
    t = _tpl()
    mod = _mod(A, K, "mean", "rcm", dtype=dtype)
    elem = numerics.DTYPES[dtype].bytes
    for p in ({}, {"warps": 16, "rows_per_warp": 8, "chunk": 16, "nbuf": 1},
              {"warps": 2, "rows_per_warp": 1, "chunk": 200, "nbuf": 2, "vec": 2}):
        params = {**t.default_params(mod), **p}
        k = t.build(mod, params, compile=False)
        names = list(k.arrays)
        dev = {n: 0x7F0000000000 + 0x10000 * i for i, n in enumerate(names)}
        calls = (0x7E0000000000, 0x7E0000000100)
        plans = k.make_plans(None, dev)
        vec = int(k.meta["vec"])
        assert len(plans) == len(k.meta["instances"]) == (2 if vec > 1 else 1)
        src = t.render([(n, tuple(a)) for n, a in k.meta["instances"]])
        nwin = -(-300 // (params["warps"] * params["rows_per_warp"]))
        for plan, (iname, iargs), v in zip(plans, k.meta["instances"], (vec, 1)):
            chunk = k.chunk(v)
            scalars = {"m": 300, "K": K, "chunk": chunk}
            assert iargs[2] == v and iargs[3] == params["rows_per_warp"] and iargs[4] == params["nbuf"]
            args = plan.arguments(calls)
            assert [(n, t_) for n, t_, _ in args] == list(rt.kernel_signature(src, iname).params)
            for n, ctype, val in args:
                if n in ("X", "Y"):
                    assert (ctype, val) == ("ptr", calls[("X", "Y").index(n)])
                elif n in dev:
                    assert (ctype, val) == ("ptr", dev[n])
                else:
                    assert (ctype, val) == ("int32", scalars[n]), n
            assert {n for n, _, _ in args} >= set(names)             # every array reaches the kernel
            assert plan.grid == (nwin, -(-K // (32 * v)), 1)
            assert plan.block == (32 * params["warps"], 1, 1)
            assert plan.smem == params["nbuf"] * chunk * 32 * v * elem
            # the column tiles cover K, and no vector reaches past it
            assert K % v == 0 and plan.grid[1] * 32 * v >= K > (plan.grid[1] - 1) * 32 * v


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, ptrs, stream):
        self.calls.append((tuple(ptrs), stream))


@pytest.mark.parametrize("dtype,vec", [("float32", 4), ("float16", 8), ("bfloat16", 2)])
def test_each_call_chooses_aligned_or_fallback_launch(dtype, vec):
    A = random_matrix(50, 40, density=0.1, seed=6)
    t = _tpl()
    elem = numerics.DTYPES[dtype].bytes
    mod = _mod(A, 32, "sum", dtype=dtype)
    k = t.build(mod, {**t.default_params(mod), "vec": vec}, compile=False)
    assert k.meta["vec"] == vec
    main, fb = _Recorder(), _Recorder()
    k.use_plans([main, fb])
    base = 1 << 20
    k.launch((base,), base + 4096, 9)
    k.launch((base + elem,), base, 9)                    # X one element off the vector
    k.launch((base,), base + elem, 9)                    # Y off
    k.launch((base + vec * elem,), base + 2 * vec * elem, 9)
    assert main.calls == [((base, base + 4096), 9), ((base + vec * elem, base + 2 * vec * elem), 9)]
    assert fb.calls == [((base + elem, base), 9), ((base, base + elem), 9)]
    # K not a multiple of any vector: one instance, every call takes it
    k1 = t.build(_mod(A, 33, "sum", dtype=dtype), {"vec": vec}, compile=False)
    assert k1.meta["vec"] == 1 and len(k1.meta["instances"]) == 1
    only = _Recorder()
    k1.use_plans([only])
    k1.launch((base + elem,), base + 3 * elem, 1)
    assert only.calls == [((base + elem, base + 3 * elem), 1)]
    # no rows: nothing launched
    e = t.build(_mod(sp.csr_matrix((0, 40), dtype=np.float32), 32, "sum", dtype=dtype), {"vec": vec}, compile=False)
    assert e.empty()
    e.use_plans([main, fb])
    e.launch((base,), base, 3)
    assert len(main.calls) == 2 and len(fb.calls) == 2
    # rows but no entries: launched (every row is written, with zeros)
    z = t.build(_mod(sp.csr_matrix((7, 40), dtype=np.float32), 32, "sum", dtype=dtype), {"vec": vec}, compile=False)
    assert not z.empty()


# ------------------------------------------------------------------------------------------
# a binary made for another GPU generation
# ------------------------------------------------------------------------------------------
def test_binary_rebuilt_for_another_arch_fits_its_shared_memory(monkeypatch):
    """An artifact built on an sm_90 GPU whose staging chunk sm_90's shared memory capped (fp32,
    4-wide lanes, two buffers of up to 256 columns), loaded on an sm_80 GPU: the instances are
    compiled again for sm_80, and then each launch must ask for no more dynamic shared memory than
    sm_80 offers, with a meta that check_arrays still accepts (a re-saved artifact loads)."""
    t = _tpl()
    A = random_matrix(100, 80, density=0.05, seed=1)
    sop = make_op(A, "spmm", 64, "sum")
    mod = SparseModule.from_op(sop)
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 90)
    k = t.build(mod, {"vec": 4, "nbuf": 2, "chunk": 256}, compile=False)
    assert k.meta["arch"] == 90 and k.launch_spec(4).smem > smem_cap(80)     # fits sm_90 only
    compiled = []
    monkeypatch.setattr(t, "compile", lambda inst, arch=None, name="": compiled.append(arch) or "/new.fatbin")
    monkeypatch.setattr(rt, "_device_arch", lambda device: 80)
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 80)
    monkeypatch.setattr(rt, "nvcc_available", lambda: True)
    k = t.load(k.params, k.arrays, {"kernel.fatbin": "/old.fatbin"}, dict(k.meta))
    assert k._binary(0) == "/new.fatbin" and compiled == [80] and k.meta["arch"] == 80
    for v in (4, 1):
        assert k.launch_spec(v).smem <= smem_cap(80), v
    t.check_arrays(sop.key(), k.params, k.arrays, k.meta, values_hash(as_csr(A)))
