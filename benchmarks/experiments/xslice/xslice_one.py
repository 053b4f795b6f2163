"""One xslice kernel on one graph, timed by events over 200 launches (for Nsight Compute runs):
    python xslice_one.py GRAPH {\"\",g,fill} KT NW B
"""
import os, sys, math
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import numpy as np, torch, cupy, common
from spcompile.autotune.measure import Timer
SRC = open(os.path.join(os.path.dirname(__file__), "xslice.cu")).read()
mod = cupy.RawModule(code=SRC, options=("-std=c++17", "-lineinfo"))
name, var, KT, NW, B = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
K = 128
A = common.load_matrix(dict((g[0], g[1]) for g in common.find_graphs([name]))[name]).tocsr()
m, n = A.shape
k = mod.get_function(f"xslice{var}{KT}" if var != "fill" else "xfill8")
NS = NW * (32 // KT if var == "g" else 1)
smem = (n * KT + NS * 2 * KT) * 4 + NS * 2 * 4
k.max_dynamic_shared_size_bytes = smem
split = np.searchsorted(A.indptr, np.linspace(0, A.nnz, B + 1), side="left").astype(np.int32)
split[0], split[-1] = 0, m
ip, ix, vv = cupy.asarray(A.indptr.astype(np.int32)), cupy.asarray(A.indices), cupy.asarray(A.data.astype(np.float32))
rs = cupy.asarray(np.maximum.accumulate(split))
X = cupy.random.standard_normal((n, K), dtype=cupy.float32); Y = cupy.empty((m, K), cupy.float32)
args = (ip, ix, vv, X, Y, rs, np.int32(n), np.int32(K))
run = lambda: k((B, K // KT), (NW * 32,), args, shared_mem=smem)
run(); cupy.cuda.Device().synchronize()
if var == "fill": ref = None
if var != "fill":
    ref = A.astype(np.float64) @ cupy.asnumpy(X).astype(np.float64)
    print("rel err", np.linalg.norm(cupy.asnumpy(Y) - ref) / np.linalg.norm(ref))
e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
for _ in range(3): run()
e0.record()
for _ in range(200): run()
e1.record(); e1.synchronize()
print(f"{name} {var} KT={KT} NW={NW} B={B}: events, 200 launches: {cupy.cuda.get_elapsed_time(e0, e1) / 200 * 1e3:.1f} us/call")
