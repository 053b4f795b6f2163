"""csr.crc_cwm with ``flat=1`` against each graph's tuned K=128 module (H100 table
``docs/benchmarks/h100_spmm_fp32_tuned_K128.json``): the tuned parameters and pipeline, then the
same with ``flat=1`` at 4-32 rows per group, unroll 2 / 4 and 4 / 8 warps per block.  Every cell
checked against the float64 reference first, timed by the Timer rule, cuSPARSE in the same run.

    python benchmarks/flat_sweep.py GRAPH [GRAPH ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402
import common  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--tuned", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     "docs", "benchmarks", "h100_spmm_fp32_tuned_K128.json"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args(argv)
    from spcompile.autotune.measure import Timer
    from spcompile.core.config import Config
    from spcompile.kernels import get_template

    tpl = get_template("csr.crc_cwm")
    timer = Timer("cuda")
    tuned = {r["graph"]: r["columns"]["tuned"]["config"] for r in json.load(open(a.tuned))["rows"]}
    out = []
    for name, path, _ in common.find_graphs(a.graphs):
        if name not in tuned:
            print(f"{name}: no tuned module in {a.tuned}", flush=True)
            continue
        A = common.load_matrix(path)
        w = bench.Workload(A, "spmm", "sum", 128, "float32", "cuda")
        base = bench.col_baseline(w)
        b = timer.time(base.call, n_sets=w.n_sets).seconds * 1e6
        cfg = Config.from_dict(tuned[name])
        spec = [dict(s) for s in cfg.pipeline]
        module = bench.PipelineCache().get(w.sop, spec) if spec else None
        p0 = dict(cfg.params)
        variants = [p0] + [{**p0, "flat": 1, "rows_per_warp": r, "unroll": u, "warps_per_block": wp}
                           for r, u, wp in itertools.product((4, 8, 16, 32), (2, 4), (4, 8))]
        res = {"graph": name, "nnz": int(A.nnz), "baseline_us": b, "cells": []}
        for p in variants:
            mod = bench.build_from_config(w.sop, tpl.make_config(p, spec, "cuda"), module=module)
            col = bench._checked(w, "x", mod, {})
            us = timer.time(col.call, n_sets=w.n_sets).seconds * 1e6 if col.call else None
            res["cells"].append({"params": p, "us": us, "status": col.rec.get("status")})
        t0 = res["cells"][0]["us"]
        best = min((c for c in res["cells"][1:] if c["us"]), key=lambda c: c["us"])
        print(f"{name:24s} cuSPARSE {b:7.1f} tuned {t0:7.1f} flat best {best['us']:7.1f} ({t0 / best['us']:.2f}x the "
              f"tuned speed) rows_per_warp={best['params']['rows_per_warp']} unroll={best['params']['unroll']} "
              f"warps_per_block={best['params']['warps_per_block']}", flush=True)
        out.append(res)
        w.release()
    os.makedirs(a.out, exist_ok=True)
    common.write_json(os.path.join(a.out, "flat_sweep_K128.json"),
                      {"command": "benchmarks/flat_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "rows": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
