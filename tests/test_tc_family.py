"""The tc family (tc.wmma_sgt impls "mma" / "wmma", tc.wmma_sgt_sddmm) on the nvcc template base
(CPU: no GPU, no nvcc needed).

* Kernels built through the template (``compile=False``: the template's own parameter checks,
  packing, instance and meta) run through the numpy emulation of their kernels
  (``kernels/tc/emulate.py``, outputs NaN-poisoned) and reproduce the float64 reference on
  awkward inputs: empty rows, a row holding every column (split windows), an all-empty matrix,
  K = 1, K not a multiple of the vector width, fp32 and 16-bit inputs, every seed configuration.
  The emulation itself catches a lost work item.
* Each kernel's launch plans bind every parameter by name: arrays and workspaces to their device
  pointers, the tile source impl "wmma" does not upload to null, scalars to the kernel's values,
  the call's pointers in their slots; grids cover every window / item / block and every column.
* The per-call choice of the aligned or the VEC = 1 launch (impl "wmma" reads only X with
  vectors), the opt-in to more than 48 KiB of dynamic shared memory, parameter checks, and the
  rendered CUDA of the tc templates (the kernel cache key) byte for byte.
"""
import hashlib
import types

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.compile import make_op
from spcompile.core import reference
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule
from spcompile.kernels import get_template
from spcompile.kernels.tc import emulate as em
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt

from conftest import random_matrix


def _matrices():
    return {
        "random": random_matrix(300, 257, density=0.03, seed=0),          # empty rows + a 257-long row
        "wide": random_matrix(70, 900, density=0.01, seed=3),             # a 900-long row: long windows
        "tiny": sp.csr_matrix(np.array([[0, 2.0, 0], [0, 0, 0], [1.0, 0, -3.0]], dtype=np.float32)),
        "nothing": sp.csr_matrix((20, 9), dtype=np.float32),
    }


MATS = _matrices()
TOL = {"tf32": 2e-3, "fp16": 1e-2, "bf16": 1e-2, "3xtf32": 1e-6}   # 3xtf32: split tf32, fp32-level


def _mod(A, op, K, reduce=None, dtype="float32", shape="fp16", pipe=()):
    base = SparseModule.from_op(make_op(A, op, K, reduce, dtype=dtype))
    return Pipeline(list(pipe) + [("tile.sgt", {"shape": shape})])(base)


def _inputs(rng, shape, dtype):
    """Inputs as the kernel sees them: 16-bit workloads get 16-bit values."""
    x = rng.standard_normal(shape)
    return x if dtype == "float32" else em.round_to(x, dtype)


def _close(got, ref, tol):
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    scale = max(1.0, float(np.abs(ref).max(initial=0.0)))
    err = float(np.abs(got - ref).max(initial=0.0)) / scale
    assert err <= tol, err


def _emulate_spmm(k, X):
    p = k.params
    if k.meta["impl"] == "mma":
        return em.emulate_mma_spmm(k.arrays, k.meta, X, col_groups=int(p["col_groups"]),
                                   warps=int(p["warps_per_block"]))
    Y = em.emulate_tc_spmm(k.arrays, k.meta, X)
    return Y if k.meta["dtype"] == "float32" else em.round_to(Y, k.meta["dtype"])   # Y rounded once


# ------------------------------------------------------------------------------------------
# built kernels through the emulation against the float64 reference
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MATS))
@pytest.mark.parametrize("dtype,shape", [("float32", "tf32"), ("float32", "fp16"), ("float16", "fp16"),
                                         ("bfloat16", "fp16")])
@pytest.mark.parametrize("K", [1, 13, 64])
def test_spmm_kernels_emulate_reference(name, dtype, shape, K):
    A = MATS[name]
    t = get_template("tc.wmma_sgt")
    rng = np.random.default_rng(K)
    X = _inputs(rng, (A.shape[1], K), dtype)
    for reduce in ("sum", "mean"):
        mod = _mod(A, "spmm", K, reduce, dtype, shape)
        ref = reference.run("spmm", reduce, as_csr(A), X)
        seeds = t.seed_params(mod) + [{**t.default_params(mod), "max_blocks": 2}]
        assert {"mma", "wmma"} <= {p["impl"] for p in seeds}
        for p in seeds:
            k = t.build(mod, p, compile=False)
            assert k.meta["vec"] == (1 if K % (4 if dtype == "float32" else 8) else (4 if dtype == "float32" else 8))
            Y = _emulate_spmm(k, X)
            _close(Y, ref, TOL[p["precision"]])
            if dtype != "float32":
                assert np.array_equal(Y, em.round_to(Y, dtype))          # written in the input dtype


@pytest.mark.parametrize("name", sorted(MATS))
@pytest.mark.parametrize("dtype,shape", [("float32", "tf32"), ("float32", "sddmm"), ("float16", "sddmm"),
                                         ("bfloat16", "sddmm")])
@pytest.mark.parametrize("K", [1, 13, 64])
def test_sddmm_kernels_emulate_reference(name, dtype, shape, K):
    A = MATS[name]
    t = get_template("tc.wmma_sgt_sddmm")
    rng = np.random.default_rng(K + 1)
    X, Y = _inputs(rng, (A.shape[0], K), dtype), _inputs(rng, (A.shape[1], K), dtype)
    mod = _mod(A, "sddmm", K, None, dtype, shape)
    ref = reference.sddmm(as_csr(A), X, Y)
    for p in t.seed_params(mod):
        k = t.build(mod, p, compile=False)
        out = em.emulate_tc_sddmm(k.arrays, k.meta, X, Y)
        _close(out, ref, TOL[p["precision"]])


def test_emulation_catches_a_lost_work_item():
    A = MATS["wide"]
    t = get_template("tc.wmma_sgt")
    mod = _mod(A, "spmm", 16, "sum")
    k = t.build(mod, {**t.default_params(mod), "max_blocks": 8}, compile=False)
    assert k.meta["slots"] > 0
    X = np.random.default_rng(0).standard_normal((A.shape[1], 16))
    _close(_emulate_spmm(k, X), A.astype(np.float64) @ X, TOL["tf32"])
    items = k.arrays["items"]
    for drop in (int(np.flatnonzero(items[:, 3] >= 0)[0]), int(np.flatnonzero(items[:, 3] < 0)[0])):
        # a split window's slot, a whole window
        arrays = {**k.arrays, "items": np.delete(items, drop, axis=0)}
        Y = em.emulate_mma_spmm(arrays, k.meta, X, col_groups=int(k.params["col_groups"]))
        assert not np.isfinite(Y).all()


# ------------------------------------------------------------------------------------------
# launch plans: every parameter bound by name
# ------------------------------------------------------------------------------------------
SPMM_CASES = [("mma", {"impl": "mma", "max_blocks": 2}), ("mma", {"impl": "mma", "max_blocks": 0, "col_groups": 2,
                                                                  "unroll": 1}),
              ("wmma", {"impl": "wmma", "dense_a": 1, "tiles_per_warp": 2}),
              ("wmma", {"impl": "wmma", "dense_a": 0, "warps_per_block": 16})]


def _plans(k):
    names = [*k.arrays, *k.workspaces()]
    dev = {n: 0x7F0000000000 + 0x10000 * i for i, n in enumerate(names)}
    return dev, k.make_plans(None, dev)


def _check_arguments(t, k, dev, plans, calls, scalars, nulls=()):
    assert len(plans) == len(k.meta["instances"]) == (2 if k.meta["vec"] > 1 else 1)
    src = t.render([(n, tuple(a)) for n, a in k.meta["instances"]])
    per_call = dict(zip((*k.inputs, k.output), calls))
    for plan, (iname, _) in zip(plans, k.meta["instances"]):
        args = plan.arguments(calls)
        assert [(n, ty) for n, ty, _ in args] == list(rt.kernel_signature(src, iname).params)
        for n, ctype, v in args:
            if n in per_call:
                assert (ctype, v) == ("ptr", per_call[n])
            elif n in dev:
                assert (ctype, v) == ("ptr", dev[n])
            elif n in nulls:
                assert (ctype, v) == ("ptr", 0), n
            else:
                assert (ctype, v) == ("int32", scalars[n]), n
        assert {n for n, _, _ in args} >= set(dev)                    # every array / workspace reaches it


@pytest.mark.parametrize("impl,params", SPMM_CASES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("K", [1, 13, 64, 200])
def test_spmm_plan_arguments_follow_the_signature(impl, params, dtype, K):
    A = MATS["wide"]
    t = get_template("tc.wmma_sgt")
    mod = _mod(A, "spmm", K, "mean", dtype)
    p = {**t.default_params(mod), **params}
    if impl == "mma" and not t.mma_ok(p["precision"], 16, p["col_groups"], p["unroll"], dtype != "float32"):
        p["unroll"] = 1
    k = t.build(mod, p, compile=False)
    dev, plans = _plans(k)
    calls = (0x7E0000000000, 0x7E0000000100)
    nulls = set() if impl == "mma" else {"tiles", "nz_ptr", "nz_pos", "nz_val"} - set(k.arrays)
    assert len(nulls) == (0 if impl == "mma" else 3 if p["dense_a"] else 1)
    _check_arguments(t, k, dev, plans, calls, {"m": A.shape[0], "K": K}, nulls)
    W = int(p["warps_per_block"])
    for plan in plans:
        assert plan.block == (32 * W, 1, 1)
        if impl == "mma":
            cols = k.meta["span"] * int(p["col_groups"]) * W
            assert plan.grid[0] == k.arrays["items"].shape[0] and plan.smem == 0
        else:
            cols = 16 * int(p["tiles_per_warp"]) * W
            assert plan.grid[0] == k.meta["windows"] and k.meta["windows"] * 16 >= A.shape[0]
            assert plan.smem == k.meta["smem_fixed"] + W * k.meta["smem_per_warp"] > 0
        assert (plan.grid[1] - 1) * cols < K <= plan.grid[1] * cols     # every column, no idle slice
    if impl == "mma":
        ws = k.workspaces()
        ngrp = k.arrays["grp_ptr"].size - 1
        assert ws["part"] == (k.arrays["slot_grp"].size * 16 * K, "float32")
        assert ws["counters"] == (ngrp * plans[0].grid[1] * W, "int32")
        assert (ngrp > 0) == (p["max_blocks"] == 2)
    else:
        assert k.workspaces() == {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("K", [1, 13, 64])
def test_sddmm_plan_arguments_follow_the_signature(dtype, K):
    A = MATS["random"]
    t = get_template("tc.wmma_sgt_sddmm")
    mod = _mod(A, "sddmm", K, None, dtype, "sddmm")
    k = t.build(mod, {**t.default_params(mod), "warps_per_block": 8}, compile=False)
    dev, plans = _plans(k)
    nblk = k.arrays["blk_win"].size
    _check_arguments(t, k, dev, plans, (0x7E0000000000, 0x7E0000000100, 0x7E0000000200),
                     {"m": A.shape[0], "K": K, "nblk": nblk})
    assert all(p.grid == (-(-nblk // 8), 1, 1) and p.block == (256, 1, 1) for p in plans)
    assert k.workspaces() == {}


def _recorder():
    """A stand-in launch plan that records the pointers and stream of each call."""
    def plan(ptrs, stream):
        plan.calls.append((tuple(ptrs), stream))
    plan.calls = []
    return plan


@pytest.mark.parametrize("dtype,elem", [("float32", 4), ("float16", 2)])
def test_each_call_chooses_aligned_or_fallback_launch(dtype, elem):
    A = MATS["random"]
    t = get_template("tc.wmma_sgt")
    mod = _mod(A, "spmm", 64, "sum", dtype)
    base = 1 << 20
    for impl, y_needs_alignment in (("mma", True), ("wmma", False)):
        k = t.build(mod, {**t.default_params(mod), "impl": impl}, compile=False)
        assert k.meta["vec"] * elem == 16
        main, fb = _recorder(), _recorder()
        k.use_plans([main, fb])
        k.launch((base,), base + 4096, 9)
        k.launch((base + 4 * elem,), base, 9)        # X one 4-element step off a 16-byte vector (fp16)
        k.launch((base,), base + elem, 9)            # Y off
        x_off = [((base + 4 * elem, base), 9)] if elem == 2 else []
        y_off = [((base, base + elem), 9)]
        assert fb.calls == x_off + (y_off if y_needs_alignment else [])
        assert len(main.calls) + len(fb.calls) == 3
    s = get_template("tc.wmma_sgt_sddmm")
    smod = _mod(A, "sddmm", 64, None, dtype, "sddmm")
    sk = s.build(smod, s.default_params(smod), compile=False)
    main, fb = _recorder(), _recorder()
    sk.use_plans([main, fb])
    sk.launch((base, base), base + elem, 3)          # out needs no vector alignment
    sk.launch((base, base + elem), base, 3)
    assert main.calls == [((base, base, base + elem), 3)] and fb.calls == [((base, base + elem, base), 3)]
    # nothing to do: no launch
    empty = s.build(_mod(MATS["nothing"], "sddmm", 64, None, dtype, "sddmm"), s.default_params(smod),
                    compile=False)
    empty.use_plans([main, fb])
    empty.launch((base, base), base, 3)
    assert len(main.calls) == 1 and len(fb.calls) == 1


def test_large_shared_memory_is_opted_in():
    """impl "wmma" with 16 warps stages more than 48 KiB: each function's limit is raised to the
    launch's dynamic shared memory before the plans are made (and never for small launches)."""
    t = get_template("tc.wmma_sgt")
    mod = _mod(MATS["random"], "spmm", 256, "sum", "float32", "fp16")
    k = t.build(mod, {**t.default_params(mod), "impl": "wmma", "warps_per_block": 16, "tiles_per_warp": 4,
                      "dense_a": 0}, compile=False)
    names = [*k.arrays, *k.workspaces()]
    fns = [types.SimpleNamespace(max_dynamic_shared_size_bytes=0) for _ in k.meta["instances"]]
    plans = k.make_plans(fns, {n: 0x7F0000000000 + 0x10000 * i for i, n in enumerate(names)})
    assert plans[0].smem > 48 * 1024
    assert [f.max_dynamic_shared_size_bytes for f in fns] == [p.smem for p in plans]
    small = t.build(mod, {**t.default_params(mod), "impl": "wmma", "warps_per_block": 2}, compile=False)
    fns = [types.SimpleNamespace(max_dynamic_shared_size_bytes=0) for _ in small.meta["instances"]]
    small.make_plans(fns, {n: 1 << 40 for n in small.arrays})
    assert all(f.max_dynamic_shared_size_bytes == 0 for f in fns)


# ------------------------------------------------------------------------------------------
# parameter checks, arch rebuild, rendered source
# ------------------------------------------------------------------------------------------
def test_invalid_parameters_are_named():
    A = MATS["random"]
    t = get_template("tc.wmma_sgt")
    mod = _mod(A, "spmm", 32, "sum", shape="tf32")
    with pytest.raises(ValueError, match=r"impl='x' \(must be one of \['mma', 'wmma'\]\), warps_per_block=3"):
        t.build(mod, {"impl": "x", "warps_per_block": 3}, compile=False)
    with pytest.raises(ValueError, match=r"precision='fp16' \(must be one of \['tf32', '3xtf32'\]\)"):
        t.build(mod, {"precision": "fp16"}, compile=False)          # 8-wide blocks: tf32 only
    with pytest.raises(ValueError, match=r"max_blocks=-1 \(must be an integer >= 0\)"):
        t.build(mod, {"max_blocks": -1}, compile=False)
    with pytest.raises(ValueError, match="registers would spill"):
        t.build(mod, {"col_groups": 4, "unroll": 4}, compile=False)
    with pytest.raises(ValueError, match="at most 8 warps"):
        t.build(mod, {"impl": "mma", "warps_per_block": 16}, compile=False)
    assert t.build(mod, {"impl": "wmma", "warps_per_block": 16}, compile=False).meta["impl"] == "wmma"
    with pytest.raises(ValueError, match="needs a 16-row SGT format"):
        t.build(SparseModule.from_op(make_op(A, "spmm", 32, "sum")), {}, compile=False)
    with pytest.raises(ValueError, match="does not match"):
        h = _mod(A, "spmm", 32, "sum", dtype="float16")
        t.build(h, {"precision": "tf32"}, compile=False)
    s = get_template("tc.wmma_sgt_sddmm")
    smod = _mod(A, "sddmm", 32, None, shape="sddmm")
    with pytest.raises(ValueError, match=r"k_unroll=3 \(must be one of \[1, 2\]\)"):
        s.build(smod, {"k_unroll": 3}, compile=False)
    with pytest.raises(ValueError, match="unknown parameter"):
        s.build(smod, {"impl": "mma"}, compile=False)


def test_binary_rebuilt_for_another_arch(monkeypatch):
    """A kernel made for sm_90 loaded on sm_80 compiles the same instances (both entry-point
    macros of tc_wmma_sgt.cu render from the instance names)."""
    t = get_template("tc.wmma_sgt")
    mod = _mod(MATS["random"], "spmm", 64, "sum")
    k = t.build(mod, t.default_params(mod), compile=False)
    inst = [(n, tuple(a)) for n, a in k.meta["instances"]]
    assert [n[:7] for n, _ in inst] == ["tc_mma_", "tc_mma_"]
    src = t.render(inst)
    assert all(f"SPC_TC_MMA_INSTANCE({n}, " in src and f"SPC_TC_SPMM_INSTANCE({n}" not in src for n, _ in inst)
    compiled = []
    monkeypatch.setattr(t, "compile",
                        lambda inst, arch=None, name="": compiled.append((inst, arch)) or "/new.fatbin")
    monkeypatch.setattr(rt, "_device_arch", lambda device: 80)
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 80)
    monkeypatch.setattr(rt, "nvcc_available", lambda: True)
    k = t.load(k.params, k.arrays, {"kernel.fatbin": "/old.fatbin"}, {**k.meta, "arch": 90})
    assert k._binary(0) == "/new.fatbin" and compiled == [(inst, 80)] and k.meta["arch"] == 80


def test_needs_sm80(monkeypatch):
    t = get_template("tc.wmma_sgt_sddmm")
    mod = _mod(MATS["tiny"], "sddmm", 8, None, shape="sddmm")
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 75)
    with pytest.raises(ValueError, match="needs sm_80 or newer"):
        t.build(mod, t.default_params(mod), compile=False)


#: sha256 of the rendered source (the on-disk kernel cache key) of tc instances (main + VEC = 1
#: fallback where the instance has one); tc.wmma_sgt's changed with the split-tf32 path (template
#: version 4), tc.wmma_sgt_sddmm's are the same as before the move onto the nvcc base.  A change
#: here invalidates every cached tc kernel binary -- update only for an intended kernel change
RENDER_SHA256 = [
    ("tc.wmma_sgt", ("tf32", 8, 1, 1, 4), {}, "a713e2330db7d0d0bacc2c66b0bbe6b8f3d7517046a3e02de8439c23ebb0e185"),
    ("tc.wmma_sgt", ("tf32", 16, 2, 0, 1), {}, "0cfa83c30eacd5dc6568a1d97af9dec3b2693bb1bcf578e295ead43b11ca6429"),
    ("tc.wmma_sgt", ("fp16", 16, 4, 1, 4), {}, "d11b0c4d6c42eabdf137b1987190afa999f19b9f7d7e653bbef6618431445e3d"),
    ("tc.wmma_sgt", ("bf16", 16, 1, 0, 8, 1), {}, "96186e954ff1616a3700da46b02c2b060020788927fcae14715692e66f30886c"),
    ("tc.wmma_sgt", ("fp16", 16, 2, 1, 8, 1), {}, "d9d55da171f3a49b37011b24d12c13d694d81dc5ac53e343d57d3b079b65d390"),
    ("tc.wmma_sgt", ("tf32", 16), {"vec": 4, "impl": "mma", "cg": 2, "unroll": 2},
     "cba6d61d65f4134592d02ba6f32673f5c6ef1c129983ca3217f1832e71092c43"),
    ("tc.wmma_sgt", ("tf32", 8), {"vec": 1, "impl": "mma", "cg": 1, "unroll": 4},
     "6d4758208932008550390b2ba454ff63d5db99548507402ed06234da15c7cd47"),
    ("tc.wmma_sgt", ("fp16", 16), {"vec": 8, "ti": 1, "impl": "mma", "cg": 2, "unroll": 1},
     "9ff0a0c996c5e7386be21dc354996a9b19629d7120a5ce527370ff2a251144e2"),
    ("tc.wmma_sgt", ("bf16", 16), {"vec": 4, "impl": "mma", "cg": 1, "unroll": 2},
     "fab852ab453f4303c7d5e7720f34e155e04d44eb464d74977413db715a26e02e"),
    ("tc.wmma_sgt_sddmm", ("tf32", 8, 2, 4), {}, "35e062c7820c8b2c90d2ee6942df7997c5d9544e97707e6f954c173a387265d7"),
    ("tc.wmma_sgt_sddmm", ("tf32", 16, 1, 1), {}, "45666e1d42a2447f3ef2f53051a491f3a5a3f8f2b4e4719275d009a28571c5bc"),
    ("tc.wmma_sgt_sddmm", ("fp16", 16, 2, 8, 1), {}, "41e4c00a9c990d8428ec966c855fb68350b4e7a52ac1d33722c7d84aa5d8ab95"),
    ("tc.wmma_sgt_sddmm", ("bf16", 16, 1, 4), {}, "2af63934320ef4ad96805c602ad8347dc07269fbc6a1682886bba59304b55b61"),
]


def test_rendered_source_unchanged():
    for name, args, kw, want in RENDER_SHA256:
        t = get_template(name)
        inst = t.instances(*args, **kw)
        if kw.get("impl") == "mma":
            assert inst == t.mma_instances(args[0], args[1], kw["cg"], kw["unroll"], kw["vec"], kw.get("ti", 0))
        got = hashlib.sha256(t.render(inst).encode()).hexdigest()
        assert got == want, f"rendered source of {name}{args}{kw} changed: cached kernels are rebuilt"
