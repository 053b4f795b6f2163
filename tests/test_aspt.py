"""aspt.tiled, two schemes: "panel" (v4: one block per row-panel part and K tile keeps the panel's
rows in shared memory, gathers the remainder, stages dense-column chunks, writes Y once; split
panels combined in slot order) and "tasks" (v3: dense tasks = panel x chunk staged in shared
memory, entries split over warps, remainder rows with long rows split, atomic combine).

CPU: the uploaded arrays of each scheme (``kernels/aspt/packer.py``), run through a numpy
emulation of its kernels (``kernels/aspt/emulate.py``; panel: per block accumulators, whole-panel
stores / partials + ordered combine into a NaN-filled output; tasks: plain row stores, then atomic
combines), reproduce the float64 reference for sum / mean / max / min on matrices with empty rows,
a long row, a hub row, K = 1 and odd K, several panel heights, chunk sizes, step sizes, block
splits, with and without cluster.lsh.  Built kernels (no binary) run through the emulation with
what their launch specs cover (rows, tasks, tail segments, blocks, K tiles, scalars, shared
memory, workspaces), for the vector instance and its VEC = 1 fallback; broken launches are caught.
Every launch argument is bound by name (checked against the parsed signature of each entry
point), each call picks the aligned or fallback launches, a binary for another arch is rebuilt
through the base, and the rendered CUDA (kernel cache key) is unchanged byte for byte.  Every
kernel variant of both schemes compiles for sm_90 and sm_80.
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

from conftest import hub_matrix as _hub, random_matrix

REDUCES = ("sum", "mean", "max", "min")


def _mod(A, K, reduce="sum", pipeline=()):
    return Pipeline(list(pipeline))(SparseModule.from_op(make_op(A, "spmm", K, reduce)))


def _ref(A, X, reduce):
    return reference.run("spmm", reduce, as_csr(A), X)




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
    from spcompile.kernels.aspt.emulate import emulate_aspt_spmm
    from spcompile.kernels.aspt.packer import aspt_arrays

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
    from spcompile.kernels.aspt.emulate import emulate_panel_spmm
    from spcompile.kernels.aspt.packer import aspt_panel_arrays

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
    from spcompile.kernels.aspt.packer import aspt_panel_arrays

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
    from spcompile.kernels.aspt.packer import aspt_arrays

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
# built kernels (no binary): emulation over the launch specs, plans bound by name
# ------------------------------------------------------------------------------------------
TASKS = {"scheme": "tasks", "chunk": 16, "max_seg": 8, "max_ent": 32, "cf": 2, "warps": 4, "rows_per_warp": 2}
PANEL = {"scheme": "panel", "chunk": 16, "max_ent": 32, "warps": 8, "nbuf": 2, "split": 4}
#: scheme settings x (K, vec): K = 1, K not a multiple of the vector (6: vec 2), odd K, wide K
KERNEL_CASES = [(TASKS, 1, 4), (TASKS, 6, 4), (TASKS, 19, 2), (TASKS, 200, 4),
                ({**TASKS, "max_seg": 0, "cf": 1, "rows_per_warp": 1, "max_ent": 0}, 64, 4),
                (PANEL, 1, 4), (PANEL, 6, 4), (PANEL, 19, 4), (PANEL, 200, 4),
                ({**PANEL, "nbuf": 1, "split": 0, "max_ent": 0}, 64, 2)]
KMATS = {**MATRICES, "nothing": lambda: sp.csr_matrix((6, 5), dtype=np.float32)}


def _built(A, K, reduce, params, pipe="h16"):
    at = get_template("aspt.tiled")
    mod = _mod(A, K, reduce, PIPES[pipe])
    return at.build(mod, {**at.default_params(mod), **params}, compile=False)


@pytest.mark.parametrize("name", sorted(KMATS))
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("case", range(len(KERNEL_CASES)))
def test_kernel_emulation_matches_reference(name, reduce, case):
    from spcompile.kernels.aspt.emulate import emulate_kernel

    params, K, vec = KERNEL_CASES[case]
    A = KMATS[name]()
    k = _built(A, K, reduce, {**params, "vec": vec}, "lsh" if case % 3 == 0 else "h16")
    assert k.meta["vec"] == (vec if K % vec == 0 else 2 if K % 2 == 0 else 1)
    X = np.random.default_rng(case).standard_normal((A.shape[1], K)).astype(np.float32)
    ref = _ref(A, X, reduce)
    for fallback in (False, True):
        Y = emulate_kernel(k, X, fallback=fallback)
        assert Y.shape == ref.shape and np.all(np.isfinite(Y)), "an output element was never written"
        assert reference.rel_error(Y, ref) <= 1e-6


def test_emulation_catches_broken_launches(monkeypatch):
    """What a wrong launch would do shows: rows or K tiles not covered stay NaN, a wrong scalar,
    too little shared memory or workspace, a missing tile launch or too many blocks raise."""
    from dataclasses import replace

    from spcompile.kernels.aspt.emulate import emulate_kernel

    A = MATRICES["hub"]()
    K = 300                                                 # vec 2: 3 K tiles of 128 (tasks), 5 of 64 (panel)
    X = np.random.default_rng(0).standard_normal((A.shape[1], K)).astype(np.float32)
    ref = _ref(A, X, "sum")

    def broken(params, edit):
        k = _built(A, K, "sum", {**params, "vec": 2})
        assert reference.rel_error(emulate_kernel(k, X), ref) <= 1e-6
        specs = k.launch_specs(2)
        monkeypatch.setattr(k, "launch_spec", lambda vec: edit(specs))
        return k

    # tasks: rows launch one block short; tile launch one K tile short; scalars; shared memory
    k = broken(TASKS, lambda s: (replace(s[0], grid=(s[0].grid[0] - 1, *s[0].grid[1:])), s[1]))
    assert np.isnan(emulate_kernel(k, X)).any()
    k = broken(TASKS, lambda s: (s[0], replace(s[1], grid=(s[1].grid[0], s[1].grid[1] - 1, 1))))
    Y = emulate_kernel(k, X)
    assert np.isfinite(Y).all() and reference.rel_error(Y, ref) > 1e-3     # dense part missing in the last tile
    k = broken(TASKS, lambda s: (s[0], replace(s[1], args={**s[1].args, "ntail": s[1].args["ntail"] - 1})))
    with pytest.raises(ValueError, match="scalar arguments"):
        emulate_kernel(k, X)
    k = broken(TASKS, lambda s: (s[0], replace(s[1], smem=s[1].smem - 4)))
    with pytest.raises(ValueError, match="shared memory"):
        emulate_kernel(k, X)
    k = broken(TASKS, lambda s: s[:1])
    with pytest.raises(ValueError, match="no tile launch"):
        emulate_kernel(k, X)
    k = broken(TASKS, lambda s: (s[0], replace(s[1], grid=(s[1].grid[0] + 1, *s[1].grid[1:]))))
    with pytest.raises(ValueError, match="dense tasks"):
        emulate_kernel(k, X)
    # panel: one K tile short, a split group missing its last block, too many blocks, scratch
    k = broken(PANEL, lambda s: (replace(s[0], grid=(s[0].grid[0], s[0].grid[1] - 1, 1)),))
    assert np.isnan(emulate_kernel(k, X)[:, -1]).all()
    k = _built(A, K, "sum", {**PANEL, "vec": 2})
    assert k.arrays["grp_n"].size >= 1
    last = int(np.flatnonzero(k.arrays["blk_slot"] >= 0).max())
    monkeypatch.setattr(k, "launch_spec", lambda vec, s=k.launch_specs(2): (replace(s[0], grid=(last, *s[0].grid[1:])),))
    assert np.isnan(emulate_kernel(k, X)).any()
    k = broken(PANEL, lambda s: (replace(s[0], grid=(s[0].grid[0] + 1, *s[0].grid[1:])),))
    with pytest.raises(ValueError, match="blocks"):
        emulate_kernel(k, X)
    k = broken(PANEL, lambda s: (replace(s[0], args={**s[0].args, "chunk": 1}),))
    with pytest.raises(ValueError, match="stages more than chunk"):
        emulate_kernel(k, X)
    k = _built(A, K, "sum", {**PANEL, "vec": 2})
    monkeypatch.setattr(k, "workspaces", lambda: {"part": (1, "float32"), "counters": (1, "int32")})
    with pytest.raises(ValueError, match="workspaces"):
        emulate_kernel(k, X)


def _scalars(k, entry):
    """The scalar arguments of an entry point, computed here from the arrays and parameters."""
    a, meta, p = k.arrays, k.meta, k.params
    K, W = int(meta["K"]), int(p["warps"])
    if entry == "_rows":
        return {"m": int(meta["m"]), "K": K, "rpw": int(p["rows_per_warp"])}
    if entry == "_tiles":
        return {"ntail": a["tail_lo"].size, "ntail_blocks": -(-a["tail_lo"].size // W), "K": K}
    return {"K": K, "H": int(meta["H"]), "chunk": int(meta["chunk"])}


class _Fn:
    """Stands for a loaded kernel function (records the dynamic shared memory it is given)."""

    def __init__(self, name):
        self.name = name


class _Module:
    def __init__(self):
        self.asked = []

    def get_function(self, name):
        self.asked.append(name)
        return _Fn(name)


@pytest.mark.parametrize("scheme,K,reduce", [("tasks", 64, "mean"), ("tasks", 33, "max"), ("panel", 64, "min"),
                                             ("panel", 1, "sum"), ("tasks-rows-only", 8, "sum")])
def test_plan_arguments_follow_the_signature(scheme, K, reduce):
    """Each instance's launches: entry points in order (tasks: _rows then _tiles; _rows alone
    without dense tasks and tail segments; panel: _panels), every parameter bound by name --
    arrays and workspaces to their device pointers, scalars to the values computed here, X / Y
    per call -- with the entry's function, grid and shared memory."""
    from spcompile.kernels.nvcc import LaunchSequence

    if scheme == "tasks-rows-only":     # the identity: no dense column, no tail segment
        A, params = sp.identity(40, dtype=np.float32, format="csr"), {**TASKS, "max_seg": 0}
    else:
        A, params = MATRICES["hub"](), (TASKS if scheme == "tasks" else PANEL)
    k = _built(A, K, reduce, {**params, "vec": 4})
    names = [*k.arrays, *k.workspaces()]
    dev = {n: 0x7F0000000000 + 0x10000 * i for i, n in enumerate(names)}
    calls = (0x7E0000000000, 0x7E0000000100)
    mod = _Module()
    k._load_module = lambda: mod
    fns = k._entry_functions()
    plans = k.make_plans(fns, dev)
    inst = [(n, tuple(a)) for n, a in k.meta["instances"]]
    assert len(plans) == len(inst) == (2 if k.meta["vec"] > 1 else 1)
    src = get_template("aspt.tiled").render(inst)
    entries = {"tasks": ["_rows", "_tiles"], "panel": ["_panels"], "tasks-rows-only": ["_rows"]}[scheme]
    assert mod.asked == [n + e for n, _ in inst for e in entries]
    used = set()
    for plan, (iname, _), vec in zip(plans, inst, k.instance_vecs()):
        seq = plan.plans if isinstance(plan, LaunchSequence) else (plan,)
        assert isinstance(plan, LaunchSequence) == (len(entries) > 1)
        assert [p.signature.name for p in seq] == [iname + e for e in entries]
        for p, entry, spec in zip(seq, entries, k.launch_specs(vec)):
            assert p.fn.name == iname + entry and p.grid == spec.grid and p.smem == spec.smem
            if spec.smem > 48 * 1024:
                assert p.fn.max_dynamic_shared_size_bytes == spec.smem
            args = p.arguments(calls)
            assert [(n, t) for n, t, _ in args] == list(rt.kernel_signature(src, iname + entry).params)
            want = _scalars(k, entry)
            for n, ctype, v in args:
                if n in ("X", "Y"):
                    assert (ctype, v) == ("ptr", calls[n == "Y"])
                elif n in dev:
                    assert (ctype, v) == ("ptr", dev[n]), n
                    used.add(n)
                else:
                    assert (ctype, v) == ("int32", want.pop(n)), n
            assert not want, f"scalars not passed to {entry}: {want}"
    # every array and workspace reaches a kernel (all of them once the tile launch runs)
    unused = set(names) - used
    assert not unused if scheme != "tasks-rows-only" else unused <= {
        "task_x0", "task_nc", "task_eptr", "dense_xrow", "ent_out", "ent_slot", "ent_val", "tail_lo", "tail_hi",
        "tail_out"}


def test_each_call_chooses_aligned_or_fallback_launches():
    """Both launches of a call go through the same instance: the VEC-wide one when X and Y are
    aligned to its vector, else the VEC = 1 one; a launch sequence runs its plans in order."""
    from spcompile.kernels.nvcc import LaunchSequence

    order = []

    class Rec:
        per_call = ("X", "Y")

        def __init__(self, tag):
            self.tag = tag

        def __call__(self, ptrs, stream):
            order.append((self.tag, tuple(ptrs), stream))

    k = _built(MATRICES["hub"](), 64, "sum", {**TASKS, "vec": 4})
    k.use_plans([LaunchSequence([Rec("rows4"), Rec("tiles4")], [(0, 1), (0, 1)]),
                 LaunchSequence([Rec("rows1"), Rec("tiles1")], [(0, 1), (0, 1)])])
    base = 1 << 20
    k.launch((base,), base + 4096, 7)
    k.launch((base + 4,), base, 7)           # X one float off a 16-byte boundary
    k.launch((base,), base + 8, 7)           # Y off
    assert [t for t, _, _ in order] == ["rows4", "tiles4", "rows1", "tiles1", "rows1", "tiles1"]
    assert order[2][1:] == ((base + 4, base), 7) and order[3][1:] == ((base + 4, base), 7)
    order.clear()
    e = _built(sp.csr_matrix((0, 5), dtype=np.float32), 64, "sum", {**PANEL, "vec": 4})
    assert e.empty()
    e.use_plans([Rec("p4"), Rec("p1")])
    e.launch((base,), base, 7)
    assert order == []


def test_load_picks_the_scheme_kernel_and_rebuilds_for_another_arch(monkeypatch):
    at = get_template("aspt.tiled")
    A = MATRICES["random"]()
    for params, cls in ((PANEL, "AsptPanelKernel"), (TASKS, "AsptKernel")):
        k = _built(A, 32, "max", {**params, "vec": 4})
        assert type(k).__name__ == cls and type(at.load(k.params, k.arrays, k.files, k.meta)).__name__ == cls
    with pytest.raises(RuntimeError, match="without its binary"):
        k._binary(0)
    compiled = []
    monkeypatch.setattr(at, "compile", lambda inst, arch=None, name="": compiled.append((inst, arch, name)) or "/n.fatbin")
    monkeypatch.setattr(rt, "_device_arch", lambda device: 80)
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 80)
    monkeypatch.setattr(rt, "nvcc_available", lambda: True)
    k = at.load(k.params, k.arrays, {"kernel.fatbin": "/old.fatbin"}, {**k.meta, "arch": 90})
    assert k._binary(0) == "/n.fatbin" and k.meta["arch"] == 80
    inst = [(n, tuple(a)) for n, a in k.meta["instances"]]
    assert compiled == [(inst, 80, inst[0][0])]


def test_invalid_parameters_are_named():
    at = get_template("aspt.tiled")
    A = MATRICES["hub"]()
    mod = _mod(A, 64, "sum", PIPES["h16"])
    with pytest.raises(ValueError, match=r"chunk=0 \(must be an integer >= 1\), cf=3 \(must be one of \[1, 2, 4\]\), nbuf=3"):
        at.build(mod, {"cf": 3, "nbuf": 3, "chunk": 0}, compile=False)
    with pytest.raises(ValueError, match="unknown parameter"):
        at.build(mod, {"tile": 4}, compile=False)
    with pytest.raises(ValueError, match="needs an ASpT format"):
        at.build(_mod(A, 64), {}, compile=False)
    with pytest.raises(ValueError, match="no room for staged columns"):
        at.build(_mod(A, 128, "sum", [("tile.aspt", {"panel_height": 1024})]), {**PANEL, "vec": 4}, compile=False)


#: sha256 of the rendered source (the on-disk kernel cache key) of aspt instances, recorded before
#: the family moved onto the nvcc base; a change invalidates every cached aspt binary
RENDER_SHA256 = {
    (4, 2, 1, "sum", "tasks"): "ab21fa73d9d7c7bfc0bf2115442aeaf0b8a6028757c59562188a0cdcc341682b",
    (1, 4, 2, "min", "tasks"): "8c4a6e7fbb1411e1f01b65e6d59dfe5c39d9959ee4c3b85ffd07e44a71910bf1",
    (2, 1, 1, "mean", "tasks"): "9d84f3193d16ff918ade9f56863bd4ecddb41f0169d2ea69b647d28ec4cdacd7",
    (4, 1, 1, "max", "panel", 2): "d8b73ec4c1e105d701bbd33b9f167212fb7683d50d7bcc45671a184e86e38c14",
    (2, 1, 1, "min", "panel", 1): "c78fa14acd0919d5328261d8961a848c713a7c129e0fc034d2b330421b15568d",
    (1, 1, 1, "sum", "panel", 2): "72204be436252a6b8a563cb25766bad5f6ca7e62118ef9d8ffe04e13e1854cb7",
}


def test_rendered_source_unchanged():
    import hashlib

    t = get_template("aspt.tiled")
    assert [n for n, _ in t.instances(4, 2, 1, "sum", "tasks")] == ["aspt_spmm_r0_v4_cf2", "aspt_spmm_r0_v1_cf2"]
    assert t.instances(1, 1, 1, "max", "panel", 2) == [("aspt_panel_r1_v1_b2", (1, 1, 1, 2))]
    for args, want in RENDER_SHA256.items():
        got = hashlib.sha256(t.render(t.instances(*args)).encode()).hexdigest()
        assert got == want, f"rendered source of aspt.tiled{args} changed: cached kernels are rebuilt"


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
