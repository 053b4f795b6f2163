"""numpy emulation of the csr family's kernels over their packed arrays (what tests run on
machines without a GPU to check the packers and launch shapes against the float64 reference).

Each emulation follows its kernel's data flow in fp32: which segment reads which nonzeros, where
each result is written (caller's order), which columns a launch covers, how split rows combine.
Outputs start NaN: whatever the kernel would leave unwritten stays NaN.  A write past the last
column raises (the kernel would write out of bounds).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ...core.numerics import round_to
from .packer import WARP_ROW, WARP_SLICES, ell_split

__all__ = ["spmm_columns", "spmm_segments", "sddmm_columns", "emulate_spmm", "emulate_sddmm", "emulate_kernel"]

_UFUNC = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}
_INIT = {"sum": 0.0, "mean": 0.0, "max": -np.inf, "min": np.inf}


def _lane_columns(K: int, starts: np.ndarray, vec: int) -> np.ndarray:
    """Columns written / read by vector accesses at ``starts`` (those with start < K, as the
    kernels guard them), each ``vec`` wide; ValueError when one reaches past column K - 1."""
    starts = starts[starts < K]
    cols = (starts[:, None] + np.arange(vec)).ravel()
    if cols.size and cols.max() >= K:
        raise ValueError(f"a {vec}-wide access at column {int(starts.max())} reaches past K = {K}")
    return cols


def spmm_columns(K: int, group: int, vec: int, cf: int, tiles: int) -> np.ndarray:
    """How often each of the K columns is written by a ``spmm_crc_cwm`` launch with ``tiles``
    column tiles (grid.y): lane l of tile t writes ``vec`` columns at
    ``t * group * vec * cf + c * group * vec + l * vec`` for c < cf."""
    t, c, lane = np.meshgrid(np.arange(tiles), np.arange(cf), np.arange(group), indexing="ij")
    starts = (t * group * vec * cf + c * group * vec + lane * vec).ravel()
    return np.bincount(_lane_columns(K, starts, vec), minlength=K)


def sddmm_columns(K: int, group: int, vec: int, xc: int) -> np.ndarray:
    """How often each column enters one ``sddmm_csr`` dot product: lane l reads ``vec`` columns
    at ``t + c * group * vec + l * vec`` for c < xc and tiles t = 0, TILE, ... below K."""
    tile = group * vec * xc
    t, c, lane = np.meshgrid(np.arange(0, max(K, 1), tile), np.arange(xc), np.arange(group), indexing="ij")
    return np.bincount(_lane_columns(K, (t + c * group * vec + lane * vec).ravel(), vec), minlength=K)


def spmm_segments(arrays: Mapping[str, np.ndarray], groups: int, segs_per_group: int) -> np.ndarray:
    """Which segments a ``spmm_crc_cwm`` launch of ``groups`` row groups (grid.x x groups per
    block) processes: group g takes segments ``grp_seg[g] .. grp_seg[g + 1] - 1`` (flat layout,
    ``grp_seg`` not empty; groups past its end return) or ``g * segs_per_group`` onwards."""
    nseg = int(np.asarray(arrays["seg_out"]).size)
    grp_seg = np.asarray(arrays["grp_seg"], dtype=np.int64)
    if grp_seg.size:
        last = grp_seg[min(groups, grp_seg.size - 1)]
        return np.arange(nseg) < last
    return np.arange(nseg) < groups * max(1, int(segs_per_group))


def emulate_spmm(arrays: Mapping[str, np.ndarray], X: np.ndarray, reduce: str, m: int,
                 columns: np.ndarray | None = None, dtype: str = "float32",
                 segments: np.ndarray | None = None, ell: int = 0) -> np.ndarray:
    """Y (m x K) as ``spmm_crc_cwm`` computes it from its arrays: per segment the reduction of
    ``data[p] * X[indices[p]]`` over its nonzeros; whole-row segments write row ``seg_out``
    (0 for an empty row, mean scaled by the row length); slices of split rows write their
    partial to ``part[seg_slot]``, and a row group is combined in slot order (and written to
    ``grp_out``) once all its slots (``slot_grp``) have arrived.  ``columns``: per column the
    number of writes of the launch (:func:`spmm_columns`); columns never written stay NaN.
    ``segments``: the segments the launch processes (:func:`spmm_segments`); the others write
    nothing (their rows stay NaN, their split rows are never combined).  Slices flagged
    ``WARP_SLICES`` (one warp's row groups) are reduced into their shared slot first, and runs of
    ``WARP_ROW`` slices of one output row into that row.  ``ell`` > 0 (ELL rows, FL = 4):
    ``indices`` holds ``ell`` column ids a segment, of which the kernel reads the first
    ``seg_ptr[s + 1] - seg_ptr[s]`` (ValueError for a longer segment: it would read past them)."""
    X = np.asarray(X, dtype=np.float32)
    K = X.shape[1]
    a = {k: np.asarray(v) for k, v in arrays.items()}
    seg_ptr = a["seg_ptr"].astype(np.int64)
    lens = np.diff(seg_ptr)
    if ell:
        a["indices"] = ell_split(a["indices"], lens, ell)[0]
    ufunc, init = _UFUNC[reduce], np.float32(_INIT[reduce])
    prod = a["data"].astype(np.float32)[:, None] * X[a["indices"]]
    acc = np.full((lens.size, K), init, dtype=np.float32)
    nonempty = lens > 0
    if nonempty.any():
        acc[nonempty] = ufunc.reduceat(prod, seg_ptr[:-1][nonempty], axis=0)

    Y = np.full((m, K), np.nan, dtype=np.float32)
    cols = np.arange(K) if columns is None else np.flatnonzero(columns)

    def store(rows, vals, length):
        vals = vals.copy()
        if reduce == "mean":
            vals *= (np.float32(1.0) / np.maximum(length, 1).astype(np.float32))[:, None]
        vals[length == 0] = 0.0
        Y[np.ix_(rows, cols)] = vals[:, cols]

    ran = np.ones(lens.size, bool) if segments is None else np.asarray(segments, bool)
    raw = a["seg_slot"].astype(np.int64)
    whole = raw == -1
    store(a["seg_out"][whole & ran], acc[whole & ran], lens[whole & ran])
    # WARP_ROW slices: a warp's consecutive segments of one row, reduced and written as the row
    wr = np.flatnonzero((raw == WARP_ROW) & ran)
    if wr.size:
        starts = np.flatnonzero(np.diff(a["seg_out"][wr], prepend=-1) != 0)
        store(a["seg_out"][wr[starts]], ufunc.reduceat(acc[wr], starts, axis=0), np.add.reduceat(lens[wr], starts))
    # slices flagged WARP_SLICES share their warp's slot: reduced together before it is written
    slot_of = np.where(raw >= WARP_SLICES, raw - WARP_SLICES, raw)
    sel = (raw >= 0) & ran
    part = np.full((a["slot_grp"].size, K), np.nan, dtype=np.float32)
    order = np.argsort(slot_of[sel], kind="stable")
    slots, start = np.unique(slot_of[sel][order], return_index=True)
    if slots.size:
        part[slots] = ufunc.reduceat(acc[sel][order], start, axis=0)
    grp_ptr = a["grp_ptr"].astype(np.int64)
    nslots = np.diff(grp_ptr)
    if nslots.size:
        # the last slice of a group to arrive (counted through slot_grp) combines slots
        # grp_ptr[g] .. grp_ptr[g + 1] in slot order
        arrived = np.bincount(a["slot_grp"][slots], minlength=nslots.size)
        done = (arrived == nslots) & (nslots > 0)
        combined = ufunc.reduceat(part, np.minimum(grp_ptr[:-1], max(part.shape[0] - 1, 0)), axis=0)
        store(a["grp_out"][done], combined[done], a["grp_len"][done])
    return round_to(Y, dtype) if dtype != "float32" else Y


def emulate_sddmm(arrays: Mapping[str, np.ndarray], X: np.ndarray, Y: np.ndarray, nnz: int,
                  columns: np.ndarray | None = None, dtype: str = "float32", flat: bool = False) -> np.ndarray:
    """out (nnz) as ``sddmm_csr`` computes it: for every position p of every segment s,
    ``out[nnz_ids[p]] = data[p] * dot(X[row], Y[indices[p]])`` in fp32, ``row`` the segment's
    ``seg_xrow[s]`` (``flat``: the entry's own ``nnz_row[p]``, the kernel's FLAT = 1), the dot over
    the columns each read ``columns[j]`` times (:func:`sddmm_columns`); positions no segment
    covers stay NaN."""
    X = np.asarray(X, dtype=np.float32)
    Y = np.asarray(Y, dtype=np.float32)
    a = {k: np.asarray(v) for k, v in arrays.items()}
    seg_ptr = a["seg_ptr"].astype(np.int64)
    lens = np.diff(seg_ptr)
    seg = np.repeat(np.arange(lens.size), lens)
    p = seg_ptr[:-1][seg] + (np.arange(seg.size) - (np.cumsum(lens) - lens)[seg])
    xrow = a["nnz_row"][p] if flat else a["seg_xrow"][seg]
    w = np.ones(X.shape[1], np.float32) if columns is None else np.asarray(columns, np.float32)
    dots = np.einsum("ij,ij,j->i", X[xrow], Y[a["indices"][p]], w, dtype=np.float32)
    out = np.full(nnz, np.nan, dtype=np.float32)
    out[a["nnz_ids"][p]] = a["data"][p].astype(np.float32) * dots
    return round_to(out, dtype) if dtype != "float32" else out


def emulate_kernel(kernel, *inputs, fallback: bool = False) -> np.ndarray:
    """Run a built ``csr.crc_cwm`` / ``csr.sddmm`` kernel (no binary needed) through the numpy
    emulation with the columns its launch covers: its main instance, or with ``fallback`` its
    ``VEC = 1`` instance."""
    p, meta = kernel.params, kernel.meta
    vec = 1 if fallback else int(meta["vec"])
    K, dtype = int(meta["K"]), meta.get("dtype", "float32")
    if kernel.template == "csr.crc_cwm":
        reduce = {0: "sum", 1: "max", 2: "min", 3: "mean"}[int(meta["instances"][0][1][1])]
        spec = kernel.launch_spec(vec)
        cols = spmm_columns(K, int(p["group"]), vec, int(p["cf"]), spec.grid[1])
        segs = spmm_segments(kernel.arrays, spec.grid[0] * (spec.block[0] // int(p["group"])),
                             int(p["rows_per_warp"]))
        fl, width = int(meta["instances"][0][1][6]), int(meta["instances"][0][1][5])
        return emulate_spmm(kernel.arrays, inputs[0], reduce, int(meta["m"]), cols, dtype, segs,
                            ell=width if fl == 4 else 0)
    cols = sddmm_columns(K, int(p["group"]), vec, int(p["k_chunks"]))
    flat = bool(int(meta["instances"][0][1][4]))        # the compiled FLAT argument
    return emulate_sddmm(kernel.arrays, *inputs, int(kernel.arrays["data"].size), cols, dtype, flat)
