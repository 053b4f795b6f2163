"""Matrix values passed at call time (``mod(X, values=v)``) and modules pickled through their
artifact bytes."""
from __future__ import annotations

import os

import pickle

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.core import reference
from spcompile.core.formats import as_csr
from spcompile.kernels import get_template

from conftest import random_matrix

# torch is a test dependency (the [test] extra, .ci/run): in CI a missing torch fails, never skips
torch = __import__("torch") if os.environ.get("CI") else pytest.importorskip("torch")


def _with_values(A, v):
    C = as_csr(A)
    return sp.csr_matrix((np.asarray(v, np.float64), C.indices, C.indptr), shape=C.shape)


@pytest.mark.parametrize("pipeline", [None, [{"name": "reorder.rcm"}]])
@pytest.mark.parametrize("reduce", ["sum", "max", "mean"])
def test_spmm_call_values_match_reference(reduce, pipeline):
    A = random_matrix(37, 29, density=0.15, seed=3)
    mod = spcompile.build(A, "spmm", K=6, reduce=reduce, target="cpu", template="cpu.csr_spmm",
                          pipeline=pipeline)
    assert mod.supports_call_values
    if pipeline:
        assert mod.values_src is not None and not np.array_equal(mod.values_src, np.arange(A.nnz))
    rng = np.random.default_rng(1)
    X = rng.standard_normal((29, 6)).astype(np.float32)
    built = mod(X).copy()
    assert reference.rel_error(built, reference.run("spmm", reduce, as_csr(A), X)) < 1e-5
    for trial in range(2):   # new values each call, numpy and torch
        v = rng.standard_normal(A.nnz)
        ref = reference.run("spmm", reduce, as_csr(_with_values(A, v)), X)
        got = mod(X, values=v.astype(np.float32)) if trial == 0 else mod(torch.from_numpy(X),
                                                                         values=torch.from_numpy(v)).numpy()
        assert reference.rel_error(got, ref) < 1e-5
    # a call without values uses the built values again, never the last call's
    assert np.array_equal(mod(X), built)


def test_same_tensor_rewritten_only_when_changed():
    A = random_matrix(21, 17, density=0.2, seed=8)
    mod = spcompile.build(A, "spmm", K=3, target="cpu", template="cpu.csr_spmm", pipeline=[{"name": "reorder.rcm"}])
    X = np.random.default_rng(3).standard_normal((17, 3)).astype(np.float32)
    C = as_csr(A)
    v = torch.randn(A.nnz, dtype=torch.float64)
    w = torch.randn(A.nnz)

    def ref(vals):
        return reference.run("spmm", "sum", as_csr(_with_values(C, vals.numpy())), X)

    assert reference.rel_error(mod(X, values=v), ref(v)) < 1e-5
    v.mul_(-2.0)                                   # changed in place: written again
    assert reference.rel_error(mod(X, values=v), ref(v)) < 1e-5
    assert reference.rel_error(mod(X, values=w), ref(w)) < 1e-5
    assert reference.rel_error(mod(X, values=v), ref(v)) < 1e-5   # back to v after w
    assert reference.rel_error(mod(X), reference.run("spmm", "sum", C, X)) < 1e-5
    assert reference.rel_error(mod(X, values=v), ref(v)) < 1e-5   # and again after the built values
    # a failed call leaves nothing remembered: the next call with that tensor writes it
    bad = torch.zeros(A.nnz, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="on the host"):
        mod(X, values=bad)
    assert reference.rel_error(mod(X, values=w), ref(w)) < 1e-5


def test_sddmm_call_values():
    A = random_matrix(23, 31, density=0.2, seed=5)
    mod = spcompile.build(A, "sddmm", K=5, target="cpu", pipeline=[{"name": "reorder.rcm"}],
                          template="cpu.csr_sddmm")
    rng = np.random.default_rng(2)
    X, Y = rng.standard_normal((23, 5)).astype(np.float32), rng.standard_normal((31, 5)).astype(np.float32)
    v = rng.standard_normal(A.nnz)
    got = mod(X, Y, values=v)
    ref = reference.run("sddmm", None, as_csr(_with_values(A, v)), X, Y)
    assert reference.rel_error(got, ref) < 1e-5
    assert reference.rel_error(mod(X, Y), reference.run("sddmm", None, as_csr(A), X, Y)) < 1e-5


def test_every_cpu_template_takes_call_values():
    """Whichever CPU template a plain build picks (quick selection times SciPy against the
    compiled kernels, so the pick depends on the machine), ``mod(X, values=v)`` works."""
    from spcompile.kernels import list_templates

    names = [t.name for t in list_templates("cpu")]
    assert {"cpu.csr_spmm", "cpu.csr_sddmm", "extern.scipy"} <= set(names)
    assert all(get_template(n).call_values_array == "data" for n in names)


def test_call_values_errors(monkeypatch):
    A = random_matrix(10, 10, density=0.3, seed=1)
    mod = spcompile.build(A, "spmm", K=4, target="cpu", template="cpu.csr_spmm")
    X = np.ones((10, 4), np.float32)
    with pytest.raises(ValueError, match=r"values has shape \(3,\), expected"):
        mod(X, values=np.ones(3, np.float32))
    with pytest.raises(TypeError, match="floating point"):
        mod(X, values=np.ones(A.nnz, np.int64))
    assert get_template("cpu.csr_spmm").call_values_array == "data"
    for name in ("extern.cusparse", "tc.vnm_spmm", "aspt.spmm"):
        if name in spcompile.kernels.base._TEMPLATES:
            assert get_template(name).call_values_array is None
    # a template whose format bakes the values in: a call with values is an error, not old values
    monkeypatch.delitem(spcompile.kernels.base.CALL_VALUE_ARRAYS, "cpu.csr_spmm")
    assert not mod.supports_call_values
    with pytest.raises(ValueError, match="bakes the matrix values"):
        mod(X, values=np.ones(A.nnz, np.float32))


def test_save_after_call_values_keeps_built_values(tmp_path):
    A = random_matrix(15, 12, density=0.3, seed=7)
    mod = spcompile.build(A, "spmm", K=3, target="cpu", pipeline=[{"name": "reorder.rcm"}],
                          template="cpu.csr_spmm")
    X = np.random.default_rng(0).standard_normal((12, 3)).astype(np.float32)
    built = mod(X).copy()
    mod(X, values=np.zeros(A.nnz, np.float32))
    path = mod.save(str(tmp_path / "m.spc"))
    back = spcompile.load(path, A)
    assert np.array_equal(back(X), built)
    # the value permutation travels with the artifact
    assert np.array_equal(back.values_src, mod.values_src)
    v = np.arange(A.nnz, dtype=np.float32)
    assert np.array_equal(back(X, values=v), mod(X, values=v))


def test_pickle_roundtrip():
    A = random_matrix(19, 14, density=0.25, seed=9)
    mod = spcompile.build(A, "spmm", K=4, reduce="max", target="cpu", pipeline=[{"name": "reorder.rcm"}],
                          template="cpu.csr_spmm")
    X = np.random.default_rng(4).standard_normal((14, 4)).astype(np.float32)
    back = pickle.loads(pickle.dumps(mod))
    assert back is not mod and back.config == mod.config and back.key == mod.key
    assert np.array_equal(back(X), mod(X))
    assert back.matrix is not None and np.array_equal(back.matrix.indices, mod.matrix.indices)
    v = np.random.default_rng(5).standard_normal(A.nnz).astype(np.float32)
    assert np.array_equal(back(X, values=v), mod(X, values=v))
    # bytes round trip with the matrix check
    assert np.array_equal(spcompile.module.loads(mod.to_bytes(), A)(X), mod(X))
    with pytest.raises(spcompile.ArtifactError, match="different matrix"):
        spcompile.module.loads(mod.to_bytes(), random_matrix(19, 14, density=0.25, seed=10))
