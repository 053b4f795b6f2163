"""aspt.tiled, two schemes: "panel" (v4: one block per row-panel part and K tile keeps the panel's
rows in shared memory, gathers the remainder, stages dense-column chunks, writes Y once; split
panels combined in slot order) and "tasks" (v3: dense tasks = panel x chunk staged in shared
memory, entries split over warps, remainder rows with long rows split, atomic combine).

CPU: the uploaded arrays of each scheme, run through a numpy emulation of its kernels (panel: per
block accumulators, whole-panel stores / partials + ordered combine into a NaN-filled output;
tasks: plain row stores, then atomic combines), reproduce the float64 reference for sum / mean /
max / min on matrices with empty rows, a long row, a hub row, K = 1 and odd K, several panel
heights, chunk sizes, step sizes, block splits, with and without cluster.lsh; every kernel
variant of both schemes compiles for sm_90 and sm_80.
GPU (``@pytest.mark.gpu``): every seed configuration against float64 on fresh inputs with
NaN-poisoned outputs."""
import subprocess

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.core import numerics, reference  # noqa: F401
from spcompile.compile import make_op
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt
from spcompile.runtime import cuda_available
from spcompile.kernels import get_template

from conftest import random_matrix

REDUCES = ("sum", "mean", "max", "min")


def _mod(A, K, reduce="sum", pipeline=()):
    return Pipeline(list(pipeline))(SparseModule.from_op(make_op(A, "spmm", K, reduce)))


def _ref(A, X, reduce):
    return reference.run("spmm", reduce, as_csr(A), X)


def _hub(seed=3):
    """Power-law-like matrix: a few hub columns shared by many rows, a hub row, empty rows."""
    rng = np.random.default_rng(seed)
    m, n = 700, 500
    rows = rng.integers(0, m, 6000)
    cols = np.minimum((rng.pareto(1.2, 6000) * 8).astype(np.int64), n - 1)
    A = sp.coo_matrix((rng.standard_normal(6000), (rows, cols)), shape=(m, n)).tocsr()
    A = A + sp.csr_matrix((rng.standard_normal(n), (np.full(n, 5), np.arange(n))), shape=(m, n))
    keep = np.ones(m)
    keep[[0, 17, m - 1]] = 0.0
    A = (sp.diags(keep) @ A).tocsr()
    A.sum_duplicates()
    A.eliminate_zeros()
    return A.astype(np.float32)


MATRICES = {
    "random": lambda: random_matrix(300, 257, density=0.03, seed=0),
    "hub": _hub,
    "clustered": lambda: sp.csr_matrix(sp.block_diag([sp.random(40, 40, density=0.5, random_state=i)
                                                      for i in range(6)]) + sp.random(240, 240, density=0.005,
                                                                                      random_state=9)).astype(np.float32),
    "tiny": lambda: sp.csr_matrix(np.array([[0, 2.0, 0], [0, 0, 0], [1.0, 0, -3.0]], dtype=np.float32)),
}

PIPES = {"h256": [("tile.aspt", {"panel_height": 256})],
         "h16": [("tile.aspt", {"panel_height": 16})],
         "lsh": [("cluster.lsh", {"skip_dense_ratio": 1.0, "panel_height": 64}), ("tile.aspt", {"panel_height": 64})]}


# ------------------------------------------------------------------------------------------
# CPU: packing + numpy emulation of both kernels
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("pipe", sorted(PIPES))
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("chunk,max_seg,max_ent", [(128, 256, 0), (3, 4, 5), (1, 0, 1), (64, 16, 32)])
def test_emulation_matches_reference(name, pipe, reduce, chunk, max_seg, max_ent):
    from spcompile.kernels.aspt.template import aspt_arrays, emulate_aspt_spmm

    A = MATRICES[name]()
    K = 5
    mod = _mod(A, K, reduce, PIPES[pipe])
    arrays = aspt_arrays(mod, chunk, max_seg, max_ent)
    X = np.random.default_rng(2).standard_normal((A.shape[1], K)).astype(np.float32)
    Y = emulate_aspt_spmm(arrays, {"m": A.shape[0], "reduce": reduce}, X)
    assert np.all(np.isfinite(Y)), "an output row was never written"
    assert reference.rel_error(Y, _ref(A, X, reduce)) <= 1e-6


PANEL_CFGS = [(96, 2048, 2, 1, 5), (3, 5, 64, 1, 1), (1, 1, 1, 3, 5), (8, 0, 200, 2, 7), (16, 7, 1000, 1, 1),
              (8, 16, 0, 1, 5)]


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("pipe", sorted(PIPES))
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("chunk,max_ent,split,ktiles,K", PANEL_CFGS)
def test_panel_emulation_matches_reference(name, pipe, reduce, chunk, max_ent, split, ktiles, K):
    from spcompile.kernels.aspt.template import aspt_panel_arrays, emulate_panel_spmm

    A = MATRICES[name]()
    mod = _mod(A, K, reduce, PIPES[pipe])
    arrays = aspt_panel_arrays(mod, chunk, max_ent, split, ktiles)
    X = np.random.default_rng(3).standard_normal((A.shape[1], K)).astype(np.float32)
    Y = emulate_panel_spmm(arrays, {"m": A.shape[0], "H": mod.formats["aspt"].panel_height, "reduce": reduce}, X)
    assert np.all(np.isfinite(Y)), "an output row was never written"
    assert reference.rel_error(Y, _ref(A, X, reduce)) <= 1e-6


def test_panel_structure():
    """Steps: gather steps before staged ones inside a block, rows ascending inside a step, at most
    max_ent entries and chunk staged columns; blocks ordered heaviest first; a hub panel is split
    and its blocks form one group of consecutive slots; every panel has a block."""
    from spcompile.kernels.aspt.template import aspt_panel_arrays

    A = MATRICES["hub"]()
    H = 64
    mod = _mod(A, 8, "sum", [("tile.aspt", {"panel_height": H})])
    a = aspt_panel_arrays(mod, chunk=7, max_ent=9, split=16)
    ep = a["st_eptr"].astype(np.int64)
    assert np.all(np.diff(ep) <= 9) and np.all(np.diff(ep) >= 1) and np.all(a["st_nc"] <= 7)
    es = np.repeat(np.arange(ep.size - 1), np.diff(ep))
    r = a["ent_row"].astype(np.int64)
    same = es[1:] == es[:-1]
    assert np.all(np.diff(r)[same] >= 0)
    for b in range(a["blk_s0"].size):
        s0, sf, s1 = a["blk_s0"][b], a["blk_sf"][b], a["blk_s1"][b]
        assert np.all(a["st_nc"][s0:sf] == 0) and np.all(a["st_nc"][sf:s1] > 0)
    assert sorted(a["blk_row0"].tolist()) == sorted(set(a["blk_row0"].tolist()) | set(range(0, A.shape[0], H))) \
        or set(range(0, A.shape[0], H)) <= set(a["blk_row0"].tolist())
    assert a["grp_n"].size >= 1 and a["grp_n"].max() >= 2
    slots = np.sort(a["blk_slot"][a["blk_slot"] >= 0])
    assert np.array_equal(slots, np.arange(slots.size)) and slots.size == a["grp_n"].sum()
    # heaviest first: the first block carries at least as many entries as the last
    ne = [ep[a["blk_s1"][b]] - ep[a["blk_s0"][b]] if a["blk_s1"][b] > a["blk_s0"][b] else 0 for b in (0, -1)]
    assert ne[0] >= ne[1]


def test_task_structure():
    """Tasks hold at most `chunk` staged columns; each task's entries are ordered by row then slot
    and address only its own slots; tail segments hold at most max_seg entries."""
    from spcompile.kernels.aspt.template import aspt_arrays

    A = MATRICES["hub"]()
    mod = _mod(A, 8, "sum", PIPES["h256"])
    a = aspt_arrays(mod, chunk=7, max_seg=16, max_ent=9)
    xs = a["task_nc"]
    assert xs.min() >= 1 and xs.max() <= 7
    te = a["task_eptr"].astype(np.int64)
    assert np.all(np.diff(te) <= 9) and np.all(np.diff(te) >= 1)
    et = np.repeat(np.arange(te.size - 1), np.diff(te))
    assert np.all(a["ent_slot"] < xs[et]) and np.all(a["ent_slot"] >= 0)
    # no perm: out == row; inside a chunk entries ascend by (row, slot), split tasks continue it
    key = a["task_x0"][et].astype(np.int64) * (A.shape[0] + 1) * 8 + a["ent_out"].astype(np.int64) * 8 + a["ent_slot"]
    assert np.all(np.diff(key) > 0)
    assert np.all(a["tail_hi"] - a["tail_lo"] <= 16) and np.all(a["tail_hi"] > a["tail_lo"])
    assert np.all(a["rem_end1"] - a["rem_ptr"][:-1] <= 16)
    assert a["tail_lo"].size > 0          # the hub row is split


def test_template_metadata():
    at = get_template("aspt.tiled")
    A = MATRICES["random"]()
    base = _mod(A, 32)
    assert {("spmm", r) for r in REDUCES} <= set(at.ops)
    pipes = at.pipelines(base)
    assert [[p["name"] for p in pipe] for pipe in pipes] == [["tile.aspt"], ["cluster.lsh", "tile.aspt"]]
    for pipe in pipes:
        mod = _mod(A, 32, "max", pipe)
        assert at.supports(mod)
        for p in at.seed_params(mod):
            assert set(p) == set(at.space(mod))
            for k, v in p.items():
                assert v in at.space(mod)[k].choices, (k, v)


# ------------------------------------------------------------------------------------------
# nvcc: every variant compiles for sm_90 and sm_80
# ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("arch", [90, 80])
def test_compile_all_variants(tmp_path, arch):
    t = get_template("aspt.tiled")
    inst = sorted({i for r in ("sum", "max", "min") for v in (1, 2, 4) for cf in (1, 2, 4)
                   for i in t.instances(v, cf, 1, r)})
    panel = sorted({i for r in ("sum", "max", "min") for v in (1, 2, 4) for nb in (1, 2)
                    for i in t.instances(v, 1, 1, r, "panel", nb)})
    src = tmp_path / "aspt.cu"
    src.write_text(t.render(inst + panel))
    out = tmp_path / "aspt.cubin"
    r = subprocess.run([rt.nvcc_path(), "-cubin", "-O3", "-std=c++17", f"-arch=sm_{arch}", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    data = out.read_bytes()
    for name, _ in inst:
        assert (name + "_rows").encode() in data and (name + "_tiles").encode() in data, name
    for name, _ in panel:
        assert (name + "_panels").encode() in data, name


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
def test_build_without_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "cache"))
    at = get_template("aspt.tiled")
    A = MATRICES["hub"]()
    mod = _mod(A, 19, "min", at.pipelines(_mod(A, 19))[0])
    k = at.build(mod, {**at.default_params(mod), "scheme": "tasks", "chunk": 512, "cf": 4, "vec": 4})
    assert k.meta["vec"] == 1 and k.meta["KT"] == 128 and k.meta["reduce"] == "min"
    assert k.meta["smem"] <= 112 * 1024 and k.files["kernel.fatbin"].startswith(str(tmp_path))
    with pytest.raises(ValueError):
        at.build(mod, {**at.default_params(mod), "cf": 3})
    # panel scheme: the chunk shrinks to what fits next to the accumulator (sm_90: 227 KiB)
    mod = _mod(A, 64, "max", at.pipelines(_mod(A, 64))[0])
    k = at.build(mod, {**at.default_params(mod), "scheme": "panel", "nbuf": 2, "chunk": 512})
    H = mod.formats["aspt"].panel_height
    assert k.meta["scheme"] == "panel" and k.meta["vec"] == 4 and k.meta["KT"] == 128
    assert k.meta["smem"] == (H + 2 * k.meta["chunk"]) * 128 * 4 <= 227 * 1024 and k.meta["chunk"] < 512
    assert type(at.load(k.params, k.arrays, k.files, k.meta)).__name__ == "AsptPanelKernel"
    with pytest.raises(ValueError):
        at.build(_mod(A, 64, "sum", [("tile.aspt", {"panel_height": 1024})]), {**at.default_params(mod), "scheme": "panel"})


# ------------------------------------------------------------------------------------------
# GPU: every seed configuration, NaN-poisoned outputs, fresh inputs, float64 reference
# ------------------------------------------------------------------------------------------
def gpu_cases():
    at = get_template("aspt.tiled")
    mats = {"random": random_matrix(1500, 3000, density=0.002, seed=5), "hub": MATRICES["hub"](),
            "tiny": MATRICES["tiny"]()}
    for mname, A in mats.items():
        for K in (1, 19, 64, 128, 256):
            for reduce in REDUCES:
                if K in (1, 64) and reduce in ("mean", "min"):
                    continue
                for pi, pipe in enumerate(at.pipelines(_mod(A, K, reduce))):
                    mod = _mod(A, K, reduce, pipe)
                    for p in at.seed_params(mod):
                        yield f"{mname}/K{K}/{reduce}/pipe{pi}/{p}", A, K, reduce, mod, p


def run_case(A, K, reduce, mod, params, rng, misalign=False):
    import cupy

    kern = get_template("aspt.tiled").build(mod, params)
    X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
    if misalign:    # X and Y one float off a 16-byte boundary: the VEC=1 fallback instance
        xb = cupy.asarray(np.concatenate([[0.0], X.ravel()]).astype(np.float32))
        xd = xb[1:].reshape(X.shape)
        ob = cupy.full(A.shape[0] * K + 1, np.nan, dtype=cupy.float32)
        out = ob[1:].reshape(A.shape[0], K)
    else:
        xd = cupy.asarray(X)
        out = cupy.full((A.shape[0], K), np.nan, dtype=cupy.float32)
    rt.call(kern, [xd], out)
    y = cupy.asnumpy(out)
    return reference.rel_error(y, _ref(A, X, reduce)) if np.all(np.isfinite(y)) else float("inf")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
def test_gpu_correct():
    rng = np.random.default_rng(11)
    bad = []
    n = 0
    for label, A, K, reduce, mod, p in gpu_cases():
        err = run_case(A, K, reduce, mod, p, rng)
        n += 1
        if not err <= 1e-5:
            bad.append((label, err))
    A = MATRICES["hub"]()
    for reduce in REDUCES:
        mod = _mod(A, 64, reduce, get_template("aspt.tiled").pipelines(_mod(A, 64))[0])
        err = run_case(A, 64, reduce, mod, get_template("aspt.tiled").default_params(mod), rng, misalign=True)
        if not err <= 1e-5:
            bad.append((f"misaligned/{reduce}", err))
    assert not bad, f"{len(bad)} of {n} failed: {bad[:10]}"
