"""Per-call host overhead of a compiled CUDA module, from Python (the way a user calls ``mod(X)``).

For a tiny matrix (so the GPU work is negligible and the host path decides), measures the
median over many batches of the wall time per call of:

  * ``empty launch``   : a do-nothing kernel through the project's prepared launch (``rt.Launch``,
                         ctypes ``cuLaunchKernel``) -- the floor of any module call;
  * ``cupy launch``    : the same kernel through CuPy's generic ``RawKernel.__call__``;
  * ``torch.sparse.mm``: cuSPARSE through torch (what a user would otherwise call);
  * ``mod(X, out=Y)``  and ``mod(X)`` for each template given (torch CUDA tensors), and
    ``mod(X)`` for CuPy arrays.

The module's own overhead is ``mod(X, out=Y)`` minus ``empty launch``; the issue's target is
<= 10 us per call for the module.  Calls are asynchronous (no synchronisation per call): the
queue never fills because each kernel runs in a few microseconds.  Writes JSON.

    python benchmarks/call_overhead.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spcompile.compile import build_from_config, make_op  # noqa: E402
from spcompile.core.ir import SparseModule  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402


def per_call_us(fn, sync, n=500, batches=15) -> float:
    for _ in range(50):
        fn()
    sync()
    res = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        sync()
        res.append((t1 - t0) / n * 1e6)
    return statistics.median(res)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--templates", nargs="*", default=["csr.crc_cwm", "csr.sddmm", "extern.cusparse"])
    a = ap.parse_args(argv)
    import cupy
    import torch

    from spcompile.runtime import cuda as rt

    res: dict = {"device": torch.cuda.get_device_name()}
    sync = torch.cuda.synchronize
    src = 'extern "C" __global__ void nop(const float* x, float* y, int n) { if (n < 0) y[0] = x[0]; }'
    path = rt.compile_cuda(src, name="nop")
    fn = rt.load_module(path).get_function("nop")
    X = torch.randn(64, 32, device="cuda")
    Y = torch.empty(64, 32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    L = rt.Launch(fn, (1, 1, 1), (32, 1, 1), [None, None, np.int32(1)])
    xp, yp = X.data_ptr(), Y.data_ptr()
    res["driver_launch_path"] = L._launch is not None   # ctypes cuLaunchKernel (else CuPy fallback)
    res["empty_launch_us"] = per_call_us(lambda: L((xp, yp), stream), sync)
    cs = rt._stream(stream)
    res["cupy_launch_us"] = per_call_us(lambda: fn((1, 1, 1), (32, 1, 1), (xp, yp, np.int32(1)), stream=cs), sync)

    rng = np.random.default_rng(0)
    A = sp.random(64, 64, density=0.1, format="csr", dtype=np.float32, random_state=rng)
    At = torch.sparse_csr_tensor(torch.from_numpy(A.indptr.astype(np.int64)), torch.from_numpy(A.indices.astype(np.int64)),
                                 torch.from_numpy(A.data), A.shape).cuda()
    res["torch_sparse_mm_us"] = per_call_us(lambda: torch.sparse.mm(At, X), sync)
    for tname in a.templates:
        tpl = get_template(tname)
        op = "sddmm" if "sddmm" in tname else "spmm"
        sop = make_op(A, op, 32, "sum" if op == "spmm" else None)
        cm = build_from_config(sop, Config(tname, tpl.default_params(SparseModule.from_op(sop)), (), "cuda"))
        ins = (X,) if op == "spmm" else (X, torch.randn(64, 32, device="cuda"))
        out = torch.empty(cm._out_shape, device="cuda")
        cm(*ins, out=out)
        ref = cm(*[x.cpu().numpy() for x in ins])
        ok = bool(np.allclose(out.cpu().numpy(), ref, rtol=1e-4, atol=1e-5))
        r = {"correct": ok,
             "out_us": per_call_us(lambda: cm(*ins, out=out), sync),
             "alloc_us": per_call_us(lambda: cm(*ins), sync)}
        cins = [cupy.asarray(x.cpu().numpy()) for x in ins]
        r["cupy_alloc_us"] = per_call_us(lambda: cm(*cins), cupy.cuda.runtime.deviceSynchronize)
        r["module_overhead_out_us"] = r["out_us"] - res["empty_launch_us"]
        res[tname] = r
        print(tname, json.dumps(r), flush=True)
    print(json.dumps(res, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "call_overhead.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
