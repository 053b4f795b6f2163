"""GPU check and benchmark of sptc.vnm (2:4 sparse-tensor-core SpMM, mma.sp m16n8k32) against
cuSPARSE fp32 (torch.sparse.mm on CSR).

Modes (combinable):
  --sanitize   a few small cases of every packing / kernel path (fp16 / bf16, block packing with a
               CSR remainder, condensed packing, split windows with atomics, K not a multiple of
               the slab width), NaN-poisoned outputs vs float64; run it under compute-sanitizer
  --bench      shared graphs at K = 128 and 256: cuSPARSE fp32 vs sptc.vnm variants:
                 "cond rcm"   reorder.rcm -> format.vnm, condensed packing (fp16; bf16 with the
                              best fp16 configuration)
                 "cond orig"  original order, condensed packing
                 "block vnm"  reorder.vnm (SOGRE) -> block packing (the v1 pipeline, new kernel)
               Each configuration is checked against float64 (relative Frobenius error) before it
               is timed (N calls captured in a CUDA graph, replayed between events; sptc times
               include the zero-rows and remainder kernels).  JSON + sptc_benchmark.md in --out.
  --perm-cache DIR  reorder.vnm permutations (+ metrics) cached as npz (computed on the CPU
               machine beforehand, so that the device does not spend its time in SOGRE).

Command used on the H100 (see docs/sptc_benchmark.md):
    python benchmarks/sptc_gpu.py --sanitize --bench --perm-cache .sptc_cache --out $OUT
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
from spcompile.kernels.sptc import template as sv  # noqa: E402
from spcompile.core.ir import SparseModule  # noqa: E402
from spcompile.passes import Pipeline  # noqa: E402
from spcompile.passes.reorder_vnm import vnm_format  # noqa: E402
from spcompile.runtime import cuda as rt  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402

GRAPHS = ["cora", "citeseer", "pubmed", "coauthor_cs", "amazon_computers", "blogcatalog", "snap_email_enron",
          "ss_bcsstk13", "ss_bcsstk25_pattern", "dimacs10_rgg_n_2_15_s0", "dimacs10_delaunay_n15", "walshaw_4elt",
          "ss_commanche_dual", "fb100_amherst41"]
KS = (128, 256)
TOL = {"fp16": 1e-2, "bf16": 2e-2}
VNM = [{"name": "reorder.vnm", "options": {"V": 1, "N": 2, "M": 4}}]
RCM = [{"name": "reorder.rcm"}, {"name": "format.vnm"}]
FMT = [{"name": "format.vnm"}]

_PACK_CACHE: dict = {}
_orig_pack = sv.pack_arrays


def _cached_pack(mod, precision="fp16", layout=sv.META_LAYOUT, pack="block"):
    key = (id(mod.A), id(mod.col_perm), id(mod.row_perm), mod.op.reduce, precision, layout, pack)
    if key not in _PACK_CACHE:
        _PACK_CACHE[key] = (mod, _orig_pack(mod, precision, layout, pack))
    return _PACK_CACHE[key][1]


sv.pack_arrays = _cached_pack  # build() packs once per (module, precision, packing); items per split


def load_vnm(gname, A, perm_cache):
    """reorder.vnm module of graph A (permutations from the npz cache when present)."""
    base = SparseModule.from_op(make_op(A, "spmm", 128, "sum"))
    path = os.path.join(perm_cache, f"vnm_{gname}.npz") if perm_cache else None
    if path and os.path.isfile(path):
        z = np.load(path, allow_pickle=False)
        rp, cp = z["rp"], z["cp"]
        met = json.loads(str(z["metrics"]))
        mod = base.permute(None if rp.size == 0 else rp, None if cp.size == 0 else cp)
        return mod.with_format("vnm", vnm_format(mod.A, 1, 2, 4)), met
    mod = Pipeline(list(VNM))(base)
    met = {k: v for k, v in mod.metrics["reorder.vnm"].items() if isinstance(v, (int, float, bool, str))}
    if path:
        os.makedirs(perm_cache, exist_ok=True)
        np.savez(path, rp=np.asarray(mod.row_perm if mod.row_perm is not None else [], np.int64),
                 cp=np.asarray(mod.col_perm if mod.col_perm is not None else [], np.int64),
                 metrics=json.dumps(met))
    return mod, met


def run_sanitize(log):
    import cupy
    from conftest import random_matrix

    t = get_template("sptc.vnm")
    fails = 0
    rng = np.random.default_rng(7)
    A = random_matrix(200, 300, density=0.03, seed=11)
    for K in (19, 64):
        for pname, pipe in (("vnm", VNM), ("rcm", RCM)):
            mod = Pipeline(list(pipe))(SparseModule.from_op(make_op(A, "spmm", K, "sum")))
            d = t.default_params(mod)
            for p in [d, {**d, "pack": "block", "split": 0}, {**d, "precision": "bf16", "split": 1},
                      {**d, "slabs_per_warp": 8, "warps_per_block": 1}]:
                kern = t.build(mod, p)
                X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
                out = cupy.full((A.shape[0], K), np.nan, dtype=cupy.float32)
                rt.call(kern, [cupy.asarray(X)], out)
                err = reference.rel_error(cupy.asnumpy(out), reference.run("spmm", "sum", mod.op.A, X))
                ok = bool(err <= TOL[p["precision"]])
                fails += not ok
                log.append({"case": f"K{K}/{pname}/{p}", "err": err, "ok": ok,
                            "remainder_nnz": kern.meta["remainder_nnz"], "items": kern.meta["items"]})
                print("sanitize", log[-1], flush=True)
    import torch

    for K in (19, 64):                  # 16-bit X / Y: scratch combine, 16-bit remainder, vector / scalar
        for dt, prec in (("float16", "fp16"), ("bfloat16", "bf16")):
            tdt = getattr(torch, dt)
            for pname, pipe in (("vnm", VNM), ("rcm", RCM)):
                mod = Pipeline(list(pipe))(SparseModule.from_op(make_op(A, "spmm", K, "sum", dtype=dt)))
                d = t.default_params(mod)
                for p in [d, {**d, "pack": "block", "split": 0}, {**d, "split": 1},
                          {**d, "slabs_per_warp": 8, "warps_per_block": 1, "split": 2}]:
                    kern = t.build(mod, p)
                    X = torch.randn(A.shape[1], K, device="cuda").to(tdt)
                    out = torch.full((A.shape[0], K), float("nan"), device="cuda", dtype=tdt)
                    rt.call(kern, [X], out, dtype=dt)
                    torch.cuda.synchronize()
                    ref = reference.run("spmm", "sum", mod.op.A, X.double().cpu().numpy())
                    err = reference.rel_error(out.double().cpu().numpy(), ref)
                    ok = bool(err <= TOL[prec])
                    fails += not ok
                    log.append({"case": f"K{K}/{dt}/{pname}/{p}", "err": err, "ok": ok,
                                "remainder_nnz": kern.meta["remainder_nnz"], "items": kern.meta["items"]})
                    print("sanitize", log[-1], flush=True)
    return fails


LSH = [{"name": "reorder.rcm"}, {"name": "cluster.lsh", "options": {"threshold_size": 16, "skip": False, "round": 1}},
       {"name": "format.vnm"}]

#: variant label -> (pipeline, X / Y dtype); "... bf16" variants rerun the best configuration of the
#: variant without the suffix in bf16 (operands and, for 16-bit I/O, X / Y)
VARIANT_DEFS = {
    "cond rcm": ("rcm", "float32"),
    "cond lsh": ("lsh", "float32"),
    "cond rcm io16": ("rcm", "float16"),
    "cond lsh io16": ("lsh", "float16"),
    "cond lsh io16 bf16": ("lsh", "bfloat16"),
    "cond orig": ("orig", "float32"),
    "block vnm": ("vnm", "float32"),
}
DEFAULT_VARIANTS = ["cond rcm", "cond lsh", "cond rcm io16", "cond lsh io16", "cond lsh io16 bf16"]
PIPES = {"rcm": RCM, "lsh": LSH, "orig": FMT}


def _configs(d, label):
    w2 = max(1, d["warps_per_block"] // 2)
    if label.startswith("cond rcm") or label.startswith("cond lsh"):
        cf = [d, {**d, "split": 4}, {**d, "split": 0}, {**d, "split": 32},
              {**d, "slabs_per_warp": 8, "warps_per_block": w2},
              {**d, "slabs_per_warp": 8, "warps_per_block": w2, "split": 4},
              {**d, "slabs_per_warp": 8, "warps_per_block": w2, "split": 32},
              {**d, "slabs_per_warp": 2, "warps_per_block": min(8, 2 * d["warps_per_block"])}]
        return cf if "io16" in label else cf + [{**d, "split": 2}]
    if label == "cond orig":
        return [d, {**d, "split": 2}, {**d, "split": 0}]
    return [{**d, "pack": "block"}, {**d, "pack": "block", "split": 2}, {**d, "pack": "block", "split": 32}]


def _time_best(torch, kernel_time, build, cfgs, X, out, ref, tol, tag, log):
    """Fastest of ``cfgs`` that matches ``ref`` (NaN-poisoned output) -> (seconds, params, err, meta)."""
    best, fails = None, 0
    for p in cfgs:
        try:
            kern = build(p)
            out.fill_(float("nan"))
            rt.call(kern, [X], out, dtype=str(out.dtype).replace("torch.", ""))
            torch.cuda.synchronize()
            err = float((torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item())
            if not err <= tol(p):
                print("WRONG", tag, p, err, flush=True)
                fails += 1
                continue
            dt = str(out.dtype).replace("torch.", "")
            tk = kernel_time(torch, lambda: rt.call(kern, [X], out, dtype=dt))
        except Exception as e:  # failures are data
            print("ERROR", tag, p, repr(e)[:300], flush=True)
            fails += 1
            continue
        log.append({"params": p, "us": tk * 1e6})
        if best is None or tk < best[0]:
            best = (tk, p, err, getattr(kern, "meta", {}))
    return best, fails


def run_bench(graphs, rows, perm_cache, variants=DEFAULT_VARIANTS, baselines=True):
    import torch
    from conftest import load_graph
    from spmm_gpu import kernel_time

    t = get_template("sptc.vnm")
    crc = get_template("csr.crc_cwm")
    fails = 0
    for gname in graphs:
        A = sp.csr_matrix(load_graph(gname)).astype(np.float32)
        A.sum_duplicates()
        A.sort_indices()
        mods, pass_s, met = {}, {}, {}
        for v in variants:
            pk = VARIANT_DEFS[v][0]
            if pk in mods:
                continue
            t0 = time.perf_counter()
            if pk == "vnm":
                mods[pk], met = load_vnm(gname, A, perm_cache)
            else:
                mods[pk] = Pipeline(list(PIPES[pk]))(SparseModule.from_op(make_op(A, "spmm", 128, "sum")))
            pass_s[pk] = time.perf_counter() - t0
        base16 = SparseModule.from_op(make_op(A, "spmm", 128, "sum", dtype="float16"))
        A64 = None
        for K in KS:
            torch.manual_seed(K)
            X = torch.randn(A.shape[1], K, device="cuda")
            Ad = torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(np.int64)),
                                         torch.from_numpy(A.indices.astype(np.int64)),
                                         torch.from_numpy(A.data.astype(np.float32)), A.shape).cuda()
            A64 = Ad.to(torch.float64)
            X16 = {"float16": X.half(), "bfloat16": X.bfloat16()}
            refs = {"float32": torch.sparse.mm(A64, X.double())}
            for dt, x in X16.items():
                refs[dt] = torch.sparse.mm(A64, x.double())
            outs = {"float32": torch.empty(A.shape[0], K, device="cuda"),
                    "float16": torch.empty(A.shape[0], K, device="cuda", dtype=torch.float16),
                    "bfloat16": torch.empty(A.shape[0], K, device="cuda", dtype=torch.bfloat16)}
            xs = {"float32": X, **X16}
            t_cu = kernel_time(torch, lambda: torch.sparse.mm(Ad, X))
            base = {"graph": gname, "m": A.shape[0], "nnz": int(A.nnz), "K": K, "cusparse_us": t_cu * 1e6,
                    "violations_before": met.get("violations_before"), "violations_after": met.get("violations_after"),
                    "pass_s": pass_s}
            if baselines:   # same-run 16-bit baselines: cuSPARSE fp16 and our CSR kernel on fp16 X / Y
                Ah = Ad.to(torch.float16)
                try:
                    oh = torch.sparse.mm(Ah, X16["float16"])
                    err = float((torch.linalg.norm(oh.double() - refs["float16"]) /
                                 torch.linalg.norm(refs["float16"])).item())
                    base["cusparse16_us"] = kernel_time(torch, lambda: torch.sparse.mm(Ah, X16["float16"])) * 1e6
                    base["cusparse16_err"] = err
                except Exception as e:  # noqa: BLE001
                    print("ERROR cusparse fp16", gname, K, repr(e)[:200], flush=True)
                log = []
                best = None
                for order, m0 in (("orig", base16), ("rcm", mods.get("rcm"))):
                    if m0 is None:
                        continue
                    mk = m0.replace(op=make_op(A, "spmm", K, "sum", dtype="float16"))
                    b, f = _time_best(torch, kernel_time, lambda p: crc.build(mk, p), crc.seed_params(mk),
                                      X16["float16"], outs["float16"], refs["float16"], lambda p: 1e-2,
                                      f"{gname} K{K} crc16 {order}", log)
                    fails += f
                    if b and (best is None or b[0] < best[0]):
                        best = (b[0], {**b[1], "order": order})
                base["crc16_us"] = best[0] * 1e6 if best else None
                base["crc16_params"] = best[1] if best else None
            bests = {}
            for label in variants:
                pk, dt = VARIANT_DEFS[label]
                mod = mods[pk].replace(op=make_op(A, "spmm", K, "sum", dtype=dt))
                d = t.default_params(mod)
                if label.endswith(" bf16"):
                    # the best io16 configuration in bf16; all of them where fp16 failed (e.g. outputs
                    # beyond the fp16 range: ss_bcsstk13's values reach 1.2e12)
                    src = bests.get(label[: -len(" bf16")])
                    cfgs = [{**src, "precision": "bf16"}] if src else \
                        [{**c, "precision": "bf16"} for c in _configs(d, label[: -len(" bf16")])]
                else:
                    cfgs = _configs(d, label)
                tried = []
                best, f = _time_best(torch, kernel_time, lambda p: t.build(mod, p), cfgs, xs[dt], outs[dt], refs[dt],
                                     lambda p: TOL[p["precision"]], f"{gname} K{K} {label}", tried)
                fails += f
                if best:
                    bests[label] = best[1]
                bm = best[3] if best else {}
                row = {**base, "variant": label, "dtype": dt, "time_us": best[0] * 1e6 if best else None,
                       "speedup": (t_cu / best[0]) if best else None, "params": best[1] if best else None,
                       "rel_err": best[2] if best else None, "tiles": bm.get("tiles"), "items": bm.get("items"),
                       "remainder_nnz": bm.get("remainder_nnz"), "nnz_per_tile": bm.get("nnz_per_tile"),
                       "gathered_rows": bm.get("gathered_rows"), "tried": tried}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "tried"}), flush=True)
        _PACK_CACHE.clear()
    return fails


def prebuild(graphs, variants=DEFAULT_VARIANTS, baselines=True):
    """CPU machine: build (compile into SPCOMPILE_KERNEL_CACHE) every kernel run_bench can build, so
    that the device compiles nothing.  bf16 variants: every configuration in bf16."""
    from conftest import load_graph

    t, crc = get_template("sptc.vnm"), get_template("csr.crc_cwm")
    n = 0
    for gname in graphs:
        A = sp.csr_matrix(load_graph(gname)).astype(np.float32)
        A.sum_duplicates()
        A.sort_indices()
        mods = {pk: Pipeline(list(PIPES[pk]))(SparseModule.from_op(make_op(A, "spmm", 128, "sum")))
                for pk in {VARIANT_DEFS[v][0] for v in variants} | {"rcm"} if pk in PIPES}
        for K in KS:
            if baselines:
                for m0 in (SparseModule.from_op(make_op(A, "spmm", K, "sum", dtype="float16")), mods["rcm"]):
                    mk = m0.replace(op=make_op(A, "spmm", K, "sum", dtype="float16"))
                    for p in crc.seed_params(mk):
                        crc.build(mk, p)
                        n += 1
            for label in variants:
                pk, dt = VARIANT_DEFS[label]
                if pk not in mods:
                    continue
                mod = mods[pk].replace(op=make_op(A, "spmm", K, "sum", dtype=dt))
                d = t.default_params(mod)
                cfgs = _configs(d, label[: -len(" bf16")] if label.endswith(" bf16") else label)
                for p in cfgs:
                    t.build(mod, p)
                    n += 1
        _PACK_CACHE.clear()
        print("prebuilt", gname, n, flush=True)
    return n


def _geo(x):
    x = [v for v in x if v]
    return float(np.exp(np.mean(np.log(x)))) if x else float("nan")


def write_markdown(rows, path, device, cmd):
    by = {}
    for r in rows:
        by.setdefault((r["graph"], r["K"]), {})[r["variant"]] = r
    variants = [v for v in VARIANT_DEFS if any(v in d for d in by.values())]
    has16 = any("cusparse16_us" in next(iter(d.values())) for d in by.values())
    lines = [f"# sptc.vnm benchmark ({device})", "",
             f"Measured on the device machine with `{cmd}`.", "",
             "SpMM sum; kernel time in microseconds (best correct configuration of those tried, CUDA-graph "
             "replay; sptc includes its zero / finish / remainder kernels); in brackets the speed-up over "
             "cuSPARSE fp32 (torch.sparse.mm, CSR, fp32 X / Y), measured in the same run.  Variants: "
             "cond = window-condensed 2:4 packing after reorder.rcm (rcm) or reorder.rcm -> cluster.lsh "
             "with 16-row clusters (lsh); fp32 X / Y converted to fp16 in registers, or io16 = fp16 X / Y "
             "used as loaded (half the gather and store bytes; bf16 = the best io16 configuration with bf16 "
             "X / Y); cond orig = original order; block vnm = reorder.vnm (SOGRE) + 32-column blocks + CSR "
             "remainder.  Same-run 16-bit baselines: cuSPARSE fp16 (torch.sparse.mm, fp16 CSR and X) and "
             "csr.crc_cwm fp16 (our CUDA-core kernel on fp16 X / Y, best of its seeds in original or RCM order); "
             "io16 / cuSP16 and io16 / crc16 compare the best io16 sptc variant with them.  reuse = nnz / X rows "
             "gathered (rcm -> lsh).", "",
             "| graph | K | nnz | cuSPARSE | " + " | ".join(variants) +
             (" | cuSPARSE fp16 | crc fp16 | io16 / cuSP16 | io16 / crc16" if has16 else "") + " | reuse | best io16 params |",
             "|---|---|---|---|" + "---|" * len(variants) + ("---|---|---|---|" if has16 else "") + "---|---|"]
    for (g, K), d in by.items():
        first = next(iter(d.values()))
        cells = []
        for v in variants:
            r = d.get(v, {})
            tt = r.get("time_us")
            cells.append("-" if tt is None else f"{tt:.1f} ({r['speedup']:.2f}x)")
        io = [d[v] for v in variants if "io16" in v and "bf16" not in v and d.get(v, {}).get("time_us")]
        bio = min(io, key=lambda r: r["time_us"]) if io else None
        if has16:
            c16, k16 = first.get("cusparse16_us"), first.get("crc16_us")
            cells.append("-" if c16 is None else f"{c16:.1f} ({first['cusparse_us'] / c16:.2f}x)")
            cells.append("-" if k16 is None else f"{k16:.1f} ({first['cusparse_us'] / k16:.2f}x)")
            cells.append("-" if not (bio and c16) else f"{c16 / bio['time_us']:.2f}x")
            cells.append("-" if not (bio and k16) else f"{k16 / bio['time_us']:.2f}x")
        reuse = []
        for v in ("cond rcm", "cond lsh"):
            r = d.get(v) or d.get(v + " io16") or {}
            reuse.append(f"{first['nnz'] / r['gathered_rows']:.2f}" if r.get("gathered_rows") else "-")
        pp = (bio or {}).get("params") or {}
        ps = f"{bio['variant'].split()[1]} W{pp.get('warps_per_block')} NT{pp.get('slabs_per_warp')} " \
             f"split{pp.get('split')}" if pp else "-"
        lines.append(f"| {g} | {K} | {first['nnz']} | {first['cusparse_us']:.1f} | " + " | ".join(cells) +
                     f" | {' -> '.join(reuse)} | {ps} |")
    lines.append("")
    for v in variants:
        spd = [d[v]["speedup"] for d in by.values() if d.get(v, {}).get("speedup")]
        if spd:
            lines.append(f"* geometric-mean speed-up of {v} over cuSPARSE fp32: {_geo(spd):.2f}x over {len(spd)} "
                         f"(graph, K) pairs, {sum(s >= 2 for s in spd)} pairs >= 2x")
    for name, keys in (("fp32 X / Y", [v for v in variants if "io16" not in v and "bf16" not in v]),
                       ("fp16 X / Y (io16)", [v for v in variants if "io16" in v and "bf16" not in v])):
        best = [max(d[v]["speedup"] for v in keys if d.get(v, {}).get("speedup"))
                for d in by.values() if any(d.get(v, {}).get("speedup") for v in keys)]
        if best:
            lines.append(f"* best sptc fp16 variant with {name} per (graph, K): geomean {_geo(best):.2f}x over "
                         f"cuSPARSE fp32, {sum(b >= 2 for b in best)} of {len(best)} pairs >= 2x, "
                         f"{sum(b >= 1 for b in best)} >= 1x")
    if has16:
        for key, name in (("cusparse16_us", "cuSPARSE fp16"), ("crc16_us", "csr.crc_cwm fp16")):
            rat = []
            for d in by.values():
                first = next(iter(d.values()))
                io = [d[v]["time_us"] for v in variants if "io16" in v and "bf16" not in v and d.get(v, {}).get("time_us")]
                if io and first.get(key):
                    rat.append(first[key] / min(io))
            if rat:
                lines.append(f"* best io16 sptc over {name} (same run): geomean {_geo(rat):.2f}x, "
                             f"{sum(r >= 1 for r in rat)} of {len(rat)} pairs >= 1x")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--perms-only", action="store_true", help="only fill --perm-cache (CPU)")
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help="comma-separated, of: " + ", ".join(VARIANT_DEFS))
    ap.add_argument("--build-only", action="store_true", help="CPU: compile every kernel the bench builds")
    ap.add_argument("--no-baselines", action="store_true", help="skip the cuSPARSE fp16 / crc fp16 baselines")
    ap.add_argument("--perm-cache", default="")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    graphs = [g for g in a.graphs.split(",") if g]
    if a.build_only:
        prebuild(graphs, [v for v in a.variants.split(",") if v], not a.no_baselines)
        return 0
    if a.perms_only:
        from conftest import load_graph

        for g in graphs:
            A = sp.csr_matrix(load_graph(g)).astype(np.float32)
            A.sum_duplicates()
            A.sort_indices()
            t0 = time.time()
            load_vnm(g, A, a.perm_cache)
            print(g, f"{time.time() - t0:.1f}s", flush=True)
        return 0
    import torch

    res = {"device": torch.cuda.get_device_name(), "checks": [], "bench": []}
    fails = 0
    t0 = time.time()
    if a.sanitize:
        fails += run_sanitize(res["checks"])
    if a.bench:
        variants = [v for v in a.variants.split(",") if v]
        bad = [v for v in variants if v not in VARIANT_DEFS]
        if bad:
            ap.error(f"unknown variants {bad}; choose from {list(VARIANT_DEFS)}")
        fails += run_bench(graphs, res["bench"], a.perm_cache, variants, not a.no_baselines)
        write_markdown(res["bench"], os.path.join(a.out, "sptc_benchmark.md"), res["device"],
                       "python benchmarks/sptc_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv))
    with open(os.path.join(a.out, "sptc_gpu.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"done in {time.time() - t0:.0f}s, failures {fails}", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
