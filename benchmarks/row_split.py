"""A graph's rows split by length into graphs of their own, for timing each part of a matrix with
``bench.py`` / ``param_sweep.py`` (section 33 of ``docs/benchmarks/h100_crc_cwm_experiments.md``).

Each part keeps the rows (in stored order) whose nonzero count falls in a range, and all of the
graph's columns, so it multiplies the same X and writes one output row per row it kept.

    python benchmarks/row_split.py snap_sx_askubuntu --at 8 16 --out DIR
        # DIR/snap_sx_askubuntu_le8.npz (rows of at most 8 nonzeros), ..._gt8.npz, ..._le16, ..._gt16
    python benchmarks/row_split.py snap_sx_askubuntu --buckets 1 2 4 8 16 --out DIR
        # rows of 0-1, 2, 3-4, 5-8 and 9-16 nonzeros: ..._len0-1.npz, ..._len2-2.npz, ...

Then ``SPCOMPILE_GRAPHS=DIR python benchmarks/bench.py --graphs snap_sx_askubuntu_le8 ...``.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def split(A: sp.csr_matrix, lo: int, hi: int | None) -> sp.csr_matrix:
    """The rows of ``A`` with ``lo <= nonzeros <= hi`` (``hi`` None: no upper bound), stored order."""
    lens = np.diff(A.indptr)
    keep = lens >= lo if hi is None else (lens >= lo) & (lens <= hi)
    return A[np.flatnonzero(keep)].tocsr()


def parts(at: list[int], buckets: list[int]) -> list[tuple[str, int, int | None]]:
    """``(suffix, lo, hi)`` of every part: ``le{w}`` / ``gt{w}`` for each ``at`` width, and
    ``len{lo}-{hi}`` for each bucket (from one more than the previous bound; the first from 0)."""
    out = []
    for w in at:
        out += [(f"le{w}", 0, w), (f"gt{w}", w + 1, None)]
    lo = 0
    for b in sorted(buckets):
        out.append((f"len{lo}-{b}", lo, b))
        lo = b + 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="+", help="graph names (in $SPCOMPILE_GRAPHS) or files")
    ap.add_argument("--at", type=int, nargs="*", default=[], help="widths: rows of at most / more than each")
    ap.add_argument("--buckets", type=int, nargs="*", default=[], help="upper bounds of row-length buckets")
    ap.add_argument("--out", required=True, help="folder the parts are written to")
    a = ap.parse_args(argv)
    if any(w < 0 for w in a.at + a.buckets):
        ap.error("widths and bucket bounds are row lengths, at least 0")
    if not a.at and not a.buckets:
        ap.error("give --at and / or --buckets")
    os.makedirs(a.out, exist_ok=True)
    for name, path, _ in common.find_graphs(a.graphs):
        A = common.load_matrix(path)
        for suffix, lo, hi in parts(a.at, a.buckets):
            B = split(A, lo, hi)
            sp.save_npz(os.path.join(a.out, f"{name}_{suffix}.npz"), B)
            print(f"{name}_{suffix}: {B.shape[0]} rows, {B.nnz} nonzeros")
    return 0


if __name__ == "__main__":
    sys.exit(main())
