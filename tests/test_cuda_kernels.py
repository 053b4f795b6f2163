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

    from spcompile.cuda_templates.templates import CrcCwm  # noqa: F401
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
