"""GPU check and benchmark of the tensor-core / tiled templates: tc.wmma_sgt (TC-GNN) and
aspt.tiled (ASpT, with and without cluster.lsh), against cuSPARSE fp32 (torch.sparse) and the
GE-SpMM CUDA-core template csr.crc_cwm.

Modes (combinable):
  --check      every GPU case of tests/test_tc_templates.py (random / clustered / tiny matrices with
               empty rows and a long row, K in {1, 19, 64, 128, 256}, sum and mean, every seed
               configuration, both pipelines per template) on fresh inputs with NaN-poisoned
               outputs against the float64 reference; tolerances tf32 2e-3, fp16 1e-2, bf16 2e-2,
               fp32 1e-5 (relative Frobenius error)
  --sanitize   a few small cases of every kernel variant family (run it under compute-sanitizer)
  --bench      shared graphs at K = 128 and 256: per template and pipeline the seed configurations
               are checked against float64 and timed (N calls captured in a CUDA graph, replayed
               between events); the fastest correct one is reported.  JSON + docs/tc_benchmark.md
  --build-only build every kernel of the selected modes without a GPU (fills the kernel cache)

Command used on the H100 (see docs/tc_benchmark.md):
    python benchmarks/tc_gpu.py --check --bench --out $OUT
"""
from __future__ import annotations

import argparse
import json
import math
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
          "tu_dd", "snap_email_enron"]
KS = (128, 256)
TOL = {"tf32": 2e-3, "fp16": 1e-2, "bf16": 2e-2, "fp32": 1e-5}


def _mod(A, K, reduce, pipe):
    return Pipeline(list(pipe))(SparseModule.from_op(make_op(A, "spmm", K, reduce)))


def _label(pipe):
    return "+".join(p["name"] if isinstance(p, dict) else (p if isinstance(p, str) else p[0]) for p in pipe) or "none"


# ------------------------------------------------------------------------------------------
def check_cases():
    """(label, A, K, reduce, template, module, params, tol) of the correctness check."""
    from conftest import random_matrix
    from test_tc_templates import MATRICES

    tc, at = get_template("tc.wmma_sgt"), get_template("aspt.tiled")
    mats = {"random": random_matrix(1500, 3000, density=0.002, seed=5), "clustered": MATRICES["clustered"](),
            "tiny": MATRICES["tiny"]()}
    for mname, A in mats.items():
        for K in (1, 19, 64, 128, 256):
            for reduce in ("sum", "mean"):
                base = _mod(A, K, reduce, ())
                for pipe in tc.pipelines(base):
                    mod = _mod(A, K, reduce, pipe)
                    for p in tc.seed_params(mod):
                        yield (f"{mname}/K{K}/{reduce}/tc[{pipe[0]['options']['shape']}]/{p}", A, K, reduce, tc,
                               mod, p, TOL[p["precision"]])
                for pipe in at.pipelines(base):
                    mod = _mod(A, K, reduce, pipe)
                    for p in at.seed_params(mod):
                        yield (f"{mname}/K{K}/{reduce}/aspt[{_label(pipe)}]/{p}", A, K, reduce, at, mod, p, TOL["fp32"])


def sanitize_cases():
    from conftest import random_matrix

    tc, at = get_template("tc.wmma_sgt"), get_template("aspt.tiled")
    A = random_matrix(200, 300, density=0.02, seed=11)
    for K in (19, 64):
        for pipe in tc.pipelines(_mod(A, K, "sum", ())):
            mod = _mod(A, K, "sum", pipe)
            d = tc.default_params(mod)
            for p in [d, {**d, "dense_a": 0}, {**d, "tiles_per_warp": 4, "warps_per_block": 2}] + \
                    [{**d, "precision": q} for q in tc._precisions(mod)]:
                yield (f"san/K{K}/tc/{p}", A, K, "sum", tc, mod, p, TOL[p["precision"]])
        for pipe in at.pipelines(_mod(A, K, "sum", ())):
            mod = _mod(A, K, "sum", pipe)
            for p in at.seed_params(mod)[:3]:
                yield (f"san/K{K}/aspt/{p}", A, K, "sum", at, mod, p, TOL["fp32"])


def _abs_csr(A):
    from spcompile.formats import CSR

    return CSR(A.indptr, A.indices, np.abs(np.asarray(A.data)), A.shape)


def run_checks(cases, build_only, log):
    fails = 0
    rng = np.random.default_rng(123)
    for label, A, K, reduce, tpl, mod, params, tol in cases:
        try:
            kern = tpl.build(mod, params)
            if build_only:
                continue
            import cupy

            X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
            out = cupy.full((A.shape[0], K), np.nan, dtype=cupy.float32)
            rt.call(kern, "cupy", [cupy.asarray(X)], out, out.shape)
            y = cupy.asnumpy(out)
            ref = reference.run("spmm", reduce, mod.op.A, X)
            err = reference.rel_error(y, ref)
            ok = err <= tol
            if not ok and tol > TOL["fp32"] and np.all(np.isfinite(y)):
                # reduced precision on outputs with cancellation (e.g. 3 values, K=1): the error is
                # bounded relative to |A| |X| (the rounding of each product), not to |A X|
                absA = mod.op.A.to_scipy() if hasattr(mod.op.A, "to_scipy") else None
                scale = reference.run("spmm", reduce, _abs_csr(mod.op.A), np.abs(X)) if absA is None else \
                    abs(absA) @ np.abs(X.astype(np.float64))
                err_abs = float(np.linalg.norm(y - ref) / max(np.linalg.norm(scale), 1e-300))
                ok = err_abs <= tol
                err = f"{err} (vs |A||X|: {err_abs:.2e})"
        except Exception as e:  # failures are data
            err, ok = repr(e)[:300], False
        fails += not ok
        log.append({"case": label, "err": err, "tol": tol, "ok": bool(ok)})
        if not ok:
            print("FAIL", label, err, flush=True)
    return fails


# ------------------------------------------------------------------------------------------
def bench_candidates(A, K):
    """(name, template, pipeline, [params]) per benchmarked variant."""
    tc, at, crc = get_template("tc.wmma_sgt"), get_template("aspt.tiled"), get_template("csr.crc_cwm")
    base = _mod(A, K, "sum", ())
    out = [("cusparse", get_template("extern.cusparse"), [], [{}]),
           ("csr.crc_cwm", crc, [], crc.seed_params(base)[:4])]
    p_tf, p_h = tc.pipelines(base)
    out.append(("tc.wmma_sgt tf32 16x8", tc, p_tf, None))
    out.append(("tc.wmma_sgt tf32 16x16", tc, p_h, "tf32"))
    out.append(("tc.wmma_sgt fp16", tc, p_h, "fp16"))
    out.append(("tc.wmma_sgt bf16", tc, p_h, "bf16"))
    p_plain, p_lsh = at.pipelines(base)
    out.append(("aspt.tiled", at, p_plain, None))
    out.append(("aspt.tiled +lsh", at, p_lsh, None))
    return out


def _tc_params(tc, mod, prec):
    d = tc.default_params(mod)
    seeds = [d, {**d, "dense_a": 0}, {**d, "tiles_per_warp": 1, "warps_per_block": 8},
             {**d, "tiles_per_warp": 4, "warps_per_block": 2}, {**d, "tiles_per_warp": 2, "warps_per_block": 2}]
    if prec:
        seeds = [{**s, "precision": prec} for s in seeds]
    return seeds


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
            if not build_only:
                torch.manual_seed(K)
                X = torch.randn(A.shape[1], K, device="cuda")
                Ad = torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(np.int64)),
                                             torch.from_numpy(A.indices.astype(np.int64)),
                                             torch.from_numpy(A.data.astype(np.float64)), A.shape).cuda()
                ref = torch.sparse.mm(Ad, X.double())
                out = torch.empty(A.shape[0], K, device="cuda")
            for name, tpl, pipe, plist in bench_candidates(A, K):
                t0 = time.perf_counter()
                mod = _mod(A, K, "sum", pipe)
                t_pass = time.perf_counter() - t0
                if plist is None or isinstance(plist, str):
                    plist = _tc_params(tpl, mod, plist) if tpl.name == "tc.wmma_sgt" else tpl.seed_params(mod)
                best = None
                prec = "fp32"
                for p in plist:
                    try:
                        kern = tpl.build(mod, p)
                        if build_only:
                            continue
                        prec = p.get("precision", "fp32")
                        out.fill_(float("nan"))
                        rt.call(kern, "torch", [X], out, out.shape)
                        torch.cuda.synchronize()
                        err = float((torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item())
                        if not err <= TOL[prec]:
                            print("WRONG", gname, K, name, p, err, flush=True)
                            continue
                        t = kernel_time(torch, lambda: rt.call(kern, "torch", [X], out, out.shape))
                    except Exception as e:
                        print("ERROR", gname, K, name, p, repr(e)[:300], flush=True)
                        continue
                    if best is None or t < best[0]:
                        best = (t, p, err)
                if build_only:
                    continue
                row = {"graph": gname, "m": A.shape[0], "nnz": int(A.nnz), "K": K, "variant": name,
                       "pipeline": _label(pipe), "pass_s": t_pass,
                       "time_us": best[0] * 1e6 if best else None, "params": best[1] if best else None,
                       "rel_err": best[2] if best else None}
                if tpl.name == "tc.wmma_sgt":
                    met = mod.metrics.get("tile.sgt", {})
                    row["sgt_density"] = met.get("density_after")
                    row["sgt_blocks"] = met.get("blocks_after")
                if tpl.name == "aspt.tiled":
                    row["dense_ratio"] = float(mod.formats["aspt"].dense_ratio)
                    row["lsh_applied"] = mod.row_perm is not None
                log_rows.append(row)
                print(json.dumps(row), flush=True)


def write_markdown(rows, path, device):
    by = {}
    for r in rows:
        by.setdefault((r["graph"], r["K"]), {})[r["variant"]] = r
    variants = ["cusparse", "csr.crc_cwm", "tc.wmma_sgt tf32 16x8", "tc.wmma_sgt tf32 16x16", "tc.wmma_sgt fp16",
                "tc.wmma_sgt bf16", "aspt.tiled", "aspt.tiled +lsh"]
    lines = [f"# tc.wmma_sgt / aspt.tiled benchmark ({device})", "",
             "SpMM sum, fp32 in/out; kernel time in microseconds (best correct seed configuration, CUDA-graph "
             "replay); in brackets the speed-up over cuSPARSE fp32 (torch.sparse.mm).  SGT density = nnz / "
             "(TC blocks x 128) of the 16x8 translation; dense = ASpT dense-tile ratio (without / with cluster.lsh).", "",
             "| graph | K | nnz | " + " | ".join(variants) + " | SGT density | dense |",
             "|---|---|---|" + "---|" * len(variants) + "---|---|"]
    for (g, K), d in by.items():
        cu = d.get("cusparse", {}).get("time_us")
        cells = []
        for v in variants:
            t = d.get(v, {}).get("time_us")
            cells.append("-" if t is None else (f"{t:.1f}" + (f" ({cu / t:.2f}x)" if cu and v != "cusparse" else "")))
        sg = d.get("tc.wmma_sgt tf32 16x8", {}).get("sgt_density")
        dr = [d.get(v, {}).get("dense_ratio") for v in ("aspt.tiled", "aspt.tiled +lsh")]
        nnz = next(iter(d.values()))["nnz"]
        lines.append(f"| {g} | {K} | {nnz} | " + " | ".join(cells) +
                     f" | {'-' if sg is None else f'{sg:.3f}'} | " +
                     " / ".join("-" if x is None else f"{x:.2f}" for x in dr) + " |")
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
