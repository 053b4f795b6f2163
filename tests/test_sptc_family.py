"""sptc.vnm on the nvcc template base (CPU: no GPU, no nvcc needed).

* A built kernel (``compile=False``) run launch by launch through the numpy emulation
  (``kernels/sptc/emulate.py``: zeroing, the tiles over the columns its grid covers, fp32 scratch
  and finishing of 16-bit builds, remainder; NaN-filled output) reproduces the float64 reference
  for every X / Y dtype and precision, both packings, split and unsplit windows, every slab /
  warp shape, K = 1, K not a multiple of the slab width, empty rows and a very long row.
* Each launch of a call binds every parameter of its kernel by name (arrays, the scratch
  workspace, scalars, the call's X / Y in their slots), in the order the kernels need.
* The emulation catches missing launches and short grids; the base refuses a launch of an
  undeclared entry point or a binding to an unknown parameter.
* The rendered CUDA of every instance (the kernel cache key) byte for byte.
"""
import hashlib
import itertools

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.compile import make_op
from spcompile.core import numerics, reference
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule
from spcompile.kernels import get_template
from spcompile.kernels.nvcc import LaunchSpec
from spcompile.kernels.sptc import emulate as em
from spcompile.kernels.sptc import template as sv
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt

from conftest import random_matrix

PIPES = {"vnm": [{"name": "reorder.vnm", "options": {"V": 1, "N": 2, "M": 4}}], "none": [{"name": "format.vnm"}],
         "rcm": [{"name": "reorder.rcm"}, {"name": "format.vnm"}]}
DTYPES = ("float32", "float16", "bfloat16")


def _mod(A, K, reduce="sum", pipe="vnm", dtype="float32"):
    return Pipeline(list(PIPES[pipe]))(SparseModule.from_op(make_op(A, "spmm", K, reduce, dtype=dtype)))


def _matrix(m=133, n=300, seed=0):
    """fp16-exact values, empty rows, a row holding every column, dense 4-chunks (a remainder)."""
    A = random_matrix(m, n, density=0.03, seed=seed).tolil()
    A[3, :] = 0
    A[m - 1, :] = 0
    A[m // 2, :] = np.linspace(-1, 1, n)
    A[1, :12] = 1.5
    A = A.tocsr()
    A.data = A.data.astype(np.float16).astype(np.float32)
    return A


def _kernel(mod, **params):
    t = get_template("sptc.vnm")
    return t.build(mod, {**t.default_params(mod), **params}, compile=False)


# ------------------------------------------------------------------------------------------
# the kernels' launches, emulated, against the float64 reference
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 13, 64])
def test_emulated_launches_match_reference(dtype, K):
    A = _matrix()
    rng = np.random.default_rng(K)
    X = numerics.round_to(rng.standard_normal((A.shape[1], K)), dtype)
    for reduce, pipe in (("sum", "vnm"), ("mean", "rcm"), ("sum", "none")):
        mod = _mod(A, K, reduce, pipe, dtype)
        ref = reference.run("spmm", reduce, as_csr(A), X)
        seen = set()
        for prec, pack, split, nt, w in itertools.product(sv.precisions_for(dtype), sv.PACKS, (0, 1, 3),
                                                           (1, 2, 8), (1, 4)):
            k = _kernel(mod, precision=prec, pack=pack, split=split, slabs_per_warp=nt, warps_per_block=w)
            Y = em.emulate_kernel(k, X)
            assert not np.isnan(Y).any(), (prec, pack, split, nt, w)
            tol = numerics.PRECISIONS[prec].tolerance
            assert reference.rel_error(Y, ref) < tol, (prec, pack, split, nt, w)
            seen.update(s.entry for s in k.launch_spec(1))
        # every helper kernel of this dtype was exercised
        sfx = {"float32": "_kernel", "float16": "_h", "bfloat16": "_b"}[dtype]
        want = {None, "sptc_remainder" + sfx} | ({"sptc_zero_rows"} if dtype == "float32"
                                                 else {"sptc_zero_scratch", "sptc_finish" + sfx})
        assert want <= seen, seen


def test_emulation_exact_for_fp16_exact_inputs():
    """fp16 A and X, fp32 Y, sum: every product and sum is exact in float64, so the emulated
    launches equal the reference exactly (any lost, doubled or misplaced entry shows)."""
    A = _matrix(77, 500, seed=3)
    K = 21
    X = numerics.round_to(np.random.default_rng(0).standard_normal((500, K)), "fp16")
    ref = reference.run("spmm", "sum", as_csr(A), X)
    for pipe, pack, split in itertools.product(PIPES, sv.PACKS, (0, 2)):
        k = _kernel(_mod(A, K, "sum", pipe), precision="fp16", pack=pack, split=split)
        np.testing.assert_allclose(em.emulate_kernel(k, X), ref, rtol=1e-12, atol=1e-12)
        # the arrays-only emulation agrees
        Y = sv.emulate_sptc_spmm(k.arrays, k.meta, X)
        np.testing.assert_allclose(Y, ref, rtol=1e-12, atol=1e-12)


def test_16bit_output_is_rounded_once_per_store():
    """A 16-bit Y holds dtype values: split windows go through fp32 scratch (one rounding)."""
    A = _matrix(64, 200, seed=5)
    K = 16
    X = numerics.round_to(np.random.default_rng(1).standard_normal((200, K)), "bfloat16")
    k = _kernel(_mod(A, K, "sum", "rcm", "bfloat16"), pack="condensed", split=1)
    assert k.arrays["zero_rows"].size > 0 and k.meta["remainder_nnz"] == 0
    Y = em.emulate_kernel(k, X)
    assert np.array_equal(numerics.round_to(Y, "bfloat16"), Y)
    ref = reference.run("spmm", "sum", as_csr(A), X)
    assert reference.rel_error(Y, ref) < numerics.DTYPES["bfloat16"].tolerance


# ------------------------------------------------------------------------------------------
# launches: what each one binds, in which order
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pack,split", [("block", 2), ("condensed", 0), ("condensed", 1)])
def test_plan_arguments_follow_the_signatures(dtype, pack, split):
    A = _matrix()
    K = 40
    mod = _mod(A, K, "mean", "vnm", dtype)
    k = _kernel(mod, pack=pack, split=split, warps_per_block=2, slabs_per_warp=2)
    names = [*k.arrays, *k.workspaces()]
    dev = {n: 0x7F0000000000 + 0x10000 * i for i, n in enumerate(names)}
    X_ptr, Y_ptr = 0x7E0000000000, 0x7E0000001000
    plans = k.make_plans(None, dev)
    assert len(plans) == len(k.meta["instances"]) == 1
    seq = plans[0]
    if not isinstance(seq, rt.LaunchSequence):      # the instance's kernel alone: one plain plan
        seq = rt.LaunchSequence([seq], [(0, 1)])
    specs = k.launch_spec(1)
    E = sv.ELEMS[dtype]
    nz, nrem = k.arrays["zero_rows"].size, k.arrays["rem_rows"].size
    inst = k.meta["instances"][0][0]
    src = get_template("sptc.vnm").render([(n, tuple(a)) for n, a in k.meta["instances"]])
    sfx = ("_kernel", "_h", "_b")[E]
    order = ([("sptc_zero_rows" if E == 0 else "sptc_zero_scratch")] if nz else []) + [inst] \
        + (["sptc_finish" + sfx] if nz and E else []) + (["sptc_remainder" + sfx] if nrem else [])
    assert [p.signature.name for p in seq.plans] == order
    assert isinstance(plans[0], rt.LaunchSequence) == (len(order) > 1)
    assert (nz > 0) == (split > 0) and (nrem > 0) == (pack == "block")
    alias = {"rows": "zero_rows"}
    scalars = {inst: {"m": A.shape[0], "K": K}, "sptc_remainder" + sfx: {"nrows": nrem, "K": K}}
    for plan, spec, args in zip(seq.plans, specs, seq.arguments((X_ptr, Y_ptr))):
        assert [(n, t_) for n, t_, _ in args] == list(rt.kernel_signature(src, plan.signature.name).params)
        assert (plan.grid, plan.block, plan.smem) == (tuple(spec.grid), tuple(spec.block), spec.smem)
        for n, ctype, v in args:
            if n in ("X", "Y"):
                assert (ctype, v) == ("ptr", {"X": X_ptr, "Y": Y_ptr}[n]), (plan.signature.name, n)
            elif n in dev or n in alias:
                assert (ctype, v) == ("ptr", dev[alias.get(n, n)]), (plan.signature.name, n)
            else:
                want = scalars.get(plan.signature.name, {"nrows": nz, "K": K})[n]
                assert (ctype, v) == ("int32", want), (plan.signature.name, n)
    main = seq.plans[order.index(inst)]
    assert main.grid == (k.arrays["items"].size // 4, -(-K // 32), 1) and main.block == (64, 1, 1)
    # the 16-bit scratch holds the split windows' rows; fp32 builds add into Y (scratch unused)
    assert k.workspaces()["S"] == ((nz * K if E else 0), "float32")


class _Recorder:
    def __init__(self, name, per_call):
        self.per_call, self.calls = per_call, []
        self.signature = rt.KernelSignature(name, tuple((n, "ptr") for n in per_call))

    def __call__(self, ptrs, stream):
        self.calls.append((tuple(ptrs), stream))


def test_sequence_passes_each_launch_its_pointers():
    zero, main, rem = _Recorder("z", ("Y",)), _Recorder("m", ("X", "Y")), _Recorder("s", ())
    seq = rt.LaunchSequence([zero, main, rem], [(1,), (0, 1), ()])
    seq((11, 22), 5)
    assert zero.calls == [((22,), 5)] and main.calls == [((11, 22), 5)] and rem.calls == [((), 5)]
    with pytest.raises(ValueError, match="per-call"):
        rt.LaunchSequence([main], [(0,)])
    A = _matrix()
    k = _kernel(_mod(A, 8), split=1, pack="block")
    calls = []
    k.use_plans([lambda ptrs, stream: calls.append((tuple(ptrs), stream))])
    k.launch((0x1000,), 0x2004, 7)               # misaligned pointers take the one instance
    assert calls == [((0x1000, 0x2004), 7)]


def test_base_refuses_bad_launch_bindings(monkeypatch):
    A = _matrix()
    k = _kernel(_mod(A, 8), split=1)
    dev = {n: 0x1000 * (i + 1) for i, n in enumerate([*k.arrays, *k.workspaces()])}
    specs = k.launch_spec(1)
    assert specs[0].entry == "sptc_zero_rows"
    for bad, match in ((LaunchSpec((1, 1, 1), (32, 1, 1), entry="sptc_nope"), "not one of the template's entry"),
                       (LaunchSpec((1, 1, 1), (32, 1, 1), args={"nrows": 1, "K": 8}, entry="sptc_zero_rows",
                                   bind={"rowz": "zero_rows"}), "unknown parameters"),
                       (LaunchSpec((1, 1, 1), (32, 1, 1), args={"nrows": 1, "K": 8}, entry="sptc_zero_rows"),
                        r"missing \['rows'\]"),
                       (LaunchSpec((1, 1, 1), (32, 1, 1), args={"nrows": 1, "K": 8, "m": 3},
                                   entry="sptc_zero_rows", bind={"rows": "zero_rows"}), r"unknown \['m'\]")):
        monkeypatch.setattr(k, "launch_spec", lambda vec, bad=bad: [bad, *specs[1:]])
        with pytest.raises(ValueError, match=match):
            k.make_plans(None, dev)


def test_emulation_catches_missing_launches_and_short_grids(monkeypatch):
    A = _matrix()
    K = 40
    X = numerics.round_to(np.random.default_rng(2).standard_normal((A.shape[1], K)), "fp16")
    ref = reference.run("spmm", "sum", as_csr(A), X)
    for dtype, drop in (("float32", "sptc_zero_rows"), ("float16", "sptc_zero_scratch"),
                        ("float16", "sptc_finish_h"), ("float32", "sptc_remainder_kernel")):
        k = _kernel(_mod(A, K, "sum", "vnm", dtype), split=1, pack="block", slabs_per_warp=1, warps_per_block=1)
        specs = k.launch_spec(1)
        assert reference.rel_error(em.emulate_kernel(k, X), ref) < 1e-2
        monkeypatch.setattr(k, "launch_spec", lambda vec, s=specs, d=drop: [x for x in s if x.entry != d])
        Y = em.emulate_kernel(k, X)
        if drop.startswith("sptc_remainder"):       # remainder rows lack their extra entries
            assert reference.rel_error(Y, ref) > 1e-2
        else:
            assert np.isnan(Y).any(), drop
    k = _kernel(_mod(A, K), slabs_per_warp=1, warps_per_block=1, split=0)   # stores only: no zeroed rows
    specs = k.launch_spec(1)
    main = next(s for s in specs if s.entry is None)
    short_y = LaunchSpec((main.grid[0], main.grid[1] - 1, 1), main.block, main.smem, main.args)
    short_x = LaunchSpec((main.grid[0] - 1, main.grid[1], 1), main.block, main.smem, main.args)
    for short, where in ((short_y, np.s_[:, K - 8:]), (short_x, None)):
        monkeypatch.setattr(k, "launch_spec", lambda vec, sh=short: [sh if s.entry is None else s for s in specs])
        Y = em.emulate_kernel(k, X)
        assert np.isnan(Y[where] if where else Y).any()
        if where:
            assert np.isnan(Y[:, K - 8:]).all() and not np.isnan(Y[:, :K - 8]).any()


# ------------------------------------------------------------------------------------------
# parameters, arch, rendered source
# ------------------------------------------------------------------------------------------
def test_invalid_parameters_are_named(monkeypatch):
    A = _matrix()
    t = get_template("sptc.vnm")
    mod = _mod(A, 8)
    with pytest.raises(ValueError, match=r"warps_per_block=3 .*slabs_per_warp=16 .*split=-1 \(must be an integer >= 0\)"):
        t.build(mod, {"warps_per_block": 3, "slabs_per_warp": 16, "split": -1}, compile=False)
    with pytest.raises(ValueError, match=r"pack='dense'"):
        t.build(mod, {"pack": "dense"}, compile=False)
    with pytest.raises(ValueError, match="vnm format"):
        t.build(SparseModule.from_op(make_op(A, "spmm", 8, "sum")), {}, compile=False)
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 75)
    with pytest.raises(ValueError, match="needs sm_80"):
        t.build(mod, {}, compile=False)


def test_meta_and_empty_kernel():
    A = _matrix()
    k = _kernel(_mod(A, 24), pack="block", split=0)
    m = k.meta
    assert m["tiles"] == k.arrays["ccol"].size // 32 and m["remainder_nnz"] == k.arrays["rem_vals"].size > 0
    assert m["items"] == k.arrays["items"].size // 4 and m["precision"] == "fp16" and m["pack"] == "block"
    assert not k.empty()
    z = _kernel(_mod(sp.csr_matrix((20, 30), dtype=np.float32), 24))
    Y = em.emulate_kernel(z, np.ones((30, 24)))
    assert not np.isnan(Y).any() and not Y.any()     # windows without tiles still store zeros


#: sha256 of the rendered source (the on-disk kernel cache key) of every sptc.vnm instance; a
#: change here invalidates every cached sptc binary -- update only for an intended kernel change
RENDER_SHA256 = {
    ('fp16', 1, 'float32'): "1f8a115c91ab43901410fc6edfcb56a11636435281a0e4ee0bd3a22ba19c7bf2",
    ('fp16', 2, 'float32'): "d4a74cb2c4b1a4611d1273955a91ae11ee7b67295a31d8edb6e0c74bdd415c60",
    ('fp16', 4, 'float32'): "6ae9c25ceb4592934115a138015d5f70258c06b703badaa187f5d7efcdced1b5",
    ('fp16', 8, 'float32'): "90e54f0eacf2bcb1181d0db336c68ab9a4d117c3f1dab723cd9a5fda58dc6826",
    ('bf16', 1, 'float32'): "1f750ccdbe770c18c336285ebb9b5ee5ed5ec35caf42da68b64b20219627f14f",
    ('bf16', 2, 'float32'): "5b519d619288dff81def20939ecca60e34c9ddae4c7d4c1e0c35dd960b751098",
    ('bf16', 4, 'float32'): "396e413831a917d5ff70b378c943029ace30771865d3372cd829608794eba093",
    ('bf16', 8, 'float32'): "b2c2973d9ac358cf5aac9137506d5b9b851bfb108ad978eca18b66609e73fa99",
    ('fp16', 1, 'float16'): "c57f500ea03a859aaa8214a8fd14761fe72c987964d2b0c0863d2a2a8995a09f",
    ('fp16', 2, 'float16'): "469cc0a3da33d6eb88eac7dd0438adc708eb7eb973e820adbc83cee2cb1e175e",
    ('fp16', 4, 'float16'): "f0ca507418ad9e792e36be2dc60966494bcbdcfc5fdf89628a3374a1cfba4833",
    ('fp16', 8, 'float16'): "8d4b196161a204bd82d88c7a68481fc747461ecc75b8a4f06b8a6ff474f4844f",
    ('bf16', 1, 'bfloat16'): "5529426ddae6c18f67fe5520d02439ee093e8506ddfe79ffa24fb0c9fdd9ccf3",
    ('bf16', 2, 'bfloat16'): "62df21ee0816db3b083f7881cb857d2c01f94e6be84c164f398c6c560c057d66",
    ('bf16', 4, 'bfloat16'): "8d29a8df240511e1ad2e9fad2b50f9b5c0984b781ad9006bebe33fdbdc0ebfea",
    ('bf16', 8, 'bfloat16'): "4046f9907ffe0b049469981b6821fb510a6763c243fa55368d3d6dd25be62e8a",
}


def test_rendered_source_unchanged():
    t = get_template("sptc.vnm")
    assert len(RENDER_SHA256) == 16
    for args, want in RENDER_SHA256.items():
        got = hashlib.sha256(t.render(t.instances(*args)).encode()).hexdigest()
        assert got == want, f"rendered source of sptc.vnm{args} changed: cached kernels are rebuilt"
