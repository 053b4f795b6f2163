"""Measure the knowledge the package ships: every portfolio member of
:mod:`spcompile.autotune.knowledge` on every graph of a folder, per op/reduce, dtype and K, with
the vendor baseline of the same run, on the GPU this runs on.

Every module is built through the product's replay path (``build_from_config``), checked against
the float64 reference on NaN-poisoned outputs (a wrong result counts as failed), and timed with
the one timing rule (``Timer("cuda")``: CUDA-graph replay between events, median of repeats; a
lighter setting than the published benchmarks, ``--repeats``/``--min-sample``, since thousands of
candidates are measured).  Writes one JSON line per (graph, workload class) to
``<out>/knowledge_rows.jsonl`` as it goes (a killed run keeps its rows; ``--skip-done`` resumes),
and ``--assemble`` turns rows into the package's ``knowledge_<arch>.json``.

    python benchmarks/collect_knowledge.py --data DIR --out OUT --prebuild --jobs 16
    python benchmarks/collect_knowledge.py --assemble OUT/knowledge_rows.jsonl \
        --write spcompile/autotune/data/knowledge_sm_90.json
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import common  # noqa: E402

from spcompile.autotune import knowledge as kn  # noqa: E402
from spcompile.compile import build_from_config, make_op  # noqa: E402
from spcompile.core.formats import as_csr  # noqa: E402
from spcompile.core.ir import pattern_hash  # noqa: E402

#: (op, reduce, dtype, widths) measured, in this order
WORKLOADS = [("spmm", "sum", "float32", kn.KNOWLEDGE_K), ("spmm", "sum", "float16", kn.KNOWLEDGE_K),
             ("sddmm", None, "float32", kn.KNOWLEDGE_K), ("sddmm", None, "float16", (64, 128, 256)),
             ("spmm", "max", "float32", (64, 128, 256)), ("spmm", "mean", "float32", (64, 128, 256))]


def _prebuild_job(job):
    """Compile the kernels one workload class needs (a small generated graph: instances depend on
    the op, dtype, K and parameters, not on the matrix)."""
    op, reduce, dtype, K = job
    from spcompile.cli.common import power_law_graph

    A = power_law_graph(4000, 12, seed=1)
    sop = make_op(A, op, K, reduce, dtype)
    fails = []
    for cid in kn.portfolio(op, reduce, dtype):
        if cid.startswith("extern."):
            continue
        try:
            build_from_config(sop, kn.candidate_config(cid, sop))
        except Exception as e:
            fails.append(f"{cid}: {type(e).__name__}: {e}"[:200])
    return job, fails


def prebuild(jobs: int, workloads) -> None:
    todo = [(op, r, d, K) for op, r, d, Ks in workloads for K in Ks]
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=max(1, jobs)) as ex:
        for job, fails in ex.map(_prebuild_job, todo):
            for f in fails:
                print(f"  prebuild {job}: {f}", flush=True)
    print(f"prebuilt {len(todo)} workload classes in {time.perf_counter() - t0:.0f} s", flush=True)


def measure_graph(name, A, workloads, timer, done, emit, n_sets=2):
    from bench import Column, PipelineCache, Workload, _checked, col_baseline  # noqa: F401

    csr = as_csr(A)
    feats = kn.features(csr)
    digest = pattern_hash(csr)
    pipes = PipelineCache()
    for op, reduce, dtype, Ks in workloads:
        cands = kn.portfolio(op, reduce, dtype)
        for K in Ks:
            cls = kn.workload_class(op, reduce, dtype, K)
            if (name, cls) in done:
                continue
            t0 = time.perf_counter()
            w = Workload(A, op, reduce, K, dtype, "cuda", n_sets)
            base = None
            if (op, reduce) in (("spmm", "sum"), ("spmm", "mean"), ("sddmm", None)):
                for dt in ([None] if dtype == "float32" else [None, "float32"]):
                    col = col_baseline(w, dt)
                    if col.call is not None:
                        try:
                            s = timer.time(col.call, n_sets=n_sets).seconds
                        except Exception:
                            s = None
                        if dt is None:
                            base = s
                        else:
                            base32 = s
            times, errors, seen = [], {}, {}
            for cid in cands:
                t = None
                try:
                    cfg = kn.candidate_config(cid, w.sop)
                    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
                    if key in seen:   # two members that are one config at this K: measured once
                        times.append(times[seen[key]])
                        continue
                    seen[key] = len(times)
                    mod = build_from_config(w.sop, cfg, module=pipes.get(w.sop, list(cfg.pipeline)))
                    col = _checked(w, cid, mod, {})
                    if col.call is None:
                        errors[cid] = col.rec.get("error", "wrong")[:200]
                    else:
                        t = timer.time(col.call, n_sets=n_sets).seconds
                    del mod, col
                except Exception as e:
                    errors[cid] = f"{type(e).__name__}: {e}"[:200]
                times.append(t)
            w.release()
            row = {"graph": name, "digest": digest, "class": cls, "op": op, "reduce": reduce, "dtype": dtype,
                   "K": K, "rows": csr.shape[0], "cols": csr.shape[1], "nnz": int(csr.nnz), "features": feats,
                   "candidates": cands, "times": times, "baseline_s": base, "errors": errors,
                   "wall_s": time.perf_counter() - t0}
            if dtype != "float32":
                row["baseline_fp32_s"] = locals().get("base32")
            emit(row)
    import torch

    torch.cuda.empty_cache()


def assemble(paths, write, device="", arch="sm_90", command=""):
    rows = {}
    for p in paths:
        with open(p) as fh:
            for line in fh:
                if line.strip():
                    r = json.loads(line)
                    rows[(r["graph"], r["class"])] = r
    workloads: dict = {}
    dropped = []
    for (g, cls), r in sorted(rows.items()):
        # rows are projected onto today's portfolio (members dropped since are left out; a
        # member added since and not measured is an error: measure again)
        want = kn.portfolio(r["op"], r["reduce"], r["dtype"])
        pos = {c: j for j, c in enumerate(r["candidates"])}
        missing = [c for c in want if c not in pos]
        if missing:
            raise SystemExit(f"{g} {cls}: not measured for portfolio members {missing[:3]}")
        times = [r["times"][pos[c]] for c in want]
        if not any(times):   # nothing worked (e.g. the result overflows float16): no information
            dropped.append(f"{g} {cls}")
            continue
        t = workloads.setdefault(cls, {"candidates": want, "graphs": []})
        r = {**r, "times": times}
        t["graphs"].append({"name": g, "digest": r["digest"], "rows": r["rows"], "cols": r["cols"], "nnz": r["nnz"],
                            "features": {k: round(v, 6) for k, v in r["features"].items()},
                            "baseline_s": r["baseline_s"], **({"baseline_fp32_s": r["baseline_fp32_s"]}
                                                               if r.get("baseline_fp32_s") is not None else {}),
                            "times": [None if v is None else float(f"{v:.4g}") for v in r["times"]]})
    doc = {"schema": "spcompile-knowledge/1", "device": device, "arch": arch, "command": command,
           "created": datetime.datetime.now().isoformat(timespec="seconds"),
           "note": "kernel seconds per portfolio member (None: failed or wrong), baseline = cuSPARSE of the same dtype",
           "workloads": workloads}
    with open(write, "w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    print(f"wrote {write}: {len(workloads)} classes, {len(rows) - len(dropped)} rows; left out (nothing "
          f"worked): {', '.join(dropped) or 'none'}")


def write_cv(path, command):
    """Leave-one-graph-out quality of the shipped model, per workload class."""
    a_arch = "sm_90"
    k = kn.load_knowledge("cuda", a_arch)
    from spcompile.autotune.select import DEFAULT_CANDIDATES, MORE_CANDIDATES

    cv = kn.cross_validate(k)
    lines = [f"# Shipped knowledge ({a_arch}): leave-one-graph-out cross-validation", "",
             f"Generated by `{command}` from `spcompile/autotune/data/knowledge_{a_arch}.json` "
             f"({k.device}).", "",
             "For every workload class and every graph measured, the k-NN model ranks the portfolio with "
             "that graph's own measurements left out; the table compares the graph's measured kernel "
             f"times of the model's first choice (*model*) and of the fastest of its first {DEFAULT_CANDIDATES} "
             f"and up to {MORE_CANDIDATES} of its next that need no other pipeline or only a degree sort, "
             "then, in a second round, the portfolio members next to the fastest of those (csr.crc_cwm: "
             "the next shorter and longer `max_seg`, the other block shapes, same pipeline), plus "
             "the vendor library (*quick*: what `build()` measures on a database miss) with the "
             "fastest portfolio member (*oracle*) and the vendor library (cuSPARSE of the same dtype; "
             "none for max and for 16-bit SDDMM). Geometric means over graphs.", "",
             "| class | graphs | model / oracle | quick / oracle | oracle x | model x | quick x | quick worst x |",
             "|---|---|---|---|---|---|---|---|"]

    def f(v, nd=3):
        return "-" if v is None else f"{v:.{nd}f}"

    for cls, r in sorted(cv.items(), key=lambda kv: (kv[0].split("/")[:3], int(kv[0].split("/")[3]))):
        lines.append(f"| {cls} | {r['graphs']} | {f(r['model_over_oracle'])} | {f(r['quick_over_oracle'])} | "
                     f"{f(r['oracle_speedup'], 2)} | {f(r['model_speedup'], 2)} | {f(r['quick_speedup'], 2)} | "
                     f"{f(r['quick_worst'], 2)} |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.splitext(path)[0] + ".json", "w") as fh:
        json.dump({"command": command, "classes": cv}, fh, indent=1, default=float)
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="folder of .npz/.mtx graphs (default: the shared graphs)")
    ap.add_argument("--graphs", nargs="+", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--prebuild", action="store_true", help="compile every portfolio kernel first, in parallel")
    ap.add_argument("--prebuild-only", action="store_true", help="compile every portfolio kernel (all classes), measure nothing")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", nargs="*", default=None, help="workload classes prefixes to measure, e.g. spmm/sum/float32")
    ap.add_argument("--K", nargs="+", type=int, default=None, help="measure only these widths")
    ap.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                    help="visit graphs in a seeded random order (a time-limited run then covers all kinds)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-sample", type=float, default=5e-4)
    ap.add_argument("--skip-done", action="store_true")
    ap.add_argument("--time-limit", type=float, default=None, help="stop starting graphs after this many seconds")
    ap.add_argument("--assemble", nargs="+", default=None, metavar="JSONL")
    ap.add_argument("--write", default=None)
    ap.add_argument("--cv", default=None, metavar="MD",
                    help="leave-one-graph-out cross-validation of the shipped knowledge, as markdown (and .json)")
    ap.add_argument("--device", default="NVIDIA H100 80GB HBM3")
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args(argv)
    command = "python benchmarks/collect_knowledge.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.assemble:
        assemble(a.assemble, a.write, a.device, a.arch, command)
        return 0
    if a.cv:
        write_cv(a.cv, command)
        return 0
    workloads = [w for w in WORKLOADS
                 if a.only is None or any(kn.workload_class(w[0], w[1], w[2], 0).startswith(p) for p in a.only)]
    if a.K:
        workloads = [(op, r, d, tuple(k for k in Ks if k in a.K)) for op, r, d, Ks in workloads]
    if a.prebuild_only:
        prebuild(a.jobs, workloads)
        return 0
    if a.prebuild:
        prebuild(a.jobs, workloads)
    from spcompile.autotune.measure import Timer

    timer = Timer("cuda", repeats=a.repeats, min_sample_s=a.min_sample)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "knowledge_rows.jsonl")
    done = set()
    if a.skip_done and os.path.exists(path):
        with open(path) as fh:
            done = {(r["graph"], r["class"]) for r in map(json.loads, filter(str.strip, fh))}
    graphs = common.find_graphs(a.graphs, a.data, None, None)
    if a.shuffle is not None:
        graphs = [graphs[i] for i in np.random.default_rng(a.shuffle).permutation(len(graphs))]
    t_start = time.perf_counter()

    def emit(row):
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        ok = [t for t in row["times"] if t]
        best = min(ok) if ok else math.nan
        b = row["baseline_s"]
        print(f"{row['graph']:28s} {row['class']:24s} best {best * 1e6:8.1f} us  baseline "
              f"{(b or math.nan) * 1e6:8.1f} us  x{(b or math.nan) / best:5.2f}  fails {len(row['errors'])}  "
              f"[{row['wall_s']:.1f} s]", flush=True)

    for gname, gpath, _ in graphs:
        if a.time_limit and time.perf_counter() - t_start > a.time_limit:
            print("time limit reached", flush=True)
            break
        A = common.load_matrix(gpath)
        measure_graph(gname, A, workloads, timer, done, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
