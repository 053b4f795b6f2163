"""The block-level combine of 32-lane row groups under compute-sanitizer: the three 32-lane cases of
``tests/test_cuda_kernels.py``'s ``WARP_COMBINE_SPMM_PARAMS`` (8, 4 and 2 warps a block), sum and
mean, ``warp_combine`` 1 and 2, two calls each into NaN-poisoned outputs, checked against float64.

    compute-sanitizer --tool racecheck python benchmarks/experiments/hub_combine/sanitize_block_combine.py [K [DTYPE]]
"""
import os
import sys
import numpy as np
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
import spcompile
from spcompile.compile import make_op
from spcompile.core import reference
from test_cuda_kernels import WARP_COMBINE_SPMM_PARAMS, _window_matrix

A = _window_matrix()
K = int(sys.argv[1]) if len(sys.argv) > 1 else 33
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
tol = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}[dtype]
X = torch.randn(A.shape[1], K, device="cuda").to(getattr(torch, dtype))
n = 0
for reduce in ("sum", "mean"):
    ref = reference.run("spmm", reduce, make_op(A, "spmm", K, reduce).A, X.double().cpu().numpy())
    for p in WARP_COMBINE_SPMM_PARAMS[-3:]:
        for wc in (1, 2):
            q = {**p, "warp_combine": wc, "vec": min(p["vec"], 4)}
            mod = spcompile.build(A, "spmm", K, reduce, target="cuda", dtype=dtype, template="csr.crc_cwm", params=q)
            for _ in range(2):
                out = torch.full((A.shape[0], K), float("nan"), device="cuda", dtype=X.dtype)
                mod(X, out=out)
                r = out.double().cpu().numpy()
                assert np.all(np.isfinite(r)) and np.linalg.norm(r - ref) / np.linalg.norm(ref) <= tol, (reduce, q)
            n += 1
print("san ok", n)
