"""``tile.sgt``: TC-GNN's Sparse Graph Translation (Wang et al., ATC'23, Algorithm 1).

Rows are cut into windows of ``BLK_H`` consecutive rows.  Inside a window the distinct column
ids of its nonzeros are sorted and renumbered 0, 1, 2, ... ("condensed" columns); consecutive
groups of ``BLK_W`` condensed columns form the window's tensor-core (TC) blocks.  No row or
column is permuted, so the module's matrix is unchanged; the result is stored as an
:class:`SGTFormat` in ``mod.formats["sgt"]``.

Metrics (``mod.metrics["tile.sgt"]``): ``blocks_before`` (nonempty ``BLK_H x BLK_W`` blocks of
the original column layout, what a TC kernel without SGT traverses), ``blocks_after`` (TC
blocks after SGT, ``sum(winPartition)``), ``reduction`` (``1 - after / before``; TC-GNN Fig. 7
reports 67.47% on average), block densities before/after, ``reuse`` (nonzeros per distinct
(window, column) pair: how many nonzeros one gathered row of the dense operand serves in a
window; 1.0 when no two rows of a window share a column), ``nnz_per_block``, ``seconds``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .base import Pass, register_pass

__all__ = ["SGTFormat", "SHAPES", "sgt_translate", "SGTPass"]

#: MMA operand shapes (BLK_H, BLK_W) by name.  TC-GNN uses 16x8 (TF-32 ``A`` operand) for SpMM
#: and 16x16 (the result tile) for SDDMM; fp16 WMMA takes 16x16 ``A`` operands.
SHAPES = {"tf32": (16, 8), "sddmm": (16, 16), "fp16": (16, 16)}


def _index_dtype(max_value: int) -> np.dtype:
    return np.dtype(np.int32) if max_value <= np.iinfo(np.int32).max else np.dtype(np.int64)


def _small_dtype(max_value: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.int32):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


@dataclass(frozen=True, eq=False)
class SGTFormat:
    """The SGT-translated layout of an ``m x n`` CSR matrix (its canonical nonzero order).

    Windows ``w = 0 .. num_windows-1`` cover rows ``[w*BLK_H, min((w+1)*BLK_H, m))``; TC blocks
    are numbered globally, window by window.  Per nonzero ``p`` (CSR order, = TC-GNN's edgeList
    order) of row ``i`` and column ``j``:

    * ``edge_to_col[p]``: condensed column slot of ``j`` within window ``w = i // BLK_H``
      (``col_map[win_col_ptr[w] + edge_to_col[p]] == j``) -- TC-GNN's ``edgeToCol``;
    * ``block_id[p] = win_block_ptr[w] + edge_to_col[p] // BLK_W``: its TC block;
    * ``block_row[p] = i % BLK_H``, ``block_col[p] = edge_to_col[p] % BLK_W``: its position in
      that block's dense ``BLK_H x BLK_W`` tile.

    Per window: ``win_partition[w]`` (number of TC blocks, TC-GNN's ``winPartition``),
    ``win_block_ptr`` (exclusive prefix sum of it, length ``num_windows + 1``), ``win_col_ptr``
    (offsets of each window's unique columns in ``col_map``, length ``num_windows + 1``),
    ``col_map`` (sorted unique original column ids of each window, concatenated).

    Per TC block ``b``: ``block_cols[b, c]`` is the original column (= row of the dense operand
    ``X``) feeding tile column ``c``, ``-1`` for padding in a window's last block (TC-GNN's
    ``sparse_AToX_index``); ``block_window[b]`` its window.  ``block_nnz_ptr`` /
    ``block_nnz_order``: the nonzeros grouped by block (inside a block sorted by column, then
    row): block ``b`` holds nonzeros ``block_nnz_order[block_nnz_ptr[b]:block_nnz_ptr[b+1]]``,
    which a kernel scatters into a zeroed tile at ``(block_row, block_col)``.
    """

    BLK_H: int
    BLK_W: int
    shape: tuple[int, int]
    win_partition: np.ndarray
    win_block_ptr: np.ndarray
    win_col_ptr: np.ndarray
    col_map: np.ndarray
    edge_to_col: np.ndarray
    block_id: np.ndarray
    block_row: np.ndarray
    block_col: np.ndarray
    block_cols: np.ndarray
    block_window: np.ndarray
    block_nnz_ptr: np.ndarray
    block_nnz_order: np.ndarray

    @property
    def num_windows(self) -> int:
        return int(self.win_partition.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.block_cols.shape[0])

    @property
    def nnz(self) -> int:
        return int(self.edge_to_col.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays by field name (for saving; ``BLK_H``/``BLK_W``/``shape`` are scalars)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__
                if isinstance(getattr(self, k), np.ndarray)}

    @classmethod
    def from_arrays(cls, BLK_H: int, BLK_W: int, shape, arrays) -> "SGTFormat":
        """Rebuild from :meth:`arrays` (e.g. after saving them to an ``.npz``)."""
        return cls(BLK_H=int(BLK_H), BLK_W=int(BLK_W), shape=tuple(int(s) for s in shape),
                   **{k: np.asarray(arrays[k]) for k in cls.__dataclass_fields__
                      if k not in ("BLK_H", "BLK_W", "shape")})

    def dense_tiles(self, data: np.ndarray, dtype=None) -> np.ndarray:
        """The ``(num_blocks, BLK_H, BLK_W)`` dense tiles holding ``data`` (one value per
        nonzero, CSR order), exactly what a WMMA kernel loads as its ``A`` fragments."""
        data = np.asarray(data)
        tiles = np.zeros((self.num_blocks, self.BLK_H, self.BLK_W), dtype=dtype or data.dtype)
        tiles[self.block_id, self.block_row, self.block_col] = data
        return tiles

    def _gather_rows(self, X: np.ndarray) -> np.ndarray:
        """``X[block_cols]`` with zero rows for padding: ``(num_blocks, BLK_W, K)``."""
        Xp = np.concatenate([X, np.zeros((1,) + X.shape[1:], dtype=X.dtype)], axis=0)
        return Xp[np.where(self.block_cols < 0, X.shape[0], self.block_cols)]

    def spmm(self, data: np.ndarray, X: np.ndarray) -> np.ndarray:
        """Reference executor: ``A @ X`` computed tile by tile as TC-GNN's Algorithm 2 does
        (per block ``ATile @ X[block_cols]``, summed over a window's blocks).  For tests and
        small matrices: it materialises every tile."""
        m, n = self.shape
        X = np.asarray(X)
        if X.ndim != 2 or X.shape[0] != n:
            raise ValueError(f"X must have shape ({n}, K), got {X.shape}")
        dt = np.result_type(np.asarray(data).dtype, X.dtype)
        K = X.shape[1]
        out = np.zeros((self.num_windows, self.BLK_H, K), dtype=dt)
        if self.num_blocks:
            prod = np.matmul(self.dense_tiles(data, dt), self._gather_rows(X).astype(dt, copy=False))
            np.add.at(out, self.block_window, prod)
        return out.reshape(-1, K)[:m]

    def sddmm(self, data: np.ndarray, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
        """Reference executor: ``out[p] = data[p] * dot(X[i], Y[j])`` via dense result tiles
        ``X[window rows] @ Y[block_cols].T`` sampled at each nonzero's tile position."""
        m, n = self.shape
        X, Y = np.asarray(X), np.asarray(Y)
        if X.ndim != 2 or Y.ndim != 2 or X.shape[0] != m or Y.shape[0] != n or X.shape[1] != Y.shape[1]:
            raise ValueError(f"X must be ({m}, K) and Y ({n}, K), got {X.shape} and {Y.shape}")
        dt = np.result_type(np.asarray(data).dtype, X.dtype, Y.dtype)
        K = X.shape[1]
        Xw = np.zeros((self.num_windows * self.BLK_H, K), dtype=dt)
        Xw[:m] = X
        Xw = Xw.reshape(self.num_windows, self.BLK_H, K)
        tiles = np.matmul(Xw[self.block_window], np.swapaxes(self._gather_rows(Y.astype(dt)), 1, 2))
        return np.asarray(data, dtype=dt) * tiles[self.block_id, self.block_row, self.block_col]


def sgt_translate(indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int], BLK_H: int = 16,
                  BLK_W: int = 8) -> tuple[SGTFormat, int]:
    """Algorithm 1 of TC-GNN on a canonical CSR pattern, vectorised over all windows at once.
    Returns the format and ``blocks_before`` (nonempty blocks without SGT)."""
    m, n = int(shape[0]), int(shape[1])
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices)
    nnz = int(indices.shape[0])
    num_windows = -(-m // BLK_H)
    n1 = max(n, 1)
    itype = _index_dtype(max(nnz, n1, m))
    # per-window edge ranges (TC-GNN's winStart / winEnd); per nonzero its window
    win_edge_ptr = indptr[np.minimum(np.arange(num_windows + 1, dtype=np.int64) * BLK_H, m)]
    win_nnz = np.diff(win_edge_ptr)
    win = np.repeat(np.arange(num_windows, dtype=itype), win_nnz)
    # Sort + Deduplication of every window at once on (window, column) keys; each row is a
    # sorted run, so the stable (merge) sort is cheap.
    key = win.astype(np.int64) * n1
    key += indices
    order = np.argsort(key, kind="stable")
    sk = key[order]
    del key
    new = np.empty(nnz, dtype=bool)
    if nnz:
        new[0] = True
        np.not_equal(sk[1:], sk[:-1], out=new[1:])
    ukeys = sk[new]
    del sk
    uwin = ukeys // n1
    col_map = (ukeys - uwin * n1).astype(_index_dtype(max(n - 1, 0)))
    win_ncols = np.bincount(uwin, minlength=num_windows).astype(np.int64)
    win_col_ptr = np.zeros(num_windows + 1, dtype=np.int64)
    np.cumsum(win_ncols, out=win_col_ptr[1:])
    # edgeToCol: global unique index of every nonzero minus its window's first one
    gidx = np.empty(nnz, dtype=itype)
    gidx[order] = np.cumsum(new, dtype=itype) - 1
    del new
    edge_to_col = gidx - np.repeat(win_col_ptr[:-1].astype(itype), win_nnz)
    del gidx
    win_partition = -(-win_ncols // BLK_W)
    win_block_ptr = np.zeros(num_windows + 1, dtype=np.int64)
    np.cumsum(win_partition, out=win_block_ptr[1:])
    num_blocks = int(win_block_ptr[-1])
    btype = _index_dtype(max(nnz, num_blocks, n1, m))
    block_id = edge_to_col // BLK_W
    block_id = block_id.astype(btype, copy=False)
    block_id += np.repeat(win_block_ptr[:-1].astype(btype), win_nnz)
    # block column map: slot s of window w -> block win_block_ptr[w] + s // BLK_W, column s % BLK_W
    block_cols = np.full((num_blocks, BLK_W), -1, dtype=_index_dtype(max(n, 1)))
    uslot = np.arange(ukeys.shape[0], dtype=np.int64) - win_col_ptr[uwin]
    block_cols[win_block_ptr[uwin] + uslot // BLK_W, uslot % BLK_W] = col_map
    block_window = np.repeat(np.arange(num_windows, dtype=btype), win_partition)
    # nonzeros grouped by block: the (window, column) sort order already groups them, since a
    # window's slots increase with the column (inside a block: by column, then by row)
    block_nnz_ptr = np.zeros(num_blocks + 1, dtype=btype)
    np.cumsum(np.bincount(block_id, minlength=num_blocks), out=block_nnz_ptr[1:])
    block_nnz_order = order.astype(btype)
    block_row = np.repeat((np.arange(m, dtype=np.int64) % BLK_H).astype(_small_dtype(BLK_H - 1)),
                          np.diff(indptr))
    # blocks without SGT: distinct (window, column // BLK_W) pairs; ukeys is sorted by
    # (window, column), so distinct pairs are the changes along it.
    if ukeys.shape[0]:
        bkey = uwin * (-(-n1 // BLK_W)) + col_map.astype(np.int64) // BLK_W
        blocks_before = int(1 + np.count_nonzero(bkey[1:] != bkey[:-1]))
    else:
        blocks_before = 0

    fmt = SGTFormat(
        BLK_H=int(BLK_H), BLK_W=int(BLK_W), shape=(m, n),
        win_partition=win_partition.astype(btype), win_block_ptr=win_block_ptr.astype(btype),
        win_col_ptr=win_col_ptr.astype(btype), col_map=col_map, edge_to_col=edge_to_col,
        block_id=block_id, block_row=block_row,
        block_col=(edge_to_col % BLK_W).astype(_small_dtype(BLK_W - 1)),
        block_cols=block_cols, block_window=block_window,
        block_nnz_ptr=block_nnz_ptr, block_nnz_order=block_nnz_order)
    for a in fmt.arrays().values():
        a.setflags(write=False)
    return fmt, blocks_before


@register_pass("tile.sgt", produces=("sgt",))
class SGTPass(Pass):
    """TC-GNN sparse graph translation: row windows condensed into dense tensor-core blocks."""

    # shape "auto": "sddmm" (16x16) for SDDMM ops, else "tf32" (16x8).  BLK_H / BLK_W, when
    # given, override the shape preset.
    default_options = {"shape": "auto", "BLK_H": None, "BLK_W": None}
    produces = ("sgt",)

    def _block_shape(self, op: str) -> tuple[int, int]:
        shape = self.options["shape"]
        if shape == "auto":
            shape = "sddmm" if op == "sddmm" else "tf32"
        if shape not in SHAPES:
            raise ValueError(f"tile.sgt: unknown shape {shape!r}; expected 'auto' or one of {sorted(SHAPES)}")
        h, w = SHAPES[shape]
        out = []
        for name, default in (("BLK_H", h), ("BLK_W", w)):
            v = self.options[name]
            v = default if v is None else v
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"tile.sgt: {name} must be a positive int, got {v!r}")
            out.append(int(v))
        return out[0], out[1]

    def transform(self, mod, ctx):
        BLK_H, BLK_W = self._block_shape(mod.op.op)
        t0 = time.perf_counter()
        A = mod.A
        fmt, before = sgt_translate(A.indptr, A.indices, A.shape, BLK_H, BLK_W)
        seconds = time.perf_counter() - t0
        after = fmt.num_blocks
        cap = float(BLK_H * BLK_W)
        metrics = {
            "BLK_H": BLK_H, "BLK_W": BLK_W, "windows": fmt.num_windows, "nnz": A.nnz,
            "blocks_before": before, "blocks_after": after,
            "reduction": (1.0 - after / before) if before else 0.0,
            "density_before": A.nnz / (before * cap) if before else 0.0,
            "density_after": A.nnz / (after * cap) if after else 0.0,
            "reuse": A.nnz / fmt.col_map.shape[0] if fmt.col_map.shape[0] else 0.0,
            "nnz_per_block": A.nnz / after if after else 0.0,
            "seconds": seconds,
        }
        return mod.with_format("sgt", fmt).with_metrics(self.name, metrics)
