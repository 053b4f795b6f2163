"""``csr.window``: row-window SpMM with each window's distinct X rows staged once in shared
memory and reused by every row of the window (``spmm_window.cu``; arrays from ``packer.py``, numpy
emulation in ``emulate.py``).

The reuse the condensed tensor-core formats get from their 16-row windows, in exact fp32 on CUDA
cores (and fp16 / bf16 inputs with fp32 accumulation): a column shared by r rows of a window is
gathered from L2 once instead of r times.  How much that saves is the matrix's window reuse
(nonzeros per distinct (window, column) pair), which locality orderings raise, so the template's
own pipelines put RCM (and RCM + LSH clustering) in front; on graphs without reuse the staging is
pure overhead.  Measured slower than ``csr.crc_cwm`` throughout (see ``tunable``), so the tuner
does not offer it.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...core.numerics import DTYPES
from ..aspt.template import smem_cap
from ..base import (check_entries, check_instances, float_array, index_array, meta_equal, meta_int,
                    pointer_array, register_template, typed_array, unique_params)
from ..csr.template import _REDUCE, _SHORT, _largest_vec, _vec_choices
from ..nvcc import AtLeast, LaunchSpec, NvccKernel, NvccTemplate
from .emulate import emulate_window, window_columns  # noqa: F401 (public here too)
from .packer import pack_window, window_partition  # noqa: F401 (public here too)

#: staged columns per buffer offered to the search
CHUNKS = (16, 32, 64, 128, 256)


def stage_chunk(chunk: int, vec: int, nbuf: int, elem_bytes: int, arch: int) -> int:
    """Columns per staging buffer: ``chunk``, or fewer where ``nbuf`` buffers of KT = 32 * vec
    elements per column would not fit in the arch's shared memory (at least 1)."""
    row = 32 * int(vec) * int(elem_bytes)
    return max(1, min(int(chunk), smem_cap(arch) // (int(nbuf) * row)))


class WindowKernel(NvccKernel):
    """Launch of ``spmm_window.cu``: one block per (row window, column tile of 32 x VEC)."""

    inputs, output = ("X",), "Y"

    def chunk(self, vec: int) -> int:
        """Columns per staging buffer of the launch with vector width ``vec``: the parameter,
        capped by the shared memory of the arch the binary is for (``meta["arch"]``, which a
        rebuild for another GPU updates)."""
        p = self.params
        return stage_chunk(int(p["chunk"]), vec, int(p["nbuf"]), DTYPES[self.meta.get("dtype", "float32")].bytes,
                           int(self.meta["arch"]))

    def launch_spec(self, vec):
        p, meta = self.params, self.meta
        K, m, chunk = int(meta["K"]), int(meta["m"]), self.chunk(int(vec))
        nwin = int(self.arrays["win_ptr"].size) - 1
        elem = DTYPES[meta.get("dtype", "float32")].bytes
        return LaunchSpec(grid=(max(nwin, 1), -(-K // (32 * int(vec))), 1), block=(32 * int(p["warps"]), 1, 1),
                          smem=int(p["nbuf"]) * chunk * 32 * int(vec) * elem, args={"m": m, "K": K, "chunk": chunk})

    def empty(self):
        return int(self.meta["m"]) == 0 or int(self.meta["K"]) == 0


@register_template
class CsrWindow(NvccTemplate):
    """Row-window SpMM (sum/max/min/mean): windows of ``warps x rows_per_warp`` consecutive rows,
    each window's distinct columns staged ``chunk`` at a time in shared memory by cp.async
    (``nbuf`` = 2: double-buffered) and reduced from there by every row that needs them; VEC-wide
    lanes, one column tile of 32 x VEC per block.  Any K >= 1.  X / Y in float32, float16 or
    bfloat16 (fp32 arithmetic, one rounding of Y)."""

    name = "csr.window"
    version = "2"
    #: not offered to the tuner: on the H100 it is slower than csr.crc_cwm on every shared graph
    #: over 200k nonzeros (best of 20 shapes behind RCM / degree order: 0.94-1.26x of cuSPARSE on
    #: meshes and batched molecules, 0.1-0.4x on social graphs, whose hub rows keep one warp busy
    #: while the block waits; 64- and 128-row windows with the rows interleaved over the warps:
    #: 0.11-0.47x on eight social graphs; docs/benchmarks/h100_window_sweep.md).  Built when named
    #: (``template="csr.window"``), e.g. by ``benchmarks/reuse_sweep.py --template csr.window``.
    tunable = False
    dtypes = ("float32", "float16", "bfloat16")
    priority = 25
    ops = tuple(("spmm", r) for r in ("sum", "max", "min", "mean"))
    format = "window"
    min_arch = 80                # cp.async
    source_file = "spmm_window.cu"
    headers = ("../csr/spmm_crc_cwm.cu",)
    instance_macro = "SPC_WINDOW_INSTANCE"
    kernel_class = WindowKernel
    fallback_param = "vec"

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"vec": C(_vec_choices(mod.op.dtype)), "warps": C([4, 8, 16]), "rows_per_warp": C([1, 2, 4, 8]),
                "chunk": C(list(CHUNKS)), "nbuf": C([1, 2])}

    @staticmethod
    def heuristic(K: int, dtype: str = "float32") -> dict:
        """16-byte lanes, 32-row windows (8 warps x 4 rows), 32 KB staging buffers, two of them."""
        vec = _largest_vec(K, 16 // DTYPES[dtype].bytes)
        chunk = max(16, min(256, 32768 // (32 * vec * DTYPES[dtype].bytes)))
        return {"vec": vec, "warps": 8, "rows_per_warp": 4, "chunk": chunk, "nbuf": 2}

    def default_params(self, mod):
        return self.heuristic(mod.op.K, mod.op.dtype)

    def seed_params(self, mod):
        d = self.default_params(mod)
        K = mod.op.K
        seeds = [d]
        # window height: taller windows share more columns, shorter ones give more blocks
        for w, r in ((4, 4), (8, 2), (8, 8), (16, 4)):
            seeds.append({**d, "warps": w, "rows_per_warp": r})
        # narrower lanes: more column tiles (blocks) on graphs with few windows
        v2 = _largest_vec(K, max(1, d["vec"] // 2))
        if v2 < d["vec"]:
            seeds.append({**d, "vec": v2, "chunk": min(256, 2 * d["chunk"])})
            seeds.append({**d, "vec": v2, "chunk": min(256, 2 * d["chunk"]), "rows_per_warp": 8})
        seeds.append({**d, "chunk": max(16, d["chunk"] // 2), "nbuf": 1})
        seeds.append({**d, "chunk": min(256, 2 * d["chunk"]), "nbuf": 1})
        return unique_params(seeds)

    def checks(self, mod):
        return {"vec": _vec_choices(mod.op.dtype), "warps": (1, 2, 4, 8, 16), "rows_per_warp": (1, 2, 4, 8),
                "chunk": AtLeast(1), "nbuf": (1, 2)}

    def pack(self, mod, params):
        return pack_window(mod, int(params["warps"]) * int(params["rows_per_warp"]))

    def instance_args(self, mod, params):
        return {"reduce": mod.op.reduce, "vec": _largest_vec(mod.op.K, int(params["vec"])),
                "rpw": int(params["rows_per_warp"]), "nbuf": int(params["nbuf"]), "dtype": mod.op.dtype}

    @staticmethod
    def instance_name(TN, R, VEC, RPW, NBUF) -> str:
        return f"spmm_window_{_SHORT[TN]}_r{R}_v{VEC}_rpw{RPW}_b{NBUF}"

    def instance(self, reduce: str, vec: int, rpw: int, nbuf: int = 2, dtype: str = "float32"):
        R, TN = _REDUCE[reduce], DTYPES[dtype].code
        return self.instance_name(TN, R, vec, rpw, nbuf), (TN, R, vec, rpw, nbuf)

    def check_arrays(self, key, params: Mapping[str, Any], arrays, meta, values=None):
        """The launches stay inside their arrays, X, Y and shared memory, and the entries rebuild
        the manifest's matrix: the compiled instances are the parameters' (rows per warp, vector
        width, buffers) for an sm_80+ arch (cp.async), the arrays have the kernel's element types, ``win_ptr`` covers ``ceil(m / W)``
        windows, every entry's ``lidx`` indexes its window's columns and rises along its row (the
        kernel's chunk scan), ``row_ids`` is a permutation of the rows."""
        m, n, nnz, K = key.rows, key.cols, key.nnz, key.K
        meta_int(meta, "m", m)
        meta_int(meta, "K", K)
        meta_equal(meta, "dtype", key.dtype)
        bad = [f"{k}={params.get(k)!r}" for k, allowed in (("vec", _vec_choices(key.dtype)), ("warps", (1, 2, 4, 8, 16)),
                                                            ("rows_per_warp", (1, 2, 4, 8)), ("nbuf", (1, 2)),
                                                            ("chunk", AtLeast(1)))
               if params.get(k) not in allowed or isinstance(params.get(k), bool)]
        if bad:
            raise ValueError(f"invalid csr.window parameters: {', '.join(bad)}")
        vec = _largest_vec(K, int(params["vec"]))
        meta_int(meta, "vec", vec)
        meta_int(meta, "arch", lo=80)
        check_instances(meta, [[nm, list(a)] for nm, a in self.instances(
            reduce=key.reduce, vec=vec, rpw=int(params["rows_per_warp"]), nbuf=int(params["nbuf"]), dtype=key.dtype)])
        W = int(params["warps"]) * int(params["rows_per_warp"])
        nwin = -(-m // W)
        for name in ("win_ptr", "ucols", "indptr", "lidx", "row_ids"):
            typed_array(arrays, name, np.int32)              # the kernel's const int* parameters
        typed_array(arrays, "data", np.float32, nnz)
        ucols = index_array(arrays, "ucols", 0, max(n, 1))
        win_ptr = pointer_array(arrays, "win_ptr", int(ucols.size), nwin + 1)
        indptr = pointer_array(arrays, "indptr", nnz, m + 1)
        lidx = index_array(arrays, "lidx", 0, 2**31 - 1, nnz)
        data = float_array(arrays, "data", nnz)
        row_ids = index_array(arrays, "row_ids", 0, max(m, 1), m)
        if m and not np.all(np.bincount(row_ids, minlength=m) == 1):
            raise ValueError("array 'row_ids' is not a permutation of the rows")
        cols = window_columns({"indptr": indptr, "win_ptr": win_ptr, "lidx": lidx, "ucols": ucols}, m, W)
        row = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
        check_entries(row_ids[row], cols, data, m, n, key.pattern, values)
