"""Helpers shared by the CLI commands: reading matrix files, a generated demo graph."""
from __future__ import annotations

import numpy as np


def load_matrix(path: str):
    """A sparse matrix from a scipy ``.npz`` (save_npz) or Matrix Market ``.mtx`` file."""
    import scipy.io
    import scipy.sparse as sp

    if path.endswith(".npz"):
        try:
            return sp.load_npz(path)
        except (ValueError, OSError) as e:
            raise SystemExit(f"error: cannot read {path!r} as a scipy sparse .npz: {e}")
    if path.endswith((".mtx", ".mtx.gz")):
        try:
            return sp.csr_matrix(scipy.io.mmread(path))
        except (ValueError, OSError, TypeError, IndexError) as e:
            raise SystemExit(f"error: cannot read {path!r} as a Matrix Market file: {e}")
    raise SystemExit(f"error: unsupported matrix file {path!r} (expected .npz or .mtx)")


def power_law_graph(n: int, avg_degree: float = 16.0, exponent: float = 2.1, seed: int = 0):
    """A symmetric Chung-Lu power-law graph (weights ~ rank^(-1/(exponent-1))), values 1.0."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    w = (np.arange(1, n + 1, dtype=np.float64)) ** (-1.0 / (exponent - 1.0))
    p = w / w.sum()
    m = int(n * avg_degree / 2)
    rows = rng.choice(n, size=m, p=p)
    cols = rng.choice(n, size=m, p=p)
    keep = rows != cols
    rows, cols = rows[keep], cols[keep]
    perm = rng.permutation(n)  # hide the degree order
    A = sp.coo_matrix((np.ones(rows.size, np.float32), (perm[rows], perm[cols])), shape=(n, n)).tocsr()
    A = ((A + A.T) > 0).astype(np.float32).tocsr()
    return A
