"""Nsight Compute driver for ``band_stage.py``: the one-window kernel on tu_nci1 at fp32 K=64
(W = 64, 256 threads, U = 2) with fixed windows and with windows cut at graph boundaries, each
launched twice to warm up and 20 times timed by CUDA events (printed).  Profile the second launch
of each (experiments section 26):

    ncu --launch-skip 1 --launch-count 1 -k regex:band_stage --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,smsp__cycles_active.avg,sm__cycles_elapsed.avg \
        --csv --page details python benchmarks/band_stage_ncu.py [GRAPH_DIR]
    (and --launch-skip 23 for the component windows; GRAPH_DIR defaults to common.default_graph_dir())
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cupy as cp  # noqa: E402
import scipy.sparse as sp  # noqa: E402

import band_stage as bs  # noqa: E402
import common  # noqa: E402

GRAPHS = sys.argv[1] if len(sys.argv) > 1 else common.default_graph_dir()
A = sp.load_npz(os.path.join(GRAPHS, 'tu_nci1.npz')).tocsr()
arr = bs.band_arrays(A)
dev = {k: cp.asarray(v) for k, v in arr.items()}
K, eb = 64, 4
X = cp.random.standard_normal((A.shape[1], K), dtype=cp.float32)
Y = cp.empty((A.shape[0], K), cp.float32)
for win in ('fixed', 'comp'):
    ln = bs.launch({"win": win, "pipe": 0, "W": 64, "T": 256, "U": 2, "G": 16, "CF": 1}, A, arr, dev, K, eb)
    kern, args = ln["kern"], ln["args"](X, Y)
    kern.max_dynamic_shared_size_bytes = ln["smem"]
    for i in range(2):
        kern(ln["grid"], ln["block"], args, shared_mem=ln["smem"])
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for i in range(20):
        kern(ln["grid"], ln["block"], args, shared_mem=ln["smem"])
    e.record()
    e.synchronize()
    print(win, ln["info"], "us/launch", cp.cuda.get_elapsed_time(s, e) / 20 * 1000, flush=True)
