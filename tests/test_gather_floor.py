"""The L2 gather floor: benchmarks/l2_gather.py's kernel compiles for sm_90 and sm_80 (nvcc, no GPU
needed), its summary picks the L2-resident and the HBM points, and bench.py reports the gather
floor, the larger of the two floors and each column's fraction of it from that JSON."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from conftest import REPO
from spcompile.runtime import cuda as rt

sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402
import l2_gather  # noqa: E402


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_gather_kernel_compiles(tmp_path, arch):
    assert rt.nvcc_available(), "nvcc is needed to check the micro-benchmark's kernel"
    src = tmp_path / "g.cu"
    src.write_text(l2_gather.SOURCE)
    r = subprocess.run([rt.nvcc_path(), f"-arch={arch}", "--ptx", str(src), "-o", str(tmp_path / "g.ptx")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert ".entry gather_rows" in (tmp_path / "g.ptx").read_text()


@pytest.mark.parametrize("K, group", [(4, 1), (8, 2), (32, 8), (64, 16), (128, 32), (512, 32), (100, 32)])
def test_group_is_a_power_of_two_up_to_a_warp(K, group):
    assert l2_gather.group_for(K) == group


def _rows():
    mk = lambda K, mb, rate: {"K": K, "x_bytes": int(mb * 2**20), "gather_Bps": rate, "nnz": 1, "seconds": 1.0,
                              "check_ok": True}
    return [mk(32, 4, 1e12), mk(64, 4, 5e12), mk(128, 16, 7e12), mk(256, 16, 6e12), mk(128, 40, 3e12),
            mk(128, 1024, 2e12), mk(256, 1024, 2.4e12), mk(32, 1024, 0.5e12)]


def test_summary_takes_l2_resident_and_hbm_points():
    s = l2_gather.summarize(_rows(), l2_bytes=50 << 20)
    assert s["l2_gather_Bps"] == pytest.approx(6e12)        # median of 5, 7, 6 (K >= 64, X <= 25 MB)
    assert s["hbm_gather_Bps"] == pytest.approx(2.2e12)     # median of 2, 2.4 (X > 100 MB, K >= 64)
    md = l2_gather.markdown({"device": "d", "command": "c", "date": "t", "rows": _rows(), "summary": s})
    assert "6.00 TB/s" in md and "2.20 TB/s" in md


def test_bench_reports_both_floors(tmp_path):
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"summary": {"l2_gather_Bps": 5e12}}))
    assert bench.read_gather_rates(str(rates)) == 5e12
    a = types.SimpleNamespace(op="spmm", dtype="float32", bandwidth=2.96e12, l2_gather_rate=5e12)
    m = n = 1000
    cols = {"baseline": {"status": "ok", "seconds": 4e-5}, "default": {"status": "ok", "seconds": 2e-5}}
    # many nonzeros per row: the gather floor (nnz*K*4 / 5 TB/s) is above the compulsory traffic
    row = bench.make_row(a, "g", "g.npz", m, n, 200_000, 64, cols)
    assert row["l2_floor_s"] == pytest.approx(200_000 * 64 * 4 / 5e12)
    assert row["bound_s"] == row["l2_floor_s"] > row["floor_s"]
    assert row["bound_fraction"]["default"] == pytest.approx(row["bound_s"] / 2e-5)
    # few nonzeros: the compulsory traffic binds
    row2 = bench.make_row(a, "g", "g.npz", m, n, 1000, 64, cols)
    assert row2["bound_s"] == row2["floor_s"] > row2["l2_floor_s"]
    # a kernel at the bound: the baseline's time over the larger floor, per row and in the summary
    assert bench.at_bound(row) == pytest.approx(4e-5 / row["bound_s"])
    fp16 = {**cols, "baseline_fp32": {"status": "ok", "seconds": 8e-5}}
    assert bench.at_bound(bench.make_row(a, "g", "g.npz", m, n, 200_000, 64, fp16), "baseline_fp32") == \
        pytest.approx(8e-5 / row["bound_s"])
    failed = bench.make_row(a, "g", "g.npz", m, n, 200_000, 64, {**cols, "baseline": {"status": "error"}})
    assert bench.at_bound(failed) is None
    s = bench.summarize([row, row2])["64"]["at_bound"]["speedup"]
    assert s["graphs"] == 2 and s["geomean"] == pytest.approx((4e-5 / row["bound_s"] * 4e-5 / row2["bound_s"]) ** 0.5)
    assert s["worst"]["speedup"] == pytest.approx(min(4e-5 / row["bound_s"], 4e-5 / row2["bound_s"]))
    # without a rate: no gather columns
    a.l2_gather_rate = None
    assert bench.at_bound(bench.make_row(a, "g", "g.npz", m, n, 1000, 64, cols)) is None
    assert "l2_floor_s" not in bench.make_row(a, "g", "g.npz", m, n, 1000, 64, cols)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"summary": {"l2_gather_Bps": None}}))
    with pytest.raises(ValueError, match="no L2 gather rate"):
        bench.read_gather_rates(str(bad))


def test_bench_markdown_has_the_gather_columns(tmp_path):
    import os

    import scipy.sparse as sp

    from conftest import random_matrix

    d = tmp_path / "graphs"
    d.mkdir()
    sp.save_npz(d / "g.npz", random_matrix(50, 50, density=0.1, seed=3))
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"summary": {"l2_gather_Bps": 5e12}}))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--data", str(d), "--target", "cpu",
                        "--K", "8", "--columns", "baseline", "default", "--gather-rates", str(rates), "--out", str(out),
                        "--name", "t"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (out / "t.md").read_text()
    assert "l2 floor us" in md and "bound frac default" in md and "geomean bound frac" in md
    assert "x at bound" in md and "a kernel at the larger floor" in md
    assert "5.00 TB/s" in md
    doc = json.loads((out / "t.json").read_text())
    row = doc["rows"][0]
    assert doc["settings"]["l2_gather_Bps"] == 5e12
    assert row["bound_s"] == max(row["floor_s"], row["l2_floor_s"])
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench.py"), "--data", str(d), "--target", "cpu",
                        "--gather-rates", str(tmp_path / "missing.json"), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--gather-rates" in r.stderr and "Traceback" not in r.stderr
