"""``tc.wmma_sgt``: TC-GNN tensor-core SpMM (Wang et al., ATC'23) on the ``tile.sgt`` layout.

One thread block per 16-row window (and slice of K); warps run WMMA on the window's condensed
TC blocks (``mod.formats["sgt"]``) against the gathered rows of X staged in shared memory; see
``tc_wmma_sgt.cu``.  Precisions: tf32 (m16n16k8, the paper's choice, any SGT block width that is a
multiple of 8), fp16 / bf16 (m16n16k16, needs 16-wide SGT blocks: ``tile.sgt[shape=fp16]``); all
accumulate in fp32.  SpMM ``sum`` (and ``mean``, by scaling the values with 1 / row length at build
time): tensor cores cannot do max/min.

The kernel works in the caller's order: SGT does not permute, and any earlier reordering is
folded in (X rows of a TC block are original column ids, output rows go to ``row_ids``).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..ir import SparseModule
from ..runtime import cuda as rt
from ..schedules.base import csr_kernel_arrays, register_template
from .templates import _NvccKernel, _NvccTemplate

__all__ = ["TcWmmaSgt", "tc_arrays", "emulate_tc_spmm", "PRECISIONS"]

#: precision name -> (kernel code, MMA k, reference.tolerance name)
PRECISIONS = {"tf32": (0, 8, "tf32"), "fp16": (1, 16, "float16"), "bf16": (2, 16, "bfloat16")}


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def tc_arrays(mod: SparseModule, precision: str = "tf32", dense_a: bool = True) -> dict[str, np.ndarray]:
    """Kernel arrays from ``mod.formats["sgt"]`` with permutations folded in:
    ``win_block_ptr`` (windows + 1), ``blk_cols`` (blocks x BW: original X row per tile column, -1
    padding), ``row_ids`` (original output row of each current row), and either ``tiles`` (dense
    16 x BW tiles in the MMA input type) or ``nz_ptr`` / ``nz_pos`` / ``nz_val`` (each block's
    nonzeros: position ``row * BW + col`` in its tile and value)."""
    fmt = mod.formats["sgt"]
    ka = csr_kernel_arrays(mod, np.int32)
    data = ka["data"].astype(np.float32)
    if mod.op.reduce == "mean":
        lens = np.diff(mod.A.indptr.astype(np.int64))
        data = (data / np.repeat(np.maximum(lens, 1), lens)).astype(np.float32)
    cols = np.asarray(fmt.block_cols, dtype=np.int64)
    if mod.col_perm is not None:
        cols = np.where(cols >= 0, np.asarray(mod.col_perm)[np.maximum(cols, 0)], -1)
    out = {"win_block_ptr": np.ascontiguousarray(fmt.win_block_ptr, dtype=np.int32),
           "blk_cols": np.ascontiguousarray(cols.reshape(-1), dtype=np.int32),
           "row_ids": np.ascontiguousarray(ka["row_ids"], dtype=np.int32)}
    BW = fmt.BLK_W
    if precision == "fp16" and data.size and float(np.abs(data).max()) > 65504.0:
        raise ValueError("matrix values exceed the fp16 range; use tf32 or bf16")
    if dense_a:
        t = fmt.dense_tiles(data, np.float32)
        if precision == "fp16":
            t = t.astype(np.float16)
        elif precision == "bf16":
            t = _bf16_bits(t)
        out["tiles"] = np.ascontiguousarray(t.reshape(-1))
    else:
        order = np.asarray(fmt.block_nnz_order, dtype=np.int64)
        pos = (np.asarray(fmt.block_row, dtype=np.int64) * BW + np.asarray(fmt.block_col, dtype=np.int64))[order]
        out["nz_ptr"] = np.ascontiguousarray(fmt.block_nnz_ptr, dtype=np.int32)
        out["nz_pos"] = np.ascontiguousarray(pos, dtype=np.uint8)
        out["nz_val"] = np.ascontiguousarray(data[order], dtype=np.float32)
    return out


def emulate_tc_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray) -> np.ndarray:
    """What the kernel computes from the uploaded ``arrays``, in float64 (for tests): per window,
    sum over its blocks of ``tile @ X[blk_cols]``, written to ``row_ids``."""
    m, BW = int(meta["m"]), int(meta["BW"])
    X = np.asarray(X, dtype=np.float64)
    K = X.shape[1]
    wbp = np.asarray(arrays["win_block_ptr"], dtype=np.int64)
    nblk = int(wbp[-1])
    if "tiles" in arrays:
        t = np.asarray(arrays["tiles"])
        t = _bf16_to_f32(t) if meta["precision"] == "bf16" else t
        tiles = t.astype(np.float64).reshape(nblk, 16, BW)
    else:
        tiles = np.zeros(nblk * 16 * BW)
        ptr = np.asarray(arrays["nz_ptr"], dtype=np.int64)
        blk = np.repeat(np.arange(nblk), np.diff(ptr))
        tiles[blk * 16 * BW + arrays["nz_pos"].astype(np.int64)] = arrays["nz_val"]
        tiles = tiles.reshape(nblk, 16, BW)
    cols = np.asarray(arrays["blk_cols"], dtype=np.int64).reshape(nblk, BW)
    Xp = np.vstack([X, np.zeros((1, K))])
    G = Xp[np.where(cols < 0, X.shape[0], cols)]                       # (nblk, BW, K)
    nwin = wbp.size - 1
    acc = np.zeros((nwin, 16, K))
    if nblk:
        np.add.at(acc, np.repeat(np.arange(nwin), np.diff(wbp)), tiles @ G)
    Y = np.zeros((m, K))
    Y[np.asarray(arrays["row_ids"], dtype=np.int64)] = acc.reshape(-1, K)[:m]
    return Y


class TcKernel(_NvccKernel):
    def prepare(self):
        import cupy

        fns = self._load_functions()
        self._fn, self._fn1 = fns[0], fns[-1]
        p, meta = self.params, self.meta
        K, m, nwin = int(meta["K"]), int(meta["m"]), int(meta["windows"])
        W, TPW = int(p["warps_per_block"]), int(p["tiles_per_warp"])
        names = ["win_block_ptr", "blk_cols", "row_ids"] + (["tiles"] if "tiles" in self.arrays
                                                             else ["nz_ptr", "nz_pos", "nz_val"])
        dev = dict(zip(names, self._upload(tuple(names))))
        z = 0
        self._args_pre = (dev["win_block_ptr"], dev["blk_cols"], dev.get("tiles", z), dev.get("nz_ptr", z),
                          dev.get("nz_pos", z), dev.get("nz_val", z), dev["row_ids"])
        self._args_post = (np.int32(m), np.int32(K))
        ktiles = -(-K // 16)
        self._grid = (max(nwin, 1), -(-ktiles // (W * TPW)), 1)
        self._block = (32 * W, 1, 1)
        self._smem = int(meta["smem_fixed"]) + W * int(meta["smem_per_warp"])
        if self._smem > 48 * 1024:
            for f in fns:
                f.max_dynamic_shared_size_bytes = self._smem
        self._empty = nwin == 0 or m == 0
        self._vec = int(meta["vec"])
        self._cupy = cupy
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x = in_ptrs[0]
        fn = self._fn1 if (self._vec > 1 and x & 15) else self._fn
        fn(self._grid, self._block, self._args_pre + (x, out_ptr) + self._args_post,
           shared_mem=self._smem, stream=rt._stream(stream))


@register_template
class TcWmmaSgt(_NvccTemplate):
    """TC-GNN (ATC'23) tensor-core SpMM on SGT row windows: WMMA tf32 m16n16k8 (fp16 / bf16
    m16n16k16 as options) with fp32 accumulation; sparse tile and gathered X rows staged in shared
    memory.  Tunable: warps per block, 16-column tiles per warp (dimension split), sparse-tile
    source (scatter into shared memory as in the paper, or dense tiles precomputed), precision."""

    name = "tc.wmma_sgt"
    version = "1"
    priority = 10
    ops = (("spmm", "sum"), ("spmm", "mean"))
    format = "sgt"
    source_file = "tc_wmma_sgt.cu"
    instance_macro = "SPC_TC_SPMM_INSTANCE"

    def requires(self, mod):
        return ("sgt",)

    def pipelines(self, mod):
        return [[{"name": "tile.sgt", "options": {"shape": "tf32"}}],
                [{"name": "tile.sgt", "options": {"shape": "fp16"}}]]

    def supports(self, mod):
        if not super().supports(mod):
            return False
        fmt = mod.formats["sgt"]
        return fmt.BLK_H == 16 and fmt.BLK_W in (8, 16) and fmt.num_blocks < 2**31 // 256

    def _precisions(self, mod) -> list[str]:
        fmt = mod.formats.get("sgt")
        bw = fmt.BLK_W if fmt is not None else 8
        return [p for p, (_, k, _) in PRECISIONS.items() if bw % k == 0]

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"warps_per_block": C([1, 2, 4, 8]), "tiles_per_warp": C([1, 2, 4]),
                "dense_a": C([0, 1]), "precision": C(["tf32", "fp16", "bf16"])}

    def default_params(self, mod):
        K = mod.op.K
        ktiles = -(-K // 16)
        tpw = 2 if ktiles >= 8 else 1
        W = max(1, min(8, -(-ktiles // tpw)))
        W = 1 << (W - 1).bit_length()
        return {"warps_per_block": min(W, 8), "tiles_per_warp": tpw, "dense_a": 1, "precision": "tf32"}

    def seed_params(self, mod):
        d = self.default_params(mod)
        seeds = [d, {**d, "dense_a": 0}]
        for tpw in (1, 2, 4):
            for W in (2, 4, 8):
                seeds.append({**d, "tiles_per_warp": tpw, "warps_per_block": W})
        for prec in self._precisions(mod):
            seeds.append({**d, "precision": prec})
        out, seen = [], set()
        for s in seeds:
            t = tuple(sorted(s.items()))
            if t not in seen:
                seen.add(t)
                out.append(s)
        return out

    @staticmethod
    def instance_name(P, BW, TPW, DENSE_A, VEC) -> str:
        return f"tc_spmm_p{P}_bw{BW}_t{TPW}_d{DENSE_A}_v{VEC}"

    def instances(self, precision: str, BW: int, tpw: int, dense_a: int, vec: int) -> list:
        P = PRECISIONS[precision][0]
        inst = [(self.instance_name(P, BW, tpw, dense_a, vec), (P, BW, tpw, dense_a, vec))]
        if vec > 1:
            inst.append((self.instance_name(P, BW, tpw, dense_a, 1), (P, BW, tpw, dense_a, 1)))
        return inst

    @staticmethod
    def smem_bytes(precision: str, BW: int, tpw: int, dense_a: int) -> tuple[int, int]:
        """(per block, per warp) dynamic shared memory, mirroring ``layout<>`` in the source."""
        size = 4 if precision == "tf32" else 2
        pad = 4 if precision == "tf32" else 8
        r128 = lambda x: -(-x // 128) * 128  # noqa: E731
        xs = r128(BW * (16 * tpw + pad) * size)
        return (0 if dense_a else r128(16 * BW * size)), xs + 16 * 16 * 4

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        if not self.supports(mod):
            raise ValueError("tc.wmma_sgt needs a 16-row SGT format (run tile.sgt first)")
        fmt = mod.formats["sgt"]
        prec = str(params["precision"])
        W, tpw, dense_a = int(params["warps_per_block"]), int(params["tiles_per_warp"]), int(params["dense_a"])
        if prec not in PRECISIONS or fmt.BLK_W % PRECISIONS[prec][1]:
            raise ValueError(f"precision {prec!r} needs an SGT block width that is a multiple of "
                             f"{PRECISIONS.get(prec, (0, '?'))[1]}, got BLK_W={fmt.BLK_W}")
        if W not in (1, 2, 4, 8, 16) or tpw not in (1, 2, 4) or dense_a not in (0, 1):
            raise ValueError(f"invalid tc.wmma_sgt parameters {params}")
        K = mod.op.K
        vec = 4 if K % 4 == 0 else 1
        arrays = tc_arrays(mod, prec, bool(dense_a))
        inst = self.instances(prec, fmt.BLK_W, tpw, dense_a, vec)
        arch = rt.device_arch()
        if arch < 80:
            raise ValueError("tc.wmma_sgt needs sm_80 or newer (tf32 / bf16 WMMA)")
        path = self.compile(inst, arch=arch, name=inst[0][0])
        fixed, per_warp = self.smem_bytes(prec, fmt.BLK_W, tpw, dense_a)
        meta = {"K": K, "m": mod.A.shape[0], "BW": fmt.BLK_W, "windows": fmt.num_windows, "vec": vec,
                "precision": prec, "tolerance_dtype": PRECISIONS[prec][2], "arch": arch,
                "smem_fixed": fixed, "smem_per_warp": per_warp,
                "instances": [[n, list(a)] for n, a in inst]}
        return TcKernel(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        return TcKernel(self.name, params, arrays, files, meta, self)
