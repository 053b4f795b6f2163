"""The benchmark driver (benchmarks/bench.py) end to end on the CPU target: two small generated
graphs, every column, JSON and markdown written under --out, ratios against the baseline of the
same run, resuming with --skip-done, and a wrong module excluded."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from conftest import REPO, random_matrix

sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402
import common  # noqa: E402

K = 8


def _run(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    d = tmp_path_factory.mktemp("graphs")
    sp.save_npz(d / "small.npz", random_matrix(60, 80, density=0.05, seed=1))
    sp.save_npz(d / "wide.npz", random_matrix(90, 200, density=0.03, seed=2, empty_rows=5))
    return d


@pytest.fixture(scope="module")
def run(graphs, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    args = ["--data", str(graphs), "--target", "cpu", "--K", str(K), "--oracle", "--max-seeds", "1",
            "--tune-timeout", "2", "--out", str(out), "--name", "t"]
    stdout = _run(*args, cwd=tmp_path_factory.mktemp("cwd"))
    with open(out / "t.json") as f:
        doc = json.load(f)
    return out, doc, stdout, args


def test_writes_json_and_markdown_only_under_out(run, graphs):
    out, doc, _, _ = run
    assert sorted(os.listdir(out)) == ["t.json", "t.md"]
    assert sorted(os.listdir(graphs)) == ["small.npz", "wide.npz"]   # nothing written beside the data
    md = (out / "t.md").read_text()
    for g in ("small", "wide"):
        assert f"| {g} |" in md
    assert "geomean x" in md and "floor" in md


def test_json_structure(run):
    _, doc, _, _ = run
    assert doc["schema"] == bench.SCHEMA
    s = doc["settings"]
    assert (s["op"], s["reduce"], s["dtype"], s["target"], s["K"]) == ("spmm", "sum", "float32", "cpu", [K])
    assert s["timer_mode"] == "autorange"
    assert doc["env"]["spcompile"] == spcompile.__version__
    assert [(r["graph"], r["K"]) for r in doc["rows"]] == [("small", K), ("wide", K)]
    for r in doc["rows"]:
        cols = r["columns"]
        assert set(cols) == {"baseline", "default", "tuned", "oracle"}
        for name, rec in cols.items():
            assert rec["status"] == "ok", (name, rec)
            assert rec["seconds"] > 0 and rec["timing"]["mode"] == "autorange"
            assert rec["rel_err"] <= rec["tol"]
        # the empty database: quick selection between the heuristic config and SciPy
        assert cols["default"]["tuning"]["source"] == "quick"
        assert cols["tuned"]["tuning"]["source"] in ("tuned", "quick")
        assert cols["tuned"]["tune_wall_s"] > 0
        assert cols["oracle"]["candidates"] >= 1 and cols["oracle"]["config"]["template"] == "cpu.csr_spmm"
        assert "cpu.csr_spmm" in cols["oracle"]["per_template"]


def test_ratios_are_against_the_same_run_baseline(run, graphs):
    _, doc, _, _ = run
    for r in doc["rows"]:
        cols = r["columns"]
        assert r["speedup_over"] == "baseline"
        assert set(r["speedup"]) == {"default", "tuned", "oracle"}
        for c, x in r["speedup"].items():
            assert x == pytest.approx(cols["baseline"]["seconds"] / cols[c]["seconds"], rel=1e-12)
        A = sp.load_npz(graphs / f"{r['graph']}.npz")
        m, n = A.shape
        fb = (m + 1) * 4 + A.nnz * 8 + n * K * 4 + m * K * 4
        assert r["floor_bytes"] == fb
        for c, f in r["floor_fraction"].items():
            assert f == pytest.approx(fb / s_bw(doc) / cols[c]["seconds"], rel=1e-12)
    summ = doc["summary"][str(K)]["speedup"]
    for c, v in summ.items():
        xs = [r["speedup"][c] for r in doc["rows"]]
        assert v["geomean"] == pytest.approx(math.exp(np.mean(np.log(xs))), rel=1e-12)
        assert v["below_1x"] == sum(x < 1 for x in xs)
        assert v["worst"]["speedup"] == min(xs)
        assert v["graphs_over_200k"] == 0 and v["geomean_over_200k"] is None


def s_bw(doc):
    return doc["settings"]["bandwidth_Bps"]


def test_skip_done_resumes_without_measuring_again(run, tmp_path):
    out, doc, _, args = run
    stdout = _run(*args, "--skip-done", cwd=tmp_path)
    with open(out / "t.json") as f:
        again = json.load(f)
    assert again["rows"] == doc["rows"]              # kept, not re-measured
    assert not [ln for ln in stdout.splitlines() if ln.startswith(("small ", "wide "))]


def test_wrong_module_is_excluded():
    """A module built for other values fails the check: reported, never timed."""
    A = random_matrix(40, 50, density=0.1, seed=3)
    B = A.copy()
    B.data = B.data * 2.0
    w = bench.Workload(A, "spmm", "sum", 4, "float32", "cpu", n_sets=3)
    good = spcompile.build(A, "spmm", 4, target="cpu", template="cpu.csr_spmm")
    wrong = spcompile.build(B, "spmm", 4, target="cpu", template="cpu.csr_spmm")
    ok = bench._checked(w, "x", good, {})
    bad = bench._checked(w, "x", wrong, {})
    assert ok.rec["status"] == "ok" and ok.call is not None
    assert bad.rec["status"] == "wrong_result" and bad.call is None
    assert bad.rec["rel_err"] == pytest.approx(1.0, rel=1e-3)
    row = bench.make_row(bench.parse_args(["--target", "cpu"])[1], "g", "g.npz", 40, 50, A.nnz, 4,
                         {"baseline": {"status": "ok", "seconds": 2.0}, "default": {**ok.rec, "seconds": 1.0},
                          "tuned": bad.rec})
    assert row["speedup"] == {"default": 2.0}          # the wrong column has no ratio


def test_time_config_builds_checks_and_times_one_cell():
    """bench.time_config (the sweeps' cell): a config built for the workload's op, checked against
    float64 and timed over its input sets; a parameter the template refuses raises ValueError."""
    from spcompile.autotune.measure import Timer
    from spcompile.kernels import get_template

    A = random_matrix(60, 70, density=0.1, seed=4)
    w = bench.Workload(A, "spmm", "sum", 8, "float32", "cpu", n_sets=3)
    tpl = get_template("cpu.csr_spmm")
    p = dict(tpl.default_params(spcompile.SparseModule.from_op(w.sop)))
    cell = bench.time_config(w, tpl.make_config(p, [], "cpu"), Timer("cpu", repeats=3, min_sample_s=1e-3))
    assert cell["status"] == "ok" and cell["us"] > 0
    deg = [{"name": "reorder.degree", "options": {}}]
    cell = bench.time_config(w, tpl.make_config(p, deg, "cpu"), Timer("cpu", repeats=3, min_sample_s=1e-3),
                             bench.PipelineCache().get(w.sop, deg))
    assert cell["status"] == "ok" and cell["us"] > 0
    with pytest.raises(ValueError):
        bench.time_config(w, tpl.make_config({**p, "k_tile": -3}, [], "cpu"), Timer("cpu"))


def test_find_graphs_filters_and_orders(graphs, tmp_path):
    found = common.find_graphs(data_dir=str(graphs))
    assert sorted(g for g, _, _ in found) == ["small", "wide"]
    assert [nz for _, _, nz in found] == sorted(nz for _, _, nz in found)
    lo = min(nz for _, _, nz in found)
    assert [g for g, _, nz in common.find_graphs(data_dir=str(graphs), min_nnz=lo + 1)] == \
        [g for g, _, nz in found if nz > lo]
    import scipy.io

    scipy.io.mmwrite(str(tmp_path / "m.mtx"), random_matrix(20, 20, seed=5))
    (name, path, nnz), = common.find_graphs([str(tmp_path / "m.mtx")])
    assert name == "m" and nnz == common.load_matrix(path).nnz
    with pytest.raises(FileNotFoundError):
        common.find_graphs(["no_such_graph"], data_dir=str(graphs))


def test_row_split_parts_keep_each_row_once_with_its_entries(tmp_path):
    """benchmarks/row_split.py: every part holds the rows of its length range, in stored order, with
    their entries and all columns; the buckets and the gt part of the last bound cover each row once."""
    import row_split
    A = random_matrix(120, 70, density=0.05, seed=3, empty_rows=7).tocsr()
    lens = np.diff(A.indptr)
    src = tmp_path / "g.npz"
    sp.save_npz(src, A)
    assert row_split.main([str(src), "--at", "2", "--buckets", "0", "2", "5", "--out", str(tmp_path / "o")]) == 0
    seen = []
    for suffix, lo, hi in [("le2", 0, 2), ("gt2", 3, None), ("len0-0", 0, 0), ("len1-2", 1, 2), ("len3-5", 3, 5)]:
        B = sp.load_npz(tmp_path / "o" / f"g_{suffix}.npz").tocsr()
        rows = np.flatnonzero((lens >= lo) & (lens <= (lens.max() if hi is None else hi)))
        assert B.shape == (rows.size, A.shape[1])
        assert abs(B - A[rows]).sum() == 0
        if suffix.startswith("len"):
            seen.append(rows)
    seen.append(np.flatnonzero(lens > 5))
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(A.shape[0]))
    with pytest.raises(SystemExit):
        row_split.main([str(src), "--out", str(tmp_path / "o")])


def test_overlap_parts_takes_each_graphs_default_configuration(tmp_path):
    """benchmarks/overlap_parts.py: the default column's configuration of each graph at the asked
    K (a later table's row replaces an earlier one's), and an error naming a graph without one."""
    import overlap_parts

    def row(g, K, ms):
        return {"graph": g, "K": K, "columns": {"default": {"config": {"template": "csr.crc_cwm",
                                                                        "params": {"max_seg": ms}}}}}
    t1, t2 = tmp_path / "t1.json", tmp_path / "t2.json"
    t1.write_text(json.dumps({"rows": [row("a", 64, 1), row("a", 128, 2), row("b", 64, 3)]}))
    t2.write_text(json.dumps({"rows": [row("a", 64, 4), {"graph": "c", "K": 64, "columns": {"default": {}}}]}))
    got = overlap_parts.table_configs([str(t1), str(t2)], 64)
    assert {g: c["params"]["max_seg"] for g, c in got.items()} == {"a": 4, "b": 3}
    with pytest.raises(SystemExit):
        overlap_parts.main(["--a", "a.npz", "--b", "c.npz", "--whole", "b.npz", "--tables", str(t1), str(t2)])
