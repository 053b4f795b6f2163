"""tc.wmma_sgt / tc.wmma_sgt_sddmm (TC-GNN) and aspt.tiled (ASpT): every variant compiles with nvcc for sm_90 and
sm_80; the arrays the templates upload reproduce A @ X (numpy emulation in float64, in the
caller's order, after permuting passes too); on a GPU the kernels match the float64 reference
with NaN-poisoned outputs at precision-appropriate tolerances."""
import subprocess

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile import reference
from spcompile.compiler import make_op
from spcompile.ir import SparseModule
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt
from spcompile.runtime import cuda_available
from spcompile.schedules import get_template

from conftest import random_matrix


def _mod(A, K, reduce="sum", pipeline=()):
    return Pipeline(list(pipeline))(SparseModule.from_op(make_op(A, "spmm", K, reduce)))


def _ref(A, X, reduce="sum"):
    from spcompile.formats import as_csr

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
    assert [p[-1]["name"] for p in tc.pipelines(mod)] == ["tile.sgt", "tile.sgt"]
    assert ["cluster.lsh", "tile.aspt"] in [[x["name"] for x in p] for p in aspt.pipelines(mod)]
    for pipe in tc.pipelines(mod):
        assert tc.supports(_mod(A, 32, pipeline=pipe))
    for pipe in aspt.pipelines(mod):
        assert aspt.supports(_mod(A, 32, pipeline=pipe))
    from spcompile.tuner import candidates

    cands = candidates(make_op(A, "spmm", 32, "sum"), "cuda")
    if rt.nvcc_available():
        assert "tc.wmma_sgt" in cands and "aspt.tiled" in cands
        assert any("cluster.lsh" in label for label in cands["aspt.tiled"])


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("prec,shape", [("tf32", "tf32"), ("tf32", "fp16"), ("fp16", "fp16"), ("bf16", "fp16")])
@pytest.mark.parametrize("dense_a", [0, 1])
@pytest.mark.parametrize("reorder", [None, "reorder.rcm", "reorder.degree"])
def test_tc_packing_emulation(name, prec, shape, dense_a, reorder):
    from spcompile.cuda_templates.tc_wmma_sgt import emulate_tc_spmm, tc_arrays
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
    from spcompile.cuda_templates.aspt_tiled import aspt_arrays, emulate_aspt_spmm

    A = MATRICES[name]()
    mod = _mod(A, 7, reduce, pipeline=pipe)
    arrays = aspt_arrays(mod)
    X = np.random.default_rng(2).standard_normal((A.shape[1], 7)).astype(np.float32)
    Y = emulate_aspt_spmm(arrays, {"m": A.shape[0], "H": mod.formats["aspt"].panel_height}, X)
    assert reference.rel_error(Y, _ref(A, X, reduce)) <= 1e-6


def test_tc_mean_scaling_and_empty():
    from spcompile.cuda_templates.tc_wmma_sgt import emulate_tc_spmm, tc_arrays

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
    from spcompile.cuda_templates.tc_wmma_sgt import emulate_mma_spmm, mma_arrays
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
    from spcompile.cuda_templates.tc_wmma_sgt import split_windows

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


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("prec,shape", [("tf32", "sddmm"), ("tf32", "tf32"), ("fp16", "sddmm"), ("bf16", "sddmm")])
@pytest.mark.parametrize("K,reorder", [(1, None), (19, "reorder.rcm"), (40, "reorder.degree")])
def test_sddmm_packing_emulation(name, prec, shape, K, reorder):
    """tc.wmma_sgt_sddmm: block windows / columns, the k-index mapping of the lanes' float4 loads,
    the C layout and the caller's nonzero order reproduce the float64 SDDMM (emulated in float64)."""
    from spcompile.cuda_templates.tc_wmma_sgt import emulate_tc_sddmm, sddmm_arrays
    from spcompile.formats import as_csr
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
    from spcompile.tuner import candidates

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
    elif which == "mma":
        t = get_template("tc.wmma_sgt")
        for prec, bws in (("tf32", (8, 16)), ("fp16", (16,)), ("bf16", (16,))):
            for bw in bws:
                for cg in (1, 2, 4):
                    for u in (1, 2, 4):
                        if t.mma_ok(prec, bw, cg, u):
                            inst.update(t.mma_instances(prec, bw, cg, u, 4))
    elif which == "sddmm":
        t = get_template("tc.wmma_sgt_sddmm")
        for prec, bws in (("tf32", (8, 16)), ("fp16", (16,)), ("bf16", (16,))):
            for bw in bws:
                for ku in (1, 2):
                    inst.update(t.instances(prec, bw, ku, 4))
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
    r = subprocess.run([rt.nvcc_path(), "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    data = out.read_bytes()
    for name, _ in inst:
        assert name.encode() in data, name


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
def test_compile_all_mma_variants(tmp_path):
    """impl "mma" of tc.wmma_sgt: all 52 variants for sm_90 and sm_80, the two archs compiled in
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
    assert ks.meta["BW"] == 16 and ks.meta["tolerance_dtype"] == "tf32"
    at = get_template("aspt.tiled")
    mod = _mod(A, 64, pipeline=at.pipelines(_mod(A, 64))[0])
    k = at.build(mod, at.default_params(mod))
    assert k.meta["warps"] == 8 and k.meta["KT"] == 128


# ------------------------------------------------------------------------------------------
# GPU: correctness against float64, NaN-poisoned outputs
# ------------------------------------------------------------------------------------------
TOL = {"tf32": 2e-3, "fp16": 1e-2, "bf16": 2e-2, "fp32": 1e-5}


def gpu_matrices():
    return {"random": random_matrix(1500, 3000, density=0.002, seed=5),
            "clustered": MATRICES["clustered"](), "tiny": MATRICES["tiny"]()}


def gpu_cases(Ks=(1, 19, 64, 128, 256)):
    """(label, matrix, K, reduce, template, pipeline, params, tolerance) for the GPU checks
    (reduce None: SDDMM)."""
    out = []
    tc, at, ts = get_template("tc.wmma_sgt"), get_template("aspt.tiled"), get_template("tc.wmma_sgt_sddmm")
    for mname, A in gpu_matrices().items():
        for K in Ks:
            for reduce in ("sum", "mean"):
                base = _mod(A, K, reduce)
                for pipe in tc.pipelines(base):
                    mod = _mod(A, K, reduce, pipe)
                    for p in tc.seed_params(mod):
                        out.append((f"{mname}/K{K}/{reduce}/tc/{pipe[0]['options']['shape']}/{p}", A, K, reduce,
                                    "tc.wmma_sgt", pipe, p, TOL[p["precision"]]))
                for pipe in at.pipelines(base):
                    mod = _mod(A, K, reduce, pipe)
                    for p in at.seed_params(mod):
                        out.append((f"{mname}/K{K}/{reduce}/aspt/{len(pipe)}/{p}", A, K, reduce, "aspt.tiled",
                                    pipe, p, TOL["fp32"]))
            base = SparseModule.from_op(make_op(A, "sddmm", K))
            for pipe in ts.pipelines(base):
                mod = Pipeline(list(pipe))(base)
                for p in ts.seed_params(mod):
                    out.append((f"{mname}/K{K}/sddmm/{pipe[0]['options']['shape']}/{p}", A, K, None,
                                "tc.wmma_sgt_sddmm", pipe, p, TOL[p["precision"]]))
    return out


def run_gpu_case(A, K, reduce, template, pipe, params, rng):
    """Build, run on fresh inputs with a NaN-poisoned output; returns the relative error."""
    import cupy
    from spcompile.formats import as_csr

    tpl = get_template(template)
    if reduce is None:                                   # SDDMM
        mod = Pipeline(list(pipe))(SparseModule.from_op(make_op(A, "sddmm", K)))
        kern = tpl.build(mod, params)
        X = rng.standard_normal((A.shape[0], K)).astype(np.float32)
        Y = rng.standard_normal((A.shape[1], K)).astype(np.float32)
        out = cupy.full((A.nnz,), np.nan, dtype=cupy.float32)
        rt.call(kern, "cupy", [cupy.asarray(X), cupy.asarray(Y)], out, out.shape)
        y, ref = cupy.asnumpy(out), reference.sddmm(as_csr(A), X, Y)
        err = reference.rel_error(y, ref)
        if np.all(np.isfinite(y)):                       # bound relative to |A| |X| |Y| per entry
            Ac = as_csr(A)
            scale = np.abs(Ac.data) * np.einsum("ij,ij->i", np.abs(X[Ac.row_ids]).astype(np.float64),
                                                np.abs(Y[Ac.indices]).astype(np.float64))
            err = min(err, float(np.linalg.norm(y - ref) / max(np.linalg.norm(scale), 1e-300)))
        return err
    mod = _mod(A, K, reduce, pipe)
    kern = tpl.build(mod, params)
    X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
    out = cupy.full((A.shape[0], K), np.nan, dtype=cupy.float32)
    rt.call(kern, "cupy", [cupy.asarray(X)], out, out.shape)
    y, ref = cupy.asnumpy(out), _ref(A, X, reduce)
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
    for label, A, K, reduce, template, pipe, params, tol in gpu_cases():
        err = run_gpu_case(A, K, reduce, template, pipe, params, rng)
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
        rt.call(kern, "cupy", [X], out, out.shape)
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
