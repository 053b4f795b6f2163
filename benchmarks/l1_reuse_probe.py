"""Run under Nsight Compute (L1 hit rate, L2 sectors read, DRAM bytes) the K=128 SpMM of three
social graphs with the tuned configuration of h100_spmm_fp32_tuned25_K128.json behind a degree or
a community order, with the grid schedule and the SM-local one:

    ncu --kernel-name regex:spmm_crc --metrics gpu__time_duration.sum,l1tex__t_sector_hit_rate.pct,\
        lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum,\
        sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct --csv \
        python benchmarks/l1_reuse_probe.py
"""
import json, os, sys
sys.path.insert(0, "benchmarks")
import numpy as np
import bench, common
from spcompile.core.config import Config
from spcompile.kernels import get_template
build_only = "--build-only" in sys.argv
rows = {r["graph"]: r for r in json.load(open("docs/benchmarks/h100_spmm_fp32_tuned25_K128.json"))["rows"]}
cases = [("reorder.degree", 0), ("reorder.community", 0), ("reorder.community", 1), ("reorder.degree", 1)]
for g in ("fb100_cornell5", "snap_email_enron", "fb100_mit8"):
    A = common.load_matrix(os.path.join(os.environ["SPCOMPILE_GRAPHS"], g + ".npz"))
    cfg = Config.from_dict(rows[g]["columns"]["tuned"]["config"])
    tpl = get_template(cfg.template)
    sop = bench.make_op(A, "spmm", 128, "sum", "float32")
    if not build_only:
        import torch
        X = torch.randn(A.shape[1], 128, device="cuda")
        Y = torch.empty(A.shape[0], 128, device="cuda")
    for pl, sl in cases:
        spec = [{"name": pl, "options": {}}]
        module = bench.PipelineCache().get(sop, spec)
        p = {**cfg.params, "sm_local": sl, "rows_per_warp": 1}
        mod = bench.build_from_config(sop, tpl.make_config(p, spec, "cuda"), module=module)
        print(g, pl, sl, flush=True)
        if not build_only:
            mod(X, out=Y); torch.cuda.synchronize()
