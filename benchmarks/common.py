"""Pieces the benchmark scripts share: finding and loading graphs, geometric means, versions of
the software and device, atomic JSON writing and markdown tables.

Graphs are any folder of ``.npz`` (``scipy.sparse.save_npz``) or ``.mtx`` (Matrix Market) files;
the default folder is ``$SPCOMPILE_GRAPHS``, else ``../shared/data/graphs`` beside the checkout.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys

import numpy as np
import scipy.sparse as sp

from spcompile.cli.common import load_matrix as cli_load_matrix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRAPH_SUFFIXES = (".npz", ".mtx")


def default_graph_dir() -> str:
    return os.environ.get("SPCOMPILE_GRAPHS") or os.path.join(ROOT, "..", "shared", "data", "graphs")


def _name(path: str) -> str:
    base = os.path.basename(path)
    for s in GRAPH_SUFFIXES:
        if base.endswith(s):
            return base[: -len(s)]
    return base


def _manifest_nnz(folder: str) -> dict:
    """``{file name: nnz}`` from the folder's manifest.json when it has one (filtering by size
    without loading every matrix)."""
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            m = json.load(f)
        return {e["file"]: int(e["nnz"]) for e in m.get("matrices", []) if "file" in e and "nnz" in e}
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def load_matrix(path: str) -> sp.csr_matrix:
    """A graph file (read like ``spcompile build`` reads it) as a float32 CSR matrix with sorted
    indices and no duplicates."""
    A = cli_load_matrix(path).tocsr().astype(np.float32)
    A.sum_duplicates()
    A.sort_indices()
    return A


def find_graphs(graphs=None, data_dir: str | None = None, min_nnz: int | None = None,
                max_nnz: int | None = None) -> list[tuple[str, str, int]]:
    """``[(name, path, nnz)]``, fewest nonzeros first (a run cut short still covers most graphs).

    ``graphs``: names (looked up in ``data_dir``) or paths of files; None: every graph file in
    ``data_dir``.  A name or path that matches nothing is an error."""
    folder = data_dir or default_graph_dir()
    paths = []
    if graphs:
        for g in graphs:
            if os.path.isfile(g):
                paths.append(g)
                continue
            hit = [os.path.join(folder, g + s) for s in GRAPH_SUFFIXES if os.path.isfile(os.path.join(folder, g + s))]
            if not hit:
                raise FileNotFoundError(f"graph {g!r}: no file {g}.npz / {g}.mtx in {folder} and no such path")
            paths.append(hit[0])
    else:
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"graph folder {folder} does not exist (set --data or SPCOMPILE_GRAPHS)")
        paths = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(GRAPH_SUFFIXES))
    known: dict = {}
    out = []
    for p in paths:
        d = os.path.dirname(os.path.abspath(p))
        if d not in known:
            known[d] = _manifest_nnz(d)
        nnz = known[d].get(os.path.basename(p))
        if nnz is None:
            nnz = int(load_matrix(p).nnz)
        if (min_nnz is not None and nnz < min_nnz) or (max_nnz is not None and nnz > max_nnz):
            continue
        out.append((_name(p), p, nnz))
    names = [n for n, _, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"several graphs named {dup}: rename the files")
    return sorted(out, key=lambda t: (t[2], t[0]))


def geomean(xs) -> float:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def versions() -> dict:
    """Versions of the software a measurement depends on (absent packages left out)."""
    import scipy

    import spcompile

    v = {"spcompile": spcompile.__version__, "python": platform.python_version(), "numpy": np.__version__,
         "scipy": scipy.__version__, "machine": platform.machine()}
    for mod in ("torch", "cupy", "tvm", "optuna"):
        m = sys.modules.get(mod)
        if m is None:
            try:
                m = __import__(mod)
            except Exception:
                continue
        v[mod] = getattr(m, "__version__", "?")
    try:
        from spcompile.runtime import cuda as rt

        v["nvcc"] = rt.nvcc_version()
    except Exception:
        pass
    return v


def device_name(target: str) -> str:
    if target == "cuda":
        import torch

        return torch.cuda.get_device_name()
    try:
        from spcompile.runtime import cpu as rt_cpu

        n = rt_cpu.num_threads()  # TVM_NUM_THREADS, else every CPU this process may use
        from spcompile.kernels.tvm.cpu_csr import PARALLEL_MIN_THREADS

        pool = f"thread pool of {n}" + ("" if n >= PARALLEL_MIN_THREADS else "; default configs run on 1 thread")
        return f"{rt_cpu.host_cpu_name()} ({os.cpu_count()} CPUs, {pool})"
    except Exception:
        return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def write_json(path: str, obj) -> None:
    """Write ``obj`` as JSON atomically (a run killed mid-write keeps the previous file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    part = path + ".part"
    with open(part, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(part, path)


def write_rows(out_dir: str, name: str, script: str, argv, rows) -> None:
    """``<out_dir>/<name>.json``: the rows measured so far and the command that made them
    (``benchmarks/<script>`` with ``argv``, default ``sys.argv[1:]``).  The sweep scripts write it
    after every graph, so that a run cut short keeps its rows."""
    args = sys.argv[1:] if argv is None else argv
    write_json(os.path.join(out_dir, name + ".json"), {"command": f"benchmarks/{script} " + " ".join(args), "rows": rows})


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    part = path + ".part"
    with open(part, "w") as f:
        f.write(text)
    os.replace(part, path)


def md_table(header, rows) -> list[str]:
    """Markdown table lines."""
    out = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return out
