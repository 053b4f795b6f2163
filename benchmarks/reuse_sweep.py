"""Row-window reuse through L1: csr.crc_cwm with narrow column tiles and many rows per block,
behind locality reorderings, against the template's default and cuSPARSE, on the shared graphs.

A block of ``warps_per_block x rows_per_warp`` consecutive rows reads, per column tile of
``group x vec x cf`` columns, the X slices of the window's columns; after a locality order (RCM,
LSH clusters) consecutive rows share columns, and a narrow tile keeps the window's distinct
slices in the SM's L1, so a shared X row is fetched from L2 once per window instead of once per
nonzero.  This sweep measures whether that pays, per graph, by the product's one timing rule
(``Timer``: kernel time of ``mod(X, out=Y)`` by CUDA-graph replay), each module checked against
the float64 reference first.

    python benchmarks/reuse_sweep.py --min-nnz 200001 --K 128 --out $OUT/reuse
    python benchmarks/reuse_sweep.py --build-only ...   # fill $SPCOMPILE_KERNEL_CACHE, no GPU
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402  (the benchmark driver: workloads, checks, one timing rule)
import common  # noqa: E402

PIPELINES = {
    "none": [],
    "degree": [{"name": "reorder.degree"}],
    "rcm": [{"name": "reorder.rcm"}],
    "rcm+lsh": [{"name": "reorder.rcm"}, {"name": "cluster.lsh", "options": {"threshold_size": 16, "skip": False,
                                                                           "round": 1}}],
}


def configs(K: int, dtype: str, op: str = "spmm", template: str | None = None, shapes: str = "all"):
    """SpMM: narrow column tiles x tall row windows (the default's shape is measured separately).
    SDDMM: lanes per nonzero x nonzeros per warp x warps per block (consecutive rows per block).
    ``csr.window``: window heights x lane widths x staging buffers; ``shapes="tall"``: 64- and
    128-row windows whose staging buffers fill the shared memory (the reuse of a window, nonzeros
    per distinct column, grows with its height)."""
    from spcompile.kernels.base import unique_params
    from spcompile.kernels.csr.template import CrcCwm, CsrSddmm, _largest_vec

    if template == "csr.window":
        from spcompile.kernels.window.template import CsrWindow

        d = CsrWindow.heuristic(K, dtype)
        out = []
        if shapes == "tall":   # chunk past the shared memory: the launch caps it (CsrWindow.chunk)
            vecs = sorted({_largest_vec(K, v) for v in (1, 2, 4) if v <= d["vec"]})
            for (w, r), v, nbuf in itertools.product(((8, 8), (16, 4), (16, 8)), vecs, (1, 2)):
                out.append({**d, "warps": w, "rows_per_warp": r, "vec": v, "chunk": 8192, "nbuf": nbuf})
            return unique_params(out)
        for (w, r), v, (chunk, nbuf) in itertools.product(((4, 4), (8, 2), (8, 4), (8, 8), (16, 4)),
                                                         (d["vec"], _largest_vec(K, max(1, d["vec"] // 2))),
                                                         ((d["chunk"], 2), (2 * d["chunk"], 1))):
            c = chunk * d["vec"] // v
            out.append({**d, "warps": w, "rows_per_warp": r, "vec": v, "chunk": min(256, c), "nbuf": nbuf})
        return unique_params(out)

    if op == "sddmm":
        d = CsrSddmm.heuristic(K, dtype)
        out = []
        for group, npw, wpb in itertools.product((8, 16), (32, 128), (4, 8)):
            out.append({**d, "group": group, "k_chunks": CsrSddmm.k_chunks(K, group, d["vec"]), "nnz_per_warp": npw,
                        "warps_per_block": wpb})
        return out

    vec = CrcCwm.heuristic(K, 0, 0.0, dtype)["vec"]
    out = []
    for group, (wpb, rpw), ms in itertools.product((8, 16, 32), ((4, 1), (8, 2), (8, 4)), (256,)):
        if group * vec > K and group > 8:
            continue
        out.append({"cf": 1, "vec": vec, "group": group, "warps_per_block": wpb, "rows_per_warp": rpw,
                    "max_seg": ms, "unroll": 2})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", nargs="*")
    ap.add_argument("--data", default=None, help="graph folder (default $SPCOMPILE_GRAPHS, else ../shared/data/graphs)")
    ap.add_argument("--min-nnz", type=int, default=200_001)
    ap.add_argument("--max-nnz", type=int, default=5_000_000)
    ap.add_argument("--K", type=int, nargs="+", default=[128])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--op", default="spmm", choices=["spmm", "sddmm"])
    ap.add_argument("--pipelines", nargs="+", default=None, choices=list(PIPELINES),
                    help="default: degree rcm rcm+lsh (spmm), none degree rcm (sddmm)")
    ap.add_argument("--template", default=None, choices=["csr.crc_cwm", "csr.sddmm", "csr.window"],
                    help="default: csr.crc_cwm (spmm) / csr.sddmm (sddmm)")
    ap.add_argument("--shapes", default="all", choices=["all", "tall"],
                    help="csr.window only: tall = 64- and 128-row windows with full shared memory")
    ap.add_argument("--out", default="reuse_out")
    ap.add_argument("--build-only", action="store_true")
    a = ap.parse_args(argv)

    import spcompile

    graphs = common.find_graphs(a.graphs, a.data, a.min_nnz, a.max_nnz)
    if not graphs:
        ap.error("no graph matches (see --graphs / --data / --min-nnz / --max-nnz)")
    if a.pipelines is None:
        a.pipelines = ["degree", "rcm", "rcm+lsh"] if a.op == "spmm" else ["none", "degree", "rcm"]
    if a.template == "csr.window" and a.op != "spmm":
        ap.error("csr.window computes spmm")
    tname = a.template or ("csr.crc_cwm" if a.op == "spmm" else "csr.sddmm")
    reduce = "sum" if a.op == "spmm" else None
    if a.build_only:   # the kernel binaries depend on the parameters and dtype only: one graph builds them
        A = common.load_matrix(graphs[0][1])
        tpl = bench.get_template(tname)
        for K in a.K:
            sop = bench.make_op(A, a.op, K, reduce, a.dtype)
            for p in configs(K, a.dtype, a.op, tname, a.shapes):
                bench.build_from_config(sop, tpl.make_config(p, [], "cuda"))
            if tname == "csr.window":   # the template's default, measured beside the shapes
                bench.build_from_config(sop, tpl.make_config(tpl.heuristic(K, a.dtype), [], "cuda"))
        print(f"built {sum(len(configs(K, a.dtype, a.op, tname, a.shapes)) for K in a.K)} configurations", flush=True)
        return 0
    from spcompile.autotune.measure import Timer

    timer = Timer("cuda")
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for name, path, _ in graphs:
        A = common.load_matrix(path)
        for K in a.K:
            t0 = time.perf_counter()
            w = bench.Workload(A, a.op, reduce, K, a.dtype, "cuda")
            base = bench.col_baseline(w)
            res = {"graph": name, "nnz": int(A.nnz), "K": K}
            res["baseline_us"] = timer.time(base.call, n_sets=w.n_sets).seconds * 1e6 if base.call else None
            default = spcompile.build(A, a.op, K, reduce, target="cuda", dtype=a.dtype, template=tname)
            col = bench._checked(w, "default", default, {})
            res["default_us"] = timer.time(col.call, n_sets=w.n_sets).seconds * 1e6 if col.call else None
            res["default"] = default.config.params
            if tname == "csr.window":   # what build() gives on this graph, measured in the same run
                prod = spcompile.build(A, a.op, K, reduce, target="cuda", dtype=a.dtype)
                col = bench._checked(w, "build", prod, {})
                res["build_us"] = timer.time(col.call, n_sets=w.n_sets).seconds * 1e6 if col.call else None
                res["build"] = prod.config.to_dict()
            cells = []
            pipes = bench.PipelineCache()   # each reordering runs once per graph and K
            tpl = bench.get_template(tname)
            for pname in a.pipelines:
                for p in configs(K, a.dtype, a.op, tname, a.shapes):
                    try:
                        mod = bench.build_from_config(w.sop, tpl.make_config(p, PIPELINES[pname], "cuda"),
                                                      module=pipes.get(w.sop, PIPELINES[pname]))
                        col = bench._checked(w, "cell", mod, {})
                        us = timer.time(col.call, n_sets=w.n_sets).seconds * 1e6 if col.call else None
                        err = col.rec.get("error")
                    except Exception as e:  # a failed cell is reported, the sweep goes on
                        us, err = None, f"{type(e).__name__}: {e}"[:200]
                    cells.append({"pipeline": pname, "params": p, "us": us, "error": err})
            res["cells"] = cells
            ok = [c for c in cells if c["us"]]
            best = min(ok, key=lambda c: c["us"]) if ok else None
            res["best"] = best
            w.release()
            rows.append(res)
            b = res["baseline_us"]
            bp = {}
            for c in ok:
                if c["pipeline"] not in bp or c["us"] < bp[c["pipeline"]]:
                    bp[c["pipeline"]] = c["us"]
            print(f"{name:26s} K={K:4d} base {b:7.1f} default {res['default_us']:7.1f} "
                  + (f"build() {res['build_us']:7.1f} " if res.get("build_us") else "")
                  + " ".join(f"{k} {v:7.1f}" for k, v in bp.items())
                  + (f" | best x{b / best['us']:.2f} {best['pipeline']} {json.dumps(best['params'])}"
                     if best and b else "")
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            suffix = "_window" if tname == "csr.window" else ""
            with open(os.path.join(a.out, f"reuse_sweep_{a.op}{suffix}.json"), "w") as f:
                json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    if rows:
        xs = [r["baseline_us"] / r["best"]["us"] for r in rows if r["best"] and r["baseline_us"]]
        xd = [r["baseline_us"] / r["default_us"] for r in rows if r["default_us"] and r["baseline_us"]]
        print(f"geomean over cuSPARSE: sweep best {common.geomean(xs):.2f}x, template default "
              f"{common.geomean(xd):.2f}x ({len(xs)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
