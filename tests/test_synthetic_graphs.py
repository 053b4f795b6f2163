"""benchmarks/synthetic_graphs.py: the two stand-in graphs have the structure their docstring
claims (checked at small sizes), and the script writes them reproducibly."""
import os
import sys

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import synthetic_graphs as sg  # noqa: E402


def test_threads_are_a_batch_of_trees_with_hub_rows():
    B = sg.threads(np.random.default_rng(1), count=40, nodes=6000)
    n = B.shape[0]
    assert B.shape == (n, n) and (B != B.T).nnz == 0 and np.all(B.data == 1) and B.diagonal().sum() == 0
    ncomp, labels = sp.csgraph.connected_components(B, directed=False)
    assert ncomp == 40 and B.nnz == 2 * (n - 40)          # 40 trees: n - 40 edges, both directions
    assert np.all(np.diff(labels) >= 0)                   # each thread's nodes are consecutive
    deg = np.diff(B.indptr)
    assert deg.max() >= 20 * deg.mean()                   # the first nodes of a thread are hubs


def test_web_links_are_mostly_local_with_hub_targets():
    A = sg.web(np.random.default_rng(2), n=20000)
    C = A.tocoo()
    assert A.shape == (20000, 20000) and np.all(A.data == 1) and (A != A.T).nnz > 0      # directed
    assert np.all(np.diff(A.indptr) >= 1)
    assert np.mean(np.abs(C.row - C.col) < 1000) > 0.6   # links within the host's id range
    indeg = np.bincount(C.col, minlength=20000)
    assert indeg.max() >= 50 * indeg.mean()               # hub pages


def test_script_writes_the_same_graphs_for_a_seed(tmp_path):
    for d in ("a", "b"):
        assert sg.main(["--out", str(tmp_path / d), "--seed", "5", "--scale", "0.01"]) == 0
    for name in ("synth_web", "synth_reddit"):
        a, b = (sp.load_npz(tmp_path / d / f"{name}.npz") for d in ("a", "b"))
        assert a.shape == b.shape and (a != b).nnz == 0 and a.nnz > 0
    assert sp.load_npz(tmp_path / "a" / "synth_web.npz").shape == (2820, 2820)
