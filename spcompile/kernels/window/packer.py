"""Host arrays of ``csr.window`` (``spmm_window.cu``), built vectorised from the module's CSR
(the passes' permutations folded in: see :func:`~spcompile.kernels.base.csr_kernel_arrays`)."""
from __future__ import annotations

import numpy as np

from ...core.ir import SparseModule
from ..base import csr_kernel_arrays

__all__ = ["window_partition", "pack_window"]


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def window_partition(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, n: int,
                     rows_per_window: int) -> dict[str, np.ndarray]:
    """The arrays of ``spmm_window.cu`` for windows of ``rows_per_window`` consecutive rows:
    ``win_ptr`` / ``ucols`` (each window's distinct columns, sorted), ``indptr``, ``lidx`` (each
    entry's index into its window's columns) and ``data``, every row's entries sorted by column
    (stable: repeated columns keep their order).  One sort of the nonzeros, memory O(nnz)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    m = indptr.size - 1
    W = max(1, int(rows_per_window))
    n = max(int(n), 1)
    nwin = -(-m // W)
    row = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
    cols = np.asarray(indices, dtype=np.int64)
    order = np.lexsort((cols, row))                        # by row, then column (stable)
    cols, data = cols[order], np.asarray(data)[order]
    key = (row // W) * n + cols                            # (window, column)
    uniq, inv = np.unique(key, return_inverse=True)
    win_ptr = np.zeros(nwin + 1, dtype=np.int64)
    if uniq.size:
        np.cumsum(np.bincount(uniq // n, minlength=nwin), out=win_ptr[1:])
    lidx = inv.reshape(-1) - win_ptr[row // W]
    return {"win_ptr": _i32(win_ptr), "ucols": _i32(uniq % n), "indptr": _i32(indptr),
            "lidx": _i32(lidx), "data": np.ascontiguousarray(data)}


def pack_window(mod: SparseModule, rows_per_window: int) -> dict[str, np.ndarray]:
    """Arrays of ``csr.window``: the window partition of the module's CSR (rows in the passes'
    order) and ``row_ids``, where each row's output goes."""
    ka = csr_kernel_arrays(mod, np.int32)
    return {**window_partition(ka["indptr"], ka["indices"], ka["data"], mod.A.shape[1], rows_per_window),
            "row_ids": _i32(ka["row_ids"])}
