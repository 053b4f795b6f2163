"""``spcompile tune`` (offline tuning jobs) and ``spcompile best`` (the best records).

    spcompile tune GRAPHS... --op spmm -K 64 128 --trials 40 [--timeout S] [--storage URL] [--workers W]
    spcompile tune GRAPHS... --more 20          # add 20 trials to each existing study
    spcompile best [--storage URL] [--all] [--json]

``--trials`` is the total budget of each (graph, K) study (a study that already has them is not
tuned again: use ``--more N`` to add N trials); ``--timeout`` bounds each study's wall time.
Each run measures the baseline again, confirms the best configs with a second measurement and
stores the winner only when it beats both the default config and the baseline measured in the
same run (the summary says when nothing was stored, and why).
Several ``spcompile tune`` processes (``--workers``, or separate commands on other machines)
pointed at one PostgreSQL URL share the studies: each trial runs once, and a killed worker's
trial is failed by the survivors after its heartbeat's grace period.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tqdm import tqdm

__all__ = ["add_commands", "cmd_tune", "cmd_best"]


def add_commands(subparsers) -> None:
    t = subparsers.add_parser("tune", help="tune graphs x K and store the best configs in the tuning database",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("graphs", nargs="+", help="matrix files (.npz from scipy.sparse.save_npz, or .mtx)")
    t.add_argument("--op", default="spmm", choices=["spmm", "sddmm"])
    t.add_argument("-K", "--K", dest="K", type=int, nargs="+", default=[64], help="feature widths (default 64)")
    t.add_argument("--reduce", nargs="+", default=None, help="reductions for spmm (sum max min mean)")
    t.add_argument("--target", default="auto", choices=["auto", "cpu", "cuda"])
    t.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"],
                   help="X / Y dtype of the workloads (default float32; float16 / bfloat16 on CUDA, float64 on "
                        "the CPU; 'auto' targets follow the dtype)")
    t.add_argument("--trials", type=int, default=None, help="trials per (graph, K) study (default 24 "
                   "when --timeout is not given)")
    t.add_argument("--more", type=int, default=None, metavar="N",
                   help="add N trials to each study (whatever it already has) instead of a total --trials")
    t.add_argument("--timeout", type=float, default=None, help="wall-time budget in seconds per study")
    t.add_argument("--trial-timeout", type=float, default=None, help="time limit of one trial (s)")
    t.add_argument("--storage", default=None, help="Optuna storage URL or SQLite path "
                   "(default: $SPCOMPILE_TUNING_DB or the embedded tuning_logs/spcompile.db)")
    t.add_argument("--workers", type=int, default=1, help="tuning processes on this machine sharing the "
                   "studies (with CUDA: one per visible GPU, round robin)")
    t.add_argument("--objective", default="kernel_time", choices=["kernel_time", "amortized"])
    t.add_argument("--expected-calls", type=float, default=None,
                   help="with --objective amortized: calls over which preprocessing is amortised")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16", "bf16"],
                   help="lowest arithmetic precision a kernel may compute in (default fp32: exact kernels "
                        "only; tf32/fp16/bf16 admit tensor-core templates, fp32 accumulation)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.set_defaults(func=cmd_tune)

    b = subparsers.add_parser("best", help="list the best records of the tuning database")
    b.add_argument("--storage", default=None, help="Optuna storage URL or SQLite path (default: embedded)")
    b.add_argument("--all", action="store_true", help="include records invalidated by template/pass changes")
    b.add_argument("--op", default=None, choices=["spmm", "sddmm"])
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_best)


# -- tune ---------------------------------------------------------------------------------------
def _jobs(args) -> list[tuple[str, str | None, int]]:
    reduces = [None] if args.op == "sddmm" else (args.reduce or ["sum"])
    return [(g, r, k) for g in args.graphs for r in reduces for k in args.K]


class _Progress:
    """tqdm bar on stderr: trial, best so far, speed-up over the baseline."""

    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled
        self.bar = None

    def __call__(self, ev: dict):
        if not self.enabled:
            return
        if ev["event"] == "start":
            self.bar = tqdm(total=ev.get("total"), desc=self.label, file=sys.stderr, leave=True,
                            dynamic_ncols=True, unit="trial")
            if ev.get("baseline_ms"):
                self.bar.set_postfix_str(f"baseline {ev['baseline_ms']:.3f} ms")
        elif ev["event"] == "trial" and self.bar is not None:
            if ev.get("counted"):
                done = ev.get("done") or 0
                if self.bar.total is not None:
                    self.bar.n = min(done, self.bar.total)
                else:
                    self.bar.n = done
            best = ev.get("best_kernel_ms")
            base = ev.get("baseline_ms")
            s = f"#{ev['number']} {ev['status']}"
            if best is not None and best != float("inf"):
                s += f" | best {best:.4f} ms"
                if base:
                    s += f" ({base / best:.2f}x)"
            self.bar.set_postfix_str(s)
            self.bar.refresh()
        elif ev["event"] == "end" and self.bar is not None:
            self.bar.close()
            self.bar = None


def _run_jobs(jobs, opts: dict, progress: bool, worker: int = 0) -> list[dict]:
    """Run every job in this process; returns summaries (dicts).  Stops on Ctrl-C."""
    import optuna

    from .common import load_matrix
    from ..autotune.tuner import tune

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = []
    cache = {}
    for g, reduce, K in jobs:
        A = cache.get(g)
        if A is None:
            A = cache[g] = load_matrix(g)
        label = f"{os.path.basename(g)} K={K}" + (f" {reduce}" if reduce and reduce != "sum" else "")
        bar = _Progress(label, progress)
        try:
            start = _untuned_pick(A, K, reduce, opts)
            res = tune(A, op=opts["op"], K=K, reduce=reduce, target=opts["target"], dtype=opts["dtype"],
                       **({"start_from": start} if start is not None else {}),
                       trials=opts["trials"],
                       timeout=opts["timeout"], storage=opts["storage"], objective=opts["objective"],
                       expected_calls=opts["expected_calls"], seed=opts["seed"],
                       trial_timeout=opts["trial_timeout"], callbacks=[bar], precision=opts.get("precision", "fp32"),
                       more=opts.get("more"), graph=os.path.basename(g))
        except KeyboardInterrupt:
            out.append({"graph": g, "reduce": reduce, "K": K, "interrupted": True})
            break
        d = res.to_dict()
        d.update(graph=g, reduce=reduce, K=K)
        out.append(d)
        if res.interrupted:
            break
    return out


def _untuned_pick(A, K, reduce, opts):
    """The job's first seed: what ``build()`` without tuning picks with the job's database
    (:func:`~spcompile.autotune.policy.untuned_config`; None for the amortized objective)."""
    from ..autotune.policy import untuned_config
    from ..compile import make_op, workload_target

    try:
        sop = make_op(A, opts["op"], K, reduce, opts["dtype"])
        target = workload_target(sop, opts["target"])
    except Exception:  # noqa: BLE001 - the tuning job reports what is wrong with the workload
        return None
    return untuned_config(sop, target, storage=opts["storage"], objective=opts.get("objective", "kernel_time"),
                          expected_calls=opts.get("expected_calls"), precision=opts.get("precision", "fp32"))


def _worker_main(jobs, opts, worker, cuda_device):
    if cuda_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_device)
    try:
        _run_jobs(jobs, opts, progress=False, worker=worker)
    except KeyboardInterrupt:
        pass
    except (ValueError, RuntimeError) as e:   # e.g. a DatabaseError: one line, and a non-zero exit
        print(f"error (worker {worker}): {e}", file=sys.stderr)
        sys.exit(2)


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    try:
        import cupy

        return [str(i) for i in range(cupy.cuda.runtime.getDeviceCount())]
    except Exception:
        return []


def _fmt_ms(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def summary_table(rows: list[dict]) -> str:
    head = ["graph", "K", "baseline ms", "best ms", "speed-up", "trials", "chosen config"]
    lines = []
    for r in rows:
        if r.get("best_config") is None and not r.get("baseline_ms"):
            cfg = "interrupted" if r.get("interrupted") else "no working config"
        else:
            from ..core.config import Config

            cfg = str(Config.from_dict(r["best_config"])) if r.get("best_config") else "no working config"
            cfg = cfg.replace("target=cpu ", "").replace("target=cuda ", "")
        sp = r.get("speedup")
        name = os.path.basename(r["graph"]).rsplit(".", 1)[0]
        if r.get("reduce") not in (None, "sum"):
            name += f" ({r['reduce']})"
        fails = r.get("n_fail", 0)
        trials = f"{r.get('n_trials', 0)}" + (f" ({fails} fail)" if fails else "")
        lines.append([name, str(r["K"]), _fmt_ms(r.get("baseline_ms")), _fmt_ms(r.get("best_kernel_ms")),
                      "-" if sp is None else f"{sp:.2f}x", trials, cfg])
    widths = [max(len(h), *(len(l[i]) for l in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda cols: "  ".join(c.ljust(w) if i in (0, 6) else c.rjust(w)  # noqa: E731
                                 for i, (c, w) in enumerate(zip(cols, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines])


def cmd_tune(args) -> int:
    from ..autotune.database import normalize_url
    import numpy as np
    import scipy.sparse as sp

    from ..compile import make_op, workload_target

    for g in args.graphs:
        if not os.path.isfile(g):
            print(f"error: no such file {g!r}", file=sys.stderr)
            return 2
    if args.more is not None and (args.trials is not None or args.more < 1):
        print("error: --more N adds N >= 1 trials to each study; it does not go with --trials", file=sys.stderr)
        return 2
    if args.objective == "amortized" and not args.expected_calls:
        print("error: --objective amortized needs --expected-calls N", file=sys.stderr)
        return 2
    # the target for the workloads' dtype ("auto": float64 goes to the CPU), or one clear line
    probe = make_op(sp.csr_matrix(np.ones((1, 1), np.float32)), args.op, 1,
                    None if args.op == "sddmm" else (args.reduce or ["sum"])[0], args.dtype)
    try:
        target = workload_target(probe, args.target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    storage = normalize_url(args.storage)
    opts = {"op": args.op, "target": target, "dtype": args.dtype, "trials": args.trials, "timeout": args.timeout,
            "storage": storage,
            "objective": args.objective, "expected_calls": args.expected_calls, "seed": args.seed,
            "trial_timeout": args.trial_timeout, "precision": args.precision, "more": args.more}
    from ..autotune.database import open_database

    open_database(storage)   # a bad or unusable storage fails here, with one line, before any work
    jobs = _jobs(args)
    t0 = time.perf_counter()
    procs = []
    if args.workers > 1:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        gpus = _visible_gpus() if target == "cuda" else []
        for w in range(1, args.workers):
            dev = gpus[w % len(gpus)] if gpus else None
            p = ctx.Process(target=_worker_main, args=(jobs, opts, w, dev), daemon=False)
            p.start()
            procs.append(p)
        if gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    interrupted = False
    try:
        rows = _run_jobs(jobs, opts, progress=not args.no_progress)
    except KeyboardInterrupt:
        rows, interrupted = [], True
    worker_failed = False
    for p in procs:
        try:
            p.join()
            worker_failed = worker_failed or bool(p.exitcode)
        except KeyboardInterrupt:
            interrupted = True
            for q in procs:
                q.join(timeout=30)
            break
    if procs:  # the summary reflects every worker's trials: read the studies again
        rows = _reread(jobs, opts, rows)
    interrupted = interrupted or any(r.get("interrupted") for r in rows)
    if args.json:
        print(json.dumps({"storage": _safe(storage), "seconds": time.perf_counter() - t0, "results": rows},
                         indent=1, default=str))
    else:
        print(summary_table(rows))
        notes = run_notes(rows, args)
        if notes:
            print("\n" + "\n".join(notes))
        print(f"\nstorage: {_safe(storage)}   ({time.perf_counter() - t0:.1f} s"
              + (", interrupted: partial results kept" if interrupted else "") + ")")
    return 130 if interrupted else (2 if worker_failed else 0)


def _row_label(r: dict) -> str:
    name = os.path.basename(r["graph"])
    return f"{name} K={r['K']}" + (f" {r['reduce']}" if r.get("reduce") not in (None, "sum") else "")


def run_notes(rows: list[dict], args=None) -> list[str]:
    """One line per study where something needs saying: nothing to do, trials added, nothing stored."""
    out = []
    for r in rows:
        if r.get("interrupted") and "n_trials" not in r:
            continue
        label = _row_label(r)
        if r.get("nothing_to_do"):
            out.append(f"{label}: nothing to do: the study already has {r.get('n_trials')} trials"
                       + (f" (--trials {args.trials})" if args is not None and args.trials else "")
                       + "; add trials with --more N")
            continue
        if args is not None and getattr(args, "more", None):
            out.append(f"{label}: added {r.get('n_new', 0)} trials (the study now has {r.get('n_trials')})")
        if r.get("stored") is False and r.get("store_note"):
            out.append(f"{label}: {r['store_note']}")
        elif r.get("stored") is None and r.get("store_note"):
            out.append(f"{label}: {r['store_note']}")
    return out


def _reread(jobs, opts, rows):
    from .common import load_matrix
    from ..compile import make_op
    from ..autotune.tuner import Tuner

    by_key = {(r["graph"], r["reduce"], r["K"]): r for r in rows}
    out = []
    for g, reduce, K in jobs:
        old = by_key.get((g, reduce, K))
        if old is None:
            continue
        try:
            tn = Tuner(make_op(load_matrix(g), opts["op"], K, reduce, opts["dtype"]), opts["target"],
                       storage=opts["storage"],
                       objective=opts["objective"], expected_calls=opts["expected_calls"], runner=object(),
                       precision=opts.get("precision", "fp32"))
            d = tn.result(old.get("stop_reason", ""), old.get("interrupted", False)).to_dict()
            d.update(graph=g, reduce=reduce, K=K, nothing_to_do=old.get("nothing_to_do", False),
                     n_new=max(old.get("n_new", 0), d["n_trials"] - (old.get("n_trials", 0) - old.get("n_new", 0))))
            out.append(d)
        except Exception:
            out.append(old)
    return out


def _safe(url: str) -> str:
    from ..autotune.policy import safe_url as _safe_url

    return _safe_url(url)


# -- best ---------------------------------------------------------------------------------------
def _short_study(name: str) -> str:
    """A study name without its digests (``spcompile-spmm-sum-K64-<digests>-kernel_time-<space>``)."""
    parts = name.split("-")
    if name.startswith("spcompile-") and len(parts) > 5:
        keep = [p for p in parts[1:] if not (len(p) >= 8 and all(c in "0123456789abcdef" for c in p))]
        return "-".join(keep)
    return name

def cmd_best(args) -> int:
    from ..autotune.database import Database, normalize_url, sqlite_path

    url = normalize_url(args.storage)
    path = sqlite_path(url)
    if path is not None and not os.path.exists(path):
        print(f"no tuning database at {path} (run `spcompile tune` first)", file=sys.stderr)
        return 1
    db = Database(url)
    recs = [r for r in db.best_records(include_invalid=args.all) if args.op is None or r.workload.get("op") == args.op]
    if args.json:
        print(json.dumps([dict(r.to_dict(), valid=r.valid, invalid_reason=r.invalid_reason()) for r in recs],
                         indent=1, default=str))
        return 0
    head = ["op", "graph", "shape", "nnz", "K", "target", "objective", "precision", "timing", "baseline ms",
            "best ms", "speed-up", "study/trial", "config"]
    lines = []
    for r in recs:
        w = r.workload
        op = w.get("op", "?") + (f"/{w['reduce']}" if w.get("reduce") else "")
        tgt = f"{r.target.get('target', '?')}:{r.target.get('device', '?')}"
        sp = r.speedup
        cfg = str(r.config).replace(f"target={r.config.target} ", "")
        if not r.valid:
            cfg = f"[invalid: {r.invalid_reason()}] " + cfg
        src = "-" if not r.study_name else f"{_short_study(r.study_name)}#{r.trial_number}"
        lines.append([op, str((r.extra or {}).get("graph") or "-"), f"{w.get('rows')}x{w.get('cols')}",
                      str(w.get("nnz")), str(w.get("K")), tgt,
                      r.objective, r.precision, r.timing or "-", _fmt_ms(r.baseline_ms), _fmt_ms(r.kernel_ms),
                      "-" if sp is None else f"{sp:.2f}x" + (f" vs {r.baseline_name}" if r.baseline_name else ""),
                      src, cfg])
    if not lines:
        print(f"no records in {_safe(url)}")
        return 0
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    for row in [head, ["-" * w for w in widths]] + lines:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"\n{len(lines)} record(s) in {_safe(url)}")
    return 0
