"""The csr family on the nvcc template base (CPU: no GPU, no nvcc needed).

* The packers run through the numpy emulation of each kernel (``kernels/csr/emulate.py``: the
  kernel's segments, writes, column coverage of its launch and split-row combine, into a
  NaN-filled output) reproduce the float64 reference: SpMM sum / max / min / mean with split long
  rows, empty rows, K = 1, K not a multiple of the vector width, both the vector instance and its
  VEC = 1 fallback, after row / column reorderings; SDDMM likewise.  The emulation itself catches
  broken packings (missing segment, missing slot, too few column tiles, a vector past K).
* Each kernel's launch plans bind every parameter by name: arrays and workspaces to their device
  pointers, scalars to the kernel's values, the call's pointers in their slots.
* Parameter checks, the per-call choice of the aligned or fallback launch, the rebuild of a
  binary made for another GPU generation, and the rendered CUDA of the csr templates (the
  kernel cache key) byte for byte.
"""
import hashlib
import json
import itertools

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.compile import make_op
from spcompile.core import numerics, reference
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule
from spcompile.kernels import get_template
from spcompile.kernels.csr import emulate as em
from spcompile.kernels.csr.packer import flat_groups, spmm_partition
from spcompile.kernels.nvcc import LaunchSpec
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt

from conftest import bounded_rows, close_scaled as _close, random_matrix

REDUCES = ("sum", "max", "min", "mean")
PIPES = {"none": [], "rcm": ["reorder.rcm"], "degree": ["reorder.degree"]}


def _matrices():
    return {
        "random": random_matrix(300, 257, density=0.03, seed=0),          # empty rows + a 257-long row
        "tall": random_matrix(700, 40, density=0.05, seed=1, long_row=False),
        "tiny": sp.csr_matrix(np.array([[0, 2.0, 0], [0, 0, 0], [1.0, 0, -3.0]], dtype=np.float32)),
        "nothing": sp.csr_matrix((6, 5), dtype=np.float32),
    }


def _mod(A, op, K, reduce=None, pipe="none", dtype="float32"):
    return Pipeline(list(PIPES[pipe]))(SparseModule.from_op(make_op(A, op, K, reduce, dtype=dtype)))


# ------------------------------------------------------------------------------------------
# emulation against the float64 reference
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_spmm_emulation_matches_reference(reduce, pipe):
    t = get_template("csr.crc_cwm")
    rng = np.random.default_rng(7)
    n_split = 0
    for (name, A), K in itertools.product(_matrices().items(), (1, 3, 6, 33, 64)):
        mod = _mod(A, "spmm", K, reduce, pipe)
        X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
        ref = reference.spmm(as_csr(A), X, reduce)
        for max_seg, (group, vec, cf) in itertools.product((0, 8, 256), ((32, 4, 1), (8, 2, 2), (4, 4, 8), (16, 1, 4))):
            k = t.build(mod, {**t.default_params(mod), "max_seg": max_seg, "group": group, "vec": vec, "cf": cf},
                        compile=False)
            n_split += int(k.arrays["grp_len"].size)
            for fallback in (False, True):
                _close(em.emulate_kernel(k, X, fallback=fallback), ref)
    assert n_split > 0   # split rows were exercised


@pytest.mark.parametrize("flat", [0, 1])
@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_sddmm_emulation_matches_reference(pipe, flat):
    t = get_template("csr.sddmm")
    rng = np.random.default_rng(8)
    # + short rows (mean ~6) around one 3000-long row: flat segments span rows and cut the long one
    mats = {**_matrices(), "long": random_matrix(60, 3000, density=0.002, seed=9)}
    for (name, A), K in itertools.product(mats.items(), (1, 3, 6, 33, 64, 130)):
        mod = _mod(A, "sddmm", K, None, pipe)
        X = rng.standard_normal((A.shape[0], K)).astype(np.float32)
        Y = rng.standard_normal((A.shape[1], K)).astype(np.float32)
        ref = reference.sddmm(as_csr(A), X, Y)
        for npw, (group, vec, xc) in itertools.product((1, 8, 256), ((32, 4, 1), (8, 2, 2), (4, 4, 8), (16, 1, 4))):
            k = t.build(mod, {**t.default_params(mod), "nnz_per_warp": npw, "group": group, "vec": vec,
                              "k_chunks": xc, "flat": flat}, compile=False)
            a = k.arrays
            assert all(int(i[1][4]) == flat for i in k.meta["instances"])
            assert (a["nnz_row"].size, a["seg_xrow"].size == 0) == ((A.nnz, True) if flat else (0, A.nnz == 0))
            if flat:   # plain runs of npw stored entries, whatever the rows
                assert np.array_equal(a["seg_ptr"], np.append(np.arange(0, A.nnz, npw), A.nnz) if A.nnz else [0])
            for fallback in (False, True):
                _close(em.emulate_kernel(k, X, Y, fallback=fallback), ref)


def _half_case(dtype):
    """A 200 x 150 matrix, K = 40, and dense inputs exact in ``dtype`` for rows (200) and columns (150)."""
    A = random_matrix(200, 150, density=0.04, seed=2)
    rng = np.random.default_rng(3)
    K = 40
    return (A, K, numerics.round_to(rng.standard_normal((200, K)), dtype),
            numerics.round_to(rng.standard_normal((150, K)), dtype))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_sddmm_emulation_within_dtype_tolerance(dtype):
    A, K, X, Y = _half_case(dtype)
    ref = reference.sddmm(as_csr(A), X, Y)
    t = get_template("csr.sddmm")
    mod = _mod(A, "sddmm", K, dtype=dtype)
    short = numerics.DTYPES[dtype].short
    for flat in (0, 1):
        k = t.build(mod, {**t.default_params(mod), "flat": flat}, compile=False)
        assert k.meta["vec"] == 8 and k.meta["instances"][0][0].startswith(f"sddmm_csr_{short}")
        assert k.meta["instances"][0][0].endswith("_flat") == bool(flat)
        assert reference.rel_error(em.emulate_kernel(k, X, Y), ref) < numerics.DTYPES[dtype].tolerance


def test_sddmm_flat_partition_and_old_params():
    from spcompile.kernels.csr.packer import sddmm_partition

    indptr = np.array([0, 0, 3000, 3003, 3003, 3010])
    part = sddmm_partition(indptr, np.array([4, 0, 1, 2, 3]), 128, flat=True)
    assert part["seg_ptr"].dtype == np.int32 and part["seg_xrow"].size == 0
    assert part["seg_ptr"].tolist() == list(range(0, 3010, 128)) + [3010]
    assert part["nnz_row"].tolist() == [0] * 3000 + [1] * 3 + [3] * 7
    assert sddmm_partition(np.zeros(4, np.int64), np.arange(3), 32, flat=True)["seg_ptr"].tolist() == [0]
    assert sddmm_partition(indptr, np.arange(5), 128)["nnz_row"].size == 0
    # a parameter set saved before "flat" existed builds the one-row-segment kernel it did then
    A = random_matrix(40, 30, density=0.1, seed=3)
    t = get_template("csr.sddmm")
    mod = _mod(A, "sddmm", 16)
    old = {"group": 16, "vec": 4, "k_chunks": 1, "nnz_per_warp": 32, "warps_per_block": 4}
    k = t.build(mod, old, compile=False)
    assert k.params["flat"] == 0 and k.meta["instances"][0] == ["sddmm_csr_f32_g16_v4_xc1", [0, 16, 4, 1, 0]]
    t.check_arrays(make_op(A, "sddmm", 16).key(), old, k.arrays, k.meta)
    assert t.make_config(old).params == old
    f = t.build(mod, {**old, "flat": 1}, compile=False)
    assert f.meta["instances"][0][0] == "sddmm_csr_f32_g16_v4_xc1_flat"
    assert f.launch_spec(4).args["nseg"] == -(-A.nnz // 32) and not f.empty()
    with pytest.raises(ValueError, match=r"flat=2 \(must be one of \[0, 1\]\)"):
        t.build(mod, {**old, "flat": 2}, compile=False)
    # every seed is a valid parameter set; flat seeds for the default and the 8- / 16-lane shapes
    seeds = t.seed_params(mod)
    flat_seeds = [p for p in seeds if p.get("flat")]
    assert {(p["group"], p["nnz_per_warp"]) for p in flat_seeds} == {(g, n) for g in (4, 8, 16) for n in (32, 128)}
    for p in seeds:
        t.build(mod, p, compile=False)


def test_sddmm_check_arrays_both_layouts():
    """The saved arrays of either segment layout pass; mixing them up, a too long flat segment or
    an X row out of range are refused (a ValueError: the artifact is not loaded)."""
    A = random_matrix(70, 90, density=0.05, seed=5)
    t = get_template("csr.sddmm")
    key = make_op(A, "sddmm", 16).key()
    from spcompile.core.ir import values_hash

    vh = values_hash(as_csr(A))
    mod = _mod(A, "sddmm", 16, pipe="degree")
    p0 = {**t.default_params(mod), "nnz_per_warp": 8}
    k0, k1 = (t.build(mod, {**p0, "flat": f}, compile=False) for f in (0, 1))
    for k in (k0, k1):
        t.check_arrays(key, k.params, k.arrays, k.meta, vh)

    def refused(k, message, params=None, meta=None, **arrays):
        a = {**{n: np.array(v, copy=True) for n, v in k.arrays.items()}, **arrays}
        with pytest.raises(ValueError, match=message):
            t.check_arrays(key, params or k.params, a, {**k.meta, **(meta or {})}, vh)

    a1 = k1.arrays
    refused(k1, "nnz_row", nnz_row=np.append(a1["nnz_row"][:-1], 70).astype(np.int32))      # X row past m
    refused(k1, "nnz_row", nnz_row=a1["nnz_row"][:-1])                                      # truncated
    refused(k1, "pattern hash|order", nnz_row=np.roll(a1["nnz_row"], 1))                     # another row
    refused(k1, "nnz_per_warp", seg_ptr=np.delete(a1["seg_ptr"], 1))                        # segment too long
    refused(k1, "seg_ptr", seg_ptr=np.append(a1["seg_ptr"][:-1], a1["seg_ptr"][-1] + 1))    # overruns
    refused(k1, "seg_xrow", seg_xrow=np.zeros(1, np.int32))                                 # not empty
    refused(k1, "instances", params={**k1.params, "flat": 0}, seg_xrow=k0.arrays["seg_xrow"],
            seg_ptr=k0.arrays["seg_ptr"], nnz_row=k0.arrays["nnz_row"])   # FLAT=1 binary, one-row arrays
    refused(k0, "instances", meta={"instances": k1.meta["instances"]})
    refused(k0, "nnz_row", nnz_row=a1["nnz_row"])                                           # not empty
    refused(k0, "'flat'", params={**k0.params, "flat": "yes"})
    refused(k0, "seg_ptr|seg_xrow", params={**k0.params, "flat": 1}, meta={"instances": k1.meta["instances"]})


def test_sddmm_entries_in_flight():
    """csr.sddmm ``unroll``: U entries a group in flight.  Instances ``_u<U>`` through
    SPC_SDDMM_INSTANCE_U (U last); 1 (absent in saved configs) keeps the one-entry kernel and its
    names; quick selection's variants of a first choice: it and its flat layout batched (4 entries
    where an entry is one 16-byte load a lane, else 2), none on top of a batched choice; the
    emulation (the sums do not depend on U) and the artifact check accept them."""
    A = random_matrix(80, 60, density=0.08, seed=6)
    t = get_template("csr.sddmm")
    mod = _mod(A, "sddmm", 64)
    d = {**t.default_params(mod), "group": 16, "vec": 4, "k_chunks": 1}
    k = t.build(mod, {**d, "unroll": 4}, compile=False)
    assert k.meta["instances"][0] == ["sddmm_csr_f32_g16_v4_xc1_u4", [0, 16, 4, 1, 0, 4]]
    assert k.meta["instances"][1][0] == "sddmm_csr_f32_g16_v1_xc1_u4"                   # VEC = 1 fallback
    assert t.instance_macro_of("sddmm_csr_f32_g16_v4_xc1_u4") == "SPC_SDDMM_INSTANCE_U"
    assert t.instance_macro_of("sddmm_csr_f32_g16_v4_xc1_flat") == "SPC_SDDMM_INSTANCE"
    src = t.render(t.instances(16, 4, 1, "float32", 1, 2))
    assert "SPC_SDDMM_INSTANCE_U(sddmm_csr_f32_g16_v4_xc1_flat_u2, 0, 16, 4, 1, 1, 2)" in src
    assert t.build(mod, d, compile=False).meta["instances"][0] == ["sddmm_csr_f32_g16_v4_xc1", [0, 16, 4, 1, 0]]
    with pytest.raises(ValueError, match="unroll"):
        t.build(mod, {**d, "unroll": 3}, compile=False)
    op = make_op(A, "sddmm", 64)
    assert t.entries_in_flight(d) == 4 and t.entries_in_flight({**d, "k_chunks": 2}) == 2
    assert t.entries_in_flight({**d, "vec": 8}, "float16") == 4 and t.entries_in_flight({**d, "vec": 8}) == 2
    assert t.unranked_variants(d, op) == [{**d, "unroll": 4}, {**d, "flat": 1, "nnz_per_warp": 32},
                                          {**d, "flat": 1, "nnz_per_warp": 32, "unroll": 4}]
    f = {**d, "k_chunks": 2, "flat": 1}
    assert t.unranked_variants(f, op) == [{**f, "unroll": 2}]
    assert t.unranked_variants({**d, "unroll": 2}, op) == []
    assert {p.get("unroll", 1) for p in t.seed_params(mod)} == {1, 4}
    X = np.random.default_rng(1).standard_normal((80, 64)).astype(np.float32)
    Y = np.random.default_rng(2).standard_normal((60, 64)).astype(np.float32)
    ref = reference.sddmm(as_csr(A), X, Y)
    key = op.key()
    for p in ({**d, "unroll": 4}, {**d, "flat": 1, "unroll": 2}):
        kk = t.build(mod, p, compile=False)
        _close(em.emulate_kernel(kk, X, Y), ref)
        t.check_arrays(key, kk.params, kk.arrays, kk.meta)
        bad = [[n, a[:5] + [3]] for n, a in kk.meta["instances"]]
        with pytest.raises(ValueError, match="instances"):
            t.check_arrays(key, kk.params, kk.arrays, {**kk.meta, "instances": bad})


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sddmm_probe_variants(dtype):
    """Quick selection's second round next to a csr.sddmm lead: the lead batched (when it is not)
    and every other lane-group width that covers K with at most 4 column chunks a lane, each with
    its own entries in flight; the lead's segments, block and pipeline kept; every variant a valid
    parameter set whose emulation is exact (K = 1, 33, 64 and 256 on a non-square matrix)."""
    A = random_matrix(70, 50, density=0.1, seed=8)
    t = get_template("csr.sddmm")
    rng = np.random.default_rng(3)
    assert t.probe_variants({"group": 8, "vec": 4, "k_chunks": 1}) == []       # no op, no shapes
    for K in (1, 33, 64, 256):
        op = make_op(A, "sddmm", K, dtype=dtype)
        mod = _mod(A, "sddmm", K, dtype=dtype)
        X = rng.standard_normal((70, K)).astype(dtype)
        Y = rng.standard_normal((50, K)).astype(dtype)
        ref = reference.sddmm(as_csr(A), X.astype(np.float32), Y.astype(np.float32))
        tol = 1e-5 if dtype == "float32" else 1e-3                   # one rounding of each output
        d = t.default_params(mod)
        vec = d["vec"]
        shapes = t.group_shapes(K, vec)
        assert d["group"] in shapes
        for lead in (d, {**d, "flat": 1, "nnz_per_warp": 16, "warps_per_block": 2},
                     {**d, "unroll": t.entries_in_flight(d, dtype)}):
            got = t.probe_variants(lead, op)
            assert lead not in got and len(got) == len({json.dumps(v, sort_keys=True) for v in got})
            batched = {**lead, "unroll": t.entries_in_flight(lead, dtype)}
            assert (batched in got) == (lead.get("unroll", 1) == 1)
            others = [v for v in got if v["group"] != lead["group"]]
            assert sorted(v["group"] for v in others) == sorted(g for g in shapes if g != lead["group"])
            for v in got:
                assert {k: x for k, x in v.items() if k not in ("group", "k_chunks", "unroll")} == \
                       {k: x for k, x in lead.items() if k not in ("group", "k_chunks", "unroll")}
                assert v["unroll"] == t.entries_in_flight(v, dtype) and v["unroll"] > 1
                assert v["k_chunks"] == t.k_chunks(K, v["group"], vec) in (1, 2, 4)
                assert v["group"] * vec * 4 >= K                      # one pass of 4 chunks covers K
                assert t.check_params(mod, v) == {**d, **v}
            for v in got[:2]:
                kk = t.build(mod, v, compile=False)
                _close(em.emulate_kernel(kk, X, Y).astype(np.float64), ref, tol=tol)
    # K=64 at 16 bits: 8 lanes of 8 halves cover a row; 16- and 32-lane groups would idle half or more
    assert get_template("csr.sddmm").group_shapes(64, 8) == (4, 8)
    assert get_template("csr.sddmm").group_shapes(256, 4) == (16, 32)

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_emulation_within_dtype_tolerance(dtype):
    A, K, _, X = _half_case(dtype)
    tol = numerics.DTYPES[dtype].tolerance
    for reduce in REDUCES:
        mod = _mod(A, "spmm", K, reduce, dtype=dtype)
        t = get_template("csr.crc_cwm")
        k = t.build(mod, {**t.default_params(mod), "max_seg": 16}, compile=False)
        assert k.meta["vec"] == 8 and k.meta["instances"][0][0].startswith(f"spmm_crc_cwm_{numerics.DTYPES[dtype].short}")
        ref = reference.spmm(as_csr(A), X, reduce)
        assert reference.rel_error(em.emulate_kernel(k, X), ref) < tol


def test_emulation_catches_broken_packing():
    A = random_matrix(120, 90, density=0.05, seed=4)
    K = 16
    X = np.random.default_rng(0).standard_normal((90, K)).astype(np.float32)
    t = get_template("csr.crc_cwm")
    mod = _mod(A, "spmm", K, "sum")
    k = t.build(mod, {**t.default_params(mod), "max_seg": 8, "group": 4, "vec": 4, "cf": 1}, compile=False)
    ref = reference.spmm(as_csr(A), X, "sum")
    _close(em.emulate_kernel(k, X), ref)
    a = k.arrays
    # a segment lost: its row stays NaN
    cut = {**a, "seg_ptr": a["seg_ptr"][:-1], "seg_out": a["seg_out"][:-1], "seg_slot": a["seg_slot"][:-1]}
    assert np.isnan(em.emulate_spmm(cut, X, "sum", 120)).any()
    # a slice of a split row reports to the wrong group: that row is never combined
    wrong = {**a, "slot_grp": np.where(np.arange(a["slot_grp"].size) == 0, a["slot_grp"].max(), a["slot_grp"])}
    assert a["grp_len"].size >= 2 and np.isnan(em.emulate_spmm(wrong, X, "sum", 120)).any()
    # one column tile too few: the last columns stay NaN
    assert np.isnan(em.emulate_spmm(a, X, "sum", 120, em.spmm_columns(K, 4, 4, 1, 0))).all()
    assert np.isnan(em.emulate_spmm(a, X, "sum", 120, em.spmm_columns(K, 4, 2, 1, 1)))[:, 8:].all()
    # a vector width that does not divide K would write past the row
    with pytest.raises(ValueError, match="reaches past K"):
        em.spmm_columns(6, 4, 4, 1, 1)
    with pytest.raises(ValueError, match="reaches past K"):
        em.sddmm_columns(6, 8, 4, 1)


def test_partition_covers_every_nonzero_once():
    indptr = np.array([0, 0, 10000, 10003, 10003, 10300])
    part = spmm_partition(indptr, np.array([4, 0, 1, 2, 3]), 256)
    seg = part["seg_ptr"]
    assert seg[0] == 0 and seg[-1] == 10300 and np.all(np.diff(seg) >= 0) and np.all(np.diff(seg) <= 256)
    assert list(part["grp_out"]) == [0, 3] and list(part["grp_len"]) == [10000, 297]
    assert (part["seg_slot"] >= 0).sum() == 40 + 2 and list(np.diff(part["grp_ptr"])) == [40, 2]
    assert sorted(part["seg_out"][part["seg_slot"] < 0]) == [1, 2, 4]   # whole rows, the empty one too


# ------------------------------------------------------------------------------------------
# launch plans: every parameter bound by name
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template,op,extra", [("csr.crc_cwm", "spmm", {}), ("csr.crc_cwm", "spmm", {"flat": 1}),
                                               ("csr.crc_cwm", "spmm", {"flat": 1, "flat_nnz": 32}),
                                               ("csr.crc_cwm", "spmm", {"flat": 2, "flat_nnz": 32, "unroll": 8}),
                                               ("csr.sddmm", "sddmm", {})])
@pytest.mark.parametrize("K", [1, 33, 64])
def test_plan_arguments_follow_the_signature(template, op, extra, K):
    A = random_matrix(300, 257, density=0.03, seed=5)
    t = get_template(template)
    mod = _mod(A, op, K, "mean" if op == "spmm" else None)
    params = {**t.default_params(mod), **({"max_seg": 16, "rows_per_warp": 2} if op == "spmm" else {}), **extra}
    k = t.build(mod, params, compile=False)
    names = [*k.arrays, *k.workspaces()]
    dev = {n: 0x7F0000000000 + 0x10000 * i for i, n in enumerate(names)}
    calls = tuple(0x7E0000000000 + 0x100 * i for i in range(len(k.inputs) + 1))
    plans = k.make_plans(None, dev)
    assert len(plans) == len(k.meta["instances"]) == (2 if k.meta["vec"] > 1 else 1)
    src = t.render([(n, tuple(a)) for n, a in k.meta["instances"]])
    nseg = int(k.arrays["seg_ptr"].size) - 1
    flat = bool(extra.get("flat"))
    # row groups: rows_per_warp segments each, or the flat layout's grp_seg runs
    ngroups = int(k.arrays["grp_seg"].size) - 1 if flat else -(-nseg // 2)
    if flat:
        assert k.arrays["grp_seg"][0] == 0 and k.arrays["grp_seg"][-1] == nseg and np.all(np.diff(k.arrays["grp_seg"]) > 0)
        if "flat_nnz" not in extra:
            assert np.all(np.diff(k.arrays["grp_seg"])[:-1] == 2)
    scalars = {"nseg": nseg, "ngroups": ngroups, "K": K, "segs_per_group": params.get("rows_per_warp")}
    for plan, (iname, _) in zip(plans, k.meta["instances"]):
        args = plan.arguments(calls)
        assert [(n, t_) for n, t_, _ in args] == list(rt.kernel_signature(src, iname).params)
        per_call = dict(zip((*k.inputs, k.output), calls))
        for n, ctype, v in args:
            if n in per_call:
                assert (ctype, v) == ("ptr", per_call[n])
            elif n in dev:
                assert (ctype, v) == ("ptr", dev[n])
            else:
                assert (ctype, v) == ("int32", scalars[n]), n
        # every array and workspace reaches the kernel; the grid covers every segment
        assert {n for n, _, _ in args} >= set(names)
        spec = plan.block[0] // 32 * (32 // int(params.get("group", 32)) if op == "spmm" else 1)
        if op == "spmm":
            assert plan.grid[0] * spec >= ngroups > (plan.grid[0] - 1) * spec
        else:
            assert plan.grid[0] * spec >= nseg


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, ptrs, stream):
        self.calls.append((tuple(ptrs), stream))


@pytest.mark.parametrize("dtype,elem", [("float32", 4), ("float16", 2)])
def test_each_call_chooses_aligned_or_fallback_launch(dtype, elem):
    A = random_matrix(50, 40, density=0.1, seed=6)
    t = get_template("csr.crc_cwm")
    mod = _mod(A, "spmm", 32, "sum", dtype=dtype)
    k = t.build(mod, {**t.default_params(mod), "vec": 4}, compile=False)
    main, fb = _Recorder(), _Recorder()
    k.use_plans([main, fb])
    base = 1 << 20
    k.launch((base,), base + 4096, 9)
    k.launch((base + elem,), base, 9)            # X one element off a 4-wide vector
    k.launch((base,), base + 2 * elem, 9)        # Y off
    k.launch((base + 4 * elem,), base + 8 * elem, 9)
    assert main.calls == [((base, base + 4096), 9), ((base + 4 * elem, base + 8 * elem), 9)]
    assert fb.calls == [((base + elem, base), 9), ((base, base + 2 * elem), 9)]

    s = get_template("csr.sddmm")
    smod = _mod(A, "sddmm", 32)
    sk = s.build(smod, {**s.default_params(smod), "vec": 4}, compile=False)
    main, fb = _Recorder(), _Recorder()
    sk.use_plans([main, fb])
    sk.launch((base, base), base + 4, 3)            # out needs no vector alignment
    sk.launch((base, base + 4), base, 3)
    assert main.calls == [((base, base, base + 4), 3)] and fb.calls == [((base, base + 4, base), 3)]
    empty = s.build(_mod(sp.csr_matrix((4, 4), dtype=np.float32), "sddmm", 32), s.default_params(smod),
                    compile=False)
    empty.use_plans([main, fb])
    empty.launch((base, base), base, 3)
    assert len(main.calls) == 1 and len(fb.calls) == 1


def test_launch_spec_shapes():
    A = random_matrix(300, 257, density=0.03, seed=0)
    t = get_template("csr.crc_cwm")
    mod = _mod(A, "spmm", 100, "sum")
    k = t.build(mod, {**t.default_params(mod), "group": 8, "vec": 4, "cf": 2, "warps_per_block": 4,
                      "rows_per_warp": 2, "max_seg": 32}, compile=False)
    nseg = k.arrays["seg_out"].size
    assert k.launch_spec(4) == LaunchSpec((-(-nseg // 32), 2, 1), (128, 1, 1), 1024,
                                          {"nseg": nseg, "ngroups": -(-nseg // 2), "K": 100, "segs_per_group": 2})
    assert k.launch_spec(1).grid[1] == 7
    # flat, nnz-balanced row groups: the grid covers grp_seg's groups (16 per block of 4 warps of
    # 8-lane groups), whatever rows_per_warp says
    kf = t.build(mod, {**k.params, "flat": 1, "flat_nnz": 32}, compile=False)
    ng = kf.arrays["grp_seg"].size - 1
    assert 0 < ng < nseg and kf.launch_spec(4).grid[0] == -(-ng // 16) and kf.launch_spec(4).args["ngroups"] == ng
    ws = k.workspaces()
    assert ws["part"] == (k.arrays["slot_grp"].size * 100, "float32")
    assert ws["counters"] == (k.arrays["grp_len"].size * 7, "int32") and k.arrays["grp_len"].size > 0


# ------------------------------------------------------------------------------------------
# parameter checks, arch rebuild, rendered source
# ------------------------------------------------------------------------------------------
def test_invalid_parameters_are_named():
    A = random_matrix(30, 20, density=0.2, seed=1)
    t = get_template("csr.crc_cwm")
    mod = _mod(A, "spmm", 8, "sum")
    with pytest.raises(ValueError, match=r"cf=3 \(must be one of \[1, 2, 4, 8\]\), vec=8 \(must be one of "
                                         r"\[1, 2, 4\]\), rows_per_warp=0 \(must be an integer >= 1\)"):
        t.build(mod, {"cf": 3, "vec": 8, "rows_per_warp": 0}, compile=False)
    with pytest.raises(ValueError, match=r"max_seg=-1"):
        t.build(mod, {"max_seg": -1}, compile=False)
    with pytest.raises(ValueError, match="unknown parameter"):
        t.build(mod, {"tile": 4}, compile=False)
    s = get_template("csr.sddmm")
    smod = _mod(A, "sddmm", 8)
    with pytest.raises(ValueError, match=r"nnz_per_warp=0 \(must be an integer >= 1\)"):
        s.build(smod, {"nnz_per_warp": 0}, compile=False)
    # 16-bit inputs allow 8-wide vectors
    h = _mod(A, "spmm", 8, "sum", dtype="float16")
    assert t.build(h, {"vec": 8}, compile=False).meta["vec"] == 8


def test_binary_rebuilt_for_another_arch(monkeypatch):
    A = random_matrix(30, 20, density=0.2, seed=1)
    t = get_template("csr.crc_cwm")
    mod = _mod(A, "spmm", 16, "max")
    k = t.build(mod, t.default_params(mod), compile=False)
    with pytest.raises(RuntimeError, match="without its binary"):
        k._binary(0)
    compiled = []
    monkeypatch.setattr(t, "compile", lambda inst, arch=None, name="": compiled.append((inst, arch)) or "/new.fatbin")
    monkeypatch.setattr(rt, "_device_arch", lambda device: 80)
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 80)
    monkeypatch.setattr(rt, "nvcc_available", lambda: True)
    k = t.load(k.params, k.arrays, {"kernel.fatbin": "/old.fatbin"}, {**k.meta, "arch": 90})
    assert k._binary(0) == "/new.fatbin"
    assert compiled == [([(n, tuple(a)) for n, a in k.meta["instances"]], 80)]
    assert k.meta["arch"] == 80 and k.files["kernel.fatbin"] == "/new.fatbin"
    assert k._binary(0) == "/new.fatbin" and len(compiled) == 1     # now built for this arch


#: sha256 of the rendered source (the on-disk kernel cache key) of csr instances; a change here
#: invalidates every cached csr kernel binary -- update only for an intended kernel change
RENDER_SHA256 = {
    ("csr.crc_cwm", ("sum", 1, 4, 32, 2, "float32")): "15dfa2048e16b1e44bd3dbfaa17fcbfade4a0c06e6b5d0776d4b30b293f3c644",
    ("csr.crc_cwm", ("mean", 4, 8, 4, 8, "bfloat16")): "328f719e14896d599c5683c70f3038301a23330619c88e265dc51144c747ced8",
    ("csr.crc_cwm", ("max", 2, 1, 8, 4, "float16")): "159f5ace3463dc73634a13d50a0f2b64848a2cc331db0bc9e71bae61c6f03865",
    ("csr.crc_cwm", ("sum", 1, 4, 32, 2, "float32", 1)): "d4ac6112c5eb944d9c96071d1238794e2e3f27fe7890655dd55a4392cf862d22",
    ("csr.crc_cwm", ("sum", 1, 4, 32, 1, "float32", 0, 8)): "d909dd210ca2f9441ac56a13d443ac06f5df48051344591081cdc717f0fc8bce",
    ("csr.crc_cwm", ("sum", 1, 8, 8, 8, "float16", 0, 1, 16)): "5e0af36ca3fcea8489c4fa5e78f677bc739a44f03235fae3955b01d34e86c84d",
    ("csr.crc_cwm", ('sum', 1, 8, 8, 16, 'float16')): "844166147c0437683634349fde59cf85dea16de573081ec22de3e00161050633",
    ("csr.crc_cwm", ("sum", 1, 4, 16, 8, "float32", 2, 4)): "a7546a6ba698ceda5fbd80060890948d8bcde9733064f81617593e7831c4452b",
    ("csr.crc_cwm", ("sum", 2, 4, 8, 4, "float32", 4, 4)): "87bc354083d7db9bc1c146ad6ed49234cc21be4e7977c7fde2aacde057c57399",
    ("csr.sddmm", (32, 4, 4, "float32")): "3f6caa4f4d3928d191918a894c7537146bcc28ed78a9ec65e986fbbc6bbf7fda",
    ("csr.sddmm", (8, 2, 2, "float16")): "fba4895bb6faad9f8126d643d648642f26d72e1e049d1cc47cc086fa066be35c",
    ("csr.sddmm", (16, 8, 1, "bfloat16", 1)): "ea2c2d8272949912608fe567554b7a0bade091ffb28ce524be31eca5153832bb",
    ("csr.sddmm", (16, 4, 1, "float32", 0, 4)): "6d7fda4bc8b7c0198c3cf9b46501017a72d9221c6a6dbf78e5b42def51980294",
}


def test_rendered_source_unchanged():
    for (name, args), want in RENDER_SHA256.items():
        t = get_template(name)
        got = hashlib.sha256(t.render(t.instances(*args)).encode()).hexdigest()
        assert got == want, f"rendered source of {name}{args} changed: cached kernels are rebuilt"


def test_spmm_min_blocks_rule_seeds_and_names():
    """csr.crc_cwm min_blocks: launch bounds of MB resident 256-thread blocks per SM.  A
    quick-selection variant (8, one X load and one column slice per lane) on sparse rows only
    (mean <= 12, never on top of a flat or min_blocks choice), two tuner seeds, in the space; its
    instances (and their VEC = 1 fallback) are named ``_mb<N>`` and defined by
    SPC_SPMM_INSTANCE_MB with N as the last argument; a parameter set without it keeps the old
    kernel and name; a bad value is refused."""
    t = get_template("csr.crc_cwm")
    ring = sp.diags([1.0, 1.0, 1.0], [-1, 0, 1], shape=(500, 500), format="csr", dtype=np.float32)
    dense = random_matrix(400, 300, density=0.1, seed=1)                                   # ~30 a row
    first = t.heuristic(64, 3, 3.0)
    # (the ring's rows are tiny: the staged stream comes after, then ELL rows: its rows fit 4)
    def not_ell(vs):
        return [v for v in vs if v.get("flat") != 4]

    assert not_ell(t.unranked_variants(first, make_op(ring, "spmm", 64)))[-2] == {**first, "min_blocks": 8, "unroll": 1}
    wide = t.heuristic(256, 3, 3.0)                                 # two column slices per lane
    assert wide["cf"] == 2 and not_ell(t.unranked_variants(wide, make_op(ring, "spmm", 256)))[-2] == \
        {**wide, "cf": 1, "min_blocks": 8, "unroll": 1}
    assert [v["flat"] for v in t.unranked_variants({**first, "min_blocks": 4}, make_op(ring, "spmm", 64))] == [2, 4, 4]
    assert t.unranked_variants(first, make_op(dense, "spmm", 64)) == []
    assert tuple(t.space(_mod(ring, "spmm", 64))["min_blocks"].choices) == t.MIN_BLOCKS
    for A in (ring, dense):
        seeds = t.seed_params(_mod(A, "spmm", 64))
        assert sorted((s["min_blocks"], s["unroll"]) for s in seeds if s.get("min_blocks", 1) > 1
                      and s.get("flat") != 4) == [(4, 4), (8, 1)]

    mod = _mod(ring, "spmm", 64)
    k = t.build(mod, first, compile=False)
    name0, args0 = k.meta["instances"][0]
    assert name0 == "spmm_crc_cwm_f32_r0_cf1_v4_g16_u2" and tuple(args0) == (0, 0, 1, 4, 16, 2, 0)
    m = t.build(mod, {**first, "min_blocks": 6}, compile=False)
    names = [n for n, _ in m.meta["instances"]]
    assert names == ["spmm_crc_cwm_f32_r0_cf1_v4_g16_u2_mb6", "spmm_crc_cwm_f32_r0_cf1_v1_g16_u2_mb6"]
    assert all(tuple(a)[-2:] == (0, 6) for _, a in m.meta["instances"])
    src = t.render([(n, tuple(a)) for n, a in m.meta["instances"]])
    assert "SPC_SPMM_INSTANCE_MB(spmm_crc_cwm_f32_r0_cf1_v4_g16_u2_mb6, 0, 0, 1, 4, 16, 2, 0, 6)" in src
    X = np.random.default_rng(0).standard_normal((500, 64)).astype(np.float32)
    _close(em.emulate_kernel(m, X), reference.spmm(as_csr(ring), X, "sum"))
    for bad in (0, 2, 16, "8"):
        with pytest.raises(ValueError, match="min_blocks"):
            t.build(mod, {**first, "min_blocks": bad}, compile=False)


def test_flat_groups_balance_nonzeros():
    """flat_groups: rows_per_warp segments per group, or (flat_nnz) runs whose weight -- nonzeros
    plus one per segment -- starts in one flat_nnz window: every segment in exactly one non-empty
    group, at most flat_nnz segments and under flat_nnz + the heaviest segment per group."""
    # segments of 0, 3, 1, 40, 1, 1, 0, 5 nonzeros (weights 1, 4, 2, 41, 2, 2, 1, 6)
    seg_ptr = np.cumsum([0, 0, 3, 1, 40, 1, 1, 0, 5])
    assert flat_groups(seg_ptr, 3).tolist() == [0, 3, 6, 8]
    assert flat_groups(seg_ptr, 3, 0).tolist() == [0, 3, 6, 8]
    # weight before each segment: 0, 1, 5, 7, 48, 50, 52, 53 -> windows of 8: 0 0 0 0 6 6 6 6
    assert flat_groups(seg_ptr, 3, 8).tolist() == [0, 4, 8]
    # windows of 4: 0 0 1 1 12 12 13 13
    assert flat_groups(seg_ptr, 1, 4).tolist() == [0, 2, 4, 6, 8]
    assert flat_groups(np.zeros(1, np.int64), 4, 32).tolist() == [0]            # no segment: no group
    rng = np.random.default_rng(3)
    lens = np.where(rng.random(5000) < 0.3, 0, rng.integers(1, 6, 5000))
    lens[rng.integers(0, 5000, 20)] = 64                                         # slices of hub rows
    seg_ptr = np.append(0, np.cumsum(lens))
    for budget in (32, 64, 128):
        gs = flat_groups(seg_ptr, 1, budget).astype(np.int64)
        assert gs[0] == 0 and gs[-1] == lens.size and np.all(np.diff(gs) > 0)
        w = np.add.reduceat(lens + 1, gs[:-1])
        assert np.diff(gs).max() <= budget and w.max() < budget + 65
        assert w[:-1].mean() >= budget / 2                                       # groups are full-ish


@pytest.mark.parametrize("reduce", REDUCES)
def test_spmm_flat_nnz_emulation_matches_reference(reduce):
    """The flat layout's arrays (rows_per_warp and nnz-balanced groups, split rows inside and
    across groups) and launch shape reproduce the float64 reference in the numpy emulation of
    the kernel's data flow; a launch one block short leaves rows unwritten (NaN)."""
    t = get_template("csr.crc_cwm")
    rng = np.random.default_rng(11)
    for (name, A), K, pipe in itertools.product(_matrices().items(), (1, 33), ("none", "degree")):
        mod = _mod(A, "spmm", K, reduce, pipe)
        X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
        ref = reference.spmm(as_csr(A), X, reduce)
        for max_seg, fnnz, rpw in itertools.product((0, 8, 64), (0, 16, 64), (1, 5)):
            p = {**t.default_params(mod), "flat": 1, "max_seg": max_seg, "flat_nnz": fnnz, "rows_per_warp": rpw}
            k = t.build(mod, p, compile=False)
            _close(em.emulate_kernel(k, X), ref)
            spec = k.launch_spec(int(k.meta["vec"]))
            gpb = spec.block[0] // int(p["group"])
            if A.nnz and spec.grid[0] > 1:
                short = em.spmm_segments(k.arrays, (spec.grid[0] - 1) * gpb, rpw)
                Y = em.emulate_spmm(k.arrays, X, reduce, A.shape[0], segments=short)
                assert np.isnan(Y).any() and not short.all()


def test_spmm_flat_nnz_arrays_checked():
    """Saved flat arrays pass the artifact checks; a grp_seg that skips segments, repeats one,
    runs past the last, or belongs to the other layout is refused by name."""
    t = get_template("csr.crc_cwm")
    A = random_matrix(300, 257, density=0.03, seed=0)
    op = make_op(A, "spmm", 16)
    mod = SparseModule.from_op(op)
    from spcompile.core.ir import values_hash
    vh = values_hash(as_csr(A))
    k = t.build(mod, {**t.default_params(mod), "flat": 1, "flat_nnz": 32, "max_seg": 32}, compile=False)
    k0 = t.build(mod, t.default_params(mod), compile=False)
    t.check_arrays(op.key(), k.params, k.arrays, k.meta, vh)
    t.check_arrays(op.key(), k0.params, k0.arrays, k0.meta, vh)
    gs = k.arrays["grp_seg"]
    bad = {"skips the last segments": gs[:-1], "repeats a group start": np.insert(gs, 1, gs[0]),
           "runs past the last segment": np.append(gs[:-1], gs[-1] + 1)}
    for what, g in bad.items():
        with pytest.raises(ValueError, match="grp_seg"):
            t.check_arrays(op.key(), k.params, {**k.arrays, "grp_seg": g.astype(np.int32)}, k.meta, vh)
    with pytest.raises(ValueError, match="grp_seg"):         # one-segment-after-another layout with groups
        t.check_arrays(op.key(), k0.params, {**k0.arrays, "grp_seg": gs}, k0.meta, vh)
    with pytest.raises(ValueError, match="grp_seg"):         # flat instances without groups
        t.check_arrays(op.key(), k.params, {**k.arrays, "grp_seg": k0.arrays["grp_seg"]}, k.meta, vh)
    with pytest.raises(ValueError, match="mix"):
        t.check_arrays(op.key(), k.params, k.arrays, {**k.meta, "instances": [k.meta["instances"][0],
                                                                              k0.meta["instances"][0]]}, vh)
    # the staged stream (flat=2) saves the same arrays under its own instances
    ks = t.build(mod, {**t.default_params(mod), "flat": 2, "flat_nnz": 32, "max_seg": 32, "unroll": 8}, compile=False)
    t.check_arrays(op.key(), ks.params, ks.arrays, ks.meta, vh)
    with pytest.raises(ValueError, match="grp_seg"):         # staged instances without groups
        t.check_arrays(op.key(), ks.params, {**ks.arrays, "grp_seg": k0.arrays["grp_seg"]}, ks.meta, vh)
    with pytest.raises(ValueError, match="mix"):
        t.check_arrays(op.key(), ks.params, ks.arrays, {**ks.meta, "instances": [ks.meta["instances"][0],
                                                                                k.meta["instances"][0]]}, vh)
    with pytest.raises(ValueError, match="flat_nnz"):
        t.build(mod, {**t.default_params(mod), "flat": 1, "flat_nnz": -1}, compile=False)
    # a tuner seed on sparse rows around hub rows (mean <= OCC_MAX_MEAN, rows too long for the
    # rows_per_warp layout), none on short even rows or dense ones
    assert A.getnnz(axis=1).mean() <= t.OCC_MAX_MEAN and not t.short_rows(A.getnnz(axis=1).max(), 1.0)
    assert [(s["flat_nnz"], s["max_seg"]) for s in t.seed_params(mod) if s.get("flat_nnz")] == [(32, 64)]
    ring = sp.diags([1.0, 1.0, 1.0], [-1, 0, 1], shape=(500, 500), format="csr", dtype=np.float32)
    dense = random_matrix(100, 100, density=0.3, seed=2)
    for B in (ring, dense):
        assert not any(s.get("flat_nnz") for s in t.seed_params(_mod(B, "spmm", 16)))


def test_spmm_flat_rule_seeds_and_names():
    """csr.crc_cwm flat=1: a candidate (quick-selection variant, tuner seeds) only on matrices of
    short, even rows; 8 rows per group up to 4 nonzeros a row on average, else 4; its instances
    (and their VEC = 1 fallback) are the flat ones, a parameter set without "flat" keeps the
    one-row kernel and its old name, and a bad value is refused."""
    t = get_template("csr.crc_cwm")
    ring = sp.diags([1.0, 1.0, 1.0], [-1, 0, 1], shape=(500, 500), format="csr", dtype=np.float32)   # 3 a row
    mesh = sp.diags([1.0] * 7, [-3, -2, -1, 0, 1, 2, 3], shape=(500, 500), format="csr", dtype=np.float32)
    hub = random_matrix(300, 257, density=0.03, seed=0)                                          # a 257-long row
    first = {**t.heuristic(64, 3, 3.0), "rows_per_warp": 2}
    for A, rpw in ((ring, 8), (mesh, 4)):
        op = make_op(A, "spmm", 64)
        assert t.unranked_variants(first, op)[0] == {**first, "flat": 1, "rows_per_warp": rpw, "warps_per_block": 4}
        # on top of a flat first choice only the staged stream, where the rows are tiny (the ring),
        # and ELL rows (both fit 4 or 8 a row, the mesh's 7 padded to 8 within ELL_MAX_PAD)
        assert [v["flat"] for v in t.unranked_variants({**first, "flat": 1}, op)] == ([2] if A is ring else []) + [4, 4]
        seeds = t.seed_params(_mod(A, "spmm", 64))
        assert sorted(s["rows_per_warp"] for s in seeds if s.get("flat") == 1) == [4, 8]
        assert [s["unroll"] for s in seeds if s.get("flat") == 4] == [4 if A is ring else 8]       # ELL rows fit
    assert not any(v.get("flat") == 1 for v in t.unranked_variants(first, make_op(hub, "spmm", 64)))
    assert t.unranked_variants(first) == []                     # no workload: nothing to judge by
    # on rows too long for it, the only flat seed is the nnz-balanced one (flat_nnz)
    assert all(s.get("flat_nnz") for s in t.seed_params(_mod(hub, "spmm", 64)) if s.get("flat"))
    assert t.short_rows(32, 8.0) and not t.short_rows(33, 2.0) and not t.short_rows(20, 8.5)

    mod = _mod(ring, "spmm", 64)
    old = t.heuristic(64, 3, 3.0)
    k = t.build(mod, old, compile=False)
    assert "flat" not in k.params and k.meta["instances"][0][0] == "spmm_crc_cwm_f32_r0_cf1_v4_g16_u2"
    f = t.build(mod, {**old, "flat": 1, "rows_per_warp": 8}, compile=False)
    names = [n for n, _ in f.meta["instances"]]
    assert names == ["spmm_crc_cwm_f32_r0_cf1_v4_g16_u2_flat", "spmm_crc_cwm_f32_r0_cf1_v1_g16_u2_flat"]
    assert all(a[-1] == 1 for _, a in f.meta["instances"])
    # the numpy emulation of the flat kernel's launch (its segments and their writes) is exact
    X = np.random.default_rng(0).standard_normal((500, 64)).astype(np.float32)
    _close(em.emulate_kernel(f, X), reference.spmm(as_csr(ring), X, "sum"))
    # flat=2 (staged) packs the same arrays under its own instances, chunks of unroll (at least 4)
    # entries; 32-entry chunks only there
    st = t.build(mod, {**old, "flat": 2, "rows_per_warp": 8}, compile=False)
    assert [n for n, _ in st.meta["instances"]] == [n.replace("_flat", "_staged") for n in names]
    assert all(np.array_equal(st.arrays[a], f.arrays[a]) for a in f.arrays)
    assert st.launch_spec(4).smem == 8 * 4 * (8 + 16 * 4 * 4) and f.launch_spec(4).smem == 8 * 16 * 8
    _close(em.emulate_kernel(st, X), reference.spmm(as_csr(ring), X, "sum"))
    assert t.build(mod, {**old, "flat": 2, "unroll": 32}, compile=False).launch_spec(4).smem == 8 * 32 * (8 + 256)
    # flat=3 (staged segments) packs the one-row layout's arrays under its own instances, chunks
    # of unroll entries staged as in flat=2
    ss = t.build(mod, {**old, "flat": 3, "unroll": 8}, compile=False)
    assert [n for n, _ in ss.meta["instances"]] == ["spmm_crc_cwm_f32_r0_cf1_v4_g16_u8_seg_staged",
                                                     "spmm_crc_cwm_f32_r0_cf1_v1_g16_u8_seg_staged"]
    assert all(np.array_equal(ss.arrays[a], k.arrays[a]) for a in k.arrays) and ss.arrays["grp_seg"].size == 0
    assert ss.launch_spec(4).smem == 8 * 8 * (8 + 16 * 4 * 4)
    assert ss.launch_spec(4).grid[0] == -(-500 // 8)                  # one segment a row group
    _close(em.emulate_kernel(ss, X), reference.spmm(as_csr(ring), X, "sum"))
    with pytest.raises(ValueError, match="flat"):
        t.build(mod, {**old, "flat": 4}, compile=False)
    with pytest.raises(ValueError, match="unroll=32 needs flat=2 or 3"):
        t.build(mod, {**old, "flat": 1, "unroll": 32}, compile=False)
    with pytest.raises(ValueError, match="flat=3 stages 131072 bytes"):   # 16 groups x 32 entries x 64 floats
        t.build(mod, {**old, "flat": 3, "unroll": 32, "warps_per_block": 8}, compile=False)
    with pytest.raises(ValueError, match="flat=2 stages 262144 bytes"):   # 16 groups x 32 entries x 2 x 64 floats
        t.build(mod, {**old, "flat": 2, "unroll": 32, "cf": 2, "warps_per_block": 8}, compile=False)


def test_spmm_staged_rule():
    """The staged stream (flat=2) is a quick-selection variant of the model's first choice where
    most rows are tiny (mean at most 4, or half the rows at most 2 nonzeros), whatever the first
    choice's launch bounds or layout (not on top of another staged one), with its column shape
    and max_seg, without a hub combine; it builds and passes the artifact checks."""
    t = get_template("csr.crc_cwm")
    rng = np.random.default_rng(3)
    m = 3000
    # reply threads: most rows 1-2 entries, one hub of 1500 per thread of 401 rows (mean above 4)
    hub_rows = np.arange(0, m, 401)
    lens = np.where(np.isin(np.arange(m), hub_rows), 1500, rng.integers(1, 3, m))
    rows = np.repeat(np.arange(m), lens)
    threads = sp.csr_matrix((np.ones(rows.size, np.float32), (rows, rng.integers(0, m, rows.size))), shape=(m, m))
    threads.sum_duplicates()
    dense = random_matrix(400, 300, density=0.1, seed=1)                                   # ~30 a row
    mesh = sp.diags([1.0] * 9, list(range(-4, 5)), shape=(800, 800), format="csr", dtype=np.float32)   # 9 a row
    first = {**t.heuristic(64, 400, 4.0), "warp_combine": 1, "max_seg": 64}
    for A, want in ((threads, True), (dense, False), (mesh, False)):
        lens = np.diff(A.indptr)
        assert t.tiny_rows(lens) == want, (lens.mean(), np.mean(lens <= 2))
        got = [v for v in t.unranked_variants(first, make_op(A, "spmm", 64)) if v.get("flat") == 2]
        assert got == ([{**{k: v for k, v in first.items() if k != "warp_combine"}, **t.STAGED}] if want else [])
    assert np.mean(np.diff(threads.indptr) <= 2) >= t.STAGED_TINY_SHARE and np.diff(threads.indptr).mean() > 4
    op = make_op(threads, "spmm", 64)
    for base in ({**first, "min_blocks": 8}, {**first, "flat": 1, "flat_nnz": 32}):
        assert [v["flat"] for v in t.unranked_variants(base, op)] == [2]
    assert t.unranked_variants({**first, **t.STAGED}, op) == []
    v = t.unranked_variants(first, op)[-1]
    k = t.build(_mod(threads, "spmm", 64), v, compile=False)
    assert k.meta["instances"][0][0].endswith("_g16_u8_staged_mb4") and k.arrays["grp_seg"].size > 2
    X = rng.standard_normal((m, 64)).astype(np.float32)
    _close(em.emulate_kernel(k, X), reference.spmm(as_csr(threads), X, "sum"))


def test_spmm_segment_staged_rule():
    """Staged segments (flat=3) are a quick-selection variant of a one-row first choice (flat 0,
    min_blocks 1) for 16-bit X / Y only, with its shape and max_seg, hub rows' slices reduced
    across the warp (whether the first choice had that combine or not: the shape measured), and
    no capped combine (the staged combine loads two partials at a time); not on top of launch
    bounds, a
    flat layout or a staged kernel.  The variant builds, names its instances and passes the
    artifact checks, its hub rows' slices reduced across the warp."""
    t = get_template("csr.crc_cwm")
    rng = np.random.default_rng(5)
    m = 2000
    lens = np.where(np.arange(m) % 250 == 0, 700, rng.integers(1, 20, m))     # hubs among ~10-long rows
    rows = np.repeat(np.arange(m), lens)
    A = sp.csr_matrix((rng.standard_normal(rows.size).astype(np.float32), (rows, rng.integers(0, m, rows.size))),
                      shape=(m, m))
    A.sum_duplicates()
    first = {**t.heuristic(64, 700, 12.0, "float16"), "max_seg": 32, "combine_vals": 16, "unroll": 2}
    assert "warp_combine" not in first and t.SEG_STAGED["warp_combine"] == 1
    for dtype, want in (("float16", True), ("bfloat16", True), ("float32", False)):
        for wc in ({}, {"warp_combine": 0}, {"warp_combine": 2}):
            got = [v for v in t.unranked_variants({**first, **wc}, make_op(A, "spmm", 64, dtype=dtype))
                   if v.get("flat") == 3]
            assert got == ([{**{k: v for k, v in first.items() if k != "combine_vals"}, **t.SEG_STAGED}] if want else [])
    op = make_op(A, "spmm", 64, dtype="float16")
    for base in ({**first, "min_blocks": 8}, {**first, "flat": 1, "rows_per_warp": 4}, {**first, **t.SEG_STAGED},
                 {**first, **t.STAGED}):
        assert not any(v.get("flat") == 3 for v in t.unranked_variants(base, op))
    v = next(v for v in t.unranked_variants(first, op) if v.get("flat") == 3)
    mod = _mod(A, "spmm", 64, dtype="float16")
    k = t.build(mod, v, compile=False)
    assert k.meta["instances"][0][0] == f"spmm_crc_cwm_f16_r0_cf1_v{first['vec']}_g{first['group']}_u8_seg_staged_mb4"
    assert k.arrays["grp_seg"].size == 0 and t.warp_slices(v) == 32 // first["group"]
    assert np.any(k.arrays["seg_slot"] >= (1 << 30))                   # hub slices reduced across the warp
    X = rng.standard_normal((m, 64)).astype(np.float16)
    _close(em.emulate_kernel(k, X), reference.spmm(as_csr(A), X.astype(np.float32), "sum"), tol=1e-2)
    assert not any(v.get("flat") == 3 and v["group"] < first["group"] for v in t.unranked_variants(first, op))


@pytest.mark.parametrize("K", [64, 128, 33])
def test_spmm_segment_staged_narrow_groups(K):
    """On matrices of tiny rows (most rows of one or two entries, a few hubs) the 16-bit staged
    segments come with a twin of half the lanes a row group and twice the column slices a lane
    (unroll 4); not in fp32, not on longer rows, not from 4-lane groups or two slices a lane.  The
    twin builds, passes the artifact checks and its emulation matches float64."""
    t = get_template("csr.crc_cwm")
    rng = np.random.default_rng(11)
    m = 3000
    lens = np.where(np.arange(m) % 300 == 0, 900, rng.choice([0, 1, 1, 2, 2, 3], m))   # tiny rows, hubs
    rows = np.repeat(np.arange(m), lens)
    A = sp.csr_matrix((rng.standard_normal(rows.size).astype(np.float32), (rows, rng.integers(0, m - 7, rows.size))),
                      shape=(m, m - 7))
    A.sum_duplicates()
    assert t.tiny_rows(np.diff(A.indptr))
    first = {**t.heuristic(K, 900, 4.0, "float16"), "max_seg": 32, "unroll": 2}
    op = make_op(A, "spmm", K, dtype="float16")
    seg = [v for v in t.unranked_variants(first, op) if v.get("flat") == 3]
    want = t.narrow_groups({**first, **t.SEG_STAGED})
    assert want == ({**first, **t.SEG_STAGED, "group": first["group"] // 2, "cf": 2 * first["cf"], "unroll": 4}
                    if first["group"] >= 8 and first["cf"] == 1 else None)
    assert seg == [{**first, **t.SEG_STAGED}] + ([want] if want else [])
    assert not [v for v in t.unranked_variants(first, make_op(A, "spmm", K)) if v.get("flat") == 3]      # fp32
    assert t.narrow_groups({**first, "group": 4}) is None and t.narrow_groups({**first, "cf": 2}) is None
    if want is None:
        return
    mod = _mod(A, "spmm", K, dtype="float16")
    k = t.build(mod, want, compile=False)
    assert k.meta["instances"][0][0].startswith(f"spmm_crc_cwm_f16_r0_cf{2 * first['cf']}_")
    t.check_arrays(op.key(), k.params, k.arrays, k.meta)
    X = rng.standard_normal((m - 7, K)).astype(np.float16)
    _close(em.emulate_kernel(k, X), reference.spmm(as_csr(A), X.astype(np.float32), "sum"), tol=1e-2)


# ------------------------------------------------------------------------------------------
# warp-reduced slices of hub rows (warp_combine)
# ------------------------------------------------------------------------------------------
def test_warp_slices_partition():
    """warp_slices W > 1: rows of more than W slices get a multiple of W and move first (one
    warp's row groups each, their W segments sharing one flagged slot); rows of exactly W slices
    (with warp_rows also those of 2 .. W - 1, cut into W) come next, one warp each, WARP_ROW on
    every slice and no slot; other rows are split and slotted as before; outputs still go to
    each row's id."""
    from spcompile.kernels.csr.packer import WARP_ROW, WARP_SLICES, warp_slice_order

    lens = np.array([3, 40, 10, 0, 17, 33, 30])          # max_seg 8: 1, 5, 2, 1, 3, 5, 4 slices
    indptr = np.concatenate([[0], np.cumsum(lens)])
    ids = np.arange(7) + 10
    F, R = WARP_SLICES, WARP_ROW
    order = warp_slice_order(indptr, 8, 4)
    assert order.tolist() == [1, 5, 6, 0, 2, 3, 4]
    p = spmm_partition(np.concatenate([[0], np.cumsum(lens[order])]), ids[order], 8, 4)
    assert p["seg_slot"].tolist() == [F] * 4 + [F + 1] * 4 + [F + 2] * 4 + [F + 3] * 4 + [R] * 4 + [-1, 4, 5, -1, 6, 7, 8]
    assert p["seg_out"].tolist() == [11] * 8 + [15] * 8 + [16] * 4 + [10, 12, 12, 13, 14, 14, 14]
    assert p["grp_ptr"].tolist() == [0, 2, 4, 6, 9] and p["grp_out"].tolist() == [11, 15, 12, 14]
    assert p["slot_grp"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3] and p["grp_len"].tolist() == [40, 33, 10, 17]
    seg_len = np.diff(p["seg_ptr"])
    assert seg_len[:8].tolist() == [5] * 8 and seg_len[16:20].tolist() == [7, 8, 7, 8] and seg_len.max() <= 8
    # warp_rows: the rows of 2 .. 3 slices are cut into 4 and written by their warp too
    order = warp_slice_order(indptr, 8, 4, warp_rows=True)
    assert order.tolist() == [1, 5, 2, 4, 6, 0, 3]
    p = spmm_partition(np.concatenate([[0], np.cumsum(lens[order])]), ids[order], 8, 4, warp_rows=True)
    assert p["seg_slot"].tolist() == [F] * 4 + [F + 1] * 4 + [F + 2] * 4 + [F + 3] * 4 + [R] * 12 + [-1, -1]
    assert p["seg_out"].tolist() == [11] * 8 + [15] * 8 + [12] * 4 + [14] * 4 + [16] * 4 + [10, 13]
    assert p["grp_ptr"].tolist() == [0, 2, 4] and p["grp_out"].tolist() == [11, 15] and p["grp_len"].tolist() == [40, 33]
    assert np.diff(p["seg_ptr"])[16:20].tolist() == [2, 3, 2, 3]                  # 10 entries in 4 slices
    # the same rows without warp slices: the old partition (no flags, one slot a slice)
    q = spmm_partition(indptr, ids, 8)
    assert q["seg_slot"].min() == -1 and q["seg_slot"].max() < F and q["grp_ptr"].tolist() == [0, 5, 7, 10, 15, 19]
    with pytest.raises(ValueError, match="first"):
        spmm_partition(indptr, ids, 8, 4)                 # hub rows not first: not warp-aligned


@pytest.mark.parametrize("reduce", REDUCES)
def test_spmm_warp_combine_emulation_matches_reference(reduce):
    """warp_combine 1 / 2 (one-segment row groups narrower than a warp, or 32-lane groups of a
    block of warps): the packed arrays (hub rows first, W slices a flagged slot; rows one combine
    unit holds whole next) and launch shape
    reproduce the float64 reference in the numpy emulation, both the vector instance and its
    VEC = 1 fallback; the arrays pass the artifact checks; the slices are flagged as the rule
    says."""
    from spcompile.core.ir import values_hash
    from spcompile.kernels.csr.packer import WARP_ROW, WARP_SLICES

    t = get_template("csr.crc_cwm")
    rng = np.random.default_rng(5)
    flagged = whole = 0
    for (name, A), K, pipe in itertools.product(_matrices().items(), (1, 33, 64), ("none", "degree")):
        mod = _mod(A, "spmm", K, reduce, pipe)
        X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
        ref = reference.spmm(as_csr(A), X, reduce)
        lens = np.diff(as_csr(A).indptr)
        for ms, (group, vec, cf), wpb, wc in itertools.product(
                (8, 16, 64), ((4, 4, 2), (8, 2, 1), (16, 1, 4), (32, 4, 1), (32, 2, 2)), (1, 4, 8), (1, 2)):
            p = {**t.default_params(mod), "max_seg": ms, "group": group, "vec": vec, "cf": cf, "rows_per_warp": 1,
                 "warps_per_block": wpb, "warp_combine": wc}
            k = t.build(mod, p, compile=False)
            W = t.warp_slices(p)
            assert W == (32 // group if group < 32 else wpb if wpb > 1 else 1)     # a block's warps at 32 lanes
            nch = -(-lens // ms)
            slot = k.arrays["seg_slot"]
            want_f = int(np.sum(-(-nch[nch > W] // W) * W)) if W > 1 else 0
            want_w = W * int(np.sum((nch <= W) & (nch >= (2 if wc == 2 else W)))) if W > 1 else 0
            assert int((slot >= WARP_SLICES).sum()) == want_f and int((slot == WARP_ROW).sum()) == want_w, (name, p)
            flagged, whole = flagged + want_f, whole + want_w
            t.check_arrays(mod.op.key(), k.params, k.arrays, k.meta, values_hash(as_csr(A)))
            for fallback in (False, True):
                _close(em.emulate_kernel(k, X, fallback=fallback), ref)
    assert flagged > 0 and whole > 0


def test_spmm_warp_combine_arrays_checked():
    """Saved warp-reduced arrays pass the artifact checks; flags without warp_combine, a warp whose
    segments name two slots, a flagged slot short of a warp's segments or off its alignment, and
    flags on a flat or multi-row layout are refused by name (the kernel's full-warp shuffles
    would wait on lanes that never come)."""
    from spcompile.core.ir import values_hash
    from spcompile.kernels.csr.packer import WARP_SLICES

    t = get_template("csr.crc_cwm")
    A = random_matrix(300, 257, density=0.03, seed=0)          # a 257-long row: 33 slices of 8
    op = make_op(A, "spmm", 64, dtype="float16")
    mod = SparseModule.from_op(op)
    vh = values_hash(as_csr(A))
    p = {**t.default_params(mod), "group": 8, "vec": 8, "cf": 1, "rows_per_warp": 1, "max_seg": 8, "warp_combine": 1}
    k = t.build(mod, p, compile=False)
    slot = k.arrays["seg_slot"]
    assert (slot >= WARP_SLICES).sum() == 36 and (slot[:36] >= WARP_SLICES).all()
    t.check_arrays(op.key(), k.params, k.arrays, k.meta, vh)

    def refused(match, params=None, meta=None, **arrays):
        with pytest.raises(ValueError, match=match):
            t.check_arrays(op.key(), params or k.params, {**k.arrays, **arrays}, meta or k.meta, vh)

    refused("warp_combine", params={**k.params, "warp_combine": 0})
    refused("warp_combine", params={**k.params, "rows_per_warp": 2})
    two = slot.copy()
    two[1] = slot[4]                                         # a warp naming two slots
    refused("seg_slot", seg_slot=two)
    off = slot.copy()
    off[0] = slot[0] - WARP_SLICES                           # one of the warp's segments unflagged
    refused("seg_slot", seg_slot=off)
    shifted = np.roll(slot[:36], 1)
    refused("seg_slot", seg_slot=np.concatenate([shifted, slot[36:]]).astype(np.int32))
    flat_meta = {**k.meta, "instances": [[n, list(a[:6]) + [1] + list(a[7:])] for n, a in k.meta["instances"]]}
    refused("warp_combine|grp_seg", meta=flat_meta)
    big = slot.copy()
    big[:4] = WARP_SLICES + 10**6                            # a slot past the workspace
    refused("seg_slot", seg_slot=big)
    # warp_combine=2: rows of 2 .. 3 slices are cut into 4, one warp each (WARP_ROW, no slot)
    from spcompile.kernels.csr.packer import WARP_ROW

    k2 = t.build(mod, {**p, "warp_combine": 2}, compile=False)
    s2, out2 = k2.arrays["seg_slot"], k2.arrays["seg_out"]
    rows = np.flatnonzero(s2 == WARP_ROW)
    assert rows.size >= 8 and rows.size % 4 == 0 and rows[0] == 36
    t.check_arrays(op.key(), k2.params, k2.arrays, k2.meta, vh)
    with pytest.raises(ValueError, match="seg_slot|written"):
        o = out2.copy()
        o[rows[1]] = out2[rows[4]]                           # a warp of two rows
        t.check_arrays(op.key(), k2.params, {**k2.arrays, "seg_out": o}, k2.meta, vh)
    with pytest.raises(ValueError, match="seg_slot"):
        x = s2.copy()
        x[rows[1]] = -1                                      # a warp's row partly WARP_ROW
        t.check_arrays(op.key(), k2.params, {**k2.arrays, "seg_slot": x}, k2.meta, vh)
    with pytest.raises(ValueError, match="warp_combine"):
        t.check_arrays(op.key(), {**k2.params, "warp_combine": 0}, k2.arrays, k2.meta, vh)


def test_warp_combine_rule_and_space():
    """warp_combine: in the tuner's space and checks; no effect (normalised to 0) without
    one-segment groups narrower than a warp or a block of 32-lane ones; quick selection's second
    round measures it, and
    with twice as long slices, next to a lead that would cut some row into a warp's slices."""
    from spcompile.core.ir import SparseModule as SM

    t = get_template("csr.crc_cwm")
    hub = random_matrix(300, 257, density=0.03, seed=0)       # a 257-long row
    hop = make_op(hub, "spmm", 64, "sum", "float16")
    hmod = SM.from_op(hop)
    base = {**t.default_params(hmod), "group": 8, "vec": 8, "cf": 1, "rows_per_warp": 1, "max_seg": 64, "unroll": 8}
    assert tuple(t.space(hmod)["warp_combine"].choices) == (0, 1, 2)
    got = t.probe_variants(base, hop)
    assert t.warp_combined(base, hop) == [{**base, "warp_combine": 1}, {**base, "warp_combine": 1, "max_seg": 128}]
    # the second round: on the lead, its capped and its deep (unroll 16) variant, each with
    # twice as long slices too
    wc = [{**b, "warp_combine": 1, **ms} for b in (base, {**base, "combine_vals": 16}, {**base, "unroll": 16})
          for ms in ({}, {"max_seg": 128})]
    assert got[-6:] == wc
    for p in wc:
        t.check_params(hmod, p)
    u2 = {**base, "unroll": 2}                                  # its capped neighbour is the u8 shape's
    assert [v for v in t.probe_variants(u2, hop) if v.get("warp_combine")] == [
        {**b, "warp_combine": 1, **ms} for b in (u2, {**base, "combine_vals": 16}, {**base, "unroll": 16})
        for ms in ({}, {"max_seg": 128})]
    fop = make_op(hub, "spmm", 32, "sum", "float32")            # fp32: neither capped nor deep
    f = {**base, "vec": 4, "group": 8}
    assert [v for v in t.probe_variants(f, fop) if v.get("warp_combine")] == \
        [{**f, "warp_combine": 1}, {**f, "warp_combine": 1, "max_seg": 128}]
    assert t.warp_combined({**base, "max_seg": 128}, hop) == []             # 257 < 4 slices of 128... 3 slices
    assert t.warp_combined({**base, "max_seg": 0}, hop) == []
    # 32-lane groups: the block's warps are the unit (none with one warp a block, nor where its
    # shared memory would pass BLOCK_COMBINE_SMEM)
    g32 = {**base, "group": 32, "warps_per_block": 4}
    assert t.warp_slices({**g32, "warp_combine": 1}) == 4
    assert t.warp_combined(g32, hop) == [{**g32, "warp_combine": 1}, {**g32, "warp_combine": 1, "max_seg": 128}]
    assert t.warp_combined({**g32, "max_seg": 128}, hop) == []                 # 257: 3 slices of 128
    assert t.warp_combined({**g32, "warps_per_block": 2, "max_seg": 128}, hop) == [
        {**g32, "warps_per_block": 2, "max_seg": 128, "warp_combine": 1},
        {**g32, "warps_per_block": 2, "max_seg": 256, "warp_combine": 1}]
    assert t.warp_combined({**g32, "warps_per_block": 1}, hop) == []
    assert t.warp_slices({**g32, "warp_combine": 1, "warps_per_block": 8, "cf": 8, "vec": 8}) == 1   # 64 KiB
    assert t.block_combine_smem(8, 4, 4) <= t.BLOCK_COMBINE_SMEM < t.block_combine_smem(8, 8, 8)
    assert t.warp_combined({**base, "rows_per_warp": 2}, hop) == []
    assert t.warp_combined({**base, "flat": 1}, hop) == []
    assert t.warp_combined({**base, "warp_combine": 1}, hop) == []
    assert t.warp_combined(base, make_op(random_matrix(300, 257, density=0.03, seed=0, long_row=False), "spmm", 64,
                                         "sum", "float16")) == []         # no row of 4 slices
    assert t.warp_combined(base, None) == []
    for q, wc in (({**base, "warp_combine": 1}, 1), ({**base, "warp_combine": 1, "group": 32}, 1),
                  ({**base, "warp_combine": 1, "group": 32, "warps_per_block": 1}, 0),
                  ({**base, "warp_combine": 1, "flat": 1}, 0), ({**base, "warp_combine": 1, "rows_per_warp": 4}, 0)):
        assert t.search_params(q)["warp_combine"] == wc
    with pytest.raises(ValueError, match="warp_combine"):
        t.build(hmod, {**base, "warp_combine": 3}, compile=False)


# ------------------------------------------------------------------------------------------
# call-time values
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["spmm", "sddmm"])
def test_call_time_values_reach_their_entries(op, monkeypatch):
    """A module built for one set of values computes with the values a call passes: written
    into the kernel's value array through the module's ``values_src`` (as a call does), they
    reproduce the float64 reference of the matrix with those values, for every row order and
    every layout that moves entries (warp-reduced hub rows first: ``warp_combine`` 1 and 2, flat
    groups, split rows)."""
    from spcompile.compile import build_from_config
    from spcompile.kernels.nvcc import NvccTemplate

    monkeypatch.setattr(NvccTemplate, "compile", lambda self, inst, arch=None, name=None: b"")  # arrays only
    t = get_template("csr.crc_cwm" if op == "spmm" else "csr.sddmm")
    rng = np.random.default_rng(11)
    moved = 0
    for (name, A), pipe in itertools.product(_matrices().items(), sorted(PIPES)):
        C = as_csr(A)
        for reduce in (REDUCES if op == "spmm" else (None,)):
            sop = make_op(A, op, 33, reduce)
            mod0 = SparseModule.from_op(sop)
            if op == "spmm":
                grid = [{"max_seg": ms, "group": g, "vec": v, "cf": cf, "rows_per_warp": 1, "warps_per_block": w,
                         "warp_combine": wc}
                        for ms, (g, v, cf), w, wc in itertools.product((8, 64), ((8, 4, 1), (32, 1, 2)), (1, 4),
                                                                        (0, 1, 2))]
                grid += [{"max_seg": 8, "group": 8, "vec": 4, "cf": 1, "rows_per_warp": 4, "flat": 1}]
            else:
                grid = [{}, {"flat": 1}]
            for params in grid:
                try:
                    p = t.check_params(mod0, {**t.default_params(mod0), **params})
                except ValueError:
                    continue
                mod = build_from_config(sop, t.make_config(p, [{"name": s, "options": {}} for s in PIPES[pipe]],
                                                           "cuda"))
                k = mod.kernel
                src = np.arange(C.nnz) if mod.values_src is None else np.asarray(mod.values_src)
                moved += int(np.any(src != np.arange(C.nnz)) and pipe == "none")
                v = rng.standard_normal(C.nnz).astype(np.float32)
                k.arrays[t.call_values_array] = v[src]          # what a call with values=v writes
                Cv = sp.csr_matrix((v, C.indices, C.indptr), shape=C.shape)
                if op == "spmm":
                    X = rng.standard_normal((A.shape[1], 33)).astype(np.float32)
                    _close(em.emulate_kernel(k, X), reference.spmm(as_csr(Cv), X, reduce))
                else:
                    X = rng.standard_normal((A.shape[0], 33)).astype(np.float32)
                    Y = rng.standard_normal((A.shape[1], 33)).astype(np.float32)
                    _close(em.emulate_kernel(k, X, Y), reference.sddmm(as_csr(Cv), X, Y))
    if op == "spmm":
        assert moved > 0      # the packer moved entries of the stored order (warp-reduced rows first)


# ------------------------------------------------------------------------------------------
# ELL rows (flat=4)
# ------------------------------------------------------------------------------------------
def test_ell_indices_pad_rows():
    """Each row's ids in their stored order, then -1, ``width`` a row; a longer row is refused."""
    from spcompile.kernels.csr.packer import ell_indices

    got = ell_indices(np.array([0, 2, 2, 5]), np.array([4, 1, 0, 3, 2]), 3)
    assert got.dtype == np.int32 and got.tolist() == [4, 1, -1, -1, -1, -1, 0, 3, 2]
    assert ell_indices(np.array([0]), np.zeros(0, np.int32), 4).size == 0
    with pytest.raises(ValueError, match="ELL rows of width 2 cannot hold a row of 3"):
        ell_indices(np.array([0, 2, 2, 5]), np.array([4, 1, 0, 3, 2]), 2)


#: ELL shapes: one and two slices a lane, fewer entries than lanes, several ids a lane
ELL_SHAPES = ({"group": 8, "vec": 4, "cf": 1, "unroll": 4, "min_blocks": 6},
              {"group": 4, "vec": 4, "cf": 2, "unroll": 8, "min_blocks": 4, "rows_per_warp": 4},
              {"group": 32, "vec": 1, "cf": 2, "unroll": 8, "rows_per_warp": 2},
              {"group": 4, "vec": 2, "cf": 1, "unroll": 16, "rows_per_warp": 3})


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_spmm_ell_emulation_matches_reference(reduce, pipe):
    """flat=4 packs every row's ids at row * unroll and its values in CSR order; the emulation of
    the launch (every row whole, the columns of its tiles) matches float64 for every reduction,
    row order, K (1, odd, wider than a tile), empty rows and rows of exactly the width, on a
    non-square matrix, and the artifact checks pass."""
    t = get_template("csr.crc_cwm")
    rng = np.random.default_rng(3)
    for i, shape in enumerate(ELL_SHAPES):
        A = bounded_rows(211, 173, shape["unroll"], 20 + i)
        for K in (1, 33, 64):
            mod = _mod(A, "spmm", K, reduce, pipe)
            op = make_op(A, "spmm", K, reduce)
            k = t.build(mod, {**t.default_params(mod), "flat": 4, "max_seg": 0, **shape}, compile=False)
            assert k.meta["instances"][0][0].endswith("_ell" + (f"_mb{shape['min_blocks']}" if shape.get("min_blocks")
                                                               else ""))
            assert k.arrays["indices"].size == A.shape[0] * shape["unroll"] and np.all(k.arrays["seg_slot"] == -1)
            assert k.arrays["data"].size == A.nnz and k.launch_spec(int(k.meta["vec"])).smem == 0
            t.check_arrays(op.key(), k.params, k.arrays, k.meta)
            X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
            _close(em.emulate_kernel(k, X), reference.spmm(as_csr(A), X, reduce))
    # 16-bit X / Y
    A = bounded_rows(211, 173, 4, 9)
    mod = _mod(A, "spmm", 64, reduce, pipe, dtype="float16")
    k = t.build(mod, {**t.default_params(mod), "flat": 4, "max_seg": 0, "unroll": 4, "min_blocks": 6}, compile=False)
    assert k.meta["instances"][0][0].startswith("spmm_crc_cwm_f16_")
    X = rng.standard_normal((A.shape[1], 64)).astype(np.float16)
    _close(em.emulate_kernel(k, X), reference.spmm(as_csr(A), X.astype(np.float32), reduce), tol=1e-2)


def test_spmm_ell_arrays_checked():
    """Saved ELL arrays pass the artifact checks; ids of the wrong length, a padding slot that is
    not -1, a row's own slot that is, a row longer than the width, split-row slots or a launch
    the matrix does not fit are refused by name."""
    from spcompile.core.ir import values_hash

    t = get_template("csr.crc_cwm")
    A = bounded_rows(120, 90, 4, 1)
    op = make_op(A, "spmm", 16)
    mod = SparseModule.from_op(op)
    vh = values_hash(as_csr(A))
    k = t.build(mod, {**t.default_params(mod), "flat": 4, "unroll": 4, "max_seg": 0}, compile=False)
    t.check_arrays(op.key(), k.params, k.arrays, k.meta, vh)
    ids, lens = k.arrays["indices"], np.diff(k.arrays["seg_ptr"])
    short = int(np.flatnonzero((lens > 0) & (lens < 4))[0])
    pad, own = ids.copy(), ids.copy()
    pad[short * 4 + 3] = 0
    own[short * 4] = -1
    for what, bad in {"a short id array": ids[:-1], "a padding slot holding an id": pad, "an own slot of -1": own}.items():
        with pytest.raises(ValueError, match="indices"):
            t.check_arrays(op.key(), k.params, {**k.arrays, "indices": bad}, k.meta, vh)
    with pytest.raises(ValueError, match="indices"):          # a real id past n
        t.check_arrays(op.key(), k.params, {**k.arrays, "indices": np.where(ids >= 0, A.shape[1], ids)}, k.meta, vh)
    # rows wider than the width (the same arrays under unroll-2 instances)
    narrow = [[k.meta["instances"][0][0], [*k.meta["instances"][0][1][:5], 2, *k.meta["instances"][0][1][6:]]]]
    with pytest.raises(ValueError, match="indices|width 2"):
        t.check_arrays(op.key(), {**k.params, "unroll": 2}, k.arrays, {**k.meta, "instances": narrow}, vh)
    slot = k.arrays["seg_slot"].copy()
    slot[short] = 0
    with pytest.raises(ValueError, match="whole rows"):
        t.check_arrays(op.key(), k.params, {**k.arrays, "seg_slot": slot}, k.meta, vh)
    with pytest.raises(ValueError, match="at most unroll=2 nonzeros, and this matrix has a row of 4"):
        t.build(mod, {**t.default_params(mod), "flat": 4, "unroll": 2, "max_seg": 0}, compile=False)


def test_spmm_ell_rule_and_space():
    """ELL rows are offered where every row fits a width of the space at most ELL_MAX_ROW and the
    padding stays within ELL_MAX_PAD: quick selection measures the first choice's column shape
    and its narrow twin under the launch bounds their loads fit (ell_min_blocks); never on rows
    too long, too uneven or already ELL.  The tuner's space has flat=4; its canonical form drops
    max_seg, combine_vals and warp_combine, which ELL rows never use."""
    t = get_template("csr.crc_cwm")
    assert t.ell_width(np.array([4, 3, 4, 2])) == 4 and t.ell_width(np.array([5, 5, 8])) == 8
    assert t.ell_width(np.array([16] * 3), "float16") == 16 and t.ell_width(np.array([16] * 3)) is None  # fp32: widths <= 8
    assert t.ell_width(np.array([8, 1, 1, 1])) is None            # 32 slots for 11 nonzeros
    assert t.ell_width(np.array([17])) is None and t.ell_width(np.zeros(0, np.int64)) is None
    assert [t.ell_min_blocks(w, cf) for w, cf in ((4, 1), (4, 2), (8, 1), (8, 2), (16, 1))] == [4, 4, 4, 1, 1]
    A = bounded_rows(300, 300, 4, 2)
    lens = np.diff(A.indptr)
    assert lens.size * 4 <= t.ELL_MAX_PAD * lens.sum()
    for dtype, K in (("float16", 64), ("float32", 64), ("float32", 128)):
        op = make_op(A, "spmm", K, dtype=dtype)
        first = t.heuristic(K, int(lens.max()), float(lens.mean()), dtype)
        got = [v for v in t.unranked_variants(first, op) if v.get("flat") == 4]
        base = {**first, "flat": 4, "unroll": 4, "max_seg": 0, "rows_per_warp": t.ELL_ROWS}
        want = [{**base, "min_blocks": 4}]
        if first["group"] >= 8 and first["cf"] == 1:
            want.append({**base, "group": first["group"] // 2, "cf": 2, "min_blocks": 4})
        assert got == want
        assert not [v for v in t.unranked_variants(got[0], op) if v.get("flat") == 4]    # not from ELL itself
    hub = sp.csr_matrix(np.vstack([np.ones((1, 40)), np.eye(40)[:39]]).astype(np.float32))
    assert not [v for v in t.unranked_variants(t.heuristic(64, 40, 2.0), make_op(hub, "spmm", 64)) if v.get("flat") == 4]
    mod = SparseModule.from_op(make_op(A, "spmm", 64))
    assert 4 in t.space(mod)["flat"].choices
    ell_seeds = [s for s in t.seed_params(mod) if s.get("flat") == 4]               # one tuner seed, where rows fit
    assert ell_seeds == [{**t.default_params(mod), "flat": 4, "unroll": 4, "max_seg": 0, "rows_per_warp": t.ELL_ROWS,
                          "min_blocks": 4}]
    assert not [s for s in t.seed_params(_mod(hub, "spmm", 64)) if s.get("flat") == 4]
    canon = t.search_params({**t.default_params(mod), "flat": 4, "unroll": 4, "max_seg": 64, "combine_vals": 16,
                             "warp_combine": 1})
    assert (canon["max_seg"], canon["combine_vals"], canon["warp_combine"]) == (0, 0, 0)


def test_spmm_ell_call_time_values(monkeypatch):
    """ELL rows keep the values in CSR order: values a call passes (through the module's
    ``values_src``) reproduce the float64 reference of the matrix with those values, in every row
    order."""
    from spcompile.compile import build_from_config
    from spcompile.kernels.nvcc import NvccTemplate

    monkeypatch.setattr(NvccTemplate, "compile", lambda self, inst, arch=None, name=None: b"")  # arrays only
    t = get_template("csr.crc_cwm")
    rng = np.random.default_rng(4)
    A = bounded_rows(150, 150, 8, 6)
    C = as_csr(A)
    for pipe, reduce in itertools.product(sorted(PIPES), REDUCES):
        sop = make_op(A, "spmm", 33, reduce)
        p = t.check_params(SparseModule.from_op(sop), {**t.default_params(SparseModule.from_op(sop)), "flat": 4,
                                                       "unroll": 8, "max_seg": 0})
        mod = build_from_config(sop, t.make_config(p, [{"name": s, "options": {}} for s in PIPES[pipe]], "cuda"))
        src = np.arange(C.nnz) if mod.values_src is None else np.asarray(mod.values_src)
        v = rng.standard_normal(C.nnz).astype(np.float32)
        mod.kernel.arrays[t.call_values_array] = v[src]
        X = rng.standard_normal((150, 33)).astype(np.float32)
        _close(em.emulate_kernel(mod.kernel, X),
               reference.spmm(as_csr(sp.csr_matrix((v, C.indices, C.indptr), shape=C.shape)), X, reduce))
