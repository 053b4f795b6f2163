"""Host arrays of the csr family's kernels, built vectorised from the module's CSR (the passes'
permutations folded in: see :func:`~spcompile.kernels.base.csr_kernel_arrays`).  Array names are
the kernels' parameter names (``spmm_crc_cwm.cu``, ``sddmm_csr.cu``)."""
from __future__ import annotations

import numpy as np

from ...core.formats import permute_csr
from ...core.ir import SparseModule
from ..base import ENTRY_SRC, csr_kernel_arrays

__all__ = ["WARP_SLICES", "WARP_ROW", "spmm_partition", "warp_slice_order", "flat_groups", "sddmm_partition", "pack_spmm",
           "ell_indices", "ell_split", "pack_ell", "pack_sddmm"]

#: ``seg_slot`` bit of a slice whose combine unit (a warp, or a block of 32-lane row groups)
#: reduces its row groups' accumulators before writing one partial (``spmm_crc_cwm.cu``'s
#: SPC_WARP_SLICES)
WARP_SLICES = 1 << 30
#: ``seg_slot`` of the slices of a row one combine unit's row groups hold whole (SPC_WARP_ROW):
#: the unit's sum is written as the row
WARP_ROW = -2


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _slices(indptr: np.ndarray, nch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row i cut into ``nch[i]`` balanced slices: ``(row of each slice, slice pointer)``."""
    m = indptr.size - 1
    lens = np.diff(indptr)
    seg_row = np.repeat(np.arange(m, dtype=np.int64), nch)
    first = np.cumsum(nch) - nch
    within = np.arange(seg_row.size, dtype=np.int64) - first[seg_row]
    seg_start = indptr[seg_row] + (within * lens[seg_row]) // nch[seg_row]
    return seg_row, np.append(seg_start, indptr[-1] if m else 0)


def _slice_counts(lens: np.ndarray, max_seg: int, warp_slices: int = 1,
                  warp_rows: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slices of each row, at most ``max_seg`` nonzeros each (0: whole rows), and which rows
    one warp's W = ``warp_slices`` row groups take together: ``sliced``, rows of more than W
    slices (a multiple of W: a warp a W slices, reduced into one partial), and ``whole``, rows
    of exactly W slices (the warp's sum is the row) -- with ``warp_rows`` also the rows of 2 .. W
    slices, cut into W.  Other rows are split as before."""
    if max_seg and max_seg > 0:
        nch = np.maximum(1, -(-lens // int(max_seg)))
    else:
        nch = np.ones(lens.size, dtype=np.int64)
    W = int(warp_slices)
    if W <= 1:
        none = np.zeros(lens.size, bool)
        return nch, none, none
    sliced = nch > W
    whole = (nch >= (2 if warp_rows else W)) & (nch <= W)
    nch[sliced] = -(-nch[sliced] // W) * W
    nch[whole] = W
    return nch, sliced, whole


def warp_slice_order(indptr: np.ndarray, max_seg: int, warp_slices: int, warp_rows: bool = False) -> np.ndarray:
    """The row order :func:`spmm_partition` needs for ``warp_slices`` > 1: the rows reduced into
    partials a warp at a time first, then the rows one warp holds whole, then every other row in
    its order (a stable sort)."""
    lens = np.diff(np.asarray(indptr, dtype=np.int64))
    _, sliced, whole = _slice_counts(lens, max_seg, warp_slices, warp_rows)
    return np.argsort(np.where(sliced, 0, np.where(whole, 1, 2)), kind="stable")


def spmm_partition(indptr: np.ndarray, row_ids: np.ndarray, max_seg: int, warp_slices: int = 1,
                   warp_rows: bool = False) -> dict[str, np.ndarray]:
    """Cut rows into segments of at most ``max_seg`` nonzeros (0: whole rows).  Returns the arrays
    of ``spmm_crc_cwm.cu``: seg_ptr, seg_out, seg_slot, grp_ptr, slot_grp, grp_out, grp_len.

    ``warp_slices`` W > 1 (one-segment row groups, W to a combine unit: the 32 / W-lane groups of
    a warp, or the W warps of a block of 32-lane groups): a row of more than W slices gets a
    multiple of W, and every W consecutive slices of it (one unit's row groups) share one partial
    slot, flagged ``WARP_SLICES`` in ``seg_slot``: the unit reduces them before writing it.  A
    row of exactly W slices (with ``warp_rows`` any row of 2 .. W slices, cut into W) is one
    unit's: ``seg_slot`` ``WARP_ROW`` on its W slices, the unit's sum written as the row, no
    partial.  These rows must come first, in that order (:func:`warp_slice_order`), so that
    their units are aligned."""
    indptr = np.asarray(indptr, dtype=np.int64)
    lens = np.diff(indptr)
    W = max(1, int(warp_slices))
    nch, sliced, whole = _slice_counts(lens, max_seg, W, warp_rows)
    seg_row, seg_ptr = _slices(indptr, nch)
    n_sl, n_wh = int(nch[sliced].sum()), int(nch[whole].sum())
    if not (sliced[seg_row[:n_sl]].all() and whole[seg_row[n_sl:n_sl + n_wh]].all()):
        raise ValueError("warp-reduced rows must come first (warp_slice_order)")
    # slots: one per W slices of a warp-reduced row, one per slice of another split row
    slotted = (nch > 1) & ~whole
    split_rows = np.flatnonzero(slotted)
    per_row = np.where(sliced[split_rows], nch[split_rows] // W, nch[split_rows])
    grp_ptr = np.concatenate([[0], np.cumsum(per_row)])
    slot_grp = np.repeat(np.arange(split_rows.size), per_row)
    seg_slot = np.full(seg_row.size, -1, dtype=np.int64)
    seg_slot[:n_sl] = (np.arange(n_sl) // W) | WARP_SLICES
    seg_slot[n_sl:n_sl + n_wh] = WARP_ROW
    rest = np.flatnonzero(slotted[seg_row] & ~sliced[seg_row])
    seg_slot[rest] = n_sl // W + np.arange(rest.size)
    row_ids = np.asarray(row_ids, dtype=np.int64)
    return {"seg_ptr": _i32(seg_ptr), "seg_out": _i32(row_ids[seg_row]), "seg_slot": _i32(seg_slot),
            "grp_ptr": _i32(grp_ptr), "slot_grp": _i32(slot_grp), "grp_out": _i32(row_ids[split_rows]),
            "grp_len": _i32(lens[split_rows])}


def flat_groups(seg_ptr: np.ndarray, segs_per_group: int, group_nnz: int = 0) -> np.ndarray:
    """First segment of each row group of the flat layout (``grp_seg``, ends with the number of
    segments).  ``group_nnz`` 0: ``segs_per_group`` consecutive segments per group.  Else groups
    of about ``group_nnz`` nonzeros: every segment weighs its nonzeros plus one (its output row),
    and segment s joins group ``floor(weight before s / group_nnz)``, so a group holds many short
    rows or a few long ones, at most ``group_nnz`` segments and less than ``group_nnz`` + the
    longest segment's weight (an nnz-balanced schedule: hub rows, cut by ``max_seg``, do not make
    one group's work many times another's)."""
    seg_ptr = np.asarray(seg_ptr, dtype=np.int64)
    nseg = seg_ptr.size - 1
    if nseg <= 0:
        return np.zeros(1, np.int32)
    if group_nnz and int(group_nnz) > 0:
        before = seg_ptr[:-1] - seg_ptr[0] + np.arange(nseg, dtype=np.int64)   # weight of segments < s
        gid = before // int(group_nnz)
        starts = np.flatnonzero(np.diff(gid, prepend=-1))
    else:
        starts = np.arange(0, nseg, max(1, int(segs_per_group)), dtype=np.int64)
    return _i32(np.append(starts, nseg))


def sddmm_partition(indptr: np.ndarray, row_ids: np.ndarray, nnz_per_warp: int,
                    flat: bool = False) -> dict[str, np.ndarray]:
    """The segments of ``sddmm_csr.cu``: seg_ptr, seg_xrow, nnz_row.  Default: segments of at
    most ``nnz_per_warp`` nonzeros of one row (empty rows have none), ``seg_xrow`` the X row
    (``row_ids`` of the row) of each, ``nnz_row`` empty.  ``flat``: ``[0, nnz)`` cut into runs of
    ``nnz_per_warp`` stored entries regardless of rows (no segment when nnz == 0), ``seg_xrow``
    empty and ``nnz_row`` the X row of every stored entry."""
    indptr = np.asarray(indptr, dtype=np.int64)
    npw = max(1, int(nnz_per_warp))
    if flat:
        nnz = int(indptr[-1]) if indptr.size else 0
        seg_ptr = np.append(np.arange(0, nnz, npw, dtype=np.int64), nnz) if nnz else np.zeros(1, np.int64)
        nnz_row = np.repeat(np.asarray(row_ids), np.diff(indptr))
        return {"seg_ptr": _i32(seg_ptr), "seg_xrow": np.zeros(0, np.int32), "nnz_row": _i32(nnz_row)}
    nch = -(-np.diff(indptr) // npw)
    seg_row, seg_ptr = _slices(indptr, nch)
    return {"seg_ptr": _i32(seg_ptr), "seg_xrow": _i32(np.asarray(row_ids, dtype=np.int64)[seg_row]),
            "nnz_row": np.zeros(0, np.int32)}


def pack_spmm(mod: SparseModule, max_seg: int, flat: bool = False, segs_per_group: int = 1,
              group_nnz: int = 0, warp_slices: int = 1, warp_rows: bool = False) -> dict[str, np.ndarray]:
    """Arrays of ``csr.crc_cwm``: the CSR columns / values, the row partition and, for the flat
    layout, the row groups (``grp_seg``, :func:`flat_groups`; empty otherwise).  ``warp_slices``
    > 1: the rows whole warps take moved first (:func:`warp_slice_order`; outputs still go to
    each row's ``row_ids``) and cut for :func:`spmm_partition`; the entries then move with their
    rows, and ``ENTRY_SRC`` says from where (``mod.A``'s entry of each value slot), so that values
    passed at call time land in the slots of their entries."""
    ka = csr_kernel_arrays(mod, np.int32)
    indptr, indices, data, row_ids = ka["indptr"], ka["indices"], ka["data"], ka["row_ids"]
    src = None
    if int(warp_slices) > 1:
        order = warp_slice_order(indptr, max_seg, warp_slices, warp_rows)
        if np.any(order != np.arange(order.size)):
            # the kernel arrays share mod.A's entry positions: its row permutation's ``src`` moves them
            permuted, src = permute_csr(mod.A, order, None)
            indptr, indices, data, row_ids = permuted.indptr, indices[src], data[src], np.asarray(row_ids)[order]
    part = spmm_partition(indptr, row_ids, max_seg, warp_slices, warp_rows)
    grp_seg = flat_groups(part["seg_ptr"], segs_per_group, group_nnz) if flat else np.zeros(0, np.int32)
    out = {"indices": _i32(indices), "data": data, **part, "grp_seg": grp_seg}
    if src is not None:
        out[ENTRY_SRC] = src    # which of mod.A's entries each value slot holds (call-time values)
    return out


def _ell_fits(lens: np.ndarray, width: int) -> None:
    if lens.size and int(lens.max()) > int(width):
        raise ValueError(f"ELL rows of width {int(width)} cannot hold a row of {int(lens.max())} nonzeros")


def ell_indices(indptr: np.ndarray, indices: np.ndarray, width: int) -> np.ndarray:
    """The column ids of every row padded to ``width`` (row-major, ``rows x width``): row i's
    ids in their stored order, then -1.  ValueError when a row holds more than ``width``."""
    indptr = np.asarray(indptr, dtype=np.int64)
    lens = np.diff(indptr)
    m, w = lens.size, int(width)
    _ell_fits(lens, w)
    out = np.full(m * w, -1, dtype=np.int32)
    nnz = int(indptr[-1]) if indptr.size else 0
    if nnz:
        row = np.repeat(np.arange(m, dtype=np.int64), lens)
        out[row * w + (np.arange(nnz, dtype=np.int64) - indptr[row])] = np.asarray(indices)[:nnz]
    return out


def ell_split(ids: np.ndarray, lens: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`ell_indices`: ``(own, padding)``, the first ``lens[i]`` ids of each
    ``width``-wide row (in CSR order) and the rest.  ValueError when a row is longer than
    ``width`` (the kernel reads no more)."""
    lens = np.asarray(lens, dtype=np.int64)
    w = int(width)
    _ell_fits(lens, w)
    grid = np.asarray(ids).reshape(lens.size, w)
    mine = np.arange(w)[None, :] < lens[:, None]
    return grid[mine], grid[~mine]


def pack_ell(mod: SparseModule, width: int) -> dict[str, np.ndarray]:
    """Arrays of ``csr.crc_cwm`` with ``flat=4`` (ELL rows): one whole-row segment a row
    (:func:`spmm_partition` without slices), ``indices`` the column ids padded to ``width`` a row
    (:func:`ell_indices`), and ``data`` the values in CSR order (call-time values land there as
    for every CSR layout)."""
    ka = csr_kernel_arrays(mod, np.int32)
    part = spmm_partition(ka["indptr"], ka["row_ids"], 0)
    return {"indices": ell_indices(ka["indptr"], ka["indices"], width), "data": ka["data"], **part,
            "grp_seg": np.zeros(0, np.int32)}


def pack_sddmm(mod: SparseModule, nnz_per_warp: int, flat: bool = False) -> dict[str, np.ndarray]:
    """Arrays of ``csr.sddmm``: the CSR columns / values, output positions and the segments
    (``flat``: runs of stored entries across rows, each entry's X row in ``nnz_row``)."""
    ka = csr_kernel_arrays(mod, np.int32)
    return {"indices": _i32(ka["indices"]), "data": ka["data"], "nnz_ids": _i32(ka["nnz_ids"]),
            **sddmm_partition(ka["indptr"], ka["row_ids"], nnz_per_warp, flat)}
