"""``sptc.vnm``: Sparse-Tensor-Core SpMM (``mma.sp`` m16n8k32, 2:4) after ``reorder.vnm`` (SOGRE, PPoPP'25).

After the SOGRE reordering most 4-column segment vectors of the matrix hold at most 2 entries, i.e.
the matrix (nearly) conforms to 2:4.  This template packs the reordered matrix into the operand form
of ``mma.sp.sync.aligned.m16n8k32.row.col.f32.{f16,bf16}.{f16,bf16}.f32`` and runs it on the
sparse tensor cores with fp32 accumulation (``sptc_vnm.cu``):

* the rows are cut into 16-row windows and the columns into 32-column blocks; only the nonempty
  (window, block) **tiles** are stored (block-CSR ``win_ptr`` over windows, sorted by block);
* per tile and row, each 4-column chunk keeps its first two entries (in column order): the
  compressed 16 x 16 values, already laid out as each lane's A fragment (``frag``: 32 lanes x 8
  fp16 / bf16 values), and the 2-bit positions of the kept values as the lanes' metadata words
  (``meta``: 16 uint32 per tile, the word of lane ``4g + t`` for ``t < 2``, sparsity selector 0);
* ``cols``: 32 original X rows per tile (``col_perm`` folded in; -1 for columns that no kept entry
  of the tile uses, so the kernel loads no X row for them);
* **lossless remainder**: entries beyond the first two of a chunk (segment vectors that still
  violate 2:4 after reordering) go to a CSR remainder in the caller's order (``rem_ptr``,
  ``rem_rows``, ``rem_cols``, ``rem_vals``: fp32), added by a CUDA-core kernel launched after the
  tensor-core kernel on the same stream.  Nothing is pruned: the output equals A @ X up to the
  fp16 / bf16 rounding of A's values and of X (fp32 accumulation).

Metadata bit order (PTX ISA, "sparse matrix storage" and the m16n8k32 f16/bf16 metadata figure):
each chunk of 4 columns contributes a nibble ``idx0 | idx1 << 2`` with ``idx0 < idx1`` (the
positions of its two stored values; a chunk with fewer entries stores zeros at unused positions);
with selector 0 the threads ``t = 0, 1`` of each quad ``g`` supply the metadata: thread ``t``
holds the chunks of columns ``16t .. 16t + 15`` of row ``g`` in bits 0..15 (chunk ``4t + q`` at bits
``4q``) and those of row ``g + 8`` in bits 16..31 (``META_LAYOUT = "split16"``).  The alternative
reading (``"rowwise"``: thread 0 = all of row g, thread 1 = row g + 8) is kept for the GPU probe
test, which checks the layout against numpy on a random dense 2:4 tile.

The kernel works in the caller's order (row_ids / col_perm folded into the arrays).  SpMM ``sum``
and ``mean`` (values scaled by 1 / row length at build time); tensor cores cannot do max / min.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...core.ir import SparseModule
from ...runtime import cuda as rt
from ...core import numerics
from ...core.numerics import NATIVE_PRECISION
from ..base import csr_kernel_arrays, register_template, unique_params
from ..nvcc import _NvccKernel, _NvccTemplate

__all__ = ["SptcVnm", "sptc_arrays", "pack_arrays", "condense_windows", "PACKS", "emulate_sptc_spmm", "decode_tiles", "META_LAYOUT", "PRECISIONS",
           "fragment_index"]

#: the MMA operand precisions of mma.sp (kernel code: :mod:`spcompile.core.numerics`)
PRECISIONS = {p: numerics.PRECISIONS[p] for p in ("fp16", "bf16")}
#: X / Y element type -> kernel code E; a 16-bit workload computes in its own precision only
ELEMS = {"float32": 0, "float16": 1, "bfloat16": 2}


def precisions_for(dtype: str) -> list[str]:
    """Operand precisions a ``dtype`` workload may use: fp32 X is converted to either in registers;
    16-bit X is used as loaded, so only its own precision."""
    return [NATIVE_PRECISION[dtype]] if dtype in NATIVE_PRECISION else list(PRECISIONS)


META_LAYOUT = "split16"


_bf16_bits = numerics.bf16_bits


def _to_bits(v: np.ndarray, precision: str) -> np.ndarray:
    if precision == "fp16":
        return np.asarray(v, dtype=np.float32).astype(np.float16).view(np.uint16)
    return _bf16_bits(v)


def _from_bits(b: np.ndarray, precision: str) -> np.ndarray:
    b = np.asarray(b, dtype=np.uint16)
    if precision == "fp16":
        return b.view(np.float16).astype(np.float64)
    return numerics.bf16_from_bits(b).astype(np.float64)


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


PACKS = ("condensed", "block")


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
    frag, meta, _, _ = pack_tiles(tid, r & 15, pos >> 2, pos & 3, s, _to_bits(vk, precision), ntiles, layout)
    return {"win_ptr": np.asarray(win_ptr, np.int32), "frag": frag, "meta": meta,
            "ccol": np.ascontiguousarray(ccol, dtype=np.int32),
            "row_ids": np.ascontiguousarray(row_ids, dtype=np.int32), "row_scale": row_scale,
            "rem_ptr": rem_ptr, "rem_rows": urows.astype(np.int32),
            "rem_cols": rc_o.astype(np.int32), "rem_vals": rv.astype(np.float32)}


def decode_tiles(frag: np.ndarray, meta: np.ndarray, precision: str, layout: str = META_LAYOUT,
                 nz_ptr=None, nz=None) -> np.ndarray:
    """Dense (ntiles, 16, 32) float64 tiles from the packed operands (checks the metadata is valid:
    two distinct, increasing positions per chunk, as mma.sp requires)."""
    if nz is None:
        fb = np.asarray(frag, np.uint32).view(np.uint16).reshape(-1, 32, 8)
        ntiles = fb.shape[0]
    else:                                           # rebuild the fragments from the list
        nzp = np.asarray(nz_ptr, np.int64)
        ntiles = nzp.size - 1
        nzv = np.asarray(nz, np.uint32)
        fb = np.zeros((ntiles, 256), np.uint16)
        fb[np.repeat(np.arange(ntiles), np.diff(nzp)), (nzv & 0xFF).astype(np.int64)] = (nzv >> 16).astype(np.uint16)
        fb = fb.reshape(ntiles, 32, 8)
    vals = np.zeros((ntiles, 16, 16))
    R, C = fragment_index()
    vals[:, R, C] = _from_bits(fb, precision)
    rw = _row_words(meta, layout).astype(np.uint64)             # (ntiles, 16)
    q = np.arange(8, dtype=np.uint64)
    nib = (rw[:, :, None] >> (4 * q)[None, None, :]) & 0xF       # (ntiles, 16, 8)
    i0, i1 = (nib & 3).astype(np.int64), (nib >> 2).astype(np.int64)
    if np.any(i0 >= i1):
        raise ValueError("invalid 2:4 metadata (positions must be distinct and increasing)")
    dense = np.zeros((ntiles, 16, 32))
    t_, r_, j_ = np.indices((ntiles, 16, 8))
    dense[t_, r_, 4 * j_ + i0] += vals[:, :, 0::2]
    dense[t_, r_, 4 * j_ + i1] += vals[:, :, 1::2]
    return dense


def emulate_sptc_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray,
                      layout: str = META_LAYOUT) -> np.ndarray:
    """What the kernels compute from the uploaded ``arrays``, in float64 (for tests): the zero
    kernel, then every work item (its tiles' products, stored or added), then the remainder."""
    m = int(meta["m"])
    X = np.asarray(X, dtype=np.float64)
    K = X.shape[1]
    tiles = decode_tiles(arrays["frag"], arrays["meta"], meta["precision"], layout)
    ntiles = tiles.shape[0]
    ccol = np.asarray(arrays["ccol"], np.int64).reshape(ntiles, 32)
    Xp = np.vstack([X, np.zeros((1, K))])
    G = Xp[np.where(ccol < 0, X.shape[0], ccol)]                  # (ntiles, 32, K)
    P = tiles @ G if ntiles else np.zeros((0, 16, K))
    items = np.asarray(arrays["items"], np.int64).reshape(-1, 4)
    nwin = -(-m // 16)
    Y = np.full((m, K), np.nan)
    Y[np.asarray(arrays["zero_rows"], np.int64)] = 0.0
    cum = np.concatenate([np.zeros((1, 16, K)), np.cumsum(P, axis=0)])
    rid = np.asarray(arrays["row_ids"], np.int64)
    sc = np.asarray(arrays["row_scale"], np.float64)
    for atomic in (0, 1):                           # stores first: an atomic item must find zeros
        sel = items[(items[:, 3] != 0) == bool(atomic)]
        part = (cum[sel[:, 2]] - cum[sel[:, 1]])    # (items, 16, K)
        r = sel[:, 0:1] * 16 + np.arange(16)[None, :]
        ok = r < m
        vals = part[ok] * sc[r[ok]][:, None]
        if atomic:
            np.add.at(Y, rid[r[ok]], vals)
        else:
            Y[rid[r[ok]]] = vals
    assert np.all(np.bincount(items[:, 0], minlength=nwin) >= 1)
    rp = np.asarray(arrays["rem_ptr"], np.int64)
    rrow = np.repeat(np.asarray(arrays["rem_rows"], np.int64), np.diff(rp))
    np.add.at(Y, rrow, np.asarray(arrays["rem_vals"], np.float64)[:, None]
              * X[np.asarray(arrays["rem_cols"], np.int64)])
    return Y


class SptcKernel(_NvccKernel):
    def prepare(self):
        fns = self._load_functions()
        byname = {n: f for (n, _), f in zip(self.meta["instances"], fns)}
        p, meta = self.params, self.meta
        K, m = int(meta["K"]), int(meta["m"])
        W, NT = int(p["warps_per_block"]), int(p["slabs_per_warp"])
        names = ["items", "frag", "meta", "ccol", "row_ids", "row_scale", "zero_rows",
                 "rem_ptr", "rem_rows", "rem_cols", "rem_vals"]
        dev = dict(zip(names, self._upload(tuple(names))))
        nitems = int(self.arrays["items"].size) // 4
        nrem = int(self.arrays["rem_rows"].size)
        nz = int(self.arrays["zero_rows"].size)
        E = ELEMS[meta.get("dtype", "float32")]
        sfx = {0: "_kernel", 1: "_h", 2: "_b"}[E]
        scratch = 0
        if E and nz:   # 16-bit: split windows add into an fp32 scratch, converted into Y once
            import cupy

            self._scratch = cupy.empty(nz * K, dtype=cupy.float32)
            scratch = int(self._scratch.data.ptr)
        zgrid = (max(1, min(1024, -(-nz * K // 256))), 1, 1)
        self._main = rt.Launch(byname[meta["instances"][0][0]], (max(nitems, 1), -(-K // (8 * NT * W)), 1),
                               (32 * W, 1, 1), (dev["items"], dev["frag"], dev["meta"], dev["ccol"],
                                                dev["row_ids"], dev["row_scale"], None, None, scratch,
                                                np.int32(m), np.int32(K)))
        self._zero = self._finish = None
        if nz and E == 0:
            self._zero = rt.Launch(byname["sptc_zero_rows"], zgrid, (256, 1, 1),
                                   (dev["zero_rows"], np.int32(nz), None, np.int32(K)))
        elif nz:
            self._zero = rt.Launch(byname["sptc_zero_scratch"], zgrid, (256, 1, 1),
                                   (scratch, np.int32(nz), np.int32(K)))
            self._finish = rt.Launch(byname["sptc_finish" + sfx], zgrid, (256, 1, 1),
                                     (dev["zero_rows"], np.int32(nz), scratch, None, np.int32(K)))
        self._rem = rt.Launch(byname["sptc_remainder" + sfx], (-(-nrem // 8), -(-K // 128), 1), (256, 1, 1),
                              (dev["rem_ptr"], dev["rem_rows"], dev["rem_cols"], dev["rem_vals"], None, None,
                               np.int32(nrem), np.int32(K))) if nrem else None
        self._empty = m == 0 or K == 0 or nitems == 0
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x = in_ptrs[0]
        if self._zero is not None:
            self._zero(() if self._finish is not None else (out_ptr,), stream)
        self._main((x, out_ptr), stream)
        if self._finish is not None:
            self._finish((out_ptr,), stream)
        if self._rem is not None:
            self._rem((x, out_ptr), stream)


@register_template
class SptcVnm(_NvccTemplate):
    """SOGRE (PPoPP'25) sparse-tensor-core SpMM: 2:4 tiles on mma.sp m16n8k32 (fp16 / bf16 operands,
    fp32 accumulation).  Two packings: ``block`` (the 32-column blocks of the reordered matrix, after
    reorder.vnm, + a lossless CUDA-core CSR remainder) and ``condensed`` (per 16-row window the
    distinct columns, grouped 2:4 by construction; best after a locality order such as reorder.rcm).
    Tunable: packing, warps per block, 8-column output slabs per warp, tiles per work item (split),
    precision."""

    name = "sptc.vnm"
    precision_param = "precision"
    version = "3"
    priority = 9
    ops = (("spmm", "sum"), ("spmm", "mean"))
    #: X / Y: fp32 (converted to the operand precision in registers) or fp16 / bf16 (used as loaded:
    #: half the gather bytes; the operand precision is then the input's), fp32 accumulation
    dtypes = ("float32", "float16", "bfloat16")
    format = "vnm"
    source_file = "sptc_vnm.cu"
    instance_macro = "SPC_SPTC_INSTANCE"

    def requires(self, mod):
        return ("vnm",)

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"pack": C(list(PACKS)), "warps_per_block": C([1, 2, 4, 8]), "slabs_per_warp": C([1, 2, 4, 8]),
                "split": C([0, 2, 4, 8, 32]), "precision": C(precisions_for(mod.op.dtype))}

    def default_params(self, mod):
        K = mod.op.K
        slabs = -(-K // 8)
        NT = 4 if slabs >= 4 else (2 if slabs >= 2 else 1)
        W = max(1, min(8, -(-slabs // NT)))
        W = 1 << (W - 1).bit_length()
        return {"pack": "condensed", "warps_per_block": min(W, 8), "slabs_per_warp": NT, "split": 8,
                "precision": precisions_for(mod.op.dtype)[0]}

    def seed_params(self, mod):
        d = self.default_params(mod)
        # measured on the H100 (docs/sptc_benchmark.md): split 8 or 32 wins (32 on power-law graphs with
        # hub windows, 0 on small meshes); split 2 loses everywhere (too many atomics)
        seeds = [d, {**d, "split": 32}, {**d, "split": 0}, {**d, "slabs_per_warp": 8,
                                                            "warps_per_block": max(1, d["warps_per_block"] // 2)},
                 {**d, "slabs_per_warp": 2, "warps_per_block": min(8, 2 * d["warps_per_block"])},
                 {**d, "pack": "block"}, {**d, "precision": precisions_for(mod.op.dtype)[-1]}]
        if mod.op.dtype != "float32" and mod.op.K >= 64:   # 16-bit X: NT = 8 gives 16-byte loads
            seeds.insert(1, {**d, "slabs_per_warp": 8, "warps_per_block": max(1, d["warps_per_block"] // 2)})
            seeds.insert(2, {**d, "slabs_per_warp": 8, "warps_per_block": max(1, d["warps_per_block"] // 2),
                             "split": 32})
        return unique_params(seeds)

    @staticmethod
    def instance_name(P, NT, E=0) -> str:
        return f"sptc3_spmm_p{P}_nt{NT}_e{E}"

    def instances(self, precision: str, NT: int, dtype: str = "float32") -> list:
        P, E = PRECISIONS[precision].code, ELEMS[dtype]
        if E and E != P:
            raise ValueError(f"sptc.vnm: {dtype} inputs need precision {NATIVE_PRECISION[dtype]!r}, "
                             f"got {precision!r}")
        return [(self.instance_name(P, NT, E), (P, NT, E))]

    def all_instances(self, precision: str, NT: int, dtype: str = "float32") -> list:
        """The main kernel plus the helper kernels (plain extern "C" functions, listed without args)."""
        aux = ["sptc_zero_rows", "sptc_zero_scratch", "sptc_remainder_kernel", "sptc_remainder_h",
               "sptc_remainder_b", "sptc_finish_h", "sptc_finish_b"]
        return self.instances(precision, NT, dtype) + [(n, ()) for n in aux]

    def render(self, instances):
        return super().render([(n, a) for n, a in instances if len(a)])

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        if not self.supports(mod):
            raise ValueError("sptc.vnm needs the vnm format (run reorder.vnm or format.vnm first)")
        prec, pack = str(params["precision"]), str(params["pack"])
        W, NT, split = int(params["warps_per_block"]), int(params["slabs_per_warp"]), int(params["split"])
        if prec not in PRECISIONS or pack not in PACKS or W not in (1, 2, 4, 8, 16) or NT not in (1, 2, 4, 8) \
                or split < 0:
            raise ValueError(f"invalid sptc.vnm parameters {params}")
        dtype = mod.op.dtype
        if dtype not in self.dtypes:
            raise ValueError(f"sptc.vnm supports dtypes {list(self.dtypes)}, not {dtype!r}")
        if prec not in precisions_for(dtype):
            raise ValueError(f"sptc.vnm: {dtype} inputs are used as loaded, so the precision must be "
                             f"{precisions_for(dtype)[0]!r}, got {prec!r}")
        arch = rt.device_arch()
        if arch < 80:
            raise ValueError("sptc.vnm needs sm_80 or newer (mma.sp)")
        arrays = sptc_arrays(mod, prec, pack=pack, split=split)
        inst = self.all_instances(prec, NT, dtype)
        path = self.compile(inst, arch=arch, name=inst[0][0])
        ntiles = int(arrays["ccol"].size) // 32
        kept = mod.A.nnz - int(arrays["rem_vals"].size)
        meta = {"K": mod.op.K, "m": mod.A.shape[0], "precision": prec, "layout": META_LAYOUT, "pack": pack,
                "dtype": dtype, "arch": arch, "tiles": ntiles,
                "items": int(arrays["items"].size) // 4, "remainder_nnz": int(arrays["rem_vals"].size),
                "nnz_per_tile": float(kept / max(1, ntiles)),
                "gathered_rows": int(np.count_nonzero(arrays["ccol"] >= 0)),
                "tile_density": float(kept / max(1, ntiles * 512)),
                "instances": [[n, list(a)] for n, a in inst]}
        return SptcKernel(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        return SptcKernel(self.name, params, arrays, files, meta, self)
