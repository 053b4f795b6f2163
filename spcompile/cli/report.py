"""``spcompile report``: one self-contained HTML page (plots embedded as PNG) of what tuning did
and what the benchmarks measured.

From the tuning database (``--storage``): the best record per workload (a table and its speed-up
over the baseline), per Optuna study the tuning curve (best-so-far speed-up against trials and
against wall time) and where the study's time went (kernel compilation, preprocessing passes,
measuring, between trials).  From benchmark JSON files (``--bench``, written by
``benchmarks/bench.py``): per K the speed-up of each column over the baseline per graph, and the
build / tuning wall time per graph.  Needs matplotlib (``pip install 'spcompile[report]'``).
"""
from __future__ import annotations

import base64
import datetime
import html
import io
import json
import math
import os


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("spcompile report draws with matplotlib: pip install 'spcompile[report]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


#: resolution of the embedded plots (``--dpi``)
DPI = 110


def _png(fig) -> str:
    """The figure as an <img> with the PNG inline (base64), then closed."""
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


def _table(head, rows) -> str:
    h = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _ms(v) -> str:
    return "-" if v is None or not math.isfinite(v) else (f"{v * 1e3:.1f} us" if v < 1 else f"{v:.3f} ms")


# -- the tuning database ----------------------------------------------------------------------
def studies(storage_url: str) -> list[dict]:
    """Per Optuna study in ``storage_url``: its name, baseline (ms, or None) and its finished trials
    in order, each ``{number, state, value_ms, start_s, end_s, compile_s, preprocess_s}`` with
    times in seconds from the study's first trial start."""
    import optuna

    from ..autotune.database import optuna_storage
    from ..autotune.tuner import quiet_optuna

    out = []
    with quiet_optuna():
        storage = optuna_storage(storage_url, heartbeat_interval=None, grace_period=None)
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
        for s in summaries:
            study = optuna.load_study(study_name=s.study_name, storage=storage)
            trials = [t for t in study.get_trials(deepcopy=False)
                      if t.datetime_start is not None and t.datetime_complete is not None]
            if not trials:
                continue
            t0 = min(t.datetime_start for t in trials)
            rows = []
            for t in sorted(trials, key=lambda t: t.number):
                res = t.user_attrs.get("result") or {}
                rows.append({"number": t.number, "state": t.state.name.lower(),
                             "value_ms": t.value if t.state.name == "COMPLETE" else None,
                             "start_s": (t.datetime_start - t0).total_seconds(),
                             "end_s": (t.datetime_complete - t0).total_seconds(),
                             "compile_s": (res.get("compile_ms") or 0.0) / 1e3,
                             "preprocess_s": (res.get("preprocess_ms") or 0.0) / 1e3,
                             "duplicate": "duplicate_of" in t.user_attrs})
            base = (study.user_attrs.get("baseline") or {}).get("ms")
            out.append({"name": s.study_name, "baseline_ms": base if base and base > 0 else None,
                        "baseline_name": (study.user_attrs.get("baseline") or {}).get("name"), "trials": rows})
    return out


def _best_so_far(st) -> tuple[list, list, list]:
    """(trial numbers, end times, best-so-far speed-up) of a study: over its baseline when it
    has one, else over its first completed trial."""
    ref = st["baseline_ms"]
    xs, ts, ys, best = [], [], [], math.inf
    for t in st["trials"]:
        if t["value_ms"] is not None and t["value_ms"] > 0:
            best = min(best, t["value_ms"])
            if ref is None:
                ref = t["value_ms"]
        if math.isfinite(best):
            xs.append(t["number"] + 1)
            ts.append(t["end_s"])
            ys.append(ref / best)
    return xs, ts, ys


def _short(name: str) -> str:
    """A study's name without its digests ("spcompile-spmm-sum-K32-<key>-<target>-..." -> "spmm-sum-K32 <key[:6]>")."""
    parts = name.split("-")
    if name.startswith("spcompile-") and len(parts) >= 5:
        return f"{'-'.join(parts[1:4])} {parts[4][:6]}"
    return name[:40]


def tuning_curves(sts) -> str:
    plt = _pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    any_base = all(st["baseline_ms"] for st in sts)
    for st in sts:
        xs, ts, ys = _best_so_far(st)
        if xs:
            a1.step(xs, ys, where="post", label=_short(st["name"]))
            a2.step(ts, ys, where="post")
    what = "best-so-far speed-up over the baseline" if any_base else "best-so-far speed-up (over the first trial)"
    for ax, xl in ((a1, "trials"), (a2, "wall time since the study's first trial (s)")):
        ax.set_xlabel(xl)
        ax.set_ylabel(what)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    if len(sts) <= 12:
        a1.legend(fontsize=7)
    fig.suptitle("Tuning curves, one line per study")
    return _png(fig)


def time_split(st) -> dict:
    """Where a study's wall time went, seconds: compiling kernels, preprocessing passes,
    measuring (the rest of each trial: the worker, the runs, the checks) and between trials
    (the sampler, the database)."""
    comp = sum(t["compile_s"] for t in st["trials"])
    pre = sum(t["preprocess_s"] for t in st["trials"])
    trial = sum(max(0.0, t["end_s"] - t["start_s"]) for t in st["trials"])
    wall = max(t["end_s"] for t in st["trials"])
    return {"compile": comp, "preprocess": pre, "measure": max(0.0, trial - comp - pre),
            "between trials": max(0.0, wall - trial)}


def time_split_plot(sts) -> str:
    plt = _pyplot()
    parts = ["compile", "preprocess", "measure", "between trials"]
    splits = [time_split(st) for st in sts]
    fig, ax = plt.subplots(figsize=(11, max(2.0, 0.35 * len(sts) + 1.2)))
    left = [0.0] * len(sts)
    labels = [_short(st["name"]) for st in sts]
    for p in parts:
        vals = [s[p] for s in splits]
        ax.barh(labels, vals, left=left, label=p)
        left = [l + v for l, v in zip(left, vals)]
    ax.set_xlabel("seconds")
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(sts) < 4 else -0.12))
    ax.set_title("Where each study's time went (measure: the trial's worker, runs and checks)")
    return _png(fig)


def database_section(storage) -> str:
    from ..autotune.database import Database, normalize_url, sqlite_path

    url = normalize_url(storage)
    path = sqlite_path(url)
    if path is not None and not os.path.exists(path):
        raise FileNotFoundError(f"no tuning database at {path}")
    db = Database(url)
    recs = db.best_records(include_invalid=True)
    out = [f"<h2>Tuning database</h2><p>{html.escape(_safe_url(url))}: {len(recs)} best record(s).</p>"]
    rows = []
    for r in recs:
        w = r.workload
        sp = r.speedup
        rows.append([w.get("op", "?") + (f"/{w['reduce']}" if w.get("reduce") else ""),
                     f"{w.get('rows')}x{w.get('cols')}", w.get("nnz"), w.get("K"),
                     f"{r.target.get('target', '?')}:{r.target.get('device', '?')}", r.precision,
                     _ms(r.baseline_ms), _ms(r.kernel_ms), "-" if sp is None else f"{sp:.2f}x",
                     r.config.template, json.dumps(r.config.params, sort_keys=True),
                     "yes" if r.valid else f"no: {r.invalid_reason()}"])
    if rows:
        out.append(_table(["op", "shape", "nnz", "K", "target", "precision", "baseline", "best", "speed-up",
                           "template", "parameters", "valid here"], rows))
    sts = studies(url)
    if sts:
        n = sum(len(s["trials"]) for s in sts)
        out.append(f"<h3>Studies</h3><p>{len(sts)} Optuna studies, {n} finished trials.</p>")
        out.append(tuning_curves(sts))
        out.append(time_split_plot(sts))
        tot = {k: sum(time_split(s)[k] for s in sts) for k in time_split(sts[0])}
        all_s = sum(tot.values()) or 1.0
        out.append(_table(["where the time went (all studies)", "seconds", "share"],
                          [[k, f"{v:.1f}", f"{100 * v / all_s:.0f}%"] for k, v in tot.items()]))
    return "\n".join(out)


def _safe_url(url: str) -> str:
    """The storage URL without a password."""
    if "://" in url and "@" in url.split("://", 1)[1]:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        return f"{scheme}://{cred.split(':', 1)[0]}:***@{host}"
    return url


# -- benchmark JSON ---------------------------------------------------------------------------
def _speedup_plot(rows, K, columns, over, key="speedup") -> str:
    """Per graph, each column's speed-up (the rows' ``key``: ``speedup`` over the baseline of the
    table's dtype, ``speedup_vs_fp32`` over the fp32 baseline of a 16-bit table)."""
    plt = _pyplot()
    rows = sorted(rows, key=lambda r: r["nnz"])
    fig, ax = plt.subplots(figsize=(max(7.0, 0.18 * len(rows) + 3), 4))
    x = list(range(len(rows)))
    for c in columns:
        ys = [(r.get(key) or {}).get(c) for r in rows]
        pts = [(i, y) for i, y in zip(x, ys) if y]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", ms=4, label=c)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([r["graph"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel(f"speed-up over {over}")
    ax.set_title(f"K={K}: speed-up per graph (fewest nonzeros first)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _png(fig)


def _wall_plot(rows, K) -> str | None:
    """Build / tuning wall time per graph (columns that report one)."""
    plt = _pyplot()
    rows = sorted(rows, key=lambda r: r["nnz"])
    series = {}
    for r in rows:
        for c, rec in r.get("columns", {}).items():
            for key in ("build_s", "tune_wall_s"):
                if isinstance(rec.get(key), (int, float)):
                    series.setdefault(f"{c} ({key.replace('_s', '').replace('_', ' ')})", {})[r["graph"]] = rec[key]
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(max(7.0, 0.18 * len(rows) + 3), 3.5))
    x = list(range(len(rows)))
    for label, vals in series.items():
        pts = [(i, vals[r["graph"]]) for i, r in zip(x, rows) if r["graph"] in vals]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s", ms=4, label=label)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([r["graph"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("seconds")
    ax.set_title(f"K={K}: where the time goes before the first call (build / tuning wall time per graph)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _png(fig)


def bench_section(path: str) -> str:
    with open(path) as f:
        doc = json.load(f)
    if doc.get("mode") in ("cold_start", "call_overhead") and isinstance(doc.get("result"), dict):
        return _mode_section(doc)
    rows = doc.get("rows")
    schema = doc.get("schema")
    if isinstance(schema, str) and schema.startswith("spcompile-") and not schema.startswith("spcompile-bench/"):
        raise ValueError(f"{path}: not a benchmarks/bench.py result (schema {schema!r}: another script's output)")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "K" in r and "graph" in r for r in rows):
        raise ValueError(f"{path}: not a benchmarks/bench.py result (no 'rows' of graph and K, no --cold-start / "
                         "--call-overhead result)")
    s = doc.get("settings", {})
    env = doc.get("env", {})
    over = "baseline"
    columns = [c for c in s.get("columns", []) if c != "baseline"]
    if not columns:
        columns = sorted({c for r in rows for c in r.get("speedup", {})})
    out = [f"<h2>Benchmark: {html.escape(str(doc.get('name', os.path.basename(path))))}</h2>",
           f"<p>{html.escape(str(s.get('op')))} {html.escape(str(s.get('reduce') or ''))} "
           f"{html.escape(str(s.get('dtype', '')))} on {html.escape(str(env.get('device', s.get('target', '?'))))}; "
           f"{len(rows)} rows; generated by <code>{html.escape(str(doc.get('command', '?')))}</code> "
           f"({html.escape(str(doc.get('updated', '')))}).</p>"]
    summ = doc.get("summary", {})
    # speed-ups over the baseline of the table's dtype and, for 16-bit tables, over the fp32
    # baseline (the only one where the vendor library has no 16-bit kernel, e.g. SDDMM)
    overs = (("speedup", over), ("speedup_vs_fp32", "baseline_fp32"))
    srows = []
    for K, d in summ.items():
        for key, name in overs:
            for c, v in (d.get(key) or {}).items():
                worst = v.get("worst") or {}
                srows.append([K, c, name, v.get("graphs"), _x(v.get("geomean")), _x(v.get("geomean_over_200k")),
                              f"{_x(worst.get('speedup'))} ({worst.get('graph', '-')})", v.get("below_1x")])
    if srows:
        out.append(_table(["K", "column", "over", "graphs", "geomean speed-up", "geomean, nnz > 200k", "worst",
                           "graphs below 1x"], srows))
    for K in sorted({r["K"] for r in rows}):
        kr = [r for r in rows if r["K"] == K]
        # the speed-ups the rows have (at least the plot over the table's own baseline)
        for key, name in [o for o in overs if any(r.get(o[0]) for r in kr)] or overs[:1]:
            out.append(_speedup_plot(kr, K, columns, name, key))
        w = _wall_plot(kr, K)
        if w:
            out.append(w)
    return "\n".join(out)


def _mode_section(doc) -> str:
    """A ``bench.py --cold-start`` or ``--call-overhead`` result as a table."""
    res, env = doc["result"], doc.get("env", {})
    out = [f"<h2>{html.escape(doc['mode'].replace('_', ' '))} ({html.escape(str(env.get('device', 'host')))})</h2>",
           f"<p>Generated by <code>{html.escape(str(doc.get('command', '?')))}</code> "
           f"({html.escape(str(doc.get('updated', '')))}).</p>"]
    if doc["mode"] == "cold_start":
        rows = [[k, f"{res[k]['median_s']:.3f}", "-", "-", "-", "-"] for k in ("python -c pass", "import spcompile")
                if isinstance(res.get(k), dict) and "median_s" in res[k]]
        for t, r in (res.get("targets") or {}).items():
            rows.append([f"import + load + first call, target {t}",
                         f"{r['median_s']:.3f}" if "median_s" in r else "-",
                         *[f"{r[k]:.3f}" if k in r else "-" for k in ("import_s", "load_s", "first_call_s")],
                         r.get("status", "-")])
        out.append("<p>Wall time of a fresh process, median of runs, seconds.</p>")
        out.append(_table(["what", "wall s", "import s", "load s", "first call s", "result"], rows))
    else:
        rows = [[k, f"{r['out_us']:.1f}" if "out_us" in r else r.get("error", "-"),
                 f"{r['alloc_us']:.1f}" if "alloc_us" in r else "-"] for k, r in (res.get("modules") or {}).items()]
        out.append(f"<p>Host time per call from Python on {html.escape(str(res.get('matrix', '?')))}; baseline "
                   f"{html.escape(str(res.get('baseline')))}: {res.get('baseline_us', float('nan')):.1f} us.</p>")
        out.append(_table(["module", "mod(X, out=Y) us", "mod(X) us"], rows))
    return "\n".join(out)


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


# -- the page ---------------------------------------------------------------------------------
STYLE = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 6px}"
         "th{background:#f3f3f3}img{max-width:100%;display:block;margin:1em 0}code{font-size:12px}")


def render(storage=None, bench=(), title: str = "spcompile report", include_db: bool = True) -> str:
    from .._version import __version__

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
             f"<p>spcompile {__version__}, {datetime.datetime.now().isoformat(timespec='seconds')}</p>"]
    for p in bench:
        parts.append(bench_section(p))
    if include_db:
        parts.append(database_section(storage))
    parts.append("</body></html>")
    return "\n".join(parts)


def cmd_report(args) -> int:
    global DPI
    DPI = args.dpi
    page = render(args.storage, args.bench or (), args.title, include_db=not args.no_db)
    with open(args.output, "w") as f:
        f.write(page)
    print(f"wrote {args.output} ({page.count('<img')} plots)")
    return 0


def add_command(sub) -> None:
    r = sub.add_parser("report", help="an HTML page of plots from the tuning database and benchmark JSON",
                       description=__doc__.split("\n\n")[0])
    r.add_argument("--storage", default=None, help="tuning database: Optuna storage URL or SQLite path "
                   "(default: $SPCOMPILE_TUNING_DB or the embedded tuning_logs/spcompile.db)")
    r.add_argument("--bench", nargs="+", default=None, metavar="JSON",
                   help="benchmarks/bench.py result files to draw")
    r.add_argument("--no-db", action="store_true", help="only the benchmark files, no tuning database")
    r.add_argument("--title", default="spcompile report")
    r.add_argument("--dpi", type=int, default=110, help="resolution of the plots (smaller file: 72)")
    r.add_argument("-o", "--output", default="spcompile-report.html")
    r.set_defaults(func=cmd_report)

