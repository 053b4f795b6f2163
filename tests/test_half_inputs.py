"""float16 / bfloat16 inputs (fp32 accumulation) for csr.crc_cwm, csr.sddmm and extern.cusparse.

CPU part (CI): dtype validation and errors, the workload key differs by dtype, parameter spaces,
every new kernel variant (16-bit element types, unroll depths, 8-wide half vectors) compiles with
nvcc for sm_90 and sm_80, the row partition with short slices.  GPU part (``gpu`` marker): every
reduction, fp16 and bf16, odd K and K=1, empty rows and a long row, NaN-poisoned outputs, torch and
CuPy inputs, against the float64 reference of the rounded inputs at the 16-bit tolerance."""
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.compile import make_op
from spcompile.core import reference
from spcompile.core.formats import as_csr
from spcompile.core.numerics import dtype_name
from spcompile.core.ir import DTYPES, SparseModule
from spcompile.runtime import cuda as rt
from spcompile.runtime import cuda_available
from spcompile.kernels import get_template, list_templates

pytestmark = pytest.mark.usefixtures("no_tuning_db")

A_SMALL = sp.random(40, 30, density=0.2, format="csr", random_state=0, dtype=np.float32)


# -- CPU: dtypes, keys, errors -------------------------------------------------------------------

def test_dtypes_and_aliases():
    assert DTYPES == ("float32", "float16", "bfloat16", "float64")
    for d, want in (("half", "float16"), ("fp16", "float16"), ("bf16", "bfloat16"), (np.float16, "float16"),
                    (np.dtype("float32"), "float32"), ("float32", "float32"), ("double", "float64"),
                    ("fp64", "float64"), ("f64", "float64"), (np.float64, "float64")):
        assert dtype_name(d) == want
    for bad in ("int8", "float128", "complex64"):
        with pytest.raises(ValueError, match=f"unsupported dtype '{bad}'"):
            make_op(A_SMALL, "spmm", 8, dtype=bad)


def test_workload_key_differs_by_dtype():
    keys = [make_op(A_SMALL, "spmm", 16, "sum", dtype=d).key() for d in DTYPES]
    assert len({k.digest() for k in keys}) == len(DTYPES) and len(set(keys)) == len(DTYPES)
    assert [k.dtype for k in keys] == list(DTYPES)
    assert len({k.pattern for k in keys}) == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cpu_target_refuses_16bit(dtype):
    with pytest.raises(ValueError, match=r"unsupported dtype .*target 'cpu'.*float32 / float64 inputs only.*csr\.crc_cwm"):
        spcompile.build(A_SMALL, "spmm", K=8, target="cpu", dtype=dtype)


@pytest.mark.parametrize("op", ["spmm", "sddmm"])
def test_cuda_target_refuses_float64(op):
    """float64 is computed by the CPU templates only: target='cuda' says so before a GPU is looked
    for (this runs without one), and no CUDA template supports a float64 workload."""
    with pytest.raises(ValueError, match=r"unsupported dtype 'float64' on target 'cuda'.*computed in float32.*"
                                         r"target='cpu' by \['cpu\.csr_"):
        spcompile.build(A_SMALL, op, K=8, target="cuda", dtype="float64")
    mod = SparseModule.from_op(make_op(A_SMALL, op, 8, dtype="float64"))
    cuda = list_templates("cuda", op=op, reduce="sum" if op == "spmm" else None)
    assert cuda and not any(t.supports(mod) for t in cuda)
    assert all(t.supports(mod) for t in list_templates("cpu", op=op, reduce="sum" if op == "spmm" else None))


def test_auto_target_builds_float64_on_the_cpu(monkeypatch):
    """target='auto' on a machine with a GPU: float64, which no CUDA template computes, is built
    for the CPU (a float32 build there would go to the GPU)."""
    import spcompile.runtime.target as rtarget

    monkeypatch.setattr(rtarget, "cuda_available", lambda: True)
    mod = spcompile.build(A_SMALL, "spmm", K=8, dtype="float64", select_budget=0)
    assert mod.target == "cpu" and mod.key.dtype == "float64"
    X = np.random.default_rng(0).standard_normal((A_SMALL.shape[1], 8))
    ref = reference.run("spmm", "sum", as_csr(A_SMALL), X)
    assert np.abs(mod(X) - ref).max() <= 1e-12 * np.abs(ref).max()
    assert rtarget.resolve_target("auto") == "cuda"      # the stand-in GPU: float32 would go there


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_supports_by_template(dtype):
    mod = SparseModule.from_op(make_op(A_SMALL, "spmm", 8, "sum", dtype=dtype))
    smod = SparseModule.from_op(make_op(A_SMALL, "sddmm", 8, dtype=dtype))
    assert get_template("csr.crc_cwm").supports(mod) and get_template("csr.sddmm").supports(smod)
    # torch.sparse.mm needs A in the input dtype: fine for float16, beyond the tolerance for bfloat16;
    # torch's sampled_addmm is fp32 only
    assert get_template("extern.cusparse").supports(mod) == (dtype == "float16")
    assert not get_template("extern.cusparse").supports(smod)
    # float32-only nvcc templates refuse 16-bit workloads in supports(); the TVM and CPU templates
    # (Template.supports does not look at the dtype) are refused by build() (tests below)
    for name in ("aspt.tiled", "tc.wmma_sgt", "sptc.vnm"):
        try:
            tpl = get_template(name)
        except ValueError:
            continue
        assert not tpl.supports(mod), name


def test_forced_float32_template_error(monkeypatch):
    import spcompile.runtime.target as rtarget

    monkeypatch.setattr(rtarget, "cuda_available", lambda: True)   # target "auto" resolves to cuda
    with pytest.raises(ValueError, match=r"unsupported dtype 'float16' for template 'tvm.cuda_csr_spmm'.*csr\.crc_cwm"):
        spcompile.build(A_SMALL, "spmm", K=8, dtype="float16", template="tvm.cuda_csr_spmm")


def test_spaces_and_defaults_by_dtype():
    t, s = get_template("csr.crc_cwm"), get_template("csr.sddmm")
    for dt, vmax in (("float32", 4), ("float16", 8), ("bfloat16", 8)):
        mod = SparseModule.from_op(make_op(A_SMALL, "spmm", 256, "sum", dtype=dt))
        assert max(t.space(mod)["vec"].choices) == vmax
        assert t.default_params(mod)["vec"] == vmax
        assert {8, 16, 32} <= set(t.space(mod)["max_seg"].choices)
        assert t.space(mod)["unroll"].choices == (1, 2, 4, 8, 16)   # quick selection's deep variant included
        for p in t.seed_params(mod):       # every seed is valid for the dtype
            assert p["vec"] in t.space(mod)["vec"].choices and p["unroll"] in (1, 2, 4, 8)
        smod = SparseModule.from_op(make_op(A_SMALL, "sddmm", 256, dtype=dt))
        assert s.default_params(smod)["vec"] == vmax
    # small graphs get short-slice seeds
    mod = SparseModule.from_op(make_op(A_SMALL, "spmm", 256, "sum"))
    assert {8, 16} <= {p["max_seg"] for p in t.seed_params(mod)}


def test_short_slices_partition():
    from spcompile.kernels.csr.template import spmm_partition

    indptr = np.array([0, 0, 1463, 1470, 1470])
    part = spmm_partition(indptr, np.arange(4), 8)
    seg = part["seg_ptr"]
    assert seg[0] == 0 and seg[-1] == 1470 and np.all(np.diff(seg) <= 8)
    assert part["grp_len"].tolist() == [1463] and (part["seg_slot"] >= 0).sum() == -(-1463 // 8)


def test_module_dtype_errors_without_gpu():
    """The module's input checks name the expected dtype (no GPU needed: _check runs first)."""
    from spcompile.core.ir import SparseOp
    from spcompile.core.config import Config
    from spcompile.module import CompiledModule

    for dt in ("float16", "bfloat16"):
        key = SparseOp("spmm", "sum", make_op(A_SMALL, "spmm", 8).A, 8, dt).key()
        cm = CompiledModule(key, Config("csr.crc_cwm", {}, (), "cuda"), kernel=None)
        if dt == "float16":
            with pytest.raises(TypeError, match="dtype float32, expected float16"):
                cm(np.zeros((30, 8), np.float32))
        else:
            for x in (np.zeros((30, 8), np.float16), np.zeros((30, 8), np.float32)):
                with pytest.raises(TypeError, match="numpy has no bfloat16"):
                    cm(x)


# -- CPU: nvcc compiles every new variant ----------------------------------------------------------

def _instances():
    t, s = get_template("csr.crc_cwm"), get_template("csr.sddmm")
    spmm, sddmm = set(), set()
    for dt in ("float16", "bfloat16", "float32"):
        vecs = (1, 2, 4, 8) if dt != "float32" else (1, 4)
        for r in ("sum", "max", "min", "mean"):
            spmm.update(t.instances(r, 2, vecs[-1], 32, 2, dt))
        for u in (1, 2, 4, 8):
            spmm.update(t.instances("sum", 1, vecs[-1], 32, u, dt))
        for cf in (4, 8):
            spmm.update(t.instances("max", cf, 4, 32, 1, dt))
        for g in (4, 8, 16):
            spmm.update(t.instances("mean", 1, vecs[1], g, 4, dt))
        for g in (4, 32):
            for v in vecs:
                sddmm.update(s.instances(g, v, 2 if g == 32 else 1, dt))
    return (t, sorted(spmm)), (s, sorted(sddmm))


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("arch", [90, 80])
def test_16bit_variants_compile(tmp_path, arch):
    for (tpl, inst), which in zip(_instances(), ("spmm", "sddmm")):
        src = tmp_path / f"{which}.cu"
        src.write_text(tpl.render(inst))
        out = tmp_path / f"{which}.cubin"
        r = subprocess.run([rt.nvcc_path(), "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-o", str(out),
                            str(src)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        data = out.read_bytes()
        for name, _ in inst:
            assert name.encode() in data, name


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
def test_build_16bit_without_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "cache"))
    for dt in ("float16", "bfloat16"):
        mod = SparseModule.from_op(make_op(A_SMALL, "spmm", 24, "max", dtype=dt))
        t = get_template("csr.crc_cwm")
        k = t.build(mod, t.default_params(mod))
        assert k.meta["dtype"] == dt and k.meta["vec"] == 8
        assert k.meta["instances"][0][0].startswith("spmm_crc_cwm_" + ("f16" if dt == "float16" else "bf16"))
        with pytest.raises(ValueError, match="invalid csr.crc_cwm parameters"):
            t.build(SparseModule.from_op(make_op(A_SMALL, "spmm", 24, "max")), {**t.default_params(mod), "vec": 8})


# -- GPU ------------------------------------------------------------------------------------------

gpu = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
@pytest.mark.parametrize("template", ["csr.crc_cwm", "csr.sddmm", "extern.cusparse"])
def test_16bit_correct_gpu(template):
    import gpu_check as gc

    A = gc.random_matrix(4, m=1200, n=12000, density=0.001)   # empty rows, a 10k-nonzero row
    log = []
    fails = gc.check_half(A, "random", log, templates={template})
    assert fails == 0, [r for r in log if not r["ok"]][:5]
    assert len(log) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
def test_16bit_module_calls_gpu():
    import torch

    A = sp.random(300, 200, density=0.05, format="csr", random_state=1, dtype=np.float32)
    for dt, tdt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        mod = spcompile.build(A, "spmm", K=40, reduce="sum", target="cuda", dtype=dt, template="csr.crc_cwm")
        X = torch.randn(200, 40, device="cuda").to(tdt)
        y = mod(X)
        y2 = mod(X)                                               # fast path
        assert y.dtype == tdt and torch.equal(y, y2)
        ref = A.astype(np.float64) @ X.double().cpu().numpy()
        assert np.linalg.norm(y.double().cpu().numpy() - ref) / np.linalg.norm(ref) < 1e-2
        assert torch.equal(mod(X.cpu()), y.cpu())                # CPU tensors: through the device
        with pytest.raises(TypeError, match=f"dtype float32, expected {dt}"):
            mod(X.float())
        with pytest.raises(ValueError, match="out must be"):
            mod(X, out=torch.empty(300, 40, device="cuda"))
        if dt == "float16":
            assert np.array_equal(mod(X.cpu().numpy()), y.cpu().numpy())  # numpy float16 in and out
