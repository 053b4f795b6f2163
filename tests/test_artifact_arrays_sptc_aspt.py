"""Structural checks of saved arrays for the sptc.vnm and aspt.tiled CUDA templates (CPU only).

``Template.check_arrays`` runs when an artifact is loaded, before any kernel sees its arrays: an
artifact whose arrays were edited and resealed must not make a kernel read or write out of
bounds.  Here:

* the arrays of genuinely built kernels (no binary) pass, over matrices with empty rows, a long
  row, no entry at all, non-square shapes, K in {1, 13, 64}, every dtype / reduction the template
  takes, every pipeline the template offers, its default and seed parameters (and splits);
* every array and the meta values / parameters the launches use, tampered one at a time (an
  index one past its bound, a negative index, a non-monotone pointer, a pointer past its end, a
  truncated array, another dtype, a changed meta count / instance argument), raise ValueError
  naming what is wrong.
"""
import copy
import itertools

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.compile import make_op
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule, values_hash
from spcompile.kernels import get_template
from spcompile.kernels.aspt.template import PANEL_ARRAYS, TASK_ARRAYS
from spcompile.kernels.sptc.template import ARRAY_DTYPES as SPTC_ARRAYS
from spcompile.passes import Pipeline

from conftest import hub_matrix as _hub, random_matrix


def _mixed(m=133, n=300, seed=0):
    """Empty rows (first, middle, last), a row holding every column, a dense run of columns."""
    A = random_matrix(m, n, density=0.03, seed=seed).tolil()
    A[0, :] = 0
    A[3, :] = 0
    A[m - 1, :] = 0
    A[m // 2, :] = np.linspace(-1, 1, n)
    A[1, :12] = 1.5
    A[7, 100:140] = 2.0
    A[40, :40] = -1.0
    A = A.tocsr()
    A.eliminate_zeros()
    A.data = A.data.astype(np.float16).astype(np.float32)
    return A




MATRICES = {
    "mixed": _mixed,
    "empty": lambda: sp.csr_matrix((20, 30), dtype=np.float32),
    "tall": lambda: random_matrix(70, 9, density=0.4, seed=1),
    "wide": lambda: random_matrix(9, 70, density=0.3, seed=2),
}


def _module(tpl, A, K, reduce, dtype, pipe):
    return Pipeline(list(pipe))(SparseModule.from_op(make_op(A, "spmm", K, reduce, dtype=dtype)))


def _check(tpl, A, K, reduce, dtype, k):
    sop = make_op(A, "spmm", K, reduce, dtype=dtype)
    tpl.check_arrays(sop.key(), k.params, k.arrays, k.meta, values_hash(as_csr(A)))


# ------------------------------------------------------------------------------------------
# genuine arrays pass
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("K", [1, 13, 64])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sptc_genuine_arrays_pass(name, K, dtype):
    t = get_template("sptc.vnm")
    A = MATRICES[name]()
    seen = set()
    for reduce in ("sum", "mean"):
        mod0 = SparseModule.from_op(make_op(A, "spmm", K, reduce, dtype=dtype))
        for pipe in t.pipelines(mod0):
            mod = Pipeline(pipe)(mod0)
            d = t.default_params(mod)
            extra = [{**d, "pack": pk, "split": s} for pk, s in itertools.product(("block", "condensed"), (1, 3))]
            for p in t.seed_params(mod) + extra:
                k = t.build(mod, p, compile=False)
                _check(t, A, K, reduce, dtype, k)
                seen.add((k.arrays["zero_rows"].size > 0, k.arrays["rem_rows"].size > 0))
    if name == "mixed":           # split windows and a remainder were among the checked kernels
        assert (True, True) in seen


@pytest.mark.parametrize("name", sorted({**MATRICES, "hub": _hub}))
@pytest.mark.parametrize("K", [1, 13, 64])
@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min"])
def test_aspt_genuine_arrays_pass(name, K, reduce):
    t = get_template("aspt.tiled")
    A = {**MATRICES, "hub": _hub}[name]()
    mod0 = SparseModule.from_op(make_op(A, "spmm", K, reduce))
    seen = set()
    for pipe in t.pipelines(mod0) + [[{"name": "tile.aspt", "options": {"panel_height": 16}}]]:
        mod = Pipeline(pipe)(mod0)
        d = t.default_params(mod)
        extra = [{**d, "max_seg": 4, "max_ent": 16, "chunk": 32},
                 {**d, "scheme": "panel", "chunk": 32, "max_ent": 16, "split": 8, "nbuf": 2},
                 {**d, "scheme": "panel", "max_ent": 0, "split": 0, "vec": 1}]
        for p in t.seed_params(mod) + extra:
            k = t.build(mod, p, compile=False)
            _check(t, A, K, reduce, "float32", k)
            if k.meta["scheme"] == "tasks":
                seen.add(("tails", k.arrays["tail_lo"].size > 0))
            else:
                seen.add(("groups", k.arrays["grp_n"].size > 0))
    if name == "hub":             # long rows' tails and split panels were among the checked kernels
        assert {("tails", True), ("groups", True)} <= seen


# ------------------------------------------------------------------------------------------
# tampered arrays / meta / parameters are refused, naming what is wrong
# ------------------------------------------------------------------------------------------
_HUB16 = [{"name": "tile.aspt", "options": {"panel_height": 16}}]
#: name -> (template, matrix, K, reduce, dtype, pipeline, parameters)
FIXTURES = {
    # block packing of the unreordered matrix: a remainder of several rows; windows of 10 tiles split, the
    # last one (9 tiles) not
    "sptc": ("sptc.vnm", _mixed, 24, "sum", "float16", [{"name": "format.vnm"}], {"pack": "block", "split": 9}),
    "tasks": ("aspt.tiled", _hub, 64, "sum", "float32", _HUB16,
              {"scheme": "tasks", "chunk": 32, "max_seg": 4, "max_ent": 64, "vec": 4}),
    # split panels: groups of blocks combined through the scratch slots
    "panel": ("aspt.tiled", _hub, 64, "sum", "float32", _HUB16,
              {"scheme": "panel", "chunk": 32, "max_ent": 64, "split": 4, "nbuf": 2, "vec": 4}),
    # whole panels: blocks of several steps, gather steps then staged ones
    "panel0": ("aspt.tiled", _hub, 64, "max", "float32", _HUB16,
               {"scheme": "panel", "chunk": 32, "max_ent": 64, "split": 0, "nbuf": 1, "vec": 4}),
}
_BUILT = {}


def _fixture(name):
    if name not in _BUILT:
        tname, mk, K, reduce, dtype, pipe, params = FIXTURES[name]
        t = get_template(tname)
        A = mk()
        mod = _module(t, A, K, reduce, dtype, pipe)
        k = t.build(mod, {**t.default_params(mod), **params}, compile=False)
        sop = make_op(A, "spmm", K, reduce, dtype=dtype)
        _BUILT[name] = (t, sop.key(), k, values_hash(as_csr(A)))
    return _BUILT[name]


class Ctx:
    """One tampering case's copies of the genuine arrays / meta / params, plus derived sizes."""

    def __init__(self, name):
        t, key, k, vh = _fixture(name)
        self.t, self.key, self.values = t, key, vh
        self.a = {n: v.copy() for n, v in k.arrays.items()}
        self.meta = copy.deepcopy(k.meta)
        self.params = dict(k.params)
        self.m, self.n = key.rows, key.cols

    def run(self):
        self.t.check_arrays(self.key, self.params, self.a, self.meta, self.values)

    # helpers
    def trunc(self, name):
        self.a[name] = self.a[name][:-1].copy()

    def retype(self, name):
        x = self.a[name]
        to = {np.dtype(np.int32): np.int64, np.dtype(np.uint32): np.int32, np.dtype(np.float32): np.float64}
        self.a[name] = x.astype(to[x.dtype])

    @property
    def items(self):
        return self.a["items"].reshape(-1, 4)


def _nonmonotone(p):
    """Make pointer ``p`` fall somewhere while every value stays within [0, p[-1]]."""
    j = np.flatnonzero(p[2:] < p[-1])
    if j.size:
        p[j[0] + 1] = p[j[0] + 2] + 1
    else:
        j = _first(p[:-2] > 0) + 1
        p[j] = p[j - 1] - 1


def _first(mask):
    idx = np.flatnonzero(mask)
    assert idx.size, "the fixture lacks what this case tampers with"
    return int(idx[0])


# --- sptc.vnm ------------------------------------------------------------------------------
def _sptc_split_item(c):
    return _first(c.items[:, 3] > 0)


def _sptc_split_numbers_past(c):
    # every item of a split window numbered past the split windows (the scratch rows)
    w = c.items[_sptc_split_item(c), 0]
    c.items[c.items[:, 0] == w, 3] = c.items[:, 3].max() + 1


def _sptc_swap_zero_rows(c):
    z = c.a["zero_rows"]
    z[0], z[1] = z[1], z[0]


def _sptc_item_other_window(c):
    i = _first(c.items[:, 2] > c.items[:, 1])
    nwin = c.a["win_ptr"].size - 1
    c.items[i, 0] = (c.items[i, 0] + 1) % nwin


def _sptc_unsplit_item(c):
    # a window with several items loses its split number on one of them
    w = c.items[:, 0]
    many = np.bincount(w)[w] > 1
    c.items[_first(many), 3] = 0


def _sptc_drop_item(c):
    c.a["items"] = c.a["items"][:-4].copy()


SPTC_CASES = {
    # ccol / frag / meta: the tiles
    "ccol past X": (lambda c: c.a["ccol"].__setitem__(_first(c.a["ccol"] >= 0), c.n), "'ccol'"),
    "ccol negative": (lambda c: c.a["ccol"].__setitem__(0, -2), "'ccol'"),
    "ccol one tile short": (lambda c: c.a.__setitem__("ccol", c.a["ccol"][:-32].copy()), "'frag'.*'ccol'"),
    "meta bad 2:4 word": (lambda c: c.a["meta"].__setitem__(0, 0), "'meta'"),
    # win_ptr
    "win_ptr non-monotone": (lambda c: _nonmonotone(c.a["win_ptr"]), "'win_ptr' must rise"),
    "win_ptr past the tiles": (lambda c: c.a["win_ptr"].__setitem__(-1, c.a["win_ptr"][-1] + 1), "'win_ptr'"),
    # row_ids / row_scale
    "row_ids past Y": (lambda c: c.a["row_ids"].__setitem__(0, c.m), "'row_ids'"),
    "row_ids negative": (lambda c: c.a["row_ids"].__setitem__(0, -1), "'row_ids'"),
    "row_ids repeated": (lambda c: c.a["row_ids"].__setitem__(0, c.a["row_ids"][1]), "'row_ids'"),
    # items
    "items window past the windows": (lambda c: c.items.__setitem__((0, 0), c.a["win_ptr"].size - 1), "'items'"),
    "items window negative": (lambda c: c.items.__setitem__((0, 0), -1), "'items'"),
    "items end past the tiles": (lambda c: c.items.__setitem__((0, 2), c.meta["tiles"] + 1), "'items'"),
    "items first tile negative": (lambda c: c.items.__setitem__((0, 1), -1), "'items'"),
    "items tile range of another window": (_sptc_item_other_window, "'items'"),
    "items split number negative": (lambda c: c.items.__setitem__((0, 3), -1), "'items'"),
    "items split number past the scratch": (lambda c: c.items.__setitem__((_sptc_split_item(c), 3),
                                                                         c.items[:, 3].max() + 1), "'items'"),
    "items split window unsplit": (_sptc_unsplit_item, "'items'"),
    "items split numbers past the split windows": (_sptc_split_numbers_past, "'items'.*numbered"),
    "items one item short": (_sptc_drop_item, "'items'"),
    "items big-endian": (lambda c: c.a.__setitem__("items", c.a["items"].astype(">i4")), "'items'"),
    # zero_rows
    "zero_rows past Y": (lambda c: c.a["zero_rows"].__setitem__(0, c.m), "'zero_rows'"),
    "zero_rows negative": (lambda c: c.a["zero_rows"].__setitem__(0, -1), "'zero_rows'"),
    "zero_rows out of order": (_sptc_swap_zero_rows, "'zero_rows'"),
    # remainder
    "rem_rows past Y": (lambda c: c.a["rem_rows"].__setitem__(-1, c.m), "'rem_rows'"),
    "rem_rows negative": (lambda c: c.a["rem_rows"].__setitem__(0, -1), "'rem_rows'"),
    "rem_rows repeated": (lambda c: c.a["rem_rows"].__setitem__(1, c.a["rem_rows"][0]), "'rem_rows'"),
    "rem_cols past X": (lambda c: c.a["rem_cols"].__setitem__(0, c.n), "'rem_cols'"),
    "rem_cols negative": (lambda c: c.a["rem_cols"].__setitem__(0, -1), "'rem_cols'"),
    "rem_ptr past the entries": (lambda c: c.a["rem_ptr"].__setitem__(-1, c.a["rem_ptr"][-1] + 1), "'rem_ptr'"),
    "rem_ptr not from 0": (lambda c: c.a["rem_ptr"].__setitem__(0, 1), "'rem_ptr'"),
    "rem_ptr non-monotone": (lambda c: _nonmonotone(c.a["rem_ptr"]), "'rem_ptr' must rise"),
    # meta
    "meta m": (lambda c: c.meta.__setitem__("m", c.m + 1), "'m'"),
    "meta K": (lambda c: c.meta.__setitem__("K", c.meta["K"] + 1), "'K'"),
    "meta K zero": (lambda c: c.meta.__setitem__("K", 0), "'K'"),
    "meta dtype": (lambda c: c.meta.__setitem__("dtype", "float32"), "'dtype'"),
    "meta arch": (lambda c: c.meta.__setitem__("arch", "sm90"), "'arch'"),
    "meta tiles": (lambda c: c.meta.__setitem__("tiles", c.meta["tiles"] + 1), "'tiles'"),
    "meta items": (lambda c: c.meta.__setitem__("items", c.meta["items"] - 1), "'items'"),
    "meta remainder_nnz": (lambda c: c.meta.__setitem__("remainder_nnz", c.meta["remainder_nnz"] + 1),
                           "'remainder_nnz'"),
    "meta gathered_rows": (lambda c: c.meta.__setitem__("gathered_rows", c.meta["gathered_rows"] + 1),
                           "'gathered_rows'"),
    "meta precision": (lambda c: c.meta.__setitem__("precision", "bf16"), "'precision'"),
    "meta pack": (lambda c: c.meta.__setitem__("pack", "condensed"), "'pack'"),
    "meta layout": (lambda c: c.meta.__setitem__("layout", "rowwise"), "'layout'"),
    "meta instance slabs": (lambda c: c.meta["instances"][0][1].__setitem__(1, 8), "'instances'"),
    "meta instance input type": (lambda c: c.meta["instances"][0][1].__setitem__(2, 0), "'instances'"),
    "meta instance precision": (lambda c: c.meta["instances"][0][1].__setitem__(0, 2), "'instances'"),
    "meta instance name": (lambda c: c.meta["instances"][0].__setitem__(0, "sptc3_spmm_p1_nt8_e1"), "'instances'"),
    "meta instances missing": (lambda c: c.meta.pop("instances"), "'instances'"),
    # parameters the launch reads
    "param slabs_per_warp": (lambda c: c.params.__setitem__("slabs_per_warp", 8), "'instances'"),
    "param warps_per_block": (lambda c: c.params.__setitem__("warps_per_block", 3), "'warps_per_block'"),
    "param warps_per_block zero": (lambda c: c.params.__setitem__("warps_per_block", 0), "'warps_per_block'"),
    "param precision": (lambda c: c.params.__setitem__("precision", "bf16"), "'precision'"),
    "param pack": (lambda c: c.params.__setitem__("pack", "dense"), "'pack'"),
    # the set of arrays
    "array missing": (lambda c: c.a.pop("win_ptr"), "takes arrays"),
    "array extra": (lambda c: c.a.__setitem__("S", np.zeros(4, np.float32)), "takes arrays"),
}


def _array_cases(names, *lead) -> dict:
    """Every array of ``names`` truncated by one element, and in a wrong dtype: refused, naming the
    array (``lead``: what comes before the edit in a case's tuple)."""
    out = {}
    for nm in names:
        out[f"{nm} truncated"] = (*lead, lambda c, nm=nm: c.trunc(nm), f"'{nm}'")
        out[f"{nm} wrong dtype"] = (*lead, lambda c, nm=nm: c.retype(nm), f"'{nm}'")
    return out


def _refused_after(fixture, edit, match):
    """The genuine copy of ``fixture`` passes its checks; after ``edit`` it is refused."""
    c = Ctx(fixture)
    c.run()
    edit(c)
    with pytest.raises(ValueError, match=match):
        c.run()


SPTC_CASES.update(_array_cases(SPTC_ARRAYS))


@pytest.mark.parametrize("case", sorted(SPTC_CASES))
def test_sptc_tampered_is_refused(case):
    _refused_after("sptc", *SPTC_CASES[case])


def test_sptc_fixture_has_every_array_and_both_item_kinds():
    _, _, k, _ = _fixture("sptc")
    assert all(v.size for v in k.arrays.values())
    it = k.arrays["items"].reshape(-1, 4)
    assert (it[:, 3] > 0).any() and (it[:, 3] == 0).any()


# --- aspt.tiled, scheme "tasks" --------------------------------------------------------------
def _tasks_entry_task(c):
    te = c.a["task_eptr"].astype(np.int64)
    return np.repeat(np.arange(te.size - 1), np.diff(te))


def _tasks_slot_unstaged(c):
    et = _tasks_entry_task(c)
    e = _first(c.a["task_nc"][et] < c.meta["chunk"])
    c.a["ent_slot"][e] = c.a["task_nc"][et[e]]


def _tasks_rem_row(c):
    rp = c.a["rem_ptr"]
    return _first(np.diff(rp) > 1)


TASK_CASES = {
    "task_x0 one past dense_xrow": (lambda c: c.a["task_x0"].__setitem__(0, c.a["dense_xrow"].size), "'task_x0'"),
    "task_x0 negative": (lambda c: c.a["task_x0"].__setitem__(0, -1), "'task_x0'"),
    "task_x0 staging past dense_xrow": (lambda c: c.a["task_x0"].__setitem__(
        -1, c.a["dense_xrow"].size - c.a["task_nc"][-1] + 1), "'dense_xrow'"),
    "task_nc past the chunk": (lambda c: c.a["task_nc"].__setitem__(0, c.meta["chunk"] + 1), "'task_nc'"),
    "task_nc negative": (lambda c: c.a["task_nc"].__setitem__(0, -1), "'task_nc'"),
    "task_eptr non-monotone": (lambda c: _nonmonotone(c.a["task_eptr"]), "'task_eptr' must rise"),
    "task_eptr past the entries": (lambda c: c.a["task_eptr"].__setitem__(-1, c.a["task_eptr"][-1] + 1),
                                   "'task_eptr'"),
    "dense_xrow past X": (lambda c: c.a["dense_xrow"].__setitem__(0, c.n), "'dense_xrow'"),
    "dense_xrow negative": (lambda c: c.a["dense_xrow"].__setitem__(0, -1), "'dense_xrow'"),
    "ent_out past Y": (lambda c: c.a["ent_out"].__setitem__(0, c.m), "'ent_out'"),
    "ent_out negative": (lambda c: c.a["ent_out"].__setitem__(0, -1), "'ent_out'"),
    "ent_slot past the chunk": (lambda c: c.a["ent_slot"].__setitem__(0, c.meta["chunk"]), "'ent_slot'"),
    "ent_slot negative": (lambda c: c.a["ent_slot"].__setitem__(0, -1), "'ent_slot'"),
    "ent_slot not staged by its task": (_tasks_slot_unstaged, "'ent_slot'"),
    "ent_val changed": (lambda c: c.a["ent_val"].__setitem__(0, c.a["ent_val"][0] + 1), "values"),
    "rem_ptr non-monotone": (lambda c: _nonmonotone(c.a["rem_ptr"]), "'rem_ptr' must rise"),
    "rem_ptr past the entries": (lambda c: c.a["rem_ptr"].__setitem__(-1, c.a["rem_ptr"][-1] + 1), "'rem_ptr'"),
    "rem_end1 past its row": (lambda c: c.a["rem_end1"].__setitem__(
        _tasks_rem_row(c), c.a["rem_ptr"][_tasks_rem_row(c) + 1] + 1), "'rem_end1'"),
    "rem_end1 before its row": (lambda c: c.a["rem_end1"].__setitem__(
        _first(c.a["rem_ptr"][:-1] > 0), c.a["rem_ptr"][_first(c.a["rem_ptr"][:-1] > 0)] - 1), "'rem_end1'"),
    "rem_end1 leaves an entry": (lambda c: c.a["rem_end1"].__setitem__(
        _tasks_rem_row(c), c.a["rem_end1"][_tasks_rem_row(c)] - 1), "'rem_end1'"),
    "rem_end1 negative": (lambda c: c.a["rem_end1"].__setitem__(0, -1), "'rem_end1'"),
    "rem_col past X": (lambda c: c.a["rem_col"].__setitem__(0, c.n), "'rem_col'"),
    "rem_col negative": (lambda c: c.a["rem_col"].__setitem__(0, -1), "'rem_col'"),
    "row_ids past Y": (lambda c: c.a["row_ids"].__setitem__(0, c.m), "'row_ids'"),
    "row_ids repeated": (lambda c: c.a["row_ids"].__setitem__(0, c.a["row_ids"][1]), "'row_ids'"),
    "row_len wrong count": (lambda c: c.a["row_len"].__setitem__(1, c.a["row_len"][1] + 1), "'row_len'"),
    "row_len negative": (lambda c: c.a["row_len"].__setitem__(1, -1), "'row_len'"),
    "tail_lo one past the entries": (lambda c: c.a["tail_lo"].__setitem__(0, c.a["rem_val"].size), "'tail_lo'"),
    "tail_lo negative": (lambda c: c.a["tail_lo"].__setitem__(0, -1), "'tail_lo'"),
    "tail_lo overlapping": (lambda c: c.a["tail_lo"].__setitem__(0, c.a["tail_lo"][0] - 1), "'tail_lo'"),
    "tail_hi past the entries": (lambda c: c.a["tail_hi"].__setitem__(0, c.a["rem_val"].size + 1), "'tail_hi'"),
    "tail_hi empty segment": (lambda c: c.a["tail_hi"].__setitem__(0, c.a["tail_lo"][0]), "'tail_hi'"),
    "tail_out past Y": (lambda c: c.a["tail_out"].__setitem__(0, c.m), "'tail_out'"),
    "tail_out another row": (lambda c: c.a["tail_out"].__setitem__(0, (c.a["tail_out"][0] + 1) % c.m), "'tail_out'"),
    # meta
    "meta m": (lambda c: c.meta.__setitem__("m", c.m + 1), "'m'"),
    "meta K": (lambda c: c.meta.__setitem__("K", c.meta["K"] * 2), "'K'"),
    "meta dtype": (lambda c: c.meta.__setitem__("dtype", "float16"), "'dtype'"),
    "meta scheme": (lambda c: c.meta.__setitem__("scheme", "panel"), "'scheme'"),
    "meta reduce": (lambda c: c.meta.__setitem__("reduce", "max"), "'reduce'"),
    "meta warps (block size)": (lambda c: c.meta.__setitem__("warps", 32), "'warps'"),
    "meta vec": (lambda c: c.meta.__setitem__("vec", 2), "'vec'"),
    "meta H": (lambda c: c.meta.__setitem__("H", 0), "'H'"),
    "meta chunk": (lambda c: c.meta.__setitem__("chunk", c.meta["chunk"] * 2), "'chunk'"),
    "meta KT": (lambda c: c.meta.__setitem__("KT", 256), "'KT'"),
    "meta smem": (lambda c: c.meta.__setitem__("smem", c.meta["smem"] * 2), "'smem'"),
    "meta tasks": (lambda c: c.meta.__setitem__("tasks", c.meta["tasks"] + 1), "'tasks'"),
    "meta tails": (lambda c: c.meta.__setitem__("tails", c.meta["tails"] - 1), "'tails'"),
    "meta instance cf": (lambda c: c.meta["instances"][0][1].__setitem__(3, 4), "'instances'"),
    "meta instance vec": (lambda c: c.meta["instances"][0][1].__setitem__(2, 2), "'instances'"),
    "meta instance scheme": (lambda c: c.meta["instances"][0][1].__setitem__(0, 1), "'instances'"),
    "meta fallback instance dropped": (lambda c: c.meta["instances"].pop(), "'instances'"),
    # parameters the launches read
    "param cf": (lambda c: c.params.__setitem__("cf", 2), "'instances'"),
    "param warps": (lambda c: c.params.__setitem__("warps", 3), "'warps'"),
    "param rows_per_warp": (lambda c: c.params.__setitem__("rows_per_warp", 0), "'rows_per_warp'"),
    "param scheme": (lambda c: c.params.__setitem__("scheme", "panel"), "takes arrays"),
    "array extra": (lambda c: c.a.__setitem__("part", np.zeros(4, np.float32)), "takes arrays"),
}
TASK_CASES.update(_array_cases(TASK_ARRAYS))


@pytest.mark.parametrize("case", sorted(TASK_CASES))
def test_aspt_tasks_tampered_is_refused(case):
    _refused_after("tasks", *TASK_CASES[case])


# --- aspt.tiled, scheme "panel" --------------------------------------------------------------
def _panel_steps(c):
    """Per step its block and whether it gathers; per entry its step."""
    a = c.a
    S = a["st_nc"].size
    blk = np.empty(S, np.int64)
    for b, (s0, s1) in enumerate(zip(a["blk_s0"], a["blk_s1"])):
        blk[s0:s1] = b
    estep = np.repeat(np.arange(S), np.diff(a["st_eptr"].astype(np.int64)))
    return blk, a["st_nc"] == 0, estep


def _panel_split_blocks(c):
    return np.flatnonzero(c.a["blk_slot"] >= 0)


def _panel_dup_slot(c):
    sb = _panel_split_blocks(c)
    c.a["blk_slot"][sb[0]] = c.a["blk_slot"][sb[1]]


def _panel_other_group(c):
    sb = _panel_split_blocks(c)
    g = c.a["blk_grp"]
    g[sb[0]] = (g[sb[0]] + 1) % c.a["grp_n"].size


def _panel_row_outside_block(c):
    blk, _, estep = _panel_steps(c)
    nr = c.a["blk_nrows"]
    e = _first(nr[blk[estep]] < c.meta["H"])
    c.a["ent_row"][e] = nr[blk[estep[e]]]


def _panel_rows_unordered(c):
    _, _, estep = _panel_steps(c)
    r = c.a["ent_row"]
    e = _first((r[1:] > r[:-1]) & (estep[1:] == estep[:-1]))
    r[e], r[e + 1] = r[e + 1], r[e]


def _panel_gather_col(c):
    _, gather, estep = _panel_steps(c)
    c.a["ent_col"][_first(gather[estep])] = c.n


def _panel_staged_col(c):
    _, gather, estep = _panel_steps(c)
    e = _first(~gather[estep] & (c.a["st_nc"][estep] < c.n))
    c.a["ent_col"][e] = c.a["st_nc"][estep[e]]


def _panel_sf_past_gathers(c):
    # a block that gathers: its first staged step moved back over a gather step
    blk, gather, _ = _panel_steps(c)
    b = blk[_first(gather)]
    c.a["blk_sf"][b] = c.a["blk_s0"][b]


def _panel_staged_nothing(c):
    _, gather, _ = _panel_steps(c)
    c.a["st_nc"][_first(~gather)] = 0


def _panel_shift_block(c):
    b = _first(c.a["blk_slot"] < 0)
    c.a["blk_row0"][b] += 1 if c.a["blk_row0"][b] + c.a["blk_nrows"][b] < c.m else -1


def _panel_s0_after_sf(c):
    b = _first(c.a["blk_sf"] > c.a["blk_s0"])
    c.a["blk_s0"][b] = c.a["blk_sf"][b] + 1


PANEL_CASES = {
    "blk_row0 past Y": ("panel", lambda c: c.a["blk_row0"].__setitem__(0, c.m), "'blk_row0'"),
    "blk_row0 negative": ("panel", lambda c: c.a["blk_row0"].__setitem__(0, -1), "'blk_row0'"),
    "blk_row0 shifted": ("panel0", _panel_shift_block, "'blk_row0'"),
    "blk_nrows past the accumulator": ("panel", lambda c: c.a["blk_nrows"].__setitem__(0, c.meta["H"] + 1),
                                       "'blk_nrows'"),
    "blk_nrows negative": ("panel", lambda c: c.a["blk_nrows"].__setitem__(0, -1), "'blk_nrows'"),
    "blk_s1 past the steps": ("panel", lambda c: c.a["blk_s1"].__setitem__(0, c.a["st_nc"].size + 1), "'blk_s1'"),
    "blk_s0 negative": ("panel", lambda c: c.a["blk_s0"].__setitem__(0, -1), "'blk_s0'"),
    "blk_s0 after blk_sf": ("panel0", _panel_s0_after_sf, "'blk_s0'"),
    "blk_s1 overlapping the next block": ("panel0", lambda c: c.a["blk_s1"].__setitem__(
        _first(c.a["blk_s1"] < c.a["st_nc"].size), c.a["blk_s1"][_first(c.a["blk_s1"] < c.a["st_nc"].size)] + 1),
        "'blk_s1'"),
    "blk_sf over a gather step": ("panel0", _panel_sf_past_gathers, "'blk_sf'"),
    "blk_sf past the steps": ("panel", lambda c: c.a["blk_sf"].__setitem__(0, c.a["st_nc"].size + 1), "'blk_sf'"),
    "blk_slot past the scratch": ("panel", lambda c: c.a["blk_slot"].__setitem__(
        _panel_split_blocks(c)[0], int((c.a["blk_slot"] >= 0).sum())), "'blk_slot'"),
    "blk_slot negative": ("panel", lambda c: c.a["blk_slot"].__setitem__(0, -2), "'blk_slot'"),
    "blk_slot repeated": ("panel", _panel_dup_slot, "'blk_slot'"),
    "blk_grp past the groups": ("panel", lambda c: c.a["blk_grp"].__setitem__(
        _panel_split_blocks(c)[0], c.a["grp_n"].size), "'blk_grp'"),
    "blk_grp negative": ("panel", lambda c: c.a["blk_grp"].__setitem__(0, -1), "'blk_grp'"),
    "blk_grp another group": ("panel", _panel_other_group, "'blk_grp'"),
    "st_x0 past dense_xrow": ("panel", lambda c: c.a["st_x0"].__setitem__(
        _first(c.a["st_nc"] > 0), c.a["dense_xrow"].size), "'st_x0'"),
    "st_x0 negative": ("panel", lambda c: c.a["st_x0"].__setitem__(0, -1), "'st_x0'"),
    "st_nc past the chunk": ("panel", lambda c: c.a["st_nc"].__setitem__(
        _first(c.a["st_nc"] > 0), c.meta["chunk"] + 1), "'st_nc'"),
    "st_nc staged step stages nothing": ("panel0", _panel_staged_nothing, "'st_nc'"),
    "st_nc negative": ("panel", lambda c: c.a["st_nc"].__setitem__(0, -1), "'st_nc'"),
    "st_eptr non-monotone": ("panel", lambda c: _nonmonotone(c.a["st_eptr"]), "'st_eptr' must rise"),
    "st_eptr past the entries": ("panel", lambda c: c.a["st_eptr"].__setitem__(-1, c.a["st_eptr"][-1] + 1),
                                 "'st_eptr'"),
    "dense_xrow past X": ("panel", lambda c: c.a["dense_xrow"].__setitem__(0, c.n), "'dense_xrow'"),
    "dense_xrow negative": ("panel", lambda c: c.a["dense_xrow"].__setitem__(0, -1), "'dense_xrow'"),
    "ent_row past the accumulator": ("panel", lambda c: c.a["ent_row"].__setitem__(0, c.meta["H"]), "'ent_row'"),
    "ent_row negative": ("panel", lambda c: c.a["ent_row"].__setitem__(0, -1), "'ent_row'"),
    "ent_row outside its block": ("panel0", _panel_row_outside_block, "'ent_row'"),
    "ent_row out of order in a step": ("panel0", _panel_rows_unordered, "'ent_row'"),
    "ent_col past X (gather)": ("panel0", _panel_gather_col, "'ent_col'"),
    "ent_col past the staged chunk": ("panel0", _panel_staged_col, "'ent_col'"),
    "ent_col negative": ("panel", lambda c: c.a["ent_col"].__setitem__(0, -1), "'ent_col'"),
    "ent_val changed": ("panel0", lambda c: c.a["ent_val"].__setitem__(0, c.a["ent_val"][0] * 2 + 1), "values"),
    "row_len wrong count": ("panel", lambda c: c.a["row_len"].__setitem__(1, c.a["row_len"][1] + 1), "'row_len'"),
    "row_ids past Y": ("panel", lambda c: c.a["row_ids"].__setitem__(0, c.m), "'row_ids'"),
    "row_ids repeated": ("panel", lambda c: c.a["row_ids"].__setitem__(0, c.a["row_ids"][1]), "'row_ids'"),
    "grp_first past the slots": ("panel", lambda c: c.a["grp_first"].__setitem__(
        0, int((c.a["blk_slot"] >= 0).sum()) + 1), "'grp_first'"),
    "grp_first shifted": ("panel", lambda c: c.a["grp_first"].__setitem__(0, c.a["grp_first"][0] + 1), "'grp_first'"),
    "grp_first negative": ("panel", lambda c: c.a["grp_first"].__setitem__(0, -1), "'grp_first'"),
    "grp_n zero": ("panel", lambda c: c.a["grp_n"].__setitem__(0, 0), "'grp_n'"),
    "grp_n one more": ("panel", lambda c: c.a["grp_n"].__setitem__(0, c.a["grp_n"][0] + 1), "'grp_n'"),
    # meta
    "meta m": ("panel", lambda c: c.meta.__setitem__("m", c.m - 1), "'m'"),
    "meta K": ("panel", lambda c: c.meta.__setitem__("K", c.meta["K"] + 1), "'K'"),
    "meta H": ("panel", lambda c: c.meta.__setitem__("H", c.meta["H"] + 16), "'H'"),
    "meta chunk": ("panel", lambda c: c.meta.__setitem__("chunk", c.meta["chunk"] + 1), "'chunk'"),
    "meta nbuf": ("panel", lambda c: c.meta.__setitem__("nbuf", 1), "'nbuf'"),
    "meta smem": ("panel", lambda c: c.meta.__setitem__("smem", c.meta["smem"] - 4), "'smem'"),
    "meta arch": ("panel", lambda c: c.meta.__setitem__("arch", -1), "'arch'"),
    "meta warps (block size)": ("panel", lambda c: c.meta.__setitem__("warps", 64), "'warps'"),
    "meta blocks": ("panel", lambda c: c.meta.__setitem__("blocks", c.meta["blocks"] + 1), "'blocks'"),
    "meta steps": ("panel", lambda c: c.meta.__setitem__("steps", c.meta["steps"] - 1), "'steps'"),
    "meta split_panels": ("panel", lambda c: c.meta.__setitem__("split_panels", c.meta["split_panels"] + 1),
                          "'split_panels'"),
    "meta instance nbuf": ("panel", lambda c: c.meta["instances"][0][1].__setitem__(3, 1), "'instances'"),
    "meta instance reduce": ("panel", lambda c: c.meta["instances"][0][1].__setitem__(1, 1), "'instances'"),
    "meta instance name": ("panel", lambda c: c.meta["instances"][1].__setitem__(0, "aspt_panel_r0_v4_b2"),
                           "'instances'"),
    "param nbuf": ("panel", lambda c: c.params.__setitem__("nbuf", 1), "'instances'"),
    "param vec": ("panel", lambda c: c.params.__setitem__("vec", 2), "'vec'"),
    "param scheme": ("panel", lambda c: c.params.__setitem__("scheme", "tasks"), "takes arrays"),
    "array missing": ("panel", lambda c: c.a.pop("grp_n"), "takes arrays"),
}
PANEL_CASES.update(_array_cases(PANEL_ARRAYS, "panel"))


@pytest.mark.parametrize("case", sorted(PANEL_CASES))
def test_aspt_panel_tampered_is_refused(case):
    _refused_after(*PANEL_CASES[case])


def test_aspt_fixtures_have_every_array():
    for name in ("tasks", "panel", "panel0"):
        _, _, k, _ = _fixture(name)
        assert all(v.size for n, v in k.arrays.items() if not (name == "panel0" and n.startswith("grp_")))
    a = _fixture("panel0")[2].arrays
    assert np.any((a["blk_sf"] > a["blk_s0"]) & (a["blk_s1"] > a["blk_sf"]))   # blocks gather, then stage


# ------------------------------------------------------------------------------------------
# end to end: a resealed artifact with a bad array is refused by load
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", ["sptc", "tasks", "panel"])
def test_load_refuses_a_resealed_artifact(tmp_path, fixture):
    from spcompile.artifact import ArtifactError
    from spcompile.module import CompiledModule, load

    t, key, k, vh = _fixture(fixture)
    fat = tmp_path / "kernel.fatbin"
    fat.write_bytes(b"\0" * 16)                  # never run: nothing here needs a GPU

    def saved(arrays, name):
        kern = t.load(k.params, arrays, {"kernel.fatbin": str(fat)}, k.meta)
        mod = CompiledModule(key, t.make_config(k.params, FIXTURES[fixture][5]), kern, values_hash=vh)
        return mod.save(str(tmp_path / name), sign_key=False)

    assert load(saved(k.arrays, "good.spc")).kernel.arrays.keys() == k.arrays.keys()
    bad = {n: v.copy() for n, v in k.arrays.items()}
    bad["row_ids"][0] = key.rows                 # one past Y's rows: the checksums are recomputed on save
    with pytest.raises(ArtifactError, match="'row_ids'"):
        load(saved(bad, "bad.spc"))
