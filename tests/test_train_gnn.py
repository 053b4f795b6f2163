"""benchmarks/train_gnn.py on the CPU: a tiny generated graph end to end (JSON and markdown
under --out, finite loss curves, every implementation without error), and the harness's
baseline logic with stand-in PyG layers (same parameters, loss curves compared, speedups)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import scipy.sparse as sp

# torch is a test dependency (the [test] extra, .ci/run): in CI a missing torch fails, never skips
torch = __import__("torch") if os.environ.get("CI") else pytest.importorskip("torch")

from conftest import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))

import train_gnn  # noqa: E402

from spcompile import nn as snn  # noqa: E402


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("graphs")
    A = sp.random(40, 40, density=0.1, random_state=3, format="csr", dtype=np.float32)
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    sp.save_npz(d / "tiny.npz", A)
    return d / "tiny.npz"


def test_cpu_smoke_run(graph_file, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_gnn.py"), "--device", "cpu",
                        "--graphs", str(graph_file), "--steps", "4", "--warmup", "1", "--features", "8",
                        "--hidden", "8", "--heads", "2", "--classes", "3", "--precisions", "fp32,bf16",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["train_gnn.json", "train_gnn.md"]
    res = json.load(open(out / "train_gnn.json"))["results"]
    assert {(x["model"], x["precision"]) for x in res} == {(m, q) for m in ("gcn", "gat") for q in ("fp32", "bf16")}
    for x in res:
        ours = x["impls"]["spcompile"]
        assert "error" not in ours, ours
        assert len(ours["losses"]) == 4 and all(np.isfinite(ours["losses"]))
        assert ours["ms_per_step"] > 0 and ours["steps_timed"] == 3
    assert "| tiny | 40 |" in open(out / "train_gnn.md").read()


class _FakeGCN(snn.GCNConv):
    """Stands in for PyG's GCNConv (same parameter names and math), for the harness test."""

    def __init__(self, i, o, cached=False, normalize=True):
        super().__init__(i, o)
        self.normalize = normalize

    def forward(self, x, e):
        if self.normalize:
            return super().forward(x, e)
        return snn.spmm(self.graph_of(e), self.lin(x)) + self.bias   # e: the normalised adjacency

    def graph_of(self, e):
        return self._cache.get(e, snn.SparseGraph)


class _FakeGAT(snn.GATConv):
    """Stands in for a PyG GATConv that names its weight ``lin_src``."""

    lin = property(lambda self: self.lin_src)

    def __init__(self, i, o, heads=1):
        super().__init__(i, o, heads=heads)
        self.lin_src = self._modules.pop("lin")


def test_harness_with_stand_in_baselines(graph_file, tmp_path, monkeypatch):
    fake = types.SimpleNamespace(GCNConv=_FakeGCN, GATConv=_FakeGAT)
    monkeypatch.setattr(train_gnn, "_pyg", lambda: fake)
    out = tmp_path / "o"
    assert train_gnn.main(["--device", "cpu", "--graphs", str(graph_file), "--steps", "5", "--warmup", "1",
                           "--features", "8", "--hidden", "8", "--heads", "2", "--classes", "3",
                           "--precisions", "fp32", "--out", str(out)]) == 0
    res = json.load(open(out / "train_gnn.json"))["results"]
    gcn = next(x for x in res if x["model"] == "gcn")
    gat = next(x for x in res if x["model"] == "gat")
    assert set(gcn["impls"]) == {"spcompile", "pyg_edge_index", "pyg_adj_t"}
    assert set(gat["impls"]) == {"spcompile", "pyg"}
    for x in (gcn, gat):
        assert all("error" not in v for v in x["impls"].values()), x["impls"]
        # same math from the same parameters: the loss curves agree to float32 noise
        assert x["max_loss_diff"] < 1e-4 and x["speedup"] > 0
    md = open(out / "train_gnn.md").read()
    assert "Geometric mean speed-up" in md
    # --resume keeps what was measured and measures only the rest (here: bf16)
    args = ["--device", "cpu", "--graphs", str(graph_file), "--steps", "3", "--warmup", "1", "--features", "8",
            "--hidden", "8", "--heads", "2", "--classes", "3", "--models", "gcn", "--out", str(out), "--resume"]
    assert train_gnn.main(args + ["--precisions", "fp32,bf16"]) == 0
    again = json.load(open(out / "train_gnn.json"))["results"]
    assert [r for r in again if r["precision"] == "fp32"] == [r for r in res]
    assert {(r["model"], r["precision"]) for r in again} == {("gcn", "fp32"), ("gat", "fp32"), ("gcn", "bf16")}


def test_mapped_state_refuses_mismatched_models():
    with pytest.raises(RuntimeError, match="no parameter of spcompile's model"):
        train_gnn._mapped_state({"c1.lin.weight": torch.zeros(2, 3)}, {"c1.lin.weight": torch.zeros(3, 3)}, "x")
    with pytest.raises(RuntimeError, match="no counterpart"):
        train_gnn._mapped_state({"c1.lin.weight": torch.zeros(2, 3), "c1.bias": torch.zeros(2)},
                                {"c1.lin.weight": torch.zeros(2, 3)}, "x")


def test_graphed_speedup_is_over_the_fastest_baseline_in_any_mode():
    """``summarize_row``: the eager ratio compares eager steps; the graphed ratio compares
    spcompile's CUDA-graph step with the fastest PyG step in either mode; failed runs are left out;
    the 20-step loss difference ignores the later drift."""
    losses = [1.0] * 30
    row = {"impls": {
        "spcompile": {"ms_per_step": 2.0, "losses": losses},
        "spcompile_graphed": {"ms_per_step": 0.5, "losses": losses[:25] + [1.1] * 5},
        "pyg_edge_index": {"ms_per_step": 3.0, "losses": losses[:25] + [1.2] * 5},
        "pyg_edge_index_graphed": {"ms_per_step": 2.5, "losses": losses},
        "pyg_adj_t": {"ms_per_step": 4.0, "losses": losses},
        "pyg_adj_t_graphed": {"error": "RuntimeError: capture failed"}}}
    train_gnn.summarize_row(row)
    assert row["best_pyg"] == "pyg_edge_index" and row["speedup"] == 1.5
    assert row["best_pyg_any"] == "pyg_edge_index_graphed" and row["speedup_graphed"] == 5.0
    assert abs(row["max_loss_diff"] - 0.2) < 1e-12 and row["loss_diff_20"] == 0.0


def test_pyg_rerun_is_the_noise_reference_not_a_baseline(graph_file, tmp_path, monkeypatch):
    """``--pyg-rerun`` trains each PyG model twice from the same parameters; the two runs' loss
    difference is reported beside spcompile's, and the rerun is never the speed baseline."""
    row = {"impls": {
        "spcompile": {"ms_per_step": 2.0, "losses": [1.0] * 30},
        "pyg": {"ms_per_step": 3.0, "losses": [1.0] * 25 + [1.3] * 5},
        "pyg_rerun": {"ms_per_step": 0.1, "losses": [1.0] * 10 + [1.05] * 20}}}
    train_gnn.summarize_row(row)
    assert row["best_pyg"] == "pyg" and row["speedup"] == 1.5
    assert abs(row["max_loss_diff"] - 0.3) < 1e-12 and row["loss_diff_20"] == 0.0
    assert abs(row["pyg_rerun_max_loss_diff"] - 0.25) < 1e-12 and abs(row["pyg_rerun_loss_diff_20"] - 0.05) < 1e-12
    fake = types.SimpleNamespace(GCNConv=_FakeGCN, GATConv=_FakeGAT)
    monkeypatch.setattr(train_gnn, "_pyg", lambda: fake)
    out = tmp_path / "o"
    assert train_gnn.main(["--device", "cpu", "--graphs", str(graph_file), "--steps", "4", "--warmup", "1",
                           "--features", "8", "--hidden", "8", "--heads", "2", "--classes", "3", "--models", "gat",
                           "--precisions", "fp32", "--pyg-rerun", "--out", str(out)]) == 0
    res, = json.load(open(out / "train_gnn.json"))["results"]
    assert set(res["impls"]) == {"spcompile", "pyg", "pyg_rerun"} and res["pyg_rerun_max_loss_diff"] < 1e-4
    assert "PyG vs PyG rerun" in open(out / "train_gnn.md").read()


def test_cuda_graph_mode_needs_a_gpu(tmp_path, graph_file):
    out = tmp_path / "tg"
    assert train_gnn.main(["--device", "cpu", "--graphs", str(graph_file), "--steps", "3", "--warmup", "1",
                           "--models", "gcn", "--precisions", "fp32", "--cuda-graph", "--out", str(out)]) == 0
    row = json.loads((out / "train_gnn.json").read_text())["results"][0]
    assert "needs a CUDA device" in row["impls"]["spcompile_graphed"]["error"]
    assert "error" not in row["impls"]["spcompile"]
