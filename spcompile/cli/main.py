"""The ``spcompile`` command: build, demo, passes, templates, info (and tune / best)."""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .._version import __version__
from ..api import build, load
from ..autotune.measure import Timer, Timing
from . import report as cli_report
from . import templates as cli_templates
from ..autotune.policy import describe
from .common import load_matrix, power_law_graph


def _module_timing(mod, ins, target: str) -> Timing:
    """The module's cost per call by the one timing rule: ``mod(X, out=Y)`` on device arrays on
    CUDA (torch tensors when torch is importable, else CuPy), on numpy arrays on the CPU."""
    if target == "cuda":
        try:
            import torch

            dev = [torch.from_numpy(x).cuda() for x in ins]
        except ImportError:
            import cupy

            dev = [cupy.asarray(x) for x in ins]
        out = mod(*dev)
    else:
        dev = list(ins)
        out = np.empty_like(mod(*dev))
    return Timer(target).time(lambda i: mod(*dev, out=out))


def cmd_build(args) -> int:
    A = load_matrix(args.matrix)
    try:
        params = json.loads(args.params) if args.params else None
    except ValueError as e:
        raise SystemExit(f"error: --params is not valid JSON ({e}): {args.params!r}")
    if params is not None and not isinstance(params, dict):
        raise SystemExit(f"error: --params must be a JSON object of parameter names and values, got {args.params!r}")
    pipeline = args.pipeline.split(",") if args.pipeline else None
    kw = {}
    if args.tune or args.trials:
        kw.update(tune=True, trials=args.trials)
    mod = build(A, op=args.op, K=args.K, reduce=args.reduce, target=args.target,
                          template=args.template, params=params, pipeline=pipeline, storage=args.storage, **kw)
    out = args.output or (args.matrix.rsplit(".", 1)[0] + ".spc")
    mod.save(out)
    print(f"built {mod.op}{'/' + mod.reduce if mod.reduce else ''} for {args.matrix} "
          f"({mod.shape[0]}x{mod.shape[1]}, nnz={mod.key.nnz}, K={mod.K})")
    print(f"config: {mod.config}")
    print(describe(mod.tuning))
    print(f"wrote {out}")
    return 0


def cmd_demo(args) -> int:
    """The main job on the embedded default: build, check and time a module for a generated graph."""
    import scipy.sparse as sp

    from ..core import numerics, reference
    from ..core.formats import as_csr
    from ..runtime import resolve_target

    target = resolve_target(args.target)
    A = power_law_graph(args.rows, args.degree, seed=args.seed)
    C = as_csr(A)
    print(f"power-law graph: {A.shape[0]} rows, {A.nnz} nonzeros, max row {int(np.diff(A.indptr).max())}; "
          f"target={target}")
    rng = np.random.default_rng(args.seed)
    rows = []
    for op, reduce in (("spmm", "sum"), ("spmm", "max"), ("spmm", "mean"), ("sddmm", None)):
        t0 = time.perf_counter()
        mod = build(A, op=op, K=args.K, reduce=reduce, target=target, storage=args.storage)
        build_s = time.perf_counter() - t0
        if op == "spmm":
            X = rng.standard_normal((A.shape[1], args.K)).astype(np.float32)
            ins = (X,)
            ref = reference.spmm(C, X, reduce)
            base = (lambda: A @ X) if reduce == "sum" else None
        else:
            X = rng.standard_normal((A.shape[0], args.K)).astype(np.float32)
            Y = rng.standard_normal((A.shape[1], args.K)).astype(np.float32)
            ins = (X, Y)
            ref = reference.sddmm(C, X, Y)
            base = None
        out = mod(*ins)
        out = out.get() if hasattr(out, "get") else np.asarray(out)
        err = reference.rel_error(out, ref)
        ok = err <= numerics.tolerance("float32")
        timing = _module_timing(mod, ins, target)
        tb = Timer("cpu").time(lambda i: base()).seconds if base else float("nan")
        rows.append((op + ("/" + reduce if reduce else ""), err, ok, build_s, timing.seconds * 1e3, tb * 1e3,
                     str(mod.config)))
        if timing.note:
            print(f"note ({rows[-1][0]}): {timing.note}")
    print(f"times: median per call, module timed in mode {timing.mode!r} (spcompile.autotune.measure.Timer)")
    print(f"{'op':12s} {'rel.err':>9s} {'ok':>4s} {'build s':>8s} {'ms/call':>9s} {'scipy ms':>9s}  config")
    for r in rows:
        print(f"{r[0]:12s} {r[1]:9.2e} {'yes' if r[2] else 'NO':>4s} {r[3]:8.2f} {r[4]:9.3f} {r[5]:9.3f}  {r[6]}")
    if args.save:
        mod.save(args.save)
        m2 = load(args.save, A)
        same = np.array_equal(np.asarray(m2(*ins)), np.asarray(mod(*ins)))
        print(f"saved {args.save}; reloaded module gives identical results: {same}")
        if not same:
            return 1
    return 0 if all(r[2] for r in rows) else 1


def cmd_passes(args) -> int:
    from ..passes import list_passes

    for name, info in list_passes().items():
        print(f"{name:16s} {info.description}")
        if info.options:
            print(f"{'':16s}   options: {dict(info.options)}")
    return 0


def cmd_info(args) -> int:
    # every check of load(), but the kernel library is never loaded: describing runs no code of it
    from ..module import describe as describe_artifact

    d = describe_artifact(args.artifact, require_signature=True if args.require_signature else None)
    k = d["key"]
    print(f"CompiledModule(op={k.op!r}, reduce={k.reduce!r}, shape={(k.rows, k.cols)}, nnz={k.nnz}, "
          f"K={k.K}, {d['config']})")
    print(f"  signed: {'yes' if d['signed'] else 'no'}")
    print(describe(d.get("tuning") if isinstance(d.get("tuning"), dict) else {}))
    for rec in d["pass_log"] if isinstance(d["pass_log"], list) else ():
        if isinstance(rec, dict):
            print(f"  pass {rec.get('name')}: {rec.get('metrics', {})}")
    return 0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spcompile", description="Sparse compiler and autotuner for SpMM / SDDMM.")
    p.add_argument("--version", action="version", version=f"spcompile {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="compile a matrix into a module artifact")
    b.add_argument("matrix", help="scipy .npz (save_npz) or Matrix Market .mtx")
    b.add_argument("--op", default="spmm", choices=["spmm", "sddmm"])
    b.add_argument("-K", type=int, required=True, help="dense feature width")
    b.add_argument("--reduce", default=None, choices=["sum", "max", "min", "mean"])
    b.add_argument("--target", default="auto", choices=["auto", "cpu", "cuda"])
    b.add_argument("--template", default=None)
    b.add_argument("--params", default=None, help="template parameters as JSON")
    b.add_argument("--pipeline", default=None, help="comma-separated pass names, e.g. reorder.rcm")
    b.add_argument("--storage", default=None, help="tuning database (Optuna storage URL)")
    b.add_argument("--tune", action="store_true", help="tune on a database miss")
    b.add_argument("--trials", type=int, default=None)
    b.add_argument("-o", "--output", default=None, help="artifact path (default: MATRIX.spc)")
    b.set_defaults(func=cmd_build)

    d = sub.add_parser("demo", help="build, check and time modules for a generated power-law graph")
    d.add_argument("--rows", type=int, default=20000)
    d.add_argument("--degree", type=float, default=16.0)
    d.add_argument("-K", type=int, default=64)
    d.add_argument("--target", default="auto", choices=["auto", "cpu", "cuda"])
    d.add_argument("--storage", default=None)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--save", default=None, help="also save the last module here and reload it")
    d.set_defaults(func=cmd_demo)

    ps = sub.add_parser("passes", help="list registered passes")
    ps.set_defaults(func=cmd_passes)
    cli_templates.add_command(sub)
    cli_report.add_command(sub)
    i = sub.add_parser("info", help="describe a saved artifact")
    i.add_argument("artifact")
    i.add_argument("--require-signature", action="store_true",
                   help="refuse an artifact not signed with $SPCOMPILE_ARTIFACT_KEY")
    i.set_defaults(func=cmd_info)

    try:
        from . import tune as cli_tune
    except ImportError:
        cli_tune = None
    if cli_tune is not None:
        cli_tune.add_commands(sub)
    return p


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, RuntimeError, OSError, MemoryError, RecursionError) as e:
        # user mistakes and bad files: one line, no traceback
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
