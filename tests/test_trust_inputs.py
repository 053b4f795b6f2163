"""Ordinary inputs that used to crash or go wrong: read-only arrays, outputs aliasing inputs,
NaN in max/min reductions (CPU kernels, the CUDA templates' emulators and sources), invalid
template parameters and K, huge mostly-empty shapes."""
from __future__ import annotations

import pathlib
import time
import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.core import reference
from spcompile.core.formats import as_csr
from spcompile.core.ir import MAX_K, SparseModule
from spcompile.compile import make_op
from spcompile.kernels import get_template
from spcompile.passes import Pipeline

from conftest import inputs_for, random_matrix

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def A():
    return random_matrix(60, 60, density=0.08, seed=5)


@pytest.fixture(scope="module")
def spmm(A):
    return spcompile.build(A, "spmm", K=8, reduce="max", target="cpu", pipeline=["reorder.degree"])


@pytest.fixture(scope="module")
def sddmm(A):
    return spcompile.build(A, "sddmm", K=8, target="cpu", pipeline=["reorder.degree"])


def _read_only_variants(X, tmp_path):
    fb = np.frombuffer(X.tobytes(), dtype=X.dtype).reshape(X.shape)
    flag = X.copy()
    flag.setflags(write=False)
    path = tmp_path / "x.bin"
    X.tofile(path)
    mm = np.memmap(path, dtype=X.dtype, mode="r", shape=X.shape)
    strided = np.repeat(X, 2, axis=1)[:, ::2]
    strided.setflags(write=False)
    return {"frombuffer": fb, "setflags": flag, "memmap_r": mm, "strided_read_only": strided}


def test_read_only_inputs(spmm, sddmm, A, tmp_path):
    X = inputs_for("spmm", A.shape, 8)[0]
    want = spmm(X)
    for name, x in _read_only_variants(X, tmp_path).items():
        for _ in range(2):  # first (checked) call and a repeated one
            np.testing.assert_array_equal(spmm(x), want, err_msg=name)
        out = np.empty_like(want)
        np.testing.assert_array_equal(spmm(x, out=out), want, err_msg=name)
    np.testing.assert_array_equal(X, _read_only_variants(X, tmp_path)["memmap_r"])  # inputs untouched
    Xs, Ys = inputs_for("sddmm", A.shape, 8)
    want = sddmm(Xs, Ys)
    rx, ry = _read_only_variants(Xs, tmp_path / "..")["setflags"], _read_only_variants(Ys, tmp_path)["frombuffer"]
    np.testing.assert_array_equal(sddmm(rx, ry), want)


def test_read_only_output_is_refused(spmm, A):
    X = inputs_for("spmm", A.shape, 8)[0]
    out = np.empty((60, 8), np.float32)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="writable"):
        spmm(X, out=out)


def test_out_overlapping_an_input_is_refused(spmm, sddmm, A):
    torch = pytest.importorskip("torch")
    X = inputs_for("spmm", A.shape, 8)[0]
    want = spmm(X)
    with pytest.raises(ValueError, match="shares memory with input X"):
        spmm(X, out=X)
    buf = np.zeros((90, 8), np.float32)
    buf[:60] = X
    with pytest.raises(ValueError, match="shares memory"):
        spmm(buf[:60], out=buf[30:90])  # partial overlap
    np.testing.assert_array_equal(spmm(buf[:60], out=buf[:60].copy()), want)
    buf2 = np.zeros((120, 8), np.float32)
    buf2[:60] = X
    np.testing.assert_array_equal(spmm(buf2[:60], out=buf2[60:]), want)  # adjacent, no overlap
    # after a good call with the same signature (the cheap path) aliasing is still caught
    Y = np.empty_like(want)
    spmm(X, out=Y)
    with pytest.raises(ValueError, match="shares memory"):
        spmm(X, out=X)
    t = torch.from_numpy(X.copy())
    with pytest.raises(ValueError, match="shares memory"):
        spmm(t, out=t)
    Xs, Ys = inputs_for("sddmm", A.shape, 8)
    flat = np.zeros(60 * 8 + A.nnz, np.float32)
    flat[:480] = Xs.ravel()
    with pytest.raises(ValueError, match="shares memory with input X"):
        sddmm(flat[:480].reshape(60, 8), Ys, out=flat[400:400 + A.nnz])
    with pytest.raises(ValueError, match="shares memory with input Y"):
        sddmm(Xs, flat[:480].reshape(60, 8), out=flat[470:470 + A.nnz])


# -- NaN -----------------------------------------------------------------------------------------

def _nan_inputs(shape, K, seed=0):
    X = np.random.default_rng(seed).standard_normal((shape[1], K)).astype(np.float32)
    X[3, 1] = np.nan
    X[7, :] = np.inf          # inf * 0-valued entries gives NaN too
    X[11, 2] = -np.inf
    return X


def _same_nan(out, ref):
    assert np.array_equal(np.isnan(out), np.isnan(ref)), (np.argwhere(np.isnan(out) != np.isnan(ref))[:5])
    fin = ~np.isnan(ref)
    assert np.array_equal(np.isinf(out[fin]), np.isinf(ref[fin]))
    ok = fin & np.isfinite(ref)
    np.testing.assert_allclose(out[ok], ref[ok], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", ["max", "min", "sum", "mean"])
@pytest.mark.parametrize("params", [{"k_tile": 1, "parallel": False}, {"k_tile": 8, "parallel": True},
                                    {"k_tile": 4, "tile_order": "task", "prefetch": 4}])
def test_cpu_reductions_propagate_nan_like_the_reference(reduce, params):
    A = random_matrix(50, 40, density=0.15, seed=1)
    A.data[::7] = 0.0  # explicit zeros: inf * 0 = NaN in the reference as well
    X = _nan_inputs(A.shape, 8)
    mod = spcompile.build(A, "spmm", K=8, reduce=reduce, target="cpu", params=params)
    ref = reference.run("spmm", reduce, as_csr(A), X)
    assert np.isnan(ref).any()
    _same_nan(mod(X), ref)


def test_cpu_sddmm_nan():
    A = random_matrix(40, 30, density=0.2, seed=2)
    X, Y = inputs_for("sddmm", A.shape, 5)
    X[2, 1] = np.nan
    mod = spcompile.build(A, "sddmm", K=5, target="cpu")
    _same_nan(mod(X, Y), reference.run("sddmm", None, as_csr(A), X, Y))


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_cuda_emulators_propagate_nan(reduce):
    from spcompile.kernels.aspt import emulate as aspt_em
    from spcompile.kernels.csr import emulate as csr_em

    A = random_matrix(80, 64, density=0.1, seed=4)
    K = 33
    X = _nan_inputs(A.shape, K, seed=1)
    ref = reference.run("spmm", reduce, as_csr(A), X)
    assert np.isnan(ref).any()
    mod = Pipeline([])(SparseModule.from_op(make_op(A, "spmm", K, reduce)))
    t = get_template("csr.crc_cwm")
    for max_seg in (0, 4):
        k = t.build(mod, {**t.default_params(mod), "max_seg": max_seg}, compile=False)
        for fallback in (False, True):
            _same_nan(csr_em.emulate_kernel(k, X, fallback=fallback), ref)
    at = get_template("aspt.tiled")
    amod = Pipeline(["tile.aspt"])(SparseModule.from_op(make_op(A, "spmm", K, reduce)))
    k = at.build(amod, at.default_params(amod), compile=False)
    for fallback in (False, True):
        _same_nan(aspt_em.emulate_kernel(k, X, fallback=fallback), ref)


def test_cuda_sources_propagate_nan():
    """The CUDA templates' reductions (nvcc sources and the TensorIR CUDA kernel) use the
    NaN-propagating comparisons, not fmaxf / fminf or TIR max / min (which drop NaN);
    tests/test_cuda_compile.py compiles them with nvcc."""
    for src in ("spcompile/kernels/csr/spmm_crc_cwm.cu", "spcompile/kernels/aspt/aspt_tiled.cu"):
        text = (REPO / src).read_text()
        assert "fmaxf(" not in text and "fminf(" not in text, src
        assert "isnan(v)" in text, src
    assert "sticky_nan<R>(v)" in (REPO / "spcompile/kernels/aspt/aspt_tiled.cu").read_text()
    cu = (REPO / "spcompile/kernels/tvm/cuda_csr.py").read_text()
    assert "T.max(acc" not in cu and "T.min(acc" not in cu and "_nan_max(T, acc" in cu


# -- parameters and K ----------------------------------------------------------------------------

@pytest.mark.parametrize("params,name", [
    ({"k_tile": -5}, "k_tile"), ({"k_tile": 0}, "k_tile"), ({"k_tile": 2 ** 40}, "k_tile"),
    ({"k_tile": 2.5}, "k_tile"), ({"k_tile": "8"}, "k_tile"), ({"tasks_per_thread": 0}, "tasks_per_thread"),
    ({"tasks_per_thread": -1}, "tasks_per_thread"), ({"balance": "fast"}, "balance"),
    ({"parallel": 1}, "parallel"), ({"tile_order": None}, "tile_order"), ({"prefetch": -4}, "prefetch"),
    ({"prefetch": 10 ** 9}, "prefetch"),
])
def test_invalid_template_parameters(A, params, name):
    with pytest.raises(ValueError, match=f"parameter '{name}'"):
        spcompile.build(A, "spmm", K=8, target="cpu", params=params)


@pytest.mark.parametrize("template,params,name", [
    ("csr.crc_cwm", {"cf": 0}, "cf"), ("csr.crc_cwm", {"max_seg": -1}, "max_seg"), ("csr.crc_cwm", {"unroll": 2 ** 40}, "unroll"),
    ("csr.crc_cwm", {"warps_per_block": 10 ** 7}, "warps_per_block"),
])
def test_invalid_cuda_template_parameters(A, template, params, name):
    mod = Pipeline([])(SparseModule.from_op(make_op(A, "spmm", 8, "sum")))
    with pytest.raises(ValueError, match=f"parameter '{name}'|{name}="):
        get_template(template).check_params(mod, params)


def test_valid_parameters_outside_the_tuned_choices_still_build(A):
    mod = spcompile.build(A, "spmm", K=8, target="cpu", params={"k_tile": 3, "tasks_per_thread": 3, "prefetch": 0})
    X = inputs_for("spmm", A.shape, 8)[0]
    np.testing.assert_allclose(mod(X), reference.run("spmm", "sum", as_csr(A), X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K,exc", [(0, ValueError), (-3, ValueError), (2 ** 40, ValueError), (MAX_K + 1, ValueError),
                                   (2.0, TypeError), (True, TypeError)])
def test_absurd_K(A, K, exc):
    with pytest.raises(exc, match="K"):
        spcompile.build(A, "spmm", K=K, target="cpu")


# -- huge, mostly empty shapes -------------------------------------------------------------------

def test_huge_empty_shape_builds_linear_in_rows():
    """3 nonzeros and 2**20 .. 2**22 rows: peak memory per row constant (and small), time about
    linear; the module computes the right rows."""
    spcompile.build(sp.random(5, 5, density=0.5, format="csr", dtype=np.float32), "spmm", K=4, target="cpu")
    per_row, secs = [], []
    for m in (1 << 20, 1 << 21, 1 << 22):
        A = sp.csr_matrix((np.array([1, 2, 3], np.float32), (np.array([0, 5, m - 1]), np.array([1, 2, 3]))),
                          shape=(m, 4))
        tracemalloc.start()
        t = time.perf_counter()
        mod = spcompile.build(A, "spmm", K=4, reduce="max", target="cpu")
        secs.append(time.perf_counter() - t)
        per_row.append(tracemalloc.get_traced_memory()[1] / m)
        tracemalloc.stop()
        X = np.arange(16, dtype=np.float32).reshape(4, 4)
        Y = mod(X)
        np.testing.assert_array_equal(Y[[0, 5, m - 1]], np.array([1, 2, 3], np.float32)[:, None] * X[[1, 2, 3]])
        assert not Y[1:5].any() and not Y[6:m - 1].any()
    assert max(per_row) <= 28, per_row  # bytes per row at peak (see the README's limits)
    assert max(per_row) / min(per_row) < 1.3, per_row
    assert secs[2] < 8 * max(secs[0], 0.05) + 1.0, secs
