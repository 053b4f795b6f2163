"""The shipped knowledge and the model over it (autotune.knowledge), quick selection
(autotune.select) and the SciPy template it measures on the CPU (extern.scipy)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.autotune import knowledge as kn
from spcompile.autotune import select
from spcompile.autotune.policy import decide
from spcompile.compile import make_op
from spcompile.core import reference
from spcompile.core.formats import as_csr

from conftest import dense_blocks, random_matrix


# -- features ---------------------------------------------------------------------------------
def test_features_values_and_pattern_only():
    A = sp.csr_matrix(np.array([[1, 0, 2, 0], [0, 0, 0, 0], [3, 4, 5, 6], [0, 0, 0, 7]], dtype=np.float32))
    f = kn.features(A)
    assert set(f) == set(kn.FEATURES)
    assert f["empty_rows"] == pytest.approx(0.25)
    assert f["log_nnz"] == pytest.approx(math.log2(7 + 1))
    assert f["log_mean_row"] == pytest.approx(math.log2(7 / 4 + 1))
    assert f["log_max_over_mean"] == pytest.approx(math.log2(4 / (7 / 4)))
    assert f["window_reuse"] == pytest.approx(7 / 4)   # one 32-row window: 7 nonzeros, 4 columns
    B = A.copy()
    B.data[:] = -9.0
    assert kn.features(B) == f                        # the pattern decides, not the values
    g = kn.features(sp.csr_matrix((5, 3), dtype=np.float32))   # no nonzeros at all
    assert all(np.isfinite(v) for v in g.values()) and g["empty_rows"] == 1.0


def test_features_are_linear_and_separate_structures():
    n = 20000
    banded = sp.diags([np.ones(n - k) for k in range(4)], list(range(4)), format="csr", dtype=np.float32)
    rng = np.random.default_rng(0)
    scattered = sp.random(n, n, density=4 / n, format="csr", random_state=rng, dtype=np.float32)
    fb, fs = kn.features(banded), kn.features(scattered)
    assert fb["locality"] > 0.99 and fs["locality"] < 0.8
    assert fb["window_reuse"] > 3 and fs["window_reuse"] < 1.2


# -- the shipped knowledge ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    k = kn.load_knowledge("cuda", "sm_90")
    assert k is not None, "the package ships knowledge_sm_90.json"
    return k


def test_shipped_knowledge_matches_the_portfolio(shipped):
    """A stale knowledge file (portfolio changed since it was measured) would rank the wrong
    configs: every class's candidates must be today's portfolio, every graph a full row."""
    want = {"spmm/sum/float32/%d" % K for K in kn.KNOWLEDGE_K} | {"spmm/sum/float16/128", "sddmm/-/float32/128"}
    assert want <= set(shipped.tables)
    for cls, t in shipped.tables.items():
        op, red, dt, K = cls.split("/")
        assert t.candidates == kn.portfolio(op, None if red == "-" else red, dt), cls
        assert t.times.shape == (len(t.names), len(t.candidates))
        assert t.X.shape == (len(t.names), len(kn.FEATURES)) and np.isfinite(t.X).all()
        assert len(set(t.digests)) == len(t.digests)
        assert (np.isfinite(t.times).sum(axis=1) >= len(t.candidates) // 2).all(), cls
    assert len(shipped.tables["spmm/sum/float32/128"].names) >= 50


def test_every_portfolio_member_is_a_valid_config():
    A = random_matrix(300, 300, density=0.02, seed=3)
    from spcompile.kernels import get_template
    from spcompile.core.ir import SparseModule

    for op, red, dt, K in [("spmm", "sum", "float32", 128), ("spmm", "sum", "float16", 64),
                           ("spmm", "mean", "float32", 32), ("sddmm", None, "float32", 256)]:
        sop = make_op(A, op, K, red, dt)
        seen = set()
        for cid in kn.portfolio(op, red, dt):
            cfg = kn.candidate_config(cid, sop)
            tpl = get_template(cfg.template)
            assert tpl.check_params(SparseModule.from_op(sop), cfg.params) == {**tpl.default_params(
                SparseModule.from_op(sop)), **cfg.params}
            seen.add(json.dumps(cfg.to_dict(), sort_keys=True))
        assert len(seen) >= len(kn.portfolio(op, red, dt)) // 2   # members differ


def test_leave_one_graph_out_quality(shipped):
    """The model on graphs it has not seen (each graph's own measurements left out): its first
    choice and the best of its first DEFAULT_CANDIDATES plus the vendor library, against the
    graph's best; the more candidates quick selection measures, the closer to the best."""
    cv = kn.cross_validate(shipped)
    fewer = kn.cross_validate(shipped, more=0, probe=False)
    first = kn.cross_validate(shipped, probe=False)
    for cls, r in cv.items():
        assert r["quick_over_oracle"] >= first[cls]["quick_over_oracle"] - 1e-12, cls
        assert first[cls]["quick_over_oracle"] >= fewer[cls]["quick_over_oracle"] - 1e-12, cls
    # the second round (neighbours of the fastest) gains where the portfolio has such neighbours
    assert cv["spmm/sum/float32/128"]["quick_over_oracle"] > first["spmm/sum/float32/128"]["quick_over_oracle"]
    for K in (64, 128, 256):
        r = cv[f"spmm/sum/float32/{K}"]
        assert r["graphs"] >= 50
        assert r["model_over_oracle"] >= 0.88, r["model_over_oracle"]
        assert r["quick_over_oracle"] >= 0.93, r["quick_over_oracle"]
        assert r["quick_speedup"] >= 1.5 and r["quick_worst"] >= 0.95
        # the held-out rows really are held out: the model's pick is not always the oracle
        assert any(row["model_s"] > row["oracle_s"] for row in r["rows"])


# -- the model on matrices outside its training set --------------------------------------------
def _doc(train):
    """A knowledge document with candidates 'a' (fast on short rows) and 'b' (fast on long rows)."""
    cands = ["csr.crc_cwm|none|ms0-u2", "csr.crc_cwm|none|ms32-w8r2", "extern.cusparse|none|default"]
    graphs = []
    for i, A in enumerate(train):
        f = kn.features(A)
        long_rows = f["log_mean_row"] > 3
        times = [2e-5, 1e-5, 4e-5] if long_rows else [1e-5, 3e-5, 4e-5]
        graphs.append({"name": f"g{i}", "digest": spcompile.core.ir.pattern_hash(spcompile.core.formats.as_csr(A)),
                       "features": f, "baseline_s": 4e-5, "times": times})
    return {"workloads": {"spmm/sum/float32/128": {"candidates": cands, "graphs": graphs}}}, cands


def test_model_ranks_by_structure_on_unseen_matrices():
    rng = np.random.default_rng(5)
    short = [sp.random(3000, 3000, density=d, format="csr", random_state=rng, dtype=np.float32)
             for d in (0.0005, 0.001, 0.0015)]
    long_ = [sp.random(3000, 3000, density=d, format="csr", random_state=rng, dtype=np.float32)
             for d in (0.02, 0.03, 0.04)]
    doc, cands = _doc(short + long_)
    k = kn.Knowledge(doc)
    t = k.table_for("spmm", "sum", "float32", 100)      # nearest K
    new_short = sp.random(5000, 5000, density=0.0008, format="csr", random_state=rng, dtype=np.float32)
    new_long = sp.random(2000, 2000, density=0.05, format="csr", random_state=rng, dtype=np.float32)
    top_s = kn.Knowledge.rank(t, kn._vector(kn.features(new_short)), k=3)
    top_l = kn.Knowledge.rank(t, kn._vector(kn.features(new_long)), k=3)
    assert top_s[0][0] == cands[0] and top_l[0][0] == cands[1]
    assert top_l[0][2] == pytest.approx(4.0, rel=0.01)   # expected speed-up over the baseline
    assert k.table_for("spmm", "max", "float32", 128) is t   # max falls back to the sum's data
    assert k.table_for("sddmm", None, "float32", 128) is None


def test_excluded_leaves_the_graph_out(monkeypatch, tmp_path):
    rng = np.random.default_rng(9)
    mats = [sp.random(2000, 2000, density=d, format="csr", random_state=rng, dtype=np.float32)
            for d in (0.001, 0.002, 0.03)]
    doc, cands = _doc(mats)
    # the first matrix's own row says 'c' (the vendor) wins on it
    doc["workloads"]["spmm/sum/float32/128"]["graphs"][0]["times"] = [9e-5, 9e-5, 1e-6]
    path = tmp_path / "k.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("SPCOMPILE_KNOWLEDGE", str(path))
    kn._CACHE.clear()
    sop = make_op(mats[0], "spmm", 128, "sum", "float32")
    monkeypatch.setattr(kn, "_applies", lambda *a: True)
    monkeypatch.setattr(kn, "_arch", lambda t: "sm_90")
    from spcompile.kernels import get_template

    monkeypatch.setattr(type(get_template("csr.crc_cwm")), "available", lambda self: True)
    monkeypatch.setattr(type(get_template("extern.cusparse")), "available", lambda self: True)
    seen = kn.ranked_configs(sop, "cuda", k=3)
    assert seen[0][0].template == "extern.cusparse"       # memory: its own record
    with kn.excluded(mats[0]):
        held_out = kn.ranked_configs(sop, "cuda", k=3)
    assert held_out[0][0].template == "csr.crc_cwm"       # generalisation from the others
    assert kn.ranked_configs(sop, "cuda", k=3)[0][0].template == "extern.cusparse"   # restored
    kn._CACHE.clear()


# -- extern.scipy ---------------------------------------------------------------------------------
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("K", [1, 7, 64])
def test_scipy_template_matches_reference(reduce, K):
    A = random_matrix(130, 90, density=0.05, seed=K)
    mod = spcompile.build(A, "spmm", K, reduce=reduce, target="cpu", template="extern.scipy")
    X = np.random.default_rng(K).standard_normal((90, K)).astype(np.float32)
    Y = np.full((130, K), np.nan, np.float32)
    mod(X, out=Y)
    ref = reference.spmm(spcompile.core.formats.as_csr(A), X.astype(np.float64), reduce)
    assert reference.rel_error(Y, ref) < 1e-5
    import torch

    Yt = mod(torch.from_numpy(X))
    assert isinstance(Yt, torch.Tensor) and np.allclose(Yt.numpy(), Y)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("K", [1, 7, 33])
def test_scipy_template_takes_call_values(dtype, reduce, K):
    """A SciPy module takes new values per call like the compiled CPU templates (so a plain CPU
    build works with ``values=`` whichever template it picks); mean divides by the row lengths
    of the pattern; a call without values goes back to the built ones.  The values follow the
    canonical CSR order (empty rows, one row holding every column)."""
    A = as_csr(random_matrix(97, 61, density=0.06, seed=K + 3, dtype=np.float64), dtype=np.float64)
    mod = spcompile.build(A, "spmm", K, reduce=reduce, target="cpu", template="extern.scipy", dtype=dtype)
    assert mod.supports_call_values
    rng = np.random.default_rng(K)
    X = rng.standard_normal((61, K)).astype(dtype)
    tol = 1e-5 if dtype == "float32" else 1e-12
    for _ in range(2):
        v = rng.standard_normal(A.nnz)
        ref = reference.spmm(as_csr((A.indptr, A.indices, v, A.shape), dtype=np.float64), X.astype(np.float64),
                             reduce)
        Y = np.full((97, K), np.nan, dtype)
        mod(X, out=Y, values=v)
        assert np.isfinite(Y).all() and reference.rel_error(Y, ref) < tol
    built = reference.spmm(A, X.astype(np.float64), reduce)
    assert reference.rel_error(mod(X), built) < tol           # the built values again
    with pytest.raises(ValueError, match="one value per stored entry"):
        mod(X, values=np.ones(A.nnz + 1))


def test_scipy_template_artifact_roundtrip(tmp_path):
    A = random_matrix(60, 50, density=0.1, seed=2)
    mod = spcompile.build(A, "spmm", 5, target="cpu", template="extern.scipy")
    p = mod.save(str(tmp_path / "m.spc"))
    X = np.random.default_rng(0).standard_normal((50, 5)).astype(np.float32)
    assert np.array_equal(spcompile.load(p)(X), mod(X))


def _with_fp16(doc, cands):
    """``doc`` plus a float16 class that measured only the first candidate and the vendor (the
    16-bit portfolios are smaller than the float32 one)."""
    g16 = [{**g, "times": [g["times"][0], g["times"][2]]} for g in doc["workloads"]["spmm/sum/float32/128"]["graphs"]]
    doc["workloads"]["spmm/sum/float16/128"] = {"candidates": [cands[0], cands[2]], "graphs": g16}
    return doc


def test_bfloat16_uses_the_float16_measurements():
    rng = np.random.default_rng(5)
    mats = [sp.random(2000, 2000, density=d, format="csr", random_state=rng, dtype=np.float32) for d in (0.001, 0.03)]
    doc, cands = _doc(mats)
    k = kn.Knowledge(_with_fp16(doc, cands))
    t16 = k.table_for("spmm", "sum", "float16", 128)
    assert t16 is not None and t16.candidates == [cands[0], cands[2]]
    assert k.table_for("spmm", "sum", "bfloat16", 128) is t16
    assert k.table_for("spmm", "sum", "float64", 128) is None     # no same-width fallback for float64


def test_cross_dtype_candidate_is_the_float32_choice_the_16bit_portfolio_lacks(tmp_path, monkeypatch):
    """A graph whose float32 winner is a shape the float16 portfolio never measured (here the
    long-row shape 'b') gets that shape offered at float16 too, with no claimed speed-up."""
    rng = np.random.default_rng(7)
    train = [sp.random(3000, 3000, density=d, format="csr", random_state=rng, dtype=np.float32)
             for d in (0.0005, 0.001, 0.02, 0.03, 0.04)]
    doc, cands = _doc(train)
    path = tmp_path / "k.json"
    path.write_text(json.dumps(_with_fp16(doc, cands)))
    monkeypatch.setenv("SPCOMPILE_KNOWLEDGE", str(path))
    kn._CACHE.clear()
    monkeypatch.setattr(kn, "_applies", lambda *a: True)
    monkeypatch.setattr(kn, "_arch", lambda t: "sm_90")
    from spcompile.kernels import get_template

    monkeypatch.setattr(type(get_template("csr.crc_cwm")), "available", lambda self: True)
    monkeypatch.setattr(type(get_template("extern.cusparse")), "available", lambda self: True)
    new_long = sp.random(2000, 2000, density=0.05, format="csr", random_state=rng, dtype=np.float32)
    new_short = sp.random(5000, 5000, density=0.0008, format="csr", random_state=rng, dtype=np.float32)
    for dt in ("float16", "bfloat16"):
        sop = make_op(new_long, "spmm", 128, "sum", dt)
        own = [c for c, _ in kn.ranked_configs(sop, "cuda", k=8)]
        assert all(c.params["max_seg"] == 0 for c in own if c.template == "csr.crc_cwm")   # 'a' only
        cross = kn.cross_dtype_configs(sop, "cuda")
        assert len(cross) == 1 and cross[0][1] is None
        cfg = cross[0][0]
        want = kn.candidate_config(cands[1], sop, "cuda")     # shape 'b', built for this dtype
        assert (cfg.template, cfg.params, cfg.pipeline) == (want.template, want.params, want.pipeline)
        # the shape of 'b' with this dtype's own vector width (16 bytes: 8 elements)
        assert cfg.params["max_seg"] == 32 and cfg.params["warps_per_block"] == 8 and cfg.params["vec"] == 8
    # 'a' wins in float32 on short rows and was measured at float16: the next unmeasured one ('b') is offered
    short16 = kn.cross_dtype_configs(make_op(new_short, "spmm", 128, "sum", "float16"), "cuda")
    assert [c.params["max_seg"] for c, _ in short16] == [32]
    assert kn.cross_dtype_configs(make_op(new_long, "spmm", 128, "sum", "float32"), "cuda") == []
    # the graph's own rows are left out under excluded(), in the float32 class too
    with kn.excluded(*train):
        assert kn.cross_dtype_configs(make_op(new_long, "spmm", 128, "sum", "float16"), "cuda") == []


# -- quick selection ----------------------------------------------------------------------------
def test_quick_selection_on_cpu_picks_the_fastest_correct(no_tuning_db):
    A = random_matrix(400, 400, density=0.02, seed=4)
    mod = spcompile.build(A, "spmm", 32, target="cpu")
    t = mod.tuning
    assert t["source"] == "quick"
    rows = {r["source"]: r for r in t["candidates"]}
    assert set(rows) == {"heuristic", "vendor"} and rows["vendor"]["template"] == "extern.scipy"
    fastest = min(t["candidates"], key=lambda r: r["kernel_ms"])
    assert mod.config.template == fastest["template"]
    assert t["expected_speedup"] == pytest.approx(rows["vendor"]["kernel_ms"] / fastest["kernel_ms"])
    X = np.random.default_rng(1).standard_normal((400, 32)).astype(np.float32)
    assert reference.rel_error(mod(X), A.astype(np.float64) @ X) < 1e-5
    # no budget: no measurement, the heuristic default
    mod0 = spcompile.build(A, "spmm", 32, target="cpu", select_budget=0)
    assert mod0.tuning["source"] == "heuristic" and mod0.config.template == "cpu.csr_spmm"


@pytest.mark.parametrize("threads, parallel", [(1, False), (2, False), (3, True), (8, True)])
def test_cpu_default_runs_on_one_thread_with_two_cores_or_fewer(monkeypatch, threads, parallel):
    # a parallel loop on two cores waits for its second thread behind any other busy thread
    from spcompile.kernels.tvm import cpu_csr
    from spcompile.runtime import cpu as rt

    monkeypatch.setattr(rt, "num_threads", lambda: threads)
    A = random_matrix(3000, 3000, density=0.01, seed=5)        # nnz * K well over the work threshold
    sop = make_op(A, "spmm", 64, "sum", "float32")
    assert A.nnz * 64 >= cpu_csr.PARALLEL_MIN_WORK
    from spcompile.compile import default_config

    assert default_config(sop, "cpu").params["parallel"] is parallel
    small = make_op(random_matrix(100, 100, density=0.05, seed=5), "spmm", 64, "sum", "float32")
    assert default_config(small, "cpu").params["parallel"] is False


def test_quick_selection_measures_the_one_thread_variant_of_a_parallel_default(monkeypatch, no_tuning_db):
    from spcompile.runtime import cpu as rt

    monkeypatch.setattr(rt, "num_threads", lambda: 4)
    A = random_matrix(3000, 3000, density=0.01, seed=6)
    mod = spcompile.build(A, "spmm", 64, target="cpu")
    assert mod.tuning["source"] == "quick"
    ours = [r for r in mod.tuning["candidates"] if r["template"] == "cpu.csr_spmm"]
    assert sorted(r["params"]["parallel"] for r in ours) == [False, True]
    assert all("kernel_ms" in r for r in ours)
    fastest = min(mod.tuning["candidates"], key=lambda r: r["kernel_ms"])
    assert (mod.config.template, mod.config.params) == (fastest["template"], fastest["params"])
    X = np.random.default_rng(2).standard_normal((3000, 64)).astype(np.float32)
    assert reference.rel_error(mod(X), A.astype(np.float64) @ X) < 1e-5


def test_quick_selection_rejects_a_wrong_candidate(monkeypatch):
    A = random_matrix(200, 150, density=0.03, seed=8)
    sop = make_op(A, "spmm", 16, "sum", "float32")
    real = select.build_from_config

    class Wrong:
        def __init__(self, m):
            self._m, self.config = m, m.config

        def __call__(self, *ins, out):
            self._m(*ins, out=out)
            out[0, 0] += 1e3   # a wrong result, faster than anything
            return out

    monkeypatch.setattr(select, "build_from_config",
                        lambda op, c, ctx=None, module=None: (Wrong if c.template == "cpu.csr_spmm" else (lambda m: m))(
                            real(op, c, ctx, module=module)))
    from spcompile.compile import default_config

    mod, info = select.quick_select(sop, "cpu", [(default_config(sop, "cpu"), None)], budget_s=0.5)
    assert mod.config.template == "extern.scipy"
    bad = [r for r in info["candidates"] if r["template"] == "cpu.csr_spmm"][0]
    assert "differs from the reference" in bad["error"]


def test_quick_selection_times_the_extra_candidates_under_their_own_label():
    A = random_matrix(300, 300, density=0.03, seed=9)
    sop = make_op(A, "spmm", 16, "sum", "float32")
    from spcompile.compile import default_config

    dflt = default_config(sop, "cpu")
    other = get_template_config(sop, dflt)
    mod, info = select.quick_select(sop, "cpu", [(dflt, None)], budget_s=2.0, vendor=False,
                                    extra=[("model (float32 shape)", other, None)])
    rows = {r["source"]: r for r in info["candidates"]}
    assert set(rows) == {"model", "model (float32 shape)"}
    assert rows["model (float32 shape)"]["params"] == dict(other.params) and "kernel_ms" in rows["model (float32 shape)"]
    fastest = min(info["candidates"], key=lambda r: r["kernel_ms"])
    assert info["chosen"] == fastest["source"] and dict(mod.config.params) == fastest["params"]


def test_quick_selection_times_close_candidates_again(monkeypatch):
    """Candidates within FINALIST_MARGIN of the fastest are timed FINALIST_ROUNDS more times, in
    turn, and the fastest median wins: one slow first timing (a GPU still clocking up) does not
    decide; a candidate far behind is not timed again."""
    A = random_matrix(300, 300, density=0.03, seed=9)
    sop = make_op(A, "spmm", 16, "sum", "float32")
    from spcompile.compile import default_config

    dflt = default_config(sop, "cpu")
    other = get_template_config(sop, dflt)
    # timing order: model, extra, vendor; then the two finalists (model, vendor), twice in turn
    script = iter([1.2e-3, 3.0e-3, 1.0e-3, 0.8e-3, 1.0e-3, 0.8e-3, 1.0e-3])
    calls = []

    class ScriptedTimer:
        def __init__(self, *a, **k):
            pass

        def time(self, fn, n_sets=1, **k):
            fn(0)
            calls.append(1)
            return type("T", (), {"seconds": next(script)})()

    monkeypatch.setattr(select, "Timer", ScriptedTimer)
    mod, info = select.quick_select(sop, "cpu", [(dflt, None)], budget_s=5.0,
                                    extra=[("slow", other, None)])
    rows = {r["source"]: r for r in info["candidates"]}
    assert len(calls) == 3 + 2 * select.FINALIST_ROUNDS
    assert info["chosen"] == "model" and mod.config.template == dflt.template      # 0.8 (median) < 1.0
    assert rows["model"]["timings_ms"] == pytest.approx([1.2, 0.8, 0.8]) and rows["model"]["kernel_ms"] == pytest.approx(0.8)
    assert rows["vendor"]["kernel_ms"] == pytest.approx(1.0) and "timings_ms" not in rows["slow"]
    assert info["expected_speedup"] == pytest.approx(1.0 / 0.8)
    # one candidate timed: no second round
    calls.clear()
    script = iter([1.0e-3])
    mod, info = select.quick_select(sop, "cpu", [(dflt, None)], budget_s=5.0, vendor=False)
    assert len(calls) == 1 and "timings_ms" not in info["candidates"][0]


def get_template_config(sop, dflt):
    """A second valid CPU config: the default with its loop parallelism flipped."""
    from spcompile.kernels import get_template

    tpl = get_template(dflt.template)
    return tpl.make_config({**dict(dflt.params), "parallel": not dflt.params["parallel"]}, dflt.pipeline, "cpu", sop.dtype)


def _recorded_quick_selection(monkeypatch, graph):
    """A shared graph, the dict that a stand-in ``quick_select`` fills with what ``decide`` handed
    it (the ranked configs and the keyword arguments, ``extra`` among them; it measures nothing),
    and ``decide_held_out(op, K, ...)``: ``decide`` on the graph for CUDA with the graph's own
    records left out of the sm_90 model."""
    from conftest import load_graph

    A = load_graph(graph)
    monkeypatch.setattr(kn, "_arch", lambda t: "sm_90")
    seen = {}

    def fake_quick(sop, target, ranked, **kw):
        seen.update(kw, ranked=ranked)
        return None, {"error": "not measured here"}

    monkeypatch.setattr(select, "quick_select", fake_quick)

    def decide_held_out(*op_args):
        with kn.excluded(A):
            return decide(make_op(A, *op_args), "cuda")

    return A, seen, decide_held_out


def test_build_offers_the_float32_shape_to_16bit_inputs(monkeypatch, no_tuning_db):
    """A graph with one row of 1463 entries among rows of about 9 (ss_hangglider_2): its float32
    winner keeps eight loads in flight ('u8'), a shape the float16 portfolio never measured.
    Quick selection at float16 (graph held out of the model) must measure it beside the model's
    own choices, under its own label."""
    A, seen, decide_held_out = _recorded_quick_selection(monkeypatch, "ss_hangglider_2")
    cfg, info, mod = decide_held_out("spmm", 128, "sum", "float16")
    extra = seen["extra"]
    srcs = [src for src, _, _ in extra]      # besides: the model's variants (min_blocks on sparse rows, RCM)
    assert srcs.count("model (float32 shape)") == 1 and \
        set(srcs) <= {"model (float32 shape)", "model (variant)", "model (native order)", "model (locality order)"}
    c = extra[srcs.index("model (float32 shape)")][1]
    assert c.template == "csr.crc_cwm" and c.params["unroll"] == 8
    assert all(r.params.get("unroll") != 8 for r, _ in seen["ranked"] if r.template == "csr.crc_cwm")
    assert info["source"] == "model" and info["quick_error"] == "not measured here"


def test_decide_reports_where_the_decision_came_from(no_tuning_db):
    A = random_matrix(100, 100, density=0.05, seed=1)
    sop = make_op(A, "spmm", 8, "max", "float32")
    cfg, info, mod = decide(sop, "cpu")
    assert info["source"] == "heuristic" and mod is None     # no vendor max, no CPU knowledge
    cfg, info, mod = decide(make_op(A, "spmm", 8, "sum", "float32"), "cpu")
    assert info["source"] == "quick" and mod is not None and mod.config == cfg


def test_call_values_builds_only_templates_that_read_values_per_call(no_tuning_db):
    from spcompile.kernels import get_template

    A = random_matrix(300, 300, density=0.03, seed=6)
    mod = spcompile.build(A, "spmm", 16, target="cpu", call_values=True)
    assert get_template(mod.config.template).call_values_array is not None
    cands = mod.tuning.get("candidates", [])
    assert all(get_template(r["template"]).call_values_array is not None for r in cands)
    # the CPU's library takes the values, so it stays a candidate (cuSPARSE would not)
    assert any(r["source"] == "vendor" and r["template"] == "extern.scipy" for r in cands)
    v = np.random.default_rng(0).standard_normal(A.nnz).astype(np.float32)
    X = np.random.default_rng(1).standard_normal((300, 16)).astype(np.float32)
    B = A.copy()
    B.data[:] = v
    assert reference.rel_error(mod(X, values=v), B.astype(np.float64) @ X) < 1e-5


def test_build_offers_the_flat_sddmm_variant_of_the_models_choice(monkeypatch, no_tuning_db):
    """The shipped SDDMM portfolio measured one-row segments of one entry in flight a group only;
    quick selection measures the model's first csr.sddmm choice again with several entries in
    flight (unroll), with nonzero-parallel (flat) segments and with both, under its own label,
    beside the model's ranking (which has neither)."""
    A, seen, decide_held_out = _recorded_quick_selection(monkeypatch, "cora")
    cfg, info, mod = decide_held_out("sddmm", 64)
    variants = [c for src, c, _ in seen["extra"] if src == "model (variant)"]
    assert len(variants) == 3
    first = next(r for r, _ in seen["ranked"] if r.template == "csr.sddmm")
    assert all(v.template == "csr.sddmm" and v.pipeline == first.pipeline for v in variants)
    from spcompile.kernels import get_template

    u = get_template("csr.sddmm").entries_in_flight(first.params)
    flat = {**dict(first.params), "flat": 1, "nnz_per_warp": 32}
    assert [dict(v.params) for v in variants] == [{**dict(first.params), "unroll": u}, flat, {**flat, "unroll": u}]
    assert all(not r.params.get("flat") and r.params.get("unroll", 1) == 1
               for r, _ in seen["ranked"] if r.template == "csr.sddmm")
    # a SpMM decision on cora (rows of 3.9 entries on average, up to 168) offers csr.crc_cwm's
    # full-occupancy variant of the model's choice and its staged stream (tiny rows), no flat=1
    # one (a row longer than 32)
    seen.clear()
    decide_held_out("spmm", 64)
    variants = [c for src, c, _ in seen["extra"] if src == "model (variant)"]
    first = next(r for r, _ in seen["ranked"] if r.template == "csr.crc_cwm")
    assert [v.template for v in variants] == ["csr.crc_cwm"] * 2
    assert dict(variants[0].params) == {**dict(first.params), "cf": 1, "min_blocks": 8, "unroll": 1}
    from spcompile.kernels import get_template

    tpl = get_template("csr.crc_cwm")
    assert dict(variants[1].params) == {**{k: x for k, x in first.params.items() if k not in ("warp_combine", "combine_vals")},
                                        **tpl.STAGED}


def test_native_order_variants_of_a_degree_ordered_choice():
    """A template's first-ranked config on a load-balancing order only (reorder.degree) is also
    offered on the matrix's own order, with its template's variants; configs on other pipelines,
    later-ranked configs of the same template and formats that need a pass are not."""
    from spcompile.compile import default_config
    from spcompile.kernels import get_template
    import scipy.sparse as sp

    ring = sp.diags([1.0, 1.0, 1.0], [-1, 0, 1], shape=(400, 400), format="csr", dtype=np.float32)
    op = make_op(ring, "spmm", 64)
    crc = get_template("csr.crc_cwm")
    p = crc.heuristic(64, 3, 3.0)
    deg = crc.make_config(p, kn._PIPES["degree"], "cuda")
    rcm = crc.make_config(p, kn._PIPES["rcm"], "cuda")
    got = kn.native_order_variants([(deg, 1.2), (rcm, 1.1)], "cuda", "float32", op)
    want = [p] + crc.unranked_variants(p, op)
    assert len(want) >= 2 and [dict(c.params) for c in got] == want
    assert all(c.template == "csr.crc_cwm" and c.pipeline == () for c in got)
    assert kn.native_order_variants([(rcm, 1.2), (deg, 1.1)], "cuda", "float32", op) == []
    sgt = get_template("tc.wmma_sgt")
    tc = sgt.make_config(sgt.default_params(spcompile.SparseModule.from_op(op)), kn._PIPES["degree"], "cuda")
    assert kn.native_order_variants([(tc, 1.3)], "cuda", "float32", op) == []
    cpu = default_config(op, "cpu")
    assert kn.native_order_variants([(cpu, None)], "cpu", "float32", op) == []     # no pipeline


def test_build_measures_the_native_order_of_a_degree_ordered_choice(monkeypatch, no_tuning_db):
    """tu_dd (a batch of small graphs, rows of at most 19 entries) held out of the model: its
    first choice runs on degree order at K=64, so quick selection also measures that choice and
    its variants on the stored order, under their own label."""
    A, seen, decide_held_out = _recorded_quick_selection(monkeypatch, "tu_dd")
    decide_held_out("spmm", 64)
    first = seen["ranked"][0][0]
    assert [p["name"] for p in first.pipeline] == ["reorder.degree"]
    native = [c for src, c, _ in seen["extra"] if src == "model (native order)"]
    variants = [c for src, c, _ in seen["extra"] if src == "model (variant)"]
    assert native and all(c.pipeline == () for c in native)
    assert dict(native[0].params) == dict(first.params)
    assert [dict(c.params) for c in native[1:]] == [dict(c.params) for c in variants if c.pipeline == first.pipeline]


def test_locality_order_variants_on_sparse_rows():
    """csr.sddmm's and csr.crc_cwm's first-ranked configs (and their unranked variants) are also
    offered on RCM when rows are sparse (mean at most RCM_MAX_MEAN); not when rows are longer,
    not when the first choice already runs on RCM."""
    from spcompile.kernels import get_template
    import scipy.sparse as sp

    sdd = get_template("csr.sddmm")
    ring = sp.diags([1.0, 1.0, 1.0], [-1, 0, 1], shape=(400, 400), format="csr", dtype=np.float32)
    op = make_op(ring, "sddmm", 64, None, "float32")
    p = sdd.heuristic(64)
    deg = sdd.make_config(p, kn._PIPES["degree"], "cuda")
    none = sdd.make_config({**p, "nnz_per_warp": 8}, kn._PIPES["none"], "cuda")
    got = kn.locality_order_variants([(deg, 1.2), (none, 1.1)], "cuda", "float32", op)
    assert [dict(c.params) for c in got] == [p] + sdd.unranked_variants(p, op)
    assert len(got) == 4 and all(list(c.pipeline) == list(kn._PIPES["rcm"]) for c in got)
    rcm = sdd.make_config(p, kn._PIPES["rcm"], "cuda")
    assert kn.locality_order_variants([(rcm, 1.2)], "cuda", "float32", op) == []
    dense = make_op(random_matrix(200, 200, density=0.2, seed=2), "sddmm", 64, None, "float32")
    assert float(dense.A.row_lengths.mean()) > sdd.RCM_MAX_MEAN
    assert kn.locality_order_variants([(deg, 1.2)], "cuda", "float32", dense) == []
    assert kn.locality_order_variants([(deg, 1.2)], "cuda", "float32", None) == []
    # csr.crc_cwm (SpMM) the same: its first choice and unranked variants (here the flat layout of
    # short rows, the full-occupancy one of sparse rows, the staged stream of tiny ones and ELL
    # rows, in two column shapes) on RCM, for sparse rows only
    crc = get_template("csr.crc_cwm")
    sop = make_op(ring, "spmm", 64)
    q = crc.heuristic(64, 3, 3.0)
    got = kn.locality_order_variants([(crc.make_config(q, kn._PIPES["degree"], "cuda"), 1.2)], "cuda", "float32", sop)
    assert [dict(c.params) for c in got] == [q] + crc.unranked_variants(q, sop)
    assert len(got) == 6 and all(list(c.pipeline) == list(kn._PIPES["rcm"]) for c in got)
    assert [c.params.get("flat") for c in got[1:]] == [1, None, 2, 4, 4]
    assert crc.RCM_MAX_MEAN == sdd.RCM_MAX_MEAN
    dense_spmm = make_op(random_matrix(200, 200, density=0.2, seed=2), "spmm", 64)
    assert kn.locality_order_variants([(crc.make_config(q, kn._PIPES["degree"], "cuda"), 1.2)], "cuda", "float32",
                                      dense_spmm) == []


@pytest.mark.parametrize("op_args, template", [(("sddmm", 256, None, "float32"), "csr.sddmm"),
                                               (("spmm", 128, "sum", "float32"), "csr.crc_cwm"),
                                               (("spmm", 64, "sum", "float16"), "csr.crc_cwm")])
def test_build_measures_on_rcm_for_sparse_rows(monkeypatch, no_tuning_db, op_args, template):
    """dimacs10_wing (a mesh, rows of at most 4 entries) held out of the model: quick selection
    measures its first choice of the CSR template on RCM as well, under its own label (SpMM: the
    model's stored order missed the tuned module's RCM, 40.8 against 32.5 us on the H100 at fp32
    K=128); fb100_mit8 (78 entries a row on average) gets no such candidate."""
    A, seen, decide_held_out = _recorded_quick_selection(monkeypatch, "dimacs10_wing")
    decide_held_out(*op_args)
    first = next(c for c, _ in seen["ranked"] if c.template == template)
    loc = [c for src, c, _ in seen["extra"] if src == "model (locality order)" and c.template == template]
    assert [p["name"] for p in first.pipeline] != ["reorder.rcm"]
    assert loc and all([p["name"] for p in c.pipeline] == ["reorder.rcm"] for c in loc)
    assert dict(loc[0].params) == dict(first.params)
    A, seen, decide_held_out = _recorded_quick_selection(monkeypatch, "fb100_mit8")
    decide_held_out(*op_args)
    assert not [c for src, c, _ in seen["extra"] if src == "model (locality order)"]


def test_quick_selection_times_over_three_input_sets(monkeypatch, timed_sets):
    """Quick selection times each candidate rotating over N_INPUT_SETS input sets with one output
    per set, as the tuner's runner does (one set keeps X hot in L2 on a graph whose X fits there
    once); results are checked on the first set."""
    A = random_matrix(250, 180, density=0.04, seed=11)
    sop = make_op(A, "spmm", 12, "sum", "float32")
    from spcompile.compile import default_config

    seen = []

    class Recording:
        def __init__(self, m):
            self._m, self.config = m, m.config

        def __call__(self, X, out):
            seen.append((X.ctypes.data, out.ctypes.data))
            return self._m(X, out=out)

    real = select.build_from_config
    monkeypatch.setattr(select, "build_from_config",
                        lambda op, c, ctx=None, module=None: Recording(real(op, c, ctx, module=module)))
    mod, info = select.quick_select(sop, "cpu", [(default_config(sop, "cpu"), None)], budget_s=0.5, vendor=False)
    assert select.N_INPUT_SETS == 3 and timed_sets and set(timed_sets) == {3}
    pairs = set(seen)
    assert len({x for x, _ in pairs}) == 3 and len({o for _, o in pairs}) == 3 and len(pairs) == 3
    assert info["candidates"][0]["kernel_ms"] > 0
    # the inputs: independent draws, the first one (the checked one) also on the host
    host, ins, outs, *_ = select._framework_inputs(sop, "cpu")
    assert len(ins) == len(outs) == 3
    assert np.array_equal(ins[0][0], host[0]) and not np.array_equal(ins[0][0], ins[1][0])


def test_quick_selection_input_sets_fit_the_free_memory():
    sop = make_op(random_matrix(100, 80, density=0.05, seed=3), "spmm", 16, "sum", "float32")
    first = select.make_inputs(sop, 1, seed=1)[0]
    per_set = (80 * 16 + 100 * 16) * 4
    frac = select.SETS_MEMORY_FRACTION
    assert select._sets_that_fit(first, sop, int(10 * per_set / frac), 3) == 3
    assert select._sets_that_fit(first, sop, int(2 * per_set / frac), 3) == 2
    assert select._sets_that_fit(first, sop, int(1.5 * per_set / frac), 3) == 1
    assert select._sets_that_fit(first, sop, 0, 3) == 1
    assert select._sets_that_fit(first, sop, int(10 * per_set / frac), 2) == 2
    half = make_op(random_matrix(100, 80, density=0.05, seed=3), "spmm", 16, "sum", "bfloat16")
    assert select._sets_that_fit(first, half, int(2 * per_set / 2 / frac), 3) == 2


def test_pick_candidates_adds_only_those_behind_known_or_cheap_pipelines():
    """Quick selection's candidates: the model's first n, then up to ``more`` of the next whose
    pipeline one of the first already needs, or that run only cheap passes (a degree sort): a
    new RCM run (seconds on a 25M-entry graph) is not paid for a lower-ranked candidate."""
    items = [("a", "P1", ["reorder.rcm"]), ("b", "P0", []), ("c", "P1", ["reorder.rcm"]),
             ("d", "P2", ["reorder.rcm", "cluster.lsh"]), ("e", "P0", []), ("f", "P3", ["reorder.degree"]),
             ("g", "P1", ["reorder.rcm"]), ("h", "P4", None)]
    of = lambda x: (x[1], x[2])  # noqa: E731
    assert [x[0] for x in select.pick_candidates(items, 3, 2, of)] == ["a", "b", "c", "e", "f"]
    assert [x[0] for x in select.pick_candidates(items, 3, 3, of)] == ["a", "b", "c", "e", "f", "g"]
    assert [x[0] for x in select.pick_candidates(items, 3, 0, of)] == ["a", "b", "c"]
    assert [x[0] for x in select.pick_candidates(items, 1, 9, of)] == ["a", "b", "c", "e", "f", "g"]
    assert [x[0] for x in select.pick_candidates(items[:2], 3, 2, of)] == ["a", "b"]
    assert "reorder.degree" in select.CHEAP_PASSES and "reorder.rcm" not in select.CHEAP_PASSES


def test_quick_selection_measures_the_next_candidates_behind_known_pipelines():
    A = random_matrix(300, 300, density=0.03, seed=12)
    sop = make_op(A, "spmm", 16, "sum", "float32")
    from spcompile.compile import default_config
    from spcompile.kernels import get_template

    d = default_config(sop, "cpu")
    tpl = get_template(d.template)

    def cfg(pipe, parallel):
        return tpl.make_config({**dict(d.params), "parallel": parallel}, pipe, "cpu", sop.dtype)

    rcm = [{"name": "reorder.rcm", "options": {}}]
    deg = [{"name": "reorder.degree", "options": {}}]
    ranked = [(cfg([], False), None), (cfg(deg, False), None), (cfg([], True), None),
              (cfg(rcm, False), None), (cfg(deg, True), None), (cfg(rcm, True), None)]
    mod, info = select.quick_select(sop, "cpu", ranked, budget_s=5.0, vendor=False)
    seen = [(r["pipeline"], r["params"]["parallel"]) for r in info["candidates"]]
    assert seen == [([], False), (["reorder.degree"], False), ([], True), (["reorder.degree"], True)]
    assert all("kernel_ms" in r for r in info["candidates"])
    # with the first three asking for RCM, the RCM candidates further down are measured too
    ranked2 = [ranked[3], ranked[0], ranked[1], ranked[2], ranked[5]]
    mod, info = select.quick_select(sop, "cpu", ranked2, budget_s=5.0, vendor=False)
    assert [(r["pipeline"], r["params"]["parallel"]) for r in info["candidates"]] == [
        (["reorder.rcm"], False), ([], False), (["reorder.degree"], False), ([], True), (["reorder.rcm"], True)]


def test_probe_ids_are_the_templates_probe_variants(shipped):
    """The second round the cross-validation scores (portfolio ids) is the one quick selection
    measures (the template's ``probe_variants`` of the member's parameters), for every csr.crc_cwm
    member of the fp32 and fp16 SpMM portfolios at K = 64 / 256."""
    from spcompile.kernels import get_template

    A = random_matrix(200, 200, density=0.05, seed=4)
    for dt in ("float32", "float16"):
        for K in (64, 256):
            sop = make_op(A, "spmm", K, "sum", dt)
            members = kn.portfolio("spmm", "sum", dt)
            for cid in members:
                cfg = kn.candidate_config(cid, sop)
                if cfg.template != "csr.crc_cwm":
                    assert kn.probe_ids(cid) == []
                    continue
                tpl = get_template(cfg.template)
                near = tpl.probe_variants(dict(cfg.params), sop)
                # the capped split-row combine is not a portfolio member: measured by quick
                # selection, not scored by the cross-validation (16-bit, unroll x vec > 16 only),
                cap = tpl.capped_combine(dict(cfg.params), sop)
                assert (cap in near) == (cap is not None) and (cap is None or dt == "float16"), cid
                capped = [p for p in near if int(p.get("combine_vals", 0))]
                assert all(tpl.capped_combine({**p, "combine_vals": 0}, sop) == p for p in capped), cid
                assert not capped or dt == "float16", cid
                # nor is the 16-rows-in-flight kernel (one column slice a lane; fp32 slices of at
                # least 128 entries)
                deep = tpl.deep_unroll(dict(cfg.params), sop)
                assert (deep in near) == (deep is not None), cid
                assert deep is None or int(deep["max_seg"]) in (0, int(cfg.params["max_seg"])) or (
                    dt == "float32" and int(deep["max_seg"]) == tpl.DEEP_MAX_SEG_FP32 > int(cfg.params["max_seg"])), cid
                # nor are the warp-reduced slices of hub rows (rows of at least 32 / group slices)
                wc = [p for p in near if int(p.get("warp_combine", 0))]
                assert all(int(p["warp_combine"]) == 1 for p in wc), cid
                want = sorted(json.dumps(p, sort_keys=True) for p in near
                              if p not in capped and p != deep and p not in wc)
                got = sorted(json.dumps(dict(kn.candidate_config(c, sop).params), sort_keys=True)
                             for c in kn.probe_ids(cid))
                assert got == want, cid
                assert set(kn.probe_ids(cid)) <= set(members) or dt == "float16"


def test_quick_selection_second_round_measures_the_leaders_neighbours(monkeypatch):
    """After the first round, quick selection measures the fastest candidate's ``probe_variants``
    on its pipeline (source "probe", checked and timed like the others); PROBE=False or
    probe=False leaves them out, as does a template without neighbours."""
    A = random_matrix(300, 300, density=0.03, seed=12)
    sop = make_op(A, "spmm", 16, "sum", "float32")
    from spcompile.compile import default_config
    from spcompile.kernels import get_template

    d = default_config(sop, "cpu")
    tpl = get_template(d.template)
    deg = [{"name": "reorder.degree", "options": {}}]
    lead = tpl.make_config({**dict(d.params), "parallel": False}, deg, "cpu", sop.dtype)
    asked = []

    def neighbours(params, op=None):
        asked.append(dict(params))
        return [{**dict(params), "parallel": not params["parallel"]}, dict(params)]   # the second: the lead

    monkeypatch.setattr(type(tpl), "probe_variants", lambda self, params, op=None: neighbours(params, op))
    mod, info = select.quick_select(sop, "cpu", [(lead, None)], budget_s=5.0, vendor=False)
    assert asked == [dict(lead.params)]
    rows = info["candidates"]
    assert [(r["source"], r["pipeline"], r["params"]["parallel"]) for r in rows] == [
        ("model", ["reorder.degree"], False), ("probe", ["reorder.degree"], True)]
    assert all("kernel_ms" in r for r in rows)
    assert mod is not None and info["chosen"] in ("model", "probe")
    assert 0 < info["second_round_s"] <= info["measure_s"]
    # two leads (within PROBE_MARGIN of each other): the neighbours of both
    other = tpl.make_config({**dict(d.params), "parallel": True}, [], "cpu", sop.dtype)
    asked.clear()
    monkeypatch.setattr(select, "PROBE_MARGIN", 1e9)
    _, info = select.quick_select(sop, "cpu", [(lead, None), (other, None)], budget_s=5.0, vendor=False)
    assert sorted(json.dumps(a, sort_keys=True) for a in asked) == sorted(
        json.dumps(dict(c.params), sort_keys=True) for c in (lead, other))
    assert {tuple(r["pipeline"]) for r in info["candidates"] if r["source"] == "probe"} == {("reorder.degree",), ()}
    monkeypatch.setattr(select, "PROBE_LEADS", 1)
    _, info = select.quick_select(sop, "cpu", [(lead, None), (other, None)], budget_s=5.0, vendor=False)
    assert len({tuple(r["pipeline"]) for r in info["candidates"] if r["source"] == "probe"}) == 1
    for off in ({"probe": False}, {}):
        if not off:
            monkeypatch.setattr(select, "PROBE", False)
        _, info = select.quick_select(sop, "cpu", [(lead, None)], budget_s=5.0, vendor=False, **off)
        assert [r["source"] for r in info["candidates"]] == ["model"]


def test_second_round_builds_do_not_spend_the_budget(monkeypatch):
    """Building the second round (nvcc on a cold kernel cache) is not measurement: neighbours
    whose build outlasts the whole budget are still checked and timed, not skipped."""
    import time as _time

    from spcompile.compile import default_config
    from spcompile.kernels import get_template

    sop = make_op(random_matrix(300, 300, density=0.03, seed=12), "spmm", 16, "sum", "float32")
    d = default_config(sop, "cpu")
    tpl = get_template(d.template)
    lead = tpl.make_config({**dict(d.params), "parallel": False}, [], "cpu", sop.dtype)
    monkeypatch.setattr(type(tpl), "probe_variants",
                        lambda self, params, op=None: [{**dict(params), "parallel": not params["parallel"]}])
    real = select.build_from_config

    def slow(op, c, ctx=None, module=None):
        if c.params["parallel"]:
            _time.sleep(0.6)                                     # a compile of the neighbour
        return real(op, c, ctx, module=module)

    monkeypatch.setattr(select, "build_from_config", slow)
    _, info = select.quick_select(sop, "cpu", [(lead, None)], budget_s=0.3, vendor=False)
    rows = info["candidates"]
    assert [r["source"] for r in rows] == ["model", "probe"]
    assert "skipped" not in rows[1] and rows[1]["kernel_ms"] > 0
    assert info["second_round_s"] >= 0.6


def test_quick_selection_runs_a_shared_pipeline_prefix_once(monkeypatch):
    """Candidates on RCM alone and on RCM followed by another pass: quick selection runs RCM once
    (the longer pipeline continues from the shorter one's module, in either order), and each
    candidate's module is the one its whole pipeline gives."""
    from spcompile.compile import default_config
    from spcompile.kernels import get_template
    from spcompile.passes.reorder_simple import RCMReorder

    sop = make_op(random_matrix(300, 300, density=0.03, seed=12), "spmm", 16, "sum", "float32")
    d = default_config(sop, "cpu")
    tpl = get_template(d.template)
    rcm = [{"name": "reorder.rcm", "options": {}}]
    both = rcm + [{"name": "reorder.degree", "options": {}}]
    calls = []
    real = RCMReorder.transform
    monkeypatch.setattr(RCMReorder, "transform", lambda self, mod, ctx: calls.append(1) or real(self, mod, ctx))
    for first, second in ((both, rcm), (rcm, both)):
        calls.clear()
        cands = [(tpl.make_config(dict(d.params), p, "cpu", sop.dtype), None) for p in (first, second)]
        mod, info = select.quick_select(sop, "cpu", cands, budget_s=5.0, vendor=False, probe=False)
        rows = info["candidates"]
        assert len(calls) == 1 and len(rows) == 2 and all("kernel_ms" in r for r in rows)
        assert [r["pipeline"] for r in rows] == [[p["name"] for p in first], [p["name"] for p in second]]
        log = [r["name"] if isinstance(r, dict) else r.name for r in mod.pass_log]
        assert log == [p["name"] for p in mod.config.pipeline]


def test_crc_cwm_probe_variants():
    """csr.crc_cwm's second-round neighbours: max_seg one step shorter and longer in
    PROBE_MAX_SEG (0, whole rows, is the longest), the other block shapes at the same max_seg;
    none next to a flat or launch-bounded parameter set; every one valid for the template."""
    from spcompile.core.ir import SparseModule
    from spcompile.kernels import get_template

    t = get_template("csr.crc_cwm")
    sop = make_op(random_matrix(200, 200, density=0.05, seed=4), "spmm", 128, "sum", "float32")
    mod = SparseModule.from_op(sop)
    base = {**t.default_params(mod), "max_seg": 64, **t.shape_params("u2", 1)}
    assert base["group"] == 32 and base["warps_per_block"] == 4
    got = t.probe_variants(base, sop)
    # a row of 200 > 3 x 64 entries: the block's 4 warps combine its slices, last (twice as long too)
    assert got[-2:] == [{**base, "warp_combine": 1}, {**base, "warp_combine": 1, "max_seg": 128}]
    got = got[:-2]
    assert [p["max_seg"] for p in got[:2]] == [32, 256]
    assert {(p["warps_per_block"], p["rows_per_warp"], p["unroll"]) for p in got[2:]} == {(4, 1, 8), (8, 2, 2)}
    assert all(p["max_seg"] == 64 for p in got[2:]) and base not in got and len(got) == 4
    assert [p["max_seg"] for p in t.probe_variants({**base, "max_seg": 0}, sop)][:1] == [256]
    assert [p["max_seg"] for p in t.probe_variants({**base, "max_seg": 16}, sop)][:1] == [32]
    assert [p["max_seg"] for p in t.probe_variants({**base, "max_seg": 1024}, sop)] == [1024, 1024]   # shapes only
    assert t.probe_variants({**base, "flat": 1}, sop) == []
    assert t.probe_variants({**base, "min_blocks": 8}, sop) == []
    for p in got:
        t.check_params(mod, p)
    # 16-bit X / Y: also the capped split-row combine, where unroll x vec > 16 values a lane
    hop = make_op(random_matrix(200, 200, density=0.05, seed=4), "spmm", 64, "sum", "float16")
    hmod = SparseModule.from_op(hop)
    u8 = {**t.default_params(hmod), "max_seg": 64, **t.shape_params("u8", 1)}
    assert u8["vec"] == 8 and u8["unroll"] == 8
    def near(p):
        return [v for v in t.probe_variants(p, hop) if not v.get("warp_combine")]

    assert near(u8)[-2] == {**u8, "combine_vals": 16} == t.capped_combine(u8, hop)
    t.check_params(hmod, {**u8, "combine_vals": 16})
    # ... and the u8 shape with 16 rows in flight a lane (its combine always capped), last
    u16 = {**u8, "unroll": 16}
    assert near(u8)[-1] == u16 == t.deep_unroll(u8, hop) == t.deep_unroll({**u8, "combine_vals": 16}, hop)
    t.check_params(hmod, u16)
    assert t.deep_unroll(u16, hop) is None and t.capped_combine(u16, hop) is None
    assert t.deep_unroll({**u8, "cf": 2}, hop) is None                                      # cf 2
    # fp32 K=64 (16-lane groups): the same, with split rows cut into slices of at least 128
    fop = make_op(random_matrix(200, 200, density=0.05, seed=4), "spmm", 64, "sum", "float32")
    fmod = SparseModule.from_op(fop)
    f8 = {**t.default_params(fmod), "max_seg": 64, **t.shape_params("u8", 1)}
    assert f8["vec"] == 4 and f8["group"] == 16
    assert t.deep_unroll(f8, fop) == {**f8, "unroll": 16, "max_seg": 128}
    assert t.deep_unroll({**f8, "max_seg": 256}, fop) == {**f8, "unroll": 16, "max_seg": 256}
    assert t.deep_unroll({**f8, "max_seg": 0}, fop) == {**f8, "unroll": 16, "max_seg": 0}
    assert t.deep_unroll(base, sop) is None                                  # 32-lane groups
    assert {**f8, "unroll": 16, "max_seg": 128} in t.probe_variants(f8, fop)
    t.check_params(fmod, t.deep_unroll(f8, fop))
    assert t.deep_unroll({**u8, "group": 16}, hop) == {**u8, "group": 16, "unroll": 16}
    assert t.deep_unroll({**u8, "group": 32}, hop) is None                                  # K=256 rows
    assert all(p["unroll"] != 16 for p in got)                     # 32-lane groups: never
    u2 = {**u8, **t.shape_params("u2", 1)}                       # 2 x 8 values: nothing to cap
    assert t.capped_combine(u2, hop) is None
    # ... but its u8 neighbour is measured capped as well (and only that one)
    assert [p for p in near(u2) if "combine_vals" in p] == [{**u8, "combine_vals": 16}]
    w8 = {**u8, **t.shape_params("w8r2", 1)}
    assert [p for p in near(w8) if "combine_vals" in p] == [{**u8, "combine_vals": 16}]
    # the capped lead and its capped u8 neighbour are one variant, measured once
    assert sum("combine_vals" in p for p in near(u8)) == 1
    assert t.capped_combine({**u8, "combine_vals": 16}, hop) is None
    assert t.capped_combine(u8, make_op(random_matrix(50, 50, density=0.1, seed=1), "spmm", 64, "sum",
                                        "float32")) is None and t.capped_combine(u8, None) is None
    assert all("combine_vals" not in p for p in got)             # fp32: never
    with pytest.raises(ValueError, match="combine_vals"):
        t.build(hmod, {**u8, "combine_vals": 8}, compile=False)
    with pytest.raises(ValueError, match="shape"):
        t.shape_params("u4", 1)


def test_probe_leads():
    """The second round's leads: the fastest, and up to PROBE_LEADS in all within PROBE_MARGIN."""
    t = {"a": 1.0, "b": 1.04, "c": 1.2, "d": 1.01}
    assert select.probe_leads(t, 2, 1.05) == ["a", "d"]
    assert select.probe_leads(t, 3, 1.05) == ["a", "d", "b"]
    assert select.probe_leads(t, 1, 1.05) == ["a"]
    assert select.probe_leads(t, 3, 1.0) == ["a"]
    assert select.probe_leads({}, 2, 1.05) == []
    assert select.probe_leads(t) == ["a", "d"][:select.PROBE_LEADS]
    # a key with no neighbours to measure (a template without probe variants, a staged kernel)
    # takes no lead's place, and the margin counts from the fastest key that has neighbours: one
    # without that wins by more than the margin does not stop the second round
    has = lambda k: k != "a"                                                          # noqa: E731
    assert select.probe_leads(t, 2, 1.05, probed=has) == ["d", "b"]
    assert select.probe_leads(t, 2, 1.02, probed=has) == ["d"]
    assert select.probe_leads({"a": 1.0, "c": 1.2}, 2, 1.05, probed=has) == ["c"]
    assert select.probe_leads({"a": 1.0, "c": 1.2, "e": 1.25}, 2, 1.05, probed=has) == ["c", "e"]
    assert select.probe_leads({"a": 1.0}, 2, 1.05, probed=has) == []


def test_second_round_lead_without_neighbours_takes_no_place(monkeypatch):
    """A first-round candidate whose template offers no neighbours (probe_variants empty) takes
    no lead's place in the second round: with one lead, whichever of two near-equal candidates
    is faster, the neighbours measured are those of the one that has some (on the GPU a
    tensor-core reuse candidate 0.7% ahead of two csr.crc_cwm leads had halved the neighbours
    measured on ss_bcsstk25_pattern at K=64).  One without neighbours that wins by far still
    leaves the second round to the one with (the margin counts from it).  With none that has
    neighbours, nothing is probed."""
    from spcompile.compile import default_config
    from spcompile.kernels import get_template

    sop = make_op(random_matrix(300, 300, density=0.03, seed=12), "spmm", 16, "sum", "float32")
    d = default_config(sop, "cpu")
    tpl = get_template(d.template)
    bare = tpl.make_config({**dict(d.params), "parallel": False}, [{"name": "reorder.degree", "options": {}}], "cpu",
                           sop.dtype)
    rich = tpl.make_config({**dict(d.params), "parallel": True}, [], "cpu", sop.dtype)
    # only the parallel=True parameter set has a neighbour (itself with another prefetch)
    monkeypatch.setattr(type(tpl), "probe_variants", lambda self, params, op=None: (
        [{**dict(params), "prefetch": 8 if params.get("prefetch") != 8 else 16}] if params["parallel"] else []))
    monkeypatch.setattr(select, "PROBE_MARGIN", 1e9)
    monkeypatch.setattr(select, "PROBE_LEADS", 1)

    class Ordered:
        """Times in call order: the first candidate timed is the fastest."""
        n = 0

        def __init__(self, *a, **k):
            pass

        def time(self, fn, n_sets=1):
            fn(0)
            Ordered.n += 1
            return type("T", (), {"seconds": 1e-3 * (1 + 0.01 * Ordered.n)})()

    monkeypatch.setattr(select, "Timer", Ordered)
    for order in ([(bare, None), (rich, None)], [(rich, None), (bare, None)]):
        _, info = select.quick_select(sop, "cpu", order, budget_s=5.0, vendor=False)
        probes = [r for r in info["candidates"] if r["source"] == "probe"]
        assert [(tuple(r["pipeline"]), r["params"]["parallel"]) for r in probes] == [((), True)]
    # the bare one first by twice the margin: the rich one's neighbour is measured all the same
    monkeypatch.setattr(select, "PROBE_MARGIN", 1.005)
    _, info = select.quick_select(sop, "cpu", [(bare, None), (rich, None)], budget_s=5.0, vendor=False)
    assert [r["source"] for r in info["candidates"]] == ["model", "model", "probe"]
    assert info["candidates"][2]["params"]["parallel"] is True
    _, info = select.quick_select(sop, "cpu", [(bare, None)], budget_s=5.0, vendor=False)
    assert [r["source"] for r in info["candidates"]] == ["model"]


def test_build_and_the_benchmark_draw_from_the_same_ranked_count(no_tuning_db, monkeypatch):
    """``build()`` (policy.decide) ranks ``select.RANKED`` configs, the count the benchmark's
    prebuild (bench._model_candidates) also reads."""
    import inspect
    import os
    import sys

    seen = []
    real = kn.ranked_configs

    def spy(sop, target, precision="fp32", k=5):
        seen.append(k)
        return real(sop, target, precision, k=k)

    monkeypatch.setattr(kn, "ranked_configs", spy)
    monkeypatch.setattr(select, "RANKED", 5)
    decide(make_op(random_matrix(300, 300, density=0.02, seed=2), "spmm", 16, "sum", "float32"), "cpu")
    assert seen and seen[0] == 5
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import bench

    class Args:
        loo, precision = False, "fp32"

    A = random_matrix(300, 300, density=0.02, seed=3)
    seen.clear()
    assert bench._model_candidates(Args(), A, make_op(A, "spmm", 64, "sum", "float32"))
    assert seen and seen[0] == 5


def test_reuse_configs_on_dense_row_windows():
    """A matrix whose 32-row windows reuse their columns at least REUSE_MIN times gets the
    tensor-core template on condensed windows of its own order and of RCM, with the template's
    defaults: split tf32 for float32 (fp32-level), the input's precision for 16-bit; nothing for a
    matrix of scattered columns, another op or reduction, or the CPU."""
    A = dense_blocks()
    sop = make_op(A, "spmm", 96, "sum", "float32")
    assert kn.features(sop.A)["window_reuse"] >= kn.REUSE_MIN
    got = kn.reuse_configs(sop, "cuda")
    tpl = spcompile.get_template(kn.REUSE_TEMPLATE)
    mod0 = spcompile.SparseModule.from_op(sop)
    assert [c.template for c in got] == [kn.REUSE_TEMPLATE] * 2
    assert [[p["name"] for p in c.pipeline] for c in got] == [["tile.sgt"], ["reorder.rcm", "tile.sgt"]]
    assert all(c.precision == "3xtf32" and dict(c.params) == {**tpl.default_params(mod0), "precision": "3xtf32"}
               for c in got)
    assert list(got[1].pipeline[:1]) == list(kn._PIPES["rcm"])
    half = kn.reuse_configs(make_op(A, "spmm", 64, "sum", "float16"), "cuda")
    assert [c.precision for c in half] == ["fp16", "fp16"]
    assert kn.reuse_configs(make_op(A, "spmm", 96, "max", "float32"), "cuda") == []
    assert kn.reuse_configs(make_op(A, "sddmm", 96, None, "float32"), "cuda") == []
    assert kn.reuse_configs(sop, "cpu") == []
    scattered = make_op(random_matrix(1200, 1200, density=0.02, seed=4), "spmm", 96, "sum", "float32")
    assert kn.features(scattered.A)["window_reuse"] < kn.REUSE_MIN and kn.reuse_configs(scattered, "cuda") == []


def test_features_are_computed_once_per_matrix(monkeypatch):
    """The model's ranking and the candidates beside it ask for the same matrix's features; a
    canonical CSR's are computed once (a copy is returned, so a caller cannot change them)."""
    sop = make_op(dense_blocks(nblocks=6), "spmm", 32, "sum", "float32")
    calls = []
    real = kn._features
    monkeypatch.setattr(kn, "_features", lambda A: calls.append(1) or real(A))
    f = kn.features(sop.A)
    f["window_reuse"] = -1.0
    assert kn.features(sop.A)["window_reuse"] > 1 and len(calls) == 1
    kn.features(sop.A.to_scipy())          # not a canonical CSR: computed again
    assert len(calls) == 2


def test_build_measures_reuse_candidates(monkeypatch, no_tuning_db):
    """ss_bcsstk25_pattern (3.65 entries per distinct column of a 32-row window) held out of the
    model: quick selection measures the tensor-core template on its condensed windows beside the
    model's choices, under its own label; fb100_mit8 (1.38) gets no such candidate."""
    A, seen, decide_held_out = _recorded_quick_selection(monkeypatch, "ss_bcsstk25_pattern")
    decide_held_out("spmm", 128, "sum", "float32")
    reuse = [c for src, c, _ in seen["extra"] if src == "model (row-window reuse)"]
    assert [c.template for c in reuse] == [kn.REUSE_TEMPLATE] * 2 and {c.precision for c in reuse} == {"3xtf32"}
    assert all(c.template != kn.REUSE_TEMPLATE for c, _ in seen["ranked"])
    A, seen, decide_held_out = _recorded_quick_selection(monkeypatch, "fb100_mit8")
    decide_held_out("spmm", 128, "sum", "float32")
    assert not [c for src, c, _ in seen["extra"] if src == "model (row-window reuse)"]
