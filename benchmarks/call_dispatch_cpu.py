"""Per-call dispatch cost of a CUDA module's call path, measured on a machine without a GPU.

A compiled CUDA module's host work per call is: its checks, the output (``mod(X)``), the stream
handle, the pointers and the launch.  ``benchmarks/bench.py --call-overhead`` measures all of it on a GPU;
this script measures everything but the launch itself, here: the module (a real
:class:`~spcompile.module.CompiledModule` of a real workload) holds a CUDA kernel whose
``launch`` does nothing, and torch CPU tensors stand in for CUDA tensors through an adapter that
differs from the torch adapter only in where it says the tensors are (device 0 for CPU memory)
and in its stream handle (a C-level constant instead of torch's current CUDA stream).  So the
timed code is the module's own: ``CompiledModule.__call__``, the plan's signature check, the run
step, ``CUDAKernel.run`` and the pointer reads.

Reported per op (SpMM: one input; SDDMM: two), median over batches, in microseconds:

  * ``launch_us``  : the no-op ``kernel.launch(ptrs, out_ptr, stream)`` alone (subtract it);
  * ``out_us``     : ``mod(*inputs, out=Y)`` -- the path the H100 figure (~2.3 us above a bare
                     driver launch) is about;
  * ``alloc_us``   : ``mod(*inputs)`` (a new output each call: torch.empty on the CPU here);
  * ``checked_us`` : a call that takes the full checks (the module's plan is dropped before each).

    PYTHONPATH=$PWD python3 benchmarks/call_dispatch_cpu.py [--json out.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np
import scipy.sparse as sp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench import _per_call_us  # noqa: E402
from spcompile.compile import make_op  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.module import CompiledModule  # noqa: E402
from spcompile.runtime import arrays  # noqa: E402
from spcompile.runtime.cuda import CUDAKernel  # noqa: E402


class NopKernel(CUDAKernel):
    """A prepared CUDA kernel whose launch does nothing."""

    _ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        pass


class CPUTensorsAsDevice(type(arrays.TORCH)):
    """The torch adapter, but CPU tensors count as device 0's and the stream is a constant."""

    def device(self, x):
        return 0 if x.get_device() < 0 else None

    def allocator(self, shape, dtype, device):
        return super().allocator(shape, dtype, None)

    def stream(self, device):
        return functools.partial(abs, 0)     # C-level, like torch._C._cuda_getCurrentRawStream

    def matcher(self, in_shapes, out_shape, dtype, device):
        return super().matcher(in_shapes, out_shape, dtype, None)


def per_call_us(fn) -> float:
    return _per_call_us(fn, lambda: None, n=2000, batches=25)


def measure(op: str, K: int = 32) -> dict:
    import torch

    A = sp.random(64, 64, density=0.1, format="csr", dtype=np.float32, random_state=0)
    sop = make_op(A, op, K, "sum" if op == "spmm" else None)
    mod = CompiledModule(sop.key(), Config("csr.crc_cwm" if op == "spmm" else "csr.sddmm", {}, (), "cuda"),
                         NopKernel("nop", {}, {}, {}, {"dtype": "float32"}))
    ins = [torch.randn(64, K) for _ in mod._in_shapes]
    out = torch.empty(mod._out_shape)
    ptrs, optr = [x.data_ptr() for x in ins], out.data_ptr()
    assert mod(*ins, out=out) is out and mod._plan.same(ins, out)

    def checked():
        mod._plan = None
        mod(*ins, out=out)

    return {"launch_us": per_call_us(lambda: mod.kernel.launch(ptrs, optr, 0)),
            "out_us": per_call_us(lambda: mod(*ins, out=out)),
            "alloc_us": per_call_us(lambda: mod(*ins)),
            "checked_us": per_call_us(checked)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    saved = arrays._BY_MODULE["torch"]
    arrays._BY_MODULE["torch"] = CPUTensorsAsDevice()
    try:
        res = {"torch": torch.__version__, "python": sys.version.split()[0]}
        for op in ("spmm", "sddmm"):
            r = measure(op)
            r["overhead_out_us"] = r["out_us"] - r["launch_us"]
            res[op] = {k: round(v, 3) for k, v in r.items()}
            print(op, json.dumps(res[op]), flush=True)
    finally:
        arrays._BY_MODULE["torch"] = saved
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
