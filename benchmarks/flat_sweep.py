"""csr.crc_cwm with ``flat=1`` against each graph's tuned K=128 module (H100 table
``docs/benchmarks/h100_spmm_fp32_tuned_K128.json``): the tuned parameters and pipeline, then the
same with ``flat=1`` at 4-32 rows per group, unroll 2 / 4 and 4 / 8 warps per block.  Every cell
checked against the float64 reference first, timed by the Timer rule, cuSPARSE in the same run.
It is ``param_sweep.py`` with that grid (the JSON, ``<out>/flat_sweep_K128.json``, is its format).

    python benchmarks/flat_sweep.py GRAPH [GRAPH ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import param_sweep  # noqa: E402

FLAT_GRID = ("--vary", "flat=1", "--vary", "rows_per_warp=4,8,16,32", "--vary", "unroll=2,4",
             "--vary", "warps_per_block=4,8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--tuned", default=param_sweep.DEFAULT_TABLE)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args(argv)
    return param_sweep.main([*a.graphs, *FLAT_GRID, "--tuned", a.tuned, "--out", a.out, "--name", "flat_sweep_K128"])


if __name__ == "__main__":
    sys.exit(main())
