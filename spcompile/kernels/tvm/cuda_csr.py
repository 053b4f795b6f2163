"""TVM TensorIR CUDA kernels for CSR SpMM (sum/max/min/mean) and SDDMM.

The kernels are written in TVMScript with explicit thread bindings, lowered by TVM's CUDA
codegen to CUDA C++ *here* (``tvm.compile(..., target={"kind": "cuda", ...})``), and that source
is compiled by nvcc to a cubin at build time.  The artifact carries the cubin plus the launch
description (kernel name, parameter order, block shape); the GPU machine loads it through the
project's CUDA runtime (the driver API, :mod:`spcompile.runtime.driver`) like any CUDA
template: neither TVM nor a CUDA compiler (nvcc / NVRTC) is needed where the module runs.  See
``docs/tvm_cuda.md``.

Thread layout (both ops): ``blockIdx.x`` over groups of ``rows_per_block`` rows,
``threadIdx.y`` over the rows of a group, ``threadIdx.x`` over ``threads_k`` lanes that split K;
each lane owns ``vec`` contiguous features per chunk of ``threads_k * vec`` features, and all
chunks of K are held in registers (one pass over a row's nonzeros).

* SpMM: each row group walks its row's nonzeros (``nnz_unroll`` of them loaded ahead to keep
  several gathers in flight) and reduces ``A[i, j] * X[j, k]`` into registers.
* SDDMM: the row's slice of X is kept in registers; per nonzero each lane forms a partial dot
  product with Y[j] and the ``threads_k`` lanes combine them with warp shuffles (xor butterfly).

Kernels work in the caller's order (see :func:`~spcompile.kernels.base.csr_kernel_arrays`).
"""
from __future__ import annotations

import functools
import math
import hashlib
import os
import re
from typing import Any, Mapping

import numpy as np

from ..._version import tvm_version
from ...core.formats import INT32_MAX
from ...core.ir import SparseModule
from ...runtime import cuda as rt
from ...runtime.driver import DeviceArray
from ...runtime.files import write_atomically
from ..base import Kernel, Template, csr_kernel_arrays, register_template

__all__ = ["CudaSpMM", "CudaSDDMM", "spmm_primfunc", "sddmm_primfunc", "cuda_source", "compile_source"]

_REDUCE_CODE = {"sum": 0, "mean": 0, "max": 1, "min": 2}



def _cached_source(src: str, name: str) -> str:
    """The CUDA source, content-addressed beside the compiled kernels (the per-user kernel cache;
    nothing in a temporary folder per build), written atomically when missing."""
    data = src.encode()
    path = os.path.join(rt.cache_dir(), f"{name}-{hashlib.sha256(data).hexdigest()[:32]}.cu")
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return path
    except OSError:
        pass
    return write_atomically(path, data, suffix=".cu")


def _nan_max(T, acc, v):
    """max that propagates NaN like the float64 reference (numpy maximum)."""
    return T.Select(T.Or(v > acc, T.isnan(v)), v, acc)


def _nan_min(T, acc, v):
    """min that propagates NaN like the float64 reference (numpy minimum)."""
    return T.Select(T.Or(v < acc, T.isnan(v)), v, acc)

def _chunks(K: int, tx: int, vec: int) -> int:
    return max(1, -(-K // (tx * vec)))


def spmm_primfunc(K: int, reduce: str, rows_per_block: int, threads_k: int, vec: int, nnz_unroll: int,
                  idx: str = "int32", wide: bool = False):
    """TensorIR of the CSR SpMM kernel (see the module docstring for the layout)."""
    from tvm.script import tirx as T

    RB, TX, V, U = int(rows_per_block), int(threads_k), int(vec), max(1, int(nnz_unroll))
    if K % V:
        raise ValueError(f"vec={V} must divide K={K}")
    C = _chunks(K, TX, V)
    R = _REDUCE_CODE[reduce]
    MEAN = reduce == "mean"
    init = 0.0 if R == 0 else (-math.inf if R == 1 else math.inf)
    off = "int64" if wide else "int32"  # offset arithmetic width (col * K may pass 2**31)

    @T.prim_func
    def spmm(a_indptr: T.handle, a_indices: T.handle, a_data: T.handle, a_rows: T.handle,
             x: T.handle, y: T.handle):
        T.func_attr({"global_symbol": "spmm", "tir.noalias": True})
        m = T.int32()
        nnz = T.int32()
        n = T.int32()
        indptr = T.match_buffer(a_indptr, (m + 1,), idx)
        indices = T.match_buffer(a_indices, (nnz,), idx)
        data = T.match_buffer(a_data, (nnz,), "float32")
        row_ids = T.match_buffer(a_rows, (m,), idx)
        X = T.match_buffer(x, (n, K), "float32")
        Y = T.match_buffer(y, (m, K), "float32")
        for b in T.thread_binding((m + RB - 1) // RB, thread="blockIdx.x"):
            for r in T.thread_binding(RB, thread="threadIdx.y"):
                for t in T.thread_binding(TX, thread="threadIdx.x"):
                    acc = T.alloc_buffer((C * V,), "float32", scope="local")
                    cols = T.alloc_buffer((U,), off, scope="local")
                    vals = T.alloc_buffer((U,), "float32", scope="local")
                    i = b * RB + r
                    if i < m:
                        lo = T.Cast("int32", indptr[i])
                        hi = T.Cast("int32", indptr[i + 1])
                        for c in T.unroll(C):
                            for v in T.vectorized(V):
                                acc[c * V + v] = T.float32(init)
                        for g in T.serial((hi - lo) // U):
                            for u in T.unroll(U):
                                cols[u] = T.Cast(off, indices[lo + g * U + u])
                                vals[u] = data[lo + g * U + u]
                            for u in T.unroll(U):
                                for c in T.unroll(C):
                                    if (c * TX + t) * V < K:
                                        for v in T.vectorized(V):
                                            acc[c * V + v] = T.Select(
                                                R == 0, acc[c * V + v] + vals[u] * X[cols[u], (c * TX + t) * V + v],
                                                T.Select(R == 1,
                                                         _nan_max(T, acc[c * V + v], vals[u] * X[cols[u], (c * TX + t) * V + v]),
                                                         _nan_min(T, acc[c * V + v], vals[u] * X[cols[u], (c * TX + t) * V + v])))
                        if U > 1:
                            for j in T.serial(lo + (hi - lo) // U * U, hi):
                                cols[0] = T.Cast(off, indices[j])
                                vals[0] = data[j]
                                for c in T.unroll(C):
                                    if (c * TX + t) * V < K:
                                        for v in T.vectorized(V):
                                            acc[c * V + v] = T.Select(
                                                R == 0, acc[c * V + v] + vals[0] * X[cols[0], (c * TX + t) * V + v],
                                                T.Select(R == 1,
                                                         _nan_max(T, acc[c * V + v], vals[0] * X[cols[0], (c * TX + t) * V + v]),
                                                         _nan_min(T, acc[c * V + v], vals[0] * X[cols[0], (c * TX + t) * V + v])))
                        cols[0] = T.Cast(off, row_ids[i])
                        if hi > lo:
                            for c in T.unroll(C):
                                if (c * TX + t) * V < K:
                                    for v in T.vectorized(V):
                                        Y[cols[0], (c * TX + t) * V + v] = T.Select(
                                            MEAN, acc[c * V + v] / T.Cast("float32", hi - lo), acc[c * V + v])
                        else:  # an empty row gives 0 for every reduction
                            for c in T.unroll(C):
                                if (c * TX + t) * V < K:
                                    for v in T.vectorized(V):
                                        Y[cols[0], (c * TX + t) * V + v] = T.float32(0)

    return spmm


def sddmm_primfunc(K: int, rows_per_block: int, threads_k: int, vec: int, idx: str = "int32",
                   wide: bool = False):
    """TensorIR of the CSR SDDMM kernel (see the module docstring for the layout)."""
    from tvm.script import tirx as T

    RB, TX, V = int(rows_per_block), int(threads_k), int(vec)
    if K % V:
        raise ValueError(f"vec={V} must divide K={K}")
    if TX & (TX - 1) or TX > 32:
        raise ValueError(f"threads_k={TX} must be a power of two <= 32 (lanes of one warp)")
    C = _chunks(K, TX, V)
    GROUP = (1 << TX) - 1  # the lanes of one row group, shifted to the group's first lane
    off = "int64" if wide else "int32"
    shuffles = []
    s = TX // 2
    while s >= 1:
        shuffles.append(s)
        s //= 2
    NS = len(shuffles)
    S0, S1, S2, S3, S4 = (shuffles + [0] * 5)[:5]

    @T.prim_func
    def sddmm(a_indptr: T.handle, a_indices: T.handle, a_data: T.handle, a_rows: T.handle,
              a_nnz_ids: T.handle, x: T.handle, y: T.handle, o: T.handle):
        T.func_attr({"global_symbol": "sddmm", "tir.noalias": True})
        m = T.int32()
        nnz = T.int32()
        n = T.int32()
        mx = T.int32()
        indptr = T.match_buffer(a_indptr, (m + 1,), idx)
        indices = T.match_buffer(a_indices, (nnz,), idx)
        data = T.match_buffer(a_data, (nnz,), "float32")
        row_ids = T.match_buffer(a_rows, (m,), idx)
        nnz_ids = T.match_buffer(a_nnz_ids, (nnz,), idx)
        X = T.match_buffer(x, (mx, K), "float32")
        Y = T.match_buffer(y, (n, K), "float32")
        out = T.match_buffer(o, (nnz,), "float32")
        for b in T.thread_binding((m + RB - 1) // RB, thread="blockIdx.x"):
            for r in T.thread_binding(RB, thread="threadIdx.y"):
                for t in T.thread_binding(TX, thread="threadIdx.x"):
                    xr = T.alloc_buffer((C * V,), "float32", scope="local")
                    pv = T.alloc_buffer((V,), "float32", scope="local")
                    sm = T.alloc_buffer((1,), "float32", scope="local")
                    col = T.alloc_buffer((1,), off, scope="local")
                    i = b * RB + r
                    if i < m:
                        mask = T.shift_left(T.uint32(GROUP), T.Cast("uint32", (r * TX + t) % 32 - t))
                        col[0] = T.Cast(off, row_ids[i])
                        for c in T.unroll(C):
                            if (c * TX + t) * V < K:
                                for v in T.vectorized(V):
                                    xr[c * V + v] = X[col[0], (c * TX + t) * V + v]
                        for j in T.serial(T.Cast("int32", indptr[i]), T.Cast("int32", indptr[i + 1])):
                            col[0] = T.Cast(off, indices[j])
                            for v in T.vectorized(V):
                                pv[v] = T.float32(0)
                            for c in T.unroll(C):
                                if (c * TX + t) * V < K:
                                    for v in T.vectorized(V):
                                        pv[v] = pv[v] + xr[c * V + v] * Y[col[0], (c * TX + t) * V + v]
                            sm[0] = pv[0]
                            for v in T.unroll(V - 1):
                                sm[0] = sm[0] + pv[v + 1]
                            if NS > 0:
                                sm[0] = sm[0] + T.tvm_warp_shuffle_xor(mask, sm[0], S0, TX, 32)
                            if NS > 1:
                                sm[0] = sm[0] + T.tvm_warp_shuffle_xor(mask, sm[0], S1, TX, 32)
                            if NS > 2:
                                sm[0] = sm[0] + T.tvm_warp_shuffle_xor(mask, sm[0], S2, TX, 32)
                            if NS > 3:
                                sm[0] = sm[0] + T.tvm_warp_shuffle_xor(mask, sm[0], S3, TX, 32)
                            if NS > 4:
                                sm[0] = sm[0] + T.tvm_warp_shuffle_xor(mask, sm[0], S4, TX, 32)
                            if t == 0:
                                out[nnz_ids[j]] = data[j] * sm[0]

    return sddmm


# -- TVM -> CUDA source -> device binary -----------------------------------------------------

_SIG = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\((\d+)\) )?(\w+)\(([^)]*)\)\s*\{')


def cuda_source(funcs: Mapping[str, Any], arch: int = rt.DEFAULT_ARCH) -> tuple[str, dict[str, dict]]:
    """Lower PrimFuncs (``{global symbol: func}``) with TVM's CUDA codegen.  Returns the CUDA
    source and, per function, its kernel's name, parameter names (in order) and launch bound."""
    import tvm

    irmod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    lib = tvm.compile(irmod, target={"kind": "cuda", "arch": f"sm_{int(arch)}"})
    mod = getattr(lib, "mod", lib)
    dev = [m for m in mod.imports if m.kind == "cuda"] or list(mod.imports)
    src = dev[0].inspect_source()
    kernels = {}
    for bound, kname, plist in _SIG.findall(src):
        kernels[kname] = {"name": kname, "params": [p.strip().split()[-1] for p in plist.split(",") if p.strip()],
                          "bound": int(bound) if bound else None}
    out = {}
    for name in funcs:
        found = [k for k in kernels if k == name + "_kernel"] or [k for k in kernels if k.startswith(name)]
        if len(found) != 1:
            raise RuntimeError(f"cannot find the CUDA kernel of {name!r} in TVM's output: {sorted(kernels)}")
        out[name] = kernels[found[0]]
    return src, out


def compile_source(src: str, arch: int, name: str) -> str:
    """nvcc TVM's CUDA source to a cached fatbin (SASS for ``arch`` + its PTX); returns the path."""
    return rt.compile_cuda(src, arch=int(arch), name=name)


@functools.lru_cache(maxsize=None)
def _tvm_cuda_codegen() -> bool:
    try:
        import tvm
    except ImportError:  # a machine that only runs saved CUDA modules
        return False
    return tvm.get_global_func("target.build.cuda", allow_missing=True) is not None


# -- kernels ------------------------------------------------------------------------------------

class _TVMCudaKernel(rt.CUDAKernel):
    """A TVM-generated CUDA kernel run from its fatbin (no TVM or compiler needed to run it).

    ``meta["kernels"]`` lists the variants in the binary (the tuned one first, then a ``vec=1``
    variant used when an input or the output is not aligned for vector loads)."""

    def _binary(self) -> str:
        self.device_id = rt.current_device()

        def rebuild(arch):   # an artifact for another GPU generation: the saved CUDA source, no TVM
            with open(self.files["kernel.cu"]) as f:
                return compile_source(f.read(), arch, self.template.replace(".", "_"))

        built = int(self.meta["arch"])
        path, arch = rt.binary_for_device(self.files["kernel.fatbin"], built, self.device_id,
                                          rebuild if "kernel.cu" in self.files else None)
        if arch != built:
            self.files = {**self.files, "kernel.fatbin": path}
            self.meta = {**self.meta, "arch": arch}
        return path

    def prepare(self):
        mod = rt.load_module(self._binary(), self.device_id)
        meta = self.meta
        self._dev = {k: DeviceArray.from_host(self.arrays[k], self.device_id) for k in meta["array_order"]}
        scalars = meta["scalars"]
        self._variants = []
        for kern in meta["kernels"]:
            slots = []  # per parameter: ("a", ptr) bound array / scalar, ("i", n) input n, ("o",) output
            for p in kern["params"]:
                base = p[:-4] if p.endswith("_ptr") else p
                if p in scalars:
                    slots.append(("a", np.int32(scalars[p])))
                elif base in self._dev:
                    slots.append(("a", self._dev[base].ptr))
                elif base in meta["inputs"]:
                    slots.append(("i", meta["inputs"].index(base)))
                elif base == meta["output"]:
                    slots.append(("o",))
                else:
                    raise RuntimeError(f"cannot bind parameter {p!r} of TVM kernel {kern['name']!r}")
            self._variants.append((mod.get_function(kern["name"]), slots))
        m, rb = int(meta["m"]), int(meta["block"][1])
        self._grid = (max(1, -(-m // rb)), 1, 1)
        self._block = tuple(int(b) for b in meta["block"])
        # prepared launches: bound arrays/scalars fixed, per-call pointers in parameter order
        self._launches = [(rt.Launch(fn, self._grid, self._block, [s[1] if s[0] == "a" else None for s in slots]),
                           tuple(s[1] if s[0] == "i" else -1 for s in slots if s[0] != "a"))
                          for fn, slots in self._variants]
        self._amask = 4 * int(meta["vec"]) - 1
        self._empty = m == 0
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        misaligned = (out_ptr | functools.reduce(lambda a, b: a | b, in_ptrs, 0)) & self._amask
        launch, order = self._launches[-1 if misaligned else 0]
        launch(tuple(out_ptr if i < 0 else in_ptrs[i] for i in order), stream)


class _TVMCudaTemplate(Template):
    csr_arrays = True
    target = "cuda"
    version = "1"
    priority = 5
    entry = ""
    array_order: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    output = ""

    def available(self) -> bool:
        return rt.nvcc_available() and _tvm_cuda_codegen()

    def supports(self, mod: SparseModule) -> bool:
        A = mod.A
        return super().supports(mod) and max(A.nnz, A.shape[0] + 1, A.shape[1]) < INT32_MAX

    # -- parameters ----------------------------------------------------------------------------
    @staticmethod
    def _vecs(K):
        return [v for v in (1, 2, 4) if K % v == 0]

    def default_params(self, mod):
        K = mod.op.K
        vec = max(self._vecs(K))
        tx = min(32, 1 << max(0, math.ceil(math.log2(max(1, -(-K // vec))))))
        return {"rows_per_block": max(1, 128 // tx), "threads_k": tx, "vec": vec}

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution

        return {"rows_per_block": CategoricalDistribution([1, 2, 4, 8, 16, 32]),
                "threads_k": CategoricalDistribution([1, 2, 4, 8, 16, 32]),
                "vec": CategoricalDistribution(self._vecs(mod.op.K))}

    def check_params(self, mod, params):
        full = super().check_params(mod, params)
        K = mod.op.K
        if K % int(full["vec"]):
            raise ValueError(f"vec={full['vec']} must divide K={K}")
        tx, rb = int(full["threads_k"]), int(full["rows_per_block"])
        if tx < 1 or tx > 32 or tx & (tx - 1):
            raise ValueError(f"threads_k={tx} must be a power of two in 1..32")
        if rb < 1 or tx * rb > 1024:
            raise ValueError(f"rows_per_block={rb} x threads_k={tx} exceeds 1024 threads per block")
        if _chunks(K, tx, int(full["vec"])) * int(full["vec"]) > 256:
            raise ValueError(f"threads_k={tx} x vec={full['vec']} too narrow for K={K}: more than 256 "
                             f"register accumulators per thread")
        return full

    # -- build / load --------------------------------------------------------------------------
    def _func(self, mod, params, idx, wide):
        raise NotImplementedError

    def _dims(self, mod):
        raise NotImplementedError

    def generate(self, mod: SparseModule, params, arch: int = rt.DEFAULT_ARCH) -> tuple[str, list[dict]]:
        """TVM's CUDA source for ``params`` and the kernels in it (tuned variant, then vec=1)."""
        m, n = mod.A.shape
        idx = str(csr_kernel_arrays(mod)["indptr"].dtype) if mod.A.nnz or m else "int32"
        wide = max(m, n, 1) * mod.op.K > INT32_MAX
        funcs = {self.entry: self._func(mod, params, idx, wide)}
        if int(params["vec"]) > 1:  # fallback for inputs not aligned to vec * 4 bytes
            funcs[self.entry + "_v1"] = self._func(mod, {**params, "vec": 1}, idx, wide)
        src, kernels = cuda_source(funcs, arch)
        block = [int(params["threads_k"]), int(params["rows_per_block"]), 1]
        for k in kernels.values():
            if k["bound"] is not None and k["bound"] != block[0] * block[1]:
                raise RuntimeError(f"TVM kernel launch bound {k['bound']} != block {block}")
        return src, [kernels[f] for f in funcs]

    def build(self, mod: SparseModule, params) -> Kernel:
        params = self.check_params(mod, params)
        arrays = {k: v for k, v in csr_kernel_arrays(mod).items() if k in self.array_order}
        arch = int(rt.device_arch())
        src, kernels = self.generate(mod, params, arch)
        binary = compile_source(src, arch, self.name.replace(".", "_"))
        cu = _cached_source(src, self.name.replace(".", "_"))
        scalars = self._dims(mod)
        meta = {"kernels": kernels, "block": [int(params["threads_k"]), int(params["rows_per_block"]), 1],
                "arch": arch, "vec": int(params["vec"]), "K": int(mod.op.K), "m": int(mod.A.shape[0]),
                "scalars": scalars, "inputs": list(self.inputs), "output": self.output,
                "array_order": list(self.array_order), "codegen": f"tvm {tvm_version()}"}
        return _TVMCudaKernel(self.name, params, arrays, {"kernel.fatbin": binary, "kernel.cu": cu}, meta)

    def load(self, params, arrays, files, meta):
        return _TVMCudaKernel(self.name, params, arrays, files, meta)


@register_template
class CudaSpMM(_TVMCudaTemplate):
    """CSR SpMM (sum/max/min/mean) as a TensorIR CUDA kernel: row groups per block, K split over
    lanes with vector loads, accumulators in registers."""

    name = "tvm.cuda_csr_spmm"
    entry = "spmm"
    ops = tuple(("spmm", r) for r in ("sum", "max", "min", "mean"))
    array_order = ("indptr", "indices", "data", "row_ids")
    inputs = ("X",)
    output = "Y"

    def default_params(self, mod):
        return {**super().default_params(mod), "nnz_unroll": 2}

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution

        return {**super().space(mod), "nnz_unroll": CategoricalDistribution([1, 2, 4])}

    def _func(self, mod, params, idx, wide):
        return spmm_primfunc(mod.op.K, mod.op.reduce, int(params["rows_per_block"]), int(params["threads_k"]),
                             int(params["vec"]), int(params["nnz_unroll"]), idx, wide)

    def _dims(self, mod):
        m, n = mod.A.shape
        return {"m": int(m), "n": int(n), "nnz": int(mod.A.nnz)}


@register_template
class CudaSDDMM(_TVMCudaTemplate):
    """CSR SDDMM as a TensorIR CUDA kernel: X's row slice in registers, per-nonzero partial dot
    products combined across lanes by warp shuffles."""

    name = "tvm.cuda_csr_sddmm"
    entry = "sddmm"
    ops = (("sddmm", None),)
    array_order = ("indptr", "indices", "data", "row_ids", "nnz_ids")
    inputs = ("X", "Y")
    output = "out"

    def _func(self, mod, params, idx, wide):
        return sddmm_primfunc(mod.op.K, int(params["rows_per_block"]), int(params["threads_k"]),
                              int(params["vec"]), idx, wide)

    def _dims(self, mod):
        m, n = mod.A.shape
        return {"m": int(m), "n": int(n), "nnz": int(mod.A.nnz), "mx": int(m)}
