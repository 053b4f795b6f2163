"""The benchmark drivers write under benchmarks/results/ (or --out), never into docs/, unless told
to (``passes.py --write-docs``)."""
from __future__ import annotations

import importlib.util
import sys

import scipy.sparse as sp

from conftest import REPO, random_matrix

sys.path.insert(0, str(REPO / "benchmarks"))
# by its path: a plain ``import passes`` finds the tests' own ``passes`` package once it is imported
_spec = importlib.util.spec_from_file_location("bench_passes_driver", REPO / "benchmarks" / "passes.py")
passes_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(passes_bench)


def test_passes_benchmark_writes_docs_only_when_asked(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    sp.save_npz(str(graphs / "g.npz"), random_matrix(60, 60, seed=1))
    monkeypatch.setattr(passes_bench, "ROOT", str(root))
    args = ["--passes", "reorder.degree", "--graphs-dir", str(graphs), "--no-isolate", "--quiet"]
    assert passes_bench.main(args) in (0, None)
    assert (root / "benchmarks" / "results" / "passes.md").exists()
    assert not (root / "docs" / "passes.md").exists()
    assert passes_bench.main(args + ["--write-docs"]) in (0, None)
    assert "reorder.degree" in (root / "docs" / "passes.md").read_text()
