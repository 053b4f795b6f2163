"""numpy emulation of ``csr.window`` over its packed arrays (tests on machines without a GPU):
which window's staged columns each entry reads, where each row is written, which columns a launch
covers.  Outputs start NaN; an entry the kernel would not reach raises."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..csr.emulate import emulate_spmm, spmm_columns

__all__ = ["window_columns", "emulate_window", "emulate_kernel"]


def window_columns(arrays: Mapping[str, np.ndarray], m: int, rows_per_window: int) -> np.ndarray:
    """The original column each stored entry reads: ``ucols[win_ptr[w] + lidx[p]]`` for the
    window ``w = row // rows_per_window`` of its row.  ValueError where the kernel would not read
    it so: an index outside its window's columns (it would never be staged) or a row whose
    indices decrease (the kernel's chunk scan assumes them sorted)."""
    a = {k: np.asarray(v) for k, v in arrays.items()}
    indptr = a["indptr"].astype(np.int64)
    win_ptr = a["win_ptr"].astype(np.int64)
    row = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
    w = row // int(rows_per_window)
    lidx = a["lidx"].astype(np.int64)
    if lidx.size and (lidx.min() < 0 or np.any(lidx >= (win_ptr[w + 1] - win_ptr[w]))):
        raise ValueError("an entry's lidx lies outside its window's columns")
    if lidx.size > 1 and np.any((np.diff(lidx) < 0) & (row[1:] == row[:-1])):
        raise ValueError("a row's lidx values are not sorted")
    return a["ucols"][win_ptr[w] + lidx]


def emulate_window(arrays: Mapping[str, np.ndarray], X: np.ndarray, reduce: str, m: int,
                   rows_per_window: int, columns: np.ndarray | None = None, dtype: str = "float32") -> np.ndarray:
    """Y (m x K) as ``spmm_window`` computes it: every row reduces ``data[p] * X[column of p]``
    in entry order and writes row ``row_ids[i]`` (0 for an empty row, mean scaled by its length);
    ``columns`` as :func:`~spcompile.kernels.csr.emulate.spmm_columns`."""
    a = {k: np.asarray(v) for k, v in arrays.items()}
    cols = window_columns(a, m, rows_per_window)
    seg = {"seg_ptr": a["indptr"], "seg_out": a["row_ids"], "seg_slot": np.full(m, -1, np.int32),
           "grp_ptr": np.zeros(1, np.int32), "slot_grp": np.zeros(0, np.int32), "grp_out": np.zeros(0, np.int32),
           "grp_len": np.zeros(0, np.int32), "indices": cols, "data": a["data"]}
    return emulate_spmm(seg, X, reduce, m, columns, dtype)


def emulate_kernel(kernel, X, fallback: bool = False) -> np.ndarray:
    """Run a built ``csr.window`` kernel (no binary needed) through the emulation with the columns
    its launch covers: its main instance, or with ``fallback`` its ``VEC = 1`` instance."""
    p, meta = kernel.params, kernel.meta
    vec = 1 if fallback else int(meta["vec"])
    K = int(meta["K"])
    reduce = {0: "sum", 1: "max", 2: "min", 3: "mean"}[int(meta["instances"][0][1][1])]
    cols = spmm_columns(K, 32, vec, 1, kernel.launch_spec(vec).grid[1])
    return emulate_window(kernel.arrays, X, reduce, int(meta["m"]),
                          int(p["warps"]) * int(p["rows_per_warp"]), cols, meta.get("dtype", "float32"))
