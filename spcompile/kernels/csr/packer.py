"""Host arrays of the csr family's kernels, built vectorised from the module's CSR (the passes'
permutations folded in: see :func:`~spcompile.kernels.base.csr_kernel_arrays`).  Array names are
the kernels' parameter names (``spmm_crc_cwm.cu``, ``sddmm_csr.cu``)."""
from __future__ import annotations

import numpy as np

from ...core.ir import SparseModule
from ..base import csr_kernel_arrays

__all__ = ["spmm_partition", "sddmm_partition", "pack_spmm", "pack_sddmm"]


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


def pack_spmm(mod: SparseModule, max_seg: int) -> dict[str, np.ndarray]:
    """Arrays of ``csr.crc_cwm``: the CSR columns / values and the row partition."""
    ka = csr_kernel_arrays(mod, np.int32)
    return {"indices": _i32(ka["indices"]), "data": ka["data"],
            **spmm_partition(ka["indptr"], ka["row_ids"], max_seg)}


def pack_sddmm(mod: SparseModule, nnz_per_warp: int, flat: bool = False) -> dict[str, np.ndarray]:
    """Arrays of ``csr.sddmm``: the CSR columns / values, output positions and the segments
    (``flat``: runs of stored entries across rows, each entry's X row in ``nnz_row``)."""
    ka = csr_kernel_arrays(mod, np.int32)
    return {"indices": _i32(ka["indices"]), "data": ka["data"], "nnz_ids": _i32(ka["nnz_ids"]),
            **sddmm_partition(ka["indptr"], ka["row_ids"], nnz_per_warp, flat)}
