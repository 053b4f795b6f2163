"""CUDA templates on a GPU: every template x reduction x K against the float64 reference with a
NaN-poisoned output, on random matrices with empty rows and a 10k-nonzero row; save/load of a CUDA
module.  Skipped without a usable GPU."""
import os
import sys

import numpy as np
import pytest

import spcompile
from spcompile.runtime import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.fixture(scope="module")
def gpu_check():
    import gpu_check as gc

    return gc


@pytest.mark.parametrize("template", ["csr.crc_cwm", "csr.sddmm", "extern.cusparse"])
def test_templates_correct(gpu_check, template):
    A = gpu_check.random_matrix(0, m=1500, n=12000, density=0.001)
    log = []
    fails = gpu_check.check_matrix(A, "random", False, log, templates={template})
    assert fails == 0, [r for r in log if not r["ok"]][:5]
    assert len(log) > 0


def test_save_load(gpu_check):
    log = []
    assert gpu_check.check_save_load(log) == 0, log


def test_call_kinds_same_result():
    import cupy
    import torch

    from spcompile.kernels.csr.template import CrcCwm  # noqa: F401
    rng = np.random.default_rng(0)
    import scipy.sparse as sp

    A = sp.random(300, 200, density=0.05, format="csr", random_state=1, dtype=np.float32)
    X = rng.standard_normal((200, 48)).astype(np.float32)
    mod = spcompile.build(A, "spmm", K=48, reduce="sum", target="cuda", template="csr.crc_cwm")
    y_np = mod(X)
    y_t = mod(torch.from_numpy(X).cuda()).cpu().numpy()
    y_c = mod(cupy.asarray(X)).get()
    assert np.array_equal(y_np, y_t) and np.array_equal(y_np, y_c)
    assert isinstance(mod(torch.from_numpy(X)), torch.Tensor)  # CPU torch: copied in and out


def test_fast_call_path_checks_and_threads():
    """After a first checked call the module takes its fast path (prepared driver launch); anything
    the fast path does not cover (wrong dtype/shape/out, non-contiguous, another thread without a
    current driver context) still works or fails with the full path's errors."""
    import threading

    import scipy.sparse as sp
    import torch

    A = sp.random(257, 190, density=0.04, format="csr", random_state=3, dtype=np.float32)
    X = torch.randn(190, 33, device="cuda")
    mod = spcompile.build(A, "spmm", K=33, reduce="sum", target="cuda", template="csr.crc_cwm")
    ref = (A.astype(np.float64) @ X.double().cpu().numpy())
    y0 = mod(X)                                  # full path, sets up the fast path
    assert mod._plan is not None
    assert mod.kernel._plans[0]._launch is not None, "driver launch path not in use"
    y1 = mod(X)                                  # fast path
    out = torch.full((257, 33), float("nan"), device="cuda")
    assert mod(X, out=out) is out
    for y in (y0, y1, out):
        assert np.allclose(y.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)
    Xt = torch.randn(33, 190, device="cuda").t()  # non-contiguous: copied by the full path
    assert np.allclose(mod(Xt).cpu().numpy(), A @ Xt.cpu().numpy(), rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="dtype"):
        mod(X.double())
    with pytest.raises(ValueError, match="shape"):
        mod(X[:, :32].contiguous())
    with pytest.raises(ValueError, match="out must be"):
        mod(X, out=torch.empty(257, 33, device="cuda", dtype=torch.float64))
    res = {}

    def worker():
        o = torch.full((257, 33), float("nan"), device="cuda")
        mod(X, out=o)
        torch.cuda.synchronize()
        res["y"] = o.cpu().numpy()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert np.allclose(res["y"], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tune_16bit_workload(tmp_path, dtype):
    """The CUDA runner tunes 16-bit workloads: inputs of that dtype, the float64 reference of the
    rounded inputs, the dtype's tolerance; the stored best builds and is correct."""
    import scipy.sparse as sp
    import torch

    from spcompile.autotune.tuner import tune

    A = sp.random(400, 300, density=0.03, format="csr", random_state=5, dtype=np.float32)
    db = str(tmp_path / "t.db")
    res = tune(A, "spmm", K=40, target="cuda", dtype=dtype, trials=5, storage=db, seed=0)
    assert res.best_config is not None and res.n_complete >= 1, res.fail_reasons
    if res.stored:
        mod = spcompile.build(A, "spmm", K=40, target="cuda", dtype=dtype, storage=db)
        assert mod.tuning["source"] == "database" and mod.config == res.best_config
    else:   # the search's best lost to cuSPARSE or the default measured in the same run: not stored
        assert "slower than" in res.store_note
        c = res.best_config
        mod = spcompile.build(A, "spmm", K=40, target="cuda", dtype=dtype, template=c.template,
                              params=dict(c.params), pipeline=list(c.pipeline))
    X = torch.randn(300, 40, device="cuda").to(getattr(torch, dtype))
    Y = mod(X)
    assert Y.dtype == X.dtype
    ref = A.astype(np.float64) @ X.double().cpu().numpy()
    err = np.linalg.norm(Y.double().cpu().numpy() - ref) / np.linalg.norm(ref)
    assert err < 1e-2, err


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2)])
@pytest.mark.parametrize("K", [1, 33, 128])
def test_flat_sddmm_spans_rows(dtype, tol, K):
    """csr.sddmm with nonzero-parallel segments (flat=1) behind a row reordering: segments cross
    empty rows and a 1999-entry row, with one or several entries in flight a group (unroll), 4- to
    32-lane groups (and one-row segments batched); every output written (NaN-poisoned), float64
    reference."""
    import scipy.sparse as sp
    import torch

    from spcompile.compile import make_op
    from spcompile.core import reference

    rng = np.random.default_rng(K)
    A = sp.random(3000, 2000, density=0.003, format="lil", random_state=3, dtype=np.float32)
    A[5, :] = 0
    A[17, :] = 0
    A[100, rng.choice(2000, 1999, replace=False)] = 1.5
    A = A.tocsr()
    tdt = getattr(torch, dtype)
    X = torch.randn(3000, K, device="cuda").to(tdt)
    Y = torch.randn(2000, K, device="cuda").to(tdt)
    ref = reference.run("sddmm", None, make_op(A, "sddmm", K).A, X.double().cpu().numpy(), Y.double().cpu().numpy())
    for p in ({"group": 8, "k_chunks": 2, "nnz_per_warp": 32}, {"group": 16, "k_chunks": 1, "nnz_per_warp": 128},
              {"group": 32, "k_chunks": 1, "nnz_per_warp": 7}, {"group": 8, "k_chunks": 1, "nnz_per_warp": 32, "unroll": 4},
              {"group": 16, "k_chunks": 2, "nnz_per_warp": 128, "unroll": 2},
              # widths quick selection's second round measures: 4 lanes of two chunks, 32 lanes of
              # one with 4 entries in flight, and that on one-row segments
              {"group": 4, "k_chunks": 2, "nnz_per_warp": 32, "unroll": 2},
              {"group": 32, "k_chunks": 1, "nnz_per_warp": 32, "unroll": 4},
              {"group": 32, "k_chunks": 1, "nnz_per_warp": 32, "unroll": 4, "flat": 0}):
        mod = spcompile.build(A, "sddmm", K, target="cuda", dtype=dtype, template="csr.sddmm",
                              params={"vec": 4, "warps_per_block": 4, "flat": 1, **p}, pipeline=["reorder.degree"])
        out = torch.full((A.nnz,), float("nan"), device="cuda", dtype=tdt)
        mod(X, Y, out=out)
        r = out.double().cpu().numpy()
        assert np.all(np.isfinite(r)), p
        assert np.linalg.norm(r - ref) / np.linalg.norm(ref) <= tol, p


#: csr.window parameter sets on the GPU: the heuristic, and staging chunks of 1, 2 and 16 columns
#: (every window spans several chunks) with one / two buffers, 1- to 128-row windows
WINDOW_PARAMS = ({}, {"warps": 4, "rows_per_warp": 8, "chunk": 2, "nbuf": 2},
                 {"warps": 16, "rows_per_warp": 1, "chunk": 16, "nbuf": 1},
                 {"warps": 1, "rows_per_warp": 1, "chunk": 1, "nbuf": 1, "vec": 1},
                 {"warps": 16, "rows_per_warp": 8, "chunk": 16, "nbuf": 2})


def _window_matrix():
    """2000 x 1500: ~6 entries a row, empty rows (first and last too), a row holding every column,
    and a 48-row band sharing 40 columns (window reuse, rows of more than 32 entries a chunk)."""
    import scipy.sparse as sp

    rng = np.random.default_rng(0)
    m, n = 2000, 1500
    A = sp.random(m, n, density=0.004, format="lil", random_state=2, dtype=np.float32)
    A[700:748, 300:340] = rng.standard_normal((48, 40)).astype(np.float32)
    A[1000, :] = rng.standard_normal(n).astype(np.float32)
    for i in (0, 5, 17, 1001, m - 1):
        A[i, :] = 0
    A = A.tocsr()
    A.eliminate_zeros()
    return A


#: csr.crc_cwm flat=1 shapes: a long row split into slices inside one group's stream, groups
#: narrower than a warp, more rows per group than lanes (the segment pointers read in windows)
FLAT_SPMM_PARAMS = ({"group": 32, "vec": 4, "cf": 1, "rows_per_warp": 8, "max_seg": 16, "unroll": 2},
                    {"group": 8, "vec": 2, "cf": 2, "rows_per_warp": 3, "max_seg": 0, "unroll": 4},
                    {"group": 4, "vec": 1, "cf": 4, "rows_per_warp": 40, "max_seg": 64, "unroll": 8})
#: nnz-balanced flat groups (flat_nnz): the long row's slices alone in their groups, runs of short
#: and empty rows, more segments in a group than lanes, at full occupancy (32 registers)
FLAT_NNZ_SPMM_PARAMS = ({"group": 32, "vec": 4, "cf": 1, "max_seg": 32, "unroll": 1, "flat_nnz": 32, "min_blocks": 8},
                        {"group": 16, "vec": 2, "cf": 2, "max_seg": 0, "unroll": 2, "flat_nnz": 64},
                        {"group": 8, "vec": 4, "cf": 1, "max_seg": 128, "unroll": 4, "flat_nnz": 128, "min_blocks": 4})


def _check_crc_cwm(dtype, tol, K, cases, check_module=None, matrix=None):
    """csr.crc_cwm built through ``spcompile.build`` on ``matrix`` (default
    :func:`_window_matrix`) for every reduction and each ``(params, pipeline)`` of ``cases``
    (``check_module(mod, params)`` first, when given): the NaN-poisoned output fully written and
    equal to the float64 reference within ``tol``, twice in a row (the split-row counters reset)."""
    import torch

    from spcompile.compile import make_op
    from spcompile.core import reference

    A = _window_matrix() if matrix is None else matrix
    tdt = getattr(torch, dtype)
    X = torch.randn(A.shape[1], K, device="cuda").to(tdt)
    for reduce in ("sum", "max", "min", "mean"):
        ref = reference.run("spmm", reduce, make_op(A, "spmm", K, reduce).A, X.double().cpu().numpy())
        for p, pipeline in cases:
            mod = spcompile.build(A, "spmm", K, reduce, target="cuda", dtype=dtype, template="csr.crc_cwm",
                                  params=p, pipeline=pipeline)
            if check_module is not None:
                check_module(mod, p)
            for _ in range(2):
                out = torch.full((A.shape[0], K), float("nan"), device="cuda", dtype=tdt)
                mod(X, out=out)
                r = out.double().cpu().numpy()
                assert np.all(np.isfinite(r)), (reduce, p)
                assert np.linalg.norm(r - ref) / np.linalg.norm(ref) <= tol, (reduce, p)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("K", [1, 33, 128])
def test_flat_spmm_streams_rows(dtype, tol, K):
    """csr.crc_cwm with flat=1 (each row group streams consecutive segments): every reduction,
    empty rows (first and last too), a row holding every column, after a degree order; the
    NaN-poisoned output fully written and equal to the float64 reference, twice in a row (the
    split-row counters reset)."""
    _check_crc_cwm(dtype, tol, K, [({"warps_per_block": 4, "flat": 1, **p}, ["reorder.degree"] if i == 1 else [])
                                   for i, p in enumerate(FLAT_SPMM_PARAMS)])


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("K", [1, 33, 128])
def test_flat_nnz_spmm_balanced_groups(dtype, tol, K):
    """csr.crc_cwm with flat row groups of about flat_nnz nonzeros (grp_seg): every reduction,
    the long row cut into slices combined across groups, empty rows, with and without a degree
    order; the NaN-poisoned output fully written and equal to the float64 reference, twice."""
    def balanced(mod, p):
        gs = mod.kernel.arrays["grp_seg"]
        assert gs.size > 2 and np.all(np.diff(gs) > 0)

    _check_crc_cwm(dtype, tol, K, [({"warps_per_block": 4, "flat": 1, **p}, ["reorder.degree"] if i != 1 else [])
                                   for i, p in enumerate(FLAT_NNZ_SPMM_PARAMS)], balanced)


#: flat=2, the staged stream (a chunk's X slices copied to shared memory by cp.async): chunks of 32,
#: 16, 8 and 4 entries (unroll; wider and narrower than the group), nnz-balanced groups and runs of 3 / 40 rows, the
#: long row's slices combined across groups, 16-, 8-, 4- and (16-bit vec 1) 2-byte copies, two
#: column slices a lane, launch bounds
STAGED_SPMM_PARAMS = (
    {"group": 16, "vec": 4, "cf": 1, "warps_per_block": 4, "max_seg": 32, "unroll": 32, "flat_nnz": 32},
    {"group": 8, "vec": 2, "cf": 2, "warps_per_block": 4, "rows_per_warp": 40, "max_seg": 64, "unroll": 16},
    {"group": 32, "vec": 1, "cf": 2, "warps_per_block": 2, "rows_per_warp": 3, "max_seg": 0, "unroll": 2,
     "min_blocks": 8},
    {"group": 4, "vec": 4, "cf": 1, "warps_per_block": 8, "max_seg": 128, "unroll": 8, "flat_nnz": 64, "min_blocks": 4})


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("K", [1, 33, 72, 128])
def test_staged_spmm_streams_rows(dtype, tol, K):
    """csr.crc_cwm with flat=2 (X slices of a chunk staged in shared memory): every reduction,
    empty rows (first and last too), a row holding every column cut into slices, with and without
    a degree order; the instances are the _staged ones and the launch carries the stage; the
    NaN-poisoned output fully written and equal to the float64 reference, twice in a row."""
    from spcompile.kernels.csr.template import CrcCwm, chunk_entries

    def staged(mod, p):
        assert all(n.endswith("_staged") or "_staged_mb" in n for n, _ in mod.kernel.meta["instances"])
        vec = int(mod.kernel.meta["vec"])
        groups = 32 * p["warps_per_block"] // p["group"]
        chunk = chunk_entries(p["group"], p["unroll"], 2)
        assert chunk == max(4, p["unroll"])
        esize = 4 if dtype == "float32" else 2
        assert mod.kernel.launch_spec(vec).smem == groups * chunk * (8 + p["cf"] * p["group"] * vec * esize)
        assert CrcCwm.stage_bytes(mod.kernel.params, vec, dtype) == chunk * p["cf"] * p["group"] * vec * esize

    _check_crc_cwm(dtype, tol, K, [({"flat": 2, **p}, ["reorder.degree"] if i % 2 else [])
                                   for i, p in enumerate(STAGED_SPMM_PARAMS)], staged)


def _ell_matrix(width):
    """613 x 587 (non-square) with rows of 0 .. ``width`` nonzeros: the first and last rows empty,
    every 7th row exactly ``width`` long, column 3 in every 5th non-empty row."""
    from conftest import bounded_rows

    return bounded_rows(613, 587, width, 5 + width, shared_col=3)


#: ELL rows (flat=4): every row's ids at s * unroll, no row pointer before them; 16-byte lanes in
#: one- and two-slice shapes under the launch bounds quick selection gives them, fewer entries
#: than lanes (32-lane groups of 4-byte lanes), four ids a lane, and groups of one to four rows
#: (the next row's ids loaded while this row's X rows load)
ELL_SPMM_PARAMS = (
    {"group": 8, "vec": 4, "cf": 1, "warps_per_block": 4, "unroll": 4, "min_blocks": 6},
    {"group": 4, "vec": 4, "cf": 2, "warps_per_block": 4, "unroll": 4, "min_blocks": 4, "rows_per_warp": 4},
    {"group": 32, "vec": 1, "cf": 2, "warps_per_block": 2, "unroll": 8, "rows_per_warp": 2},
    {"group": 4, "vec": 2, "cf": 1, "warps_per_block": 8, "unroll": 16, "rows_per_warp": 3})


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("K", [1, 33, 72, 128])
def test_ell_spmm_rows(dtype, tol, K):
    """csr.crc_cwm with flat=4 (ELL rows): every reduction, empty rows (first and last too), rows
    of exactly the width, a non-square matrix, with and without a degree order; the instances
    are the _ell ones, the ids padded to the width a row, no shared memory; the NaN-poisoned
    output fully written and equal to the float64 reference, twice in a row."""
    def ell_rows(mod, p):
        assert all("_ell" in n for n, _ in mod.kernel.meta["instances"])
        assert mod.kernel.arrays["indices"].size == mod.kernel.arrays["seg_out"].size * p["unroll"]
        assert mod.kernel.launch_spec(int(mod.kernel.meta["vec"])).smem == 0

    for i, p in enumerate(ELL_SPMM_PARAMS):
        _check_crc_cwm(dtype, tol, K, [({"flat": 4, "max_seg": 0, **p}, ["reorder.degree"] if i % 2 else [])],
                       ell_rows, matrix=_ell_matrix(p["unroll"]))


#: staged segments (flat=3): one-row groups with hub slices reduced across the warp (shuffles) and
#: across the block (32-lane groups, shared memory over the stage), several segments a group one
#: after another, chunks of 4-32 entries, 2- to 16-byte copies, launch bounds
SEG_STAGED_SPMM_PARAMS = (
    {"group": 16, "vec": 4, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 32, "unroll": 8,
     "min_blocks": 4, "warp_combine": 1},
    {"group": 8, "vec": 2, "cf": 2, "warps_per_block": 4, "rows_per_warp": 3, "max_seg": 64, "unroll": 16},
    {"group": 32, "vec": 4, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 32, "unroll": 8,
     "warp_combine": 1},
    {"group": 32, "vec": 1, "cf": 2, "warps_per_block": 2, "rows_per_warp": 1, "max_seg": 0, "unroll": 32},
    {"group": 4, "vec": 4, "cf": 1, "warps_per_block": 8, "rows_per_warp": 1, "max_seg": 16, "unroll": 4,
     "min_blocks": 8, "warp_combine": 2},
    # the narrow-group twin quick selection measures on tiny rows (CrcCwm.narrow_groups)
    {"group": 4, "vec": 4, "cf": 2, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 32, "unroll": 4,
     "min_blocks": 4, "warp_combine": 1})


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("K", [1, 33, 72, 128])
def test_segment_staged_spmm(dtype, tol, K):
    """csr.crc_cwm with flat=3 (segments one after another, each chunk's X slices staged in shared
    memory): every reduction, empty rows, a row holding every column cut into slices (combined
    across groups, warps or the block), with and without a degree order; the instances are the
    _seg_staged ones, no flat groups, and the launch carries the stage; the NaN-poisoned output
    fully written and equal to the float64 reference, twice in a row."""
    from spcompile.kernels.csr.template import CrcCwm, chunk_entries

    def seg_staged(mod, p):
        assert all("_seg_staged" in n for n, _ in mod.kernel.meta["instances"])
        assert mod.kernel.arrays["grp_seg"].size == 0
        vec = int(mod.kernel.meta["vec"])
        chunk = chunk_entries(p["group"], p["unroll"], 3)
        esize = 4 if dtype == "float32" else 2
        assert CrcCwm.stage_bytes(mod.kernel.params, vec, dtype) == chunk * p["cf"] * p["group"] * vec * esize
        assert mod.kernel.launch_spec(vec).smem >= 32 * p["warps_per_block"] // p["group"] * chunk * (
            8 + p["cf"] * p["group"] * vec * esize)

    _check_crc_cwm(dtype, tol, K, [({"flat": 3, **p}, ["reorder.degree"] if i % 2 else [])
                                   for i, p in enumerate(SEG_STAGED_SPMM_PARAMS)], seg_staged)


#: eight row segments per row group, one after another (rows_per_warp=8 is in the tuner's space)
ROWS_PER_WARP_SPMM_PARAMS = (
    {"group": 16, "vec": 4, "cf": 1, "warps_per_block": 4, "rows_per_warp": 8, "max_seg": 32, "unroll": 2},
    {"group": 32, "vec": 4, "cf": 2, "warps_per_block": 8, "rows_per_warp": 8, "max_seg": 0, "unroll": 1})


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2)])
@pytest.mark.parametrize("K", [1, 33, 128])
def test_eight_rows_per_warp_spmm(dtype, tol, K):
    """csr.crc_cwm with rows_per_warp=8 (without flat): every reduction, split long rows, empty
    rows, with and without a degree order; the NaN-poisoned output fully written and equal to the
    float64 reference, twice."""
    _check_crc_cwm(dtype, tol, K, [(p, ["reorder.degree"] if i == 1 else [])
                                   for i, p in enumerate(ROWS_PER_WARP_SPMM_PARAMS)])


MIN_BLOCKS_SPMM_PARAMS = (
    {"group": 32, "vec": 4, "cf": 1, "warps_per_block": 8, "rows_per_warp": 1, "max_seg": 64, "unroll": 1, "min_blocks": 8},
    {"group": 16, "vec": 2, "cf": 2, "warps_per_block": 4, "rows_per_warp": 2, "max_seg": 16, "unroll": 4, "min_blocks": 6},
    {"group": 8, "vec": 1, "cf": 4, "warps_per_block": 2, "rows_per_warp": 4, "max_seg": 32, "unroll": 8, "min_blocks": 8,
     "flat": 1})


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("K", [1, 33, 128])
def test_min_blocks_spmm(dtype, tol, K):
    """csr.crc_cwm under launch bounds of 6 / 8 resident blocks (registers capped at 40 / 32, the
    split-row combine spilling): every reduction, split rows (a row holding every column), empty
    rows, one-row and flat groups; the NaN-poisoned output fully written and equal to the float64
    reference, twice in a row (the split-row counters reset)."""
    def launch_bounded(mod, p):
        assert all(n.endswith(f"_mb{p['min_blocks']}") for n, _ in mod.kernel.meta["instances"])

    _check_crc_cwm(dtype, tol, K, [(p, None) for p in MIN_BLOCKS_SPMM_PARAMS], launch_bounded)


#: the split-row combine capped at 16 values a lane (combine_vals): unroll x vec above 16 with a
#: row split into many slices (max_seg 16: 94 slices of the full row), a flat stream, launch bounds
CAPPED_COMBINE_SPMM_PARAMS = (
    {"group": 8, "vec": 8, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 16, "unroll": 8},
    {"group": 16, "vec": 8, "cf": 2, "warps_per_block": 4, "rows_per_warp": 2, "max_seg": 64, "unroll": 4},
    {"group": 8, "vec": 4, "cf": 1, "warps_per_block": 2, "rows_per_warp": 4, "max_seg": 32, "unroll": 8, "flat": 1},
    {"group": 32, "vec": 8, "cf": 1, "warps_per_block": 8, "rows_per_warp": 1, "max_seg": 32, "unroll": 8,
     "min_blocks": 4})


@pytest.mark.parametrize("dtype, tol", [("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("K", [1, 33, 128])
def test_capped_combine_spmm(dtype, tol, K):
    """csr.crc_cwm with combine_vals=16 (quick selection's second-round variant for 16-bit X / Y):
    every reduction, a row holding every column combined from tens of slices, empty rows, one-row,
    two-row, flat and launch-bounded groups; the instances are the _cq16 ones; the NaN-poisoned
    output fully written and equal to the float64 reference, twice in a row."""
    def capped(mod, p):
        assert all(n.endswith("_cq16") for n, _ in mod.kernel.meta["instances"])

    _check_crc_cwm(dtype, tol, K, [({**p, "combine_vals": 16}, ["reorder.degree"] if i == 1 else [])
                                   for i, p in enumerate(CAPPED_COMBINE_SPMM_PARAMS)], capped)


#: 16 X rows in flight a lane (unroll 16): chunks of two column ids a lane in 4- and 8-lane
#: groups (a chunk wider than the group), one id a lane in 32-lane groups; rows split into many
#: slices (its combine is always capped), two rows per group, a flat stream, launch bounds
DEEP_UNROLL_SPMM_PARAMS = (
    {"group": 8, "vec": 8, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 16, "unroll": 16},
    {"group": 4, "vec": 8, "cf": 2, "warps_per_block": 2, "rows_per_warp": 2, "max_seg": 64, "unroll": 16},
    {"group": 8, "vec": 4, "cf": 1, "warps_per_block": 4, "rows_per_warp": 4, "max_seg": 32, "unroll": 16, "flat": 1},
    {"group": 32, "vec": 8, "cf": 1, "warps_per_block": 8, "rows_per_warp": 1, "max_seg": 0, "unroll": 16,
     "min_blocks": 4})


@pytest.mark.parametrize("dtype, tol", [("float16", 2e-2), ("bfloat16", 5e-2), ("float32", 1e-5)])
@pytest.mark.parametrize("K", [1, 33, 128])
def test_deep_unroll_spmm(dtype, tol, K):
    """csr.crc_cwm with unroll=16 (quick selection's second-round variant for 16-bit X / Y):
    every reduction, chunks wider than the row group, a row holding every column combined from
    tens of slices, empty rows, one-, two- and four-row groups, flat and launch-bounded; the
    instances are the _u16 ones with twice the group's shared memory where the chunk is wider;
    the NaN-poisoned output fully written and equal to the float64 reference, twice in a row."""
    from spcompile.kernels.csr.template import chunk_entries

    def deep(mod, p):
        assert all("_u16" in n for n, _ in mod.kernel.meta["instances"])
        spec = mod.kernel.launch_spec(int(p["vec"]))
        assert spec.smem == (32 * p["warps_per_block"] // p["group"]) * chunk_entries(p["group"], 16) * 8

    _check_crc_cwm(dtype, tol, K, [(deep_unroll_params(p, dtype), ["reorder.degree"] if i == 1 else [])
                                   for i, p in enumerate(DEEP_UNROLL_SPMM_PARAMS)], deep)


#: the lean instances of spmm_crc_cwm.cu (lean_of: unroll 16, or unroll 8 in 8-lane groups): full
#: chunks without bound checks next to partial ones, split and whole long rows, the capped combine
#: and warp-combined slices, two column slices a lane, a flat stream (its lean addresses only); the
#: segment layout's unroll 8 in 8-lane groups fetches each chunk's ids a chunk ahead
LEAN_SPMM_PARAMS = (
    {"group": 8, "vec": 8, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 64, "unroll": 8},
    {"group": 8, "vec": 8, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 64, "unroll": 8,
     "combine_vals": 16, "warp_combine": 1},
    {"group": 8, "vec": 8, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 64, "unroll": 16,
     "warp_combine": 1},
    {"group": 16, "vec": 8, "cf": 1, "warps_per_block": 2, "rows_per_warp": 1, "max_seg": 32, "unroll": 16},
    {"group": 8, "vec": 4, "cf": 2, "warps_per_block": 4, "rows_per_warp": 2, "max_seg": 0, "unroll": 8},
    {"group": 8, "vec": 8, "cf": 1, "warps_per_block": 4, "rows_per_warp": 4, "max_seg": 32, "unroll": 8, "flat": 1})


@pytest.mark.parametrize("dtype, tol", [("float16", 2e-2), ("bfloat16", 5e-2), ("float32", 1e-5)])
@pytest.mark.parametrize("K", [1, 7, 64, 72, 128])
def test_lean_spmm_full_chunks(dtype, tol, K):
    """csr.crc_cwm's lean instances (32-bit row addresses, full chunks without bound checks):
    every reduction on a matrix of short rows (partial chunks), a band of 40-entry rows (full
    chunks and a partial one) and a row holding every column, K not a multiple of the column
    tile; the NaN-poisoned output fully written and equal to the float64 reference, twice."""
    def lean(mod, p):
        assert all(f"_g{p['group']}_u{p['unroll']}" in n for n, _ in mod.kernel.meta["instances"])

    _check_crc_cwm(dtype, tol, K, [(deep_unroll_params(p, dtype), ["reorder.degree"] if i % 2 else [])
                                   for i, p in enumerate(LEAN_SPMM_PARAMS)], lean)


#: warp-reduced slices of split rows (warp_combine): 8-, 4- and 2-group warps, short slices (a row
#: holding every column cut into tens of warps' slices), unroll 16 and the capped combine, launch
#: bounds, several column tiles
WARP_COMBINE_SPMM_PARAMS = (
    {"group": 8, "vec": 8, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 8, "unroll": 2},
    {"group": 4, "vec": 4, "cf": 2, "warps_per_block": 2, "rows_per_warp": 1, "max_seg": 16, "unroll": 8},
    {"group": 16, "vec": 4, "cf": 1, "warps_per_block": 8, "rows_per_warp": 1, "max_seg": 32, "unroll": 16},
    {"group": 8, "vec": 8, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 16, "unroll": 8,
     "combine_vals": 16, "min_blocks": 4},
    # 32-lane groups: the block's warps reduce through shared memory (8, 4 and 2 warps)
    {"group": 32, "vec": 4, "cf": 2, "warps_per_block": 8, "rows_per_warp": 1, "max_seg": 8, "unroll": 2},
    {"group": 32, "vec": 4, "cf": 1, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 16, "unroll": 8,
     "min_blocks": 4},
    {"group": 32, "vec": 2, "cf": 4, "warps_per_block": 2, "rows_per_warp": 1, "max_seg": 32, "unroll": 4})


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("float16", 2e-2), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("K", [1, 33, 128])
def test_warp_combine_spmm(dtype, tol, K):
    """csr.crc_cwm with warp_combine 1 / 2: every reduction, the split rows' slices reduced across
    each combine unit's row groups (a warp's narrower groups by shuffles, a block's 32-lane
    groups through shared memory; flagged slots, one per unit) before the combine, rows a unit
    holds whole written by it (2: every split row of fewer slices than the unit's groups), empty
    rows, with and without a degree order; the NaN-poisoned output fully written and equal to the
    float64 reference, twice in a row (the split-row counters reset)."""
    from spcompile.kernels.base import get_template
    from spcompile.kernels.csr.packer import WARP_ROW, WARP_SLICES

    def warp_reduced(mod, p):
        slot = mod.kernel.arrays["seg_slot"]
        W = 32 // p["group"] if p["group"] < 32 else p["warps_per_block"]
        assert get_template("csr.crc_cwm").warp_slices(mod.kernel.params) == W
        assert (slot >= WARP_SLICES).sum() >= 2 * W
        assert p["warp_combine"] == 1 or (slot == WARP_ROW).sum() >= 2 * W

    _check_crc_cwm(dtype, tol, K, [({**deep_unroll_params(p, dtype), "warp_combine": wc},
                                    ["reorder.degree"] if i == 1 else [])
                                   for wc in (1, 2) for i, p in enumerate(WARP_COMBINE_SPMM_PARAMS)], warp_reduced)


def deep_unroll_params(p, dtype):
    """``p`` with at most 16 bytes a vector load of ``dtype`` (fp32: 4 elements)."""
    return {**p, "vec": min(int(p["vec"]), 4)} if dtype == "float32" else dict(p)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("K", [1, 33, 128, 256])
def test_window_matches_reference(dtype, K):
    """csr.window through the public build: every reduction, with and without RCM, NaN-poisoned
    outputs passed as ``out=``, against the float64 reference of the (rounded) inputs; a copy of X
    one element off its vector alignment runs the VEC = 1 fallback to the same result."""
    import torch

    from spcompile.core import numerics, reference
    from spcompile.core.formats import as_csr

    A = _window_matrix()
    m, n = A.shape
    tdt = getattr(torch, dtype)
    tol = numerics.tolerance(dtype)
    X = torch.randn(n, K, device="cuda").to(tdt)
    Xh = X.double().cpu().numpy()
    flat = torch.empty(n * K + 1, device="cuda", dtype=tdt)
    Xoff = flat[1:].view(n, K)                      # one element past an aligned allocation
    Xoff.copy_(X)
    checked = 0
    for i, reduce in enumerate(("sum", "max", "min", "mean")):
        ref = reference.spmm(as_csr(A), Xh, reduce)
        # every reduction runs the heuristic and two more parameter sets, in turn
        for p in (WINDOW_PARAMS[0], WINDOW_PARAMS[1 + i % 4], WINDOW_PARAMS[1 + (i + 1) % 4]):
            pipe = ["reorder.rcm"] if i % 2 else None
            mod = spcompile.build(A, "spmm", K=K, reduce=reduce, target="cuda", dtype=dtype, template="csr.window",
                                  params=dict(p), pipeline=pipe)
            k = mod.kernel
            assert mod.config.template == "csr.window"
            if p:
                assert k.chunk(int(k.meta["vec"])) == p["chunk"]
                assert np.diff(k.arrays["win_ptr"]).max() > p["chunk"]      # windows span several chunks
            for x in ((X, Xoff) if int(k.meta["vec"]) > 1 else (X,)):
                out = torch.full((m, K), float("nan"), device="cuda", dtype=tdt)
                assert mod(x, out=out) is out
                torch.cuda.synchronize()
                got = out.double().cpu().numpy()
                assert np.all(np.isfinite(got)), (reduce, p)
                err = reference.rel_error(got, ref)
                assert err <= tol, (reduce, p, err)
                checked += 1
            y = mod(X)                                  # a fresh output of the module's own
            assert y.dtype == tdt and y.shape == (m, K)
            assert reference.rel_error(y.double().cpu().numpy(), ref) <= tol
    assert checked >= 12


def test_window_numpy_inputs_and_empty_matrix():
    """csr.window called with host arrays; an all-empty matrix writes zeros over a NaN output."""
    import scipy.sparse as sp
    import torch

    from spcompile.core import reference
    from spcompile.core.formats import as_csr

    A = _window_matrix()
    X = np.random.default_rng(1).standard_normal((A.shape[1], 48)).astype(np.float32)
    mod = spcompile.build(A, "spmm", K=48, reduce="mean", target="cuda", template="csr.window",
                          params={"chunk": 16, "nbuf": 2})
    y = mod(X)
    assert isinstance(y, np.ndarray) and reference.rel_error(y, reference.spmm(as_csr(A), X, "mean")) <= 1e-5
    E = sp.csr_matrix((37, 20), dtype=np.float32)
    for reduce in ("sum", "max"):
        emod = spcompile.build(E, "spmm", K=20, reduce=reduce, target="cuda", template="csr.window")
        out = torch.full((37, 20), float("nan"), device="cuda")
        emod(torch.randn(20, 20, device="cuda"), out=out)
        assert torch.equal(out.cpu(), torch.zeros(37, 20))
