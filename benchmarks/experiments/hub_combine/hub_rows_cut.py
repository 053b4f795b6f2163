"""Is the split-row combine of hub rows the critical path of csr.crc_cwm at 16-bit K=64?

For graphs with hub rows, the ``default`` module's configuration of a committed table
(``docs/benchmarks/h100_spmm_fp16_default_big_v3.json``) is built through the product's
``build_from_config``, checked against float64 and timed by the Timer rule on (a) the graph, with
``max_seg`` and ``unroll`` / ``combine_vals`` varied, and (b) the graph with every row longer than
L cut into rows of at most L (the same nonzeros and X gathers; no long split-row combine).

    python benchmarks/experiments/hub_combine/hub_rows_cut.py [--build-only]   # from the project root

Writes ``hubdiag.json`` under ``$OUT`` (else the working directory).
"""
import json, os, sys
import numpy as np, scipy.sparse as sp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench, common
from spcompile.core.config import Config
from spcompile.kernels import get_template
build_only = "--build-only" in sys.argv
K = 64
t = {(r["graph"], r["K"]): r for r in json.load(open("docs/benchmarks/h100_spmm_fp16_default_big_v3.json"))["rows"]}
GRAPHS = ["twitch_de", "wiki_squirrel", "amazon_computers", "blogcatalog", "fb100_cornell5", "snap_sx_askubuntu", "fb100_mit8"]

def split_rows(A, L):
    A = A.tocsr(); A.sort_indices()
    lens = np.diff(A.indptr)
    pieces = np.maximum(1, -(-lens // L))
    first = np.concatenate([[0], np.cumsum(pieces)[:-1]])
    row = np.repeat(np.arange(A.shape[0]), lens)
    pos = np.arange(A.nnz) - A.indptr[row]
    newrow = first[row] + pos // L
    return sp.csr_matrix((A.data, A.indices, np.concatenate([[0], np.cumsum(np.bincount(newrow, minlength=int(pieces.sum())))])),
                         shape=(int(pieces.sum()), A.shape[1]))

timer = None
if not build_only:
    from spcompile.autotune.measure import Timer
    timer = Timer("cuda")
out = []
for g in GRAPHS:
    r = t.get((g, K))
    cfgd = r["columns"]["default"]["config"]
    if cfgd["template"] != "csr.crc_cwm":
        continue
    A0 = common.load_matrix(os.path.join(os.environ["SPCOMPILE_GRAPHS"], g + ".npz"))
    cfg = Config.from_dict(cfgd)
    tpl = get_template(cfg.template)
    p0 = dict(cfg.params)
    cases = [("orig", A0, p0)]
    for ms in (16, 32, 128, 256):
        if ms != p0.get("max_seg"):
            cases.append((f"max_seg={ms}", A0, {**p0, "max_seg": ms}))
    for u, cq in ((8, 0), (8, 16), (16, 0), (4, 0), (4, 16), (2, 0)):
        q = {**p0, "unroll": u, "combine_vals": cq}
        if q != p0:
            cases.append((f"unroll={u},cq={cq}", A0, q))
    for L in (64, 256):
        cases.append((f"rows cut at {L}", split_rows(A0, L), p0))
    spec = [dict(s) for s in cfg.pipeline]
    for label, A, p in cases:
        w = bench.Workload(A, "spmm", "sum", K, "float16", "cuda") if not build_only else None
        sop = w.sop if w else bench.make_op(A, "spmm", K, "sum", "float16")
        module = bench.PipelineCache().get(sop, spec) if spec else None
        config = tpl.make_config(p, spec, "cuda", "float16")
        try:
            if build_only:
                bench.build_from_config(sop, config, module=module)
                print(g, label, "built", flush=True)
                continue
            cell = bench.time_config(w, config, timer, module)
        except ValueError as e:
            print(g, label, "refused", e, flush=True)
            if w is not None:
                w.release()
            continue
        us = cell["us"]
        print(f"{g:20s} {label:22s} {us if us else float('nan'):7.1f} us  {cell['status']}", flush=True)
        out.append({"graph": g, "case": label, "params": p, **cell, "m": A.shape[0], "nnz": int(A.nnz)})
        w.release()
if not build_only:
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "hubdiag.json"), "w"), indent=1)
