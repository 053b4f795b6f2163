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

from typing import Any

import numpy as np

from ...core.numerics import DTYPES, NATIVE_PRECISION
from ..base import (check_instances, index_array, meta_equal, meta_int, pointer_array, register_template,
                    typed_array, unique_params)
from ..nvcc import AtLeast, LaunchSpec, NvccKernel, NvccTemplate
from .emulate import decode_tiles, emulate_sptc_spmm  # noqa: F401 (public here too)
from .packer import (META_LAYOUT, PACKS, PRECISIONS, condense_windows, fragment_index,  # noqa: F401
                     pack_arrays, sptc_arrays)

__all__ = ["SptcVnm", "SptcKernel", "sptc_arrays", "pack_arrays", "condense_windows", "PACKS", "emulate_sptc_spmm",
           "decode_tiles", "META_LAYOUT", "PRECISIONS", "ELEMS", "fragment_index", "precisions_for"]

#: X / Y element type -> kernel code E; a 16-bit workload computes in its own precision only
ELEMS = {d: DTYPES[d].code for d in ("float32", "float16", "bfloat16")}
_SUFFIX = {0: "_kernel", 1: "_h", 2: "_b"}    # helper kernels per E
#: the arrays of a kernel (``sptc_arrays``), each with the element type its kernel parameter has
ARRAY_DTYPES = {"win_ptr": np.int32, "frag": np.uint32, "meta": np.uint32, "ccol": np.int32, "row_ids": np.int32,
                "row_scale": np.float32, "rem_ptr": np.int32, "rem_rows": np.int32, "rem_cols": np.int32,
                "rem_vals": np.float32, "items": np.int32, "zero_rows": np.int32}
_INT_MAX = 2**31 - 1


def _typed(arrays, name: str, size: int | None = None, of: str = "") -> np.ndarray:
    """``arrays[name]``: 1-D, exactly the element type the kernel reads it as (``ARRAY_DTYPES``:
    another width or byte order would be read as other values / past its end), ``size`` long
    (``of``: what that length follows, for the message)."""
    return typed_array(arrays, name, ARRAY_DTYPES[name], size, of)


def _index(arrays, name: str, lo: int, hi: int, size: int | None = None, of: str = "") -> np.ndarray:
    _typed(arrays, name, size, of)
    return index_array(arrays, name, lo, hi, size)


def _pointer(arrays, name: str, last: int, size: int, of: str = "", last_of: str = "") -> np.ndarray:
    """A pointer array of ``size`` entries rising from 0 to ``last`` (``last_of``: what it counts)."""
    _typed(arrays, name, size, of)
    try:
        return pointer_array(arrays, name, last, size)
    except ValueError as e:
        raise ValueError(f"{e}" + (f" ({last_of})" if last_of else "")) from None


def _param(params, name: str, allowed) -> Any:
    v = params.get(name)
    ok = (v in allowed if all(isinstance(a, str) for a in allowed) else
          isinstance(v, (int, np.integer)) and not isinstance(v, bool) and int(v) in allowed)
    if not ok:
        raise ValueError(f"parameter {name!r} must be one of {list(allowed)}, got {v!r}")
    return v if isinstance(v, str) else int(v)


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

    def check_arrays(self, key, params, arrays, meta, values=None):
        """Every index the kernels follow stays inside its array, X (``key.cols`` rows) or Y
        (``key.rows`` rows) and the fp32 scratch, and the launches are the ones these arrays were
        built for (see the module doc and ``sptc_vnm.cu``):

        * the parameters / meta that shape the launches and the instance (``m``, ``K``, ``dtype``,
          precision, slabs, warps, pack, layout, ``instances``) agree with the workload key and
          with each other; the counts in the meta (tiles, items, remainder) with the arrays;
        * every array has the kernel's element type; ``frag`` / ``meta`` / ``ccol`` hold 128 / 16 /
          32 words per tile, ``ccol`` X rows or -1, the metadata valid 2:4 positions;
        * ``win_ptr`` rises from 0 to the tiles over the 16-row windows; the work ``items``
          (window, first tile, end tile, split number) name windows, cover every tile exactly
          once inside their window's range, give every window an item; a window of several items
          is split (one split number > 0, distinct, 1 .. #split windows), and ``zero_rows`` are
          exactly the output rows of the split windows in that numbering (the zeroing / fp32
          scratch rows, ``(split - 1) * 16 + window row``, stay inside it);
        * ``row_ids`` a permutation of the output rows, ``row_scale`` one float per row;
        * the remainder: distinct increasing output rows ``rem_rows``, ``rem_ptr`` from 0 to its
          entries, ``rem_cols`` X rows, ``rem_vals`` one float per entry.

        The matrix itself is not compared with the manifest's pattern hash: the 2:4 operands keep
        no trace of an explicitly stored zero (a padded slot reads the same)."""
        m, n, K = key.rows, key.cols, key.K
        for what, v in (("rows", m), ("cols", n), ("K", K)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 0 <= v <= _INT_MAX:
                raise ValueError(f"workload {what} must be an integer in [0, 2**31), got {v!r}")
        if key.dtype not in ELEMS:
            raise ValueError(f"{self.name} computes for {sorted(ELEMS)}, not {key.dtype!r}")
        if sorted(arrays) != sorted(ARRAY_DTYPES):
            raise ValueError(f"{self.name} takes arrays {sorted(ARRAY_DTYPES)}, got {sorted(arrays)}")
        # --- launch scalars, parameters, instance
        meta_int(meta, "m", m)
        meta_int(meta, "K", K, lo=1)
        meta_equal(meta, "dtype", key.dtype)
        meta_int(meta, "arch")
        prec = _param(params, "precision", precisions_for(key.dtype))
        NT = _param(params, "slabs_per_warp", (1, 2, 4, 8))
        _param(params, "warps_per_block", (1, 2, 4, 8, 16))
        pack = _param(params, "pack", PACKS)
        meta_equal(meta, "precision", prec)
        meta_equal(meta, "pack", pack)
        meta_equal(meta, "layout", META_LAYOUT)
        want = [[nm, list(a)] for nm, a in self.instances(precision=prec, NT=NT, dtype=key.dtype)]
        check_instances(meta, want)
        # --- tiles
        ccol = _index(arrays, "ccol", -1, n)
        if ccol.size % 32:
            raise ValueError(f"array 'ccol' must hold 32 X rows per tile, got {ccol.size} values")
        ntiles = ccol.size // 32
        _typed(arrays, "frag", ntiles * 128, "128 words per tile of 'ccol'")
        words = _typed(arrays, "meta", ntiles * 16, "16 words per tile of 'ccol'")
        nib = (words[:, None] >> (4 * np.arange(8, dtype=np.uint32))[None, :]) & np.uint32(0xF)
        if np.any((nib & 3) >= (nib >> 2)):
            raise ValueError("array 'meta' holds invalid 2:4 metadata (positions must be distinct and increasing)")
        nwin = -(-m // 16)
        win_ptr = _pointer(arrays, "win_ptr", ntiles, nwin + 1, f"the 16-row windows of m={m} rows + 1",
                           "the tiles of 'ccol'")
        row_ids = _index(arrays, "row_ids", 0, m, m, "m")
        if m and not np.all(np.bincount(row_ids, minlength=m) == 1):
            raise ValueError("array 'row_ids' is not a permutation of the rows")
        _typed(arrays, "row_scale", m, "m")
        # --- work items: (window, first tile, end tile, split number)
        items = _typed(arrays, "items")
        if items.size % 4:
            raise ValueError(f"array 'items' must hold 4 values per work item, got {items.size}")
        it = items.reshape(-1, 4).astype(np.int64)
        w, beg, end, at = it[:, 0], it[:, 1], it[:, 2], it[:, 3]
        nitems = it.shape[0]
        if nitems and (w.min() < 0 or w.max() >= nwin):
            raise ValueError(f"array 'items' names windows outside [0, {nwin})")
        if nitems and (np.any(beg < win_ptr[w]) or np.any(end < beg) or np.any(end > win_ptr[w + 1])):
            raise ValueError("array 'items' holds tile ranges outside their window's tiles (win_ptr)")
        cover = np.cumsum(np.bincount(beg, minlength=ntiles + 1) - np.bincount(end, minlength=ntiles + 1))[:ntiles]
        if np.any(cover != 1):
            raise ValueError("array 'items' must cover every tile exactly once")
        per_win = np.bincount(w, minlength=nwin)
        if np.any(per_win == 0):
            raise ValueError("array 'items' leaves a window without a work item (its rows would not be written)")
        if nitems and at.min() < 0:
            raise ValueError("array 'items' holds negative split numbers")
        wat = np.zeros(nwin, np.int64)
        wat[w] = at
        if np.any(at != wat[w]) or np.any((per_win > 1) & (wat == 0)):
            raise ValueError("array 'items': the items of a window split into several must share one split number > 0")
        sw = np.flatnonzero(wat > 0)
        nsplit = sw.size
        if nsplit and (wat[sw].max() > nsplit or np.any(np.bincount(wat[sw], minlength=nsplit + 1)[1:] != 1)):
            raise ValueError(f"array 'items': the split windows must be numbered 1 .. {nsplit}, each once")
        zero_rows = _index(arrays, "zero_rows", 0, m)
        r = (sw[:, None] * 16 + np.arange(16)[None, :]).ravel()
        slot = ((wat[sw] - 1)[:, None] * 16 + np.arange(16)[None, :]).ravel()
        ok = r < m
        expect = np.full(nsplit * 16, -1, np.int64)
        expect[slot[ok]] = row_ids[r[ok]]
        nz = zero_rows.size
        if nz != int(ok.sum()) or not np.array_equal(expect[:nz], zero_rows):
            raise ValueError("array 'zero_rows' must be the output rows of the split windows, in their split numbering")
        # --- CSR remainder (one warp per row, distinct rows)
        rem_rows = _index(arrays, "rem_rows", 0, m)
        nrem = rem_rows.size
        if nrem >= 2**26:                                   # the remainder kernel's warp id is an int
            raise ValueError(f"array 'rem_rows' holds {nrem} rows, more than the remainder kernel indexes")
        if np.any(rem_rows[1:] <= rem_rows[:-1]):
            raise ValueError("array 'rem_rows' must hold distinct output rows in increasing order")
        rem_vals = _typed(arrays, "rem_vals")
        _index(arrays, "rem_cols", 0, n, rem_vals.size, "the entries of 'rem_vals'")
        _pointer(arrays, "rem_ptr", rem_vals.size, nrem + 1, "the rows of 'rem_rows' + 1", "the entries of 'rem_vals'")
        # --- counts in the meta
        meta_int(meta, "tiles", ntiles)
        meta_int(meta, "items", nitems)
        meta_int(meta, "remainder_nnz", int(rem_vals.size))
        meta_int(meta, "gathered_rows", int(np.count_nonzero(ccol >= 0)))
        if rem_vals.size > key.nnz:
            raise ValueError(f"array 'rem_vals' holds {rem_vals.size} entries, more than the matrix's {key.nnz}")

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
