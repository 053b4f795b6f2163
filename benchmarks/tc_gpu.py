"""GPU check and benchmark of the TC-GNN templates tc.wmma_sgt (SpMM) and tc.wmma_sgt_sddmm (SDDMM)
against cuSPARSE fp32 (torch.sparse.mm / torch.sparse.sampled_addmm) and the CUDA-core templates
csr.crc_cwm (GE-SpMM) and csr.sddmm.  (aspt.tiled has its own benchmarks/aspt_gpu.py.)

Modes (combinable):
  --check      every GPU case of tests/test_tc_templates.py (random / clustered / tiny matrices with
               empty rows and a long row, K in {1, 13, 64, 128, 256}, sum and mean, SDDMM, float32 /
               float16 / bfloat16 workloads, every seed configuration on the SGT pipelines, defaults
               on the window-reuse pipeline) on fresh inputs with NaN-poisoned outputs against the
               float64 reference on the values the kernel receives; tolerances tf32 2e-3, fp16 1e-2,
               bf16 2e-2, fp32 1e-5, 16-bit workloads 1e-2 (relative Frobenius error)
  --sanitize   a few small cases of every kernel variant family, fp32 and 16-bit (run it under
               compute-sanitizer)
  --bench      shared graphs at K = 128 and 256, SpMM and SDDMM: cuSPARSE fp32 / fp16, the CUDA-core
               templates on float32 and float16 workloads, the TC templates on fp32 inputs and on
               float16 / bfloat16 workloads, with and without the window-reuse pipeline (each
               pipeline run once per graph); per variant the listed configurations are checked
               against float64 and timed (calls captured in a CUDA graph, replayed between events);
               the fastest correct one is reported.  JSON + tc_benchmark.md
  --build-only build every kernel of the selected modes without a GPU (fills the kernel cache)

Command used on the H100 (see docs/tc_benchmark.md):
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/tc_gpu.py --sanitize --out $OUT/san
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

from spcompile.core import numerics, reference  # noqa: E402
from spcompile.compile import make_op  # noqa: E402
from spcompile.core.ir import SparseModule  # noqa: E402
from spcompile.passes import Pipeline  # noqa: E402
from spcompile.runtime import cuda as rt  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402

GRAPHS = ["cora", "citeseer", "pubmed", "coauthor_cs", "amazon_computers", "blogcatalog", "fb100_amherst41",
          "ss_bcsstk13", "ss_bcsstk25_pattern", "dimacs10_rgg_n_2_15_s0", "dimacs10_delaunay_n15", "tu_enzymes",
          "tu_dd", "snap_email_enron", "wiki_squirrel", "twitch_de", "musae_facebook", "snap_sx_askubuntu"]
KS = (128, 256)
TOL = {"tf32": 2e-3, "fp16": 1e-2, "bf16": 2e-2, "fp32": 1e-5}
TOL16 = 1e-2      # 16-bit inputs / outputs against float64 on the 16-bit input values


def _mod(A, K, reduce, pipe, dtype="float32"):
    op = make_op(A, "sddmm", K, None, dtype) if reduce is None else make_op(A, "spmm", K, reduce, dtype)
    return Pipeline(list(pipe))(SparseModule.from_op(op))


def _label(pipe):
    return "+".join(p["name"] if isinstance(p, dict) else (p if isinstance(p, str) else p[0]) for p in pipe) or "none"


# ------------------------------------------------------------------------------------------
def check_cases():
    """(label, A, K, reduce, template name, pipeline, params, tol, dtype) of the correctness check:
    exactly the GPU cases of the unit tests."""
    from test_tc_templates import gpu_cases

    return [c for c in gpu_cases() if c[4].startswith("tc.")]   # aspt.tiled: benchmarks/aspt_gpu.py


def sanitize_cases():
    """Small cases of every variant family (both impls, split windows, all precisions, SDDMM;
    fp32 inputs and 16-bit inputs with aligned (K = 64) and scalar (K = 13 / 19) loads)."""
    from conftest import random_matrix

    tc, ts = get_template("tc.wmma_sgt"), get_template("tc.wmma_sgt_sddmm")
    A = random_matrix(200, 300, density=0.02, seed=11)
    out = []
    for dtype, Ks in (("float32", (19, 64)), ("float16", (13, 64)), ("bfloat16", (13, 64))):
        for K in Ks:
            for pipe in tc.pipelines(_mod(A, K, "sum", (), dtype))[:2]:
                mod = _mod(A, K, "sum", pipe, dtype)
                d, dw = tc._defaults(mod)
                ps = [d, {**d, "max_blocks": 2}, {**d, "max_blocks": 2, "col_groups": 2, "unroll": 1},
                      {**d, "max_blocks": 2, "unroll": 4, "col_groups": 1}, dw, {**dw, "dense_a": 0}]
                ps += [{**d, "precision": q, "max_blocks": 2, "unroll": 1} for q in tc._precisions(mod)]
                for p in ps:
                    tol = TOL[p["precision"]] if dtype == "float32" else TOL16
                    out.append((f"san/K{K}/{dtype}/tc/{p}", A, K, "sum", "tc.wmma_sgt", pipe, p, tol, dtype))
            for pipe in ts.pipelines(_mod(A, K, None, (), dtype))[:2]:
                for p in ts.seed_params(_mod(A, K, None, pipe, dtype)):
                    tol = TOL[p["precision"]] if dtype == "float32" else TOL16
                    out.append((f"san/K{K}/{dtype}/sddmm/{p}", A, K, None, "tc.wmma_sgt_sddmm", pipe, p, tol, dtype))
    return out


def run_checks(cases, build_only, log):
    from test_tc_templates import run_gpu_case

    fails = 0
    rng = np.random.default_rng(123)
    for label, A, K, reduce, tname, pipe, params, tol, dtype in cases:
        try:
            if build_only:
                get_template(tname).build(_mod(A, K, reduce, pipe, dtype), params)
                continue
            err = run_gpu_case(A, K, reduce, tname, pipe, params, rng, dtype)
            ok = bool(err <= tol)
        except Exception as e:  # failures are data
            err, ok = repr(e)[:300], False
        fails += not ok
        log.append({"case": label, "err": err, "tol": tol, "ok": ok})
        if not ok:
            print("FAIL", label, err, flush=True)
    return fails


# ------------------------------------------------------------------------------------------
# benchmark: fp32 and 16-bit inputs, with and without the window-reuse pipeline
# ------------------------------------------------------------------------------------------
def _pipes():
    from spcompile.kernels.tc.template import WINDOW_REUSE

    sgt = lambda shape: [{"name": "tile.sgt", "options": {"shape": shape}}]  # noqa: E731
    return {"sgt16x8": sgt("tf32"), "sgt16x16": sgt("fp16"), "reuse16x16": [*WINDOW_REUSE, *sgt("fp16")]}


#: (column name, template, dtype, pipeline key, precision or None); pipeline None: no passes
SPMM_VARIANTS = [
    ("cusparse", "extern.cusparse", "float32", None, None),
    ("cusparse fp16", "extern.cusparse", "float16", None, None),
    ("csr.crc_cwm", "csr.crc_cwm", "float32", None, None),
    ("csr.crc_cwm fp16", "csr.crc_cwm", "float16", None, None),
    ("tc tf32 16x8", "tc.wmma_sgt", "float32", "sgt16x8", "tf32"),
    ("tc tf32 +reuse", "tc.wmma_sgt", "float32", "reuse16x16", "tf32"),
    ("tc fp16-op fp32-X", "tc.wmma_sgt", "float32", "sgt16x16", "fp16"),
    ("tc fp16-op fp32-X +reuse", "tc.wmma_sgt", "float32", "reuse16x16", "fp16"),
    ("tc fp16", "tc.wmma_sgt", "float16", "sgt16x16", "fp16"),
    ("tc bf16", "tc.wmma_sgt", "bfloat16", "sgt16x16", "bf16"),
    ("tc fp16 +reuse", "tc.wmma_sgt", "float16", "reuse16x16", "fp16"),
    ("tc bf16 +reuse", "tc.wmma_sgt", "bfloat16", "reuse16x16", "bf16"),
]
SDDMM_VARIANTS = [
    ("cusparse", "extern.cusparse", "float32", None, None),
    ("csr.sddmm", "csr.sddmm", "float32", None, None),
    ("csr.sddmm fp16", "csr.sddmm", "float16", None, None),
    ("tc sddmm tf32", "tc.wmma_sgt_sddmm", "float32", "sgt16x16", "tf32"),
    ("tc sddmm tf32 +reuse", "tc.wmma_sgt_sddmm", "float32", "reuse16x16", "tf32"),
    ("tc sddmm fp16", "tc.wmma_sgt_sddmm", "float16", "sgt16x16", "fp16"),
    ("tc sddmm bf16", "tc.wmma_sgt_sddmm", "bfloat16", "sgt16x16", "bf16"),
    ("tc sddmm fp16 +reuse", "tc.wmma_sgt_sddmm", "float16", "reuse16x16", "fp16"),
    ("tc sddmm bf16 +reuse", "tc.wmma_sgt_sddmm", "bfloat16", "reuse16x16", "bf16"),
]


def _params(tpl, mod, prec):
    """The configurations timed per variant (best correct one reported)."""
    if tpl.name == "extern.cusparse":
        return [{}]
    if tpl.name in ("csr.crc_cwm", "csr.sddmm"):
        return tpl.seed_params(mod)[:4]
    d = {**tpl.default_params(mod), "precision": prec}
    if tpl.name == "tc.wmma_sgt_sddmm":
        return [d, {**d, "k_unroll": 3 - d["k_unroll"]}, {**d, "warps_per_block": 8}]
    ti = int(mod.op.dtype != "float32")
    bw = mod.formats["sgt"].BLK_W
    seeds = [d, {**d, "max_blocks": 8}, {**d, "max_blocks": 128}, {**d, "unroll": 1}]
    groups = -(-mod.op.K // tpl._span(mod.op.dtype))
    if groups >= 2:
        cg2 = 2 if d["col_groups"] == 1 else 1
        seeds.append({**d, "col_groups": cg2, "unroll": 1 if cg2 == 2 else 4,
                      "warps_per_block": max(1, min(8, -(-groups // cg2)))})
    return [s for s in seeds if tpl.mma_ok(prec, bw, s["col_groups"], s["unroll"], ti)]


def _with_op(mod, op, K, dtype):
    """A pipeline output re-used for another op / K / dtype (the passes depend on A alone)."""
    import dataclasses

    return mod.replace(op=dataclasses.replace(mod.op, op=op, reduce="sum" if op == "spmm" else None, K=K,
                                              dtype=dtype))


def run_bench(graphs, build_only, log_rows, out_dir=None):
    from conftest import load_graph

    if not build_only:
        import torch
        from spmm_gpu import kernel_time
    pipes = _pipes()
    for gname in graphs:
        A = sp.csr_matrix(load_graph(gname)).astype(np.float32)
        A.sum_duplicates()
        A.sort_indices()
        base = SparseModule.from_op(make_op(A, "spmm", 128, "sum"))
        mods, pass_s = {}, {}
        for key, pipe in pipes.items():                    # each pipeline once per graph
            t0 = time.perf_counter()
            mods[key] = Pipeline(list(pipe))(base)
            pass_s[key] = time.perf_counter() - t0
        mods[None], pass_s[None] = base, 0.0
        sgt = {k: dict(mods[k].metrics["tile.sgt"]) for k in pipes}
        for K in KS:
            for op, variants in (("spmm", SPMM_VARIANTS), ("sddmm", SDDMM_VARIANTS)):
                if not build_only:
                    torch.manual_seed(K)
                    X32 = torch.randn(A.shape[0 if op == "sddmm" else 1], K, device="cuda")
                    Y32 = torch.randn(A.shape[1], K, device="cuda") if op == "sddmm" else None
                    refs = {}
                for name, tname, dtype, pkey, prec in variants:
                    tpl = get_template(tname)
                    mod = _with_op(mods[pkey], op, K, dtype)
                    best = None
                    if not build_only:
                        tdt = getattr(torch, dtype)
                        ins = [X32.to(tdt)] + ([Y32.to(tdt)] if op == "sddmm" else [])
                        if dtype not in refs:              # float64 reference on the values the kernel gets
                            Xd = ins[0].double()
                            if op == "spmm":
                                Ad = torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(np.int64)),
                                                             torch.from_numpy(A.indices.astype(np.int64)),
                                                             torch.from_numpy(A.data.astype(np.float64)),
                                                             A.shape).cuda()
                                refs[dtype] = torch.sparse.mm(Ad, Xd)
                            else:
                                rows = torch.from_numpy(np.repeat(np.arange(A.shape[0]), np.diff(A.indptr))).cuda()
                                cols = torch.from_numpy(A.indices.astype(np.int64)).cuda()
                                vals = torch.from_numpy(A.data.astype(np.float64)).cuda()
                                refs[dtype] = vals * (Xd[rows] * ins[1].double()[cols]).sum(1)
                        ref = refs[dtype]
                        out = torch.empty(tuple(ref.shape), dtype=tdt, device="cuda")
                    for p in _params(tpl, mod, prec):
                        try:
                            kern = tpl.build(mod, p)
                            if build_only:
                                continue
                            out.fill_(float("nan"))
                            rt.call(kern, ins, out, dtype=dtype)
                            torch.cuda.synchronize()
                            err = float((torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item())
                            tol = TOL16 if dtype != "float32" else TOL[p.get("precision", "fp32")]
                            if not err <= tol:
                                print("WRONG", gname, K, op, name, p, err, flush=True)
                                continue
                            t = kernel_time(torch, lambda: rt.call(kern, ins, out, dtype=dtype))
                        except Exception as e:
                            print("ERROR", gname, K, op, name, p, repr(e)[:300], flush=True)
                            continue
                        if best is None or t < best[0]:
                            best = (t, p, err)
                    if build_only:
                        continue
                    row = {"graph": gname, "m": A.shape[0], "nnz": int(A.nnz), "K": K, "op": op, "variant": name,
                           "dtype": dtype, "pipeline": _label(pipes[pkey]) if pkey else "none",
                           "pass_s": pass_s[pkey], "time_us": best[0] * 1e6 if best else None,
                           "params": best[1] if best else None, "rel_err": best[2] if best else None}
                    if pkey:
                        row.update(sgt_blocks=sgt[pkey]["blocks_after"], sgt_nnz_per_block=sgt[pkey]["nnz_per_block"],
                                   sgt_reuse=sgt[pkey]["reuse"],
                                   max_win_blocks=int(np.max(mods[pkey].formats["sgt"].win_partition, initial=0)))
                    log_rows.append(row)
                    print(json.dumps(row), flush=True)
        if out_dir and not build_only:                    # partial results survive a time-out
            with open(os.path.join(out_dir, "tc_bench_partial.json"), "w") as f:
                json.dump(log_rows, f, default=str)


def write_markdown(rows, path, device):
    lines = [f"# tc.wmma_sgt / tc.wmma_sgt_sddmm benchmark ({device})", ""]
    for op, variants in (("spmm", SPMM_VARIANTS), ("sddmm", SDDMM_VARIANTS)):
        names = [v[0] for v in variants]
        by = {}
        for r in rows:
            if r.get("op", "spmm") == op:
                by.setdefault((r["graph"], r["K"]), {})[r["variant"]] = r
        if not by:
            continue
        lines += [f"## {op.upper()}", "",
                  "| graph | K | nnz | " + " | ".join(names) + " | SGT 16x16 blocks / nnz per block / reuse | "
                  "+reuse: blocks / nnz per block / reuse |",
                  "|---|---|---|" + "---|" * len(names) + "---|---|"]
        plain = next(n for n, _, _, pk, _ in variants if pk == "sgt16x16")
        reuse = next(n for n, _, _, pk, _ in variants if pk == "reuse16x16")
        for (g, K), d in by.items():
            cu = d.get("cusparse", {}).get("time_us")
            cells = []
            for v in names:
                t = d.get(v, {}).get("time_us")
                cells.append("-" if t is None else (f"{t:.1f}" + (f" ({cu / t:.2f}x)" if cu and v != "cusparse" else "")))
            sg = []
            for v in (plain, reuse):
                r = d.get(v, {})
                sg.append("-" if r.get("sgt_blocks") is None else
                          f"{r['sgt_blocks']} / {r['sgt_nnz_per_block']:.1f} / {r['sgt_reuse']:.2f}")
            nnz = next(iter(d.values()))["nnz"]
            lines.append(f"| {g} | {K} | {nnz} | " + " | ".join(cells) + f" | {sg[0]} | {sg[1]} |")
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
        run_bench([g for g in a.graphs.split(",") if g], a.build_only, res["bench"], a.out)
    if not a.build_only:
        with open(os.path.join(a.out, "tc_gpu.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        if res["bench"]:
            write_markdown(res["bench"], os.path.join(a.out, "tc_benchmark.md"), res["device"])
    print(f"done in {time.time() - t0:.0f}s, failures {fails}", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
