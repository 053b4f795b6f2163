"""tc.wmma_sgt's split-tf32 precision ("3xtf32"): fp32-level SpMM on tf32 tensor cores.

A is split at build time into tf32 hi + lo fragments, X in registers the same way, and three tf32
MMAs accumulate lo(A) hi(X) + hi(A) lo(X) + hi(A) hi(X) in fp32.  Checked here without a GPU:
the packed fragments, the lane-by-lane emulation of the kernel against float64 (fp32-level error,
where plain tf32 is ~1e-3), the parameter rules (impl "mma" only, SpMM only, offered by the search and the seeds, the only
tensor-core precision the default fp32 policy admits) and that its instances compile for sm_90
and sm_80.  On the GPU, ``benchmarks/gpu_check.py`` checks it against float64 under
compute-sanitizer."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.compile import make_op
from spcompile.core import numerics, reference
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule
from spcompile.kernels import get_template
from spcompile.kernels.tc import emulate as em
from spcompile.kernels.tc import packer
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt

from conftest import random_matrix

MATS = {
    "random": random_matrix(300, 257, density=0.03, seed=0),       # empty rows + a long row
    "wide": random_matrix(70, 900, density=0.01, seed=3),          # long windows (split items)
    "tiny": sp.csr_matrix(np.array([[0, 2.0, 0], [0, 0, 0], [1.0, 0, -3.0]], dtype=np.float32)),
    "nothing": sp.csr_matrix((20, 9), dtype=np.float32),
}


def _mod(A, K, reduce="sum", shape="tf32"):
    base = SparseModule.from_op(make_op(A, "spmm", K, reduce))
    return Pipeline([("tile.sgt", {"shape": shape})])(base)


def _rel(got, ref):
    assert got.shape == ref.shape and np.isfinite(got).all()
    den = float(np.linalg.norm(ref))
    return float(np.linalg.norm(got - ref)) / (den if den > 0 else 1.0)


def _params(t, mod, **kw):
    return {**t.default_params(mod), "precision": "3xtf32", **kw}


@pytest.mark.parametrize("name", sorted(MATS))
@pytest.mark.parametrize("shape", ["tf32", "fp16"])            # 16 x 8 and 16 x 16 TC blocks
@pytest.mark.parametrize("K", [1, 13, 64, 100])
def test_emulated_kernel_is_fp32_exact(name, shape, K):
    A = MATS[name]
    t = get_template("tc.wmma_sgt")
    rng = np.random.default_rng(K)
    X = rng.standard_normal((A.shape[1], K)).astype(np.float32)    # what the kernel reads
    for reduce in ("sum", "mean"):
        mod = _mod(A, K, reduce, shape)
        ref = reference.run("spmm", reduce, as_csr(A), X.astype(np.float64))
        for extra in ({}, {"max_blocks": 2}, {"col_groups": 2, "unroll": 1}):
            p = _params(t, mod, **extra)
            k = t.build(mod, p, compile=False)
            Y = em.emulate_mma_spmm(k.arrays, k.meta, X, col_groups=int(p["col_groups"]),
                                    warps=int(p["warps_per_block"]))
            assert _rel(Y, ref) <= 1e-6, (name, shape, K, reduce, extra)


def test_split_is_what_makes_it_exact():
    # the same kernel with plain tf32 is three orders of magnitude less exact on the same inputs
    A = random_matrix(200, 300, density=0.05, seed=5)
    t = get_template("tc.wmma_sgt")
    X = np.random.default_rng(1).standard_normal((300, 64)).astype(np.float32)
    mod = _mod(A, 64)
    ref = reference.spmm(as_csr(A), X.astype(np.float64))
    errs = {}
    for prec in ("tf32", "3xtf32"):
        p = {**t.default_params(mod), "precision": prec}
        k = t.build(mod, p, compile=False)
        errs[prec] = _rel(em.emulate_mma_spmm(k.arrays, k.meta, X, col_groups=int(p["col_groups"]),
                                              warps=int(p["warps_per_block"])), ref)
    assert errs["3xtf32"] <= 1e-6 < 1e-4 <= errs["tf32"], errs


def test_fragments_are_tf32_hi_and_lo():
    A = random_matrix(64, 64, density=0.1, seed=2)
    mod = _mod(A, 8)
    one = packer.mma_arrays(mod, "tf32")
    two = packer.mma_arrays(mod, "3xtf32")
    assert two["afrag"].size == 2 * one["afrag"].size
    for k in ("pcols", "row_ids", "items"):
        assert np.array_equal(one[k], two[k])
    f = two["afrag"].reshape(-1, 2, 32, 4)
    hi, lo = f[:, 0], f[:, 1]
    assert np.array_equal(hi.reshape(-1), one["afrag"])                 # hi is the tf32 rounding
    for part in (hi, lo):                                               # both are tf32 values
        assert not (part.view(np.uint32) & 0x1FFF).any()
    # hi + lo recovers the fp32 value to within tf32's rounding of the remainder (2^-22 relative)
    exact = packer.mma_arrays(mod, "3xtf32")["afrag"].reshape(-1, 2, 32, 4).sum(1, dtype=np.float64)
    stored = np.zeros_like(exact)
    r, c = packer.a_frag_layout("tf32")
    fmt = mod.formats["sgt"]
    from spcompile.kernels.base import csr_kernel_arrays

    data = packer._spmm_data(mod, csr_kernel_arrays(mod, np.int32))
    tiles = fmt.dense_tiles(data, np.float32).reshape(fmt.num_blocks, 16, -1, 8).transpose(0, 2, 1, 3)
    stored = tiles[:, :, r, c].reshape(exact.shape).astype(np.float64)
    assert np.all(np.abs(exact - stored) <= 2.0 ** -22 * np.abs(stored))


def test_parameter_rules():
    A = MATS["random"]
    t = get_template("tc.wmma_sgt")
    mod = _mod(A, 32)
    assert "3xtf32" in numerics.allowed_precisions("fp32")             # fp32-level: the fp32 policy admits it
    assert "3xtf32" in t.space(mod)["precision"].choices                 # searched
    assert [p["impl"] for p in t.seed_params(mod) if p["precision"] == "3xtf32"] == ["mma"]   # one seed
    assert t.default_params(mod)["precision"] == "tf32"                  # a separate choice, not the default
    sd = get_template("tc.wmma_sgt_sddmm")
    smod0 = SparseModule.from_op(make_op(A, "sddmm", 32))
    assert "3xtf32" not in sd.space(smod0)["precision"].choices          # the SDDMM does not implement it
    assert sd.default_params(smod0)["precision"] == "tf32"
    t.check_params(mod, _params(t, mod))                                 # built when asked for
    with pytest.raises(ValueError, match="impl 'mma' only"):
        t.validate(mod, t.check_params(mod, _params(t, mod, impl="wmma")))
    sd = get_template("tc.wmma_sgt_sddmm")
    smod = Pipeline([("tile.sgt", {"shape": "tf32"})])(SparseModule.from_op(make_op(A, "sddmm", 32)))
    with pytest.raises(ValueError, match="precision='3xtf32'"):
        sd.validate(smod, sd.check_params(smod, {**sd.default_params(smod), "precision": "3xtf32"}))
    cfg = t.make_config(_params(t, mod), (), "cuda")
    assert cfg.precision == "3xtf32" and numerics.result_tolerance(cfg.precision, "float32") == 1e-5


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_split_tf32_instances_compile(tmp_path, arch):
    assert rt.nvcc_available(), "nvcc is needed to compile the CUDA templates"
    t = get_template("tc.wmma_sgt")
    inst = set()
    for bw in (8, 16):
        for cg, u in ((1, 4), (2, 2)):
            inst.update(t.mma_instances("3xtf32", bw, cg, u, 4))
    src = tmp_path / "k.cu"
    src.write_text(t.render(sorted(inst)))
    r = subprocess.run([rt.nvcc_path(), f"-arch={arch}", "--ptx", str(src), "-o", str(tmp_path / "k.ptx")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = (tmp_path / "k.ptx").read_text()
    assert ptx.count(".entry tc_mma_p3_") == len(inst)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx
