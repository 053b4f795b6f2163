"""``build()``'s module of each graph (the ``default`` column of committed tables) next to the same
with ``warp_combine=1``, and that with other ``max_seg`` / ``unroll`` / ``combine_vals``: every
cell built through ``build_from_config``, checked against float64 and timed by the Timer rule.

    python benchmarks/experiments/hub_combine/warp_combine_cells.py [GRAPH ...] [--v1] [--build-only]

``--v1``: the cells of ``h100_warp_combine_cells_v1.json`` (``warp_combine`` 1 with other
``max_seg``, ``unroll`` and ``combine_vals``); default: ``warp_combine`` 1 and 2 on the
module's parameters, with twice as long slices, and (16-bit) as the capped ``unroll`` 8 and the
``unroll`` 16 kernel.

Writes ``wcdiag.json`` under ``$OUT`` (else the working directory).
"""
import json, os, sys, time
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench, common
from spcompile.core.config import Config
from spcompile.kernels import get_template
build_only = "--build-only" in sys.argv
CASES = [("docs/benchmarks/h100_spmm_fp16_default_big_v3.json", "float16", 64),
         ("docs/benchmarks/h100_spmm_fp16_default_big_v3.json", "float16", 128),
         ("docs/benchmarks/h100_spmm_fp32_default_big.json", "float32", 64)]
only = [a for a in sys.argv[1:] if not a.startswith("--")]
timer = None
if not build_only:
    from spcompile.autotune.measure import Timer
    timer = Timer("cuda")
out = []
t0 = time.time()
for table, dt, K in CASES:
    for r in json.load(open(table))["rows"]:
        if r["K"] != K or (only and r["graph"] not in only):
            continue
        cfgd = r["columns"]["default"]["config"]
        p0 = dict(cfgd["params"])
        if cfgd["template"] != "csr.crc_cwm" or int(p0.get("flat", 0)) or int(p0["rows_per_warp"]) != 1 or int(p0["group"]) >= 32:
            continue
        A = common.load_matrix(os.path.join(os.environ["SPCOMPILE_GRAPHS"], r["graph"] + ".npz"))
        lens = np.diff(A.tocsr().indptr)
        cfg = Config.from_dict(cfgd)
        tpl = get_template(cfg.template)
        if "--v1" in sys.argv:               # the cells of h100_warp_combine_cells_v1.json
            wc = {**p0, "warp_combine": 1}
            cells = [p0, wc] + [{**wc, "max_seg": ms} for ms in (16, 32, 64, 128) if ms != int(p0["max_seg"])]
            us_ = (16, 4) if dt == "float16" else (8, 4)
            cells += [{**wc, "unroll": u, "combine_vals": 0} for u in us_ if u != int(p0["unroll"])]
            if dt == "float16":
                cells.append({**wc, "unroll": 8, "combine_vals": 16})
        else:                                # warp_combine 1 / 2 on the lead, twice as long slices, capped, deep
            ms = int(p0["max_seg"])
            cells = [p0]
            for w in (1, 2):
                cells += [{**p0, "warp_combine": w}, {**p0, "warp_combine": w, "max_seg": 2 * ms}]
                if dt == "float16":
                    cells += [{**p0, "warp_combine": w, "unroll": 8, "combine_vals": 16},
                              {**p0, "warp_combine": w, "unroll": 16, "combine_vals": 0}]
        seen, uniq = set(), []
        for c in cells:
            k = json.dumps(c, sort_keys=True)
            if k not in seen:
                seen.add(k); uniq.append(c)
        spec = [dict(s) for s in cfg.pipeline]
        w = None if build_only else bench.Workload(A, "spmm", "sum", K, dt, "cuda")
        sop = w.sop if w else bench.make_op(A, "spmm", K, "sum", dt)
        module = bench.PipelineCache().get(sop, spec) if spec else None
        res = []
        for p in uniq:
            if build_only:
                bench.build_from_config(sop, tpl.make_config(p, spec, "cuda", dt), module=module)
                continue
            res.append({"params": p, **bench.time_config(w, tpl.make_config(p, spec, "cuda", dt), timer, module)})
        if build_only:
            print(r["graph"], dt, K, len(uniq), "built", flush=True); continue
        b = r["columns"]["default"].get("seconds")
        line = " ".join(f"{c['us']:.1f}" if c["us"] else "nan" for c in res)
        print(f"{r['graph']:22s} {dt} K={K:3d} maxrow={lens.max():5d} | {line}", flush=True)
        out.append({"graph": r["graph"], "dtype": dt, "K": K, "cells": res})
        w.release()
        json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "wcdiag.json"), "w"), indent=1)
print("elapsed", time.time() - t0)
