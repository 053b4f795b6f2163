"""The spcompile benchmark driver: every number it reports comes from the product path.

Per graph and K, all in one run and timed by one rule (``spcompile.autotune.measure.Timer``: the
kernel time of ``mod(X, out=Y)``, many calls captured in one CUDA graph and replayed between
events on CUDA, median of repeats), the columns are:

  baseline       target cuda: cuSPARSE, the ``extern.cusparse`` module (``torch.mm`` on a CSR
                 tensor for SpMM, ``torch.sparse.sampled_addmm`` for SDDMM) called as
                 ``mod(X, out=Y)`` like every other column; target cpu: scipy ``A @ X``
                 (float32 CSR, single-threaded; SpMM sum only)
  baseline_fp32  16-bit dtypes on cuda: cuSPARSE in fp32 on the same (rounded) values
  default        ``spcompile.build()`` with an empty database (a fresh SQLite file: no record can
                 leak in): the heuristic decision
  tuned          ``spcompile.build(tune=True, timeout=T)`` on a fresh database; the tuning wall
                 time is reported
  oracle         (--oracle) every template x pipeline x seed configuration of the tuner's space
                 (``Template.pipelines`` + ``Template.seed_params``, the best ``--oracle-top`` again
                 behind each generic reordering), each measured; the fastest kept and timed again

Every module's result is checked against the float64 scipy reference first (output poisoned with
NaN, tolerance ``numerics.tolerance`` of the config's precision and of the dtype); a wrong result
is reported and its time not counted.  Speed-ups are over the baseline measured in the same run
(over ``default`` where the op has no baseline); the memory floor is the compulsory traffic (CSR
arrays, X and Y once) at ``--bandwidth``.

Writes ``<out>/<name>.json`` after every (graph, K) (a killed run keeps its rows) and
``<out>/<name>.md``; nothing outside ``--out``.  Other modes: ``--call-overhead`` (host time per
call on a tiny matrix), ``--cold-start`` (a fresh interpreter loading an artifact and calling it),
``--build-only`` (compile every kernel a CUDA run will need into ``$SPCOMPILE_KERNEL_CACHE``, no GPU).

    python benchmarks/bench.py --quick                                  # smoke run
    python benchmarks/bench.py --K 64 128 256 --min-nnz 200001 --oracle --out $OUT/big
    python benchmarks/bench.py --target cuda --K 128 --build-only --oracle --jobs 2
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import common  # noqa: E402

import spcompile  # noqa: E402
from spcompile.compile import build_from_config, default_config, make_op  # noqa: E402
from spcompile.core import numerics, reference  # noqa: E402
from spcompile.core.ir import SparseModule  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402
from spcompile.passes import Pipeline  # noqa: E402

SCHEMA = "spcompile-bench/1"
COLUMNS = ("baseline", "baseline_fp32", "default", "tuned", "oracle")
BIG_NNZ = 200_000
FLOOR_FORMULA = {
    "spmm": "(m+1)*i + nnz*(i+4) + n*K*e + m*K*e bytes (CSR indptr, indices and fp32 values, X read once, "
            "Y written once; i = 4 (8 beyond 2^31 entries), e = bytes per element of the dtype)",
    "sddmm": "(m+1)*i + nnz*(i+4) + (m+n)*K*e + nnz*e bytes (CSR indptr, indices and fp32 values, X and Y read "
             "once, the nnz outputs written once; i = 4 (8 beyond 2^31 entries), e = bytes per element)",
}


# -------------------------------------------------------------------------------------------------
# workloads: inputs, outputs, reference, floor
# -------------------------------------------------------------------------------------------------
def gathered_bytes(op: str, nnz: int, K: int, dtype: str) -> int:
    """Bytes of dense rows a gather kernel reads: one row of X (SpMM) or of the column operand
    (SDDMM) per nonzero.  Divided by the measured L2 gather rate (``benchmarks/l2_gather.py``), the
    bound of a kernel whose dense operand fits in L2 and that reads a row per nonzero."""
    return nnz * K * numerics.dtype(dtype).bytes


def read_gather_rates(path: str) -> float:
    """The L2 gather rate (B/s) of a ``benchmarks/l2_gather.py`` JSON."""
    with open(path) as f:
        doc = json.load(f)
    rate = (doc.get("summary") or {}).get("l2_gather_Bps")
    if not rate or rate <= 0:
        raise ValueError(f"{path}: no L2 gather rate in its summary")
    return float(rate)


def floor_bytes(op: str, m: int, n: int, nnz: int, K: int, dtype: str) -> int:
    """Bytes that must move at least once (see FLOOR_FORMULA)."""
    i = 4 if max(nnz, m, n) <= np.iinfo(np.int32).max else 8
    e = numerics.dtype(dtype).bytes
    csr = (m + 1) * i + nnz * (i + 4)
    return csr + (n * K * e + m * K * e if op == "spmm" else (m + n) * K * e + nnz * e)


class Workload:
    """One (graph, K): the op, ``n_sets`` input sets (values exact in the dtype), an output per set,
    and the float64 reference of set 0.  ``io(dtype)`` gives the inputs converted to another dtype
    (the fp32 baseline of a 16-bit workload sees the same values)."""

    def __init__(self, A, op, reduce, K, dtype, target, n_sets=3, seed=0):
        from spcompile.autotune.measure import make_inputs

        self.sop = make_op(A, op, K, reduce, dtype)
        self.target = target
        self.dtype = self.sop.dtype
        self.n_sets = n_sets
        self._host = make_inputs(self.sop, n_sets, seed)
        ref = reference.run(self.sop.op, self.sop.reduce, self.sop.A, *self._host[0])
        self._io: dict = {}
        if target == "cuda":
            import torch

            self.ref = torch.from_numpy(ref).cuda()
            self.ref_norm = float(torch.linalg.norm(self.ref))
        else:
            self.ref, self.ref_norm = ref, float(np.linalg.norm(ref))

    def io(self, dtype: str | None = None):
        dtype = dtype or self.dtype
        if dtype not in self._io:
            shape = self.sop.output_shape
            if self.target == "cuda":
                import torch

                tdt = getattr(torch, dtype)
                ins = [tuple(torch.from_numpy(x).cuda().to(tdt) for x in h) for h in self._host]
                outs = [torch.empty(shape, dtype=tdt, device="cuda") for _ in self._host]
            else:
                ins = [tuple(np.ascontiguousarray(x, dtype=np.dtype(dtype)) for x in h) for h in self._host]
                outs = [np.empty(shape, dtype=np.dtype(dtype)) for _ in self._host]
            self._io[dtype] = (ins, outs)
        return self._io[dtype]

    def module_call(self, mod, dtype: str | None = None):
        ins, outs = self.io(dtype)
        return lambda i: mod(*ins[i], out=outs[i])

    def rel_error(self, res) -> float:
        if self.target == "cuda":
            import torch

            r = res.double()
            if not bool(torch.isfinite(r).all()):
                return math.inf
            num = float(torch.linalg.norm(r - self.ref))
        else:
            r = np.asarray(res, dtype=np.float64)
            if not np.all(np.isfinite(r)):
                return math.inf
            num = float(np.linalg.norm(r - self.ref))
        return num / self.ref_norm if self.ref_norm > 0 else num

    def check(self, call, dtype: str | None = None) -> float:
        """Relative error of ``call(0)`` with every output poisoned with NaN first."""
        _, outs = self.io(dtype)
        for o in outs:
            o.fill_(float("nan")) if self.target == "cuda" else o.fill(np.nan)
        res = call(0)
        if self.target == "cuda":
            import torch

            torch.cuda.synchronize()
        return self.rel_error(outs[0] if res is None else res)

    def release(self):
        self._io.clear()
        self.ref = None


# -------------------------------------------------------------------------------------------------
# oracle candidates: the tuner's space, every seed
# -------------------------------------------------------------------------------------------------
class PipelineCache:
    """Pass pipeline outputs of one graph, run once and reused for every template and K (passes
    depend on the matrix and their options alone)."""

    def __init__(self):
        self.mods: dict = {}
        self.seconds: dict = {}

    def get(self, sop, spec):
        key = json.dumps(spec, sort_keys=True, default=str)
        if key not in self.mods:
            t0 = time.perf_counter()
            try:
                self.mods[key] = Pipeline(spec)(SparseModule.from_op(sop))
            except Exception as e:  # a pass that fails on this graph: its candidates fail
                self.mods[key] = e
            self.seconds[key] = time.perf_counter() - t0
        mod = self.mods[key]
        if isinstance(mod, Exception):
            raise mod
        return mod if mod.op is sop else mod.replace(op=sop)

    def clear(self):
        self.mods.clear()
        self.seconds.clear()


def _label(spec) -> str:
    return "+".join(p["name"] for p in spec) or "none"


def seed_candidates(sop, target, pipes: PipelineCache, allowed, max_seeds=None, errors=None):
    """``[(template, pipeline spec, params)]``: every template of the tuner's space on each of its
    own pipelines with its default and seed configurations (at most ``max_seeds`` per pipeline),
    precisions outside ``allowed`` left out."""
    from spcompile.autotune.space import candidates

    out = []
    mod0 = SparseModule.from_op(sop)
    for tname in candidates(sop, target):
        tpl = get_template(tname)
        for spec in (Pipeline(p).spec() for p in tpl.pipelines(mod0)):
            try:
                mod = pipes.get(sop, spec)
            except Exception as e:
                if errors is not None:
                    errors.append(f"pipeline {_label(spec)}: {type(e).__name__}: {e}"[:300])
                continue
            if not tpl.supports(mod):
                continue
            try:
                seeds = [tpl.default_params(mod), *tpl.seed_params(mod)]
            except Exception:
                seeds = [tpl.default_params(mod)]
            seen, n = [], 0
            for p in seeds:
                p = {**tpl.default_params(mod), **dict(p)}
                if p in seen or tpl.precision_of(p, mod.op.dtype) not in allowed:
                    continue
                seen.append(p)
                if max_seeds is not None and n >= max_seeds:
                    break
                out.append((tname, spec, p))
                n += 1
    return out


def reorder_candidates(sop, target, measured, top):
    """The ``top`` fastest measured configurations of each template again behind every generic
    reordering the tuner's space puts in front of that pipeline."""
    from spcompile.autotune.space import candidates

    out = []
    for tname, specs in candidates(sop, target).items():
        for spec in specs.values():
            if not spec or not spec[0]["name"].startswith("reorder."):
                continue
            rest = spec[1:]
            own = sorted((r for r in measured if r["template"] == tname and r["pipeline_spec"] == rest
                          and r.get("seconds") is not None), key=lambda r: r["seconds"])
            for r in own[:top]:
                out.append((tname, spec, r["config"]["params"]))
    return out


# -------------------------------------------------------------------------------------------------
# columns
# -------------------------------------------------------------------------------------------------
class Column:
    """A measured contender: its record (JSON) and the call the timer runs."""

    def __init__(self, name, rec, call=None, dtype=None, module=None):
        self.name, self.rec, self.call, self.dtype, self.module = name, rec, call, dtype, module


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


def _checked(w: Workload, name, mod, rec, dtype=None) -> Column:
    """Check a built module's result; a wrong one is recorded and gets no call to time."""
    rec["config"] = mod.config.to_dict()
    rec["tuning"] = dict(mod.tuning)
    call = w.module_call(mod, dtype)
    try:
        err = w.check(call, dtype)
    except Exception as e:
        rec.update(status="error", error="run: " + _err(e))
        return Column(name, rec)
    tol = numerics.result_tolerance(mod.config.precision, dtype or w.dtype)
    rec.update(rel_err=err, tol=tol)
    if not err <= tol:
        rec.update(status="wrong_result", error=f"relative error {err:.3g} > tolerance {tol:.1g}")
        return Column(name, rec)
    rec["status"] = "ok"
    return Column(name, rec, call, dtype, mod)


def time_config(w: Workload, config, timer, module=None) -> dict:
    """One cell of a parameter sweep: ``config`` built for ``w``'s op through the product's
    ``build_from_config`` (on the pipeline's ``module`` when given), checked against float64 and
    timed by ``timer`` over ``w``'s input sets.  ``{"us": kernel time or None when the check
    failed, "status": ...}``; a ValueError of a combination the template refuses propagates."""
    col = _checked(w, "x", build_from_config(w.sop, config, module=module), {})
    us = timer.time(col.call, n_sets=w.n_sets).seconds * 1e6 if col.call else None
    return {"us": us, "status": col.rec.get("status")}


def col_baseline(w: Workload, dtype=None) -> Column:
    sop = w.sop
    name = "baseline" if dtype is None else "baseline_fp32"
    if w.target == "cpu":
        rec = {"name": "scipy.csr_matmul (float32, single-threaded)"}
        if sop.op != "spmm" or sop.reduce != "sum" or w.dtype != "float32":
            rec.update(status="unsupported", error="scipy baseline: SpMM sum in float32 only")
            return Column(name, rec)
        S = sop.A.to_scipy()
        ins, _ = w.io()
        call = lambda i: S @ ins[i][0]  # noqa: E731
        err = w.check(call)
        tol = numerics.tolerance("float32")
        rec.update(rel_err=err, tol=tol, status="ok" if err <= tol else "wrong_result")
        return Column(name, rec, call if err <= tol else None)
    rec = {"name": f"cuSPARSE ({dtype or w.dtype}, extern.cusparse)"}
    try:
        mod = spcompile.build(sop.A, sop.op, sop.K, sop.reduce, target="cuda", dtype=dtype or w.dtype,
                              template="extern.cusparse")
    except (ValueError, TypeError) as e:
        rec.update(status="unsupported", error=_err(e))
        return Column(name, rec)
    except Exception as e:
        rec.update(status="error", error=_err(e))
        return Column(name, rec)
    return _checked(w, name, mod, rec, dtype)


def col_default(w: Workload, tmp: str, precision: str, loo: bool = False) -> Column:
    sop = w.sop
    url = "sqlite:///" + os.path.join(tmp, f"empty-{uuid.uuid4().hex}.db")   # never created
    rec = {"name": "build() with an empty database", "storage": "fresh empty SQLite file",
           "leave_one_out": bool(loo)}
    from spcompile.autotune.knowledge import excluded

    try:
        t0 = time.perf_counter()
        with excluded(sop.A) if loo else contextlib.nullcontext():
            mod = spcompile.build(sop.A, sop.op, sop.K, sop.reduce, target=w.target, dtype=w.dtype, storage=url,
                                  precision=precision)
        rec["build_s"] = time.perf_counter() - t0
    except Exception as e:
        rec.update(status="error", error=_err(e))
        return Column("default", rec)
    if mod.tuning.get("source") not in ("heuristic", "model", "quick"):
        rec.update(status="error", config=mod.config.to_dict(), tuning=dict(mod.tuning),
                   error=f"decision came from {mod.tuning.get('source')!r}, not the heuristics: a database leaked in")
        return Column("default", rec)
    return _checked(w, "default", mod, rec)


def col_tuned(w: Workload, tmp: str, precision: str, timeout: float, loo: bool = False) -> Column:
    sop = w.sop
    path = os.path.join(tmp, f"tune-{uuid.uuid4().hex}.db")
    rec = {"name": f"build(tune=True, timeout={timeout:g}) on a fresh database", "tune_timeout_s": timeout,
           "leave_one_out": bool(loo)}
    from spcompile.autotune.knowledge import excluded

    try:
        t0 = time.perf_counter()
        # --loo: the tuner's model seeds leave the measured graph's own records out too
        with excluded(sop.A) if loo else contextlib.nullcontext():
            mod = spcompile.build(sop.A, sop.op, sop.K, sop.reduce, target=w.target, dtype=w.dtype,
                                  storage="sqlite:///" + path, tune=True, timeout=timeout, precision=precision)
        rec["tune_wall_s"] = time.perf_counter() - t0
    except Exception as e:
        rec.update(status="error", error=_err(e))
        return Column("tuned", rec)
    finally:
        for p in (path, path + "-journal"):
            if os.path.exists(p):
                os.remove(p)
    return _checked(w, "tuned", mod, rec)


def col_oracle(w: Workload, pipes: PipelineCache, timer, precision: str, max_seeds, top: int, log) -> Column:
    sop = w.sop
    allowed = numerics.allowed_precisions(precision, w.dtype)
    errors: list = []
    measured: list = []
    best = None

    def run(cands):
        nonlocal best
        for tname, spec, params in cands:
            r = {"template": tname, "pipeline_spec": spec, "config": {"params": params}}
            try:
                tpl = get_template(tname)
                mod = build_from_config(sop, tpl.make_config(params, spec, w.target, sop.dtype), module=pipes.get(sop, spec))
                col = _checked(w, "oracle", mod, {})
                r.update(col.rec)
                if col.call is not None:
                    r["seconds"] = timer.time(col.call, n_sets=w.n_sets).seconds
                    if best is None or r["seconds"] < best[0]["seconds"]:
                        best = (r, col)
            except Exception as e:
                r.update(status="error", error=_err(e))
            if r.get("status") != "ok":
                errors.append(f"{tname} [{_label(spec)}] {params}: {r.get('error')}"[:400])
                log(f"    oracle: {errors[-1]}")
            measured.append(r)

    run(seed_candidates(sop, w.target, pipes, allowed, max_seeds, errors))
    run(reorder_candidates(sop, w.target, measured, top))
    per_template: dict = {}
    for r in measured:
        if r.get("seconds") is not None:
            t = r["template"]
            if t not in per_template or r["seconds"] < per_template[t]["seconds"]:
                per_template[t] = {"seconds": r["seconds"], "config": r["config"]}
    summary = {"name": "fastest of every seed configuration", "candidates": len(measured),
               "failed": sum(1 for r in measured if r.get("seconds") is None), "failures": errors[:50],
               "per_template": per_template,
               "pipeline_s": {_label(json.loads(k)): round(v, 4) for k, v in pipes.seconds.items()}}
    if best is None:
        return Column("oracle", {**summary, "status": "error", "error": "no candidate gave a correct result"})
    r, col = best
    col.rec = {**summary, **{k: v for k, v in r.items() if k not in ("template", "pipeline_spec", "seconds")},
               "search_seconds": r["seconds"]}
    return col


# -------------------------------------------------------------------------------------------------
# one graph
# -------------------------------------------------------------------------------------------------
def bench_graph(a, name, path, A, Ks, timer, tmp, done, log, emit):
    pipes = PipelineCache()
    m, n = A.shape
    for K in Ks:
        if (name, K) in done:
            continue
        t_row = time.perf_counter()
        w = Workload(A, a.op, a.reduce, K, a.dtype, a.target, a.n_sets)
        cols: list[Column] = []
        if "baseline" in a.columns:
            cols.append(col_baseline(w))
            if a.target == "cuda" and w.dtype != "float32":
                cols.append(col_baseline(w, "float32"))
        if "default" in a.columns:
            cols.append(col_default(w, tmp, a.precision, a.loo))
        if "tuned" in a.columns:
            cols.append(col_tuned(w, tmp, a.precision, a.tune_timeout, a.loo))
        if "oracle" in a.columns:
            cols.append(col_oracle(w, pipes, timer, a.precision, a.max_seeds, a.oracle_top, log))
        # every column timed here, one after the other, on the same inputs and outputs
        for c in cols:
            if c.call is None:
                continue
            try:
                t = timer.time(c.call, n_sets=w.n_sets)
                c.rec.update(seconds=t.seconds, timing=t.to_dict())
            except Exception as e:
                c.rec.update(status="error", error="timing: " + _err(e))
        row = make_row(a, name, path, m, n, A.nnz, K, {c.name: c.rec for c in cols})
        row["wall_s"] = time.perf_counter() - t_row
        emit(row)
        del cols
        w.release()
        if a.target == "cuda":
            import torch

            torch.cuda.empty_cache()
    pipes.clear()


def _ok(rec) -> bool:
    return rec is not None and rec.get("status") == "ok" and rec.get("seconds")


def make_row(a, name, path, m, n, nnz, K, columns) -> dict:
    fb = floor_bytes(a.op, m, n, nnz, K, a.dtype)
    floor_s = fb / a.bandwidth
    ref = "baseline" if _ok(columns.get("baseline")) else ("default" if _ok(columns.get("default")) else None)
    row = {"graph": name, "path": os.path.abspath(path), "m": m, "n": n, "nnz": int(nnz), "K": K,
           "floor_bytes": fb, "floor_s": floor_s, "columns": columns, "speedup_over": ref, "speedup": {},
           "floor_fraction": {}}
    l2_rate = getattr(a, "l2_gather_rate", None)
    if l2_rate:
        # the larger of the two floors binds: compulsory (HBM) traffic, or a row of the dense
        # operand per nonzero at the L2 gather rate
        row["l2_floor_s"] = gathered_bytes(a.op, int(nnz), K, a.dtype) / l2_rate
        row["bound_s"] = max(floor_s, row["l2_floor_s"])
        row["bound_fraction"] = {}
    for c, rec in columns.items():
        if not _ok(rec):
            continue
        row["floor_fraction"][c] = floor_s / rec["seconds"]
        if l2_rate:
            row["bound_fraction"][c] = row["bound_s"] / rec["seconds"]
        if ref and c != ref and not c.startswith("baseline"):
            row["speedup"][c] = columns[ref]["seconds"] / rec["seconds"]
    if _ok(columns.get("baseline_fp32")):
        b = columns["baseline_fp32"]["seconds"]
        row["speedup_vs_fp32"] = {c: b / rec["seconds"] for c, rec in columns.items()
                                  if _ok(rec) and not c.startswith("baseline")}
    return row


# -------------------------------------------------------------------------------------------------
# summary, JSON, markdown
# -------------------------------------------------------------------------------------------------
def at_bound(row, baseline: str | None = None) -> float | None:
    """Baseline time / the larger floor (``bound_s``): the speed-up over ``baseline`` (default: the
    baseline column) of a kernel that ran exactly at the bound; None without gather rates or
    without a good baseline time."""
    rec = row["columns"].get(baseline or "baseline")
    if not row.get("bound_s") or not _ok(rec):
        return None
    return rec["seconds"] / row["bound_s"]


def _speedup_stats(pairs) -> dict:
    """Summary of ``[(speed-up, graph, nnz)]``: count, geomean (all / over ``BIG_NNZ``), worst,
    graphs below 1.0x."""
    big = [x for x, _, nz in pairs if nz > BIG_NNZ]
    worst = min(pairs)
    return {"graphs": len(pairs), "geomean": _finite(common.geomean([x for x, _, _ in pairs])),
            "graphs_over_200k": len(big), "geomean_over_200k": _finite(common.geomean(big)),
            "worst": {"graph": worst[1], "speedup": worst[0]},
            "below_1x": sum(1 for x, _, _ in pairs if x < 1.0)}


def summarize(rows) -> dict:
    out = {}
    for K in sorted({r["K"] for r in rows}):
        rk = [r for r in rows if r["K"] == K]
        d = {}
        for kind in ("speedup", "speedup_vs_fp32"):
            cols = sorted({c for r in rk for c in r.get(kind, {})}, key=lambda c: COLUMNS.index(c))
            for c in cols:
                pairs = [(r[kind][c], r["graph"], r["nnz"]) for r in rk if c in r.get(kind, {})]
                ff = [r["floor_fraction"][c] for r in rk if c in r["floor_fraction"]]
                bf = [r["bound_fraction"][c] for r in rk if c in r.get("bound_fraction", {})]
                d.setdefault(kind, {})[c] = {
                    **_speedup_stats(pairs), "geomean_floor_fraction": _finite(common.geomean(ff)),
                    **({"geomean_bound_fraction": _finite(common.geomean(bf))} if bf else {})}
        # a kernel running exactly at the larger floor, over the same baselines: the speed-up the
        # floors leave room for (below 1.0: the baseline already runs faster than the floor)
        for kind, bcol in (("speedup", None), ("speedup_vs_fp32", "baseline_fp32")):
            pairs = [(x, r["graph"], r["nnz"]) for r in rk if (x := at_bound(r, bcol)) is not None]
            if pairs and any(kind in r for r in rk):
                d.setdefault("at_bound", {})[kind] = _speedup_stats(pairs)
        # each template alone (its fastest oracle configuration) over the same-run baseline
        per_t: dict = {}
        for r in rk:
            ref = r["columns"].get(r.get("speedup_over") or "", {})
            for t, v in (r["columns"].get("oracle") or {}).get("per_template", {}).items():
                if _ok(ref):
                    per_t.setdefault(t, []).append((ref["seconds"] / v["seconds"], r["graph"]))
        if per_t:
            d["oracle_per_template"] = {
                t: {"graphs": len(v), "geomean": _finite(common.geomean([x for x, _ in v])),
                    "wins": sum(1 for x, _ in v if x > 1.0), "worst": {"graph": min(v)[1], "speedup": min(v)[0]}}
                for t, v in sorted(per_t.items())}
        # the tuner against the oracle of the same run: oracle time / tuned time per graph (1.0: the
        # tuner reached the fastest seed; above 1: it found better than every seed)
        to = [(r["columns"]["oracle"]["seconds"] / r["columns"]["tuned"]["seconds"], r["graph"]) for r in rk
              if _ok(r["columns"].get("tuned")) and _ok(r["columns"].get("oracle"))]
        if to:
            d["tuned_over_oracle"] = {"graphs": len(to), "geomean": _finite(common.geomean([x for x, _ in to])),
                                      "below_095": sum(1 for x, _ in to if x < 0.95),
                                      "worst": {"graph": min(to)[1], "ratio": min(to)[0]}}
        tw = [r["columns"]["tuned"]["tune_wall_s"] for r in rk if "tune_wall_s" in r["columns"].get("tuned", {})]
        if tw:
            d["tune_wall_s"] = {"median": statistics.median(tw), "max": max(tw), "total": sum(tw)}
        d["graphs"] = len(rk)
        d["failures"] = sum(1 for r in rk for rec in r["columns"].values()
                            if rec.get("status") in ("error", "wrong_result"))
        out[str(K)] = d
    return out


def _finite(x):
    return x if x is not None and math.isfinite(x) else None


def _f(x, fmt=".2f") -> str:
    """A ratio for the tables ("-" when absent; small fractions with two significant digits)."""
    if x is None:
        return "-"
    return f"{x:.2g}" if 0 < abs(x) < 0.01 else format(x, fmt)


def _source(rec) -> str:
    t = (rec or {}).get("tuning") or {}
    if not t:
        return "-"
    s = t.get("source", "?")
    if s == "tuned":
        return f"tuned ({t.get('trials', '?')} trials)"
    return s + (f" ({t['reason']})" if t.get("reason") else "")


def _us(rec):
    return f"{rec['seconds'] * 1e6:.1f}" if _ok(rec) else ("wrong" if (rec or {}).get("status") == "wrong_result"
                                                            else "-")


def _cfg(rec) -> str:
    c = (rec or {}).get("config")
    if not c:
        return "-"
    pipe = "+".join(p["name"] for p in c.get("pipeline", []))
    prec = "" if c.get("precision", "fp32") == "fp32" else f" {c['precision']}"
    return f"{pipe + ' -> ' if pipe else ''}{c['template']}{prec} {json.dumps(c.get('params', {}), separators=(',', ':'))}"


def _stats_cells(v) -> list:
    """The summary-table cells of a :func:`_speedup_stats` dict: graphs, geomean (all, over 200k),
    worst, graphs below 1.0x."""
    return [v["graphs"], _f(v["geomean"]), f"{_f(v['geomean_over_200k'])} ({v['graphs_over_200k']})",
            f"{_f(v['worst']['speedup'])} ({v['worst']['graph']})", v["below_1x"]]


def markdown(doc) -> str:
    s, rows = doc["settings"], doc["rows"]
    cols = [c for c in COLUMNS if any(c in r["columns"] for r in rows)]
    ours = [c for c in cols if not c.startswith("baseline")]
    L = [f"# {doc['name']}: {s['op']}{'' if s['op'] == 'sddmm' else ' ' + s['reduce']}, {s['dtype']}, "
         f"target {s['target']} ({doc['env'].get('device')})", "",
         f"Generated by `{doc['command']}` (spcompile {doc['env'].get('spcompile')}, {doc['updated']}).", "",
         f"Kernel time of `mod(X, out=Y)` by the Timer (mode `{s.get('timer_mode')}`), us.  baseline = "
         f"{'cuSPARSE (torch.sparse through the extern.cusparse module)' if s['target'] == 'cuda' else 'scipy A @ X'}"
         f"; default = `build()` with an empty database"
         + (f"; tuned = `build(tune=True, timeout={s['tune_timeout_s']:g})` on a fresh database (tune s = its wall "
            f"time)" if "tuned" in cols else "")
         + ("; oracle = fastest of every template x pipeline x seed configuration" if "oracle" in cols else "")
         + f".  Precision policy `{s['precision']}`.  Every result was checked against the float64 reference "
         f"before its time counted; x = speed-up over the baseline of the same run.  floor = compulsory "
         f"traffic {s['floor_formula']} at {s['bandwidth_Bps'] / 1e12:.2f} TB/s; floor frac = floor time / "
         f"kernel time."
         + (f"  l2 floor = nnz*K*e bytes (a row of the dense operand per nonzero) at the measured L2 gather rate "
            f"{s['l2_gather_Bps'] / 1e12:.2f} TB/s (`benchmarks/l2_gather.py`); bound frac = the larger floor / "
            f"kernel time; x at bound = baseline time / the larger floor, the speed-up of a kernel that ran "
            f"exactly at it." if s.get("l2_gather_Bps") else ""), ""]
    summ = doc["summary"]
    with_l2 = any("l2_floor_s" in r for r in rows)
    srows = []
    for K, d in summ.items():
        for kind, label in (("speedup", "baseline"), ("speedup_vs_fp32", "cuSPARSE fp32")):
            for c, v in d.get(kind, {}).items():
                srows.append([K, c, label, *_stats_cells(v), _f(v["geomean_floor_fraction"])]
                             + ([_f(v.get("geomean_bound_fraction"))] if with_l2 else []))
        for kind, label in (("speedup", "baseline"), ("speedup_vs_fp32", "cuSPARSE fp32")):
            v = d.get("at_bound", {}).get(kind)
            if v:
                srows.append([K, "a kernel at the larger floor", label, *_stats_cells(v), "-", "1.00"])
        for t, v in d.get("oracle_per_template", {}).items():
            srows.append([K, f"{t} alone (oracle)", "baseline", v["graphs"], _f(v["geomean"]), "-",
                          f"{_f(v['worst']['speedup'])} ({v['worst']['graph']})", v["graphs"] - v["wins"], "-"]
                         + (["-"] if with_l2 else []))
        if "tuned_over_oracle" in d:
            v = d["tuned_over_oracle"]
            srows.append([K, "tuned", "oracle (speed fraction)", v["graphs"], _f(v["geomean"]), "-",
                          f"{_f(v['worst']['ratio'])} ({v['worst']['graph']})", f"{v['below_095']} (< 0.95)", "-"]
                         + (["-"] if with_l2 else []))
        if "tune_wall_s" in d:
            tw = d["tune_wall_s"]
            srows.append([K, "tuning wall time", "-", d["graphs"], f"median {tw['median']:.1f} s",
                          f"max {tw['max']:.1f} s", "-", "-", "-"] + (["-"] if with_l2 else []))
    if srows:
        L += common.md_table(["K", "column", "over", "graphs", "geomean x", "geomean x (nnz > 200k)", "worst x",
                              "graphs < 1.0x", "geomean floor frac"] + (["geomean bound frac"] if with_l2 else []),
                             srows)
        L.append("")
    head = ["graph", "nnz", "K", "floor us"] + (["l2 floor us", "x at bound"] if with_l2 else []) \
        + [c for c in cols if c.startswith("baseline")]
    for c in ours:
        head += [c, "x"] + (["tune s", "tuned from"] if c == "tuned" else [])
    head += [f"floor frac {c}" for c in ours] + ([f"bound frac {c}" for c in ours] if with_l2 else []) \
        + ["tuned config" if "tuned" in cols else "default config"]
    trows = []
    for r in rows:
        cells = [r["graph"], r["nnz"], r["K"], _f(r["floor_s"] * 1e6, ".1f")]
        if with_l2:
            cells += [_f(r["l2_floor_s"] * 1e6, ".1f") if "l2_floor_s" in r else "-", _f(at_bound(r))]
        cells += [_us(r["columns"].get(c)) for c in cols if c.startswith("baseline")]
        for c in ours:
            rec = r["columns"].get(c)
            x = r["speedup"].get(c)
            cells += [_us(rec), _f(x)]
            if c == "tuned":
                cells.append(f"{rec['tune_wall_s']:.1f}" if rec and "tune_wall_s" in rec else "-")
                cells.append(_source(rec))
        cells += [_f(r["floor_fraction"].get(c)) for c in ours]
        if with_l2:
            cells += [_f(r.get("bound_fraction", {}).get(c)) for c in ours]
        cells.append(_cfg(r["columns"].get("tuned") or r["columns"].get("default")))
        trows.append(cells)
    L += common.md_table(head, trows)
    bad = [(r["graph"], r["K"], c, rec.get("status"), rec.get("error", ""))
           for r in rows for c, rec in r["columns"].items() if rec.get("status") in ("error", "wrong_result")]
    if bad:
        L += ["", "Excluded (wrong result or error):", ""]
        L += [f"* {g} K={K} {c}: {st}: {e}" for g, K, c, st, e in bad]
    return "\n".join(L) + "\n"


SETTING_KEYS = ("op", "reduce", "dtype", "target", "precision")


def load_prior(paths, settings, Ks) -> list:
    rows = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        if doc.get("schema") != SCHEMA:
            raise SystemExit(f"{p}: not a {SCHEMA} file")
        diff = {k: (doc["settings"].get(k), settings[k]) for k in SETTING_KEYS if doc["settings"].get(k) != settings[k]}
        if diff:
            raise SystemExit(f"{p}: measured with other settings {diff}; merge only runs of one workload")
        rows += [r for r in doc["rows"] if r["K"] in Ks]
    seen, out = set(), []
    for r in rows:
        if (r["graph"], r["K"]) not in seen:
            seen.add((r["graph"], r["K"]))
            out.append(r)
    return out


# -------------------------------------------------------------------------------------------------
# call overhead and cold start
# -------------------------------------------------------------------------------------------------
def _tiny(seed=0):
    import scipy.sparse as sp

    return sp.random(64, 64, density=0.1, format="csr", dtype=np.float32, random_state=seed)


def _per_call_us(fn, sync, n=500, batches=15) -> float:
    """Median over batches of host wall time per call (calls issued back to back, synchronised
    once after each batch, outside the timed region)."""
    for _ in range(50):
        fn()
    sync()
    res = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        res.append((time.perf_counter() - t0) / n * 1e6)
        sync()
    return statistics.median(res)


def call_overhead(a, tmp) -> dict:
    """Host time per call on a tiny matrix (the GPU work is negligible, the call path decides)."""
    A = _tiny()
    K = 32
    w = Workload(A, "spmm", "sum", K, "float32", a.target, n_sets=1)
    (X,), Y = w.io()[0][0], w.io()[1][0]
    if a.target == "cuda":
        import torch

        sync = torch.cuda.synchronize
        At = torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(np.int64)),
                                     torch.from_numpy(A.indices.astype(np.int64)), torch.from_numpy(A.data),
                                     A.shape).cuda()
        base_name, base = "torch.sparse.mm", lambda: torch.sparse.mm(At, X)
    else:
        sync = lambda: None  # noqa: E731
        base_name, base = "scipy A @ X", lambda: A @ X
    res = {"matrix": "64 x 64, 10% dense, K=32, float32", "baseline": base_name,
           "baseline_us": _per_call_us(base, sync), "modules": {}}
    url = "sqlite:///" + os.path.join(tmp, "overhead-empty.db")
    mods = {"build()": dict(storage=url)}
    for t in a.templates or []:
        mods[t] = dict(template=t)
    for label, kw in mods.items():
        rec = {}
        try:
            mod = spcompile.build(A, "spmm", K, "sum", target=a.target, **kw)
            col = _checked(w, label, mod, rec)
            if col.call is not None:
                rec["out_us"] = _per_call_us(lambda: mod(X, out=Y), sync)
                rec["alloc_us"] = _per_call_us(lambda: mod(X), sync)
                rec["out_over_baseline"] = rec["out_us"] / res["baseline_us"]
        except Exception as e:
            rec.update(status="error", error=_err(e))
        res["modules"][label] = rec
    return res


def cold_start(a, tmp) -> dict:
    """Wall time of a fresh ``python -c "import spcompile; spcompile.load(p)(X)"`` per target, the
    artifact built and saved first; median of ``--cold-runs``, with the process's own split into
    ``import spcompile``, ``load()`` and the first call.  ``python -c pass`` and a bare
    ``import spcompile`` are measured too, for scale."""
    from spcompile.runtime.target import cuda_available

    targets = [a.target] if a.target != "auto" else ["cpu"] + (["cuda"] if cuda_available() else [])
    A = _tiny(1)
    X = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    xp, yp = os.path.join(tmp, "x.npy"), os.path.join(tmp, "y.npy")
    np.save(xp, X)
    ref = reference.run("spmm", "sum", spcompile.as_csr(A), X)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
    # as after ``pip install`` (which compiles the package's bytecode): bytecode written (to a
    # cache of this run) by an untimed first run and read by the timed ones
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")

    def runs(code):
        ts, phases = [], []
        subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True)
        for _ in range(a.cold_runs):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True)
            ts.append(time.perf_counter() - t0)
            if r.stdout.strip().startswith("{"):
                phases.append(json.loads(r.stdout.strip().splitlines()[-1]))
        out = {"median_s": statistics.median(ts), "samples_s": ts}
        for k, v in (phases[0] if phases else {}).items():
            if isinstance(v, (int, float)):
                out[k + "_s"] = statistics.median(p[k] for p in phases)
            else:      # a fact of the run (the same in every run), not a time
                out[k] = v
        return out

    res = {"python -c pass": runs("pass"), "import numpy": runs("import numpy"),
           "import spcompile": runs("import spcompile"), "targets": {}}
    if "cuda" in targets:
        # what any CUDA program on this machine pays before running a kernel: the interpreter,
        # numpy, cuInit and the primary context (ctypes, no spcompile)
        res["floor: numpy + CUDA context"] = runs(
            "import time; t0 = time.perf_counter(); import json, ctypes, numpy; t1 = time.perf_counter(); "
            "l = ctypes.CDLL('libcuda.so.1'); assert l.cuInit(0) == 0; d = ctypes.c_int(); c = ctypes.c_void_p(); "
            "assert l.cuDeviceGet(ctypes.byref(d), 0) == 0; "
            "assert l.cuDevicePrimaryCtxRetain(ctypes.byref(c), d) == 0; t2 = time.perf_counter(); "
            "print(json.dumps({'import': t1 - t0, 'context': t2 - t1}))")
    for t in targets:
        try:
            mod = spcompile.build(A, "spmm", 32, "sum", target=t,
                                  storage="sqlite:///" + os.path.join(tmp, f"cold-{t}-empty.db"))
            p = mod.save(os.path.join(tmp, f"cold-{t}.spc"))
        except Exception as e:
            res["targets"][t] = {"status": "error", "error": _err(e)}
            continue
        for label, warm in ((t, False),) + (((f"{t}, load(warm_up=True)", True),) if t == "cuda" else ()):
            rec = {"config": mod.config.to_dict()}
            try:
                code = ("import time; t0 = time.perf_counter(); import json, numpy as np, spcompile; "
                        f"t1 = time.perf_counter(); m = spcompile.load({p!r}, warm_up={warm}); "
                        f"t2 = time.perf_counter(); y = np.asarray(m(np.load({xp!r}))); t3 = time.perf_counter(); "
                        f"np.save({yp!r}, y); print(json.dumps({{'import': t1 - t0, 'load': t2 - t1, "
                        "'first_call': t3 - t2, 'gpu_framework_imported': "
                        "[k for k in ('cupy', 'torch') if k in sys.modules]}))")
                rec.update(runs("import sys; " + code))
                err = reference.rel_error(np.load(yp), ref)
                rec.update(rel_err=err, status="ok" if err <= numerics.tolerance("float32") else "wrong_result")
            except Exception as e:
                rec.update(status="error", error=_err(e))
            res["targets"][label] = rec
    return res


def _f3(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def mode_markdown(doc) -> str:
    """The table of a --call-overhead or --cold-start run."""
    res, env = doc["result"], doc["env"]
    L = [f"# {doc['mode'].replace('_', ' ')} ({env.get('device', 'host')}, spcompile {env.get('spcompile')})", "",
         f"Generated by `{doc['command']}` ({doc['updated']}).", ""]
    if doc["mode"] == "call_overhead":
        L += [f"Host wall time per call from Python on a tiny matrix ({res['matrix']}): calls issued back to "
              f"back, median over batches, us.  Baseline: {res['baseline']} {res['baseline_us']:.1f} us.", ""]
        L += common.md_table(["module", "config", "mod(X, out=Y) us", "mod(X) us", "out= / baseline"],
                             [[k, _cfg(r), f"{r['out_us']:.1f}" if "out_us" in r else r.get("error", "-"),
                               f"{r['alloc_us']:.1f}" if "alloc_us" in r else "-",
                               _f(r.get("out_over_baseline"))] for k, r in res["modules"].items()])
    else:
        L += ["Wall time of a fresh `python -c \"import spcompile; spcompile.load(p)(X)\"` (numpy X, the "
              "artifact saved first), median of runs, s; import / load / first call: the process's own "
              "split of that time (the rest is the interpreter's start and exit).  Bytecode compiled, as "
              "after `pip install` (an untimed run first).", ""]
        ph = ("import_s", "load_s", "first_call_s")
        scale = [k for k in ("python -c pass", "import numpy", "import spcompile") if k in res]
        rows = [[k, "-", f"{res[k]['median_s']:.2f}", "-", "-", "-", "-"] for k in scale]
        fl = res.get("floor: numpy + CUDA context")
        if fl:
            rows.append(["floor: numpy + CUDA context (ctypes, no spcompile)", "-", f"{fl['median_s']:.2f}",
                         _f3(fl.get("import_s")), "-", f"context {_f3(fl.get('context_s'))}", "-"])
        rows += [[f"import + load + call, target {t}", _cfg(r), f"{r['median_s']:.2f}" if "median_s" in r else "-",
                  *[f"{r[k]:.3f}" if k in r else "-" for k in ph], r.get("status")] for t, r in res["targets"].items()]
        L += common.md_table(["what", "config", "median s", "import s", "load s", "first call s", "result"], rows)
    return "\n".join(L) + "\n"


# -------------------------------------------------------------------------------------------------
# --build-only: fill the kernel cache for a CUDA run (no GPU needed)
# -------------------------------------------------------------------------------------------------
def _model_candidates(a, A, sop) -> list:
    """What quick selection in ``build()`` builds for ``sop``: the model's first choices, their
    unranked variants, native and locality orders, the row-window reuse candidates and, for 16-bit
    inputs, the float32 shape (with ``--loo`` the graph's own records left out, as in the default
    column), and the second round's neighbours of each."""
    from spcompile.autotune import knowledge
    from spcompile.autotune.select import DEFAULT_CANDIDATES, MORE_CANDIDATES, RANKED, pick_candidates

    with (knowledge.excluded(A) if a.loo else contextlib.nullcontext()):
        try:
            ranked = knowledge.ranked_configs(sop, "cuda", a.precision, k=RANKED)
            got = pick_candidates(ranked, DEFAULT_CANDIDATES, MORE_CANDIDATES)
            got += knowledge.cross_dtype_configs(sop, "cuda", a.precision)
            got += [(c, None) for _, c in knowledge.beside_ranking(ranked, sop, "cuda", a.precision)]
            # the second round's neighbours of whichever of them is fastest
            for c, _ in list(got):
                tpl = get_template(c.template)
                got += [(tpl.make_config(p, c.pipeline, "cuda", sop.dtype), None)
                        for p in tpl.probe_variants(dict(c.params), sop)]
        except Exception as e:  # noqa: BLE001
            print(f"  K={sop.K}: no model candidates: {_err(e)}", flush=True)
            return []
    return [(c.template, list(c.pipeline), dict(c.params)) for c, _ in got]


def _build_job(job):
    a, name, path, Ks = job
    A = common.load_matrix(path)
    pipes = PipelineCache()
    n = fails = 0
    allowed = numerics.allowed_precisions(a.precision, a.dtype)
    t0 = time.perf_counter()
    for K in Ks:
        sop = make_op(A, a.op, K, a.reduce, a.dtype)
        cands = []
        try:
            cfg = default_config(sop, "cuda")
            cands.append((cfg.template, list(cfg.pipeline), dict(cfg.params)))
        except Exception as e:
            print(f"  {name} K={K}: no default config: {_err(e)}", flush=True)
        cands += _model_candidates(a, A, sop)
        if "tuned" in a.columns or "oracle" in a.columns:
            cands += seed_candidates(sop, "cuda", pipes, allowed, a.max_seeds)
        for tname, spec, params in cands:
            if tname == "extern.cusparse":
                continue   # a library call: nothing to compile
            n += 1
            try:
                tpl = get_template(tname)
                build_from_config(sop, tpl.make_config(params, spec, "cuda"), module=pipes.get(sop, spec))
            except Exception as e:
                fails += 1
                print(f"  {name} K={K} {tname} [{_label(spec)}] {params}: {_err(e)}"[:300], flush=True)
    return name, n, fails, time.perf_counter() - t0


def build_only(a, graphs, Ks) -> int:
    import concurrent.futures as cf

    from spcompile.runtime import cuda as rt

    print(f"filling the kernel cache {rt.cache_dir()} (sm_{rt.DEFAULT_ARCH}) for {len(graphs)} graphs, "
          f"K {Ks}", flush=True)
    jobs = [(a, name, path, Ks) for name, path, _ in graphs]
    total = failed = 0
    with cf.ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        for name, n, fails, s in ex.map(_build_job, jobs):
            total, failed = total + n, failed + fails
            print(f"built {name}: {n} configurations, {fails} failed, {s:.0f} s", flush=True)
    print(f"{total} configurations built, {failed} failed")
    return 0


# -------------------------------------------------------------------------------------------------
# command line
# -------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    g = ap.add_argument_group("graphs")
    g.add_argument("--graphs", nargs="+", metavar="NAME|PATH", help="graph names in --data, or .npz/.mtx paths")
    g.add_argument("--data", default=None, metavar="DIR",
                   help="folder of .npz/.mtx graphs (default $SPCOMPILE_GRAPHS, else ../shared/data/graphs)")
    g.add_argument("--min-nnz", type=int, default=None)
    g.add_argument("--max-nnz", type=int, default=None)
    g = ap.add_argument_group("workload")
    g.add_argument("--op", choices=("spmm", "sddmm"), default="spmm")
    g.add_argument("--reduce", choices=("sum", "mean", "max", "min"), default="sum", help="SpMM reduction")
    g.add_argument("--K", type=int, nargs="+", default=None, help="dense widths (default 64 128 256)")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32", help="X / Y dtype")
    g.add_argument("--target", choices=("auto", "cuda", "cpu"), default="auto")
    g.add_argument("--precision", choices=tuple(numerics.PRECISIONS), default="fp32",
                   help="precision policy of build()/tune and the oracle (lowest precision admitted)")
    g = ap.add_argument_group("columns")
    g.add_argument("--columns", nargs="+", choices=("baseline", "default", "tuned", "oracle"),
                   default=["baseline", "default", "tuned"])
    g.add_argument("--loo", action="store_true",
                   help="default and tuned columns: the shipped model leaves the measured graph's own records out "
                        "(leave-one-graph-out: the number of a graph the model has not seen)")
    g.add_argument("--oracle", action="store_true", help="add the oracle column (every seed configuration)")
    g.add_argument("--tune-timeout", type=float, default=None, metavar="T",
                   help="seconds of tuning per (graph, K) for the tuned column (default 20; --quick 5)")
    g.add_argument("--max-seeds", type=int, default=None,
                   help="oracle / --build-only: at most this many configurations per template and pipeline")
    g.add_argument("--oracle-top", type=int, default=2,
                   help="oracle: the best N configurations of each template again behind each reordering")
    g = ap.add_argument_group("timing")
    g.add_argument("--timer-mode", default=None, help="Timer mode (default: graph on cuda, autorange on cpu)")
    g.add_argument("--n-sets", type=int, default=3, help="input sets the timer rotates over")
    g.add_argument("--bandwidth", type=float, default=2.96e12, help="B/s of the memory floor (H100 copy rate)")
    g.add_argument("--gather-rates", default=None, metavar="JSON",
                   help="benchmarks/l2_gather.py's JSON: also report the L2 gather floor per graph and the "
                        "fraction of the larger floor")
    g = ap.add_argument_group("output")
    g.add_argument("--out", default=os.path.join(HERE, "results"), help="folder of the JSON and markdown")
    g.add_argument("--name", default=None, help="file name stem (default from op, reduce, dtype, target)")
    g.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="earlier JSONs of the same workload: their rows are kept, their (graph, K) not re-run")
    g.add_argument("--skip-done", action="store_true", help="resume: keep the rows of <out>/<name>.json")
    g.add_argument("--quick", action="store_true",
                   help="smoke run: 3 smallest graphs, first K, 5 s tuning, 2 seeds per pipeline")
    g = ap.add_argument_group("other modes")
    g.add_argument("--build-only", action="store_true",
                   help="compile every kernel the run would build first (default configs, the model's quick-"
                        "selection candidates, and with the tuned or oracle column every seed) into "
                        "$SPCOMPILE_KERNEL_CACHE for sm_90; no GPU needed")
    g.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="--build-only processes")
    g.add_argument("--call-overhead", action="store_true",
                   help="host time per mod(X, out=Y) / mod(X) on a tiny matrix vs torch.sparse.mm (scipy on cpu)")
    g.add_argument("--templates", nargs="*", default=None, help="--call-overhead: templates to add")
    g.add_argument("--cold-start", action="store_true",
                   help="wall time of a fresh interpreter loading a saved module and calling it, per target")
    g.add_argument("--cold-runs", type=int, default=5)
    a = ap.parse_args(argv)
    if a.oracle and "oracle" not in a.columns:
        a.columns.append("oracle")
    if a.K is None:
        a.K = [64] if a.quick else [64, 128, 256]
    if a.tune_timeout is None:
        a.tune_timeout = 5.0 if a.quick else 20.0
    if a.quick and a.max_seeds is None:
        a.max_seeds = 2
    if a.op == "sddmm":
        a.reduce = None
    a.l2_gather_rate = None
    if a.gather_rates:
        try:
            a.l2_gather_rate = read_gather_rates(a.gather_rates)
        except (OSError, ValueError) as e:
            ap.error(f"--gather-rates: {e}")
    return ap, a


def main(argv=None) -> int:
    ap, a = parse_args(argv)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    command = "python benchmarks/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if not a.build_only and not a.cold_start:
        from spcompile.runtime import resolve_target

        a.target = resolve_target(a.target)
    if a.call_overhead or a.cold_start:
        with tempfile.TemporaryDirectory(prefix="spcompile-bench-") as tmp:
            kind = "call_overhead" if a.call_overhead else "cold_start"
            res = call_overhead(a, tmp) if a.call_overhead else cold_start(a, tmp)
        doc = {"schema": SCHEMA, "mode": kind, "command": command, "env": {**common.versions()},
               "updated": datetime.datetime.now().isoformat(timespec="seconds"), "result": res}
        if a.target in ("cpu", "cuda"):
            doc["env"]["device"] = common.device_name(a.target)
        name = a.name or f"{kind}_{a.target}"
        common.write_json(os.path.join(a.out, name + ".json"), doc)
        md = mode_markdown(doc)
        common.write_text(os.path.join(a.out, name + ".md"), md)
        print(md)
        return 0
    graphs = common.find_graphs(a.graphs, a.data, a.min_nnz, a.max_nnz)
    if a.quick and not a.graphs:
        graphs = graphs[:3]
    if not graphs:
        ap.error("no graph matches (see --graphs / --data / --min-nnz / --max-nnz)")
    if a.build_only:
        a.target = "cuda"
        return build_only(a, graphs, a.K)
    from spcompile.autotune.measure import Timer

    timer = Timer(a.target, mode=a.timer_mode)
    name = a.name or "_".join(x for x in (a.op, a.reduce if a.op == "spmm" and a.reduce != "sum" else None,
                                          a.dtype, a.target, None if a.precision == "fp32" else a.precision) if x)
    jpath, mpath = os.path.join(a.out, name + ".json"), os.path.join(a.out, name + ".md")
    settings = {"op": a.op, "reduce": a.reduce, "dtype": a.dtype, "target": a.target, "precision": a.precision,
                "K": a.K, "columns": a.columns, "leave_one_out": a.loo, "tune_timeout_s": a.tune_timeout, "max_seeds": a.max_seeds,
                "oracle_top": a.oracle_top, "n_sets": a.n_sets, "timer_mode": a.timer_mode,
                "bandwidth_Bps": a.bandwidth, "floor_formula": FLOOR_FORMULA[a.op], "big_nnz": BIG_NNZ,
                "l2_gather_Bps": a.l2_gather_rate}
    merge = list(a.merge) + ([jpath] if a.skip_done and os.path.exists(jpath) else [])
    rows = load_prior(merge, settings, a.K)
    done = {(r["graph"], r["K"]) for r in rows}
    env = {**common.versions(), "device": common.device_name(a.target)}
    started = datetime.datetime.now().isoformat(timespec="seconds")

    def log(msg):
        print(msg, flush=True)

    def emit(row=None):
        if row is not None:
            rows.append(row)
            cells = " ".join(f"{c} {_us(rec)}" for c, rec in row["columns"].items())
            sp_ = " ".join(f"{c} x{x:.2f}" for c, x in row["speedup"].items())
            log(f"{row['graph']:28s} K={row['K']:<4d} nnz={row['nnz']:<9d} {cells}  {sp_}  [{row['wall_s']:.0f} s]")
        timing = next((rec["timing"] for r in rows for rec in r["columns"].values() if "timing" in rec), None)
        doc = {"schema": SCHEMA, "name": name, "command": command, "started": started,
               "updated": datetime.datetime.now().isoformat(timespec="seconds"), "env": env,
               "settings": {**settings, "timer_mode": (timing or {}).get("mode", a.timer_mode)},
               "merged_from": merge, "rows": rows, "summary": summarize(rows)}
        common.write_json(jpath, doc)
        common.write_text(mpath, markdown(doc))
        return doc

    log(f"{len(graphs)} graphs, K {a.K}, {a.op} {a.reduce or ''} {a.dtype} on {a.target} ({env['device']}), "
        f"columns {a.columns}; writing {jpath}")
    with tempfile.TemporaryDirectory(prefix="spcompile-bench-") as tmp:
        for gname, path, _ in graphs:
            if all((gname, K) in done for K in a.K):
                continue
            A = common.load_matrix(path)
            bench_graph(a, gname, path, A, a.K, timer, tmp, done, log, emit)
    doc = emit()
    for K, d in doc["summary"].items():
        for kind in ("speedup", "speedup_vs_fp32"):
            for c, v in d.get(kind, {}).items():
                log(f"K={K} {c} {kind}: geomean {_f(v['geomean'])}x over {v['graphs']} graphs "
                    f"({_f(v['geomean_over_200k'])}x over the {v['graphs_over_200k']} with nnz > 200k), worst "
                    f"{_f(v['worst']['speedup'])}x ({v['worst']['graph']}), {v['below_1x']} below 1.0x")
    log(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
