#!/usr/bin/env python
"""Run every registered preprocessing pass over the shared graphs and tabulate its metrics.

For each pass and graph it calls ``spcompile.passes.run(name, A, **options)`` (in a forked child
process, so that a per-pass per-graph time limit can be enforced and a crash is only a table
entry) and records the pass's metric dict.  Writes a markdown report (default
``benchmarks/results/passes.md``; ``--write-docs``: ``docs/passes.md``, the published table) and
the raw results as JSON (default ``benchmarks/results/passes.json``).

    python benchmarks/passes.py                              # all passes, all graphs
    python benchmarks/passes.py --passes tile.sgt --graphs cora pubmed
    python benchmarks/passes.py --max-nnz 2e6 --max-nnz cluster.lsh=5e5 --timeout 300
    python benchmarks/passes.py --passes reorder.vnm --merge  # re-run one pass, keep the others

Graphs: ``--graphs-dir``, else ``$SPCOMPILE_GRAPHS``, else ``../shared/data/graphs`` (relative to
the repository root), every ``*.npz`` readable by ``scipy.sparse.load_npz``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback

import numpy as np
import scipy
import scipy.sparse as sp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The passes of the project's papers and what to show for each: (before, after) metric pairs,
# single metrics, and the paper's reference numbers for the summary.  Passes not listed here
# (or metrics not named here) are still run and shown: any "<x>_before"/"<x>_after" pair is
# detected, other scalar metrics are listed.
KNOWN = {
    "reorder.vnm": {
        "pairs": [("violations_before", "violations_after"), ("conforms_before", "conforms")],
        "singles": ["improvement_rate"],
        "paper": "SOGRE Table 7: 5-9% of matrices conform to V:N:M before reordering, 88-94% after",
        "note": "a matrix conforms when it has no V:N:M violation (`conforms_before` / `conforms`, "
                "else `violations_* == 0`); the summary gives the fraction of conforming graphs.",
    },
    "cluster.lsh": {
        "pairs": [("dense_ratio_before", "dense_ratio_after"),
                  ("avg_similarity_before", "avg_similarity_after")],
        "singles": [],
        "paper": "",
    },
    "tile.aspt": {
        "pairs": [],
        "singles": ["dense_ratio"],
        "paper": "",
    },
    "tile.sgt": {
        "pairs": [("blocks_before", "blocks_after"), ("density_before", "density_after")],
        "singles": [],
        "paper": "TC-GNN Fig. 7: SGT removes 67.47% of the TC blocks on average (16x8 SpMM and 16x16 SDDMM blocks)",
        "note": "`blocks_before`: nonempty BLK_H x BLK_W blocks in the original column order (what a TC "
                "kernel without SGT traverses); `blocks_after`: TC blocks after SGT, sum(winPartition); "
                "density = nnz / (blocks x BLK_H x BLK_W). Default shape 16x8 (tf32 SpMM); the "
                "`[shape=sddmm]` run uses 16x16 blocks. The summary's 'on average per graph' is the "
                "mean of the per-graph reductions (how Fig. 7 averages); 'total' pools all graphs.",
        # also run with these options, reported as "tile.sgt[shape=sddmm]" (Fig. 7's SDDMM bars)
        "variants": [{"shape": "sddmm"}],
        # the shared graphs that are also in TC-GNN's Table 4 (Type I and II)
        "paper_graphs": ["citeseer", "cora", "pubmed", "tu_proteins_full", "tu_dd"],
    },
}
SKIP_KEYS = {"seconds"}


# ---------------------------------------------------------------------------- helpers

def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return _jsonable(v.tolist()) if v.size <= 64 else f"<array {v.shape} {v.dtype}>"
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (np.floating, float)):
        v = float(v)
        return v if math.isfinite(v) else str(v)
    if v is None or isinstance(v, (int, str)):
        return v
    return repr(v)


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
        return f"{v:.3f}" if abs(v) >= 0.001 else f"{v:.2e}"
    if v is None:
        return ""
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _parse_limit(values, cast, what):
    """``["2e6", "cluster.lsh=5e5"]`` -> (global value or None, {pass: value})."""
    glob_v, per = None, {}
    for item in values or ():
        if "=" in item:
            k, v = item.split("=", 1)
            per[k.strip()] = cast(float(v))
        else:
            glob_v = cast(float(item))
    return glob_v, per


def _parse_options(values):
    """``["tile.sgt.BLK_W=16", "reorder.vnm.N=2"]``: pass name = all but the last dotted part."""
    out: dict[str, dict] = {}
    for item in values or ():
        if "=" not in item:
            raise SystemExit(f"--option expects PASS.KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        name, _, key = k.rpartition(".")
        if not name or not key:
            raise SystemExit(f"--option expects PASS.KEY=VALUE, got {item!r}")
        try:
            v = json.loads(v)
        except ValueError:
            pass  # a plain string
        out.setdefault(name, {})[key] = v
    return out


def find_graphs(directory: str, names=None) -> list[str]:
    files = sorted(glob.glob(os.path.join(directory, "*.npz")))
    if names:
        want = {os.path.splitext(os.path.basename(n))[0] for n in names}
        files = [f for f in files if os.path.splitext(os.path.basename(f))[0] in want]
        missing = want - {os.path.splitext(os.path.basename(f))[0] for f in files}
        if missing:
            raise SystemExit(f"graphs not found in {directory}: {sorted(missing)}")
    return files


# ---------------------------------------------------------------------------- running

def load_passes():
    """({name: PassInfo}, {name: import error}): each pass module is imported on its own, so
    that one broken module (another helper's work in progress) does not stop the others."""
    import importlib

    from spcompile.passes import base

    errors = {}
    for mod in ("reorder_simple", "reorder_vnm", "cluster_lsh", "tile_aspt", "tile_sgt"):
        try:
            importlib.import_module(f"spcompile.passes.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"spcompile.passes.{mod}":
                errors[mod.replace("_", ".", 1)] = f"import failed: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            errors[mod.replace("_", ".", 1)] = f"import failed: {type(e).__name__}: {e}"
    try:
        base._load_builtin()
    except Exception:  # noqa: BLE001 -- already recorded per module above
        pass
    try:
        base._load_entry_points()
    except Exception:  # noqa: BLE001
        pass
    infos = {}
    for name, cls in sorted(base._REGISTRY.items()):
        try:
            infos[name] = cls().info
        except Exception as e:  # noqa: BLE001
            errors[name] = f"cannot instantiate: {type(e).__name__}: {e}"
    return infos, errors


def _worker(conn, name, A, options):
    try:
        from spcompile.passes import run

        t0 = time.perf_counter()
        mod = run(name, A, **options)
        wall = time.perf_counter() - t0
        conn.send(("ok", _jsonable(dict(mod.metrics.get(name, {}))), wall))
    except BaseException as e:  # noqa: BLE001 -- every failure is a table entry
        tb = traceback.format_exc(limit=4)
        conn.send(("error", f"{type(e).__name__}: {e}", tb))
    finally:
        conn.close()


def run_one(name, A, options, timeout, isolate):
    """(status, metrics, wall seconds, error text)."""
    if not isolate:
        from spcompile.passes import run

        t0 = time.perf_counter()
        try:
            mod = run(name, A, **options)
        except Exception as e:  # noqa: BLE001
            return "error", {}, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
        return "ok", _jsonable(dict(mod.metrics.get(name, {}))), time.perf_counter() - t0, None
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    p = ctx.Process(target=_worker, args=(child, name, A, options), daemon=True)
    p.start()
    child.close()
    msg = None
    try:
        if parent.poll(timeout):
            msg = parent.recv()
    except EOFError:
        msg = None
    wall = time.perf_counter() - t0
    if msg is None:
        if p.is_alive():
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
            p.join()
            return "timeout", {}, wall, f"no result within {timeout:g} s"
        p.join()
        return "error", {}, wall, f"worker died (exit code {p.exitcode})"
    p.join()
    if msg[0] == "ok":
        return "ok", msg[1], msg[2], None
    return "error", {}, wall, msg[1]


# ---------------------------------------------------------------------------- reporting

def _base(label: str) -> str:
    """Pass name of a result label (``"tile.sgt[shape=sddmm]"`` -> ``"tile.sgt"``)."""
    return label.split("[", 1)[0]


def _label(name: str, opts: dict) -> str:
    return name + ("[" + ",".join(f"{k}={v}" for k, v in opts.items()) + "]" if opts else "")


def _columns(name, rows, show_all=False):
    """The (kind, keys) columns to show for pass ``name`` given its results."""
    name = _base(name)
    spec = KNOWN.get(name, {"pairs": [], "singles": []})
    keys = set()
    for r in rows:
        keys.update(k for k, v in r.get("metrics", {}).items() if not isinstance(v, (dict, list)))
    cols, used = [], set()
    for b, a in spec["pairs"]:
        if b in keys or a in keys:
            cols.append(("pair", (b, a)))
            used.update((b, a))
    for s in spec["singles"]:
        if s in keys:
            cols.append(("single", (s,)))
            used.add(s)
    if cols and _base(name) in KNOWN and not show_all:
        return cols  # the other metrics are in the JSON
    for k in sorted(keys):  # other before/after pairs
        if k.endswith("_before") and k not in used:
            a = k[: -len("_before")] + "_after"
            if a in keys:
                cols.append(("pair", (k, a)))
                used.update((k, a))
    for k in sorted(keys - used - SKIP_KEYS):
        cols.append(("single", (k,)))
    return cols


def _cell(kind, keys, metrics):
    if kind == "pair":
        b, a = (metrics.get(k) for k in keys)
        s = f"{_fmt(b)} → {_fmt(a)}"
        if keys == ("blocks_before", "blocks_after") and _num(b) and _num(a) and b:
            s += f" ({(a - b) / b * 100:+.1f}%)"
        return s
    return _fmt(metrics.get(keys[0]))


def _header(kind, keys):
    if kind == "pair":
        b = keys[0][: -len("_before")] if keys[0].endswith("_before") else keys[0]
        return f"{b} before → after"
    if keys[0] == "reduction":
        return "reduction"
    return keys[0]


def _mean(xs):
    xs = [float(x) for x in xs if _num(x)]
    return (sum(xs) / len(xs)) if xs else None


def summarise(name, rows):
    """Averages over the graphs a pass ran on (plain dict, also written to the JSON)."""
    ok = [r for r in rows if r["status"] == "ok"]
    s = {"graphs": len(rows), "ok": len(ok),
         "errors": sum(r["status"] == "error" for r in rows),
         "timeouts": sum(r["status"] == "timeout" for r in rows),
         "skipped": sum(r["status"] == "skipped" for r in rows),
         "seconds_total": sum(r.get("seconds") or 0.0 for r in ok)}
    ms = [r["metrics"] for r in ok]
    if not ms:
        return s
    name = _base(name)
    for kind, keys in _columns(name, ok):
        for k in keys:
            v = _mean(m.get(k) for m in ms)
            if v is not None:
                s[f"mean_{k}"] = v
    if name == "tile.sgt":
        b = sum(m.get("blocks_before", 0) for m in ms)
        a = sum(m.get("blocks_after", 0) for m in ms)
        red = [1 - m["blocks_after"] / m["blocks_before"] for m in ms
               if _num(m.get("blocks_before")) and m.get("blocks_before")]
        s["mean_reduction"] = _mean(red)
        pg = set(KNOWN["tile.sgt"]["paper_graphs"])
        s["mean_reduction_paper_graphs"] = _mean(
            1 - r["metrics"]["blocks_after"] / r["metrics"]["blocks_before"] for r in ok
            if r["graph"] in pg and r["metrics"].get("blocks_before"))
        s["paper_graphs"] = sorted(pg & {r["graph"] for r in ok})
        s["total_blocks_before"], s["total_blocks_after"] = b, a
        s["total_reduction"] = (1 - a / b) if b else None
    if name == "reorder.vnm":
        def conforming(m, when):
            for k in (f"conforms_{when}",) + (("conforms",) if when == "after" else ()):
                if k in m and isinstance(m[k], bool):
                    return m[k]
            v = m.get(f"violations_{when}")
            return (v == 0) if _num(v) else None

        for when in ("before", "after"):
            c = [conforming(m, when) for m in ms]
            c = [x for x in c if x is not None]
            s[f"conforming_{when}"] = (sum(c) / len(c)) if c else None
    return s


def _summary_line(name, s):
    name = _base(name)
    if not s.get("ok"):
        return "no successful runs"
    parts = []
    if name == "tile.sgt":
        if s.get("mean_reduction") is not None:
            parts.append(f"TC blocks reduced by **{s['mean_reduction'] * 100:.2f}%** on average per graph "
                         f"(total {s['total_blocks_before']:,} → {s['total_blocks_after']:,}, "
                         f"{(s['total_reduction'] or 0) * 100:.2f}%)")
        if s.get("mean_reduction_paper_graphs") is not None:
            parts.append(f"on the paper's graphs ({', '.join(s['paper_graphs'])}): "
                         f"**{s['mean_reduction_paper_graphs'] * 100:.2f}%**")
    elif name == "reorder.vnm":
        cb, ca = s.get("conforming_before"), s.get("conforming_after")
        if cb is not None or ca is not None:
            parts.append("conforming matrices: " + " → ".join(
                f"**{x * 100:.1f}%**" if x is not None else "n/a" for x in (cb, ca)))
    for k, v in s.items():
        if k.startswith("mean_") and not k.startswith("mean_reduction") and v is not None:
            parts.append(f"mean {k[5:]} {_fmt(v)}")
    parts.append(f"{s['seconds_total']:.1f} s in total")
    return "; ".join(parts)


def render_markdown(res) -> str:
    meta = res["meta"]
    out = ["# Preprocessing passes on the shared graphs", "",
           f"Generated by `{meta['command']}` on {meta['date']} "
           f"({meta['machine']}, Python {meta['python']}, numpy {meta['numpy']}, scipy {meta['scipy']}).",
           f"Graphs: {meta['num_graphs']} from `{meta['graphs_dir_display']}`; each pass runs on its own "
           "(`spcompile.passes.run(name, A, **options)`, default options unless listed) "
           f"with a time limit of {meta['timeout']:g} s per pass and graph. "
           "*seconds* is the pass's own time as it reports it (`metrics['seconds']`).", "",
           "## Summary", "",
           "| pass | options | ok / graphs | errors | timeouts | skipped | result | paper |",
           "|---|---|---|---|---|---|---|---|"]
    for name, pr in res["passes"].items():
        s = pr.get("summary", {})
        if pr["status"] == "missing":
            out.append(f"| `{name}` | | 0 / {meta['num_graphs']} | | | | **not available**: "
                       f"{_md_escape(pr.get('error', ''))} | {KNOWN.get(_base(name), {}).get('paper', '')} |")
            continue
        opts = ", ".join(f"{k}={v}" for k, v in pr.get("options", {}).items())
        out.append(f"| `{name}` | {_md_escape(opts)} | {s.get('ok', 0)} / {s.get('graphs', 0)} | "
                   f"{s.get('errors', 0)} | {s.get('timeouts', 0)} | {s.get('skipped', 0)} | "
                   f"{_md_escape(_summary_line(name, s))} | {KNOWN.get(_base(name), {}).get('paper', '')} |")
    notes = [(n, KNOWN[n]["note"]) for n in KNOWN if KNOWN[n].get("note")
             and any(_base(k) == n for k in res["passes"])]
    if notes:
        out += ["", "Metrics:", ""] + [f"- `{n}`: {t}" for n, t in notes]
    for name, pr in res["passes"].items():
        out += ["", f"## `{name}`", ""]
        if pr["status"] == "missing":
            out.append(f"Not run: {_md_escape(pr.get('error', ''))}")
            continue
        rows = pr["results"]
        cols = _columns(name, [r for r in rows if r["status"] == "ok"])
        head = ["graph", "rows", "nnz"] + [_header(k, ks) for k, ks in cols] + ["seconds", "status"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in rows:
            m = r.get("metrics", {})
            secs = m.get("seconds", r.get("seconds"))
            status = r["status"] if r["status"] == "ok" else f"**{r['status']}**: {r.get('error') or ''}"
            cells = [r["graph"], _fmt(r["rows"]), _fmt(r["nnz"])]
            cells += [_cell(k, ks, m) if r["status"] == "ok" else "" for k, ks in cols]
            cells += [f"{secs:.3f}" if _num(secs) else "", status]
            out.append("| " + " | ".join(_md_escape(str(c)) for c in cells) + " |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs-dir", default=None,
                    help="directory of *.npz graphs (default $SPCOMPILE_GRAPHS or ../shared/data/graphs)")
    ap.add_argument("--graphs", nargs="+", help="only these graphs (file names without .npz)")
    ap.add_argument("--passes", nargs="+", help="only these passes (default: every registered pass "
                    "plus the papers' passes, reported as missing when not registered)")
    ap.add_argument("--max-nnz", action="append", metavar="[PASS=]N",
                    help="skip graphs with more stored entries, for all passes or one pass (repeatable)")
    ap.add_argument("--timeout", action="append", metavar="[PASS=]SECONDS",
                    help="time limit per pass and graph (default 600; repeatable, PASS=S for one pass)")
    ap.add_argument("--option", action="append", metavar="PASS.KEY=VALUE",
                    help="pass option override, value parsed as JSON when it parses (repeatable)")
    ap.add_argument("--no-variants", action="store_true",
                    help="skip the extra option variants of the papers' passes (e.g. tile.sgt[shape=sddmm])")
    ap.add_argument("--no-isolate", action="store_true",
                    help="run in this process (no time limit, a crash stops the run)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the existing JSON's results for passes not run now")
    ap.add_argument("--out-md", default=None,
                    help="markdown report (default benchmarks/results/passes.md; see --write-docs)")
    ap.add_argument("--write-docs", action="store_true", help="write the markdown report to docs/passes.md")
    ap.add_argument("--out-json", default=os.path.join(ROOT, "benchmarks", "results", "passes.json"))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.out_md is None:
        args.out_md = os.path.join(ROOT, "docs" if args.write_docs else os.path.join("benchmarks", "results"),
                                   "passes.md")

    gdir = args.graphs_dir or os.environ.get("SPCOMPILE_GRAPHS") or \
        os.path.join(ROOT, "..", "shared", "data", "graphs")
    gdir_display = os.path.relpath(gdir, ROOT) if os.path.abspath(gdir).startswith(os.path.dirname(ROOT)) else gdir
    files = find_graphs(gdir, args.graphs)
    if not files:
        raise SystemExit(f"no *.npz graphs in {gdir}")
    max_nnz, max_nnz_per = _parse_limit(args.max_nnz, int, "--max-nnz")
    timeout, timeout_per = _parse_limit(args.timeout, float, "--timeout")
    timeout = 600.0 if timeout is None else timeout
    pass_opts = _parse_options(args.option)

    registered, import_errors = load_passes()
    names = args.passes or sorted(set(registered) | set(KNOWN))
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))

    graphs = []
    for f in files:
        A = sp.load_npz(f).tocsr()
        graphs.append((os.path.splitext(os.path.basename(f))[0], A))
    graphs.sort(key=lambda g: (g[1].nnz, g[0]))

    res = {"meta": {
        "command": "python benchmarks/passes.py" + ("" if argv is None and len(sys.argv) < 2 else
                                                    " " + " ".join(argv if argv is not None else sys.argv[1:])),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
        "graphs_dir": os.path.abspath(gdir), "graphs_dir_display": gdir_display,
        "num_graphs": len(graphs), "timeout": timeout, "timeout_per_pass": timeout_per,
        "max_nnz": max_nnz, "max_nnz_per_pass": max_nnz_per}, "passes": {}}
    if args.merge and os.path.exists(args.out_json):
        with open(args.out_json) as fh:
            old = json.load(fh)
        for k, v in old.get("passes", {}).items():
            if _base(k) not in names:
                res["passes"][k] = v

    jobs = []  # (label, pass name, options given to run())
    for name in names:
        jobs.append((name, name, pass_opts.get(name, {})))
        if not args.no_variants:
            for v in KNOWN.get(name, {}).get("variants", ()):
                jobs.append((_label(name, v), name, {**pass_opts.get(name, {}), **v}))
    for label, name, given in jobs:
        if name not in registered:
            res["passes"][label] = {"status": "missing", "error": import_errors.get(
                name, "pass not registered (its module is missing)")}
            log(f"{label}: not registered, skipped")
            continue
        opts = {**registered[name].options, **given}
        lim = max_nnz_per.get(name, max_nnz)
        tmo = timeout_per.get(name, timeout)
        rows = []
        for gname, A in graphs:
            row = {"graph": gname, "rows": int(A.shape[0]), "cols": int(A.shape[1]), "nnz": int(A.nnz)}
            if lim is not None and A.nnz > lim:
                row.update(status="skipped", error=f"nnz > {lim:,}", metrics={}, seconds=None)
            else:
                status, metrics, wall, err = run_one(name, A, given, tmo, not args.no_isolate)
                row.update(status=status, metrics=metrics, seconds=wall, error=err)
            rows.append(row)
            log(f"{label:14s} {gname:28s} nnz={A.nnz:>10,} {row['status']:8s} "
                f"{(row['seconds'] or 0):8.2f}s {row['error'] or ''}")
        res["passes"][label] = {"status": "ok", "pass": name, "options": _jsonable(opts), "results": rows}
        res["passes"][label]["summary"] = _jsonable(summarise(label, rows))
    res["passes"] = dict(sorted(res["passes"].items()))

    os.makedirs(os.path.dirname(os.path.abspath(args.out_json)), exist_ok=True)
    with open(args.out_json, "w") as fh:
        json.dump(_jsonable(res), fh, indent=1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out_md)), exist_ok=True)
    with open(args.out_md, "w") as fh:
        fh.write(render_markdown(res))
    log(f"wrote {args.out_md} and {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
