"""Structural checks of the CUDA templates' saved arrays (what ``spcompile.load`` runs before any
kernel sees them; a ValueError there is an ArtifactError).  Genuine arrays of many builds pass;
one altered array or meta value at a time -- an index past its bound, a negative index, a pointer
that falls or overruns, a truncated array, a count of the meta -- is refused with a message naming
it.  For csr.* the arrays must also rebuild the manifest's matrix (a relabelled artifact is refused);
built without a GPU (``compile=False``: the arrays and meta are the real ones)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.compile import make_op
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule, values_hash
from spcompile.kernels import get_template
from spcompile.passes import Pipeline

from conftest import random_matrix

MATS = {
    "random": random_matrix(300, 257, density=0.03, seed=0),      # empty rows, a long row
    "wide": random_matrix(70, 900, density=0.01, seed=3),         # long windows / split rows
    "empty": sp.csr_matrix((20, 9), dtype=np.float32),
}
TEMPLATES = {"csr.crc_cwm": ("spmm", "sum"), "csr.sddmm": ("sddmm", None), "tc.wmma_sgt": ("spmm", "sum"),
             "tc.wmma_sgt_sddmm": ("sddmm", None), "csr.window": ("spmm", "sum")}


def _kernels(tname, A, K=13, dtype="float32"):
    t = get_template(tname)
    op, red = TEMPLATES[tname]
    sop = make_op(A, op, K, red, dtype=dtype)
    m0 = SparseModule.from_op(sop)
    out = []
    for pipe in t.pipelines(m0) or [[]]:
        mod = Pipeline(pipe)(m0)
        if not t.supports(mod):
            continue
        ps = [t.default_params(mod)] + t.seed_params(mod)
        if tname == "tc.wmma_sgt" and dtype == "float32":
            ps.append({**t.default_params(mod), "precision": "3xtf32"})
        for p in ps:
            out.append((t, sop, t.build(mod, p, compile=False)))
    return out


@pytest.mark.parametrize("tname", sorted(TEMPLATES))
@pytest.mark.parametrize("name", sorted(MATS))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_genuine_arrays_pass(tname, name, dtype):
    A = MATS[name]
    ks = _kernels(tname, A, 13, dtype)
    assert ks
    for t, sop, k in ks:
        t.check_arrays(sop.key(), k.params, k.arrays, k.meta, values_hash(as_csr(A)))


def _first(tname, pred=lambda k: True):
    for name in ("wide", "random"):          # the flat_nnz seed needs sparse rows ("random")
        A = MATS[name]
        for t, sop, k in _kernels(tname, A):
            if pred(k):
                return t, sop, k, values_hash(as_csr(A))
    raise AssertionError("no such kernel")


def _bump_max(a):
    a = a.copy()
    a.reshape(-1)[int(np.argmax(a))] += 1
    return a


def _negate_first(a):
    a = a.copy()
    a.reshape(-1)[0] = -2
    return a


def _fall(a):
    a = a.copy()
    a[1], a[2] = a[2] + 1, a[1]
    return a


def _repeat_first(a):
    a = a.copy()
    a[1] = a[0]
    return a


def _slot_past_end(items):
    a = items.copy()
    i = int(np.argmax(a[:, 3]))
    a[i, 3] += 1                  # the largest slot + 1: one past the partial-result workspace
    return a


def _last_to(v):
    def f(a):
        a = a.copy()
        a[-1] = v
        return a
    return f


SPLIT = lambda k: k.arrays.get("slot_grp") is not None and k.arrays["slot_grp"].size > 0   # noqa: E731
FLAT = lambda k: k.params.get("flat") == 1   # noqa: E731
FLAT_NNZ = lambda k: k.template == "csr.crc_cwm" and bool(k.params.get("flat_nnz"))   # noqa: E731
CASES = [
    # (template, kernel filter, what, change arrays, change meta, message)
    ("csr.crc_cwm", FLAT_NNZ, "a flat group past the last segment", {"grp_seg": _bump_max}, {}, "'grp_seg'"),
    ("csr.crc_cwm", FLAT_NNZ, "an empty flat group", {"grp_seg": _repeat_first}, {}, "'grp_seg'"),
    ("csr.crc_cwm", FLAT_NNZ, "flat groups dropped", {"grp_seg": lambda a: a[:0]}, {}, "'grp_seg'"),
    ("csr.crc_cwm", SPLIT, "column past n", {"indices": _bump_max}, {}, "'indices'"),
    # the kernel reads const int* / const float*: a wider or narrower element type would be read
    # as other values or past the array's end, even where every value is in range
    ("csr.crc_cwm", SPLIT, "64-bit columns", {"indices": lambda a: a.astype(np.int64)}, {}, "'indices' must be a 1-D int32"),
    ("csr.crc_cwm", SPLIT, "64-bit segment pointer", {"seg_ptr": lambda a: a.astype(np.int64)}, {}, "'seg_ptr' must be a 1-D int32"),
    ("csr.crc_cwm", SPLIT, "16-bit values", {"data": lambda a: a.astype(np.float16)}, {}, "'data' must be a 1-D float32"),
    ("csr.sddmm", lambda k: True, "64-bit columns", {"indices": lambda a: a.astype(np.int64)}, {}, "'indices' must be a 1-D int32"),
    ("csr.sddmm", lambda k: True, "64-bit output positions", {"nnz_ids": lambda a: a.astype(np.int64)}, {}, "'nnz_ids' must be a 1-D int32"),
    ("csr.sddmm", lambda k: True, "double values", {"data": lambda a: a.astype(np.float64)}, {}, "'data' must be a 1-D float32"),
    ("csr.crc_cwm", SPLIT, "negative column", {"indices": _negate_first}, {}, "'indices'"),
    ("csr.crc_cwm", SPLIT, "segment pointer falls", {"seg_ptr": _fall}, {}, "'seg_ptr'"),
    ("csr.crc_cwm", SPLIT, "segment pointer overruns", {"seg_ptr": lambda a: np.append(a[:-1], a[-1] + 5)}, {},
     "'seg_ptr'"),
    ("csr.crc_cwm", SPLIT, "output row past m", {"seg_out": _bump_max}, {}, "seg_out"),
    ("csr.crc_cwm", SPLIT, "two segments write one row", {"seg_out": _repeat_first}, {}, "exactly one"),
    ("csr.crc_cwm", SPLIT, "slot past the workspace", {"seg_slot": _bump_max}, {}, "seg_slot"),
    ("csr.crc_cwm", SPLIT, "group of a slot past the groups", {"slot_grp": _bump_max}, {}, "slot_grp"),
    ("csr.crc_cwm", SPLIT, "group pointer overruns", {"grp_ptr": lambda a: np.append(a[:-1], a[-1] + 1)}, {},
     "grp_ptr"),
    ("csr.crc_cwm", SPLIT, "group length wrong", {"grp_len": lambda a: a + 1}, {}, "grp_len"),
    ("csr.crc_cwm", SPLIT, "values truncated", {"data": lambda a: a[:-1]}, {}, "'data'"),
    ("csr.crc_cwm", SPLIT, "indices as floats", {"indices": lambda a: a.astype(np.float32)}, {}, "'indices'"),
    ("csr.crc_cwm", SPLIT, "another value", {"data": lambda a: a + 1}, {}, "values hash"),
    ("csr.crc_cwm", SPLIT, "another column", {"indices": lambda a: (a + 1) % 900}, {}, "pattern hash|repeat|order"),
    ("csr.crc_cwm", SPLIT, "K of the meta", {}, {"K": 64}, "'K'"),
    ("csr.crc_cwm", SPLIT, "rows of the meta", {}, {"m": 71}, "'m'"),
    ("csr.sddmm", lambda k: True, "X row past m", {"seg_xrow": _last_to(70)}, {}, "seg_xrow"),
    ("csr.sddmm", lambda k: True, "output position repeated", {"nnz_ids": lambda a: np.append(a[1:], a[1])}, {},
     "nnz_ids"),
    ("csr.sddmm", lambda k: True, "segment pointer overruns", {"seg_ptr": lambda a: np.append(a[:-1], a[-1] + 1)}, {},
     "seg_ptr"),
    ("csr.sddmm", lambda k: True, "another column", {"indices": lambda a: (a + 3) % 900}, {}, "pattern hash|order"),
    ("csr.sddmm", FLAT, "flat: X row past m", {"nnz_row": _last_to(70)}, {}, "nnz_row"),
    ("csr.sddmm", FLAT, "flat: X rows truncated", {"nnz_row": lambda a: a[:-1]}, {}, "nnz_row"),
    ("csr.sddmm", FLAT, "flat: another row", {"nnz_row": lambda a: np.roll(a, 1)}, {}, "pattern hash|order"),
    ("csr.sddmm", FLAT, "flat: segment pointer overruns", {"seg_ptr": lambda a: np.append(a[:-1], a[-1] + 1)}, {},
     "seg_ptr"),
    ("csr.sddmm", FLAT, "flat: segment longer than nnz_per_warp", {"seg_ptr": lambda a: np.delete(a, 1)}, {},
     "nnz_per_warp"),
    ("csr.sddmm", FLAT, "flat: one-row X rows too", {"seg_xrow": lambda a: np.zeros(3, a.dtype)}, {}, "seg_xrow"),
    ("csr.sddmm", lambda k: not k.params["flat"], "one-row: per-entry X rows", {"nnz_row": lambda a: np.zeros(5, a.dtype)},
     {}, "nnz_row"),
    ("csr.sddmm", lambda k: not k.params["flat"], "one-row: FLAT=1 entry point",
     {}, {"instances": [["sddmm_csr_f32_g8_v1_xc1_flat", [0, 8, 1, 1, 1]]]}, "instances"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma" and k.arrays["slot_grp"].size > 0, "X row past n",
     {"pcols": _bump_max}, {}, "pcols"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma", "negative X row", {"pcols": _negate_first}, {}, "pcols"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma", "fragments truncated", {"afrag": lambda a: a[:-4]}, {},
     "afrag"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma", "block range past the blocks",
     {"items": lambda a: np.vstack([a[:1] + [0, 1000, 0, 0], a[1:]])}, {}, "items"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma", "window past the rows",
     {"items": lambda a: np.vstack([a[:1] + [0, 0, 100, 0], a[1:]])}, {}, "items"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma" and k.arrays["slot_grp"].size > 0, "slot past the workspace",
     {"items": lambda a: _slot_past_end(a)}, {}, "items"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma", "output row past m", {"row_ids": _bump_max}, {}, "row_ids"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma", "items count of the meta", {}, {"items": 10**6}, "'items'"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma", "another block width", {}, {"BW": 16}, "instances|'BW'"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "mma", "another dtype", {}, {"dtype": "float16"}, "dtype"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "wmma" and "tiles" in k.arrays, "window pointer overruns",
     {"win_block_ptr": lambda a: np.append(a[:-1], a[-1] + 1)}, {}, "win_block_ptr"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "wmma" and "tiles" in k.arrays, "tiles truncated",
     {"tiles": lambda a: a[:-1]}, {}, "tiles"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "wmma" and "nz_pos" in k.arrays, "position outside the tile",
     {"nz_pos": lambda a: _bump_max(a.astype(np.int32) * 0 + 255).astype(np.uint16)}, {}, "nz_pos"),
    ("tc.wmma_sgt", lambda k: k.meta["impl"] == "wmma", "shared memory of the meta", {}, {"smem_per_warp": 1}, "smem"),
    ("tc.wmma_sgt_sddmm", lambda k: True, "output position past nnz", {"nz_out": _bump_max}, {}, "nz_out"),
    ("tc.wmma_sgt_sddmm", lambda k: True, "window past the rows", {"blk_win": _bump_max}, {}, "blk_win"),
    ("tc.wmma_sgt_sddmm", lambda k: True, "block column past n", {"blk_cols": _bump_max}, {}, "blk_cols"),
    ("tc.wmma_sgt_sddmm", lambda k: True, "nonzero pointer falls", {"nz_ptr": _fall}, {}, "nz_ptr"),
    ("tc.wmma_sgt_sddmm", lambda k: True, "values truncated", {"nz_val": lambda a: a[:-1]}, {}, "nz_val"),
    ("tc.wmma_sgt_sddmm", lambda k: True, "nnz of the meta", {}, {"nnz": 5}, "'nnz'"),
    ("csr.window", lambda k: True, "window column past n", {"ucols": _bump_max}, {}, "'ucols'"),
    ("csr.window", lambda k: True, "negative window column", {"ucols": _negate_first}, {}, "'ucols'"),
    ("csr.window", lambda k: True, "negative lidx", {"lidx": _negate_first}, {}, "'lidx'"),
    ("csr.window", lambda k: True, "lidx past every window", {"lidx": _bump_max}, {}, "outside its window"),
    ("csr.window", lambda k: True, "window pointer falls", {"win_ptr": _fall}, {}, "'win_ptr'"),
    ("csr.window", lambda k: True, "window pointer overruns", {"win_ptr": lambda a: np.append(a[:-1], a[-1] + 5)}, {},
     "'win_ptr'|'ucols'"),
    ("csr.window", lambda k: True, "row pointer overruns", {"indptr": lambda a: np.append(a[:-1], a[-1] + 1)}, {},
     "'indptr'"),
    ("csr.window", lambda k: True, "two rows write one output row", {"row_ids": _repeat_first}, {}, "permutation"),
    ("csr.window", lambda k: True, "output row past m", {"row_ids": _bump_max}, {}, "'row_ids'"),
    ("csr.window", lambda k: True, "values truncated", {"data": lambda a: a[:-1]}, {}, "'data'"),
    ("csr.window", lambda k: True, "another value", {"data": lambda a: a + 1}, {}, "values hash"),
    ("csr.window", lambda k: True, "another column", {"ucols": lambda a: (a + 1) % 900}, {}, "pattern hash|order"),
    ("csr.window", lambda k: True, "K of the meta", {}, {"K": 64}, "'K'"),
    ("csr.window", lambda k: True, "an arch without cp.async", {}, {"arch": 75}, "'arch'"),
    ("csr.window", lambda k: k.params["nbuf"] == 2, "another buffer count compiled", {},
     {"instances": [["spmm_window_f32_r0_v1_rpw4_b1", [0, 0, 1, 4, 1]]]}, "instances"),
]


@pytest.mark.parametrize("tname, pred, what, arrays, meta, message", CASES, ids=[f"{c[0]}: {c[2]}" for c in CASES])
def test_altered_arrays_are_refused(tname, pred, what, arrays, meta, message):
    t, sop, k, vh = _first(tname, pred)
    arr = {n: np.array(a, copy=True) for n, a in k.arrays.items()}
    for n, f in arrays.items():
        arr[n] = f(arr[n])
    m = copy.deepcopy(dict(k.meta))
    m.update(meta)
    with pytest.raises(ValueError, match=message):
        t.check_arrays(sop.key(), k.params, arr, m, vh)
