"""``spcompile report``: one HTML file with its plots inline, from a tuning database made by a
real (tiny) tuning run and a small benchmarks/bench.py-format JSON file."""
from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.cli import main
from spcompile.cli import report


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory):
    # On a 7 us CPU kernel the search's best can land within timing noise above the default
    # config measured in the same run; the tuner then rightly stores nothing ("quick").  The
    # report needs a stored record, so a run that stored none is repeated in a fresh database.
    A = sp.random(300, 300, density=0.02, format="csr", dtype=np.float32, random_state=0)
    notes = []
    for attempt in range(5):
        url = "sqlite:///" + str(tmp_path_factory.mktemp("report") / "tuning.db")
        mod = spcompile.build(A, "spmm", K=16, target="cpu", tune=True, trials=3, storage=url)
        if mod.tuning["source"] == "tuned":
            return url, mod
        assert mod.tuning["source"] == "quick" and "nothing stored" in mod.tuning["tune_note"], mod.tuning
        notes.append(mod.tuning["tune_note"])
    pytest.fail(f"5 tuning runs stored no record: {notes}")


def _bench_json(path):
    rows = []
    for i, (g, nnz) in enumerate((("tiny_a", 100), ("tiny_b", 5000), ("tiny_c", 300000))):
        for K in (32, 64):
            rows.append({"graph": g, "nnz": nnz, "K": K, "m": 10, "n": 10, "speedup_over": "baseline",
                         "speedup": {"default": 0.5 + i, "tuned": 1.0 + i},
                         "columns": {"baseline": {"status": "ok", "seconds": 1e-4},
                                     "default": {"status": "ok", "seconds": 1e-4, "build_s": 0.1 * (i + 1)},
                                     "tuned": {"status": "ok", "seconds": 5e-5, "tune_wall_s": 5.0 + i}}})
    doc = {"schema": 1, "name": "spmm_float32_cpu", "command": "python benchmarks/bench.py --quick",
           "updated": "2026-11-25T00:00:00", "env": {"device": "test cpu"},
           "settings": {"op": "spmm", "reduce": "sum", "dtype": "float32", "target": "cpu",
                        "columns": ["baseline", "default", "tuned"]},
           "rows": rows,
           "summary": {"32": {"speedup": {"default": {"graphs": 3, "geomean": 1.1, "graphs_over_200k": 1,
                                                      "geomean_over_200k": 2.5, "below_1x": 1,
                                                      "worst": {"graph": "tiny_a", "speedup": 0.5}}}}}}
    path.write_text(json.dumps(doc))
    return path


def _pngs(page):
    imgs = re.findall(r'<img alt="plot" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    return [base64.b64decode(b) for b in imgs]


def test_report_from_a_tuning_database_and_bench_json(tuned_db, tmp_path, capsys):
    url, mod = tuned_db
    bench = _bench_json(tmp_path / "bench.json")
    out = tmp_path / "report.html"
    assert main(["report", "--storage", url, "--bench", str(bench), "-o", str(out)]) == 0
    page = out.read_text()
    pngs = _pngs(page)
    # per K (2): speed-up + build/tune wall time; the database: tuning curves + time split
    assert len(pngs) == 6 and all(p.startswith(b"\x89PNG\r\n\x1a\n") and len(p) > 2000 for p in pngs)
    assert "src=\"http" not in page and "<script" not in page          # one self-contained file
    assert mod.config.template in page and "tiny_a" in page and "2.50x" in page
    assert "6 plots" in capsys.readouterr().out


def test_tuning_curve_and_time_split_follow_the_study(tuned_db):
    url, mod = tuned_db
    sts = report.studies(url)
    assert len(sts) == 1
    st = sts[0]
    values = [t["value_ms"] for t in st["trials"] if t["value_ms"] is not None]
    xs, ts, ys = report._best_so_far(st)
    assert st["baseline_ms"] and ys[-1] == pytest.approx(st["baseline_ms"] / min(values))
    assert all(b >= a for a, b in zip(ys, ys[1:])) and ts == sorted(ts)       # best-so-far never drops
    split = report.time_split(st)
    assert split["compile"] > 0 and all(v >= 0 for v in split.values())
    wall = max(t["end_s"] for t in st["trials"])
    assert sum(split.values()) == pytest.approx(max(wall, sum(split.values())), rel=1e-6)


def test_report_shows_a_cold_start_result_as_a_table(tmp_path):
    doc = {"mode": "cold_start", "command": "python benchmarks/bench.py --cold-start", "env": {"device": "cpu"},
           "result": {"python -c pass": {"median_s": 0.05}, "import spcompile": {"median_s": 0.17},
                      "targets": {"cpu": {"median_s": 0.26, "import_s": 0.12, "load_s": 0.078,
                                          "first_call_s": 0.0004, "status": "ok"}}}}
    p = tmp_path / "cold.json"
    p.write_text(json.dumps(doc))
    page = report.render(bench=[str(p)], include_db=False)
    assert "<td>import + load + first call, target cpu</td><td>0.260</td><td>0.120</td><td>0.078</td>" in page


def test_report_errors_are_clear(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"name": "something else"}))
    with pytest.raises(ValueError, match="not a benchmarks/bench.py result"):
        report.render(bench=[str(bad)], include_db=False)
    other = tmp_path / "gather.json"   # rows of (graph, K) of another script's schema
    other.write_text(json.dumps({"schema": "spcompile-short-gather/1", "rows": [{"graph": "g", "K": 64}]}))
    with pytest.raises(ValueError, match="not a benchmarks/bench.py result"):
        report.render(bench=[str(other)], include_db=False)
    sweep = tmp_path / "sweep.json"   # rows, but not of (graph, K): another script's output
    sweep.write_text(json.dumps({"rows": [{"graph": "g", "variant": "a", "us": 1.0}]}))
    with pytest.raises(ValueError, match="not a benchmarks/bench.py result"):
        report.render(bench=[str(sweep)], include_db=False)
    with pytest.raises(FileNotFoundError, match="no tuning database"):
        report.render(storage=str(tmp_path / "absent.db"))


def test_report_shows_speedups_over_the_fp32_baseline_of_a_16_bit_table(tmp_path):
    # a 16-bit table whose vendor library has no 16-bit kernel (SDDMM): its only speed-ups are
    # over the fp32 baseline, and the report shows them (summary rows and per-graph plots)
    rows = [{"graph": g, "nnz": nnz, "K": 64, "m": 10, "n": 10, "speedup_over": "default", "speedup": {},
             "speedup_vs_fp32": {"default": x},
             "columns": {"baseline": {"status": "unsupported"}, "baseline_fp32": {"status": "ok", "seconds": 1e-4},
                         "default": {"status": "ok", "seconds": 1e-4 / x, "build_s": 0.5}}}
            for g, nnz, x in (("g_a", 300000, 4.0), ("g_b", 600000, 3.25))]
    doc = {"schema": "spcompile-bench/1", "name": "sddmm_float16", "command": "bench.py --op sddmm --dtype float16",
           "settings": {"op": "sddmm", "dtype": "float16", "columns": ["baseline", "default"]}, "rows": rows,
           "summary": {"64": {"speedup_vs_fp32": {"default": {"graphs": 2, "geomean": 3.61, "graphs_over_200k": 2,
                                                              "geomean_over_200k": 3.61, "below_1x": 0,
                                                              "worst": {"graph": "g_b", "speedup": 3.25}}}}}}
    path = tmp_path / "b16.json"
    path.write_text(json.dumps(doc))
    page = report.bench_section(str(path))
    assert "baseline_fp32" in page and "3.61x" in page and "3.25x (g_b)" in page
    pngs = _pngs(page)
    assert len(pngs) == 2                     # the speed-ups over fp32 (no empty plot over the 16-bit one) + wall time
