"""TVM TensorIR CPU kernels (llvm target) for CSR SpMM (sum/max/min/mean) and SDDMM.

Schedule parameters (tunable through ``space()``):

* ``rows_per_task``: rows handled by one parallel task (the outer loop is ``T.parallel`` over
  chunks of rows; larger chunks mean less scheduling overhead, smaller ones better balance),
* ``k_tile``: width of the slice of K kept in a register accumulator while walking a row's
  nonzeros (the row's structure is re-read once per slice, X's slice rows stay in cache).

The kernel works in the caller's order: ``indices`` are original column ids and ``row_ids`` /
``nnz_ids`` say where outputs go (see :func:`~spcompile.schedules.base.csr_kernel_arrays`).
"""
from __future__ import annotations

import math

import numpy as np

from ..ir import SparseModule
from ..runtime import cpu as rt
from .base import Kernel, Template, csr_kernel_arrays, register_template

_REDUCE_CODE = {"sum": 0, "mean": 0, "max": 1, "min": 2}


def _spmm_func(K: int, reduce: str, rows_per_task: int, k_tile: int, idx: str):
    import tvm
    from tvm.script import tirx as T

    KT = max(1, min(k_tile, K))
    NT = K // KT  # full tiles
    REM = K - NT * KT
    R = _REDUCE_CODE[reduce]
    MEAN = 1 if reduce == "mean" else 0
    RPT = max(1, rows_per_task)
    init = 0.0 if R == 0 else (-math.inf if R == 1 else math.inf)

    @T.prim_func
    def spmm(a_indptr: T.handle, a_indices: T.handle, a_data: T.handle, a_rows: T.handle,
             x: T.handle, y: T.handle):
        T.func_attr({"global_symbol": "spmm", "tir.noalias": True})
        m = T.int32()
        nnz = T.int32()
        n = T.int32()
        indptr = T.match_buffer(a_indptr, (m + 1,), idx, align=4)
        indices = T.match_buffer(a_indices, (nnz,), idx, align=4)
        data = T.match_buffer(a_data, (nnz,), "float32", align=4)
        rows = T.match_buffer(a_rows, (m,), idx, align=4)
        X = T.match_buffer(x, (n, K), "float32", align=4)
        Y = T.match_buffer(y, (m, K), "float32", align=4)
        for c in T.parallel((m + RPT - 1) // RPT):
            for r in T.serial(RPT):
                i = c * RPT + r
                if i < m:
                    lo = T.Cast("int32", indptr[i])
                    hi = T.Cast("int32", indptr[i + 1])
                    orow = rows[i]
                    acc = T.alloc_buffer((KT,), "float32", scope="local")
                    for t in T.serial(NT):
                        for k in T.vectorized(KT):
                            acc[k] = T.float32(init)
                        for j in T.serial(lo, hi):
                            for k in T.vectorized(KT):
                                acc[k] = T.Select(
                                    R == 0, acc[k] + data[j] * X[indices[j], t * KT + k],
                                    T.Select(R == 1, T.max(acc[k], data[j] * X[indices[j], t * KT + k]),
                                             T.min(acc[k], data[j] * X[indices[j], t * KT + k])))
                        for k in T.vectorized(KT):
                            Y[orow, t * KT + k] = T.Select(
                                hi == lo, T.float32(0),
                                T.Select(MEAN == 1, acc[k] / T.Cast("float32", hi - lo), acc[k]))
                    if REM > 0:
                        for k in T.serial(REM):
                            acc[k] = T.float32(init)
                        for j in T.serial(lo, hi):
                            for k in T.serial(REM):
                                acc[k] = T.Select(
                                    R == 0, acc[k] + data[j] * X[indices[j], NT * KT + k],
                                    T.Select(R == 1, T.max(acc[k], data[j] * X[indices[j], NT * KT + k]),
                                             T.min(acc[k], data[j] * X[indices[j], NT * KT + k])))
                        for k in T.serial(REM):
                            Y[orow, NT * KT + k] = T.Select(
                                hi == lo, T.float32(0),
                                T.Select(MEAN == 1, acc[k] / T.Cast("float32", hi - lo), acc[k]))

    return spmm


def _sddmm_func(K: int, rows_per_task: int, k_tile: int, idx: str):
    from tvm.script import tirx as T

    KT = max(1, min(k_tile, K))
    NT = K // KT
    REM = K - NT * KT
    RPT = max(1, rows_per_task)

    @T.prim_func
    def sddmm(a_indptr: T.handle, a_indices: T.handle, a_data: T.handle, a_rows: T.handle,
              a_nnz_ids: T.handle, x: T.handle, y: T.handle, o: T.handle):
        T.func_attr({"global_symbol": "sddmm", "tir.noalias": True})
        m = T.int32()
        nnz = T.int32()
        n = T.int32()
        mx = T.int32()
        indptr = T.match_buffer(a_indptr, (m + 1,), idx, align=4)
        indices = T.match_buffer(a_indices, (nnz,), idx, align=4)
        data = T.match_buffer(a_data, (nnz,), "float32", align=4)
        rows = T.match_buffer(a_rows, (m,), idx, align=4)
        nnz_ids = T.match_buffer(a_nnz_ids, (nnz,), idx, align=4)
        X = T.match_buffer(x, (mx, K), "float32", align=4)
        Y = T.match_buffer(y, (n, K), "float32", align=4)
        out = T.match_buffer(o, (nnz,), "float32", align=4)
        for c in T.parallel((m + RPT - 1) // RPT):
            for r in T.serial(RPT):
                i = c * RPT + r
                if i < m:
                    orow = rows[i]
                    acc = T.alloc_buffer((KT,), "float32", scope="local")
                    s = T.alloc_buffer((1,), "float32", scope="local")
                    for j in T.serial(T.Cast("int32", indptr[i]), T.Cast("int32", indptr[i + 1])):
                        for k in T.vectorized(KT):
                            acc[k] = T.float32(0)
                        for t in T.serial(NT):
                            for k in T.vectorized(KT):
                                acc[k] = acc[k] + X[orow, t * KT + k] * Y[indices[j], t * KT + k]
                        s[0] = T.float32(0)
                        for k in T.serial(REM):
                            s[0] = s[0] + X[orow, NT * KT + k] * Y[indices[j], NT * KT + k]
                        for k in T.serial(KT):
                            s[0] = s[0] + acc[k]
                        out[nnz_ids[j]] = data[j] * s[0]

    return sddmm


class _CPUKernel(Kernel):
    target = "cpu"

    def __init__(self, template, params, arrays, files, meta, lib, entry):
        super().__init__(template, params, arrays, files, meta)
        self._lib = lib
        self._fn = lib[entry]
        self._entry = entry
        self._bound = [rt.as_tensor(arrays[k]) for k in meta["array_order"]]

    def __call__(self, *inputs, out):
        self._fn(*self._bound, *(rt.as_tensor(x) for x in inputs), rt.as_tensor(out))
        return out


class _CPUTemplate(Template):
    target = "cpu"
    version = "1"
    priority = 10
    entry = ""
    array_order: tuple[str, ...] = ()

    def available(self) -> bool:
        try:
            import tvm  # noqa: F401
            from tvm.target import codegen

            return codegen.llvm_version_major() > 0
        except Exception:
            return False

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution

        K = mod.op.K
        tiles = sorted({t for t in (4, 8, 16, 32, 64, 128) if t <= max(4, K)} | {min(K, 256)})
        return {"rows_per_task": CategoricalDistribution([1, 4, 16, 64, 256]),
                "k_tile": CategoricalDistribution(tiles)}

    def default_params(self, mod):
        return {"rows_per_task": 16, "k_tile": min(mod.op.K, 32)}

    def _func(self, mod, params, idx):
        raise NotImplementedError

    def build(self, mod: SparseModule, params) -> Kernel:
        params = self.check_params(mod, params)
        arrays = {k: v for k, v in csr_kernel_arrays(mod).items() if k in self.array_order}
        idx = str(arrays["indptr"].dtype)
        lib = rt.compile_primfunc(self._func(mod, params, idx))
        path = rt.export(lib)
        meta = {"array_order": list(self.array_order), "llvm_target": rt.host_llvm_target(),
                "entry": self.entry}
        return _CPUKernel(self.name, params, arrays, {"kernel.so": path}, meta, rt.load(path), self.entry)

    def load(self, params, arrays, files, meta):
        return _CPUKernel(self.name, params, arrays, files, meta, rt.load(files["kernel.so"]), meta["entry"])


@register_template
class CPUSpMM(_CPUTemplate):
    """CSR SpMM (sum/max/min/mean) as a TensorIR kernel: parallel row chunks, K tiles in registers."""

    name = "cpu.csr_spmm"
    ops = tuple(("spmm", r) for r in ("sum", "max", "min", "mean"))
    entry = "spmm"
    array_order = ("indptr", "indices", "data", "row_ids")

    def _func(self, mod, params, idx):
        return _spmm_func(mod.op.K, mod.op.reduce, int(params["rows_per_task"]), int(params["k_tile"]), idx)


@register_template
class CPUSDDMM(_CPUTemplate):
    """CSR SDDMM as a TensorIR kernel: parallel row chunks, vectorised dot products per nonzero."""

    name = "cpu.csr_sddmm"
    ops = (("sddmm", None),)
    entry = "sddmm"
    array_order = ("indptr", "indices", "data", "row_ids", "nnz_ids")

    def _func(self, mod, params, idx):
        return _sddmm_func(mod.op.K, int(params["rows_per_task"]), int(params["k_tile"]), idx)
