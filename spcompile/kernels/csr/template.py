"""CUDA C++ templates: ``csr.crc_cwm`` (GE-SpMM SpMM), ``csr.sddmm`` and ``extern.cusparse``.

Each CUDA template has ONE parametrised source (``*.cu`` beside this file).  Parameters that shape
registers and unrolled loops are C++ template arguments; for a parameter set we render the source
plus one ``extern "C"`` wrapper instantiating it (``SPC_*_INSTANCE``), compile with nvcc (cached on
disk, see :mod:`spcompile.runtime.cuda`) and keep the binary in the kernel's ``files`` so saved
artifacts carry it.  Parameters that do not need to be compile-time (K, warps per block, rows per
warp, the row partition) are launch arguments, so one binary serves every K and block shape.

Load balance: rows longer than ``max_seg`` nonzeros are cut into balanced slices processed by
different row groups and combined in the same launch (see ``spmm_crc_cwm.cu``); with
``max_seg=0`` every row is one segment (the paper's plain mapping).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...core.ir import SparseModule
from ...runtime import cuda as rt
from ..base import csr_kernel_arrays, register_template, unique_params
from ..nvcc import _NvccKernel, _NvccTemplate

_REDUCE = {"sum": 0, "max": 1, "min": 2, "mean": 3}
#: element types of X / Y / output the nvcc templates compile for (TN template code, bytes);
#: the matrix values stay fp32 and all arithmetic is fp32 (one rounding of the output)
_ELEM = {"float32": (0, 4), "float16": (1, 2), "bfloat16": (2, 2)}
_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _vec_choices(dtype: str) -> list[int]:
    """Vector widths (elements) up to 16 bytes per load for ``dtype``."""
    return [1, 2, 4, 8] if _ELEM[dtype][1] == 2 else [1, 2, 4]


def _largest_vec(K: int, vec: int) -> int:
    v = int(vec)
    while v > 1 and K % v:
        v //= 2
    return max(v, 1)


# ------------------------------------------------------------------------------------------
# row partition (vectorised)
# ------------------------------------------------------------------------------------------
def spmm_partition(indptr: np.ndarray, row_ids: np.ndarray, max_seg: int) -> dict[str, np.ndarray]:
    """Cut rows into segments of at most ``max_seg`` nonzeros (0: whole rows).  Returns the arrays
    of ``spmm_crc_cwm.cu``: seg_ptr, seg_out, seg_slot, grp_ptr, slot_grp, grp_out, grp_len."""
    indptr = np.asarray(indptr, dtype=np.int64)
    m = indptr.size - 1
    lens = np.diff(indptr)
    if max_seg and max_seg > 0:
        nch = np.maximum(1, -(-lens // int(max_seg)))
    else:
        nch = np.ones(m, dtype=np.int64)
    nseg = int(nch.sum())
    seg_row = np.repeat(np.arange(m, dtype=np.int64), nch)
    first = np.cumsum(nch) - nch
    within = np.arange(nseg, dtype=np.int64) - first[seg_row]
    seg_start = indptr[seg_row] + (within * lens[seg_row]) // nch[seg_row]   # balanced slices
    seg_ptr = np.append(seg_start, indptr[-1] if m else 0)
    split_seg = nch[seg_row] > 1
    seg_slot = np.full(nseg, -1, dtype=np.int64)
    seg_slot[split_seg] = np.arange(int(split_seg.sum()))
    split_rows = np.flatnonzero(nch > 1)
    grp_ptr = np.concatenate([[0], np.cumsum(nch[split_rows])])
    slot_grp = np.repeat(np.arange(split_rows.size), nch[split_rows])
    row_ids = np.asarray(row_ids, dtype=np.int64)
    return {"seg_ptr": _i32(seg_ptr), "seg_out": _i32(row_ids[seg_row]), "seg_slot": _i32(seg_slot),
            "grp_ptr": _i32(grp_ptr), "slot_grp": _i32(slot_grp), "grp_out": _i32(row_ids[split_rows]),
            "grp_len": _i32(lens[split_rows])}


def sddmm_partition(indptr: np.ndarray, row_ids: np.ndarray, nnz_per_warp: int) -> dict[str, np.ndarray]:
    """Segments of at most ``nnz_per_warp`` nonzeros of one row (empty rows have none)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    m = indptr.size - 1
    lens = np.diff(indptr)
    npw = max(1, int(nnz_per_warp))
    nch = -(-lens // npw)
    nseg = int(nch.sum())
    seg_row = np.repeat(np.arange(m, dtype=np.int64), nch)
    first = np.cumsum(nch) - nch
    within = np.arange(nseg, dtype=np.int64) - first[seg_row]
    seg_start = indptr[seg_row] + (within * lens[seg_row]) // nch[seg_row]
    seg_ptr = np.append(seg_start, indptr[-1] if m else 0)
    return {"seg_ptr": _i32(seg_ptr), "seg_xrow": _i32(np.asarray(row_ids, dtype=np.int64)[seg_row])}


# ------------------------------------------------------------------------------------------
# csr.crc_cwm — GE-SpMM
# ------------------------------------------------------------------------------------------
class CrcCwmKernel(_NvccKernel):
    def prepare(self):
        import cupy

        fns = self._load_functions()
        self._fn = fns[0]
        self._fn1 = fns[-1]                          # VEC=1 instance (alignment fallback)
        p, K = self.params, int(self.meta["K"])
        G, CF, VEC = int(p["group"]), int(p["cf"]), int(self.meta["vec"])
        nseg = int(self.arrays["seg_out"].size)
        wpb, rpw = int(p["warps_per_block"]), int(p["rows_per_warp"])
        threads = 32 * wpb
        groups = threads // G
        bx = -(-nseg // (groups * rpw))
        ty, ty1 = -(-K // (G * VEC * CF)), -(-K // (G * CF))
        ngrp = int(self.arrays["grp_len"].size)
        nslot = int(self.arrays["slot_grp"].size)
        pre = self._upload(("seg_ptr", "seg_out", "seg_slot", "indices", "data"))
        post_arr = self._upload(("grp_ptr", "slot_grp", "grp_out", "grp_len"))
        self._part = cupy.empty(max(1, nslot * K), dtype=cupy.float32)
        self._counters = cupy.zeros(max(1, ngrp * max(ty, ty1)), dtype=cupy.int32)
        args = pre + (None, None, int(self._part.data.ptr), int(self._counters.data.ptr), *post_arr,
                      np.int32(nseg), np.int32(K), np.int32(rpw))
        block, smem = (threads, 1, 1), threads * 8
        self._launch = rt.Launch(self._fn, (bx, ty, 1), block, args, smem)
        self._launch1 = rt.Launch(self._fn1, (bx, ty1, 1), block, args, smem)   # unaligned X / Y
        self._amask = _ELEM[self.meta.get("dtype", "float32")][1] * VEC - 1
        self._empty = nseg == 0
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x = in_ptrs[0]
        (self._launch1 if (x | out_ptr) & self._amask else self._launch)((x, out_ptr), stream)


@register_template
class CrcCwm(_NvccTemplate):
    """GE-SpMM (SC'20) CSR SpMM with sum/max/min/mean: coalesced row caching in shared memory,
    coarse-grained warp merging (CF), vector loads, sub-warp row groups for narrow K, split long
    rows for load balance, and ``unroll`` nonzeros' X loads in flight before accumulating.  Any
    K >= 1.  X / Y in float32, float16 or bfloat16 (fp32 accumulation, one rounding of Y)."""

    name = "csr.crc_cwm"
    version = "2"
    dtypes = ("float32", "float16", "bfloat16")   # X / Y; fp32 accumulation
    priority = 30
    ops = tuple(("spmm", r) for r in ("sum", "max", "min", "mean"))
    source_file = "spmm_crc_cwm.cu"
    instance_macro = "SPC_SPMM_INSTANCE"

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"cf": C([1, 2, 4, 8]), "vec": C(_vec_choices(mod.op.dtype)), "group": C([4, 8, 16, 32]),
                "warps_per_block": C([2, 4, 8]), "rows_per_warp": C([1, 2, 4]),
                "max_seg": C([0, 8, 16, 32, 64, 256, 1024, 4096]), "unroll": C([1, 2, 4, 8])}

    @staticmethod
    def heuristic(K: int, max_row: int, mean_row: float, dtype: str = "float32") -> dict:
        vec = _largest_vec(K, 16 // _ELEM[dtype][1])
        lanes = -(-K // vec)
        group = next(g for g in (4, 8, 16, 32) if g >= min(lanes, 32))
        cf = min(8, max(1, -(-K // (group * vec))))
        cf = 1 << (cf - 1).bit_length() if cf > 1 else 1
        cf = min(cf, 4)
        max_seg = 0 if max_row <= max(256, 4 * mean_row) else 256
        return {"cf": cf, "vec": vec, "group": group, "warps_per_block": 4, "rows_per_warp": 1,
                "max_seg": max_seg, "unroll": 2 if cf <= 2 else 1}

    def default_params(self, mod):
        lens = mod.A.row_lengths
        return self.heuristic(mod.op.K, int(lens.max()) if lens.size else 0,
                              float(lens.mean()) if lens.size else 0.0, mod.op.dtype)

    def seed_params(self, mod):
        d = self.default_params(mod)
        K = mod.op.K
        seeds = [d]
        for ms in (0, 32, 64, 256, 1024):
            seeds.append({**d, "max_seg": ms})
        # few rows with long-ish rows (small dense-ish graphs): short slices give parallelism
        vmax = 16 // _ELEM[mod.op.dtype][1]
        vec4 = _largest_vec(K, vmax)
        cf4 = min(4, max(1, -(-K // (32 * vec4))))
        cf4 = 1 << (cf4 - 1).bit_length() if cf4 > 1 else 1
        for ms in (32, 64):
            seeds.append({**d, "group": 32, "vec": vec4, "cf": cf4, "max_seg": ms})
        vec = vec4
        for cf in (1, 2, 4, 8):
            if 32 * vec * cf <= max(32 * vec, 2 * K):
                seeds.append({**d, "group": 32, "vec": vec, "cf": cf, "unroll": 2 if cf <= 2 else 1})
        seeds.append({**d, "vec": 1, "group": 32, "cf": min(4, max(1, -(-K // 32)))})
        seeds.append({**d, "warps_per_block": 8, "rows_per_warp": 2})
        seeds.append({**d, "warps_per_block": 2})
        seeds.append({**d, "unroll": 1})
        seeds.append({**d, "unroll": 4 if d["cf"] <= 2 else 2})
        if mod.A.nnz <= 200_000:
            # small graphs are latency-bound: shorter slices of long rows and finer column tiles
            # (more row groups / blocks in flight), more X loads in flight per lane
            for ms in (8, 16, 32):
                seeds.append({**d, "group": 32, "vec": vec4, "cf": cf4, "max_seg": ms,
                              "unroll": max(1, min(8, 8 // cf4))})
            for g in (8, 16):
                if g * vec4 < K:
                    for ms in (16, 32):
                        seeds.append({**d, "group": g, "vec": vec4, "cf": 1, "max_seg": ms, "unroll": 8})
        return unique_params(seeds)

    @staticmethod
    def instance_name(TN, R, CF, VEC, G, U) -> str:
        t = ("f32", "f16", "bf16")[TN]
        return f"spmm_crc_cwm_{t}_r{R}_cf{CF}_v{VEC}_g{G}_u{U}"

    def instances(self, reduce: str, cf: int, vec: int, group: int, unroll: int = 4,
                  dtype: str = "float32") -> list:
        R, TN = _REDUCE[reduce], _ELEM[dtype][0]
        inst = [(self.instance_name(TN, R, cf, vec, group, unroll), (TN, R, cf, vec, group, unroll))]
        if vec > 1:
            inst.append((self.instance_name(TN, R, cf, 1, group, unroll), (TN, R, cf, 1, group, unroll)))
        return inst

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        K = mod.op.K
        dtype = mod.op.dtype
        if dtype not in self.dtypes:
            raise ValueError(f"csr.crc_cwm supports dtypes {list(self.dtypes)}, not {dtype!r}")
        cf, group, unroll = int(params["cf"]), int(params["group"]), int(params["unroll"])
        if (cf not in (1, 2, 4, 8) or group not in (4, 8, 16, 32) or int(params["vec"]) not in _vec_choices(dtype)
                or unroll not in (1, 2, 4, 8)):
            raise ValueError(f"invalid csr.crc_cwm parameters {params} for dtype {dtype}")
        if int(params["warps_per_block"]) not in (1, 2, 4, 8) or int(params["rows_per_warp"]) < 1:
            raise ValueError(f"invalid csr.crc_cwm parameters {params}")
        vec = _largest_vec(K, int(params["vec"]))
        ka = csr_kernel_arrays(mod, np.int32)
        arrays = {"indices": _i32(ka["indices"]), "data": ka["data"],
                  **spmm_partition(ka["indptr"], ka["row_ids"], int(params["max_seg"]))}
        inst = self.instances(mod.op.reduce, cf, vec, group, unroll, dtype)
        arch = rt.device_arch()
        path = self.compile(inst, arch=arch, name=inst[0][0])
        meta = {"K": K, "vec": vec, "arch": arch, "dtype": dtype, "instances": [[n, list(a)] for n, a in inst]}
        return CrcCwmKernel(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        return CrcCwmKernel(self.name, params, arrays, files, meta, self)


# ------------------------------------------------------------------------------------------
# csr.sddmm
# ------------------------------------------------------------------------------------------
class SddmmKernel(_NvccKernel):
    def prepare(self):
        fns = self._load_functions()
        self._fn, self._fn1 = fns[0], fns[-1]
        p, K = self.params, int(self.meta["K"])
        nseg = int(self.arrays["seg_xrow"].size)
        wpb = int(p["warps_per_block"])
        args = self._upload(("seg_ptr", "seg_xrow", "indices", "data", "nnz_ids")) + (
            None, None, None, np.int32(nseg), np.int32(K))
        grid, block = (max(1, -(-nseg // wpb)), 1, 1), (32 * wpb, 1, 1)
        self._launch = rt.Launch(self._fn, grid, block, args)
        self._launch1 = rt.Launch(self._fn1, grid, block, args)
        self._amask = _ELEM[self.meta.get("dtype", "float32")][1] * int(self.meta["vec"]) - 1
        self._empty = nseg == 0
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x, y = in_ptrs
        (self._launch1 if (x | y) & self._amask else self._launch)((x, y, out_ptr), stream)


@register_template
class CsrSddmm(_NvccTemplate):
    """CSR SDDMM: a warp per bounded run of one row's nonzeros (X row reused from registers),
    G-lane groups per nonzero with VEC-wide coalesced loads and shuffle reductions, XC column
    chunks per lane (K tiling).  Any K >= 1.  X / Y / output in float32, float16 or bfloat16
    (fp32 dot products, one rounding of each output)."""

    name = "csr.sddmm"
    version = "2"
    dtypes = ("float32", "float16", "bfloat16")   # X / Y / output; fp32 dot products
    priority = 30
    ops = (("sddmm", None),)
    source_file = "sddmm_csr.cu"
    instance_macro = "SPC_SDDMM_INSTANCE"

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"group": C([4, 8, 16, 32]), "vec": C(_vec_choices(mod.op.dtype)), "k_chunks": C([1, 2, 4]),
                "nnz_per_warp": C([8, 16, 32, 64, 128, 256]), "warps_per_block": C([2, 4, 8])}

    @staticmethod
    def heuristic(K: int, dtype: str = "float32") -> dict:
        vec = _largest_vec(K, 16 // _ELEM[dtype][1])
        lanes = -(-K // vec)
        group = 32 if lanes >= 32 else next(g for g in (4, 8, 16, 32) if g >= lanes)
        xc = min(4, max(1, -(-K // (group * vec))))
        xc = 1 << (xc - 1).bit_length() if xc > 1 else 1
        return {"group": group, "vec": vec, "k_chunks": xc, "nnz_per_warp": 32, "warps_per_block": 4}

    def default_params(self, mod):
        return self.heuristic(mod.op.K, mod.op.dtype)

    def seed_params(self, mod):
        d = self.default_params(mod)
        K = mod.op.K
        vec = d["vec"]
        seeds = [d, {**d, "nnz_per_warp": 8}, {**d, "nnz_per_warp": 128}]
        for g in (8, 16):
            xc = min(4, max(1, -(-K // (g * vec))))
            xc = 1 << (xc - 1).bit_length() if xc > 1 else 1
            seeds.append({**d, "group": g, "k_chunks": xc})
            seeds.append({**d, "group": g, "k_chunks": xc, "nnz_per_warp": 64})
        seeds.append({**d, "warps_per_block": 8})
        return unique_params(seeds)

    @staticmethod
    def instance_name(TN, G, VEC, XC) -> str:
        t = ("f32", "f16", "bf16")[TN]
        return f"sddmm_csr_{t}_g{G}_v{VEC}_xc{XC}"

    def instances(self, group: int, vec: int, xc: int, dtype: str = "float32") -> list:
        TN = _ELEM[dtype][0]
        inst = [(self.instance_name(TN, group, vec, xc), (TN, group, vec, xc))]
        if vec > 1:
            inst.append((self.instance_name(TN, group, 1, xc), (TN, group, 1, xc)))
        return inst

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        K = mod.op.K
        dtype = mod.op.dtype
        if dtype not in self.dtypes:
            raise ValueError(f"csr.sddmm supports dtypes {list(self.dtypes)}, not {dtype!r}")
        group, xc = int(params["group"]), int(params["k_chunks"])
        if group not in (4, 8, 16, 32) or xc not in (1, 2, 4, 8) or int(params["vec"]) not in _vec_choices(dtype):
            raise ValueError(f"invalid csr.sddmm parameters {params} for dtype {dtype}")
        if int(params["warps_per_block"]) not in (1, 2, 4, 8) or int(params["nnz_per_warp"]) < 1:
            raise ValueError(f"invalid csr.sddmm parameters {params}")
        vec = _largest_vec(K, int(params["vec"]))
        ka = csr_kernel_arrays(mod, np.int32)
        arrays = {"indices": _i32(ka["indices"]), "data": ka["data"], "nnz_ids": _i32(ka["nnz_ids"]),
                  **sddmm_partition(ka["indptr"], ka["row_ids"], int(params["nnz_per_warp"]))}
        inst = self.instances(group, vec, xc, dtype)
        arch = rt.device_arch()
        path = self.compile(inst, arch=arch, name=inst[0][0])
        meta = {"K": K, "vec": vec, "arch": arch, "dtype": dtype, "instances": [[n, list(a)] for n, a in inst]}
        return SddmmKernel(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        return SddmmKernel(self.name, params, arrays, files, meta, self)
