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


def sddmm_partition(indptr: np.ndarray, row_ids: np.ndarray, nnz_per_warp: int) -> dict[str, np.ndarray]:
    """Segments of at most ``nnz_per_warp`` nonzeros of one row (empty rows have none)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    nch = -(-np.diff(indptr) // max(1, int(nnz_per_warp)))
    seg_row, seg_ptr = _slices(indptr, nch)
    return {"seg_ptr": _i32(seg_ptr), "seg_xrow": _i32(np.asarray(row_ids, dtype=np.int64)[seg_row])}


def pack_spmm(mod: SparseModule, max_seg: int) -> dict[str, np.ndarray]:
    """Arrays of ``csr.crc_cwm``: the CSR columns / values and the row partition."""
    ka = csr_kernel_arrays(mod, np.int32)
    return {"indices": _i32(ka["indices"]), "data": ka["data"],
            **spmm_partition(ka["indptr"], ka["row_ids"], max_seg)}


def pack_sddmm(mod: SparseModule, nnz_per_warp: int) -> dict[str, np.ndarray]:
    """Arrays of ``csr.sddmm``: the CSR columns / values, output positions and the segments."""
    ka = csr_kernel_arrays(mod, np.int32)
    return {"indices": _i32(ka["indices"]), "data": ka["data"], "nnz_ids": _i32(ka["nnz_ids"]),
            **sddmm_partition(ka["indptr"], ka["row_ids"], nnz_per_warp)}
