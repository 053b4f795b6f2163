"""The csr.crc_cwm cases of docs/benchmarks/h100_crc_cwm_experiments.md, for Nsight Compute: each
module is built by the product's ``build_from_config`` from a committed table's ``build()``
configuration (fp32 K=64/128, fp16 K=64, and two ``max_seg`` variants) and called once.

    ncu --target-processes all -k regex:spmm_crc_cwm --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --csv \
        --page details python benchmarks/crc_ncu_cases.py
    python benchmarks/crc_ncu_cases.py --build-only     # CPU: fill $SPCOMPILE_KERNEL_CACHE

Graphs come from $SPCOMPILE_GRAPHS (default: the shared graph folder)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import common  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402

build_only = "--build-only" in sys.argv
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
t32 = {(r["graph"], r["K"]): r for r in json.load(open(os.path.join(ROOT, "docs", "benchmarks", "h100_spmm_fp32_default_big.json")))["rows"]}
t16 = {(r["graph"], r["K"]): r for r in json.load(open(os.path.join(ROOT, "docs", "benchmarks", "h100_spmm_fp16_default.json")))["rows"]}
cases = []
for g in ("twitch_de", "fb100_mit8", "snap_email_enron"):
    cases.append((g, 64, "float32", t32[(g, 64)]["columns"]["default"]["config"], {}))
    cases.append((g, 64, "float16", t16[(g, 64)]["columns"]["default"]["config"], {}))
for ms in (16, 256):
    cases.append(("twitch_de", 64, "float16", t16[("twitch_de", 64)]["columns"]["default"]["config"], {"max_seg": ms}))
cases.append(("twitch_de", 128, "float32", t32[("twitch_de", 128)]["columns"]["default"]["config"], {}))
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
        mod(X, out=Y)
        torch.cuda.synchronize()
