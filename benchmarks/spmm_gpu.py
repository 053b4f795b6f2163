"""GPU SpMM benchmark: cuSPARSE vs each CUDA template's best configuration vs the tuned best.

For each shared graph and K (fp32 X and Y, reduce=sum):
  * every candidate -- cuSPARSE; each template's seed configurations on the output of each of the
    template's own pass pipelines (tile.sgt, reorder.vnm, cluster.lsh -> tile.aspt, ...); the two
    best configurations of pipeline-free templates again behind reorder.rcm / reorder.degree -- is
    checked against a float64 reference computed on the GPU (output NaN-poisoned first; tolerance
    by the precision the kernel computes in), then its *kernel time* is measured: N calls of
    ``mod(X, out=Y)`` captured once in a CUDA graph, replayed between one pair of events, / N;
  * per template the fastest configuration is kept; *tuned* is the fastest exact-fp32 candidate
    (``build()``'s default precision policy), *any* the fastest of every precision;
  * for cuSPARSE, each template's best and the tuned best, the *per-call latency* from Python is
    measured too: median over single calls of ``Y = mod(X); torch.cuda.synchronize()``;
  * the memory-traffic floor: ((m+1)*4 + nnz*8 + n*K*4 + m*K*4) bytes over the device-to-device
    copy bandwidth measured in the same run (bytes read + written).

Writes JSON and a markdown table.  Commands (SPCOMPILE_GRAPHS names the graph folder):

    python benchmarks/spmm_gpu.py --out $OUT                          # CSR templates, K 32..512
    python benchmarks/spmm_gpu.py --all-templates --K 128 256 --out $OUT   # every CUDA template
    python benchmarks/spmm_gpu.py --all-templates --K 128 256 --build-only # fill the kernel cache (CPU)
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spcompile.compile import build_from_config, make_op  # noqa: E402
from spcompile.core.ir import SparseModule  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402
from spcompile.core import numerics, reference  # noqa: E402

KS = (32, 64, 128, 256, 512)


def copy_bandwidth(torch) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    n = 1 << 28  # 1 GiB of float32
    a = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        s.record()
        for _ in range(5):
            b.copy_(a)
        e.record()
        e.synchronize()
        best = min(best, s.elapsed_time(e) / 5 * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 4 / best


def kernel_time(torch, fn, budget_s=0.004) -> float:
    """Seconds per call: calls captured in a CUDA graph, replays timed with events (falls back to
    back-to-back launches between one pair of events if capture fails)."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    one = max(s.elapsed_time(e) * 1e-3, 2e-6)
    per_graph = int(min(200, max(5, 0.5e-3 / one)))
    try:
        g = torch.cuda.CUDAGraph()
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            fn()
            with torch.cuda.graph(g, stream=st):
                for _ in range(per_graph):
                    fn()
        torch.cuda.current_stream().wait_stream(st)
        g.replay()
        torch.cuda.synchronize()
        reps = max(3, int(budget_s / (one * per_graph)))
        times = []
        for _ in range(3):
            s.record()
            for _ in range(reps):
                g.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3 / (reps * per_graph))
        del g
        return min(times)
    except Exception:
        torch.cuda.synchronize()
        n = max(10, int(budget_s / one))
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) * 1e-3 / n


def latency(torch, fn, n=60) -> float:
    """Median seconds of one Python call plus synchronisation."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def load_graphs(names=None, max_nnz=None):
    gdir = os.environ.get("SPCOMPILE_GRAPHS", "")
    out = []
    for p in sorted(glob.glob(os.path.join(gdir, "*.npz"))):
        name = os.path.basename(p)[:-4]
        if names and name not in names:
            continue
        A = sp.load_npz(p).tocsr().astype(np.float32)
        A.sum_duplicates()
        A.sort_indices()
        if max_nnz and A.nnz > max_nnz:
            continue
        out.append((name, A))
    out.sort(key=lambda t: t[1].nnz)  # smallest first: a run cut short still covers most graphs
    return out


def _precision(params) -> str:
    return str(params.get("precision", "fp32"))


class Candidates:
    """Every (template, pipeline, parameters) the benchmark measures for one graph: each template's
    own pipelines (run once per graph and reused for every K: passes do not depend on K) with its
    seed configurations computed on the pipeline's output, and -- for templates without a pipeline
    of their own -- the best ``top`` configurations again behind each generic reordering, as the
    tuner's space offers them."""

    def __init__(self, reorders=("reorder.rcm", "reorder.degree"), top=2, max_seeds=None):
        self.max_seeds = max_seeds
        self.cache: dict = {}
        self.pass_s: dict = {}
        self.reorders = tuple(reorders)
        self.top = top

    def module(self, gname, sop, spec):
        from spcompile.passes import Pipeline

        key = (gname, json.dumps(spec, sort_keys=True))
        if key not in self.cache:
            t0 = time.perf_counter()
            try:
                self.cache[key] = Pipeline(spec)(SparseModule.from_op(sop))
            except Exception as e:  # a pass that fails on this graph: its templates are skipped
                self.cache[key] = e
            self.pass_s[key] = time.perf_counter() - t0
        m = self.cache[key]
        if isinstance(m, Exception):
            raise m
        return m.replace(op=sop)

    def first(self, tnames, gname, sop):
        from spcompile.passes import Pipeline

        mod0 = SparseModule.from_op(sop)
        res = []
        for t in tnames:
            tpl = get_template(t)
            if (sop.op, sop.reduce) not in tpl.ops or not tpl.available():
                continue
            for spec in tpl.pipelines(mod0):
                spec = Pipeline(spec).spec()
                try:
                    mod = self.module(gname, sop, spec) if spec else mod0
                except Exception as e:
                    print(f"  {gname}: pipeline {[p['name'] for p in spec]} failed: {type(e).__name__}: {e}"[:300])
                    continue
                if not tpl.supports(mod):
                    continue
                try:
                    seeds = tpl.seed_params(mod)
                except Exception:
                    seeds = [tpl.default_params(mod)]
                if spec:  # templates fed by their own pipelines: the first seeds only (time)
                    seeds = seeds[: self.max_seeds]
                for p in seeds:
                    res.append((t, spec, {**tpl.default_params(mod), **dict(p)}))
        return res

    def second(self, measured, gname, sop):
        """The best ``top`` configurations of each pipeline-free template behind each reordering."""
        from spcompile.passes import Pipeline

        res = []
        by_t: dict = {}
        for rec in measured:
            if "kernel_s" in rec and not rec["pipeline"] and rec["template"] != "extern.cusparse":
                by_t.setdefault(rec["template"], []).append(rec)
        for t, recs in by_t.items():
            recs.sort(key=lambda r: r["kernel_s"])
            for r in self.reorders:
                for rec in recs[: self.top]:
                    res.append((t, Pipeline([r]).spec(), rec["params"]))
        return res

    def build(self, gname, sop, tname, spec, params):
        mod = self.module(gname, sop, spec) if spec else None
        return build_from_config(sop, Config(tname, params, tuple(spec), "cuda"), module=mod)


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def run_bench(op: str, templates, ks, graphs, out_dir, tag, max_seeds=None, prior=None, dtype="float32"):
    """``dtype``: the workload's X / Y dtype.  For a 16-bit workload the cuSPARSE candidate runs in
    that dtype too (fp16 CSR); cuSPARSE fp32 on the same (rounded) X is measured as well for SpMM
    (``cusparse_fp32_kernel_s``), and "exact" means the workload's own precision or better."""
    import torch
    from spcompile.core.numerics import allowed_precisions

    tdt = getattr(torch, dtype)
    esz = 4 if dtype == "float32" else 2
    exact_prec = allowed_precisions("fp32", dtype)

    bw = copy_bandwidth(torch)
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = list(prior or [])
    t_start = time.time()
    cands = Candidates(max_seeds=max_seeds)
    for gname, A in graphs:
        cands.cache.clear()
        m, n = A.shape
        Ad = None
        for K in ks:
            if any(r["graph"] == gname and r["K"] == K for r in rows):
                continue  # measured in an earlier run (--merge)
            sop = make_op(A, op, K, "sum" if op == "spmm" else None, dtype=dtype)
            torch.manual_seed(K)
            if op == "spmm":
                ins = [torch.randn(n, K, device="cuda").to(tdt)]
                if Ad is None:
                    Ad = torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(np.int64)),
                                                 torch.from_numpy(A.indices.astype(np.int64)),
                                                 torch.from_numpy(A.data.astype(np.float64)), A.shape).cuda()
                ref = torch.sparse.mm(Ad, ins[0].double())
                out = torch.empty(m, K, device="cuda", dtype=tdt)
                floor_bytes = (m + 1) * 4 + A.nnz * 8 + n * K * esz + m * K * esz
            else:
                ins = [torch.randn(m, K, device="cuda").to(tdt), torch.randn(n, K, device="cuda").to(tdt)]
                rows_ = torch.from_numpy(np.repeat(np.arange(m), np.diff(A.indptr))).cuda()
                cols_ = torch.from_numpy(A.indices.astype(np.int64)).cuda()
                dat = torch.from_numpy(A.data.astype(np.float64)).cuda()
                ref = torch.empty(A.nnz, dtype=torch.float64, device="cuda")
                step = max(1, (1 << 27) // K)  # chunks: never materialise nnz x K doubles at once
                for c0 in range(0, A.nnz, step):
                    sl = slice(c0, c0 + step)
                    ref[sl] = dat[sl] * (ins[0].double()[rows_[sl]] * ins[1].double()[cols_[sl]]).sum(1)
                del rows_, cols_
                out = torch.empty(A.nnz, device="cuda", dtype=tdt)
                floor_bytes = (m + 1) * 4 + A.nnz * 8 + (m + n) * K * esz + A.nnz * esz
            refn = torch.linalg.norm(ref).item() or 1.0
            floor = floor_bytes / bw
            measured, mods = [], {}

            def measure(tname, spec, p):
                rec = {"template": tname, "pipeline": [q["name"] for q in spec], "params": p,
                       "precision": _precision(p)}
                try:
                    cm = cands.build(gname, sop, tname, spec, p)
                    out.fill_(float("nan"))
                    cm(*ins, out=out)
                    err = (torch.linalg.norm(out.double() - ref).item() / refn)
                    tdt = cm.kernel.meta.get("tolerance_dtype", "float32") if isinstance(cm.kernel.meta, dict) else "float32"
                    tol = max(1e-4 if tdt == "float32" else numerics.tolerance(tdt),
                              1e-4 if dtype == "float32" else numerics.tolerance(dtype))
                    if not (err <= tol):
                        rec["error"] = f"wrong result rel_err={err:.3g} (tolerance {tol:g}, {tdt})"
                    else:
                        rec["kernel_s"] = kernel_time(torch, lambda: cm(*ins, out=out))
                        rec["rel_err"] = err
                        mods[id(rec)] = cm
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                if "error" in rec:
                    print(f"  {gname} K={K} {tname} {rec['pipeline']} {p}: {rec['error']}", flush=True)
                measured.append(rec)

            for tname, spec, p in cands.first(templates, gname, sop):
                measure(tname, spec, p)
            for tname, spec, p in cands.second(measured, gname, sop):
                measure(tname, spec, p)
            ok = [r for r in measured if "kernel_s" in r]
            per_tpl: dict = {}
            for r in ok:  # per template its fastest configuration (any precision)
                if r["template"] not in per_tpl or r["kernel_s"] < per_tpl[r["template"]]["kernel_s"]:
                    per_tpl[r["template"]] = r
            if "extern.cusparse" not in per_tpl:
                print(f"  {gname} K={K}: no cuSPARSE result", flush=True)
                continue
            exact = [r for r in ok if r["precision"] in exact_prec]
            if not exact:
                print(f"  {gname} K={K}: no exact result", flush=True)
                continue
            tuned = min(exact, key=lambda r: r["kernel_s"])      # what build() picks by default (fp32)
            tuned_any = min(ok, key=lambda r: r["kernel_s"])     # precision="bf16": anything goes
            finals = {id(r): r for r in [*per_tpl.values(), tuned, tuned_any]}
            # re-measure the winners (selection noise) and their per-call latency
            for rid, rec in finals.items():
                cm = mods[rid]
                try:
                    rec["kernel_s"] = min(rec["kernel_s"], kernel_time(torch, lambda: cm(*ins, out=out)))
                    rec["latency_s"] = latency(torch, lambda: cm(*ins))
                except Exception as e:  # a winner that fails when run again is a bug: say so, drop it
                    rec["error"] = f"re-run failed: {type(e).__name__}: {e}"[:300]
                    print(f"  {gname} K={K} {rec['template']} {rec['params']}: {rec['error']}", flush=True)
                    rec.pop("kernel_s", None)
            ok = [r for r in ok if "kernel_s" in r]
            exact = [r for r in ok if r["precision"] in exact_prec]
            per_tpl = {t: r for t, r in per_tpl.items() if "kernel_s" in r}
            if "extern.cusparse" not in per_tpl or not exact:
                continue
            tuned = min(exact, key=lambda r: r["kernel_s"])
            tuned_any = min(ok, key=lambda r: r["kernel_s"])
            cus = per_tpl["extern.cusparse"]
            strip = lambda r: {k: v for k, v in r.items() if k != "template"}  # noqa: E731
            row = {"graph": gname, "m": m, "n": n, "nnz": int(A.nnz), "K": K, "floor_s": floor,
                   "cusparse_kernel_s": cus["kernel_s"], "cusparse_latency_s": cus["latency_s"],
                   "tuned_template": tuned["template"], "tuned_params": tuned["params"],
                   "tuned_pipeline": tuned["pipeline"],
                   "tuned_kernel_s": tuned["kernel_s"], "tuned_latency_s": tuned["latency_s"],
                   "tuned_any_template": tuned_any["template"], "tuned_any_params": tuned_any["params"],
                   "tuned_any_pipeline": tuned_any["pipeline"], "tuned_any_precision": tuned_any["precision"],
                   "tuned_any_kernel_s": tuned_any["kernel_s"],
                   "templates": {t: strip(r) for t, r in per_tpl.items()},
                   "n_candidates": len(measured), "n_failed": len(measured) - len(ok)}
            row["speedup_kernel"] = cus["kernel_s"] / row["tuned_kernel_s"]
            row["speedup_latency"] = cus["latency_s"] / row["tuned_latency_s"]
            row["speedup_kernel_any"] = cus["kernel_s"] / row["tuned_any_kernel_s"]
            row["floor_fraction"] = floor / row["tuned_kernel_s"]
            if dtype != "float32" and op == "spmm":   # the fp32 library path on the same values
                Ad32 = Ad.to(torch.float32)
                X32 = ins[0].float()
                row["dtype"] = dtype
                row["cusparse_fp32_kernel_s"] = kernel_time(torch, lambda: torch.sparse.mm(Ad32, X32))
                row["speedup_kernel_vs_fp32"] = row["cusparse_fp32_kernel_s"] / row["tuned_kernel_s"]
                row["speedup_kernel_any_vs_fp32"] = row["cusparse_fp32_kernel_s"] / row["tuned_any_kernel_s"]
                del Ad32, X32
            rows.append(row)
            print(f"{gname:28s} K={K:3d} nnz={A.nnz:8d} cusp {cus['kernel_s']*1e6:8.1f}us "
                  f"tuned {tuned['template']} {'+'.join(tuned['pipeline'])} {tuned['kernel_s']*1e6:8.1f}us "
                  f"x{row['speedup_kernel']:.2f} (any precision x{row['speedup_kernel_any']:.2f} {tuned_any['template']} "
                  f"{tuned_any['precision']}) lat x{row['speedup_latency']:.2f} floor {row['floor_fraction']:.2f} "
                  f"[{len(measured)} cand, {time.time() - t_start:.0f}s]", flush=True)
            del mods
            _write(rows, templates, bw, torch, out_dir, tag, final=False)  # partial results survive a timeout
    return _write(rows, templates, bw, torch, out_dir, tag, final=True)


def _write(rows, templates, bw, torch, out_dir, tag, final):
    summary = summarize(rows, templates)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{tag}.json"), "w") as f:
        json.dump({"copy_bandwidth_Bps": bw, "device": torch.cuda.get_device_name(), "rows": rows,
                   "summary": summary}, f, indent=1, default=str)
    dts = {r.get("dtype", "float32") for r in rows}
    md = markdown(rows, summary, templates, bw, torch.cuda.get_device_name(), tag, dts.pop() if len(dts) == 1 else "float32")
    with open(os.path.join(out_dir, f"{tag}.md"), "w") as f:
        f.write(md)
    if final:
        print(md.split("| graph |")[0])
    return rows, summary


def summarize(rows, templates):
    s = {}
    for K in sorted({r["K"] for r in rows}):
        rk = [r for r in rows if r["K"] == K]
        big = [r for r in rk if r["nnz"] > 200_000]
        d = {"graphs": len(rk),
             "geomean_kernel": geomean([r["speedup_kernel"] for r in rk]),
             "geomean_latency": geomean([r["speedup_latency"] for r in rk]),
             "geomean_kernel_over200k": geomean([r["speedup_kernel"] for r in big]),
             "worst_kernel": min(((r["speedup_kernel"], r["graph"]) for r in rk), default=None),
             "geomean_kernel_any": geomean([r.get("speedup_kernel_any", r["speedup_kernel"]) for r in rk]),
             "geomean_kernel_any_over200k": geomean([r.get("speedup_kernel_any", r["speedup_kernel"]) for r in big])}
        if any("speedup_kernel_vs_fp32" in r for r in rk):
            d["geomean_kernel_vs_fp32"] = geomean([r.get("speedup_kernel_vs_fp32") for r in rk])
            d["geomean_kernel_any_vs_fp32"] = geomean([r.get("speedup_kernel_any_vs_fp32") for r in rk])
            d["pairs_vs_fp32_ge2"] = sum(1 for r in rk if (r.get("speedup_kernel_vs_fp32") or 0) >= 2)
        for t in templates:
            if t == "extern.cusparse":
                continue
            sp_ = [r["cusparse_kernel_s"] / r["templates"][t]["kernel_s"] for r in rk if t in r["templates"]]
            d[f"geomean_kernel_{t}_only"] = geomean(sp_)
            d[f"graphs_{t}"] = len(sp_)
            d[f"wins_{t}"] = sum(1 for x in sp_ if x > 1.0)
            d[f"worst_kernel_{t}_only"] = min(((r["cusparse_kernel_s"] / r["templates"][t]["kernel_s"], r["graph"])
                                               for r in rk if t in r["templates"]), default=None)
        s[K] = d
    return s


def _cell(rec):
    if rec is None:
        return "-"
    tag = [] if rec.get("precision", "fp32") == "fp32" else [rec["precision"]]
    tag += [p.split(".")[-1] for p in rec.get("pipeline", []) if p.startswith("reorder.") or p.startswith("cluster.")]
    return f"{rec['kernel_s'] * 1e6:.1f}" + (f" ({','.join(tag)})" if tag else "")


def markdown(rows, summary, templates, bw, dev, tag, dtype="float32"):
    own = [t for t in templates if t != "extern.cusparse"]
    if dtype == "float32":
        what = ("Speed-ups are over cuSPARSE fp32 (torch.sparse). *tuned* = fastest exact-fp32 candidate (what "
                "`build()` picks with its default `precision='fp32'`); *any* = fastest candidate of any precision "
                "(`precision='bf16'`: tf32/fp16/bf16 tensor-core kernels admitted, each checked at its tolerance). ")
    else:
        what = (f"{dtype} workload: X and Y are {dtype}.  The cuSPARSE column and the x columns are cuSPARSE in "
                f"that dtype (torch.sparse.mm on a {dtype} CSR); the lines above compare with cuSPARSE fp32 on the "
                f"same values.  *tuned* = fastest candidate computing in the workload's own precision or better "
                f"(what `build(..., dtype='{dtype}')` picks with its default `precision='fp32'`); *any* = any "
                f"precision.  Every candidate was checked against float64 at the {dtype} tolerance. ")
    L = [f"## {tag}: {dev}, copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", "",
         "Kernel time: CUDA-graph replay / calls (us). Latency: median single call + sync from Python (us). "
         + what +
         "floor = memory-traffic floor / tuned kernel time.  Template cells: best configuration of that "
         "template (in brackets its precision and the reordering in front when not plain).", "",
         "| K | graphs | geomean tuned x | geomean any x | geomean latency x | tuned x (nnz>200k) | any x (nnz>200k) "
         "| worst tuned x | " + " | ".join(f"{t} alone: geomean / wins / worst" for t in own) + " |",
         "|---|---|---|---|---|---|---|---|" + "---|" * len(own)]
    for K, d in summary.items():
        if "geomean_kernel_vs_fp32" in d:
            L.insert(2, f"16-bit workload, K={K}: the tuned module (fp16/bf16 X / Y) is "
                        f"{d['geomean_kernel_vs_fp32']:.2f}x (geomean; any precision "
                        f"{d['geomean_kernel_any_vs_fp32']:.2f}x) over cuSPARSE **fp32** on the same values, "
                        f"{d['pairs_vs_fp32_ge2']} of {d['graphs']} graphs >= 2x; the table's cuSPARSE column "
                        f"and x columns are cuSPARSE in the workload's dtype.\n")
    for K, d in summary.items():
        w = d["worst_kernel"]
        cells = []
        for t in own:
            ww = d.get(f"worst_kernel_{t}_only")
            cells.append(f"{d.get(f'geomean_kernel_{t}_only', float('nan')):.2f} / "
                         f"{d.get(f'wins_{t}', 0)} of {d.get(f'graphs_{t}', 0)} / "
                         + (f"{ww[0]:.2f} ({ww[1]})" if ww else "-"))
        L.append(f"| {K} | {d['graphs']} | {d['geomean_kernel']:.2f} | {d.get('geomean_kernel_any', float('nan')):.2f} | "
                 f"{d['geomean_latency']:.2f} | {d['geomean_kernel_over200k']:.2f} | "
                 f"{d.get('geomean_kernel_any_over200k', float('nan')):.2f} | {w[0]:.2f} ({w[1]}) | "
                 + " | ".join(cells) + " |")
    L += ["", "| graph | nnz | K | cuSPARSE | " + " | ".join(own)
          + " | tuned | x | any | x any | cuSPARSE lat | tuned lat | x lat | floor frac | tuned config |",
          "|---|---|---|---|" + "---|" * len(own) + "---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [_cell(r["templates"].get(t)) for t in own]
        pipe = "+".join(r.get("tuned_pipeline", []))
        L.append(f"| {r['graph']} | {r['nnz']} | {r['K']} | {r['cusparse_kernel_s'] * 1e6:.1f} | " + " | ".join(cells)
                 + f" | {r['tuned_kernel_s'] * 1e6:.1f} | {r['speedup_kernel']:.2f} | "
                 f"{r.get('tuned_any_kernel_s', r['tuned_kernel_s']) * 1e6:.1f} | {r.get('speedup_kernel_any', r['speedup_kernel']):.2f} | "
                 f"{r['cusparse_latency_s'] * 1e6:.1f} | "
                 f"{r['tuned_latency_s'] * 1e6:.1f} | {r['speedup_latency']:.2f} | {r['floor_fraction']:.2f} | "
                 f"{(pipe + ' -> ') if pipe else ''}{r['tuned_template']} "
                 f"{json.dumps(r['tuned_params'], separators=(',', ':'))} |")
    return "\n".join(L) + "\n"


def _build_job(job):
    """Build (compile, cache) every first-stage candidate of one graph at the given widths."""
    op, templates, gname, path, ks, max_seeds, dtype = job
    A = sp.load_npz(path).tocsr().astype(np.float32)
    A.sum_duplicates()
    A.sort_indices()
    cands, n, fails = Candidates(max_seeds=max_seeds), 0, 0
    for K in ks:
        sop = make_op(A, op, K, "sum" if op == "spmm" else None, dtype=dtype)
        for tname, spec, p in cands.first(templates, gname, sop):
            n += 1
            try:
                cands.build(gname, sop, tname, spec, p)
            except Exception as e:
                fails += 1
                print(f"  build {gname} K={K} {tname} {p}: {type(e).__name__}: {e}"[:240], flush=True)
    return gname, n, fails, {k[1]: round(v, 2) for k, v in cands.pass_s.items()}


def build_only(op, templates, ks, names, jobs, max_seeds=None, dtype="float32"):
    """Compile every candidate's kernels into the kernel cache (no GPU needed), ``jobs`` graphs at a time."""
    import concurrent.futures as cf

    gdir = os.environ.get("SPCOMPILE_GRAPHS", "")
    todo = [(op, templates, os.path.basename(p)[:-4], p, ks, max_seeds, dtype) for p in sorted(glob.glob(os.path.join(gdir, "*.npz")),
                                                                         key=os.path.getsize)
            if names is None or os.path.basename(p)[:-4] in names]
    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=jobs) as ex:
        for gname, n, fails, pass_s in ex.map(_build_job, todo):
            print(f"built {gname}: {n} candidates, {fails} failed, passes {pass_s} [{time.time() - t0:.0f}s]", flush=True)
    return 0


def main(argv=None, op="spmm", default_templates=("extern.cusparse", "csr.crc_cwm")):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--K", type=int, nargs="*", default=list(KS))
    ap.add_argument("--graphs", nargs="*", default=None)
    ap.add_argument("--max-nnz", type=int, default=None)
    ap.add_argument("--templates", nargs="*", default=list(default_templates))
    ap.add_argument("--all-templates", action="store_true",
                    help="every available CUDA template for the op (tensor-core ones included)")
    ap.add_argument("--merge", nargs="*", default=[],
                    help="JSON files of earlier runs: their rows are kept and their (graph, K) not re-run")
    ap.add_argument("--skip", nargs="*", default=[], help="graphs to leave out (e.g. done in an earlier call)")
    ap.add_argument("--build-only", action="store_true",
                    help="only build every candidate (fills the kernel cache; no GPU needed)")
    ap.add_argument("--tag", default=None, help="name of the JSON / markdown files (default <op>_gpu)")
    ap.add_argument("--max-seeds", type=int, default=None,
                    help="at most this many seed configurations per pipeline of the templates that "
                         "have pass pipelines of their own (tensor-core, ASpT); CSR templates get all")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="X / Y dtype of the workload (16-bit: cuSPARSE fp32 measured as well, SpMM)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes for --build-only")
    a = ap.parse_args(argv)
    if a.all_templates:
        from spcompile.kernels import list_templates

        a.templates = ["extern.cusparse"] + [t.name for t in list_templates("cuda", available_only=True)
                                             if t.name != "extern.cusparse" and any(o[0] == op for o in t.ops)]
    if a.build_only:
        names = set(a.graphs) if a.graphs else None
        if a.skip:
            names = (names or {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(
                os.environ.get("SPCOMPILE_GRAPHS", ""), "*.npz"))}) - set(a.skip)
        return build_only(op, a.templates, a.K, names, a.jobs, a.max_seeds, a.dtype)
    graphs = [g for g in load_graphs(a.graphs, a.max_nnz) if g[0] not in a.skip]
    prior = []
    for path in a.merge:
        with open(path) as f:
            prior += [r for r in json.load(f)["rows"] if r["K"] in a.K]
    done = {(r["graph"], r["K"]) for r in prior}
    graphs = [g for g in graphs if any((g[0], K) not in done for K in a.K)]
    tag = a.tag or (f"{op}_gpu" if a.dtype == "float32" else f"{op}_gpu_{a.dtype}")
    run_bench(op, a.templates, a.K, graphs, a.out, tag, a.max_seeds, prior, a.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
