"""Host arrays of ``sptc.vnm`` (``sptc_vnm.cu``), built vectorised from the module's CSR in the
caller's order (row_ids / col_perm folded in).  Array names are the kernels' parameter names.

* 16-row windows x 32-column tiles in one of two packings (``PACKS``): ``block`` (the nonempty
  32-column blocks of the current order, the first two entries of every 4-column chunk kept, the
  rest in a CSR remainder) or ``condensed`` (per window its distinct columns, grouped 2:4 by
  :func:`condense_windows`; no remainder);
* per tile the lanes' A fragments (``frag``: 32 lanes x 8 fp16 / bf16 values, layout
  :func:`fragment_index`), metadata words (``meta``: 16 uint32, layout ``META_LAYOUT``, see
  :func:`_meta_words`) and the 32 original X rows of its columns (``ccol``, -1: unused);
* ``row_scale`` (per current row a power of two the stored values are divided by: fp16 range),
  ``row_ids`` (original row of every current row);
* the CSR remainder ``rem_ptr`` / ``rem_rows`` / ``rem_cols`` / ``rem_vals`` (fp32, original
  rows and columns);
* the work items ``items`` (window, first tile, end tile, split number) and ``zero_rows`` (the
  original rows of split windows), for a ``split`` limit of tiles per item;
* ``win_ptr`` (tiles of every window): read by the packing and the emulation only.
"""
from __future__ import annotations

import numpy as np

from ...core import numerics
from ...core.ir import SparseModule
from ..base import csr_kernel_arrays

__all__ = ["PRECISIONS", "PACKS", "META_LAYOUT", "fragment_index", "pack_tiles", "condense_windows",
           "pack_arrays", "sptc_arrays"]

#: the MMA operand precisions of mma.sp (kernel code P: :data:`spcompile.core.numerics.PRECISIONS`)
PRECISIONS = {p: numerics.PRECISIONS[p] for p in ("fp16", "bf16")}
PACKS = ("condensed", "block")
#: metadata word layout of the lanes (PTX ISA m16n8k32 metadata figure, sparsity selector 0):
#: thread t < 2 of quad g holds the chunks of columns 16t .. 16t + 15 of row g in bits 0..15 and
#: those of row g + 8 in bits 16..31 ("rowwise", thread 0 = row g, 1 = row g + 8, is kept for the
#: GPU probe test)
META_LAYOUT = "split16"


def value_bits(v: np.ndarray, precision: str) -> np.ndarray:
    """Bit patterns (uint16) of ``v`` rounded to the operand ``precision`` (round to nearest even)."""
    if precision == "fp16":
        return np.asarray(v, dtype=np.float32).astype(np.float16).view(np.uint16)
    return numerics.bf16_bits(v)


def fragment_index():
    """``(R, C)``: int arrays (32, 8); element i of lane ``4g + t``'s A fragment is compressed
    tile entry ``(R, C)`` (m16n8k16 A layout: a0,a1 row g cols 2t, 2t+1; a2,a3 row g + 8; a4..a7
    the same 8 columns further)."""
    lane = np.arange(32)[:, None]
    i = np.arange(8)[None, :]
    g, t = lane >> 2, lane & 3
    R = g + 8 * ((i >> 1) & 1)
    C = 2 * t + (i & 1) + 8 * (i >> 2)
    return np.broadcast_to(R, (32, 8)).copy(), np.broadcast_to(C, (32, 8)).copy()


def _meta_words(rowword: np.ndarray, layout: str) -> np.ndarray:
    """(ntiles, 16) uint32 row words (chunk j at bits 4j) -> (ntiles, 16) lane words (index 2g + t)."""
    rw = rowword.astype(np.uint64)
    lo, hi = rw[:, :8], rw[:, 8:]
    out = np.empty((rw.shape[0], 8, 2), np.uint64)
    if layout == "split16":
        out[:, :, 0] = (lo & 0xFFFF) | ((hi & 0xFFFF) << 16)
        out[:, :, 1] = (lo >> 16) | ((hi >> 16) << 16)
    elif layout == "rowwise":
        out[:, :, 0], out[:, :, 1] = lo, hi
    else:
        raise ValueError(f"unknown metadata layout {layout!r}")
    return out.reshape(-1, 16).astype(np.uint32)


def _row_words(meta: np.ndarray, layout: str) -> np.ndarray:
    """Inverse of :func:`_meta_words`."""
    mw = np.asarray(meta, dtype=np.uint64).reshape(-1, 8, 2)
    rw = np.empty((mw.shape[0], 16), np.uint64)
    if layout == "split16":
        rw[:, :8] = (mw[:, :, 0] & 0xFFFF) | ((mw[:, :, 1] & 0xFFFF) << 16)
        rw[:, 8:] = (mw[:, :, 0] >> 16) | ((mw[:, :, 1] >> 16) << 16)
    else:
        rw[:, :8], rw[:, 8:] = mw[:, :, 0], mw[:, :, 1]
    return rw.astype(np.uint32)


def pack_tiles(tile, rr, j, idx, slot, val_bits, ntiles, layout=META_LAYOUT):
    """``frag`` (ntiles*32*4 uint32), ``meta`` (ntiles*16 uint32) and the entry list ``nz_ptr`` /
    ``nz`` (fragment position | value bits << 16, grouped by tile) from the kept entries: tile id,
    row in tile, chunk j (0..7), position in chunk (0..3), slot (0/1; the chunk's entries in column
    order) and value bits (uint16).  A chunk with one entry at position 3 moves it to slot 1."""
    tile = np.asarray(tile, np.int64)
    rr, j, idx, slot = (np.asarray(a, np.int64) for a in (rr, j, idx, slot))
    cell = (tile * 16 + rr) * 8 + j
    # does the chunk hold a second kept entry?
    has2 = np.zeros(ntiles * 128, bool)
    has2[cell[slot == 1]] = True
    single = (slot == 0) & ~has2[cell]
    slot = np.where(single & (idx == 3), 1, slot)
    I0 = np.zeros(ntiles * 128, np.uint32)
    I1 = np.ones(ntiles * 128, np.uint32)
    s0, s1 = slot == 0, slot == 1
    I0[cell[s0]] = idx[s0]
    I1[cell[s1]] = idx[s1]
    lone = single & (idx < 3)
    I1[cell[lone]] = 3                                # zero value at position 3
    lone3 = single & (idx == 3)
    I0[cell[lone3]] = 2                               # zero value at position 2, the entry in slot 1
    nib = (I0 | (I1 << 2)).reshape(ntiles, 16, 8)
    rowword = np.zeros((ntiles, 16), np.uint32)
    for q in range(8):
        rowword |= nib[:, :, q] << np.uint32(4 * q)
    meta = _meta_words(rowword, layout)
    vals = np.zeros((ntiles, 16, 16), np.uint16)
    vals[tile, rr, 2 * j + slot] = val_bits
    R, C = fragment_index()
    frag = vals[:, R, C]                                # (ntiles, 32, 8) uint16
    inv = np.empty(256, np.int64)
    inv[(R * 16 + C).ravel()] = np.arange(256)
    pos = inv[rr * 16 + 2 * j + slot]
    o = np.argsort(tile, kind="stable")
    nz = (pos[o].astype(np.uint32) | (np.asarray(val_bits, np.uint32)[o] << np.uint32(16))).astype(np.uint32)
    nz_ptr = np.concatenate([[0], np.cumsum(np.bincount(tile, minlength=ntiles))]).astype(np.int32)
    return (np.ascontiguousarray(frag).reshape(-1).view(np.uint32).copy(),
            np.ascontiguousarray(meta.reshape(-1)), nz_ptr, nz)


def _entries(mod: SparseModule):
    """Stored entries of ``mod.A`` (current order) sorted by (row, col), values scaled for ``mean``,
    plus the original row of every current row and the original column of every current column."""
    A = mod.A
    m, n = A.shape
    ka = csr_kernel_arrays(mod, np.int32)
    lens = np.diff(np.asarray(A.indptr, np.int64))
    rows = np.repeat(np.arange(m, dtype=np.int64), lens)
    cols = np.asarray(A.indices, np.int64)
    data = np.asarray(A.data, np.float32)
    if mod.op.reduce == "mean":
        data = (data / np.repeat(np.maximum(lens, 1), lens)).astype(np.float32)
    key = rows * (n + 1) + cols
    if key.size and np.any(key[1:] < key[:-1]):
        o = np.argsort(key, kind="stable")
        rows, cols, data = rows[o], cols[o], data[o]
    row_ids = np.asarray(ka["row_ids"], np.int64)
    col_map = np.arange(n, dtype=np.int64) if mod.col_perm is None else np.asarray(mod.col_perm, np.int64)
    return rows, cols, data, row_ids, col_map, m, n


def _rank_in_groups(key: np.ndarray) -> np.ndarray:
    """Rank of every element among the equal keys before it (``key`` sorted)."""
    nnz = key.size
    if not nnz:
        return np.zeros(0, np.int64)
    first = np.ones(nnz, bool)
    first[1:] = key[1:] != key[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(nnz), 0))
    return np.arange(nnz) - start


def condense_windows(rows: np.ndarray, cols: np.ndarray, m: int):
    """Window-local column condensing (TC-GNN's SGT idea, made 2:4 by construction).

    Per 16-row window the distinct columns its rows use are numbered into 4-column groups so that
    no row holds more than 2 entries in a group (greedy next-fit over the window's columns, taken
    round-robin over the rows that use them first: column i of every row before column i + 1 of
    any row).  Returns ``(slot, nslots)``: the window-local slot (group * 4 + position) of every
    entry's column and the number of slots of every window (a multiple of 4).  Vectorised over the
    windows: one numpy step per column rank, not per entry."""
    rows = np.asarray(rows, np.int64)
    cols = np.asarray(cols, np.int64)
    nwin = -(-m // 16)
    nnz = rows.size
    if nnz == 0:
        return np.zeros(0, np.int64), np.zeros(nwin, np.int64)
    n = int(cols.max()) + 1
    win = rows >> 4
    key = win * n + cols
    o = np.argsort(key, kind="stable")
    ks = key[o]
    first = np.ones(nnz, bool)
    first[1:] = ks[1:] != ks[:-1]
    pstart = np.flatnonzero(first)
    pair = np.empty(nnz, np.int64)
    pair[o] = np.cumsum(first) - 1
    bits = np.left_shift(np.int64(1), rows[o] & 15)
    mask = np.bitwise_or.reduceat(bits, pstart)                     # rows of the window using the column
    pwin = ks[pstart] // n
    npair = pstart.size
    fr = np.log2((mask & -mask).astype(np.float64)).astype(np.int64)  # first row using the column
    # pairs are sorted by (window, column); (window, first row) groups are not contiguous -> sort
    o2 = np.lexsort((np.arange(npair), pwin * 16 + fr))
    rk = np.empty(npair, np.int64)
    rk[o2] = _rank_in_groups((pwin * 16 + fr)[o2])
    po = np.lexsort((fr, rk, pwin))                                # processing order of the pairs
    cnt = np.bincount(pwin, minlength=nwin)
    st = np.concatenate([[0], np.cumsum(cnt)])[:-1]
    wl = np.argsort(-cnt, kind="stable")
    cs = cnt[wl]
    nw = int(np.count_nonzero(cs))
    stw = st[wl[:nw]]
    one = np.zeros(nw, np.int64)
    two = np.zeros(nw, np.int64)
    k = np.full(nw, 4, np.int64)
    grp = np.full(nw, -1, np.int64)
    pslot = np.empty(npair, np.int64)
    neg = -cs[:nw]
    for jstep in range(int(cs[0]) if nw else 0):
        na = int(np.searchsorted(neg, -jstep, side="left"))        # windows with more than jstep columns
        idx = po[stw[:na] + jstep]
        s = mask[idx]
        o_, t_, k_ = one[:na], two[:na], k[:na]
        new = ((s & t_) != 0) | (k_ >= 4)
        grp[:na] += new
        o_[new] = 0
        t_[new] = 0
        k_[new] = 0
        t_ |= o_ & s
        o_ |= s
        pslot[idx] = grp[:na] * 4 + k_
        k_ += 1
    nslots = np.zeros(nwin, np.int64)
    nslots[wl[:nw]] = (grp + 1) * 4
    return pslot[pair], nslots


def _items(win_ptr: np.ndarray, split: int, m: int, row_ids: np.ndarray):
    """Work items ``(window, first tile, end tile, split)`` (int32 x 4, heaviest first; split = 0 for
    a window done by one item, else the window's number among the split windows, from 1) and the
    original rows of the split windows, in that numbering (16 per window, past-the-end rows of
    the last window dropped): zeroed before the atomics, or (16-bit builds) the rows that fp32
    scratch row ``(split - 1) * 16 + r`` is finally written to."""
    wp = np.asarray(win_ptr, np.int64)
    nwin = wp.size - 1
    nt = np.diff(wp)
    nch = np.maximum(1, -(-nt // split)) if split > 0 else np.ones(nwin, np.int64)
    iw = np.repeat(np.arange(nwin), nch)
    ci = np.arange(iw.size) - np.repeat(np.cumsum(nch) - nch, nch)
    if split > 0:
        beg = wp[iw] + ci * split
        end = np.minimum(beg + split, wp[iw + 1])
    else:
        beg, end = wp[iw], wp[iw + 1]
    sidx = np.cumsum(nch > 1)                      # split windows numbered from 1 in window order
    at = np.where(nch[iw] > 1, sidx[iw], 0).astype(np.int64)
    items = np.stack([iw, beg, end, at], axis=1)
    items = items[np.argsort(-(end - beg), kind="stable")]
    sw = np.flatnonzero(nch > 1)
    zr = (sw[:, None] * 16 + np.arange(16)[None, :]).ravel()
    zr = zr[zr < m]
    return np.ascontiguousarray(items, dtype=np.int32).reshape(-1), row_ids[zr].astype(np.int32)



def sptc_arrays(mod: SparseModule, precision: str = "fp16", layout: str = META_LAYOUT, pack: str = "block",
                split: int = 0) -> dict[str, np.ndarray]:
    """Kernel arrays: :func:`pack_arrays` (tiles, remainder) plus the work items for ``split``."""
    arrays = dict(pack_arrays(mod, precision, layout, pack))
    arrays["items"], arrays["zero_rows"] = _items(arrays["win_ptr"], int(split), int(mod.A.shape[0]),
                                                  arrays["row_ids"])
    return arrays


def pack_arrays(mod: SparseModule, precision: str = "fp16", layout: str = META_LAYOUT,
                pack: str = "block") -> dict[str, np.ndarray]:
    """Kernel arrays of the 2:4 tile form of ``mod.A`` plus the CSR remainder (see module doc).

    ``pack="block"``: tiles = nonempty (16-row window, 32-column block) of the current order, the
    first two entries of every 4-column chunk kept, the rest in the CSR remainder.
    ``pack="condensed"``: tiles over the window's condensed columns (:func:`condense_windows`):
    2:4 by construction, no remainder.  (``sptc_arrays``' ``split``: most tiles per work item, 0 = one
    item per window.)"""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if pack not in PACKS:
        raise ValueError(f"pack must be one of {PACKS}, got {pack!r}")
    rows, cols, data, row_ids, col_map, m, n = _entries(mod)
    nnz = cols.size
    nwin = -(-m // 16)
    if pack == "block":
        rank = _rank_in_groups(rows * (-(-n // 4) + 1) + (cols >> 2))
        keep = rank < 2
        ncb = -(-n // 32)
        r, c, v, s = rows[keep], cols[keep], data[keep], rank[keep]
        tkey = (r >> 4) * ncb + (c >> 5)
        ukeys, tid = np.unique(tkey, return_inverse=True)
        tid = tid.reshape(-1)
        ntiles = ukeys.size
        win_ptr = np.concatenate([[0], np.cumsum(np.bincount(ukeys // ncb, minlength=nwin))])
        pos = c & 31
        ccol = np.full(ntiles * 32, -1, np.int64)
        ccol[tid * 32 + pos] = col_map[c]
    else:
        keep = np.ones(nnz, bool)
        slot, nslots = condense_windows(rows, cols, m)
        ntw = -(-nslots // 32)
        tbase = np.concatenate([[0], np.cumsum(ntw)])
        win_ptr = tbase
        ntiles = int(tbase[-1])
        r, c, v = rows, cols, data
        tid = tbase[r >> 4] + (slot >> 5)
        pos = slot & 31
        ck = (tid * 16 + (r & 15)) * 32 + pos
        o = np.argsort(ck, kind="stable")
        s = np.empty(nnz, np.int64)
        s[o] = _rank_in_groups(ck[o] >> 2)
        if nnz and s.max() > 1:                                   # pragma: no cover - by construction
            raise AssertionError("condensed packing broke 2:4")
        ccol = np.full(ntiles * 32, -1, np.int64)
        ccol[tid * 32 + pos] = col_map[c]
    # --- remainder (caller's order), grouped by original row
    rr_o, rc_o, rv = row_ids[rows[~keep]], col_map[cols[~keep]], data[~keep]
    o = np.argsort(rr_o, kind="stable")
    rr_o, rc_o, rv = rr_o[o], rc_o[o], rv[o]
    urows, cnt = np.unique(rr_o, return_counts=True)
    rem_ptr = np.concatenate([[0], np.cumsum(cnt)]).astype(np.int32)
    # per-row power-of-two scale keeps the stored values inside the fp16 range
    amax = np.zeros(m, np.float64)
    if nnz:
        np.maximum.at(amax, rows, np.abs(data.astype(np.float64)))
    ex = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))), 0.0)
    row_scale = np.ldexp(1.0, ex.astype(np.int64)).astype(np.float32)
    vk = (v.astype(np.float64) / row_scale[r]).astype(np.float32)
    frag, meta, _, _ = pack_tiles(tid, r & 15, pos >> 2, pos & 3, s, value_bits(vk, precision), ntiles, layout)
    return {"win_ptr": np.asarray(win_ptr, np.int32), "frag": frag, "meta": meta,
            "ccol": np.ascontiguousarray(ccol, dtype=np.int32),
            "row_ids": np.ascontiguousarray(row_ids, dtype=np.int32), "row_scale": row_scale,
            "rem_ptr": rem_ptr, "rem_rows": urows.astype(np.int32),
            "rem_cols": rc_o.astype(np.int32), "rem_vals": rv.astype(np.float32)}
