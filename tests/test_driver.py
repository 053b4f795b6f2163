"""The driver-API runtime where it can be checked without a GPU: what happens with no usable
driver (clear errors, no crash), the ``warm_up`` option of :func:`spcompile.load`, and the
device-copy adapter the numpy call path uses."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.runtime import driver
from spcompile.runtime.arrays import DEVICE, NUMPY


def test_without_a_driver_nothing_crashes(monkeypatch):
    monkeypatch.setattr(driver, "_INIT", [False])
    monkeypatch.setattr(driver, "_PRIMARY", {})
    assert driver.init() is False and driver.device_count() == 0 and driver.current_device() is None
    with pytest.raises(driver.CudaError, match="not usable on this machine"):
        driver.DeviceArray((4,), np.float32, 0)
    with pytest.raises(driver.CudaError):
        driver.primary_context(0)
    assert driver.make_current(0) is False


def test_numpy_inputs_go_through_device_arrays():
    assert NUMPY.device_adapter is DEVICE
    arr = type("A", (), {"ptr": 1234, "device": 2})()
    assert DEVICE.ptr(arr) == 1234 and DEVICE.device(arr) == 2 and DEVICE.contiguous(arr) is arr
    assert DEVICE.stream(0)() == 0        # the legacy default stream: ordered with the copies


@pytest.mark.parametrize("bad", ["yes", -1, 1.0, None])
def test_load_warm_up_is_checked(tmp_path, bad, no_tuning_db):
    A = sp.random(40, 30, density=0.1, format="csr", random_state=0, dtype=np.float32)
    p = spcompile.build(A, "spmm", K=4, target="cpu", template="cpu.csr_spmm").save(str(tmp_path / "m.spc"))
    with pytest.raises(TypeError, match="warm_up must be a bool or a CUDA device index"):
        spcompile.load(p, warm_up=bad)


def test_load_warm_up_without_a_gpu_is_harmless(tmp_path, no_tuning_db):
    A = sp.random(40, 30, density=0.1, format="csr", random_state=0, dtype=np.float32)
    p = spcompile.build(A, "spmm", K=4, target="cpu", template="cpu.csr_spmm").save(str(tmp_path / "m.spc"))
    X = np.random.default_rng(0).standard_normal((30, 4)).astype(np.float32)
    m = spcompile.load(p, warm_up=True)
    driver._WARM[0].join(timeout=60)
    assert np.abs(m(X) - A.astype(np.float64) @ X).max() < 1e-5
