"""Parameters of each graph's tuned module varied one grid at a time: the tuned configuration of a
committed benchmark table (its ``tuned`` column: template, pipeline, parameters), then the same
with every combination of the ``--vary`` values.  Every cell is built through the product's
``build_from_config``, checked against the float64 reference first and timed by the Timer rule,
with cuSPARSE in the same run.

    python benchmarks/param_sweep.py GRAPH [GRAPH ...] --vary min_blocks=1,4,6,8 --vary unroll=2,4
        [--tuned TABLE.json ...] [--column tuned|default] [--dtype float32|float16|bfloat16] [--K 128]
        [--build-only] [--out DIR] [--name NAME]

``--tuned`` may be given several times (a later table's row for a graph replaces an earlier one);
``--build-only`` compiles every cell's kernels into ``$SPCOMPILE_KERNEL_CACHE`` for sm_90 (no GPU).
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

DEFAULT_TABLE = os.path.join(common.ROOT, "docs", "benchmarks", "h100_spmm_fp32_tuned_K128.json")


def _vary(spec: str) -> tuple[str, list[int]]:
    name, _, vals = spec.partition("=")
    if not name or not vals:
        raise argparse.ArgumentTypeError(f"--vary wants NAME=V1,V2,..., got {spec!r}")
    return name, [int(v) for v in vals.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graphs", nargs="+")
    ap.add_argument("--vary", type=_vary, action="append", required=True)
    ap.add_argument("--tuned", action="append", default=None)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="X / Y element type (the tables' dtype)")
    ap.add_argument("--column", default="tuned", help="the table column whose module is varied (tuned, default)")
    ap.add_argument("--pipelines", nargs="+", default=None,
                    help="replace the tuned pipeline by each of these in turn: none, or pass names "
                         "joined by '+' (e.g. reorder.degree, reorder.community)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default="param_sweep")
    a = ap.parse_args(argv)
    from spcompile.core.config import Config
    from spcompile.kernels import get_template

    tuned = {}
    for t in a.tuned or [DEFAULT_TABLE]:
        for r in json.load(open(t))["rows"]:
            if int(r.get("K", a.K)) == a.K and r["columns"].get(a.column, {}).get("config"):
                tuned[r["graph"]] = r["columns"][a.column]["config"]
    names = [n for n, _ in a.vary]
    grid = list(itertools.product(*[v for _, v in a.vary]))
    timer = None
    if not a.build_only:
        from spcompile.autotune.measure import Timer

        timer = Timer("cuda")
    out = []
    for name, path, _ in common.find_graphs(a.graphs):
        if name not in tuned:
            print(f"{name}: no {a.column} module at K={a.K} in the tables", flush=True)
            continue
        A = common.load_matrix(path)
        cfg = Config.from_dict(tuned[name])
        tpl = get_template(cfg.template)
        p0 = dict(cfg.params)
        variants = [p0] + [v for v in ({**p0, **dict(zip(names, g))} for g in grid) if v != p0]
        specs = ([[dict(s) for s in cfg.pipeline]] if not a.pipelines else
                 [[] if pl == "none" else [{"name": n, "options": {}} for n in pl.split("+")] for pl in a.pipelines])
        if a.build_only:
            sop = bench.make_op(A, "spmm", a.K, "sum", a.dtype)
            refused = 0
            for spec in specs:
                module = bench.PipelineCache().get(sop, spec) if spec else None
                for p in variants:
                    try:
                        bench.build_from_config(sop, tpl.make_config(p, spec, "cuda", a.dtype), module=module)
                    except ValueError as e:              # a combination the template refuses
                        refused += 1
                        print(f"    refused {({k: p.get(k) for k in names})}: {e}", flush=True)
            print(f"{name}: {len(variants) * len(specs) - refused} configurations built, {refused} refused", flush=True)
            continue
        w = bench.Workload(A, "spmm", "sum", a.K, a.dtype, "cuda")
        b = timer.time(bench.col_baseline(w).call, n_sets=w.n_sets).seconds * 1e6
        res = {"graph": name, "nnz": int(A.nnz), "K": a.K, "template": cfg.template, "pipeline": specs[0],
               "baseline_us": b, "cells": []}
        for spec in specs:
            module = bench.PipelineCache().get(w.sop, spec) if spec else None
            for p in variants:
                try:
                    cell = bench.time_config(w, tpl.make_config(p, spec, "cuda", a.dtype), timer, module)
                except ValueError as e:                  # a combination the template refuses
                    cell = {"us": None, "status": "refused", "error": str(e)[:200]}
                res["cells"].append({"params": p, "pipeline": spec, **cell})
        t0 = res["cells"][0]["us"]
        best = min((c for c in res["cells"] if c["us"]), key=lambda c: c["us"])
        shown = {**{k: best["params"].get(k) for k in names}, "pipeline": "+".join(x["name"] for x in best["pipeline"])}
        print(f"{name:24s} cuSPARSE {b:7.1f} tuned {t0:7.1f} best {best['us']:7.1f} ({t0 / best['us']:.3f}x the "
              f"tuned speed) {shown}", flush=True)
        for c in res["cells"][1:]:
            print(f"    {c['us'] if c['us'] else float('nan'):7.1f} {({k: c['params'].get(k) for k in names})} "
                  f"{'+'.join(x['name'] for x in c['pipeline']) or 'none'}", flush=True)
        out.append(res)
        w.release()
        common.write_rows(a.out, a.name, "param_sweep.py", argv, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
