"""Host arrays of the csr family's kernels, built vectorised from the module's CSR (the passes'
permutations folded in: see :func:`~spcompile.kernels.base.csr_kernel_arrays`).  Array names are
the kernels' parameter names (``spmm_crc_cwm.cu``, ``sddmm_csr.cu``)."""
from __future__ import annotations

import numpy as np

from ...core.ir import SparseModule
from ..base import csr_kernel_arrays

__all__ = ["spmm_partition", "flat_groups", "sddmm_partition", "pack_spmm", "pack_sddmm"]


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


def spmm_partition(indptr: np.ndarray, row_ids: np.ndarray, max_seg: int) -> dict[str, np.ndarray]:
    """Cut rows into segments of at most ``max_seg`` nonzeros (0: whole rows).  Returns the arrays
    of ``spmm_crc_cwm.cu``: seg_ptr, seg_out, seg_slot, grp_ptr, slot_grp, grp_out, grp_len."""
    indptr = np.asarray(indptr, dtype=np.int64)
    lens = np.diff(indptr)
    if max_seg and max_seg > 0:
        nch = np.maximum(1, -(-lens // int(max_seg)))
    else:
        nch = np.ones(lens.size, dtype=np.int64)
    seg_row, seg_ptr = _slices(indptr, nch)
    split_seg = nch[seg_row] > 1
    seg_slot = np.full(seg_row.size, -1, dtype=np.int64)
    seg_slot[split_seg] = np.arange(int(split_seg.sum()))
    split_rows = np.flatnonzero(nch > 1)
    grp_ptr = np.concatenate([[0], np.cumsum(nch[split_rows])])
    slot_grp = np.repeat(np.arange(split_rows.size), nch[split_rows])
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
              group_nnz: int = 0) -> dict[str, np.ndarray]:
    """Arrays of ``csr.crc_cwm``: the CSR columns / values, the row partition and, for the flat
    layout, the row groups (``grp_seg``, :func:`flat_groups`; empty otherwise)."""
    ka = csr_kernel_arrays(mod, np.int32)
    part = spmm_partition(ka["indptr"], ka["row_ids"], max_seg)
    grp_seg = flat_groups(part["seg_ptr"], segs_per_group, group_nnz) if flat else np.zeros(0, np.int32)
    return {"indices": _i32(ka["indices"]), "data": ka["data"], **part, "grp_seg": grp_seg}


def pack_sddmm(mod: SparseModule, nnz_per_warp: int, flat: bool = False) -> dict[str, np.ndarray]:
    """Arrays of ``csr.sddmm``: the CSR columns / values, output positions and the segments
    (``flat``: runs of stored entries across rows, each entry's X row in ``nnz_row``)."""
    ka = csr_kernel_arrays(mod, np.int32)
    return {"indices": _i32(ka["indices"]), "data": ka["data"], "nnz_ids": _i32(ka["nnz_ids"]),
            **sddmm_partition(ka["indptr"], ka["row_ids"], nnz_per_warp, flat)}
