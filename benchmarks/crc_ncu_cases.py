"""The csr.crc_cwm cases of docs/benchmarks/h100_crc_cwm_experiments.md, for Nsight Compute: each
module is built by the product's ``build_from_config`` from a committed table's ``build()``
configuration (fp32 K=64/128, fp16 K=64, and two ``max_seg`` variants) and called once.

    ncu --target-processes all -k regex:spmm_crc_cwm --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --csv \
        --page details python benchmarks/crc_ncu_cases.py
    python benchmarks/crc_ncu_cases.py --build-only     # CPU: fill $SPCOMPILE_KERNEL_CACHE

Other cases: ``--table T.json --cells GRAPH:K [GRAPH:K ...]`` takes each cell's ``build()``
configuration (column ``default``) from the bench table T.json (its dtype) instead, e.g. the
fp32 graphs of short rows furthest from the floor (``--calls N`` calls each module N times, for
``--launch-skip`` to profile a warm call):

    ... python benchmarks/crc_ncu_cases.py --table docs/benchmarks/h200_spmm_fp32_default_big.json \
        --cells snap_sx_askubuntu:64 snap_sx_askubuntu:128 dimacs10_wing:64 tu_nci1:64

Graphs come from $SPCOMPILE_GRAPHS (default: the shared graph folder)."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import common  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_cases():
    """The cases of the experiments document's section 2 (H100 tables)."""
    bdir = os.path.join(ROOT, "docs", "benchmarks")
    t32 = {(r["graph"], r["K"]): r for r in json.load(open(os.path.join(bdir, "h100_spmm_fp32_default_big.json")))["rows"]}
    t16 = {(r["graph"], r["K"]): r for r in json.load(open(os.path.join(bdir, "h100_spmm_fp16_default.json")))["rows"]}
    cases = []
    for g in ("twitch_de", "fb100_mit8", "snap_email_enron"):
        cases.append((g, 64, "float32", t32[(g, 64)]["columns"]["default"]["config"], {}))
        cases.append((g, 64, "float16", t16[(g, 64)]["columns"]["default"]["config"], {}))
    for ms in (16, 256):
        cases.append(("twitch_de", 64, "float16", t16[("twitch_de", 64)]["columns"]["default"]["config"], {"max_seg": ms}))
    cases.append(("twitch_de", 128, "float32", t32[("twitch_de", 128)]["columns"]["default"]["config"], {}))
    return cases


def table_cases(path, cells):
    """``build()``'s csr.crc_cwm configuration of each GRAPH:K cell of a bench table."""
    table = json.load(open(path))
    rows = {(r["graph"], r["K"]): r for r in table["rows"]}
    cases = []
    for cell in cells:
        g, K = cell.rsplit(":", 1)
        if (g, int(K)) not in rows:
            sys.exit(f"crc_ncu_cases: no row {g} K={K} in {path}")
        cfgd = rows[(g, int(K))]["columns"]["default"]["config"]
        if cfgd["template"] != "csr.crc_cwm":
            sys.exit(f"crc_ncu_cases: {g} K={K} is not a csr.crc_cwm module ({cfgd['template']})")
        cases.append((g, int(K), table["settings"]["dtype"], cfgd, {}))
    return cases


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--build-only", action="store_true", help="fill $SPCOMPILE_KERNEL_CACHE, no GPU")
ap.add_argument("--table", help="a bench.py JSON whose default column's configurations to run")
ap.add_argument("--cells", nargs="+", default=[], metavar="GRAPH:K", help="with --table: its cells")
ap.add_argument("--calls", type=int, default=1,
                help="calls of each module (profile a warm one with ncu --launch-skip / --launch-count)")
a = ap.parse_args()
if a.cells and not a.table:
    ap.error("--cells needs --table")
build_only = a.build_only
cases = table_cases(a.table, a.cells) if a.table else default_cases()
for i, (g, K, dt, cfgd, over) in enumerate(cases):
    A = common.load_matrix(os.path.join(common.default_graph_dir(), g + ".npz"))
    cfg = Config.from_dict(cfgd)
    tpl = get_template(cfg.template)
    sop = bench.make_op(A, "spmm", K, "sum", dt)
    spec = [dict(s) for s in cfg.pipeline]
    module = bench.PipelineCache().get(sop, spec) if spec else None
    p = {**cfg.params, **over}
    mod = bench.build_from_config(sop, tpl.make_config(p, spec, "cuda"), module=module)
    print("CASE", i, g, K, dt, json.dumps(p), flush=True)
    if not build_only:
        import torch
        tdt = torch.float16 if dt == "float16" else torch.float32
        X = torch.randn(A.shape[1], K, device="cuda").to(tdt)
        Y = torch.empty(A.shape[0], K, device="cuda", dtype=tdt)
        for _ in range(a.calls):
            mod(X, out=Y)
        torch.cuda.synchronize()
