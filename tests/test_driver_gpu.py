"""The driver-API runtime on a GPU: device arrays (copies, zero-copy views from torch and CuPy),
loading and calling a saved CUDA module in a fresh process with neither CuPy nor torch imported
(with and without ``warm_up``), launches from a fresh thread, call-time values through every
framework, and the vendor-library template on numpy and CuPy inputs.  Skipped without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.runtime import cuda_available, driver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _matrix(seed=1, m=300, n=200):
    A = sp.random(m, n, density=0.05, format="csr", random_state=seed, dtype=np.float32)
    A = A.tolil()
    A[7, :] = 0            # an empty row
    A[11, :150] = 1.5      # a long row
    return A.tocsr()


def test_device_array_copies_and_views():
    import cupy
    import torch

    x = np.random.default_rng(0).standard_normal((33, 5)).astype(np.float32)
    d = driver.DeviceArray.from_host(x, 0)
    assert d.shape == (33, 5) and d.nbytes == x.nbytes and d.device == 0
    assert np.array_equal(d.get(), x)
    t = torch.as_tensor(d, device="cuda:0")          # a view: same memory
    assert t.data_ptr() == d.ptr and torch.equal(t.cpu(), torch.from_numpy(x))
    t.mul_(2)
    torch.cuda.synchronize()
    assert np.array_equal(d.get(), 2 * x)
    c = cupy.asarray(d)
    assert c.data.ptr == d.ptr and np.array_equal(cupy.asnumpy(c), 2 * x)
    z = driver.DeviceArray.zeros((4, 3), np.int32, 0)
    assert np.array_equal(z.get(), np.zeros((4, 3), np.int32))
    with pytest.raises(ValueError, match="cannot copy"):
        d.set(np.zeros(3, np.float32))
    e = driver.DeviceArray.from_host(np.zeros((0, 4), np.float32), 0)   # empty arrays are fine
    assert e.get().shape == (0, 4)
    assert driver.compute_capability(0)[0] >= 7 and driver.device_count() >= 1


def test_load_and_call_imports_no_gpu_framework(tmp_path):
    A = _matrix()
    X = np.random.default_rng(2).standard_normal((200, 33)).astype(np.float32)
    mod = spcompile.build(A, "spmm", K=33, target="cuda", template="csr.crc_cwm",
                          storage="sqlite:///" + str(tmp_path / "e.db"))
    p = str(mod.save(str(tmp_path / "m.spc")))
    np.save(tmp_path / "x.npy", X)
    ref = A.astype(np.float64) @ X.astype(np.float64)
    for warm in ("False", "True"):
        # CuPy and torch blocked (importing either raises): the driver alone loads and runs it
        code = (f"import sys; sys.modules['cupy'] = sys.modules['torch'] = None; "
                f"import json, numpy as np, spcompile; m = spcompile.load({p!r}, warm_up={warm}); "
                f"y = m(np.load('x.npy')); y2 = m(np.load('x.npy')); np.save('y.npy', y); "
                f"print(json.dumps([[k for k in ('cupy', 'torch', 'tvm') if sys.modules.get(k)], "
                f"bool(np.array_equal(y, y2))]))")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        loaded, same = json.loads(r.stdout.strip().splitlines()[-1])
        assert loaded == [] and same, (warm, loaded)
        y = np.load(tmp_path / "y.npy")
        assert np.abs(y - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())


def test_launch_from_a_fresh_thread_and_values_through_every_framework():
    import cupy
    import torch

    A = _matrix(3)
    rng = np.random.default_rng(4)
    X = rng.standard_normal((200, 16)).astype(np.float32)
    mod = spcompile.build(A, "spmm", K=16, target="cuda", template="csr.crc_cwm",
                          pipeline=[{"name": "reorder.rcm"}])
    Xt = torch.from_numpy(X).cuda()
    got = {}

    def work():
        got["y"] = mod(Xt).cpu().numpy()     # a thread that never used CUDA before

    th = threading.Thread(target=work)
    th.start()
    th.join()
    ref = A.astype(np.float64) @ X.astype(np.float64)
    assert np.abs(got["y"] - ref).max() <= 1e-5 * np.abs(ref).max()
    C = A.tocsr()
    v = rng.standard_normal(C.nnz)
    refv = sp.csr_matrix((v, C.indices, C.indptr), shape=C.shape) @ X.astype(np.float64)
    tol = 1e-5 * np.abs(refv).max()
    assert np.abs(mod(X, values=v.astype(np.float32)) - refv).max() <= tol
    assert np.abs(mod(Xt, values=torch.from_numpy(v).cuda()).cpu().numpy() - refv).max() <= tol
    assert np.abs(cupy.asnumpy(mod(cupy.asarray(X), values=cupy.asarray(v))) - refv).max() <= tol
    assert np.abs(mod(X) - ref).max() <= 1e-5 * np.abs(ref).max()      # back to the built values


def test_vendor_template_on_numpy_and_cupy_inputs():
    import cupy

    A = _matrix(5)
    X = np.random.default_rng(6).standard_normal((200, 24)).astype(np.float32)
    mod = spcompile.build(A, "spmm", K=24, target="cuda", template="extern.cusparse")
    ref = A.astype(np.float64) @ X.astype(np.float64)
    tol = 1e-5 * np.abs(ref).max()
    out = np.full((300, 24), np.nan, np.float32)
    assert np.abs(mod(X, out=out) - ref).max() <= tol and np.abs(out - ref).max() <= tol
    assert np.abs(cupy.asnumpy(mod(cupy.asarray(X))) - ref).max() <= tol
