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
import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402

import band_stage as bs  # noqa: E402
import common  # noqa: E402

GRAPHS = sys.argv[1] if len(sys.argv) > 1 else common.default_graph_dir()
A = sp.load_npz(os.path.join(GRAPHS, 'tu_nci1.npz')).tocsr()
arr = bs.band_arrays(A)
dev = {k: cp.asarray(v) for k, v in arr.items()}
K, eb, W, T, U = 64, 4, 64, 256, 2
X = cp.random.standard_normal((A.shape[1], K), dtype=cp.float32)
Y = cp.empty((A.shape[0], K), cp.float32)
for win in ('fixed', 'comp'):
    key = f"{win}_%s{W}"
    w_row, span = arr[key % 'row'], arr[key % 'span']
    smax, nmax, rmax = bs.limits(arr['indptr'], w_row, span, K, eb)
    opts = (f"-DBS_TB={eb}", "-DBS_G=16", "-DBS_CF=1", f"-DBS_U={U}", f"-DBS_T={T}", f"-DBS_SMAX={smax}",
            f"-DBS_NMAX={nmax}", f"-DBS_RMAX={rmax}", "-std=c++17")
    kern = cp.RawKernel(bs.SOURCE, 'band_stage', options=opts)
    smem = smax * K * eb + nmax * 8
    kern.max_dynamic_shared_size_bytes = smem
    args = (dev['indptr'], dev['cols'], dev['vals'], dev[key % 'row'], dev[key % 'lo'], dev[key % 'span'], X, Y, np.int32(K))
    for i in range(2):
        kern((len(span),), (T,), args, shared_mem=smem)
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for i in range(20):
        kern((len(span),), (T,), args, shared_mem=smem)
    e.record(); e.synchronize()
    print(win, len(span), smax, nmax, rmax, "us/launch", cp.cuda.get_elapsed_time(s, e) / 20 * 1000, flush=True)
