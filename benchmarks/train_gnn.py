"""GNN training steps through spcompile.nn against PyTorch Geometric.

Per graph, model (2-layer GCN, 2-layer GAT) and precision (fp32; fp16 / bf16 autocast), one
training step -- forward, cross-entropy loss, backward, Adam step -- timed per step after warm-up
(CUDA events around each step on the GPU; perf_counter on the CPU), for:

* ``spcompile``: :class:`spcompile.nn.GCNConv` / :class:`spcompile.nn.GATConv` on a prepared graph,
* ``pyg_edge_index``: PyG ``GCNConv(cached=True)`` with ``edge_index``,
* ``pyg_adj_t``: PyG ``GCNConv(normalize=False)`` with the normalised adjacency as a torch sparse
  CSR tensor (cuSPARSE on the GPU),
* ``pyg``: PyG ``GATConv`` with ``edge_index``,
* ``spcompile_compiled`` (``--compile``): the spcompile model under ``torch.compile(fullgraph=True)``.

Every implementation starts from the same parameters (the spcompile model's, loaded into the PyG
model: the layers use PyG's parameter names) and trains on the same random features and labels;
the loss curves over ``--steps`` steps are compared (largest difference to spcompile's curve).
The first step (graph preparation and module builds) is reported on its own (``first_step_s``).
Writes ``train_gnn.json`` and ``train_gnn.md`` under ``--out``.

GPU run (shared graphs with more than 100k nonzeros, the default)::

    python benchmarks/train_gnn.py --device cuda --out results/train_gnn

CPU smoke test::

    python benchmarks/train_gnn.py --device cpu --graphs cora --steps 5 --warmup 1 --out /tmp/tg
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

PRECISIONS = {"fp32": None, "fp16": "float16", "bf16": "bfloat16"}


def _pyg():
    try:
        import torch_geometric.nn as pyg_nn

        return pyg_nn
    except Exception as e:   # not installed / broken install: baselines are left out, said in the output
        return e


def make_models(kind, F, hidden, classes, heads, pyg_nn, impls):
    """{impl: model} with one set of parameters."""
    import torch

    from spcompile import nn as snn

    class Net(torch.nn.Module):
        def __init__(self, c1, c2, act):
            super().__init__()
            self.c1, self.c2, self.act = c1, c2, act

        def forward(self, x, g):
            return self.c2(self.act(self.c1(x, g)), g)

    if kind == "gcn":
        ours = Net(snn.GCNConv(F, hidden), snn.GCNConv(hidden, classes), torch.relu)
    else:
        ours = Net(snn.GATConv(F, hidden, heads=heads), snn.GATConv(hidden * heads, classes, heads=1),
                   torch.nn.functional.elu)
    models = {"spcompile": ours}
    if "spcompile_compiled" in impls:
        twin = make_models(kind, F, hidden, classes, heads, None, ("spcompile",))["spcompile"]
        twin.load_state_dict(ours.state_dict())
        models["spcompile_compiled"] = torch.compile(twin, fullgraph=True)
    if isinstance(pyg_nn, Exception) or pyg_nn is None:
        return models
    if kind == "gcn":
        cand = {"pyg_edge_index": lambda: Net(pyg_nn.GCNConv(F, hidden, cached=True),
                                              pyg_nn.GCNConv(hidden, classes, cached=True), torch.relu),
                "pyg_adj_t": lambda: Net(pyg_nn.GCNConv(F, hidden, normalize=False),
                                         pyg_nn.GCNConv(hidden, classes, normalize=False), torch.relu)}
    else:
        cand = {"pyg": lambda: Net(pyg_nn.GATConv(F, hidden, heads=heads), pyg_nn.GATConv(hidden * heads, classes, heads=1),
                                   torch.nn.functional.elu)}
    for name, make in cand.items():
        if name not in impls:
            continue
        m = make()
        m.load_state_dict(_mapped_state(ours.state_dict(), m.state_dict(), name))
        models[name] = m
    return models


def _mapped_state(mine: dict, theirs: dict, name: str) -> dict:
    """Our parameters under the PyG model's names: the same names, or (PyG versions whose GATConv
    keeps ``lin_src`` / ``lin_dst``, one shared weight for a single input) ``lin``'s weight."""
    out = {}
    for k in theirs:
        src = k if k in mine else k.replace(".lin_src.", ".lin.").replace(".lin_dst.", ".lin.")
        if src not in mine or tuple(mine[src].shape) != tuple(theirs[k].shape):
            raise RuntimeError(f"{name}: no parameter of spcompile's model for {k!r} {tuple(theirs[k].shape)}; "
                               f"cannot start from the same parameters")
        out[k] = mine[src]
    unused = set(mine) - {k if k in mine else k.replace(".lin_src.", ".lin.").replace(".lin_dst.", ".lin.")
                          for k in theirs}
    if unused:
        raise RuntimeError(f"{name}: spcompile's parameters {sorted(unused)} have no counterpart in the PyG model")
    return out


def run_impl(model, graph_arg, x, y, steps, warmup, precision, device, lr, graphed=False):
    """Train ``steps`` steps from the model's current parameters: per-step times (after
    ``warmup`` steps), the losses, the first step's time.

    ``graphed``: the whole step (forward, loss, backward, ``Adam(capturable=True)`` step) captured
    once in a CUDA graph and replayed -- PyTorch's whole-network capture recipe: the first step
    eagerly (module builds, caches), three more eagerly on a side stream, one step captured (the
    capture runs nothing), then every further step one replay.  Times are those of the replays."""
    import torch

    model.to(device)
    cuda = device.type == "cuda"
    if graphed and not cuda:
        raise ValueError("CUDA-graph capture needs a CUDA device")
    opt = torch.optim.Adam(model.parameters(), lr=lr, capturable=graphed)
    amp = PRECISIONS[precision]

    def step():
        opt.zero_grad(set_to_none=not graphed)
        with (torch.autocast(device.type, dtype=getattr(torch, amp), cache_enabled=not graphed) if amp
              else contextlib.nullcontext()):
            out = model(x, graph_arg)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    losses, times = [], []
    t0 = time.perf_counter()
    losses.append(step())
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    run = step
    if graphed:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(min(3, steps - 1)):
                losses.append(step().clone())
        torch.cuda.current_stream().wait_stream(side)
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            static_loss = step()

        def run():
            cg.replay()
            return static_loss.clone()
    for i in range(len(losses), steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            losses.append(run())
            b.record()
            times.append((a, b))
        else:
            t = time.perf_counter()
            losses.append(run())
            times.append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in times]
    else:
        times = [t * 1e3 for t in times]
    # the first ``warmup`` steps are not counted; the untimed ones (the first, the side-stream
    # warm-up of a graphed run) are among them
    timed = times[max(0, warmup - (steps - len(times))):] or times
    return {"ms_per_step": statistics.median(timed) if timed else float("nan"),
            "ms_mean": statistics.fmean(timed) if timed else float("nan"),
            "steps_timed": len(timed), "first_step_s": first,
            "losses": [float(l) for l in torch.stack(losses).float().cpu()]}


def graph_inputs(A, device, kind, impl, build_options):
    """What ``impl``'s model takes as its graph argument."""
    import torch

    from spcompile import nn as snn

    coo = A.tocoo()
    edge_index = torch.from_numpy(np.stack([coo.col, coo.row]).astype(np.int64)).to(device)   # source -> target
    n = A.shape[0]
    if impl.startswith("spcompile"):
        g = snn.gcn_norm(edge_index, n, **build_options) if kind == "gcn" else snn.gat_graph(edge_index, n, **build_options)
        return g.to(device)
    if impl == "pyg_adj_t":
        C = snn.gcn_norm(edge_index, n).csr
        return torch.sparse_csr_tensor(torch.from_numpy(C.indptr.astype(np.int64)),
                                       torch.from_numpy(C.indices.astype(np.int64)),
                                       torch.from_numpy(np.array(C.data, np.float32)), C.shape).to(device)
    return edge_index


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", nargs="*", help="graph names or paths (default: every graph with > --min-nnz nonzeros)")
    p.add_argument("--data", help="graph folder (default: $SPCOMPILE_GRAPHS or ../shared/data/graphs)")
    p.add_argument("--min-nnz", type=int, default=100_000)
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--models", default="gcn,gat")
    p.add_argument("--precisions", default="fp32,fp16,bf16")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128, help="GCN hidden width; GAT: width per head is hidden // heads")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--compile", action="store_true", help="also time the spcompile model under torch.compile(fullgraph=True)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time every implementation with its whole training step captured in a CUDA graph "
                        "(<impl>_graphed; PyTorch's whole-network capture)")
    p.add_argument("--pyg-rerun", action="store_true",
                   help="also train every PyG model a second time from the same initial parameters (<impl>_rerun): "
                        "the loss difference between PyG's two runs is the fp32-noise reference for spcompile's")
    p.add_argument("--build-options", default="{}", help="JSON keyword arguments of spcompile.build for the graphs' "
                                                        "modules, e.g. '{\"tune\": true, \"timeout\": 60}'")
    p.add_argument("--resume", action="store_true", help="keep the rows of an earlier run's train_gnn.json under "
                                                      "--out and measure only the others (long runs in pieces)")
    p.add_argument("--require-pyg", action="store_true", help="fail when torch_geometric does not import")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    import torch

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    build_options = json.loads(a.build_options)
    pyg_nn = _pyg()
    if isinstance(pyg_nn, Exception):
        if a.require_pyg:
            raise SystemExit(f"torch_geometric does not import: {pyg_nn}")
        print(f"note: torch_geometric does not import ({pyg_nn}); measuring spcompile only", flush=True)
    graphs = common.find_graphs(a.graphs, a.data, None if a.graphs else a.min_nnz)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    precisions = [q.strip() for q in a.precisions.split(",") if q.strip()]
    for q in precisions:
        if q not in PRECISIONS:
            raise SystemExit(f"unknown precision {q!r}; choose from {list(PRECISIONS)}")
    results = []
    out_json = os.path.join(a.out, "train_gnn.json")
    if a.resume and os.path.isfile(out_json):
        with open(out_json) as f:
            results = [r for r in json.load(f).get("results", [])
                       if "error" not in r["impls"].get("spcompile", {"error": 1})]
        print(f"resuming: {len(results)} rows already measured", flush=True)
    done = {(r["graph"], r["model"], r["precision"]) for r in results}
    for name, path, nnz in graphs:
        if all((name, k, q) in done for k in models for q in precisions):
            continue
        A = common.load_matrix(path)
        if A.shape[0] != A.shape[1]:
            print(f"{name}: not square, skipped", flush=True)
            continue
        n = A.shape[0]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(n, a.features, generator=gen).to(device)
        y = torch.randint(0, a.classes, (n,), generator=gen).to(device)
        prepared = {}
        for kind in models:
            impls = ["spcompile"] + (["spcompile_compiled"] if a.compile else []) + \
                (["pyg_edge_index", "pyg_adj_t"] if kind == "gcn" else ["pyg"])
            hidden = a.hidden if kind == "gcn" else max(1, a.hidden // a.heads)
            for prec in precisions:
                if (name, kind, prec) in done:
                    continue
                torch.manual_seed(1)
                ms = make_models(kind, a.features, hidden, a.classes, a.heads, pyg_nn, impls)
                if a.pyg_rerun:      # PyG again from the same parameters: its run-to-run noise
                    ms.update({f"{k}_rerun": copy.deepcopy(m) for k, m in list(ms.items()) if k.startswith("pyg")})
                if a.cuda_graph:     # twins from the same initial parameters, trained on their own
                    ms.update({f"{k}_graphed": copy.deepcopy(m) for k, m in list(ms.items())
                               if k != "spcompile_compiled" and not k.endswith("_rerun")})
                row = {"graph": name, "rows": n, "nnz": int(A.nnz), "model": kind, "precision": prec,
                       "device": str(device), "impls": {}}
                for impl, model in ms.items():
                    try:
                        base_impl = impl.removesuffix("_graphed").removesuffix("_rerun")
                        gkey = (kind, "spcompile" if impl.startswith("spcompile") else base_impl)
                        if gkey not in prepared:   # one graph per model kind and input form (its modules
                            prepared[gkey] = graph_inputs(A, device, kind, base_impl, build_options)  # per dtype)
                        garg = prepared[gkey]
                        r = run_impl(model, garg, x, y, a.steps, a.warmup, prec, device, a.lr,
                                     graphed=impl.endswith("_graphed"))
                    except Exception as e:   # one implementation failing does not stop the run; recorded
                        r = {"error": f"{type(e).__name__}: {e}"}
                    row["impls"][impl] = r
                    print(f"{name} {kind} {prec} {impl}: " + (f"{r['ms_per_step']:.3f} ms/step, first step "
                          f"{r['first_step_s']:.2f} s, final loss {r['losses'][-1]:.4f}" if "error" not in r
                          else r["error"]), flush=True)
                summarize_row(row)
                results.append(row)
                common.write_json(out_json, {
                    "args": vars(a), "versions": common.versions(), "device": common.device_name(device.type),
                    "pyg": None if isinstance(pyg_nn, Exception) else "imported", "results": results})
    common.write_text(os.path.join(a.out, "train_gnn.md"), markdown(results, device))
    print(open(os.path.join(a.out, "train_gnn.md")).read())
    return 0


def summarize_row(row) -> None:
    """The row's speed-ups: ``speedup`` = the faster eager PyG baseline's step time / spcompile's
    eager one; with CUDA-graph runs, ``speedup_graphed`` = the fastest PyG time in any mode (eager
    or graphed) / spcompile's graphed one.  ``max_loss_diff``: the largest difference between
    spcompile's loss curve and any baseline's, ``loss_diff_20``: the same over the first 20 steps
    (later steps of two fp32 runs drift apart as rounding differences grow).  With ``--pyg-rerun``:
    ``pyg_rerun_max_loss_diff`` / ``pyg_rerun_loss_diff_20``, the same between PyG's two runs of
    one implementation (its own run-to-run noise, the reference for spcompile's differences)."""
    everything = {k: v for k, v in row["impls"].items() if "error" not in v}
    ok = {k: v for k, v in everything.items() if not k.endswith("_rerun")}
    reruns = [[abs(p - q) for p, q in zip(everything[k.removesuffix("_rerun")]["losses"], v["losses"])]
              for k, v in everything.items() if k.endswith("_rerun") and k.removesuffix("_rerun") in everything]
    if reruns:
        row["pyg_rerun_max_loss_diff"] = max(max(d) for d in reruns)
        row["pyg_rerun_loss_diff_20"] = max(max(d[:20]) for d in reruns)
    ours = ok.get("spcompile")
    eager = {k: v for k, v in ok.items() if k.startswith("pyg") and not k.endswith("_graphed")}
    anymode = {k: v for k, v in ok.items() if k.startswith("pyg")}
    if ours is None or not eager:
        return
    best = min(eager, key=lambda k: eager[k]["ms_per_step"])
    row["best_pyg"] = best
    row["speedup"] = eager[best]["ms_per_step"] / ours["ms_per_step"]
    diffs = [[abs(p - q) for p, q in zip(ours["losses"], v["losses"])] for v in anymode.values()]
    row["max_loss_diff"] = max(max(d) for d in diffs)
    row["loss_diff_20"] = max(max(d[:20]) for d in diffs)
    g = ok.get("spcompile_graphed")
    if g is not None:
        top = min(anymode, key=lambda k: anymode[k]["ms_per_step"])
        row["best_pyg_any"] = top
        row["speedup_graphed"] = anymode[top]["ms_per_step"] / g["ms_per_step"]


def markdown(results, device) -> str:
    impls = sorted({k for r in results for k in r["impls"]}, key=lambda k: (not k.startswith("spcompile"), k))
    graphed = any("speedup_graphed" in r for r in results)
    rerun = any("pyg_rerun_max_loss_diff" in r for r in results)
    header = ["graph", "rows", "nnz", "model", "precision"] + [f"{k} ms/step" for k in impls] + \
        ["speedup vs best PyG"] + (["graphed speedup vs best PyG (any mode)"] if graphed else []) + \
        ["loss diff (20 steps)", "max loss diff"] + (["PyG vs PyG rerun: loss diff (20 steps)", "max"] if rerun else [])
    rows = []
    for r in results:
        cells = [r["graph"], r["rows"], r["nnz"], r["model"], r["precision"]]
        for k in impls:
            v = r["impls"].get(k)
            cells.append("-" if v is None else ("error" if "error" in v else f"{v['ms_per_step']:.3f}"))
        cells.append(f"{r['speedup']:.2f}x" if "speedup" in r else "-")
        if graphed:
            cells.append(f"{r['speedup_graphed']:.2f}x" if "speedup_graphed" in r else "-")
        cells.append(f"{r['loss_diff_20']:.2e}" if "loss_diff_20" in r else "-")
        cells.append(f"{r['max_loss_diff']:.2e}" if "max_loss_diff" in r else "-")
        if rerun:
            cells += [f"{r[k]:.2e}" if k in r else "-" for k in ("pyg_rerun_loss_diff_20", "pyg_rerun_max_loss_diff")]
        rows.append(cells)
    lines = [f"# GNN training steps ({device})", ""] + common.md_table(header, rows)
    geo = {}
    for r in results:
        if "speedup" in r:
            geo.setdefault((r["model"], r["precision"]), {}).setdefault("eager", []).append(r["speedup"])
        if "speedup_graphed" in r:
            geo.setdefault((r["model"], r["precision"]), {}).setdefault("graphed", []).append(r["speedup_graphed"])
    if geo:
        lines += ["", "Geometric mean speed-up over the faster PyG baseline (eager: both eager; graphed: "
                  "spcompile's CUDA-graph step against PyG's fastest step in either mode):", ""]
        lines += common.md_table(
            ["model", "precision", "graphs", "geomean speedup (eager)", "geomean speedup (graphed)"],
            [[m, q, len(v.get("eager", [])), f"{common.geomean(v['eager']):.2f}x" if v.get("eager") else "-",
              f"{common.geomean(v['graphed']):.2f}x ({len(v['graphed'])})" if v.get("graphed") else "-"]
             for (m, q), v in sorted(geo.items())])
    errs = [(r["graph"], r["model"], r["precision"], k, v["error"]) for r in results
            for k, v in r["impls"].items() if "error" in v]
    if errs:
        lines += ["", "Errors:", ""] + [f"- {g} {m} {q} {k}: {e}" for g, m, q, k, e in errs]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
