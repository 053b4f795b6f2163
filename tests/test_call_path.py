"""The module call path: array adapters (runtime/arrays.py), the plan a first checked call makes
and the cheap signature check later calls pass, and the CUDA run step with a recording kernel
(no GPU: numpy arrays stand in for device arrays through an adapter that places them on device 0).
Tests of torch tensors take the ``torch`` fixture (the optional [torch] extra)."""
from __future__ import annotations

import functools
import operator
import sys

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.compile import make_op
from spcompile.core import reference
from spcompile.core.config import Config
from spcompile.core.formats import as_csr
from spcompile.module import CompiledModule
from spcompile.runtime import arrays
from spcompile.runtime import cuda as rt
from spcompile.runtime.arrays import CUPY, DEVICE, NUMPY, TORCH, adapter_for

from conftest import random_matrix

pytestmark = pytest.mark.usefixtures("no_tuning_db")


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


class _FakeCupyArray:
    __module__ = "cupy._core.core"


def test_adapter_for_recognises_frameworks_by_type():
    had_cupy = "cupy" in sys.modules
    assert adapter_for(np.zeros(2)) is NUMPY
    assert adapter_for(np.zeros(2)[::2]) is NUMPY
    assert adapter_for(_FakeCupyArray()) is CUPY
    assert ("cupy" in sys.modules) == had_cupy            # recognised without importing CuPy
    for other in ([1.0], 3.0, None, "x", np.float32(1)):
        assert adapter_for(other) is None
    # numpy arrays go through the driver's device arrays: no GPU framework imported for them
    assert NUMPY.device_adapter is DEVICE and TORCH.device_adapter is TORCH and CUPY.device_adapter is CUPY


def test_torch_adapter(torch):
    assert adapter_for(torch.zeros(2)) is TORCH
    assert adapter_for(torch.nn.Parameter(torch.zeros(2))) is TORCH

    t = torch.zeros((3, 4))
    assert TORCH.dtype(t) == "float32" and TORCH.dtype(t.half()) == "float16" and TORCH.dtype(t.bfloat16()) == "bfloat16"
    assert TORCH.device(t) is None and NUMPY.device(np.zeros(1)) is None
    assert TORCH.ptr(t) == t.data_ptr()
    tt = torch.zeros((4, 3)).t()
    assert not TORCH.is_contiguous(tt) and TORCH.is_contiguous(TORCH.contiguous(tt))
    assert torch.equal(TORCH.contiguous(tt), tt) and TORCH.contiguous(t) is t
    a = np.zeros((4, 3), np.float32).T
    assert not NUMPY.is_contiguous(a) and NUMPY.contiguous(a).flags.c_contiguous
    new = TORCH.allocator((2, 5), "bfloat16", None)()
    assert new.shape == (2, 5) and new.dtype == torch.bfloat16 and new.device.type == "cpu"
    assert NUMPY.allocator((2, 5), "float16", None)().dtype == np.float16
    with pytest.raises(ValueError, match=r"shape \(3, 5\), expected \(3, 4\) \(the module was built for K=4\)"):
        TORCH.check(torch.zeros((3, 5)), "X", (3, 4), "float32")
    with pytest.raises(TypeError, match=r"dtype float32, expected float16 .* e\.g\. Y\.half\(\)"):
        TORCH.check(t, "Y", (3, 4), "float16")
    with pytest.raises(TypeError, match=r"e\.g\. X\.astype\(np\.float16\)"):
        NUMPY.check(np.zeros((3, 4), np.float32), "X", (3, 4), "float16")
    with pytest.raises(TypeError, match=r"numpy has no bfloat16 dtype.*torch\.from_numpy\(X\)\.bfloat16\(\)"):
        NUMPY.check(np.zeros((3, 4), np.float32), "X", (3, 4), "bfloat16")
    TORCH.check(t.bfloat16(), "X", (3, 4), "bfloat16")
    TORCH.check_out(torch.zeros((3, 4)), (3, 4), "float32", None)
    for bad in (torch.zeros((3, 4), dtype=torch.float64), torch.zeros((4, 3)).t(), torch.zeros((3, 5)),
                np.zeros((3, 4), np.float32)):
        with pytest.raises(ValueError, match=r"out must be a C-contiguous, writable float32 torch tensor of "
                                             r"shape \(3, 4\) on the CPU"):
            TORCH.check_out(bad, (3, 4), "float32", None)
    ro = np.zeros((3, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        NUMPY.check_out(ro, (3, 4), "float32", None)


@pytest.mark.parametrize("adapter", [NUMPY, TORCH], ids=lambda a: a.name)
def test_matcher_accepts_exactly_the_signature(adapter, request):
    torch = request.getfixturevalue("torch")
    mk = (lambda s, dt="float32": np.zeros(s, dt)) if adapter is NUMPY else \
         (lambda s, dt="float32": torch.zeros(s, dtype=getattr(torch, dt)))
    same = adapter.matcher([(5, 3), (4, 3)], (7,), "float32", None)
    X, Y, out = mk((5, 3)), mk((4, 3)), mk((7,))
    assert same((X, Y), None) and same((X, Y), out)
    assert not same((X,), None)                                  # input count
    assert not same((X, X), None)                                # shape
    assert not same((X, mk((4, 3), "float16")), None)            # dtype
    assert not same((X, mk((3, 4)).T), None)                     # not contiguous
    assert not same((X, Y), mk((8,)))                            # out shape
    assert not same((X, Y), mk((7,), "float64"))                 # out dtype
    other = torch.zeros((4, 3)) if adapter is NUMPY else np.zeros((4, 3), np.float32)
    assert not same((X, other), None) and not same((X, Y), torch.zeros(7) if adapter is NUMPY else np.zeros(7, np.float32))


# -- CPU modules: one path for numpy and torch ------------------------------------------------

@pytest.fixture(scope="module")
def cpu_mods(tmp_path_factory):
    A = random_matrix(41, 29, density=0.1, seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPCOMPILE_TUNING_DB", str(tmp_path_factory.getbasetemp() / "absent" / "none.db"))
        mods = {op: spcompile.build(A, op, K=5, reduce="max" if op == "spmm" else None, target="cpu")
                for op in ("spmm", "sddmm")}
    return A, mods


def test_cpu_module_plans_per_framework(cpu_mods, torch):
    A, mods = cpu_mods
    mod = mods["spmm"]
    X = np.random.default_rng(0).standard_normal((29, 5)).astype(np.float32)
    ref = reference.run("spmm", "max", as_csr(A), X)
    assert mod._plan is None or mod._plan.same((X,), None)
    out = np.full((41, 5), np.nan, np.float32)
    assert mod(X, out=out) is out and reference.rel_error(out, ref) < 1e-6
    plan_np = mod._plan
    assert plan_np.same((X,), out) and plan_np.same((X,), None)
    # torch CPU tensors go to the kernel as they are (DLPack), into a torch output
    Xg = torch.from_numpy(X.copy()).requires_grad_(True)
    with pytest.raises(RuntimeError, match="requires grad.*spcompile.nn.spmm"):
        mod(Xg)                     # not differentiable: an error, never a silently detached result
    with torch.no_grad():
        assert np.array_equal(mod(Xg).numpy(), out)
    Xt = torch.from_numpy(X.copy())
    outt = torch.full((41, 5), float("nan"))
    assert mod(Xt, out=outt) is outt and np.array_equal(outt.numpy(), out)
    plan_t = mod._plan
    assert plan_t is not plan_np and plan_t.same((Xt,), outt) and not plan_t.same((X,), None)
    y = mod(Xt)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and np.array_equal(y.numpy(), out)
    # back to numpy: the numpy plan is reused, not rebuilt
    assert np.array_equal(mod(X), out) and mod._plan is plan_np
    # a non-contiguous input fails the cheap check and takes the full path (copied), same result
    Xf = np.asfortranarray(X)
    assert not plan_np.same((Xf,), None)
    assert np.array_equal(mod(Xf), out) and np.array_equal(mod(torch.from_numpy(Xf)).numpy(), out)
    with pytest.raises(ValueError, match="out must be a C-contiguous, writable float32 torch tensor"):
        mod(Xt, out=torch.empty((41, 5), dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        mod(Xt, out=np.empty((41, 5), np.float32))              # out of another framework
    with pytest.raises(ValueError, match="out must be"):
        mod(X, out=torch.empty((41, 5)))


def test_cpu_sddmm_torch_and_numpy_agree(cpu_mods, torch):
    A, mods = cpu_mods
    rng = np.random.default_rng(1)
    X, Y = rng.standard_normal((41, 5)).astype(np.float32), rng.standard_normal((29, 5)).astype(np.float32)
    out = mods["sddmm"](X, Y)
    assert reference.rel_error(out, reference.run("sddmm", None, as_csr(A), X, Y)) < 1e-6
    outt = torch.full((as_csr(A).nnz,), float("nan"))
    assert mods["sddmm"](torch.from_numpy(X), torch.from_numpy(Y), out=outt) is outt
    assert np.array_equal(outt.numpy(), out)
    with pytest.raises(TypeError, match=r"inputs mix array types \['torch', 'numpy'\]"):
        mods["sddmm"](torch.from_numpy(X), Y)


def test_empty_matrix_module_writes_zeros_for_torch_too(torch):
    mod = spcompile.build(sp.csr_matrix((6, 4), dtype=np.float32), "spmm", K=3, target="cpu")
    out = torch.full((6, 3), float("nan"))
    assert mod(torch.ones((4, 3)), out=out) is out and torch.count_nonzero(out) == 0
    assert np.array_equal(mod(np.ones((4, 3), np.float32)), np.zeros((6, 3), np.float32))


# -- the CUDA run step, with a recording kernel -------------------------------------------------

class Recorder(rt.CUDAKernel):
    """A prepared CUDA kernel that records its launches (pointers and stream)."""

    _ready = True

    def __init__(self):
        super().__init__("rec", {}, {}, {}, {"dtype": "float32"})
        self.launches = []

    def launch(self, in_ptrs, out_ptr, stream):
        self.launches.append((list(in_ptrs), out_ptr, stream))


class NumpyAsDevice(type(NUMPY)):
    """numpy arrays as if on CUDA device 0 (pointers: their host addresses, stream: 7)."""

    ptr = operator.attrgetter("ctypes.data")
    device_adapter = property(lambda self: self)

    def device(self, x):
        return 0

    def allocator(self, shape, dtype, device):
        return super().allocator(shape, dtype, None)

    def stream(self, device):
        return functools.partial(abs, 7)


@pytest.fixture
def as_device(monkeypatch):
    monkeypatch.setattr(arrays, "NUMPY", NumpyAsDevice())
    return arrays.NUMPY


def ptr(x):
    return x.ctypes.data


@pytest.mark.parametrize("op", ["spmm", "sddmm"])
def test_cuda_module_runs_device_arrays_through_one_path(as_device, op):
    A = random_matrix(20, 12, density=0.2, seed=1)
    sop = make_op(A, op, 7, "sum" if op == "spmm" else None)
    kern = Recorder()
    mod = CompiledModule(sop.key(), Config("csr.crc_cwm" if op == "spmm" else "csr.sddmm", {}, (), "cuda"), kern)
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal(s).astype(np.float32) for s in mod._in_shapes]
    out = np.empty(mod._out_shape, np.float32)
    assert mod(*ins, out=out) is out                         # checked call: makes the plan
    plan = mod._plan
    assert plan is not None and plan.same(ins, out)
    y = mod(*ins)                                            # same signature, allocated output
    assert mod._plan is plan and y.shape == mod._out_shape and y.dtype == np.float32 and y is not out
    want = [ptr(x) for x in ins]
    assert kern.launches == [(want, ptr(out), 7), (want, ptr(y), 7)]
    # a non-contiguous input: full checks, a contiguous copy reaches the kernel, same plan
    nc = np.asfortranarray(ins[0])
    assert not plan.same([nc, *ins[1:]], out)
    mod(nc, *ins[1:], out=out)
    assert mod._plan is plan and kern.launches[-1][0][0] != ptr(nc) and kern.launches[-1][1] == ptr(out)
    with pytest.raises(ValueError, match=r"out must be a C-contiguous, writable float32 numpy array of shape "
                                         r".* on CUDA device 0 \(like the inputs\)"):
        mod(*ins, out=np.empty(mod._out_shape, np.float64))
    with pytest.raises(TypeError, match="dtype float64, expected float32"):
        mod(*[x.astype(np.float64) for x in ins])
    assert len(kern.launches) == 3


def test_cuda_placement_errors(as_device):
    kern = Recorder()
    X = np.zeros((3, 2), np.float32)
    assert rt.placement(kern, as_device, [X]) == 0
    kern.device_id = 1
    with pytest.raises(ValueError, match=r"inputs must be on CUDA device 1 \(the module's device\) or all on the "
                                         r"host, got \['CUDA device 0'\]"):
        rt.placement(kern, as_device, [X])
    with pytest.raises(TypeError, match="of one kind"):
        rt.call(kern, [X, [1.0]], X)
    with pytest.raises(TypeError, match="numpy has no bfloat16 dtype"):
        rt.call(kern, [X], out_shape=(3, 2), dtype="bfloat16")


def test_rt_call_uses_the_run_step(as_device):
    kern = Recorder()
    X, out = np.ones((4, 3), np.float32), np.empty((5, 3), np.float32)
    assert rt.call(kern, [X], out) is out
    assert kern(X, out=out) is out
    assert kern.launches == [([ptr(X)], ptr(out), 7)] * 2
    with pytest.raises(ValueError, match="out must be"):
        rt.call(kern, [X], out, dtype="float16")
