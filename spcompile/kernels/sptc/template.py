"""``sptc.vnm``: Sparse-Tensor-Core SpMM (``mma.sp`` m16n8k32, 2:4) after ``reorder.vnm`` (SOGRE, PPoPP'25).

After the SOGRE reordering most 4-column segment vectors of the matrix hold at most 2 entries, i.e.
the matrix (nearly) conforms to 2:4.  This template packs the reordered matrix into the operand form
of ``mma.sp.sync.aligned.m16n8k32.row.col.f32.{f16,bf16}.{f16,bf16}.f32`` and runs it on the
sparse tensor cores with fp32 accumulation (``sptc_vnm.cu``):

* the rows are cut into 16-row windows and the columns into 32-column blocks; only the nonempty
  (window, block) **tiles** are stored (block-CSR ``win_ptr`` over windows, sorted by block);
* per tile and row, each 4-column chunk keeps its first two entries (in column order): the
  compressed 16 x 16 values, already laid out as each lane's A fragment (``frag``: 32 lanes x 8
  fp16 / bf16 values), and the 2-bit positions of the kept values as the lanes' metadata words
  (``meta``: 16 uint32 per tile, the word of lane ``4g + t`` for ``t < 2``, sparsity selector 0);
* ``cols``: 32 original X rows per tile (``col_perm`` folded in; -1 for columns that no kept entry
  of the tile uses, so the kernel loads no X row for them);
* **lossless remainder**: entries beyond the first two of a chunk (segment vectors that still
  violate 2:4 after reordering) go to a CSR remainder in the caller's order (``rem_ptr``,
  ``rem_rows``, ``rem_cols``, ``rem_vals``: fp32), added by a CUDA-core kernel launched after the
  tensor-core kernel on the same stream.  Nothing is pruned: the output equals A @ X up to the
  fp16 / bf16 rounding of A's values and of X (fp32 accumulation).

Metadata bit order (PTX ISA, "sparse matrix storage" and the m16n8k32 f16/bf16 metadata figure):
each chunk of 4 columns contributes a nibble ``idx0 | idx1 << 2`` with ``idx0 < idx1`` (the
positions of its two stored values; a chunk with fewer entries stores zeros at unused positions);
with selector 0 the threads ``t = 0, 1`` of each quad ``g`` supply the metadata: thread ``t``
holds the chunks of columns ``16t .. 16t + 15`` of row ``g`` in bits 0..15 (chunk ``4t + q`` at bits
``4q``) and those of row ``g + 8`` in bits 16..31 (``META_LAYOUT = "split16"``).  The alternative
reading (``"rowwise"``: thread 0 = all of row g, thread 1 = row g + 8) is kept for the GPU probe
test, which checks the layout against numpy on a random dense 2:4 tile.

The kernel works in the caller's order (row_ids / col_perm folded into the arrays).  SpMM ``sum``
and ``mean`` (values scaled by 1 / row length at build time); tensor cores cannot do max / min.
The arrays are built in ``packer.py``, the numpy emulation of the kernels is ``emulate.py``.
"""
from __future__ import annotations

import numpy as np

from ...core.numerics import DTYPES, NATIVE_PRECISION
from ..base import register_template, unique_params
from ..nvcc import AtLeast, LaunchSpec, NvccKernel, NvccTemplate
from .emulate import decode_tiles, emulate_sptc_spmm  # noqa: F401 (public here too)
from .packer import (META_LAYOUT, PACKS, PRECISIONS, condense_windows, fragment_index,  # noqa: F401
                     pack_arrays, sptc_arrays)

__all__ = ["SptcVnm", "SptcKernel", "sptc_arrays", "pack_arrays", "condense_windows", "PACKS", "emulate_sptc_spmm",
           "decode_tiles", "META_LAYOUT", "PRECISIONS", "ELEMS", "fragment_index", "precisions_for"]

#: X / Y element type -> kernel code E; a 16-bit workload computes in its own precision only
ELEMS = {d: DTYPES[d].code for d in ("float32", "float16", "bfloat16")}
_SUFFIX = {0: "_kernel", 1: "_h", 2: "_b"}    # helper kernels per E


def precisions_for(dtype: str) -> list[str]:
    """Operand precisions a ``dtype`` workload may use: fp32 X is converted to either in registers;
    16-bit X is used as loaded, so only its own precision."""
    return [NATIVE_PRECISION[dtype]] if dtype in NATIVE_PRECISION else list(PRECISIONS)


class SptcKernel(NvccKernel):
    """The launches of one call on its stream: the split windows' rows zeroed (fp32 Y) or their
    fp32 scratch (16-bit Y), the instance over the work items (blockIdx.x) and 8 * NT * W-column
    slabs (blockIdx.y), the scratch finished into Y (16-bit), the CSR remainder added."""

    inputs, output = ("X",), "Y"

    def _sizes(self) -> tuple[int, int, int, int]:
        a = self.arrays
        return int(self.meta["K"]), int(a["items"].size) // 4, int(a["zero_rows"].size), int(a["rem_rows"].size)

    def workspaces(self):
        K, _, nz, _ = self._sizes()
        E = ELEMS[self.meta.get("dtype", "float32")]
        # 16-bit builds: the split windows add into fp32 rows, converted into Y once (fp32: unused)
        return {"S": (nz * K if E else 0, "float32")}

    def launch_spec(self, vec):
        K, nitems, nz, nrem = self._sizes()
        W, NT = int(self.params["warps_per_block"]), int(self.params["slabs_per_warp"])
        E = ELEMS[self.meta.get("dtype", "float32")]
        sfx = _SUFFIX[E]
        zgrid, blk = (max(1, min(1024, -(-nz * K // 256))), 1, 1), (256, 1, 1)
        main = LaunchSpec((max(nitems, 1), -(-K // (8 * NT * W)), 1), (32 * W, 1, 1),
                          args={"m": int(self.meta["m"]), "K": K})
        out = [main]
        if nz and E == 0:
            out.insert(0, LaunchSpec(zgrid, blk, args={"nrows": nz, "K": K}, entry="sptc_zero_rows",
                                     bind={"rows": "zero_rows"}))
        elif nz:
            out.insert(0, LaunchSpec(zgrid, blk, args={"nrows": nz, "K": K}, entry="sptc_zero_scratch"))
            out.append(LaunchSpec(zgrid, blk, args={"nrows": nz, "K": K}, entry="sptc_finish" + sfx,
                                  bind={"rows": "zero_rows"}))
        if nrem:
            out.append(LaunchSpec((-(-nrem // 8), -(-K // 128), 1), blk, args={"nrows": nrem, "K": K},
                                  entry="sptc_remainder" + sfx))
        return out

    def empty(self):
        K, nitems, _, _ = self._sizes()
        return int(self.meta["m"]) == 0 or K == 0 or nitems == 0


@register_template
class SptcVnm(NvccTemplate):
    """SOGRE (PPoPP'25) sparse-tensor-core SpMM: 2:4 tiles on mma.sp m16n8k32 (fp16 / bf16 operands,
    fp32 accumulation).  Two packings: ``block`` (the 32-column blocks of the reordered matrix, after
    reorder.vnm, + a lossless CUDA-core CSR remainder) and ``condensed`` (per 16-row window the
    distinct columns, grouped 2:4 by construction; best after a locality order such as reorder.rcm).
    Tunable: packing, warps per block, 8-column output slabs per warp, tiles per work item (split),
    precision."""

    name = "sptc.vnm"
    precision_param = "precision"
    version = "3"
    priority = 9
    ops = (("spmm", "sum"), ("spmm", "mean"))
    #: X / Y: fp32 (converted to the operand precision in registers) or fp16 / bf16 (used as loaded:
    #: half the gather bytes; the operand precision is then the input's), fp32 accumulation
    dtypes = ("float32", "float16", "bfloat16")
    format = "vnm"
    source_file = "sptc_vnm.cu"
    instance_macro = "SPC_SPTC_INSTANCE"
    kernel_class = SptcKernel
    min_arch = 80                                  # mma.sp
    entry_points = ("sptc_zero_rows", "sptc_zero_scratch", "sptc_remainder_kernel", "sptc_remainder_h",
                    "sptc_remainder_b", "sptc_finish_h", "sptc_finish_b")

    def requires(self, mod):
        return ("vnm",)

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"pack": C(list(PACKS)), "warps_per_block": C([1, 2, 4, 8]), "slabs_per_warp": C([1, 2, 4, 8]),
                "split": C([0, 2, 4, 8, 32]), "precision": C(precisions_for(mod.op.dtype))}

    def default_params(self, mod):
        K = mod.op.K
        slabs = -(-K // 8)
        NT = 4 if slabs >= 4 else (2 if slabs >= 2 else 1)
        W = max(1, min(8, -(-slabs // NT)))
        W = 1 << (W - 1).bit_length()
        return {"pack": "condensed", "warps_per_block": min(W, 8), "slabs_per_warp": NT, "split": 8,
                "precision": precisions_for(mod.op.dtype)[0]}

    def seed_params(self, mod):
        d = self.default_params(mod)
        # measured on the H100 (the retired sptc benchmark): split 8 or 32 wins (32 on power-law graphs with
        # hub windows, 0 on small meshes); split 2 loses everywhere (too many atomics)
        seeds = [d, {**d, "split": 32}, {**d, "split": 0}, {**d, "slabs_per_warp": 8,
                                                            "warps_per_block": max(1, d["warps_per_block"] // 2)},
                 {**d, "slabs_per_warp": 2, "warps_per_block": min(8, 2 * d["warps_per_block"])},
                 {**d, "pack": "block"}, {**d, "precision": precisions_for(mod.op.dtype)[-1]}]
        if mod.op.dtype != "float32" and mod.op.K >= 64:   # 16-bit X: NT = 8 gives 16-byte loads
            seeds.insert(1, {**d, "slabs_per_warp": 8, "warps_per_block": max(1, d["warps_per_block"] // 2)})
            seeds.insert(2, {**d, "slabs_per_warp": 8, "warps_per_block": max(1, d["warps_per_block"] // 2),
                             "split": 32})
        return unique_params(seeds)

    def checks(self, mod):
        return {"pack": PACKS, "warps_per_block": (1, 2, 4, 8, 16), "slabs_per_warp": (1, 2, 4, 8),
                "split": AtLeast(0), "precision": precisions_for(mod.op.dtype)}

    def validate(self, mod, params):
        if "vnm" not in mod.formats:
            raise ValueError("sptc.vnm needs the vnm format (run reorder.vnm or format.vnm first)")
        super().validate(mod, params)

    def pack(self, mod, params):
        return sptc_arrays(mod, str(params["precision"]), pack=str(params["pack"]), split=int(params["split"]))

    def instance_args(self, mod, params):
        return {"precision": str(params["precision"]), "NT": int(params["slabs_per_warp"]), "dtype": mod.op.dtype}

    @staticmethod
    def instance_name(P, NT, E=0) -> str:
        return f"sptc3_spmm_p{P}_nt{NT}_e{E}"

    def instance(self, precision: str, NT: int, dtype: str = "float32"):
        P, E = PRECISIONS[precision].code, ELEMS[dtype]
        if E and E != P:
            raise ValueError(f"sptc.vnm: {dtype} inputs need precision {NATIVE_PRECISION[dtype]!r}, "
                             f"got {precision!r}")
        return self.instance_name(P, NT, E), (P, NT, E)

    def extra_meta(self, mod, params, arrays):
        ntiles = int(arrays["ccol"].size) // 32
        nrem = int(arrays["rem_vals"].size)
        kept = mod.A.nnz - nrem
        return {"precision": str(params["precision"]), "layout": META_LAYOUT, "pack": str(params["pack"]),
                "tiles": ntiles, "items": int(arrays["items"].size) // 4, "remainder_nnz": nrem,
                "nnz_per_tile": float(kept / max(1, ntiles)),
                "gathered_rows": int(np.count_nonzero(arrays["ccol"] >= 0)),
                "tile_density": float(kept / max(1, ntiles * 512))}
