"""Two parts of a graph's rows (``benchmarks/row_split.py``) run one after the other and side by
side, next to the whole graph's module: whether a module that ran short and long rows as separate
kernels could gain by overlapping them (section 33 of ``docs/benchmarks/h100_crc_cwm_experiments.md``).

Each module is built by the product's ``build_from_config`` from the ``default`` column of the
given ``bench.py`` tables (the graph's file name without ``.npz`` is its name there), checked
against the float64 reference on NaN-poisoned outputs, and timed by the Timer rule (CUDA-graph
replay between events, median).  Side by side = part A on the current stream and part B on a
second one, forked and joined inside the captured graph; afterwards both parts' outputs are
checked again.

    python benchmarks/overlap_parts.py --a DIR/g_le16.npz --b DIR/g_gt16.npz --whole g.npz \
        --tables parts.json whole.json --K 64 [--dtype float16] [--out DIR --name NAME] [--build-only]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402
import common  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402


def table_configs(paths: list[str], K: int) -> dict:
    """``{graph: config dict}`` of the ``default`` column at ``K`` (a later table wins)."""
    out = {}
    for p in paths:
        with open(p) as f:
            for r in json.load(f)["rows"]:
                cfg = r["columns"].get("default", {}).get("config")
                if int(r["K"]) == K and cfg:
                    out[r["graph"]] = cfg
    return out


def build(path: str, cfgd: dict, K: int, dtype: str, target: str):
    """``(workload, module)`` of the graph file ``path`` built from ``cfgd``."""
    A = common.load_matrix(path)
    w = bench.Workload(A, "spmm", "sum", K, dtype, target) if target == "cuda" else None
    sop = w.sop if w is not None else bench.make_op(A, "spmm", K, "sum", dtype)
    cfg = Config.from_dict(cfgd)
    spec = [dict(s) for s in cfg.pipeline]
    module = bench.PipelineCache().get(sop, spec) if spec else None
    mod = bench.build_from_config(sop, get_template(cfg.template).make_config(dict(cfg.params), spec, "cuda"),
                                  module=module)
    return w, mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="graph file of part A")
    ap.add_argument("--b", required=True, help="graph file of part B")
    ap.add_argument("--whole", required=True, help="graph file of the whole graph")
    ap.add_argument("--tables", nargs="+", required=True, help="bench.py JSON tables with the three configurations")
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--build-only", action="store_true", help="compile into $SPCOMPILE_KERNEL_CACHE, no GPU")
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="overlap_parts")
    a = ap.parse_args(argv)
    cfgs = table_configs(a.tables, a.K)
    names = {k: os.path.splitext(os.path.basename(getattr(a, k)))[0] for k in ("a", "b", "whole")}
    missing = [n for n in names.values() if n not in cfgs]
    if missing:
        ap.error(f"no default configuration at K={a.K} for {missing} in {a.tables}")
    target = "cpu" if a.build_only else "cuda"
    built = {k: build(getattr(a, k), cfgs[n], a.K, a.dtype, target) for k, n in names.items()}
    if a.build_only:
        print("built", ", ".join(names.values()))
        return 0

    import torch
    from spcompile.autotune.measure import Timer

    calls, errs = {}, {}
    for k, (w, mod) in built.items():
        calls[k] = w.module_call(mod)
        errs[k] = w.check(calls[k])
    tol = bench.numerics.tolerance(a.dtype)
    if any(e > tol for e in errs.values()):
        raise SystemExit(f"wrong result: relative errors {errs} (tolerance {tol})")
    side = torch.cuda.Stream()

    def both(i):
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        calls["a"](i)
        with torch.cuda.stream(side):
            calls["b"](i)
        cur.wait_stream(side)

    timer = Timer("cuda")
    n_sets = built["a"][0].n_sets
    us = {k: timer.time(calls[k], n_sets=n_sets).seconds * 1e6 for k in ("a", "b", "whole")}
    us["a_then_b"] = timer.time(lambda i: (calls["a"](i), calls["b"](i)), n_sets=n_sets).seconds * 1e6
    us["a_beside_b"] = timer.time(both, n_sets=n_sets).seconds * 1e6
    wa, wb = built["a"][0], built["b"][0]
    outs_a, outs_b = wa.io()[1], wb.io()[1]
    for o in (*outs_a, *outs_b):
        o.fill_(float("nan"))
    both(0)
    torch.cuda.synchronize()
    errs["a_beside_b"] = max(wa.rel_error(outs_a[0]), wb.rel_error(outs_b[0]))
    if errs["a_beside_b"] > tol:
        raise SystemExit(f"wrong result side by side: relative error {errs['a_beside_b']}")
    rec = {"command": "benchmarks/overlap_parts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": torch.cuda.get_device_name(), "K": a.K, "dtype": a.dtype, "graphs": names,
           "configs": {k: cfgs[n] for k, n in names.items()}, "us": us, "rel_err": errs}
    print(json.dumps({"graphs": names, "us": {k: round(v, 2) for k, v in us.items()}}))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, a.name + ".json"), "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
