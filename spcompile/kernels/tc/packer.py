"""Host arrays of the tc family's kernels, built vectorised from ``mod.formats["sgt"]`` with the
passes' permutations folded in (X rows of a TC block are original column ids, output rows go to
``row_ids``).  Array names are the kernels' parameter names (``tc_wmma_sgt.cu``,
``tc_wmma_sddmm.cu``).

Also here: the MMA operand precisions and the 16-bit input policy, and the PTX ISA fragment
layouts of ``mma.m16n8k8`` (tf32) / ``mma.m16n8k16`` (fp16 / bf16) that both the fragment packing
of impl "mma" and the emulation (``emulate.py``) follow.
"""
from __future__ import annotations

import numpy as np

from ...core import numerics
from ...core.ir import SparseModule
from ...core.numerics import NATIVE_PRECISION
from ..base import csr_kernel_arrays

__all__ = ["PRECISIONS", "INPUT_PRECISION", "input_type", "a_frag_layout", "b_frag_rows", "split_windows",
           "tc_arrays", "mma_arrays", "sddmm_arrays"]

#: the MMA operand precisions of the tensor-core kernels (code, MMA k: :mod:`spcompile.core.numerics`);
#: "3xtf32" is tf32 MMAs on split operands (hi + lo) for fp32-level results, impl "mma" only
PRECISIONS = {p: numerics.PRECISIONS[p] for p in ("tf32", "fp16", "bf16", "3xtf32")}
#: precisions whose MMA is the tf32 one (fragment layouts of mma.m16n8k8)
TF32_LIKE = ("tf32", "3xtf32")
#: workload dtype -> the only MMA precision offered for it (16-bit inputs are MMA operands as they
#: are; fp32 inputs are converted in registers to any of PRECISIONS)
INPUT_PRECISION = NATIVE_PRECISION


def input_type(dtype: str, precision: str) -> int:
    """Kernel input-type code TI: 0 for float32 inputs (any precision), 1 for 16-bit inputs, whose
    precision must be their own type; a clear error otherwise."""
    if dtype == "float32":
        return 0
    want = INPUT_PRECISION.get(dtype)
    if want is None:
        raise ValueError(f"unsupported dtype {dtype!r}; expected float32, float16 or bfloat16")
    if precision != want:
        raise ValueError(f"precision {precision!r} does not match the {dtype} workload: {dtype} inputs run "
                         f"with precision {want!r} only")
    return 1


# ------------------------------------------------------------------------------------------
# PTX fragment layouts (g = lane / 4, t = lane % 4)
# ------------------------------------------------------------------------------------------
_LANE = np.arange(32)
_G, _T = _LANE // 4, _LANE % 4


def a_frag_layout(precision: str) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) in the 16 x KS A operand of register element i of lane l, shape (32, n): the
    PTX ISA layouts of mma.m16n8k8 .tf32 (4 elements) and mma.m16n8k16 .f16/.bf16 (8)."""
    if precision in TF32_LIKE:
        i = np.arange(4)
        return _G[:, None] + 8 * (i % 2), _T[:, None] + 4 * (i // 2)
    i = np.arange(8)
    return _G[:, None] + 8 * ((i // 2) % 2), 2 * _T[:, None] + (i % 2) + 8 * (i // 4)


def b_frag_rows(precision: str) -> np.ndarray:
    """k index (row of the KS x 8 B operand, column n = g) of B register element e of lane l."""
    if precision in TF32_LIKE:
        return np.stack([_T, _T + 4], 1)
    return np.stack([2 * _T, 2 * _T + 1, 2 * _T + 8, 2 * _T + 9], 1)


# ------------------------------------------------------------------------------------------
# shared pieces
# ------------------------------------------------------------------------------------------
def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _folded_cols(mod: SparseModule) -> np.ndarray:
    """SGT block columns (blocks x BW) as original X / Y row ids (-1: padding)."""
    cols = np.asarray(mod.formats["sgt"].block_cols, dtype=np.int64)
    if mod.col_perm is not None:
        cols = np.where(cols >= 0, np.asarray(mod.col_perm)[np.maximum(cols, 0)], -1)
    return cols


def _spmm_data(mod: SparseModule, ka) -> np.ndarray:
    """A's values in fp32; for ``mean`` scaled by 1 / row length (tensor cores only sum)."""
    data = ka["data"].astype(np.float32)
    if mod.op.reduce == "mean":
        lens = np.diff(mod.A.indptr.astype(np.int64))
        data = (data / np.repeat(np.maximum(lens, 1), lens)).astype(np.float32)
    return data


def _check_fp16_range(data: np.ndarray, precision: str) -> None:
    if precision == "fp16" and data.size and float(np.abs(data).max()) > 65504.0:
        raise ValueError("matrix values exceed the fp16 range; use tf32 or bf16")


def _as_16bit(a: np.ndarray, precision: str) -> np.ndarray:
    """fp16 values, or bf16 bit patterns (uint16), of a float32 array."""
    return a.astype(np.float16) if precision == "fp16" else numerics.bf16_bits(a)


def _block_nonzeros(mod: SparseModule) -> tuple[np.ndarray, np.ndarray]:
    """``(order, pos)``: the stored nonzeros block by block (indices into A's CSR order) and each
    one's position ``row * BW + col`` in its 16 x BW block."""
    fmt = mod.formats["sgt"]
    order = np.asarray(fmt.block_nnz_order, dtype=np.int64)
    pos = (np.asarray(fmt.block_row, dtype=np.int64) * fmt.BLK_W + np.asarray(fmt.block_col, dtype=np.int64))[order]
    return order, pos


# ------------------------------------------------------------------------------------------
# impl "wmma"
# ------------------------------------------------------------------------------------------
def tc_arrays(mod: SparseModule, precision: str = "tf32", dense_a: bool = True) -> dict[str, np.ndarray]:
    """Arrays of impl "wmma": ``win_block_ptr`` (windows + 1), ``blk_cols`` (blocks x BW:
    original X row per tile column, -1 padding), ``row_ids`` (original output row of each current
    row), and either ``tiles`` (dense 16 x BW tiles in the MMA input type) or ``nz_ptr`` /
    ``nz_pos`` / ``nz_val`` (each block's nonzeros: position ``row * BW + col`` in its tile and
    value)."""
    if precision == "3xtf32":
        raise ValueError("precision '3xtf32' runs with impl 'mma' only")
    fmt = mod.formats["sgt"]
    ka = csr_kernel_arrays(mod, np.int32)
    data = _spmm_data(mod, ka)
    out = {"win_block_ptr": _i32(fmt.win_block_ptr), "blk_cols": _i32(_folded_cols(mod).reshape(-1)),
           "row_ids": _i32(ka["row_ids"])}
    _check_fp16_range(data, precision)
    if dense_a:
        t = fmt.dense_tiles(data, np.float32)
        if precision != "tf32":
            t = _as_16bit(t, precision)
        out["tiles"] = np.ascontiguousarray(t.reshape(-1))
    else:
        order, pos = _block_nonzeros(mod)
        out["nz_ptr"] = _i32(fmt.block_nnz_ptr)
        out["nz_pos"] = np.ascontiguousarray(pos, dtype=np.uint8)
        out["nz_val"] = np.ascontiguousarray(data[order], dtype=np.float32)
    return out


# ------------------------------------------------------------------------------------------
# impl "mma": fragment packing and window splitting
# ------------------------------------------------------------------------------------------
def split_windows(win_block_ptr: np.ndarray, max_blocks: int) -> dict[str, np.ndarray]:
    """Work items of at most ``max_blocks`` TC blocks (0: whole windows), balanced within a window,
    longest first.  ``items`` (n, 4) int32: first block, end block, window, partial slot (-1 when
    the window is one item); ``slot_grp`` (slot -> split window group), ``grp_ptr`` (group ->
    its contiguous slots).  Empty windows get one empty item (the kernel writes their zeros)."""
    wbp = np.asarray(win_block_ptr, dtype=np.int64)
    nb = np.diff(wbp)
    nwin = nb.size
    nch = np.maximum(1, -(-nb // int(max_blocks))) if max_blocks and max_blocks > 0 else np.ones(nwin, np.int64)
    win = np.repeat(np.arange(nwin, dtype=np.int64), nch)
    first = np.cumsum(nch) - nch
    within = np.arange(win.size, dtype=np.int64) - first[win]
    lo = wbp[win] + (within * nb[win]) // nch[win]
    hi = wbp[win] + ((within + 1) * nb[win]) // nch[win]
    split = nch[win] > 1
    slot = np.full(win.size, -1, dtype=np.int64)
    slot[split] = np.arange(int(split.sum()))
    sw = np.flatnonzero(nch > 1)
    grp_ptr = np.concatenate([[0], np.cumsum(nch[sw])]).astype(np.int64)
    slot_grp = np.repeat(np.arange(sw.size, dtype=np.int64), nch[sw])
    order = np.argsort(-(hi - lo), kind="stable")
    items = np.stack([lo, hi, win, slot], 1)[order]
    return {"items": _i32(items), "slot_grp": _i32(slot_grp), "grp_ptr": _i32(grp_ptr)}


def mma_arrays(mod: SparseModule, precision: str = "tf32", max_blocks: int = 32) -> dict[str, np.ndarray]:
    """Arrays of impl "mma": ``afrag`` (A fragments per MMA k-step and lane, 16 bytes each: 4
    tf32-rounded floats or 8 fp16/bf16; 3xtf32: the step's 32 hi fragments, then its 32 lo ones), ``pcols`` (each k-step's X row ids in the order a lane
    loads them: tf32 columns (t, t+4) per lane, 16-bit (2t, 2t+1, 2t+8, 2t+9)), ``row_ids`` and
    the work items of :func:`split_windows`."""
    fmt = mod.formats["sgt"]
    BW = fmt.BLK_W
    KS = PRECISIONS[precision].mma_k
    if BW % KS:
        raise ValueError(f"precision {precision!r} needs a block width multiple of {KS}, got {BW}")
    ka = csr_kernel_arrays(mod, np.int32)
    data = _spmm_data(mod, ka)
    _check_fp16_range(data, precision)
    S = BW // KS
    nblk = fmt.num_blocks
    tiles = fmt.dense_tiles(data, np.float32).reshape(nblk, 16, S, KS).transpose(0, 2, 1, 3)  # (nblk, S, 16, KS)
    r, c = a_frag_layout(precision)
    frag = tiles[:, :, r, c]                                           # (nblk, S, 32, 4 | 8)
    if precision == "3xtf32":
        # per k-step the 32 lanes' hi fragments, then their lo fragments: a = hi + lo, each tf32
        hi = numerics.tf32_round(frag)
        lo = numerics.tf32_round(frag - hi)
        frag = np.stack([hi, lo], 2)                                    # (nblk, S, 2, 32, 4)
    else:
        frag = numerics.tf32_round(frag) if precision == "tf32" else _as_16bit(frag, precision)
    cols = _folded_cols(mod).reshape(nblk, S, KS)
    order = b_frag_rows(precision)[:4].reshape(-1)                      # lanes t = 0..3 (g = 0)
    out = {"afrag": np.ascontiguousarray(frag.reshape(-1)), "pcols": _i32(cols[:, :, order].reshape(-1)),
           "row_ids": _i32(ka["row_ids"])}
    out.update(split_windows(fmt.win_block_ptr, max_blocks))
    return out


# ------------------------------------------------------------------------------------------
# SDDMM
# ------------------------------------------------------------------------------------------
def sddmm_arrays(mod: SparseModule) -> dict[str, np.ndarray]:
    """Arrays of ``tc_wmma_sddmm.cu``: ``blk_win`` (window of each TC block), ``blk_cols``
    (original Y row per block column, -1 padding), ``nz_ptr`` / ``nz_pos`` (position row * BW +
    col in the block) / ``nz_val`` (A.data) / ``nz_out`` (caller's nonzero index) of each block's
    nonzeros, ``row_ids`` (original X row of each current row)."""
    fmt = mod.formats["sgt"]
    ka = csr_kernel_arrays(mod, np.int32)
    order, pos = _block_nonzeros(mod)
    return {"blk_win": _i32(fmt.block_window), "blk_cols": _i32(_folded_cols(mod).reshape(-1)),
            "nz_ptr": _i32(fmt.block_nnz_ptr), "nz_pos": np.ascontiguousarray(pos, dtype=np.uint8),
            "nz_val": np.ascontiguousarray(ka["data"][order], dtype=np.float32),
            "nz_out": _i32(np.asarray(ka["nnz_ids"])[order]), "row_ids": _i32(ka["row_ids"])}
