"""Device-side correctness check of the CUDA templates (run on a GPU machine).

For every CUDA template x reduction x K in {1, 3, 32, 100, 128} and several parameter sets (the
template's seeds plus every coarsening factor with split rows): random matrices with empty rows
and one 10k-nonzero row, inputs as torch CUDA tensors, CuPy arrays and numpy arrays in turn, the
output poisoned with NaN before every run, compared with the float64 reference.  Then 16-bit inputs
(float16 / bfloat16, fp32 accumulation: every reduction, odd K and K=1, torch and CuPy arrays, at
the fp16/bf16 tolerance against the float64 reference of the rounded inputs), the template families
that run behind their own pipelines (tensor-core SGT, sparse tensor-core V:N:M, ASpT: defaults and seeds
at every precision and dtype they take), the smallest graphs of the graph folder, and save/load of a
CUDA module.  (Per-call overhead: ``benchmarks/bench.py
--call-overhead``.)

    python benchmarks/gpu_check.py --out DIR            # full check, JSON log in DIR
    python benchmarks/gpu_check.py --quick              # small, for compute-sanitizer memcheck
    python benchmarks/gpu_check.py --precompile         # CPU only: fill the kernel cache
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

from spcompile.core import numerics, reference  # noqa: E402
from spcompile.compile import build_from_config, make_op  # noqa: E402
from spcompile.core.ir import SparseModule  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402
from spcompile.kernels.base import unique_params  # noqa: E402

KS = (1, 3, 32, 100, 128)
REDUCES = ("sum", "max", "min", "mean")


def random_matrix(seed: int, m=3000, n=12000, density=0.001, long_row=10000, empty_frac=0.1):
    rng = np.random.default_rng(seed)
    A = sp.random(m, n, density=density, format="lil", random_state=rng, dtype=np.float32,
                  data_rvs=lambda k: rng.standard_normal(k).astype(np.float32))
    empty = rng.choice(m, int(empty_frac * m), replace=False)
    for i in empty:
        A.rows[i] = []
        A.data[i] = []
    A = A.tocsr()
    if long_row:
        r = int(rng.integers(m))
        cols = np.sort(rng.choice(n, long_row, replace=False))
        L = sp.csr_matrix((rng.standard_normal(long_row).astype(np.float32), (np.full(long_row, r), cols)), shape=(m, n))
        A = A.tolil()
        A.rows[r] = []
        A.data[r] = []
        A = (A.tocsr() + L).tocsr()
    A.sort_indices()
    return A


def param_sets(tpl, mod):
    sets = list(tpl.seed_params(mod))
    if tpl.name == "csr.crc_cwm":
        d = tpl.default_params(mod)
        for cf in (1, 2, 4, 8):
            sets.append({**d, "group": 32, "vec": 1, "cf": cf, "max_seg": 64})
        sets.append({**d, "group": 8, "vec": 4, "cf": 1, "max_seg": 1024, "rows_per_warp": 4})
        sets.append({**d, "group": 4, "vec": 2, "cf": 2, "max_seg": 0, "warps_per_block": 8})
    elif tpl.name == "csr.sddmm":
        sets.append({**tpl.default_params(mod), "k_chunks": 1, "group": 4})   # multi-tile path
        sets.append({**tpl.default_params(mod), "vec": 1, "k_chunks": 8, "group": 32})
        sets.append({**tpl.default_params(mod), "k_chunks": 1, "group": 4, "unroll": 4})     # multi-tile, batched
        sets.append({**tpl.default_params(mod), "k_chunks": 1, "group": 8, "flat": 1, "unroll": 2})
    return unique_params(sets)


def cases(quick: bool):
    """(template, op, reduce, K) combinations."""
    ks = (3, 32) if quick else KS
    reds = ("sum", "max") if quick else REDUCES
    for K in ks:
        for r in reds:
            yield "csr.crc_cwm", "spmm", r, K
            if r in ("sum", "mean"):
                yield "extern.cusparse", "spmm", r, K
        yield "csr.sddmm", "sddmm", None, K
        yield "extern.cusparse", "sddmm", None, K


def precompile(quick: bool):
    """Build every configuration the check uses (compiles into the kernel cache; no GPU)."""
    A = random_matrix(0, m=200, n=12000, density=0.01)
    n = 0
    for tname, op, red, K in cases(quick):
        tpl = get_template(tname)
        if tname.startswith("extern"):
            continue
        mod = SparseModule.from_op(make_op(A, op, K, red))
        for p in param_sets(tpl, mod):
            tpl.build(mod, p)
            n += 1
    for tname, op, red, K, dt in half_cases(quick):
        tpl = get_template(tname)
        if tname.startswith("extern"):
            continue
        mod = SparseModule.from_op(make_op(A, op, K, red, dtype=dt))
        for p in half_param_sets(tpl, mod):
            tpl.build(mod, p)
            n += 1
    return n


def _inputs(kind, arrays):
    if kind == "numpy":
        return list(arrays)
    if kind == "torch":
        import torch

        return [torch.from_numpy(a).cuda() for a in arrays]
    import cupy

    return [cupy.asarray(a) for a in arrays]


def _poisoned(kind, shape):
    if kind == "numpy":
        return np.full(shape, np.nan, dtype=np.float32)
    if kind == "torch":
        import torch

        return torch.full(shape, float("nan"), dtype=torch.float32, device="cuda")
    import cupy

    return cupy.full(shape, np.nan, dtype=cupy.float32)


def _host(x):
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        return x.cpu().numpy()
    return x.get()


def check_matrix(A, label, quick, log, kinds=("torch", "cupy", "numpy"), templates=None):
    fails = 0
    rng = np.random.default_rng(1)
    i = 0
    for tname, op, red, K in cases(quick):
        if templates and tname not in templates:
            continue
        tpl = get_template(tname)
        sop = make_op(A, op, K, red)
        mod = SparseModule.from_op(sop)
        inputs = [rng.standard_normal(s).astype(np.float32) for s in sop.input_shapes]
        ref = reference.run(op, red, sop.A, *inputs)
        psets = param_sets(tpl, mod) if not quick else param_sets(tpl, mod)[:3]
        for p in psets:
            kind = kinds[i % len(kinds)]
            i += 1
            rec = {"matrix": label, "template": tname, "op": op, "reduce": red, "K": K, "params": p, "kind": kind}
            try:
                cm = build_from_config(sop, Config(tname, p, (), "cuda", tpl.format))
                out = _poisoned(kind, sop.output_shape)
                res = cm(*_inputs(kind, inputs), out=out)
                err = reference.rel_error(_host(res), ref)
                rec["rel_err"] = err
                rec["ok"] = bool(err <= 1e-5)
            except Exception as e:  # results are data
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
            fails += not rec["ok"]
            log.append(rec)
            if not rec["ok"]:
                print("FAIL", json.dumps(rec, default=str), flush=True)
    return fails


HALF_DTYPES = ("float16", "bfloat16")
HALF_KS = (1, 3, 32, 100, 128)


def half_cases(quick: bool = False):
    """(template, op, reduce, K, dtype) of the 16-bit input checks."""
    ks = (3, 32) if quick else HALF_KS
    for dt in HALF_DTYPES:
        for K in ks:
            for r in (("sum", "max") if quick else REDUCES):
                yield "csr.crc_cwm", "spmm", r, K, dt
            yield "csr.sddmm", "sddmm", None, K, dt
            if not quick and dt == "float16":   # cuSPARSE via torch: SpMM float16 only (see templates.py)
                yield "extern.cusparse", "spmm", "sum", K, dt
                yield "extern.cusparse", "spmm", "mean", K, dt


def half_param_sets(tpl, mod):
    """A few configurations per 16-bit case: default, split rows with every unroll depth, the widest
    and the scalar vector width, sub-warp groups."""
    d = tpl.default_params(mod)
    if tpl.name == "csr.crc_cwm":
        sets = [d, {**d, "max_seg": 16, "unroll": 8, "vec": 8}, {**d, "max_seg": 64, "unroll": 1, "vec": 1},
                {**d, "group": 8, "cf": 2, "vec": 2, "max_seg": 32, "unroll": 4},
                {**d, "group": 32, "cf": 4, "vec": 4, "max_seg": 8, "unroll": 2, "rows_per_warp": 2}]
    elif tpl.name == "csr.sddmm":
        sets = [d, {**d, "vec": 8, "group": 4, "k_chunks": 1}, {**d, "vec": 1, "k_chunks": 4, "group": 32},
                {**d, "unroll": 4}, {**d, "vec": 8, "group": 4, "k_chunks": 2, "flat": 1, "unroll": 2}]
    else:
        sets = [d]
    return unique_params(sets)


def _to_kind(kind, a, dtype):
    """A float32 host array as a ``dtype`` array of ``kind`` (torch or cupy)."""
    import torch

    t = torch.from_numpy(a).cuda().to(getattr(torch, dtype))
    if kind == "torch":
        return t
    import cupy

    return cupy.from_dlpack(t)


def check_half(A, label, log, quick=False, templates=None, kinds=("torch", "cupy")):
    """16-bit inputs: result dtype = input dtype, error vs the float64 reference of the *rounded*
    inputs <= numerics.tolerance(dtype), output poisoned with NaN before the call."""
    import torch

    fails = 0
    rng = np.random.default_rng(2)
    i = 0
    for tname, op, red, K, dt in half_cases(quick):
        if templates and tname not in templates:
            continue
        tpl = get_template(tname)
        sop = make_op(A, op, K, red, dtype=dt)
        mod = SparseModule.from_op(sop)
        ins32 = [rng.standard_normal(s).astype(np.float32) for s in sop.input_shapes]
        for p in half_param_sets(tpl, mod):
            kind = kinds[i % len(kinds)] if dt == "float16" else "torch"   # cupy: no bfloat16 arrays
            i += 1
            rec = {"matrix": label, "template": tname, "op": op, "reduce": red, "K": K, "dtype": dt,
                   "params": p, "kind": kind}
            try:
                xs = [_to_kind(kind, a, dt) for a in ins32]
                rounded = [torch.from_numpy(a).to(getattr(torch, dt)).double().numpy() for a in ins32]
                ref = reference.run(op, red, sop.A, *rounded)
                cm = build_from_config(sop, Config(tname, p, (), "cuda", tpl.format))
                out = _to_kind(kind, np.full(sop.output_shape, np.nan, np.float32), dt)
                res = cm(*xs, out=out)
                res2 = cm(*xs)                                   # allocated output
                ok_dtype = str(res2.dtype).replace("torch.", "") == dt and res is out
                host = torch.from_dlpack(res).double().cpu().numpy()
                err = reference.rel_error(host, ref)
                rec["rel_err"] = err
                rec["ok"] = bool(err <= numerics.tolerance(dt)) and ok_dtype
                if not ok_dtype:
                    rec["error"] = f"result dtype {res2.dtype}, expected {dt}"
            except Exception as e:  # results are data
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
            fails += not rec["ok"]
            log.append(rec)
            if not rec["ok"]:
                print("FAIL", json.dumps(rec, default=str), flush=True)
    return fails


class _NONE:  # a distribution stand-in with no choices
    choices = ()


#: the families that run behind their own pipelines (formats made by passes)
FAMILY_TEMPLATES = ("tc.wmma_sgt", "tc.wmma_sgt_sddmm", "sptc.vnm", "aspt.tiled")


def check_families(A, label, log, Ks=(1, 33, 64), seeds: int = 2):
    """Every template of :data:`FAMILY_TEMPLATES` behind each of its own pipelines: its default
    parameters and first ``seeds`` seed configurations at every precision it offers, for each K
    and dtype it takes; torch inputs, output poisoned with NaN, checked against the float64
    reference of the rounded inputs at max(tolerance(precision), tolerance(dtype))."""
    import torch

    from spcompile.passes import Pipeline

    fails = 0
    rng = np.random.default_rng(3)
    for tname in FAMILY_TEMPLATES:
        tpl = get_template(tname)
        for (op, red) in tpl.ops[:1]:
            for dt in tpl.dtypes:
                for K in Ks:
                    sop = make_op(A, op, K, red, dtype=dt)
                    mod0 = SparseModule.from_op(sop)
                    ins32 = [rng.standard_normal(s).astype(np.float32) for s in sop.input_shapes]
                    tdt = getattr(torch, dt)
                    xs = [torch.from_numpy(a).cuda().to(tdt) for a in ins32]
                    ref = reference.run(op, red, sop.A, *[x.double().cpu().numpy() for x in xs])
                    for pipe in tpl.pipelines(mod0):
                        rec = {"matrix": label, "template": tname, "op": op, "reduce": red, "K": K, "dtype": dt,
                               "pipeline": [s["name"] for s in pipe]}
                        try:
                            mod = Pipeline(pipe)(mod0)
                            if not tpl.supports(mod):
                                continue
                            dflt = tpl.default_params(mod)
                            # precisions built only when asked for (e.g. split tf32): checked too
                            extra = [{**dflt, "precision": p} for p in tpl.checks(mod).get("precision", ())
                                     if p not in tpl.space(mod).get("precision", _NONE).choices]
                            psets = unique_params([dflt, *tpl.seed_params(mod)[:seeds], *extra])
                        except Exception as e:  # results are data
                            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
                            log.append(rec)
                            fails += 1
                            continue
                        for params in psets:
                            r = dict(rec, params=params)
                            try:
                                cfg = tpl.make_config(params, pipe, "cuda")
                                cm = build_from_config(sop, cfg, module=mod)
                                out = torch.full(sop.output_shape, float("nan"), dtype=tdt, device="cuda")
                                cm(*xs, out=out)
                                torch.cuda.synchronize()
                                err = reference.rel_error(out.double().cpu().numpy(), ref)
                                tol = numerics.result_tolerance(cm.config.precision, dt)
                                r.update(rel_err=err, precision=cm.config.precision, ok=bool(err <= tol))
                            except Exception as e:  # results are data
                                r.update(ok=False, error=f"{type(e).__name__}: {e}"[:500])
                            fails += not r["ok"]
                            log.append(r)
                            if not r["ok"]:
                                print("FAIL", json.dumps(r, default=str), flush=True)
    return fails


def check_save_load(log):
    import torch

    A = random_matrix(5, m=500, n=12000, density=0.003)
    X = torch.randn(A.shape[1], 64, device="cuda")
    ok = True
    with tempfile.TemporaryDirectory() as d:
        for tname, red in (("csr.crc_cwm", "max"), ("csr.crc_cwm", "sum"), ("extern.cusparse", "sum")):
            sop = make_op(A, "spmm", 64, red)
            tpl = get_template(tname)
            cm = build_from_config(sop, Config(tname, tpl.default_params(SparseModule.from_op(sop)), (), "cuda"))
            p = cm.save(os.path.join(d, f"m_{tname}_{red}.spc"))
            from spcompile.module import load

            cm2 = load(p, A)
            y1, y2 = cm(X).cpu().numpy(), cm2(X).cpu().numpy()
            files = list(cm2.kernel.files.values())
            err = reference.rel_error(y2, y1)
            same = bool(err <= 1e-6) and all(f.startswith(cm2._tmpdir) for f in files)
            log.append({"save_load": tname, "reduce": red, "ok": same, "rel_err": err, "files": files})
            ok &= same
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--graphs", type=int, default=6, help="graphs of --data to check (fewest nonzeros first)")
    ap.add_argument("--data", default=None, help="graph folder (default $SPCOMPILE_GRAPHS, else ../shared/data/graphs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.precompile:
        n = precompile(a.quick)
        print(f"precompiled {n} builds")
        return 0
    import cupy

    log: list = []
    fails = 0
    if a.quick:
        cupy.cuda.set_allocator(None)  # no pool: memcheck sees every buffer's true bounds
        A = random_matrix(3, m=100, n=3000, density=0.01, long_row=2500)
        fails += check_matrix(A, "random-quick", True, log, kinds=("torch",))
        fails += check_half(A, "random-quick", log, quick=True, kinds=("torch",))
        fails += check_families(random_matrix(4, m=200, n=300, density=0.02, long_row=250), "random-families", log,
                                Ks=(1, 33), seeds=1)
    else:
        for seed in (0, 1):
            fails += check_matrix(random_matrix(seed), f"random{seed}", False, log)
        fails += check_half(random_matrix(2), "random2-16bit", log)
        fails += check_families(random_matrix(4, m=600, n=900, density=0.01, long_row=800), "random-families", log)
        if a.graphs and os.path.isdir(a.data or common.default_graph_dir()):
            for name, path, _ in common.find_graphs(data_dir=a.data)[: a.graphs]:
                fails += check_matrix(common.load_matrix(path), name, True, log, kinds=("torch",))
        fails += check_save_load(log)
    n = len([r for r in log if "ok" in r])
    print(f"gpu_check: {n - fails}/{n} passed, {fails} failed")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_check_quick.json" if a.quick else "gpu_check.json"), "w") as f:
            json.dump(log, f, indent=1, default=str)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
