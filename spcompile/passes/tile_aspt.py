"""``tile.aspt``: adaptive sparse tiling (ASpT, Hong et al. PPoPP'19, as described in Jiang et al.
PPoPP'20 §2.3).

The rows are cut into row panels of ``panel_height`` consecutive rows.  Inside a panel, a column
holding at least ``dense_threshold`` stored entries is *dense*: the kernel stages that column's row
of X in shared memory once per panel and every entry of the column reads it from there.  The
entries of dense columns form the panel's *dense tile*; every other entry goes to a plain CSR
*remainder* processed row-wise.  Nothing is permuted: the pass only adds format data
(``mod.formats["aspt"]``, an :class:`ASpTFormat`), so it is lossless by construction.

Composition with ``cluster.lsh`` (ASpT-RR of Jiang et al.): ``cluster.lsh`` (round 1) permutes
rows so that similar rows share panels, then ``tile.aspt`` tiles, then ``cluster.lsh`` (round 2)
reorders only the *processing order of the remainder rows* (``ASpTFormat.rem_rows``), which keeps
the panels and dense tiles intact.  See :mod:`spcompile.passes.cluster_lsh`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from .base import Pass, register_pass

__all__ = ["ASpTFormat", "build_aspt", "dense_mask", "dense_ratio", "aspt_spmm", "aspt_sddmm", "TileASpT"]


def _row_ids(indptr: np.ndarray, m: int) -> np.ndarray:
    return np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr.astype(np.int64)))


def _dense_runs(indptr, indices, shape, panel_height: int, dense_threshold: int):
    """Sort the entries by (panel, column).  Returns (order, run_start, run_len, run_key) where the
    runs are the distinct (panel, column) pairs in ascending key order, key = panel * n + column."""
    m, n = shape
    nnz = int(indices.shape[0])
    if nnz == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e, e
    key = (_row_ids(indptr, m) // int(panel_height)) * np.int64(n) + indices.astype(np.int64)
    # stable sort: the rows of a panel are already sorted runs, which the merge sort exploits
    order = np.argsort(key, kind="stable")
    sk = key[order]
    starts = np.flatnonzero(np.concatenate(([True], sk[1:] != sk[:-1])))
    lens = np.diff(np.append(starts, nnz))
    return order, starts, lens, sk[starts]


def dense_mask(A, panel_height: int = 32, dense_threshold: int = 2) -> np.ndarray:
    """Boolean per stored entry of CSR ``A`` (canonical order): True when it lies in a dense tile."""
    order, starts, lens, _ = _dense_runs(A.indptr, A.indices, A.shape, panel_height, dense_threshold)
    mask = np.zeros(A.nnz, dtype=bool)
    if A.nnz:
        mask[order] = np.repeat(lens >= dense_threshold, lens)
    return mask


def dense_ratio(A, panel_height: int = 32, dense_threshold: int = 2) -> float:
    """Fraction of stored entries of ``A`` that fall into ASpT dense tiles (0 for an empty matrix)."""
    if A.nnz == 0:
        return 0.0
    return float(np.count_nonzero(dense_mask(A, panel_height, dense_threshold)) / A.nnz)


@dataclass(frozen=True, eq=False)
class ASpTFormat:
    """ASpT format data of a module's matrix ``A`` (m x n, canonical CSR, current row/col order).

    All arrays are numpy; index arrays are int32 (``*_ptr`` / ``*_pos`` int64).

    Row panels: panel ``p`` holds rows ``[p * panel_height, min((p + 1) * panel_height, m))``;
    ``n_panels = ceil(m / panel_height)``.

    Dense part (one thread block per panel; stage ``X[dense_cols[dense_ptr[p]:dense_ptr[p+1]]]``
    in shared memory, slot s of the panel holding column ``dense_cols[dense_ptr[p] + s]``):

    * ``dense_ptr``  (n_panels + 1): offsets of each panel's dense column list.
    * ``dense_cols`` (total dense columns): column ids (the module's current column numbering),
      ascending inside a panel.
    * ``tile_indptr`` (m + 1): CSR row pointer of the dense entries; panel p's entries are
      ``tile_indptr[p*H] : tile_indptr[min((p+1)*H, m)]`` (rows are contiguous inside a panel).
    * ``tile_slots`` : local column slot (0 .. panel's dense count - 1) of each dense entry, i.e. the
      shared-memory row to read; ascending inside a row.
    * ``tile_data``  : values of the dense entries.
    * ``tile_pos``   : position of each dense entry in ``A``'s CSR arrays (where SDDMM writes).

    Remainder (row-wise CSR over the entries outside dense tiles, one warp per row):

    * ``rem_rows``    : the module row of each remainder row, in *processing order* (only rows that
      keep at least one entry).  Ascending after ``tile.aspt``; ``cluster.lsh`` round 2 permutes it.
    * ``rem_indptr``  (len(rem_rows) + 1), ``rem_indices`` (module column ids, ascending in a row),
      ``rem_data``, ``rem_pos`` (position in ``A``'s CSR arrays).

    Output rule: ``Y[r] = reduce(dense entries of r, remainder entries of r)``; row lengths for
    ``mean`` come from ``A.indptr``; rows with no entries give 0.
    """

    shape: tuple[int, int]
    panel_height: int
    dense_threshold: int
    dense_ptr: np.ndarray
    dense_cols: np.ndarray
    tile_indptr: np.ndarray
    tile_slots: np.ndarray
    tile_data: np.ndarray
    tile_pos: np.ndarray
    rem_rows: np.ndarray
    rem_indptr: np.ndarray
    rem_indices: np.ndarray
    rem_data: np.ndarray
    rem_pos: np.ndarray

    @property
    def n_panels(self) -> int:
        return int(self.dense_ptr.shape[0] - 1)

    @property
    def nnz(self) -> int:
        return int(self.tile_data.shape[0] + self.rem_data.shape[0])

    @property
    def dense_nnz(self) -> int:
        return int(self.tile_data.shape[0])

    @property
    def dense_ratio(self) -> float:
        return self.dense_nnz / self.nnz if self.nnz else 0.0

    def row_lengths(self) -> np.ndarray:
        """Stored entries per module row (dense + remainder)."""
        lens = np.diff(self.tile_indptr).astype(np.int64)
        np.add.at(lens, self.rem_rows, np.diff(self.rem_indptr))
        return lens

    def reorder_remainder(self, perm) -> "ASpTFormat":
        """Permute the processing order of the remainder rows (``perm``: new position -> current
        position in ``rem_rows``).  Dense tiles and the output mapping are unchanged."""
        perm = np.asarray(perm, dtype=np.int64)
        k = self.rem_rows.shape[0]
        if perm.shape != (k,) or not np.array_equal(np.sort(perm), np.arange(k)):
            raise ValueError(f"perm must be a permutation of range({k})")
        ptr = self.rem_indptr.astype(np.int64)
        lens = np.diff(ptr)[perm]
        new_ptr = np.zeros(k + 1, dtype=np.int64)
        np.cumsum(lens, out=new_ptr[1:])
        src = np.arange(int(new_ptr[-1]), dtype=np.int64) - np.repeat(new_ptr[:-1] - ptr[:-1][perm], lens)
        return dataclasses.replace(self, rem_rows=self.rem_rows[perm], rem_indptr=new_ptr,
                                   rem_indices=self.rem_indices[src], rem_data=self.rem_data[src],
                                   rem_pos=self.rem_pos[src])

    def remainder_csr(self):
        """The remainder as a CSR in processing order (row i = module row ``rem_rows[i]``)."""
        from ..core.formats import CSR

        k = int(self.rem_rows.shape[0])
        return CSR(self.rem_indptr.copy(), self.rem_indices.copy(), self.rem_data.copy(), (k, self.shape[1]))

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}


def build_aspt(A, panel_height: int = 32, dense_threshold: int = 2) -> ASpTFormat:
    """Tile CSR ``A`` into an :class:`ASpTFormat` (vectorised: one stable sort of the entries)."""
    panel_height = int(panel_height)
    dense_threshold = int(dense_threshold)
    if panel_height < 1:
        raise ValueError(f"panel_height must be >= 1, got {panel_height}")
    if dense_threshold < 1:
        raise ValueError(f"dense_threshold must be >= 1, got {dense_threshold}")
    m, n = A.shape
    nnz = A.nnz
    n_panels = -(-m // panel_height) if m else 0
    indptr = A.indptr.astype(np.int64)
    order, starts, lens, rkey = _dense_runs(indptr, A.indices, A.shape, panel_height, dense_threshold)
    is_dense_run = lens >= dense_threshold
    dkey = rkey[is_dense_run]
    d_panel = dkey // max(n, 1)
    dense_cols = (dkey - d_panel * n).astype(np.int32)
    dense_ptr = np.zeros(n_panels + 1, dtype=np.int64)
    np.cumsum(np.bincount(d_panel, minlength=n_panels), out=dense_ptr[1:])
    mask = np.zeros(nnz, dtype=bool)
    slot = np.zeros(nnz, dtype=np.int64)
    if nnz:
        mask[order] = np.repeat(is_dense_run, lens)
        # slot of a dense run = its rank among the panel's dense runs
        run_slot = np.cumsum(is_dense_run) - 1
        run_panel = rkey // max(n, 1)
        run_slot = run_slot - dense_ptr[run_panel]
        slot[order] = np.repeat(run_slot, lens)
    rows = _row_ids(indptr, m)
    pos = np.arange(nnz, dtype=np.int64)
    tile_pos = pos[mask]
    tile_indptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows[mask], minlength=m), out=tile_indptr[1:])
    rem = ~mask
    rem_pos = pos[rem]
    rem_counts = np.bincount(rows[rem], minlength=m)
    rem_rows = np.flatnonzero(rem_counts).astype(np.int64)
    rem_indptr = np.zeros(rem_rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(rem_counts[rem_rows], out=rem_indptr[1:])
    return ASpTFormat(shape=(m, n), panel_height=panel_height, dense_threshold=dense_threshold,
                      dense_ptr=dense_ptr, dense_cols=dense_cols, tile_indptr=tile_indptr,
                      tile_slots=slot[mask].astype(np.int32), tile_data=A.data[mask].copy(),
                      tile_pos=tile_pos, rem_rows=rem_rows, rem_indptr=rem_indptr,
                      rem_indices=A.indices[rem].astype(np.int32), rem_data=A.data[rem].copy(),
                      rem_pos=rem_pos)


def _dense_entry_rows_cols(fmt: ASpTFormat):
    m = fmt.shape[0]
    rows = _row_ids(fmt.tile_indptr, m)
    panels = rows // fmt.panel_height
    cols = fmt.dense_cols[fmt.dense_ptr[panels] + fmt.tile_slots].astype(np.int64)
    return rows, cols


def _rem_entry_rows(fmt: ASpTFormat):
    return np.repeat(fmt.rem_rows, np.diff(fmt.rem_indptr))


def aspt_spmm(fmt: ASpTFormat, X: np.ndarray, reduce: str = "sum") -> np.ndarray:
    """Execute the ASpT format in numpy (float64): dense tiles read X through each panel's staged
    column list, the remainder row-wise; results are combined with ``reduce``."""
    X = np.asarray(X, dtype=np.float64)
    m = fmt.shape[0]
    K = X.shape[1]
    d_rows, d_cols = _dense_entry_rows_cols(fmt)
    # staged shared-memory copy per panel: X_s[dense_ptr[p] + slot] == X[dense_cols[...]]
    Xs = X[fmt.dense_cols.astype(np.int64)]
    d_vals = fmt.tile_data.astype(np.float64)[:, None] * Xs[fmt.dense_ptr[d_rows // fmt.panel_height] + fmt.tile_slots]
    r_rows = _rem_entry_rows(fmt)
    r_vals = fmt.rem_data.astype(np.float64)[:, None] * X[fmt.rem_indices.astype(np.int64)]
    rows = np.concatenate([d_rows, r_rows])
    vals = np.concatenate([d_vals, r_vals]) if rows.size else np.zeros((0, K))
    lens = np.bincount(rows, minlength=m)
    if reduce in ("sum", "mean"):
        Y = np.zeros((m, K))
        np.add.at(Y, rows, vals)
        if reduce == "mean":
            Y /= np.maximum(lens, 1)[:, None]
        return Y
    if reduce not in ("max", "min"):
        raise ValueError(f"unknown reduce {reduce!r}")
    ufunc = np.maximum if reduce == "max" else np.minimum
    Y = np.full((m, K), -np.inf if reduce == "max" else np.inf)
    ufunc.at(Y, rows, vals)
    Y[lens == 0] = 0.0
    return Y


def aspt_sddmm(fmt: ASpTFormat, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Execute SDDMM on the ASpT format (float64); output in ``A``'s CSR order."""
    X = np.asarray(X, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    out = np.zeros(fmt.nnz)
    d_rows, d_cols = _dense_entry_rows_cols(fmt)
    out[fmt.tile_pos] = fmt.tile_data * np.einsum("ij,ij->i", X[d_rows], Y[d_cols])
    r_rows = _rem_entry_rows(fmt)
    out[fmt.rem_pos] = fmt.rem_data * np.einsum("ij,ij->i", X[r_rows], Y[fmt.rem_indices.astype(np.int64)])
    return out


@register_pass("tile.aspt")
class TileASpT(Pass):
    """Adaptive sparse tiling: per row panel, dense columns -> shared-memory tiles, rest -> CSR."""

    default_options = {"panel_height": 32, "dense_threshold": 2}
    produces = ("aspt",)

    def transform(self, mod, ctx):
        t0 = time.perf_counter()
        fmt = build_aspt(mod.A, self.options["panel_height"], self.options["dense_threshold"])
        nd = int(fmt.dense_cols.shape[0])
        return mod.with_format("aspt", fmt).with_metrics(self.name, {
            "dense_ratio": fmt.dense_ratio,
            "dense_nnz": fmt.dense_nnz,
            "dense_cols": nd,
            "panels": fmt.n_panels,
            "avg_dense_col_reuse": (fmt.dense_nnz / nd) if nd else 0.0,
            "remainder_rows": int(fmt.rem_rows.shape[0]),
            "seconds": time.perf_counter() - t0,
        })
