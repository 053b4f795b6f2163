"""``aspt.tiled``: ASpT tiled SpMM (Hong et al. PPoPP'19; ASpT-RR with ``cluster.lsh``, Jiang et al.
PPoPP'20) on the ``tile.aspt`` layout (``mod.formats["aspt"]``).

Per row panel one thread block stages the X rows of the panel's dense columns in shared memory
(chunk by chunk) and reads them for every dense-tile entry; the remainder entries of the panel's
rows follow in the same block, GE-SpMM style (coalesced row caching + coarse warp merging); each
output row is written once.  See ``aspt_tiled.cu``.  SpMM ``sum`` and ``mean`` (values scaled by
1 / row length at build time).  Works in the caller's order: ``cluster.lsh`` row permutations go
to ``row_ids``, column permutations into the staged/loaded X row ids.

Pipelines offered to the tuner: ``tile.aspt`` alone and ``cluster.lsh -> tile.aspt`` (round 1
forms panels of similar rows; ASpT-RR's round 2 only reorders the remainder's processing order,
which this fused kernel does not use, so it is not offered).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..ir import SparseModule
from ..runtime import cuda as rt
from ..schedules.base import csr_kernel_arrays, register_template
from .templates import _NvccKernel, _NvccTemplate, _largest_vec

__all__ = ["AsptTiled", "aspt_arrays", "emulate_aspt_spmm"]

#: dynamic shared memory cap for the staged chunk (the H100 allows up to 227 KiB per block)
_SMEM_CAP = 96 * 1024


def aspt_arrays(mod: SparseModule) -> dict[str, np.ndarray]:
    """Kernel arrays from ``mod.formats["aspt"]`` with permutations folded in (original column
    ids, ``row_ids``) and the remainder regrouped by module row (``rem_ptr`` of length m + 1)."""
    fmt = mod.formats["aspt"]
    m = fmt.shape[0]
    ka = csr_kernel_arrays(mod, np.int32)
    cp = None if mod.col_perm is None else np.asarray(mod.col_perm, dtype=np.int64)
    mapc = (lambda c: np.asarray(c, dtype=np.int64)) if cp is None else (lambda c: cp[np.asarray(c, dtype=np.int64)])
    tile_val = np.asarray(fmt.tile_data, dtype=np.float64)
    rem_rows = np.asarray(fmt.rem_rows, dtype=np.int64)
    rem_len = np.diff(np.asarray(fmt.rem_indptr, dtype=np.int64))
    ent_row = np.repeat(rem_rows, rem_len)
    order = np.argsort(ent_row, kind="stable")        # processing order -> module-row order
    rem_val = np.asarray(fmt.rem_data, dtype=np.float64)[order]
    counts = np.zeros(m, dtype=np.int64)
    counts[rem_rows] = rem_len
    rem_ptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(counts, out=rem_ptr[1:])
    if mod.op.reduce == "mean":
        lens = np.maximum(np.diff(mod.A.indptr.astype(np.int64)), 1).astype(np.float64)
        tile_val = tile_val / np.repeat(lens, np.diff(np.asarray(fmt.tile_indptr, dtype=np.int64)))
        rem_val = rem_val / np.repeat(lens, counts)
    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    return {"dense_ptr": i32(fmt.dense_ptr), "dense_xrow": i32(mapc(fmt.dense_cols)),
            "tile_ptr": i32(fmt.tile_indptr), "tile_slot": i32(fmt.tile_slots),
            "tile_val": np.ascontiguousarray(tile_val, dtype=np.float32),
            "rem_ptr": i32(rem_ptr), "rem_col": i32(mapc(np.asarray(fmt.rem_indices)[order])),
            "rem_val": np.ascontiguousarray(rem_val, dtype=np.float32), "row_ids": i32(ka["row_ids"])}


def emulate_aspt_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray) -> np.ndarray:
    """What the kernel computes from the uploaded ``arrays``, in float64 (for tests)."""
    m, H = int(meta["m"]), int(meta["H"])
    X = np.asarray(X, dtype=np.float64)
    tp = np.asarray(arrays["tile_ptr"], dtype=np.int64)
    trow = np.repeat(np.arange(m), np.diff(tp))
    dp = np.asarray(arrays["dense_ptr"], dtype=np.int64)
    xrow = np.asarray(arrays["dense_xrow"], dtype=np.int64)[dp[trow // H] + arrays["tile_slot"]]
    Y = np.zeros((m, X.shape[1]))
    np.add.at(Y, trow, arrays["tile_val"].astype(np.float64)[:, None] * X[xrow])
    rp = np.asarray(arrays["rem_ptr"], dtype=np.int64)
    rrow = np.repeat(np.arange(m), np.diff(rp))
    np.add.at(Y, rrow, arrays["rem_val"].astype(np.float64)[:, None] * X[arrays["rem_col"].astype(np.int64)])
    out = np.zeros_like(Y)
    out[np.asarray(arrays["row_ids"], dtype=np.int64)] = Y
    return out


class AsptKernel(_NvccKernel):
    _ORDER = ("dense_ptr", "dense_xrow", "tile_ptr", "tile_slot", "tile_val", "rem_ptr", "rem_col",
              "rem_val", "row_ids")

    def prepare(self):
        fns = self._load_functions()
        self._fn, self._fn1 = fns[0], fns[-1]
        meta = self.meta
        K, m, H = int(meta["K"]), int(meta["m"]), int(meta["H"])
        self._pre = self._upload(self._ORDER)
        self._post = (np.int32(m), np.int32(K), np.int32(H), np.int32(meta["chunk"]))
        npanel = int(self.arrays["dense_ptr"].size) - 1
        self._grid = (max(npanel, 1), -(-K // int(meta["KT"])), 1)
        self._grid1 = (max(npanel, 1), -(-K // int(meta["KT1"])), 1)
        self._block = (32 * int(meta["warps"]), 1, 1)
        self._smem, self._smem1 = int(meta["smem"]), int(meta["smem1"])
        for f, s in ((self._fn, self._smem), (self._fn1, self._smem1)):
            if s > 48 * 1024:
                f.max_dynamic_shared_size_bytes = s
        self._amask = 4 * int(meta["vec"]) - 1
        self._empty = npanel == 0 or m == 0
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x = in_ptrs[0]
        args = self._pre + (x, out_ptr) + self._post
        if (x | out_ptr) & self._amask:
            self._fn1(self._grid1, self._block, args, shared_mem=self._smem1, stream=rt._stream(stream))
        else:
            self._fn(self._grid, self._block, args, shared_mem=self._smem, stream=rt._stream(stream))


@register_template
class AsptTiled(_NvccTemplate):
    """ASpT (PPoPP'19/'20) tiled SpMM: per row panel, X rows of dense columns staged in shared
    memory, remainder by CRC/CWM in the same block.  Tunable: rows per warp, CF, vector width,
    staged chunk of dense columns.  Pipelines: tile.aspt, cluster.lsh -> tile.aspt."""

    name = "aspt.tiled"
    version = "1"
    priority = 10
    ops = (("spmm", "sum"), ("spmm", "mean"))
    format = "aspt"
    source_file = "aspt_tiled.cu"
    instance_macro = "SPC_ASPT_SPMM_INSTANCE"

    def requires(self, mod):
        return ("aspt",)

    def pipelines(self, mod):
        return [[{"name": "tile.aspt", "options": {"panel_height": 32, "dense_threshold": 2}}],
                [{"name": "cluster.lsh", "options": {}},
                 {"name": "tile.aspt", "options": {"panel_height": 32, "dense_threshold": 2}}]]

    def supports(self, mod):
        if not super().supports(mod):
            return False
        return 1 <= mod.formats["aspt"].panel_height <= 256

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"rows_per_warp": C([1, 2, 4, 8]), "cf": C([1, 2, 4]), "vec": C([1, 2, 4]),
                "chunk": C([16, 32, 64, 128])}

    def default_params(self, mod):
        K = mod.op.K
        vec = _largest_vec(K, 4)
        cf = min(4, max(1, -(-K // (32 * vec))))
        cf = 1 << (cf - 1).bit_length() if cf > 1 else 1
        return {"rows_per_warp": 4, "cf": min(cf, 4), "vec": vec, "chunk": 32}

    def seed_params(self, mod):
        d = self.default_params(mod)
        seeds = [d, {**d, "rows_per_warp": 2}, {**d, "rows_per_warp": 8}, {**d, "chunk": 64},
                 {**d, "chunk": 16}, {**d, "cf": max(1, d["cf"] // 2)}, {**d, "rows_per_warp": 1}]
        out, seen = [], set()
        for s in seeds:
            t = tuple(sorted(s.items()))
            if t not in seen:
                seen.add(t)
                out.append(s)
        return out

    @staticmethod
    def instance_name(VEC, CF, RPW) -> str:
        return f"aspt_spmm_v{VEC}_cf{CF}_r{RPW}"

    def instances(self, vec: int, cf: int, rpw: int) -> list:
        inst = [(self.instance_name(vec, cf, rpw), (vec, cf, rpw))]
        if vec > 1:
            inst.append((self.instance_name(1, cf, rpw), (1, cf, rpw)))
        return inst

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        if not self.supports(mod):
            raise ValueError("aspt.tiled needs an ASpT format (run tile.aspt first)")
        rpw, cf, chunk = int(params["rows_per_warp"]), int(params["cf"]), int(params["chunk"])
        if rpw not in (1, 2, 4, 8) or cf not in (1, 2, 4) or int(params["vec"]) not in (1, 2, 4) or chunk < 1:
            raise ValueError(f"invalid aspt.tiled parameters {params}")
        fmt = mod.formats["aspt"]
        H = int(fmt.panel_height)
        warps = -(-H // rpw)
        if warps > 32:
            raise ValueError(f"panel_height {H} with rows_per_warp {rpw} needs more than 32 warps")
        K = mod.op.K
        vec = _largest_vec(K, int(params["vec"]))
        KT, KT1 = 32 * vec * cf, 32 * cf
        chunk = max(1, min(chunk, _SMEM_CAP // (KT * 4)))
        arrays = aspt_arrays(mod)
        inst = self.instances(vec, cf, rpw)
        arch = rt.device_arch()
        path = self.compile(inst, arch=arch, name=inst[0][0])
        meta = {"K": K, "m": mod.A.shape[0], "H": H, "warps": warps, "vec": vec, "KT": KT, "KT1": KT1,
                "chunk": chunk, "smem": chunk * KT * 4, "smem1": chunk * KT1 * 4, "arch": arch,
                "dense_ratio": float(fmt.dense_ratio), "instances": [[n, list(a)] for n, a in inst]}
        return AsptKernel(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        return AsptKernel(self.name, params, arrays, files, meta, self)
