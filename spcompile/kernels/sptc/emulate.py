"""numpy emulation of ``sptc.vnm``'s kernels over their packed arrays (what tests run on machines
without a GPU to check the packing, the metadata and the launches against the float64 reference).

:func:`decode_tiles` reads the tiles back from the mma.sp operands (checking the metadata is valid
2:4); :func:`emulate_sptc_spmm` is what the kernels compute from the arrays, in float64;
:func:`emulate_kernel` runs a built kernel's launches as it makes them (zeroing, tiles over the
columns its grid covers, fp32 scratch and finishing of a 16-bit build, remainder), with the
operand roundings and each rounding of a 16-bit output, into a NaN-filled output.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...core import numerics
from ...core.numerics import round_to
from .packer import META_LAYOUT, _row_words, fragment_index

__all__ = ["decode_tiles", "emulate_sptc_spmm", "emulate_kernel"]


def _from_bits(b: np.ndarray, precision: str) -> np.ndarray:
    """float64 values of operand bit patterns (uint16) of ``precision``."""
    b = np.asarray(b, dtype=np.uint16)
    if precision == "fp16":
        return b.view(np.float16).astype(np.float64)
    return numerics.bf16_from_bits(b).astype(np.float64)


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
    cum = _tile_products(arrays, meta["precision"], X, layout)
    items = np.asarray(arrays["items"], np.int64).reshape(-1, 4)
    nwin = -(-m // 16)
    Y = np.full((m, K), np.nan)
    Y[np.asarray(arrays["zero_rows"], np.int64)] = 0.0
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


def _tile_products(arrays: Mapping[str, np.ndarray], precision: str, X: np.ndarray,
                   layout: str = META_LAYOUT) -> np.ndarray:
    """Cumulative sums over the tiles of ``tile @ X[ccol]`` (ntiles + 1, 16, K), float64."""
    K = X.shape[1]
    tiles = decode_tiles(arrays["frag"], arrays["meta"], precision, layout)
    ntiles = tiles.shape[0]
    ccol = np.asarray(arrays["ccol"], np.int64).reshape(ntiles, 32)
    Xp = np.vstack([X, np.zeros((1, K))])
    P = tiles @ Xp[np.where(ccol < 0, X.shape[0], ccol)] if ntiles else np.zeros((0, 16, K))
    return np.concatenate([np.zeros((1, 16, K)), np.cumsum(P, axis=0)])


def emulate_kernel(kernel, X: np.ndarray) -> np.ndarray:
    """Y (m x K, float64, NaN where nothing is written) as a built ``sptc.vnm`` kernel computes it
    (no binary needed), launch by launch in the order of ``kernel.launch_spec``:

    * ``sptc_zero_rows`` / ``sptc_zero_scratch``: the split windows' output rows / fp32 scratch to 0;
    * the instance: work items ``items[:grid.x]``; warp v of block (x, y) computes the columns
      ``(y * W + v) * 8 * NT`` + [0, 8 NT) below K, with X converted to the operand precision;
      the sums of a split item are added (fp32 builds: into Y, 16-bit: into scratch row
      ``(split - 1) * 16 + r``), the others stored (rounded to a 16-bit Y);
    * ``sptc_finish_*``: scratch -> Y (one rounding);
    * ``sptc_remainder_*``: warp w of the 8 per block adds the remainder row ``w`` into Y over the
      128 columns of its grid.y (16-bit Y: read, add, round).
    """
    a, meta = kernel.arrays, kernel.meta
    m, K, dtype, prec = int(meta["m"]), int(meta["K"]), meta.get("dtype", "float32"), meta["precision"]
    NT = int(meta["instances"][0][1][1])
    X = np.asarray(X, np.float32)
    if dtype != "float32":
        X = round_to(X, dtype)                       # the kernel reads a 16-bit X
    X = X.astype(np.float64)
    Xop = round_to(X, prec).astype(np.float64)       # mma operands
    out = (lambda v: round_to(v, dtype).astype(np.float64)) if dtype != "float32" else (lambda v: v)
    Y = np.full((m, K), np.nan)
    if kernel.empty():
        return Y
    zero_rows = np.asarray(a["zero_rows"], np.int64)
    rid = np.asarray(a["row_ids"], np.int64)
    scale = np.asarray(a["row_scale"], np.float64)
    S = np.full((zero_rows.size, K), np.nan)
    specs = kernel.launch_spec(1)
    for s in ([specs] if not isinstance(specs, (list, tuple)) else specs):
        e = s.entry
        if e is None:
            W = s.block[0] // 32
            cols = np.arange(min(K, s.grid[1] * W * 8 * NT))
            items = np.asarray(a["items"], np.int64).reshape(-1, 4)[:s.grid[0]]
            cum = _tile_products(a, prec, Xop[:, cols])
            for atomic in (False, True):
                sel = items[(items[:, 3] != 0) == atomic]
                part = cum[sel[:, 2]] - cum[sel[:, 1]]                  # (items, 16, columns)
                r = sel[:, 0:1] * 16 + np.arange(16)[None, :]
                ok = r < m
                vals = part[ok] * scale[r[ok]][:, None]
                if not atomic:
                    Y[np.ix_(rid[r[ok]], cols)] = out(vals)
                elif dtype == "float32":
                    np.add.at(Y, (rid[r[ok]][:, None], cols[None, :]), vals)
                else:
                    srow = ((sel[:, 3:4] - 1) * 16 + np.arange(16)[None, :])[ok]
                    np.add.at(S, (srow[:, None], cols[None, :]), vals)
        elif e == "sptc_zero_rows":
            Y[zero_rows] = 0.0
        elif e == "sptc_zero_scratch":
            S[:] = 0.0
        elif e.startswith("sptc_finish"):
            Y[zero_rows] = out(S)
        elif e.startswith("sptc_remainder"):
            nrem = int(s.args["nrows"])
            warps = min(nrem, s.grid[0] * s.block[0] // 32)
            cols = np.arange(min(K, 128 * s.grid[1]))
            rp = np.asarray(a["rem_ptr"], np.int64)
            rows = np.repeat(np.arange(warps), np.diff(rp[:warps + 1]))
            add = np.zeros((warps, cols.size))
            np.add.at(add, rows, np.asarray(a["rem_vals"], np.float64)[:rp[warps], None]
                      * X[np.asarray(a["rem_cols"], np.int64)[:rp[warps]]][:, cols])
            tgt = np.asarray(a["rem_rows"], np.int64)[:warps]
            Y[np.ix_(tgt, cols)] = out(Y[np.ix_(tgt, cols)] + add)
        else:
            raise ValueError(f"no emulation of kernel {e!r}")
    return Y
