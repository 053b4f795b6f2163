"""The pass framework: registry (decorator and the ``spcompile.passes`` entry-point group),
Pipeline, PassContext options and instruments, TimingInstrument, and lossless permutations of the
shipped reorderings, all the way through build()."""
from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile import Pass, PassContext, Pipeline, TimingInstrument, register_pass
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule, SparseOp
from spcompile.passes import base, get_pass, list_passes
from spcompile.passes import run as run_pass

from conftest import check_result, count_pass_runs, inputs_for, random_matrix

pytestmark = pytest.mark.usefixtures("no_tuning_db")


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    """Every test sees (and leaves) the registry as it was: third-party names do not leak."""
    base._load_builtin()
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(base, "_ENTRY_POINTS_LOADED", base._ENTRY_POINTS_LOADED)


@pytest.fixture(scope="module")
def A():
    return random_matrix(60, 45, density=0.08, seed=31)


def make_module(A, op="spmm", K=3, reduce=None):
    return SparseModule.from_op(SparseOp(op, reduce, as_csr(A), K))


def reverse_rows(mod, ctx, shift=0):
    """Third-party pass as a function: rows reversed, then rotated by ``shift``."""
    m = mod.A.shape[0]
    perm = np.roll(np.arange(m)[::-1], shift)
    return mod.permute(perm, None).with_metrics("thirdparty.reverse", {"shift": shift})


# -- registry ---------------------------------------------------------------------------------------

def test_builtin_passes_listed():
    info = list_passes()
    assert {"reorder.rcm", "reorder.degree"} <= set(info)
    assert info["reorder.degree"].options == {"descending": True}
    assert info["reorder.rcm"].description


def test_register_function_pass_and_build(A):
    register_pass("thirdparty.reverse")(reverse_rows)
    p = get_pass("thirdparty.reverse", shift=5)
    assert p.name == "thirdparty.reverse" and p.options == {"shift": 5}
    assert get_pass("thirdparty.reverse").options == {"shift": 0}  # default from the signature
    for op, reduce in [("spmm", "mean"), ("sddmm", None)]:
        mod = spcompile.build(A, op, K=4, reduce=reduce, target="cpu",
                              pipeline=[("thirdparty.reverse", {"shift": 7}), "reorder.degree"])
        assert mod.config.pipeline[0] == {"name": "thirdparty.reverse", "options": {"shift": 7}}
        assert mod.pass_log[0]["metrics"]["shift"] == 7
        inputs = inputs_for(op, A.shape, 4)
        check_result(mod(*inputs), A, op, reduce, inputs)


def test_register_class_pass():
    @register_pass("thirdparty.colrev", produces=("colrev",))
    class ColumnReverse(Pass):
        """Columns in reverse order."""

        default_options = {"mark": 1}

        def transform(self, mod, ctx):
            n = mod.A.shape[1]
            return mod.permute(None, np.arange(n)[::-1]).with_format("colrev", {"mark": self.options["mark"]})

    p = get_pass("thirdparty.colrev", mark=3)
    assert isinstance(p, ColumnReverse) and p.info.produces == ("colrev",)
    assert p.info.description == "Columns in reverse order."
    out = Pipeline([p])(make_module(sp.eye(4, 5, format="csr")))
    assert out.formats["colrev"] == {"mark": 3}
    np.testing.assert_array_equal(out.col_perm, [4, 3, 2, 1, 0])
    with pytest.raises(TypeError, match="unknown option"):
        get_pass("thirdparty.colrev", colour="red")


def test_subclass_registered_under_its_own_name():
    from spcompile.passes.reorder_simple import DegreeSort

    @register_pass("thirdparty.ascending_degree", options={"descending": False})
    class Ascending(DegreeSort):
        pass

    p = get_pass("thirdparty.ascending_degree")
    assert p.name == "thirdparty.ascending_degree" and p.options == {"descending": False}
    assert get_pass("reorder.degree").name == "reorder.degree"  # the parent is untouched
    assert get_pass("reorder.degree").options == {"descending": True}
    spec = Pipeline([p]).spec()
    assert Pipeline(spec).spec() == spec  # replayable by name


def test_registry_errors():
    register_pass("thirdparty.once")(reverse_rows)
    with pytest.raises(ValueError, match="already registered"):
        register_pass("thirdparty.once")(lambda mod, ctx: mod)
    register_pass("thirdparty.once", override=True)(lambda mod, ctx: mod)
    for bad in ("Upper.Case", "", "has space", 3):
        with pytest.raises(ValueError, match="dotted lowercase"):
            register_pass(bad)
    with pytest.raises(TypeError, match="expected a Pass subclass or a function"):
        register_pass("thirdparty.notapass")(42)

    class Named(Pass):
        name = "thirdparty.a"

    with pytest.raises(ValueError, match="registered as 'thirdparty.b'"):
        register_pass("thirdparty.b")(Named)
    with pytest.raises(ValueError, match="unknown pass 'thirdparty.missing'"):
        get_pass("thirdparty.missing")


PLUGIN = '''
import numpy as np
from spcompile.passes import Pass


class EvenOddRows(Pass):
    """Even rows first, then odd rows."""

    default_options = {"odd_first": False}

    def transform(self, mod, ctx):
        m = mod.A.shape[0]
        even, odd = np.arange(0, m, 2), np.arange(1, m, 2)
        perm = np.concatenate([odd, even] if self.options["odd_first"] else [even, odd])
        return mod.permute(perm, None).with_metrics(self.name, {"plugin": True})


def swap_columns(mod, ctx, first=0, second=1):
    n = mod.A.shape[1]
    perm = np.arange(n)
    perm[[first, second]] = perm[[second, first]]
    return mod.permute(None, perm)
'''


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """A third-party distribution on sys.path declaring passes in the spcompile.passes group."""
    (tmp_path / "spc_plugin_mod.py").write_text(PLUGIN)
    dist = tmp_path / "spc_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: spc-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""\
        [spcompile.passes]
        plugin.evenodd = spc_plugin_mod:EvenOddRows
        plugin.swapcols = spc_plugin_mod:swap_columns
        plugin.broken = spc_plugin_mod:does_not_exist
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_ENTRY_POINTS_LOADED", False)  # rescan entry points
    yield
    sys.modules.pop("spc_plugin_mod", None)


def test_entry_point_passes(plugin_dist, A):
    assert "plugin.evenodd" not in base._REGISTRY
    with pytest.warns(UserWarning, match="plugin.broken"):  # a broken plug-in warns, never breaks
        p = get_pass("plugin.evenodd", odd_first=True)
    assert p.name == "plugin.evenodd" and p.options == {"odd_first": True}
    assert get_pass("plugin.swapcols").options == {"first": 0, "second": 1}
    assert "plugin.broken" not in list_passes()
    mod = spcompile.build(A, "spmm", K=3, reduce="max", target="cpu",
                          pipeline=[("plugin.evenodd", {"odd_first": True}),
                                    ("plugin.swapcols", {"first": 2, "second": 40}), "reorder.rcm"])
    assert [p["name"] for p in mod.config.pipeline] == ["plugin.evenodd", "plugin.swapcols", "reorder.rcm"]
    assert mod.pass_log[0]["metrics"]["plugin"] is True
    X = inputs_for("spmm", A.shape, 3)[0]
    check_result(mod(X), A, "spmm", "max", (X,))


def test_entry_points_do_not_shadow_registered_names(plugin_dist):
    register_pass("plugin.evenodd")(reverse_rows)
    with pytest.warns(UserWarning):
        base._load_entry_points()
    assert get_pass("plugin.evenodd").options == {"shift": 0}


# -- Pipeline / PassContext / instruments -----------------------------------------------------------

class RecordingInstrument(spcompile.passes.PassInstrument):
    def __init__(self):
        self.events = []

    def enter_pass(self, info, mod):
        self.events.append(("enter", info.name, mod.A.shape))

    def exit_pass(self, info, mod, seconds):
        assert seconds >= 0 and info.name in mod.metrics
        self.events.append(("exit", info.name, dict(info.options)))


def test_pipeline_spec_forms():
    p = Pipeline(["reorder.rcm", ("reorder.degree", {"descending": False}),
                  {"name": "reorder.degree"}, get_pass("reorder.rcm", symmetric_mode=False)])
    assert len(p) == 4
    spec = p.spec()
    assert spec == [{"name": "reorder.rcm", "options": {"symmetric_mode": True}},
                    {"name": "reorder.degree", "options": {"descending": False}},
                    {"name": "reorder.degree", "options": {"descending": True}},
                    {"name": "reorder.rcm", "options": {"symmetric_mode": False}}]
    assert Pipeline(spec).spec() == spec
    assert "reorder.rcm" in repr(p)
    with pytest.raises(TypeError, match="cannot read pipeline item"):
        Pipeline([3.5])


def test_pass_context_options_instruments_and_timing(A):
    timing = TimingInstrument()
    rec = RecordingInstrument()
    ctx = PassContext(options={"reorder.degree": {"descending": False}}, instruments=[rec, timing], seed=3)
    out = Pipeline(["reorder.rcm", "reorder.degree"])(make_module(A), ctx)
    assert [e[:2] for e in rec.events] == [("enter", "reorder.rcm"), ("exit", "reorder.rcm"),
                                          ("enter", "reorder.degree"), ("exit", "reorder.degree")]
    assert rec.events[3][2] == {"descending": False}  # the context's override reached the pass
    lens = out.A.row_lengths
    assert np.all(np.diff(lens) >= 0)  # ascending, as overridden
    assert [n for n, _ in timing.timings] == ["reorder.rcm", "reorder.degree"]
    assert all(s >= 0 for _, s in timing.timings)
    assert "reorder.rcm" in timing.summary() and "ms" in timing.summary()
    assert [r.name for r in out.log] == ["reorder.rcm", "reorder.degree"]
    assert out.log[1].options == {"descending": False}
    assert out.metrics["reorder.degree"]["seconds"] >= 0


def test_pass_context_as_context_manager_and_through_build(A):
    timing = TimingInstrument()
    with PassContext(options={"reorder.degree": {"descending": False}}, instruments=[timing]) as ctx:
        assert PassContext.current() is ctx
        mod = spcompile.build(A, "spmm", K=2, target="cpu", pipeline=["reorder.degree"])
    assert PassContext.current() is not ctx
    assert [n for n, _ in timing.timings] == ["reorder.degree"]
    # the recorded decision is what actually ran, so it replays to the same module
    assert mod.config.pipeline == ({"name": "reorder.degree", "options": {"descending": False}},)
    X = inputs_for("spmm", A.shape, 2)[0]
    check_result(mod(X), A, "spmm", "sum", (X,))
    timing2 = TimingInstrument()
    spcompile.build(A, "spmm", K=2, target="cpu", pipeline=["reorder.rcm"], ctx=PassContext(instruments=[timing2]))
    assert [n for n, _ in timing2.timings] == ["reorder.rcm"]


def test_pass_requirements_and_bad_results():
    @register_pass("thirdparty.needs_sgt", requires=("sgt",))
    def needs(mod, ctx):
        return mod

    @register_pass("thirdparty.returns_none")
    def bad(mod, ctx):
        return None

    mod = make_module(sp.eye(3, format="csr"))
    with pytest.raises(ValueError, match=r"requires format\(s\) \['sgt'\]"):
        Pipeline(["thirdparty.needs_sgt"])(mod)
    assert Pipeline(["thirdparty.needs_sgt"])(mod.with_format("sgt", {})) is not None
    with pytest.raises(TypeError, match="returned NoneType, not a SparseModule"):
        Pipeline(["thirdparty.returns_none"])(mod)


def test_sparse_module_is_immutable_and_passes_do_not_mutate(A):
    mod = make_module(A)
    out = Pipeline(["reorder.rcm"])(mod)
    assert mod.row_perm is None and mod.log == () and dict(mod.metrics) == {}
    with pytest.raises(Exception):
        mod.row_perm = np.arange(3)
    with pytest.raises(TypeError):
        out.metrics["x"] = 1
    with pytest.raises(ValueError):
        out.A.indices[0] = 0  # read-only arrays


# -- permutations are lossless ------------------------------------------------------------------------

def assert_lossless(mod: SparseModule):
    A0 = mod.op.A.to_scipy().toarray()
    m, n = A0.shape
    rp = np.arange(m) if mod.row_perm is None else mod.row_perm
    cp = np.arange(n) if mod.col_perm is None else mod.col_perm
    assert rp.dtype == np.int64 and cp.dtype == np.int64
    np.testing.assert_array_equal(np.sort(rp), np.arange(m))
    np.testing.assert_array_equal(np.sort(cp), np.arange(n))
    np.testing.assert_array_equal(mod.A.to_scipy().toarray(), A0[rp][:, cp])
    nnz = np.arange(mod.A.nnz) if mod.nnz_perm is None else mod.nnz_perm
    np.testing.assert_array_equal(np.sort(nnz), np.arange(mod.op.A.nnz))
    np.testing.assert_array_equal(mod.A.data, mod.op.A.data[nnz])
    # the entry map is consistent with the row/column maps
    rows_new = np.repeat(np.arange(m), np.diff(mod.A.indptr))
    rows_old = np.repeat(np.arange(m), np.diff(mod.op.A.indptr))
    np.testing.assert_array_equal(rp[rows_new], rows_old[nnz])
    np.testing.assert_array_equal(cp[mod.A.indices], mod.op.A.indices[nnz])


MATRICES = {
    "square": lambda: random_matrix(70, 70, density=0.05, seed=41),
    "nonsquare-tall": lambda: random_matrix(70, 33, density=0.08, seed=42),
    "nonsquare-wide": lambda: random_matrix(25, 90, density=0.06, seed=43),
    "empty": lambda: sp.csr_matrix((6, 4), dtype=np.float32),
    "asymmetric-square": lambda: sp.triu(random_matrix(40, 40, density=0.1, seed=44), format="csr"),
}


@pytest.mark.parametrize("matrix", sorted(MATRICES))
@pytest.mark.parametrize("pipeline", [["reorder.rcm"], ["reorder.degree"], [("reorder.degree", {"descending": False})],
                                      [("reorder.rcm", {"symmetric_mode": False})],
                                      ["reorder.degree", "reorder.rcm", "reorder.degree"]],
                         ids=["rcm", "degree", "degree-asc", "rcm-nonsym", "degree+rcm+degree"])
def test_reorderings_are_lossless(matrix, pipeline):
    A = MATRICES[matrix]()
    out = Pipeline(pipeline)(make_module(A))
    assert_lossless(out)
    if A.shape[0] == A.shape[1] and A.nnz and pipeline == ["reorder.rcm"]:
        assert out.symmetric_perm  # square RCM renumbers rows and columns alike
    if pipeline == ["reorder.degree"]:
        assert np.all(np.diff(out.A.row_lengths) <= 0)
        assert out.metrics["reorder.degree"]["first_row_len"] == out.A.row_lengths.max(initial=0)


def test_rcm_reduces_bandwidth_of_a_scrambled_band():
    n = 200
    band = sp.diags([np.ones(n - abs(k)) for k in (-2, -1, 0, 1, 2)], [-2, -1, 0, 1, 2], format="csr")
    p = np.random.default_rng(0).permutation(n)
    scrambled = band[p][:, p].tocsr()
    out = run_pass("reorder.rcm", scrambled)
    m = out.metrics["reorder.rcm"]
    assert m["bandwidth_after"] <= 2.0 < m["bandwidth_before"]
    assert_lossless(out)


@pytest.mark.parametrize("op,reduce", [("spmm", "sum"), ("spmm", "min"), ("sddmm", None)])
def test_permuted_modules_compute_in_callers_order_nonsquare(op, reduce):
    A = MATRICES["nonsquare-wide"]()
    mod = spcompile.build(A, op, K=3, reduce=reduce, target="cpu",
                          pipeline=["reorder.rcm", ("reorder.degree", {"descending": False})])
    inputs = inputs_for(op, A.shape, 3)
    check_result(mod(*inputs), A, op, reduce, inputs)


def test_run_helper():
    out = run_pass("reorder.degree", sp.eye(3, format="csr") + sp.csr_matrix(([1.0], ([2], [0])), shape=(3, 3)),
                   descending=True)
    assert out.row_perm[0] == 2 and "reorder.degree" in out.metrics


def test_run_prefixed_runs_a_common_start_once(monkeypatch):
    """Pipelines through one cache run a shared prefix once: RCM, then RCM + degree continues
    from RCM's module; the result is the whole pipeline's (its log, its matrix); the seconds
    are the whole pipeline's; a cached pipeline comes back as it ran; a pass that fails is cached
    as its error, raised again (without running) for every pipeline that starts with it, and
    other pipelines still run."""
    from spcompile.passes import pipeline_key, run_prefixed
    from spcompile.passes.reorder_simple import DegreeSort, RCMReorder

    calls = count_pass_runs(monkeypatch, RCMReorder, DegreeSort)
    A = random_matrix(300, 300, density=0.02, seed=4)
    start = SparseModule.from_op(SparseOp("spmm", "sum", as_csr(A), 4))
    rcm = [{"name": "reorder.rcm", "options": {}}]
    both = rcm + [{"name": "reorder.degree", "options": {}}]
    direct = Pipeline(both)(start)
    calls.clear()
    cache = {}
    m1, s1 = run_prefixed(rcm, start, cache)
    m2, s2 = run_prefixed(both, start, cache)
    assert calls == ["RCMReorder", "DegreeSort"] and s2 >= s1 > 0
    assert [r.name for r in m2.log] == ["reorder.rcm", "reorder.degree"]
    assert np.array_equal(m2.A.indices, direct.A.indices) and np.array_equal(m2.nnz_perm, direct.nnz_perm)
    assert run_prefixed(both, start, cache) == (m2, s2) and run_prefixed([], start, cache) == (start, 0.0)
    assert calls == ["RCMReorder", "DegreeSort"] and set(cache) == {pipeline_key(p) for p in ([], rcm, both)}

    def broken(self, mod, ctx):
        calls.append("broken")
        raise ValueError("no order for this matrix")

    monkeypatch.setattr(DegreeSort, "transform", broken)
    deg = [{"name": "reorder.degree", "options": {}}]
    longer = deg + rcm
    for spec in (deg, longer, deg):
        with pytest.raises(ValueError, match="no order"):
            run_prefixed(spec, start, cache)
    assert calls.count("broken") == 1 and isinstance(cache[pipeline_key(deg)][0], ValueError)
    # the longer pipeline has its own entry, the prefix's error (quick selection looks a
    # candidate's pipeline up by its key: a KeyError there would hide the pass's error)
    assert cache[pipeline_key(longer)][0] is cache[pipeline_key(deg)][0]
    assert run_prefixed(rcm, start, cache)[0] is m1
