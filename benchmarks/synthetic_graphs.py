"""Two generated graphs shaped like graph classes the shared set lacks, for ``bench.py --graphs PATH``:

* ``synth_web``: a web crawl's shape (282k pages, 2.65M links): Zipf out-degrees (exponent 1.9,
  at most 2000 + 3), 70% of the links to pages within a few hundred ids of their source (pages of
  one host are numbered together), the rest to Pareto-distributed hub pages; directed, values 1.
* ``synth_reddit``: a batch of discussion threads (2000 trees, 862k nodes, 1.72M entries, mean
  degree 2): log-normal thread sizes, each node attached to an earlier node of its thread with a
  bias toward the first ones (the post and the top comments become hub rows); symmetric, values 1.

Generated with numpy's default generator from ``--seed`` (vectorised; a few seconds), saved as
scipy ``.npz``.  They stand in for classes, not for any real graph:

    python benchmarks/synthetic_graphs.py --out DIR
    python benchmarks/bench.py --graphs DIR/synth_web.npz DIR/synth_reddit.npz --K 64 128 256
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import scipy.sparse as sp


def web(rng: np.random.Generator, n: int = 282_000) -> sp.csr_matrix:
    out_deg = np.minimum(rng.zipf(1.9, n), 2000) + 3
    m = int(out_deg.sum())
    src = np.repeat(np.arange(n), out_deg)
    local = rng.random(m) < 0.7
    near = np.clip(src + (rng.standard_normal(m) * 200).astype(np.int64), 0, n - 1)
    hub = (rng.pareto(1.2, m) * 50).astype(np.int64) % n
    A = sp.csr_matrix((np.ones(m, np.float32), (src, np.where(local, near, hub))), shape=(n, n))
    A.sum_duplicates()
    A.data[:] = 1
    return A


def threads(rng: np.random.Generator, count: int = 2000, nodes: int = 859_000) -> sp.csr_matrix:
    sizes = np.maximum(rng.lognormal(5.6, 0.9, count).astype(np.int64), 5)
    sizes = (sizes * nodes / sizes.sum()).astype(np.int64) + 2
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    N = int(sizes.sum())
    local = np.arange(N) - np.repeat(starts, sizes)           # index inside its thread
    parent = (local * rng.random(N) ** 3).astype(np.int64)     # an earlier node, biased to the first
    keep = local > 0
    r, c = (np.repeat(starts, sizes) + local)[keep], (np.repeat(starts, sizes) + parent)[keep]
    B = sp.csr_matrix((np.ones(2 * r.size, np.float32), (np.concatenate([r, c]), np.concatenate([c, r]))),
                      shape=(N, N))
    B.sum_duplicates()
    B.data[:] = 1
    return B


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for synth_web.npz and synth_reddit.npz")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the default sizes (pages, threads, nodes)")
    a = ap.parse_args(argv)
    if not 0 < a.scale <= 100:
        ap.error("--scale must be in (0, 100]")
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    graphs = (("synth_web", web(rng, max(2, round(282_000 * a.scale)))),
              ("synth_reddit", threads(rng, max(1, round(2000 * a.scale)), max(10, round(859_000 * a.scale)))))
    for name, A in graphs:
        sp.save_npz(os.path.join(a.out, name + ".npz"), A)
        print(f"{name}: {A.shape[0]} rows, {A.nnz} entries, longest row {int(np.diff(A.indptr).max())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
