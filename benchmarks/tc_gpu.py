"""GPU check and benchmark of the TC-GNN templates tc.wmma_sgt (SpMM) and tc.wmma_sgt_sddmm (SDDMM)
against cuSPARSE fp32 (torch.sparse.mm / torch.sparse.sampled_addmm) and the CUDA-core templates
csr.crc_cwm (GE-SpMM) and csr.sddmm.  (aspt.tiled has its own benchmarks/aspt_gpu.py.)

Modes (combinable):
  --check      every GPU case of tests/test_tc_templates.py (random / clustered / tiny matrices with
               empty rows and a long row, K in {1, 19, 64, 128, 256}, sum and mean, SDDMM, every seed
               configuration, every pipeline per template) on fresh inputs with NaN-poisoned
               outputs against the float64 reference; tolerances tf32 2e-3, fp16 1e-2, bf16 2e-2,
               fp32 1e-5 (relative Frobenius error)
  --sanitize   a few small cases of every kernel variant family (run it under compute-sanitizer)
  --bench      shared graphs at K = 128 and 256, SpMM and SDDMM: per variant the listed
               configurations are checked against float64 and timed (calls captured in a CUDA
               graph, replayed between events); the fastest correct one is reported.
               JSON + tc_benchmark.md
  --build-only build every kernel of the selected modes without a GPU (fills the kernel cache)

Command used on the H100 (see docs/tc_benchmark.md):
    compute-sanitizer --tool memcheck python3 benchmarks/tc_gpu.py --sanitize --out $OUT/san
    python3 benchmarks/tc_gpu.py --check --bench --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import scipy.sparse as sp

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tests"))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))

from spcompile import reference  # noqa: E402
from spcompile.compiler import make_op  # noqa: E402
from spcompile.ir import SparseModule  # noqa: E402
from spcompile.passes import Pipeline  # noqa: E402
from spcompile.runtime import cuda as rt  # noqa: E402
from spcompile.schedules import get_template  # noqa: E402

GRAPHS = ["cora", "citeseer", "pubmed", "coauthor_cs", "amazon_computers", "blogcatalog", "fb100_amherst41",
          "ss_bcsstk13", "ss_bcsstk25_pattern", "dimacs10_rgg_n_2_15_s0", "dimacs10_delaunay_n15", "tu_enzymes",
          "tu_dd", "snap_email_enron", "wiki_squirrel", "twitch_de", "musae_facebook", "snap_sx_askubuntu"]
KS = (128, 256)
TOL = {"tf32": 2e-3, "fp16": 1e-2, "bf16": 2e-2, "fp32": 1e-5}


def _mod(A, K, reduce, pipe):
    op = make_op(A, "sddmm", K) if reduce is None else make_op(A, "spmm", K, reduce)
    return Pipeline(list(pipe))(SparseModule.from_op(op))


def _label(pipe):
    return "+".join(p["name"] if isinstance(p, dict) else (p if isinstance(p, str) else p[0]) for p in pipe) or "none"


# ------------------------------------------------------------------------------------------
def check_cases():
    """(label, A, K, reduce, template name, pipeline, params, tol) of the correctness check:
    exactly the GPU cases of the unit tests."""
    from test_tc_templates import gpu_cases

    return [c for c in gpu_cases() if c[4].startswith("tc.")]   # aspt.tiled: benchmarks/aspt_gpu.py


def sanitize_cases():
    """Small cases of every variant family (both impls, split windows, all precisions, SDDMM)."""
    from conftest import random_matrix

    tc, ts = get_template("tc.wmma_sgt"), get_template("tc.wmma_sgt_sddmm")
    A = random_matrix(200, 300, density=0.02, seed=11)
    out = []
    for K in (19, 64):
        for pipe in tc.pipelines(_mod(A, K, "sum", ())):
            mod = _mod(A, K, "sum", pipe)
            d, dw = tc._defaults(mod)
            ps = [d, {**d, "max_blocks": 2}, {**d, "max_blocks": 2, "col_groups": 2, "unroll": 1},
                  {**d, "max_blocks": 2, "unroll": 4, "col_groups": 1}, dw, {**dw, "dense_a": 0}]
            ps += [{**d, "precision": q, "max_blocks": 2, "unroll": 1} for q in tc._precisions(mod)]
            for p in ps:
                out.append((f"san/K{K}/tc/{p}", A, K, "sum", "tc.wmma_sgt", pipe, p, TOL[p["precision"]]))
        for pipe in ts.pipelines(_mod(A, K, None, ())):
            for p in ts.seed_params(_mod(A, K, None, pipe)):
                out.append((f"san/K{K}/sddmm/{p}", A, K, None, "tc.wmma_sgt_sddmm", pipe, p, TOL[p["precision"]]))
    return out


def run_checks(cases, build_only, log):
    from test_tc_templates import run_gpu_case

    fails = 0
    rng = np.random.default_rng(123)
    for label, A, K, reduce, tname, pipe, params, tol in cases:
        try:
            if build_only:
                get_template(tname).build(_mod(A, K, reduce, pipe), params)
                continue
            err = run_gpu_case(A, K, reduce, tname, pipe, params, rng)
            ok = bool(err <= tol)
        except Exception as e:  # failures are data
            err, ok = repr(e)[:300], False
        fails += not ok
        log.append({"case": label, "err": err, "tol": tol, "ok": ok})
        if not ok:
            print("FAIL", label, err, flush=True)
    return fails


# ------------------------------------------------------------------------------------------
SPMM_VARIANTS = ["cusparse", "csr.crc_cwm", "tc mma tf32 16x8", "tc mma tf32 16x16", "tc mma fp16", "tc mma bf16",
                 "tc wmma (v1) tf32 16x8", "tc wmma (v1) fp16"]
SDDMM_VARIANTS = ["cusparse", "csr.sddmm", "tc sddmm tf32 16x16", "tc sddmm tf32 16x8", "tc sddmm fp16",
                  "tc sddmm bf16"]


def bench_candidates(A, K, op):
    """(name, template, pipeline, params list | callable(mod) -> params list) per variant."""
    if op == "sddmm":
        ts, cs = get_template("tc.wmma_sgt_sddmm"), get_template("csr.sddmm")
        base = _mod(A, K, None, ())
        p16, p8 = ts.pipelines(base)

        def sd(prec, full):
            def f(mod):
                d = {**ts.default_params(mod), "precision": prec}
                return [d, {**d, "k_unroll": 3 - d["k_unroll"]}, {**d, "warps_per_block": 8}] if full else [d]
            return f
        return [("cusparse", get_template("extern.cusparse"), [], [{}]),
                ("csr.sddmm", cs, [], cs.seed_params(base)[:4]),
                ("tc sddmm tf32 16x16", ts, p16, sd("tf32", True)), ("tc sddmm tf32 16x8", ts, p8, sd("tf32", True)),
                ("tc sddmm fp16", ts, p16, sd("fp16", False)), ("tc sddmm bf16", ts, p16, sd("bf16", False))]
    tc, crc = get_template("tc.wmma_sgt"), get_template("csr.crc_cwm")
    base = _mod(A, K, "sum", ())
    p_tf, p_h = tc.pipelines(base)

    def mma(prec, full):
        def f(mod):
            d = {**tc._defaults(mod)[0], "precision": prec}
            seeds = [d, {**d, "max_blocks": 8}, {**d, "max_blocks": 128}, {**d, "unroll": 1}]
            if full:
                seeds += [{**d, "max_blocks": 0}, {**d, "unroll": 2}]
                cg2 = 2 if d["col_groups"] == 1 else 1
                seeds.append({**d, "col_groups": cg2, "unroll": 1 if cg2 == 2 else 4,
                              "warps_per_block": max(1, min(8, -(-K // (32 * cg2))))})
            return [s for s in seeds if tc.mma_ok(prec, mod.formats["sgt"].BLK_W, s["col_groups"], s["unroll"])]
        return f

    def wmma(prec):
        return lambda mod: [{**tc._defaults(mod)[1], "precision": prec}]
    return [("cusparse", get_template("extern.cusparse"), [], [{}]),
            ("csr.crc_cwm", crc, [], crc.seed_params(base)[:4]),
            ("tc mma tf32 16x8", tc, p_tf, mma("tf32", True)), ("tc mma tf32 16x16", tc, p_h, mma("tf32", False)),
            ("tc mma fp16", tc, p_h, mma("fp16", False)), ("tc mma bf16", tc, p_h, mma("bf16", False)),
            ("tc wmma (v1) tf32 16x8", tc, p_tf, wmma("tf32")), ("tc wmma (v1) fp16", tc, p_h, wmma("fp16"))]


def run_bench(graphs, build_only, log_rows):
    from conftest import load_graph

    if not build_only:
        import torch
        from spmm_gpu import kernel_time
    for gname in graphs:
        A = sp.csr_matrix(load_graph(gname)).astype(np.float32)
        A.sum_duplicates()
        A.sort_indices()
        for K in KS:
            for op in ("spmm", "sddmm"):
                reduce = "sum" if op == "spmm" else None
                if not build_only:
                    torch.manual_seed(K)
                    X = torch.randn(A.shape[0 if op == "sddmm" else 1], K, device="cuda")
                    ins = [X]
                    if op == "spmm":
                        Ad = torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(np.int64)),
                                                     torch.from_numpy(A.indices.astype(np.int64)),
                                                     torch.from_numpy(A.data.astype(np.float64)), A.shape).cuda()
                        ref = torch.sparse.mm(Ad, X.double())
                        out = torch.empty(A.shape[0], K, device="cuda")
                    else:
                        Yd = torch.randn(A.shape[1], K, device="cuda")
                        ins = [X, Yd]
                        rows = torch.from_numpy(np.repeat(np.arange(A.shape[0]), np.diff(A.indptr))).cuda()
                        cols = torch.from_numpy(A.indices.astype(np.int64)).cuda()
                        vals = torch.from_numpy(A.data.astype(np.float64)).cuda()
                        ref = vals * (X.double()[rows] * Yd.double()[cols]).sum(1)
                        out = torch.empty(A.nnz, device="cuda")
                for name, tpl, pipe, plist in bench_candidates(A, K, op):
                    t0 = time.perf_counter()
                    mod = _mod(A, K, reduce, pipe)
                    t_pass = time.perf_counter() - t0
                    if callable(plist):
                        plist = plist(mod)
                    best = None
                    for p in plist:
                        try:
                            kern = tpl.build(mod, p)
                            if build_only:
                                continue
                            prec = p.get("precision", "fp32")
                            out.fill_(float("nan"))
                            rt.call(kern, "torch", ins, out, out.shape)
                            torch.cuda.synchronize()
                            err = float((torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item())
                            if not err <= TOL[prec]:
                                print("WRONG", gname, K, op, name, p, err, flush=True)
                                continue
                            t = kernel_time(torch, lambda: rt.call(kern, "torch", ins, out, out.shape))
                        except Exception as e:
                            print("ERROR", gname, K, op, name, p, repr(e)[:300], flush=True)
                            continue
                        if best is None or t < best[0]:
                            best = (t, p, err)
                    if build_only:
                        continue
                    row = {"graph": gname, "m": A.shape[0], "nnz": int(A.nnz), "K": K, "op": op, "variant": name,
                           "pipeline": _label(pipe), "pass_s": t_pass,
                           "time_us": best[0] * 1e6 if best else None, "params": best[1] if best else None,
                           "rel_err": best[2] if best else None}
                    if tpl.name.startswith("tc."):
                        met = mod.metrics.get("tile.sgt", {})
                        row["sgt_density"] = met.get("density_after")
                        row["sgt_blocks"] = met.get("blocks_after")
                        fmt = mod.formats["sgt"]
                        row["max_win_blocks"] = int(np.max(fmt.win_partition, initial=0))
                        row["BW"] = fmt.BLK_W
                    log_rows.append(row)
                    print(json.dumps(row), flush=True)


def write_markdown(rows, path, device):
    lines = [f"# tc.wmma_sgt / tc.wmma_sgt_sddmm benchmark ({device})", ""]
    for op, variants in (("spmm", SPMM_VARIANTS), ("sddmm", SDDMM_VARIANTS)):
        by = {}
        for r in rows:
            if r.get("op", "spmm") == op:
                by.setdefault((r["graph"], r["K"]), {})[r["variant"]] = r
        if not by:
            continue
        lines += [f"## {op.upper()}", "",
                  "| graph | K | nnz | " + " | ".join(variants) + " | SGT density 16x%d | max blocks/window |"
                  % (8 if op == "spmm" else 16),
                  "|---|---|---|" + "---|" * len(variants) + "---|---|"]
        first_tc = variants[2]
        for (g, K), d in by.items():
            cu = d.get("cusparse", {}).get("time_us")
            cells = []
            for v in variants:
                t = d.get(v, {}).get("time_us")
                cells.append("-" if t is None else (f"{t:.1f}" + (f" ({cu / t:.2f}x)" if cu and v != "cusparse" else "")))
            sg = d.get(first_tc, {}).get("sgt_density")
            mw = d.get(first_tc, {}).get("max_win_blocks")
            nnz = next(iter(d.values()))["nnz"]
            lines.append(f"| {g} | {K} | {nnz} | " + " | ".join(cells) +
                         f" | {'-' if sg is None else f'{sg:.3f}'} | {'-' if mw is None else mw} |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    res = {"device": "none", "checks": [], "bench": []}
    if not a.build_only:
        import torch

        res["device"] = torch.cuda.get_device_name()
    fails = 0
    t0 = time.time()
    if a.sanitize:
        fails += run_checks(sanitize_cases(), a.build_only, res["checks"])
        print(f"sanitize cases: {len(res['checks'])}, failures {fails}", flush=True)
    if a.check:
        fails += run_checks(check_cases(), a.build_only, res["checks"])
        print(f"check cases: {len(res['checks'])}, failures {fails}, {time.time() - t0:.0f}s", flush=True)
    if a.bench:
        run_bench([g for g in a.graphs.split(",") if g], a.build_only, res["bench"])
    if not a.build_only:
        with open(os.path.join(a.out, "tc_gpu.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        if res["bench"]:
            write_markdown(res["bench"], os.path.join(a.out, "tc_benchmark.md"), res["device"])
    print(f"done in {time.time() - t0:.0f}s, failures {fails}", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
