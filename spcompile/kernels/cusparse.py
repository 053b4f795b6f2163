"""``extern.cusparse``: the vendor library (cuSPARSE through torch.sparse) as a template."""
from __future__ import annotations

import numpy as np

from ..core.ir import SparseModule
from ..runtime import cuda as rt
from ..runtime import driver
from ..runtime.arrays import TORCH
from .base import Template, register_template


# ------------------------------------------------------------------------------------------
class CusparseKernel(rt.CUDAKernel):
    """cuSPARSE through PyTorch: ``torch.mm`` on a device CSR tensor built once (SpMM sum/mean,
    mean by pre-scaled values) and ``torch.sparse.sampled_addmm`` (SDDMM)."""

    def prepare(self):
        import torch

        self.device_id = torch.cuda.current_device()
        dev = torch.device("cuda", self.device_id)
        a = self.arrays
        m, n = (int(v) for v in self.meta["shape"])
        crow = torch.from_numpy(a["indptr"]).to(dev)
        col = torch.from_numpy(a["indices"]).to(dev)
        # torch.sparse needs A in the inputs' dtype: for 16-bit inputs the library's A is rounded
        # to that dtype (cuSPARSE still accumulates in fp32)
        tdt = getattr(torch, self.meta.get("dtype", "float32"))
        vals = torch.from_numpy(a["data"]).to(dev).to(tdt)
        if self.meta["op"] == "spmm":
            self._A = torch.sparse_csr_tensor(crow, col, vals, (m, n), device=dev)
        else:
            self._A = torch.sparse_csr_tensor(crow, col, torch.ones_like(vals), (m, n), device=dev)
            self._vals = vals
        self._out_ok = True
        self._torch = torch
        self._ready = True

    def run(self, adapter, inputs, out, stream):
        if adapter is TORCH:
            self._run(inputs, out)
            return
        # CuPy callers and numpy inputs' device copies: order against their stream by
        # synchronising around the library call (the vendor baseline only; our own kernels launch
        # on the caller's stream directly); their arrays are viewed through
        # __cuda_array_interface__
        torch = self._torch
        driver.stream_synchronize(stream, self.device_id)
        dev = torch.device("cuda", self.device_id)
        self._run([torch.as_tensor(x, device=dev) for x in inputs], torch.as_tensor(out, device=dev))
        torch.cuda.current_stream(dev).synchronize()

    def _run(self, inputs, out):
        torch = self._torch
        if self.meta["op"] == "spmm":
            if self._out_ok:
                try:
                    torch.mm(self._A, inputs[0], out=out)
                    return
                except (RuntimeError, TypeError, NotImplementedError):
                    self._out_ok = False
            out.copy_(torch.sparse.mm(self._A, inputs[0]))
        else:
            X, Y = inputs
            r = torch.sparse.sampled_addmm(self._A, X, Y.t(), beta=0.0, alpha=1.0)
            torch.mul(r.values(), self._vals, out=out)

    def launch(self, in_ptrs, out_ptr, stream):
        raise NotImplementedError("extern.cusparse runs on framework arrays (run())")


@register_template
class Cusparse(Template):
    """cuSPARSE (through torch.sparse) as a tuning candidate, so a tuned module is never slower
    than the vendor library.  SpMM sum and mean, SDDMM.  Works on the original matrix (passes do
    not apply to a library call)."""

    name = "extern.cusparse"
    version = "1"
    csr_arrays = True
    csr_values = False   # SpMM mean stores the values divided by the row lengths
    target = "cuda"
    priority = 5
    ops = (("spmm", "sum"), ("spmm", "mean"), ("sddmm", None))
    #: 16-bit inputs (checked on the H100, torch 2.11): torch.sparse.mm on CUDA takes CSR float16
    #: and bfloat16, but A's values must then be in the input dtype too.  float16 A stays within the
    #: 1e-2 tolerance; bfloat16 A (8-bit mantissa) does not (rel. error 1.5e-2 to 1.7e-2 on random
    #: inputs), so bfloat16 is not offered.  torch.sparse.sampled_addmm has no 16-bit kernels ("not
    #: implemented for 'Half'" / 'BFloat16'): SDDMM is fp32 only.
    dtypes = ("float32", "float16")

    def supports(self, mod):
        if mod.op.dtype != "float32" and mod.op.op != "spmm":
            return False
        return super().supports(mod)

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("torch") is not None

    def space(self, mod):
        return {}

    def default_params(self, mod):
        return {}

    def build(self, mod: SparseModule, params):
        params = self.check_params(mod, params)
        A = mod.op.A  # caller's order: the library needs no permutation folding
        data = np.array(A.data, dtype=np.float32)
        if mod.op.op == "spmm" and mod.op.reduce == "mean":
            lens = np.diff(A.indptr.astype(np.int64))
            data = (data / np.repeat(np.maximum(lens, 1), lens)).astype(np.float32)
        arrays = {"indptr": np.array(A.indptr, dtype=np.int64), "indices": np.array(A.indices, dtype=np.int64),
                  "data": data}
        meta = {"op": mod.op.op, "reduce": mod.op.reduce, "shape": list(A.shape), "dtype": mod.op.dtype}
        return CusparseKernel(self.name, params, arrays, {}, meta)

    def load(self, params, arrays, files, meta):
        return CusparseKernel(self.name, params, arrays, files, meta)
