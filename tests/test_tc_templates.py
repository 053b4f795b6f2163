"""tc.wmma_sgt / tc.wmma_sgt_sddmm (TC-GNN) and aspt.tiled (ASpT): every variant compiles with nvcc for sm_90 and
sm_80; the arrays the templates upload reproduce A @ X (numpy emulation in float64, in the
caller's order, after permuting passes too); on a GPU the kernels match the float64 reference
with NaN-poisoned outputs at precision-appropriate tolerances."""
import subprocess

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.core import numerics, reference  # noqa: F401
from spcompile.compile import make_op
from spcompile.core.ir import SparseModule
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt
from spcompile.runtime import cuda_available
from spcompile.kernels import get_template

from conftest import random_matrix


def _mod(A, K, reduce="sum", pipeline=(), dtype="float32"):
    return Pipeline(list(pipeline))(SparseModule.from_op(make_op(A, "spmm", K, reduce, dtype)))


def _ref(A, X, reduce="sum"):
    from spcompile.core.formats import as_csr

    return reference.run("spmm", reduce, as_csr(A), X)


MATRICES = {
    "random": lambda: random_matrix(300, 257, density=0.03, seed=0),
    "clustered": lambda: sp.csr_matrix(sp.block_diag([sp.random(40, 40, density=0.5, random_state=i)
                                                      for i in range(6)]) + sp.random(240, 240, density=0.005,
                                                                                      random_state=9)).astype(np.float32),
    "tiny": lambda: sp.csr_matrix(np.array([[0, 2.0, 0], [0, 0, 0], [1.0, 0, -3.0]], dtype=np.float32)),
}


# ------------------------------------------------------------------------------------------
# CPU: template metadata and numpy emulation of the uploaded packing
# ------------------------------------------------------------------------------------------
def test_registered_with_pipelines():
    tc, aspt = get_template("tc.wmma_sgt"), get_template("aspt.tiled")
    A = MATRICES["random"]()
    mod = _mod(A, 32)
    assert tc.requires(mod) == ("sgt",) and aspt.requires(mod) == ("aspt",)
    assert not tc.supports(mod) and not aspt.supports(mod)   # formats missing before passes
    assert [p[-1]["name"] for p in tc.pipelines(mod)] == ["tile.sgt", "tile.sgt", "tile.sgt"]
    assert ["reorder.rcm", "cluster.lsh", "tile.sgt"] in [[x["name"] for x in p] for p in tc.pipelines(mod)]
    assert ["cluster.lsh", "tile.aspt"] in [[x["name"] for x in p] for p in aspt.pipelines(mod)]
    for pipe in tc.pipelines(mod):
        assert tc.supports(_mod(A, 32, pipeline=pipe))
    for pipe in aspt.pipelines(mod):
        assert aspt.supports(_mod(A, 32, pipeline=pipe))
    from spcompile.autotune.space import candidates

    cands = candidates(make_op(A, "spmm", 32, "sum"), "cuda")
    if rt.nvcc_available():
        assert "tc.wmma_sgt" in cands and "aspt.tiled" in cands
        assert any("cluster.lsh" in label for label in cands["aspt.tiled"])


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("prec,shape", [("tf32", "tf32"), ("tf32", "fp16"), ("fp16", "fp16"), ("bf16", "fp16")])
@pytest.mark.parametrize("dense_a", [0, 1])
@pytest.mark.parametrize("reorder", [None, "reorder.rcm", "reorder.degree"])
def test_tc_packing_emulation(name, prec, shape, dense_a, reorder):
    from spcompile.kernels.tc.emulate import emulate_tc_spmm
    from spcompile.kernels.tc.packer import tc_arrays
    from spcompile.passes.base import list_passes

    if reorder and reorder not in list_passes():
        pytest.skip(f"{reorder} not registered")
    A = MATRICES[name]()
    K = 19
    pipe = ([reorder] if reorder else []) + [("tile.sgt", {"shape": shape})]
    mod = _mod(A, K, pipeline=pipe)
    fmt = mod.formats["sgt"]
    arrays = tc_arrays(mod, prec, bool(dense_a))
    X = np.random.default_rng(1).standard_normal((A.shape[1], K)).astype(np.float32)
    meta = {"m": A.shape[0], "BW": fmt.BLK_W, "precision": prec}
    Y = emulate_tc_spmm(arrays, meta, X)
    ref = _ref(A, X)
    tol = 1e-12 if (prec == "tf32" or not dense_a) else 1e-2   # dense low-precision tiles are rounded
    assert reference.rel_error(Y, ref) <= tol


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("pipe", [[("tile.aspt", {})], [("tile.aspt", {"panel_height": 16})],
                                  ["cluster.lsh", ("tile.aspt", {})],
                                  ["cluster.lsh", ("tile.aspt", {}), "cluster.lsh"]])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_aspt_packing_emulation(name, pipe, reduce):
    from spcompile.kernels.aspt.template import aspt_arrays, emulate_aspt_spmm

    A = MATRICES[name]()
    mod = _mod(A, 7, reduce, pipeline=pipe)
    arrays = aspt_arrays(mod)
    X = np.random.default_rng(2).standard_normal((A.shape[1], 7)).astype(np.float32)
    Y = emulate_aspt_spmm(arrays, {"m": A.shape[0], "H": mod.formats["aspt"].panel_height}, X)
    assert reference.rel_error(Y, _ref(A, X, reduce)) <= 1e-6


def test_tc_mean_scaling_and_empty():
    from spcompile.kernels.tc.emulate import emulate_tc_spmm
    from spcompile.kernels.tc.packer import tc_arrays

    A = MATRICES["random"]()
    mod = _mod(A, 5, "mean", pipeline=[("tile.sgt", {"shape": "tf32"})])
    X = np.random.default_rng(3).standard_normal((A.shape[1], 5)).astype(np.float32)
    Y = emulate_tc_spmm(tc_arrays(mod), {"m": A.shape[0], "BW": 8, "precision": "tf32"}, X)
    assert reference.rel_error(Y, _ref(A, X, "mean")) <= 1e-6


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("prec,shape", [("tf32", "tf32"), ("tf32", "fp16"), ("fp16", "fp16"), ("bf16", "fp16")])
@pytest.mark.parametrize("max_blocks", [0, 3, 32])
@pytest.mark.parametrize("K,reorder", [(1, None), (19, "reorder.rcm"), (40, None)])
def test_mma_packing_emulation(name, prec, shape, max_blocks, K, reorder):
    """impl "mma": fragment packing, permuted column ids, lane column mapping, work items and the
    in-order combination of split windows reproduce A @ X (lane-level emulation)."""
    from spcompile.kernels.tc.emulate import emulate_mma_spmm
    from spcompile.kernels.tc.packer import mma_arrays
    from spcompile.passes.base import list_passes

    if reorder and reorder not in list_passes():
        pytest.skip(f"{reorder} not registered")
    A = MATRICES[name]()
    mod = _mod(A, K, pipeline=([reorder] if reorder else []) + [("tile.sgt", {"shape": shape})])
    arrays = mma_arrays(mod, prec, max_blocks)
    items = arrays["items"]
    n = np.diff(items[:, :2], axis=1).ravel()
    assert np.all(n[:-1] >= n[1:])                                   # longest first
    if max_blocks:
        assert n.max(initial=0) <= max_blocks
    X = np.random.default_rng(1).standard_normal((A.shape[1], K)).astype(np.float32)
    meta = {"m": A.shape[0], "BW": mod.formats["sgt"].BLK_W, "precision": prec}
    Y = emulate_mma_spmm(arrays, meta, X, col_groups=2)
    assert reference.rel_error(Y, _ref(A, X)) <= (1e-3 if prec == "tf32" else 1e-2)


def test_split_windows_balanced():
    from spcompile.kernels.tc.packer import split_windows

    wbp = np.array([0, 0, 100, 103, 103, 135])
    r = split_windows(wbp, 32)
    items = r["items"]
    assert items.shape == (4 + 1 + 1 + 2, 4)                        # 100 -> 4 items, 32 -> 1, 3 -> 1, empty x2
    assert sorted(map(tuple, items[:, :2].tolist())) == sorted(
        [(0, 0), (0, 25), (25, 50), (50, 75), (75, 100), (100, 103), (103, 103), (103, 135)])
    split = items[items[:, 3] >= 0]
    assert set(split[:, 2]) == {1} and sorted(split[:, 3]) == [0, 1, 2, 3]
    assert r["grp_ptr"].tolist() == [0, 4] and r["slot_grp"].tolist() == [0, 0, 0, 0]
    assert split_windows(wbp, 0)["items"].shape == (5, 4)


# ------------------------------------------------------------------------------------------
# CPU: 16-bit inputs (float16 / bfloat16 X, Y and output; fp32 accumulation)
# ------------------------------------------------------------------------------------------
DT16 = [("float16", "fp16"), ("bfloat16", "bf16")]


def _ref64(A, X, reduce="sum"):
    """float64 reference on the given (already 16-bit-rounded) X."""
    return _ref(A, np.asarray(X, dtype=np.float64), reduce)


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("dtype,prec", DT16)
@pytest.mark.parametrize("max_blocks", [0, 3])
@pytest.mark.parametrize("K,pipe", [(1, ()), (13, ("reorder.rcm",)), (72, ()), (64, "reuse")])
def test_mma_packing_emulation_16bit(name, dtype, prec, max_blocks, K, pipe):
    """impl "mma" with 16-bit X: the 8-values-per-lane column mapping (64 columns per group), the
    byte-permuted B pairs, the C layout, fp32 partials and one rounding of Y reproduce A @ X."""
    from spcompile.passes.recipes import WINDOW_REUSE
    from spcompile.kernels.tc.emulate import emulate_mma_spmm, round_to
    from spcompile.kernels.tc.packer import mma_arrays

    A = MATRICES[name]()
    pre = list(WINDOW_REUSE) if pipe == "reuse" else list(pipe)
    mod = _mod(A, K, pipeline=pre + [("tile.sgt", {"shape": "fp16"})], dtype=dtype)
    arrays = mma_arrays(mod, prec, max_blocks)
    X = round_to(np.random.default_rng(4).standard_normal((A.shape[1], K)), dtype)
    meta = {"m": A.shape[0], "BW": 16, "precision": prec, "dtype": dtype}
    Y = emulate_mma_spmm(arrays, meta, X, col_groups=2)
    assert np.all(np.isfinite(Y))
    assert np.array_equal(Y, round_to(Y, dtype))                     # output in the input dtype
    assert reference.rel_error(Y, _ref64(A, X)) <= 1e-2


@pytest.mark.parametrize("dtype,prec", DT16)
@pytest.mark.parametrize("dense_a", [0, 1])
def test_tc_packing_emulation_16bit(dtype, prec, dense_a):
    """impl "wmma" with 16-bit X (staged as loaded): the uploaded tiles reproduce A @ X."""
    from spcompile.kernels.tc.emulate import emulate_tc_spmm, round_to
    from spcompile.kernels.tc.packer import tc_arrays

    A = MATRICES["random"]()
    mod = _mod(A, 24, "mean", pipeline=[("tile.sgt", {"shape": "fp16"})], dtype=dtype)
    X = round_to(np.random.default_rng(5).standard_normal((A.shape[1], 24)), dtype)
    Y = round_to(emulate_tc_spmm(tc_arrays(mod, prec, bool(dense_a)), {"m": A.shape[0], "BW": 16,
                                                                       "precision": prec}, X), dtype)
    assert reference.rel_error(Y, _ref64(A, X, "mean")) <= 1e-2


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("dtype,prec", DT16)
@pytest.mark.parametrize("K", [1, 13, 64, 100])
def test_sddmm_packing_emulation_16bit(name, dtype, prec, K):
    """tc.wmma_sgt_sddmm with 16-bit X / Y: 64-feature chunks, words of the loaded vectors used as
    MMA operands, one rounding of each output, in the caller's nonzero order (after reordering)."""
    from spcompile.passes.recipes import WINDOW_REUSE
    from spcompile.kernels.tc.emulate import emulate_tc_sddmm, round_to
    from spcompile.kernels.tc.packer import sddmm_arrays
    from spcompile.core.formats import as_csr

    A = MATRICES[name]()
    pre = list(WINDOW_REUSE) if K == 64 else []
    mod = Pipeline(pre + [("tile.sgt", {"shape": "sddmm"})])(SparseModule.from_op(make_op(A, "sddmm", K, None, dtype)))
    arrays = sddmm_arrays(mod)
    rng = np.random.default_rng(6)
    X, Y = round_to(rng.standard_normal((A.shape[0], K)), dtype), round_to(rng.standard_normal((A.shape[1], K)), dtype)
    meta = {"m": A.shape[0], "BW": 16, "precision": prec, "nnz": A.nnz, "dtype": dtype}
    out = emulate_tc_sddmm(arrays, meta, X, Y)
    assert np.all(np.isfinite(out)) and np.array_equal(out, round_to(out, dtype))
    assert reference.rel_error(out, reference.sddmm(as_csr(A), X, Y)) <= 1e-2


@pytest.mark.parametrize("dtype,prec", DT16)
def test_16bit_precision_policy(dtype, prec):
    """A 16-bit workload is offered (space, defaults, seeds) only its own precision and only 16-wide
    SGT pipelines; build() refuses another precision with a clear error."""
    from spcompile.kernels.tc.packer import input_type

    A = MATRICES["clustered"]()
    for tname, op in (("tc.wmma_sgt", "spmm"), ("tc.wmma_sgt_sddmm", "sddmm")):
        t = get_template(tname)
        assert dtype in t.dtypes
        base = SparseModule.from_op(make_op(A, op, 32, "sum" if op == "spmm" else None, dtype))
        assert list(t.space(base)["precision"].choices) == [prec]
        assert t.default_params(base)["precision"] == prec
        pipes = t.pipelines(base)
        assert len(pipes) == 2 and all(p[-1]["options"]["shape"] in ("fp16", "sddmm") for p in pipes)
        for pipe in pipes:
            mod = Pipeline(list(pipe))(base)
            assert t.supports(mod)
            assert {p["precision"] for p in t.seed_params(mod)} == {prec}
            t.check_params(mod, t.default_params(mod))
            with pytest.raises(ValueError, match="does not match"):
                t.check_params(mod, {"precision": "tf32"})
        narrow = Pipeline([("tile.sgt", {"shape": "tf32"})])(base)
        assert not t.supports(narrow)                              # 8-wide blocks: no 16-bit MMA
        for other in ("tf32", "fp16", "bf16"):
            if other != prec:
                with pytest.raises(ValueError, match="does not match"):
                    input_type(dtype, other)
    with pytest.raises(ValueError, match="does not match"):
        input_type(dtype, "tf32")
    assert input_type("float32", "fp16") == 0 and input_type(dtype, prec) == 1


def test_window_reuse_pipeline():
    """rcm -> cluster.lsh(16-row clusters) -> tile.sgt builds for both templates, keeps A @ X exact
    (emulated) and does not add SGT blocks on clustered input."""
    from spcompile.passes.recipes import WINDOW_REUSE
    from spcompile.kernels.tc.emulate import emulate_mma_spmm
    from spcompile.kernels.tc.packer import mma_arrays

    A = MATRICES["clustered"]()
    rng = np.random.default_rng(8)
    perm = rng.permutation(A.shape[0])
    A = sp.csr_matrix(A[perm][:, perm])                              # hide the clusters
    A.sort_indices()
    plain = _mod(A, 16, pipeline=[("tile.sgt", {"shape": "fp16"})])
    reuse = _mod(A, 16, pipeline=list(WINDOW_REUSE) + [("tile.sgt", {"shape": "fp16"})])
    assert reuse.formats["sgt"].num_blocks < plain.formats["sgt"].num_blocks
    met = reuse.metrics["tile.sgt"]
    assert met["reuse"] > plain.metrics["tile.sgt"]["reuse"] >= 1.0
    X = rng.standard_normal((A.shape[1], 16)).astype(np.float32)
    Y = emulate_mma_spmm(mma_arrays(reuse, "tf32", 4), {"m": A.shape[0], "BW": 16, "precision": "tf32"}, X)
    assert reference.rel_error(Y, _ref(A, X)) <= 1e-3
    for tname, op in (("tc.wmma_sgt", "spmm"), ("tc.wmma_sgt_sddmm", "sddmm")):
        t = get_template(tname)
        base = SparseModule.from_op(make_op(A, op, 16, "sum" if op == "spmm" else None))
        assert [x["name"] for x in t.pipelines(base)[-1]] == ["reorder.rcm", "cluster.lsh", "tile.sgt"]
        assert t.supports(Pipeline(t.pipelines(base)[-1])(base))


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("prec,shape", [("tf32", "sddmm"), ("tf32", "tf32"), ("fp16", "sddmm"), ("bf16", "sddmm")])
@pytest.mark.parametrize("K,reorder", [(1, None), (19, "reorder.rcm"), (40, "reorder.degree")])
def test_sddmm_packing_emulation(name, prec, shape, K, reorder):
    """tc.wmma_sgt_sddmm: block windows / columns, the k-index mapping of the lanes' float4 loads,
    the C layout and the caller's nonzero order reproduce the float64 SDDMM (emulated in float64)."""
    from spcompile.kernels.tc.emulate import emulate_tc_sddmm
    from spcompile.kernels.tc.packer import sddmm_arrays
    from spcompile.core.formats import as_csr
    from spcompile.passes.base import list_passes

    if reorder and reorder not in list_passes():
        pytest.skip(f"{reorder} not registered")
    A = MATRICES[name]()
    mod = Pipeline(([reorder] if reorder else []) + [("tile.sgt", {"shape": shape})])(
        SparseModule.from_op(make_op(A, "sddmm", K)))
    arrays = sddmm_arrays(mod)
    rng = np.random.default_rng(2)
    X, Y = rng.standard_normal((A.shape[0], K)), rng.standard_normal((A.shape[1], K))
    meta = {"m": A.shape[0], "BW": mod.formats["sgt"].BLK_W, "precision": prec, "nnz": A.nnz}
    out = emulate_tc_sddmm(arrays, meta, X, Y)
    assert reference.rel_error(out, reference.sddmm(as_csr(A), X, Y)) <= 1e-12


def test_tc_sddmm_registered():
    t = get_template("tc.wmma_sgt_sddmm")
    A = MATRICES["random"]()
    base = SparseModule.from_op(make_op(A, "sddmm", 32))
    assert t.requires(base) == ("sgt",) and not t.supports(base)
    for pipe in t.pipelines(base):
        mod = Pipeline(list(pipe))(base)
        assert t.supports(mod)
        for p in t.seed_params(mod):
            assert set(p) <= set(t.space(mod))
    from spcompile.autotune.space import candidates

    if rt.nvcc_available():
        assert "tc.wmma_sgt_sddmm" in candidates(make_op(A, "sddmm", 32), "cuda")


# ------------------------------------------------------------------------------------------
# nvcc: every variant compiles for sm_90 and sm_80
# ------------------------------------------------------------------------------------------
def _all_instances(which):
    inst = set()
    if which == "tc":
        t = get_template("tc.wmma_sgt")
        for prec, bws in (("tf32", (8, 16)), ("fp16", (16,)), ("bf16", (16,))):
            for bw in bws:
                for tpw in (1, 2, 4):
                    for d in (0, 1):
                        inst.update(t.instances(prec, bw, tpw, d, 4))
                        if prec != "tf32":                        # 16-bit X / Y
                            inst.update(t.instances(prec, bw, tpw, d, 8, 1))
    elif which == "mma":
        t = get_template("tc.wmma_sgt")
        for prec, bws in (("tf32", (8, 16)), ("fp16", (16,)), ("bf16", (16,))):
            for bw in bws:
                for cg in (1, 2, 4):
                    for u in (1, 2, 4):
                        if t.mma_ok(prec, bw, cg, u):
                            inst.update(t.mma_instances(prec, bw, cg, u, 4))
                        if prec != "tf32" and t.mma_ok(prec, bw, cg, u, 1):
                            inst.update(t.mma_instances(prec, bw, cg, u, 8, 1))
    elif which == "sddmm":
        t = get_template("tc.wmma_sgt_sddmm")
        for prec, bws in (("tf32", (8, 16)), ("fp16", (16,)), ("bf16", (16,))):
            for bw in bws:
                for ku in (1, 2):
                    inst.update(t.instances(prec, bw, ku, 4))
                    if prec != "tf32":
                        inst.update(t.instances(prec, bw, ku, 8, 1))
    else:
        t = get_template("aspt.tiled")
        for vec in (1, 2, 4):
            for cf in (1, 2, 4):
                for rpw in (1, 2, 4, 8):
                    inst.update(t.instances(vec, cf, rpw))
    return t, sorted(inst)


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("which", ["tc", "sddmm", "aspt"])
def test_compile_all_variants(tmp_path, arch, which):
    t, inst = _all_instances(which)
    src = tmp_path / f"{which}.cu"
    src.write_text(t.render(inst))
    out = tmp_path / f"{which}.cubin"
    fast = ["-Xptxas", "-O1"] if which != "aspt" else []     # CI time; the kernel cache builds with -O3
    r = subprocess.run([rt.nvcc_path(), "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", *fast, "-o", str(out),
                        str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    data = out.read_bytes()
    for name, _ in inst:
        assert name.encode() in data, name


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
def test_compile_all_mma_variants(tmp_path):
    """impl "mma" of tc.wmma_sgt: all 52 fp32-input and 40 16-bit-input variants for sm_90 and sm_80, the two archs compiled in
    parallel (ptxas -O1 keeps this CI check fast; the kernel cache builds with full -O3)."""
    t, inst = _all_instances("mma")
    src = tmp_path / "mma.cu"
    src.write_text(t.render(inst))
    procs = {arch: subprocess.Popen([rt.nvcc_path(), "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-Xptxas", "-O1",
                                     "-o", str(tmp_path / f"mma{arch}.cubin"), str(src)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for arch in (90, 80)}
    for arch, p in procs.items():
        _, err = p.communicate()
        assert p.returncode == 0, err[-4000:]
        data = (tmp_path / f"mma{arch}.cubin").read_bytes()
        for name, _ in inst:
            assert name.encode() in data, name


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
def test_build_without_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "cache"))
    A = MATRICES["random"]()
    tc = get_template("tc.wmma_sgt")
    mod = _mod(A, 64, pipeline=tc.pipelines(_mod(A, 64))[0])
    k = tc.build(mod, tc.default_params(mod))
    assert k.files["kernel.fatbin"].startswith(str(tmp_path)) and k.meta["precision"] == "tf32"
    assert k.meta["impl"] == "mma" and k.meta["items"] >= 1
    with pytest.raises(ValueError):
        tc.build(mod, {**tc.default_params(mod), "precision": "fp16"})   # 8-wide blocks: tf32 only
    with pytest.raises(ValueError):
        tc.build(mod, {**tc.default_params(mod), "col_groups": 4, "unroll": 4})   # would spill
    kw = tc.build(mod, {**tc.default_params(mod), "impl": "wmma"})
    assert kw.meta["impl"] == "wmma" and "tiles" in kw.arrays
    ts = get_template("tc.wmma_sgt_sddmm")
    smod = Pipeline(ts.pipelines(SparseModule.from_op(make_op(A, "sddmm", 64)))[0])(
        SparseModule.from_op(make_op(A, "sddmm", 64)))
    ks = ts.build(smod, ts.default_params(smod))
    assert ks.meta["BW"] == 16 and ks.meta["precision"] == "tf32"
    at = get_template("aspt.tiled")
    mod = _mod(A, 64, pipeline=at.pipelines(_mod(A, 64))[0])
    k = at.build(mod, at.default_params(mod))
    assert k.meta["warps"] == 8 and k.meta["KT"] == 128


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("dtype,prec", DT16)
def test_build_16bit_without_gpu(tmp_path, monkeypatch, dtype, prec):
    """16-bit builds: meta["dtype"] (the runtime allocates the output in it), the 16-bit-input
    instances, 8-element vectors when K % 8 == 0, and a clear refusal of another precision."""
    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "cache"))
    A = MATRICES["random"]()
    tc = get_template("tc.wmma_sgt")
    for K, vec in ((64, 8), (13, 1)):
        mod = _mod(A, K, pipeline=tc.pipelines(_mod(A, K, dtype=dtype))[0], dtype=dtype)
        k = tc.build(mod, tc.default_params(mod))
        assert k.meta["dtype"] == dtype and k.meta["precision"] == prec and k.meta["vec"] == vec
        assert k.meta["span"] == 64 and all(n.endswith("_x16") for n, _ in k.meta["instances"])
        with pytest.raises(ValueError, match="does not match"):
            tc.build(mod, {**tc.default_params(mod), "precision": "tf32"})
        kw = tc.build(mod, {**tc.default_params(mod), "impl": "wmma"})
        assert kw.meta["dtype"] == dtype and kw.meta["instances"][0][1][-1] == 1
    ts = get_template("tc.wmma_sgt_sddmm")
    base = SparseModule.from_op(make_op(A, "sddmm", 64, None, dtype))
    ks = ts.build(Pipeline(ts.pipelines(base)[0])(base), ts.default_params(base))
    assert ks.meta["dtype"] == dtype and ks.meta["vec"] == 8 and ks.meta["instances"][0][0].endswith("_x16")
    with pytest.raises(ValueError, match="does not match"):
        ts.build(Pipeline(ts.pipelines(base)[0])(base), {**ts.default_params(base), "precision": "tf32"})


# ------------------------------------------------------------------------------------------
# GPU: correctness against float64, NaN-poisoned outputs
# ------------------------------------------------------------------------------------------
TOL = {"tf32": 2e-3, "fp16": 1e-2, "bf16": 2e-2, "fp32": 1e-5, "3xtf32": 1e-6}   # 3xtf32: split tf32, fp32-level
TOL16 = 1e-2          # 16-bit inputs and output (A's values in 16 bit, output rounded once)


def gpu_matrices():
    return {"random": random_matrix(1500, 3000, density=0.002, seed=5),
            "clustered": MATRICES["clustered"](), "tiny": MATRICES["tiny"]()}


def _seeds_for(tpl, mod, pipe):
    """Every seed on the plain SGT pipelines; the default (and one split setting for SpMM) on the
    longer window-reuse pipeline (same kernels, other input order)."""
    seeds = tpl.seed_params(mod)
    if len(pipe) > 1:
        d = tpl.default_params(mod)
        seeds = [d] + ([{**d, "max_blocks": 8}] if "max_blocks" in d else [])
    return seeds


def _plabel(pipe):
    return "+".join(x["name"].split(".")[-1] for x in pipe[:-1]) + pipe[-1]["options"]["shape"]


def gpu_cases(Ks=(1, 13, 64, 128, 256), dtypes=("float32", "float16", "bfloat16")):
    """(label, matrix, K, reduce, template, pipeline, params, tolerance, dtype) for the GPU checks
    (reduce None: SDDMM); 16-bit workloads: tolerance 1e-2 against float64 on the 16-bit inputs."""
    out = []
    tc, at, ts = get_template("tc.wmma_sgt"), get_template("aspt.tiled"), get_template("tc.wmma_sgt_sddmm")
    for mname, A in gpu_matrices().items():
        for K in Ks:
            for dtype in dtypes:
                for reduce in ("sum", "mean"):
                    base = _mod(A, K, reduce, dtype=dtype)
                    for pipe in tc.pipelines(base):
                        mod = _mod(A, K, reduce, pipe, dtype=dtype)
                        for p in _seeds_for(tc, mod, pipe):
                            tol = TOL[p["precision"]] if dtype == "float32" else TOL16
                            out.append((f"{mname}/K{K}/{dtype}/{reduce}/tc/{_plabel(pipe)}/{p}", A, K, reduce,
                                        "tc.wmma_sgt", pipe, p, tol, dtype))
                base = SparseModule.from_op(make_op(A, "sddmm", K, None, dtype))
                for pipe in ts.pipelines(base):
                    mod = Pipeline(list(pipe))(base)
                    for p in _seeds_for(ts, mod, pipe):
                        tol = TOL[p["precision"]] if dtype == "float32" else TOL16
                        out.append((f"{mname}/K{K}/{dtype}/sddmm/{_plabel(pipe)}/{p}", A, K, None,
                                    "tc.wmma_sgt_sddmm", pipe, p, tol, dtype))
            for reduce in ("sum", "mean"):
                base = _mod(A, K, reduce)
                for pipe in at.pipelines(base):
                    mod = _mod(A, K, reduce, pipe)
                    for p in at.seed_params(mod):
                        out.append((f"{mname}/K{K}/{reduce}/aspt/{len(pipe)}/{p}", A, K, reduce, "aspt.tiled",
                                    pipe, p, TOL["fp32"], "float32"))
    return out


def _dev_array(a, dtype):
    """A torch CUDA tensor of ``dtype`` holding ``a`` (float16 / bfloat16: rounded once), and the
    float64 numpy copy of exactly the values the kernel sees."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).cuda().to(getattr(torch, dtype))
    return t, t.double().cpu().numpy()


_PIPE_CACHE: dict = {}


def _piped(A, op, K, reduce, dtype, pipe):
    """The pipeline's output for (A, pipe), run once and re-used for other K / reduce / dtype (the
    passes depend on the matrix alone)."""
    import dataclasses

    key = (id(A), op, repr(pipe))
    if key not in _PIPE_CACHE:
        _PIPE_CACHE[key] = (A, Pipeline(list(pipe))(SparseModule.from_op(make_op(A, op, K, reduce, dtype))))
    mod = _PIPE_CACHE[key][1]
    return mod.replace(op=dataclasses.replace(mod.op, K=K, reduce=reduce, dtype=dtype))


def run_gpu_case(A, K, reduce, template, pipe, params, rng, dtype="float32"):
    """Build, run on fresh inputs (in ``dtype``) with a NaN-poisoned output; returns the relative
    error against float64 on the values the kernel received."""
    import torch
    from spcompile.core.formats import as_csr

    tpl = get_template(template)
    tdt = getattr(torch, dtype)
    if reduce is None:                                   # SDDMM
        mod = _piped(A, "sddmm", K, None, dtype, pipe)
        kern = tpl.build(mod, params)
        Xt, X = _dev_array(rng.standard_normal((A.shape[0], K)), dtype)
        Yt, Y = _dev_array(rng.standard_normal((A.shape[1], K)), dtype)
        out = torch.full((A.nnz,), float("nan"), dtype=tdt, device="cuda")
        rt.call(kern, [Xt, Yt], out, dtype=dtype)
        y, ref = out.double().cpu().numpy(), reference.sddmm(as_csr(A), X, Y)
        err = reference.rel_error(y, ref)
        if np.all(np.isfinite(y)):                       # bound relative to |A| |X| |Y| per entry
            Ac = as_csr(A)
            scale = np.abs(Ac.data) * np.einsum("ij,ij->i", np.abs(X[Ac.row_ids]).astype(np.float64),
                                                np.abs(Y[Ac.indices]).astype(np.float64))
            err = min(err, float(np.linalg.norm(y - ref) / max(np.linalg.norm(scale), 1e-300)))
        return err
    mod = _piped(A, "spmm", K, reduce, dtype, pipe)
    kern = tpl.build(mod, params)
    Xt, X = _dev_array(rng.standard_normal((A.shape[1], K)), dtype)
    out = torch.full((A.shape[0], K), float("nan"), dtype=tdt, device="cuda")
    rt.call(kern, [Xt], out, dtype=dtype)
    y, ref = out.double().cpu().numpy(), _ref64(A, X, reduce)
    err = reference.rel_error(y, ref)
    if kern.meta.get("precision", "fp32") != "fp32" and np.all(np.isfinite(y)):
        # reduced precision with cancellation (a 3x3 matrix at K=1): bound relative to |A| |X|
        scale = abs(sp.csr_matrix(A)).astype(np.float64) @ np.abs(X.astype(np.float64))
        err = min(err, float(np.linalg.norm(y - ref) / max(np.linalg.norm(scale), 1e-300)))
    return err


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
def test_gpu_correct():
    rng = np.random.default_rng(7)
    bad = []
    for label, A, K, reduce, template, pipe, params, tol, dtype in gpu_cases():
        err = run_gpu_case(A, K, reduce, template, pipe, params, rng, dtype)
        if not err <= tol:
            bad.append((label, err))
    assert not bad, bad[:10]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
def test_gpu_split_repeatable():
    """impl "mma" with split windows: the last-arriver combination resets its counters, so
    repeated calls give bit-identical results (fixed slot order)."""
    import cupy

    A = gpu_matrices()["random"]
    tc = get_template("tc.wmma_sgt")
    mod = _mod(A, 64, "sum", tc.pipelines(_mod(A, 64))[0])
    kern = tc.build(mod, {**tc.default_params(mod), "max_blocks": 8})
    assert kern.meta["slots"] > 0
    X = cupy.asarray(np.random.default_rng(3).standard_normal((A.shape[1], 64)).astype(np.float32))
    outs = []
    for _ in range(3):
        out = cupy.full((A.shape[0], 64), np.nan, dtype=cupy.float32)
        rt.call(kern, [X], out)
        outs.append(cupy.asnumpy(out))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    assert reference.rel_error(outs[0], _ref(A, cupy.asnumpy(X))) <= TOL["tf32"]


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("name,op", [("tc.wmma_sgt", "spmm"), ("tc.wmma_sgt_sddmm", "sddmm")])
def test_artifact_roundtrip(tmp_path, monkeypatch, name, op):
    """What a saved artifact holds (arrays through .npz, meta through JSON, the fatbin) rebuilds the
    same kernel with load(), compiling nothing."""
    import io
    import json

    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "cache"))
    A = MATRICES["clustered"]()
    tpl = get_template(name)
    base = SparseModule.from_op(make_op(A, op, 24) if op == "sddmm" else make_op(A, op, 24, "sum"))
    mod = Pipeline(list(tpl.pipelines(base)[0]))(base)
    params = {**tpl.default_params(mod), **({"max_blocks": 8} if op == "spmm" else {})}
    k = tpl.build(mod, params)
    buf = io.BytesIO()
    np.savez(buf, **k.arrays)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        arrays = {n: np.array(z[n]) for n in z.files}
    k2 = tpl.load(json.loads(json.dumps(k.params)), arrays, dict(k.files), json.loads(json.dumps(k.meta)))
    assert k2.meta == k.meta and set(k2.arrays) == set(k.arrays)
    for n in k.arrays:
        assert k2.arrays[n].dtype == k.arrays[n].dtype and np.array_equal(k2.arrays[n], k.arrays[n])
