"""``tc.wmma_sgt`` / ``tc.wmma_sgt_sddmm``: TC-GNN tensor-core SpMM and SDDMM (Wang et al., ATC'23)
on the ``tile.sgt`` layout, on the :class:`~spcompile.kernels.nvcc.NvccTemplate` base; arrays from
``packer.py``, numpy emulation of the kernels in ``emulate.py``.

SpMM, two implementations (parameter ``impl``, see ``tc_wmma_sgt.cu``):

* ``"mma"`` (default): register-direct ``mma.sync``; a row window's TC blocks are cut into
  balanced work items of at most ``max_blocks`` blocks (longest first, one thread block per item
  and K slice), partial 16 x K results of a split window are combined in the same launch by the
  last item to finish (fixed slot order: deterministic; ``part`` / ``counters`` workspaces).  A
  fragments are packed at build time, X rows are loaded straight into registers as 16-byte
  vectors (no shared memory, no block barriers).  Entry points ``SPC_TC_MMA_INSTANCE``.
* ``"wmma"``: the paper's scheme -- one thread block per 16-row window (and slice of K); warps run
  WMMA on the window's condensed TC blocks (``mod.formats["sgt"]``) against the gathered rows of
  X staged in shared memory.  Entry points ``SPC_TC_SPMM_INSTANCE``.

SDDMM (``tc.wmma_sgt_sddmm``, ``tc_wmma_sddmm.cu``): one warp per TC block computes the 16 x BW
block of ``X[window rows] @ Y[block columns]^T`` with ``mma.sync`` and writes ``A.data * dot`` for
the block's stored nonzeros, in the caller's nonzero order.  Precisions: tf32 (m16n16k8, the
paper's choice, any SGT block width that is a multiple of 8), fp16 / bf16 (m16n16k16, needs
16-wide SGT blocks: ``tile.sgt[shape=fp16]``); all accumulate in fp32.  SpMM ``sum`` (and
``mean``, by scaling the values with 1 / row length at build time): tensor cores cannot do
max/min.

Workload dtypes (``mod.op.dtype``): float32 (X / Y converted in registers to the chosen
precision) and float16 / bfloat16: X (and Y for SDDMM) are read as 16-bit with 16-byte loads (8
values per lane) and used as MMA operands as they are, so the precision is the input type (fp16
for float16, bf16 for bfloat16; other precisions are refused), accumulation is fp32 and the output
is written in the input dtype, rounded once (split SpMM windows add fp32 partials in a fixed order
and round the sum).  Both kernel sources include ``tc_frag.cuh`` (conversions, mma.sync wrappers,
guarded vector loads / stores), inlined by :meth:`NvccTemplate.source_text` (``headers``).

Pipelines: ``tile.sgt`` alone (16x8 and 16x16 blocks), and
:data:`spcompile.passes.recipes.WINDOW_REUSE` + ``tile.sgt``: RCM then 16-row LSH clusters, which
put rows with common neighbours in the same window (more nonzeros per gathered X row, fewer TC
blocks).

The kernels work in the caller's order: SGT does not permute, and any earlier reordering is
folded in (X rows of a TC block are original column ids, output rows go to ``row_ids``).
"""
from __future__ import annotations

import numpy as np

from ..base import (check_instances, float_array, index_array, meta_int, pointer_array, register_template,
                    unique_params)
from ..nvcc import AtLeast, LaunchSpec, NvccKernel, NvccTemplate
from .emulate import emulate_mma_spmm, emulate_tc_sddmm, emulate_tc_spmm, round_to  # noqa: F401 (public here too)
from .packer import (INPUT_PRECISION, PRECISIONS, input_type, mma_arrays, sddmm_arrays,  # noqa: F401
                     split_windows, tc_arrays)

__all__ = ["TcWmmaSgt", "TcWmmaSgtSddmm", "TcKernel", "TcSddmmKernel", "tc_arrays", "emulate_tc_spmm",
           "mma_arrays", "emulate_mma_spmm", "split_windows", "sddmm_arrays", "emulate_tc_sddmm", "PRECISIONS",
           "INPUT_PRECISION", "input_type", "round_to"]


def _vec(K: int, ti: int) -> int:
    """Elements per 16-byte vector load when K allows it (fp32: 4, 16-bit: 8), else 1."""
    w = 8 if ti else 4
    return w if K % w == 0 else 1


def _pow2_at_most(x: int, hi: int) -> int:
    x = max(1, min(int(x), hi))
    return 1 << (x.bit_length() - 1) if x & (x - 1) else x


#: the precisions the search offers for float32 inputs ("3xtf32": split tf32, fp32-level results,
#: only where a template implements it)
SEARCH_PRECISIONS = ("3xtf32", "tf32", "fp16", "bf16")


def _allowed_precisions(dtype: str, search: bool = True, split: bool = True) -> list[str]:
    """The precisions offered for a workload dtype: a 16-bit input's own, or (float32) those of
    the search, or with ``search=False`` every one the kernels implement; ``split=False`` leaves
    split tf32 out (a template without it)."""
    if dtype in INPUT_PRECISION:
        return [INPUT_PRECISION[dtype]]
    return [p for p in PRECISIONS if (not search or p in SEARCH_PRECISIONS) and (split or p != "3xtf32")]


def _default_precision(dtype: str) -> str:
    """A default configuration's precision: the input's own (16-bit), else plain tf32 (the
    precision policy decides whether a build may use it; split tf32 is a separate choice)."""
    return next(p for p in _allowed_precisions(dtype) if p != "3xtf32")


class _SgtTemplate(NvccTemplate):
    """What both tc templates share: the 16-row SGT format, sm_80+, the precision policy (16-bit
    inputs run in their own precision; fp16 / bf16 need 16-wide blocks), X / Y vectors of 16
    bytes when K allows (VEC = 1 fallback instance otherwise and for unaligned calls)."""

    precision_param = "precision"
    dtypes = ("float32", "float16", "bfloat16")
    priority = 10
    format = "sgt"
    headers = ("tc_frag.cuh",)   # shared by tc_wmma_sgt.cu and tc_wmma_sddmm.cu
    fallback_param = "vec"
    min_arch = 80                # tf32 / bf16 tensor cores
    #: the block width :meth:`_precisions` assumes before tile.sgt ran
    _bw_before_tiling = 16

    _allowed_precisions = staticmethod(_allowed_precisions)
    #: the kernel implements precision "3xtf32" (impl "mma" of the SpMM)
    split_tf32 = False

    def requires(self, mod):
        return ("sgt",)

    def supports(self, mod):
        if not super().supports(mod):
            return False
        fmt = mod.formats["sgt"]
        bws = (16,) if mod.op.dtype != "float32" else (8, 16)
        return fmt.BLK_H == 16 and fmt.BLK_W in bws and fmt.num_blocks < 2**31 // 256

    def _precisions(self, mod, search: bool = True) -> list[str]:
        """The allowed precisions whose MMA k divides the module's SGT block width (``search``:
        only those the search offers; else every one this template implements)."""
        fmt = mod.formats.get("sgt")
        bw = fmt.BLK_W if fmt is not None else self._bw_before_tiling
        return [p for p in self._allowed_precisions(mod.op.dtype, search) if bw % PRECISIONS[p].mma_k == 0
                and (p != "3xtf32" or self.split_tf32)]

    def check_params(self, mod, params):
        full = super().check_params(mod, params)
        input_type(mod.op.dtype, str(full["precision"]))     # 16-bit inputs: their own precision only
        return full

    def validate(self, mod, params):
        if mod.op.dtype in self.dtypes and not self.supports(mod):
            raise ValueError(f"{self.name} needs a 16-row SGT format (run tile.sgt first; 16-bit inputs need "
                             "16-wide blocks: tile.sgt[shape=fp16])")
        super().validate(mod, params)

    def checks(self, mod):
        return {"precision": self._precisions(mod, search=False)}

    def _check_common(self, key, params, meta) -> tuple[int, int]:
        """The saved meta against the workload and params: rows, K, dtype, the block width and
        the instances' precision / block width / input type.  Returns ``(BW, windows)``."""
        meta_int(meta, "m", key.rows)
        meta_int(meta, "K", key.K)
        if meta.get("dtype") != key.dtype:
            raise ValueError(f"kernel meta 'dtype' must be {key.dtype!r}, got {meta.get('dtype')!r}")
        prec = params.get("precision")
        if meta.get("precision") != prec or prec not in PRECISIONS:
            raise ValueError(f"kernel meta 'precision' must be the params' {prec!r}, got {meta.get('precision')!r}")
        BW = meta_int(meta, "BW")
        if BW not in (8, 16) or BW % PRECISIONS[prec].mma_k:
            raise ValueError(f"kernel meta 'BW' must be 8 or 16 and a multiple of the MMA k, got {BW}")
        check_instances(meta, [[nm, list(a)] for nm, a in self.instances(
            **self._instance_args_of(key.K, key.dtype, BW, params))])
        return BW, -(-key.rows // 16)

    def _common_args(self, mod, params) -> dict:
        return self._args_of(mod.op.K, mod.op.dtype, int(mod.formats["sgt"].BLK_W), params)

    @staticmethod
    def _args_of(K: int, dtype: str, BW: int, params) -> dict:
        prec = str(params["precision"])
        ti = input_type(dtype, prec)
        return {"precision": prec, "BW": BW, "vec": _vec(K, ti), "ti": ti}

    def instance_args(self, mod, params):
        return self._instance_args_of(mod.op.K, mod.op.dtype, int(mod.formats["sgt"].BLK_W), params)

    def _instance_args_of(self, K: int, dtype: str, BW: int, params) -> dict:
        """The instance arguments of ``params`` for a workload of width ``K`` and ``dtype`` on
        ``BW``-wide blocks (what :meth:`instance_args` gives for a built module; a saved
        kernel's instances are checked against it)."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------
# tc.wmma_sgt -- SpMM
# ------------------------------------------------------------------------------------------
class TcKernel(NvccKernel):
    """Launch of ``tc_wmma_sgt.cu``.  impl "wmma": one block per window and slice of 16-column
    tiles, shared memory for the staged tile / X rows, only X read with vector loads; impl "mma":
    one block per work item and column slice, split windows combine through ``part`` /
    ``counters``, X and Y read / written with vectors."""

    inputs, output = ("X",), "Y"

    @property
    def impl(self) -> str:
        return str(self.meta.get("impl", "wmma"))

    @property
    def aligned(self):
        return ("X",) if self.impl == "wmma" else ("X", "Y")

    def _mma_slices(self) -> int:
        """Column slices (grid.y) of impl "mma": SPAN columns per column group and warp."""
        p = self.params
        span = int(self.meta.get("span", 32))
        return -(-int(self.meta["K"]) // (span * int(p["col_groups"]) * int(p["warps_per_block"])))

    def workspaces(self):
        if self.impl == "wmma":
            return {}
        K, W = int(self.meta["K"]), int(self.params["warps_per_block"])
        ngrp = int(self.arrays["grp_ptr"].size) - 1
        return {"part": (int(self.arrays["slot_grp"].size) * 16 * K, "float32"),   # fp32 partials
                "counters": (ngrp * self._mma_slices() * W, "int32")}

    def launch_spec(self, vec):
        p, meta = self.params, self.meta
        K, m, W = int(meta["K"]), int(meta["m"]), int(p["warps_per_block"])
        scalars = {"m": m, "K": K}
        if self.impl == "mma":
            nitems = int(self.arrays["items"].shape[0])
            return LaunchSpec(grid=(max(nitems, 1), self._mma_slices(), 1), block=(32 * W, 1, 1), args=scalars)
        ktiles = -(-K // 16)
        smem = int(meta["smem_fixed"]) + W * int(meta["smem_per_warp"])
        # the tile source not uploaded (dense tiles or the blocks' nonzeros) is passed as null
        null = {n: 0 for n in ("tiles", "nz_ptr", "nz_pos", "nz_val") if n not in self.arrays}
        return LaunchSpec(grid=(max(int(meta["windows"]), 1), -(-ktiles // (W * int(p["tiles_per_warp"]))), 1),
                          block=(32 * W, 1, 1), smem=smem, args={**null, **scalars})

    def empty(self):
        m = int(self.meta["m"])
        if self.impl == "mma":
            return int(self.arrays["items"].shape[0]) == 0 or m == 0
        return int(self.meta["windows"]) == 0 or m == 0


@register_template
class TcWmmaSgt(_SgtTemplate):
    """TC-GNN (ATC'23) tensor-core SpMM on SGT row windows: tf32 m16n8k8 / m16n16k8 (fp16 / bf16
    m16n8k16 / m16n16k16 as options) with fp32 accumulation.  impl "mma": register-direct
    mma.sync with balanced work items (windows split into runs of at most ``max_blocks`` TC
    blocks; tunable: warps per block, column groups per warp, blocks in flight per warp);
    impl "wmma": the paper's scheme (sparse tile and gathered X rows staged in shared memory;
    tunable: warps per block, 16-column tiles per warp, sparse-tile source).  X / Y in float32
    (converted to the MMA precision in registers) or float16 / bfloat16 (X loaded as 16-bit and
    used as the MMA operand directly, precision = the input type, fp32 accumulation, Y rounded
    once; split windows combine fp32 partials).  Precision "3xtf32" (impl "mma", float32 inputs):
    split tf32 -- A packed as tf32 hi + lo fragments, X split in registers, three tf32 MMAs per
    product -- for fp32-level results (admitted by the default fp32 precision policy)."""

    name = "tc.wmma_sgt"
    version = "4"
    ops = (("spmm", "sum"), ("spmm", "mean"))
    source_file = "tc_wmma_sgt.cu"
    instance_macro = "SPC_TC_SPMM_INSTANCE"      # impl "wmma"
    mma_instance_macro = "SPC_TC_MMA_INSTANCE"   # impl "mma"
    kernel_class = TcKernel
    _bw_before_tiling = 8
    split_tf32 = True

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"impl": C(["mma", "wmma"]), "warps_per_block": C([1, 2, 4, 8]), "col_groups": C([1, 2, 4]),
                "unroll": C([1, 2, 4]), "max_blocks": C([0, 8, 32, 128]), "tiles_per_warp": C([1, 2, 4]),
                "dense_a": C([0, 1]), "precision": C(self._allowed_precisions(mod.op.dtype, split=self.split_tf32))}

    @staticmethod
    def _span(dtype: str) -> int:
        """Output columns per column group of impl "mma": 32 (fp32 X), 64 (16-bit X)."""
        return 32 if dtype == "float32" else 64

    @staticmethod
    def _mma_shape(K: int, span: int = 32) -> tuple[int, int]:
        groups = -(-K // span)
        cg = 1 if groups <= 8 else 2
        return cg, _pow2_at_most(-(-groups // cg), 8)

    @staticmethod
    def _wmma_shape(K: int) -> tuple[int, int]:
        ktiles = -(-K // 16)
        tpw = 2 if ktiles >= 8 else 1
        W = max(1, min(8, -(-ktiles // tpw)))
        return tpw, min(1 << (W - 1).bit_length(), 8)

    def default_params(self, mod):
        K = mod.op.K
        tpw, _ = self._wmma_shape(K)
        cg, wm = self._mma_shape(K, self._span(mod.op.dtype))
        return {"impl": "mma", "warps_per_block": wm, "col_groups": cg, "unroll": 4 if cg == 1 else 2,
                "max_blocks": 32, "tiles_per_warp": tpw, "dense_a": 1,
                "precision": _default_precision(mod.op.dtype)}

    def _defaults(self, mod):
        d = self.default_params(mod)
        return d, {**d, "impl": "wmma", "warps_per_block": self._wmma_shape(mod.op.K)[1]}

    def seed_params(self, mod):
        d, dw = self._defaults(mod)
        K = mod.op.K
        groups = -(-K // self._span(mod.op.dtype))
        seeds = [d]
        for mb in (0, 8, 128):
            seeds.append({**d, "max_blocks": mb})
        seeds += [{**d, "unroll": 1}, {**d, "unroll": 2}]
        if groups >= 2:
            cg2 = 2 if d["col_groups"] == 1 else 1
            seeds.append({**d, "col_groups": cg2, "unroll": 1 if cg2 == 2 else 4,
                          "warps_per_block": _pow2_at_most(-(-groups // cg2), 8)})
        for prec in self._precisions(mod):
            seeds.append({**d, "precision": prec})
        seeds += [dw, {**dw, "dense_a": 0}]
        return unique_params(seeds)

    # -- checks ------------------------------------------------------------------------------
    def checks(self, mod):
        # warps_per_block 16 only for impl "wmma" (see validate)
        return {**super().checks(mod), "impl": ("mma", "wmma"), "warps_per_block": (1, 2, 4, 8, 16),
                "col_groups": (1, 2, 4), "unroll": (1, 2, 4), "max_blocks": AtLeast(0),
                "tiles_per_warp": (1, 2, 4), "dense_a": (0, 1)}

    def validate(self, mod, params):
        super().validate(mod, params)
        if params["impl"] != "mma":
            if params["precision"] == "3xtf32":
                raise ValueError(f"invalid {self.name} parameters: precision '3xtf32' runs with impl 'mma' only")
            return
        if int(params["warps_per_block"]) > 8:
            raise ValueError(f"invalid {self.name} parameters: warps_per_block={params['warps_per_block']} "
                             "(impl 'mma' runs at most 8 warps per block)")
        a = self._common_args(mod, params)
        if not self.mma_ok(a["precision"], a["BW"], int(params["col_groups"]), int(params["unroll"]), a["ti"]):
            raise ValueError(f"col_groups x unroll too large for {a['precision']} with {a['BW']}-wide blocks "
                             f"and {mod.op.dtype} inputs (registers would spill)")

    @staticmethod
    def mma_ok(precision: str, BW: int, cg: int, unroll: int, ti: int = 0) -> bool:
        """Register budget: 16-byte X vectors in flight per lane (CG x U x k-steps x rows) <= 16;
        16-bit X (8 n-tiles per column group, 32 accumulators each): at most 2 column groups."""
        KS = PRECISIONS[precision].mma_k
        nr = 2 if PRECISIONS[precision].mma_k == 8 else 4
        return cg * unroll * (BW // KS) * nr <= 16 and (not ti or cg <= 2)

    @staticmethod
    def smem_bytes(precision: str, BW: int, tpw: int, dense_a: int) -> tuple[int, int]:
        """(per block, per warp) dynamic shared memory of impl "wmma", mirroring ``layout<>``."""
        size = 4 if precision == "tf32" else 2
        pad = 4 if precision == "tf32" else 8
        r128 = lambda x: -(-x // 128) * 128  # noqa: E731
        xs = r128(BW * (16 * tpw + pad) * size)
        return (0 if dense_a else r128(16 * BW * size)), xs + 16 * 16 * 4

    # -- arrays, instances, meta -------------------------------------------------------------
    def pack(self, mod, params):
        prec = str(params["precision"])
        if params["impl"] == "mma":
            return mma_arrays(mod, prec, int(params["max_blocks"]))
        return tc_arrays(mod, prec, bool(int(params["dense_a"])))

    def check_arrays(self, key, params, arrays, meta, values=None):
        """Bounds of every index the kernels follow (X rows, output rows, blocks, tiles, slots)
        and sizes that match the block count; what is in bounds but altered is the signature's
        to catch (the dense A tiles do not say which zeros are stored entries)."""
        BW, nwin = self._check_common(key, params, meta)
        m, n = key.rows, key.cols
        impl = meta.get("impl")
        if impl != params.get("impl") or impl not in ("mma", "wmma"):
            raise ValueError(f"kernel meta 'impl' must be the params' {params.get('impl')!r}, got {impl!r}")
        row_ids = index_array(arrays, "row_ids", 0, max(m, 1), m)
        if m and not np.all(np.bincount(row_ids, minlength=m) == 1):
            raise ValueError("array 'row_ids' is not a permutation of the rows")
        prec = str(params["precision"])
        if impl == "mma":
            KS = PRECISIONS[prec].mma_k
            pcols = index_array(arrays, "pcols", -1, max(n, 1))
            if pcols.size % BW:
                raise ValueError(f"array 'pcols' must hold whole blocks of {BW} columns, got {pcols.size}")
            nblk = pcols.size // BW
            per_lane = 4 if KS == 8 else 8                              # values per 16-byte fragment
            frags = nblk * (BW // KS) * 32 * per_lane * (2 if prec == "3xtf32" else 1)
            afrag = float_array(arrays, "afrag", frags)
            if afrag.dtype.itemsize * per_lane != 16:
                raise ValueError(f"array 'afrag' must hold 16-byte fragments, got {afrag.dtype}")
            items = index_array(arrays, "items", -1, 2**31, ndim=2)
            if items.shape[1:] != (4,):
                raise ValueError(f"array 'items' must be (n, 4), got {list(items.shape)}")
            slot_grp = index_array(arrays, "slot_grp", 0, 2**31)
            grp_ptr = pointer_array(arrays, "grp_ptr", slot_grp.size)
            if slot_grp.size and int(slot_grp.max()) >= grp_ptr.size - 1:
                raise ValueError(f"array 'slot_grp' holds values outside [0, {grp_ptr.size - 1})")
            lo, hi, win, slot = items.T
            if items.size and (lo.min() < 0 or np.any(hi < lo) or hi.max() > nblk or win.min() < 0
                               or win.max() >= max(nwin, 1) or slot.max() >= slot_grp.size):
                raise ValueError(f"array 'items' holds a block range outside [0, {nblk}], a window outside "
                                 f"[0, {nwin}) or a slot outside [-1, {slot_grp.size})")
            if items.size and np.bincount(slot[slot >= 0], minlength=slot_grp.size).tolist() != [1] * slot_grp.size:
                raise ValueError("array 'items' must name every partial-result slot exactly once")
            meta_int(meta, "items", items.shape[0])
            meta_int(meta, "slots", slot_grp.size)
            meta_int(meta, "span", self._span(key.dtype))
            return
        win_ptr = index_array(arrays, "win_block_ptr", 0, 2**31)
        blk_cols = index_array(arrays, "blk_cols", -1, max(n, 1))
        if blk_cols.size % BW:
            raise ValueError(f"array 'blk_cols' must hold whole blocks of {BW} columns, got {blk_cols.size}")
        nblk = blk_cols.size // BW
        pointer_array(arrays, "win_block_ptr", nblk, meta_int(meta, "windows") + 1)
        if win_ptr.size - 1 > max(nwin, 1):
            raise ValueError(f"kernel meta 'windows' must be at most {nwin}")
        fixed, per_warp = self.smem_bytes(prec, BW, int(params["tiles_per_warp"]), int(params["dense_a"]))
        meta_int(meta, "smem_fixed", fixed)
        meta_int(meta, "smem_per_warp", per_warp)
        if int(params["dense_a"]):
            float_array(arrays, "tiles", nblk * 16 * BW)
        else:
            nz_pos = index_array(arrays, "nz_pos", 0, 16 * BW)
            pointer_array(arrays, "nz_ptr", nz_pos.size, nblk + 1)
            float_array(arrays, "nz_val", nz_pos.size)

    def _instance_args_of(self, K, dtype, BW, params):
        a = self._args_of(K, dtype, BW, params)
        if params["impl"] == "mma":
            return {**a, "impl": "mma", "cg": int(params["col_groups"]), "unroll": int(params["unroll"])}
        return {**a, "impl": "wmma", "tpw": int(params["tiles_per_warp"]), "dense_a": int(params["dense_a"])}

    @staticmethod
    def instance_name(P, BW, TPW, DENSE_A, VEC, TI=0) -> str:
        return f"tc_spmm_p{P}_bw{BW}_t{TPW}_d{DENSE_A}_v{VEC}" + ("_x16" if TI else "")

    @staticmethod
    def mma_instance_name(P, BW, CG, U, VEC, TI=0) -> str:
        return f"tc_mma_p{P}_bw{BW}_c{CG}_u{U}_v{VEC}" + ("_x16" if TI else "")

    def instance(self, precision: str, BW: int, tpw: int = 1, dense_a: int = 1, vec: int = 1, ti: int = 0,
                 impl: str = "wmma", cg: int = 1, unroll: int = 1):
        """impl "wmma": ``(precision, BW, tpw, dense_a, vec, ti)``; impl "mma": ``(precision, BW,
        vec=, ti=, cg=, unroll=)`` (see :meth:`mma_instances`)."""
        P = PRECISIONS[precision].code
        if impl == "mma":
            return self.mma_instance_name(P, BW, cg, unroll, vec, ti), (P, BW, cg, unroll, vec, ti)
        if impl != "wmma":
            raise ValueError(f"{self.name}: unknown impl {impl!r}")
        return self.instance_name(P, BW, tpw, dense_a, vec, ti), (P, BW, tpw, dense_a, vec, ti)

    def mma_instances(self, precision: str, BW: int, cg: int, unroll: int, vec: int, ti: int = 0) -> list:
        """The impl "mma" instance (and its VEC = 1 fallback)."""
        return self.instances(precision, BW, vec=vec, ti=ti, impl="mma", cg=cg, unroll=unroll)

    def instance_macro_of(self, name: str) -> str:
        return self.mma_instance_macro if name.startswith("tc_mma") else self.instance_macro

    def extra_meta(self, mod, params, arrays):
        fmt = mod.formats["sgt"]
        meta = {"BW": fmt.BLK_W, "windows": fmt.num_windows, "precision": str(params["precision"]),
                "impl": str(params["impl"])}
        if params["impl"] == "mma":
            return {**meta, "items": int(arrays["items"].shape[0]), "slots": int(arrays["slot_grp"].size),
                    "span": self._span(mod.op.dtype)}
        fixed, per_warp = self.smem_bytes(str(params["precision"]), fmt.BLK_W, int(params["tiles_per_warp"]),
                                          int(params["dense_a"]))
        return {**meta, "smem_fixed": fixed, "smem_per_warp": per_warp}


# ------------------------------------------------------------------------------------------
# tc.wmma_sgt_sddmm
# ------------------------------------------------------------------------------------------
class TcSddmmKernel(NvccKernel):
    """Launch of ``tc_wmma_sddmm.cu``: a warp per TC block; X and Y are read with vector loads."""

    inputs, output = ("X", "Y"), "out"
    aligned = ("X", "Y")

    def launch_spec(self, vec):
        nblk, W = int(self.arrays["blk_win"].size), int(self.params["warps_per_block"])
        return LaunchSpec(grid=(max(1, -(-nblk // W)), 1, 1), block=(32 * W, 1, 1),
                          args={"nblk": nblk, "m": int(self.meta["m"]), "K": int(self.meta["K"])})

    def empty(self):
        return self.arrays["blk_win"].size == 0


@register_template
class TcWmmaSgtSddmm(_SgtTemplate):
    """TC-GNN (ATC'23) tensor-core SDDMM on SGT blocks: per TC block the 16 x BW block of
    X[window rows] @ Y[block columns]^T with mma.sync (tf32 m16n8k8; fp16 / bf16 m16n8k16 as
    options; fp32 accumulate), sampled at the block's stored nonzeros and scaled by A's values,
    written in the caller's nonzero order.  Tunable: warps per block, feature chunks in flight,
    precision; the SGT block width comes from the pipeline (16x16 as the paper, or 16x8).  X / Y /
    output in float32 or float16 / bfloat16 (16-bit: the loaded values are the MMA operands,
    precision = the input type, 64-feature chunks, each output rounded once)."""

    name = "tc.wmma_sgt_sddmm"
    version = "2"
    ops = (("sddmm", None),)
    source_file = "tc_wmma_sddmm.cu"
    instance_macro = "SPC_TC_SDDMM_INSTANCE"
    kernel_class = TcSddmmKernel

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"warps_per_block": C([2, 4, 8]), "k_unroll": C([1, 2]),
                "precision": C(self._allowed_precisions(mod.op.dtype, split=self.split_tf32))}

    def default_params(self, mod):
        chunk = 32 if mod.op.dtype == "float32" else 64
        return {"warps_per_block": 4, "k_unroll": 2 if mod.op.K > chunk else 1,
                "precision": _default_precision(mod.op.dtype)}

    def seed_params(self, mod):
        d = self.default_params(mod)
        seeds = [d, {**d, "k_unroll": 3 - d["k_unroll"]}, {**d, "warps_per_block": 8}, {**d, "warps_per_block": 2}]
        seeds += [{**d, "precision": p} for p in self._precisions(mod)]
        return unique_params(seeds)

    def checks(self, mod):
        return {**super().checks(mod), "warps_per_block": (1, 2, 4, 8), "k_unroll": (1, 2)}

    def pack(self, mod, params):
        return sddmm_arrays(mod)

    def check_arrays(self, key, params, arrays, meta, values=None):
        """Bounds of every index the kernel follows; the outputs are a permutation of the entries."""
        BW, nwin = self._check_common(key, params, meta)
        m, n, nnz = key.rows, key.cols, key.nnz
        meta_int(meta, "nnz", nnz)
        index_array(arrays, "row_ids", 0, max(m, 1), m)
        blk_win = index_array(arrays, "blk_win", 0, max(nwin, 1))
        index_array(arrays, "blk_cols", -1, max(n, 1), blk_win.size * BW)
        nz_pos = index_array(arrays, "nz_pos", 0, 16 * BW, nnz)
        pointer_array(arrays, "nz_ptr", nz_pos.size, blk_win.size + 1)
        float_array(arrays, "nz_val", nnz)
        nz_out = index_array(arrays, "nz_out", 0, max(nnz, 1), nnz)
        if nnz and not np.all(np.bincount(nz_out, minlength=nnz) == 1):
            raise ValueError("array 'nz_out' is not a permutation of the stored entries")

    def _instance_args_of(self, K, dtype, BW, params):
        a = self._args_of(K, dtype, BW, params)
        return {"precision": a["precision"], "BW": a["BW"], "ku": int(params["k_unroll"]), "vec": a["vec"],
                "ti": a["ti"]}

    @staticmethod
    def instance_name(P, BW, KU, VEC, TI=0) -> str:
        return f"tc_sddmm_p{P}_bw{BW}_k{KU}_v{VEC}" + ("_x16" if TI else "")

    def instance(self, precision: str, BW: int, ku: int, vec: int, ti: int = 0):
        P = PRECISIONS[precision].code
        return self.instance_name(P, BW, ku, vec, ti), (P, BW, ku, vec, ti)

    def extra_meta(self, mod, params, arrays):
        return {"nnz": int(mod.A.nnz), "BW": mod.formats["sgt"].BLK_W, "precision": str(params["precision"])}
