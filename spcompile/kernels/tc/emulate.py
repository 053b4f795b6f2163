"""numpy emulation of the tc family's kernels over their packed arrays (what tests run on
machines without a GPU to check the packers, the fragment layouts and the lanes' column mapping
against the float64 reference).

:func:`emulate_mma_spmm` and :func:`emulate_tc_sddmm` follow their kernels lane by lane (PTX
fragment layouts, the vectors each lane loads, where each lane stores); their outputs start NaN,
so whatever the kernel would leave unwritten stays NaN.  :func:`emulate_tc_spmm` (impl "wmma")
computes per window the sum over its blocks of ``tile @ X[blk_cols]`` from the uploaded tiles or
nonzeros.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...core import numerics
from .packer import PRECISIONS, _G, _T, a_frag_layout, b_frag_rows, input_type

__all__ = ["round_to", "emulate_tc_spmm", "emulate_mma_spmm", "emulate_tc_sddmm"]


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """Values of ``a`` rounded to ``dtype`` (:func:`spcompile.core.numerics.round_to`), as float64."""
    return numerics.round_to(a, dtype).astype(np.float64)


def emulate_tc_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray) -> np.ndarray:
    """What the kernel computes from the uploaded ``arrays``, in float64 (for tests): per window,
    sum over its blocks of ``tile @ X[blk_cols]``, written to ``row_ids``."""
    m, BW = int(meta["m"]), int(meta["BW"])
    X = np.asarray(X, dtype=np.float64)
    K = X.shape[1]
    wbp = np.asarray(arrays["win_block_ptr"], dtype=np.int64)
    nblk = int(wbp[-1])
    if "tiles" in arrays:
        t = np.asarray(arrays["tiles"])
        t = numerics.bf16_from_bits(t) if meta["precision"] == "bf16" else t
        tiles = t.astype(np.float64).reshape(nblk, 16, BW)
    else:
        tiles = np.zeros(nblk * 16 * BW)
        ptr = np.asarray(arrays["nz_ptr"], dtype=np.int64)
        blk = np.repeat(np.arange(nblk), np.diff(ptr))
        tiles[blk * 16 * BW + arrays["nz_pos"].astype(np.int64)] = arrays["nz_val"]
        tiles = tiles.reshape(nblk, 16, BW)
    cols = np.asarray(arrays["blk_cols"], dtype=np.int64).reshape(nblk, BW)
    Xp = np.vstack([X, np.zeros((1, K))])
    G = Xp[np.where(cols < 0, X.shape[0], cols)]                       # (nblk, BW, K)
    nwin = wbp.size - 1
    acc = np.zeros((nwin, 16, K))
    if nblk:
        np.add.at(acc, np.repeat(np.arange(nwin), np.diff(wbp)), tiles @ G)
    Y = np.full((m, K), np.nan)            # rows no window covers stay NaN
    Y[np.asarray(arrays["row_ids"], dtype=np.int64)] = acc.reshape(-1, K)[:m]
    return Y


def _frag_values(afrag: np.ndarray, precision: str, nsteps: int) -> np.ndarray:
    """(nsteps, 32, n) register values of the A fragments; 3xtf32: (2, nsteps, 32, 4), hi then lo."""
    a = np.asarray(afrag)
    if precision == "bf16":
        a = numerics.bf16_from_bits(a)
    if precision == "3xtf32":
        return np.moveaxis(a.astype(np.float64).reshape(nsteps, 2, 32, 4), 1, 0)
    return a.astype(np.float64).reshape(nsteps, 32, 4 if precision == "tf32" else 8)


def emulate_mma_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray,
                     col_groups: int = 1, warps: int = 1) -> np.ndarray:
    """What the register-direct kernel computes, lane by lane (float64): A rebuilt from the packed
    fragments through the PTX layout, B from the X values each lane loads (NJ = 4 floats, or 8
    16-bit values for a float16 / bfloat16 ``meta["dtype"]``, at column base + NJ g, element j for
    n-tile j), C scattered as the lanes store it (row g / g+8, columns base + 2 NJ t + NJ q + j),
    items summed into rows or partial slots, slots combined in order; a 16-bit Y is rounded once.
    For 16-bit workloads ``X`` holds the 16-bit values (e.g. rounded with :func:`round_to`)."""
    m, BW, prec = int(meta["m"]), int(meta["BW"]), str(meta["precision"])
    dtype = str(meta.get("dtype", "float32"))
    NJ = 8 if input_type(dtype, prec) else 4
    KS = PRECISIONS[prec].mma_k
    S = BW // KS
    X = np.asarray(X, dtype=np.float64)
    K = X.shape[1]
    items = np.asarray(arrays["items"], dtype=np.int64).reshape(-1, 4)
    pcols = np.asarray(arrays["pcols"], dtype=np.int64)
    nsteps = pcols.size // KS
    nblk = nsteps // S
    ar, ac = a_frag_layout(prec)
    split = prec == "3xtf32"
    fv = _frag_values(arrays["afrag"], prec, nsteps)                    # (nsteps, 32, n) | (2, ...)
    A = np.zeros((2 if split else 1, nsteps, 16, KS))
    for h in range(A.shape[0]):
        A[h][:, ar, ac] = fv[h] if split else fv
    brow = b_frag_rows(prec)                                            # (32, NR)
    NR = brow.shape[1]
    lane_cols = pcols.reshape(nsteps, 4, NR)[:, _T, :]                  # (nsteps, 32, NR): row ids a lane loads
    Xp = np.vstack([X, np.zeros((1, K))])
    SPAN = 8 * NJ
    span = SPAN * col_groups * warps
    Cblk = np.zeros((nblk, 16, -(-K // span) * span))
    for base in range(0, Cblk.shape[2], SPAN):
        # lane loads X[c][base + NJ g + j], j = 0..NJ-1 (zero beyond K or for padding)
        colsj = base + NJ * _G[:, None] + np.arange(NJ)                 # (32, NJ)
        valid = colsj < K
        rowsel = np.where(lane_cols < 0, X.shape[0], lane_cols)         # (nsteps, 32, NR)
        vals = Xp[rowsel[..., None], np.minimum(colsj, K - 1)[None, :, None, :]] * valid[None, :, None, :]
        # vals: (nsteps, 32, NR, NJ); B of n-tile j: B[k = brow[l, e], n = g(l)] = vals[:, l, e, j]
        def operand(v):
            B = np.zeros((nsteps, NJ, KS, 8))
            for e in range(NR):
                B[:, :, brow[:, e], _G] = np.moveaxis(v[:, :, e, :], 2, 1)
            return B

        prod = lambda a, b: np.einsum("srk,sjkn->sjrn", a, b)          # noqa: E731
        if split:
            # the kernel: x = hi + lo in tf32 (cvt.rna of x, then of the fp32 remainder), three
            # tf32 MMAs in fp32: lo(A) hi(x) + hi(A) lo(x) + hi(A) hi(x) (lo x lo dropped)
            x32 = vals.astype(np.float32)
            bh = numerics.tf32_round(x32)
            bl = numerics.tf32_round(x32 - bh)
            Bh, Bl = operand(bh.astype(np.float64)), operand(bl.astype(np.float64))
            C = prod(A[1], Bh) + prod(A[0], Bl) + prod(A[0], Bh)
        else:
            C = prod(A[0], operand(vals))
        C = C.reshape(nblk, S, NJ, 16, 8).sum(1)                         # (nblk, j, 16, 8)
        # lane (g, t): c0 = C[g][2t] -> column base + 2 NJ t + j, c1 = C[g][2t+1] -> + NJ + j
        for n in range(8):
            q, tt = n % 2, n // 2
            for j in range(NJ):
                Cblk[:, :, base + 2 * NJ * tt + NJ * q + j] = C[:, j, :, n]
    Cblk = Cblk[:, :, :K]
    cs = np.concatenate([np.zeros((1, 16, K)), np.cumsum(Cblk, axis=0)])
    Y = np.full((m, K), np.nan)
    row_ids = np.asarray(arrays["row_ids"], dtype=np.int64)
    nslot = int(np.asarray(arrays["slot_grp"]).size)
    part = np.full((nslot, 16, K), np.nan)
    for lo, hi, win, slot in items:
        v = cs[hi] - cs[lo]
        if slot < 0:
            rows = win * 16 + np.arange(16)
            keep = rows < m
            Y[row_ids[rows[keep]]] = v[keep]
        else:
            part[slot] = v
    grp_ptr = np.asarray(arrays["grp_ptr"], dtype=np.int64)
    slot_grp = np.asarray(arrays["slot_grp"], dtype=np.int64)
    for grp in range(grp_ptr.size - 1):
        s0, s1 = grp_ptr[grp], grp_ptr[grp + 1]
        wins = {int(w) for lo, hi, w, sl in items if s0 <= sl < s1}
        assert len(wins) == 1 and np.all(slot_grp[s0:s1] == grp)
        win = wins.pop()
        rows = win * 16 + np.arange(16)
        keep = rows < m
        Y[row_ids[rows[keep]]] = part[s0:s1].sum(0)[keep]
    return Y if dtype == "float32" else round_to(Y, dtype)


def _sddmm_features(precision: str, ti: int, Kp: int):
    """The feature index of each k index (0..KS-1) of every MMA k-step of the SDDMM kernel, in
    order.  fp32 X / Y: lane (g, t) loads float4 q of a 32-feature chunk at features
    kc + 16 q + 4 t + (0..3); tf32 k = t <-> q = 0 element j, k = t + 4 <-> q = 1 element j (4
    steps); fp16 / bf16 k = 2t + e <-> q = 0 element 2j + e, k = 2t + 8 + e <-> q = 1 (2 steps).
    16-bit X / Y: 8 values per lane of a 64-feature chunk, k = 2t + e <-> kc + 8t + 2j + e,
    k = 2t + 8 + e <-> kc + 32 + 8t + 2j + e (4 steps)."""
    t = np.arange(4)
    for kc in range(0, Kp, 64 if ti else 32):
        if ti:
            for j in range(4):
                lo = (kc + 8 * t[:, None] + 2 * j + np.arange(2)).ravel()
                yield np.concatenate([lo, lo + 32])
        elif precision == "tf32":
            for j in range(4):
                yield np.concatenate([kc + 4 * t + j, kc + 16 + 4 * t + j])
        else:
            for j in range(2):
                lo = (kc + 4 * t[:, None] + 2 * j + np.arange(2)).ravel()
                yield np.concatenate([lo, lo + 16])


def emulate_tc_sddmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray,
                     Y: np.ndarray) -> np.ndarray:
    """What the SDDMM kernel computes (float64), lane by lane: A / B fragments built from the
    vectors each lane loads under the kernel's k-index mapping (:func:`_sddmm_features`; fp32:
    float4s, 32-feature chunks; 16-bit ``meta["dtype"]``: 8 values, 64-feature chunks), C
    scattered through the PTX C layout into the 16 x BW block, then each stored nonzero's value
    times its block entry (rounded once to a 16-bit output type), in the caller's nonzero order
    (outputs no block writes stay NaN).  For 16-bit workloads X / Y hold the 16-bit values."""
    m, BW, prec, nnz = int(meta["m"]), int(meta["BW"]), str(meta["precision"]), int(meta["nnz"])
    dtype = str(meta.get("dtype", "float32"))
    ti = input_type(dtype, prec)
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    K = X.shape[1]
    win = np.asarray(arrays["blk_win"], dtype=np.int64)
    nblk = win.size
    cols = np.asarray(arrays["blk_cols"], dtype=np.int64).reshape(nblk, BW)
    row_ids = np.asarray(arrays["row_ids"], dtype=np.int64)
    chunk = 64 if ti else 32
    Kp = -(-K // chunk) * chunk
    Xp = np.zeros((m + 1, Kp))
    Xp[:m, :K] = X[row_ids]                  # by current row; row m = zeros (rows beyond m)
    Yp = np.zeros((Y.shape[0] + 1, Kp))
    Yp[:-1, :K] = Y
    rows = win[:, None] * 16 + np.arange(16)
    xr = np.where(rows < m, rows, m)          # (nblk, 16)
    yc = np.where(cols < 0, Y.shape[0], cols)  # (nblk, BW)
    ar, ac = a_frag_layout(prec)              # A (16 x KS): rows = window rows, k = features
    brow = b_frag_rows(prec)
    C = np.zeros((nblk, 16, BW))
    for feat in _sddmm_features(prec, ti, Kp):
        # A register element i of lane l holds X[row ar][feat[ac]]; rebuild A through the layout
        Aop = np.zeros((nblk, 16, feat.size))
        Aop[:, ar, ac] = Xp[xr[:, ar], feat[ac]]
        for n0 in range(0, BW, 8):
            Bop = np.zeros((nblk, feat.size, 8))
            for e in range(brow.shape[1]):
                Bop[:, brow[:, e], _G] = Yp[yc[:, n0 + _G], feat[brow[:, e]]]
            C[:, :, n0:n0 + 8] += Aop @ Bop
    out = np.full(nnz, np.nan)
    ptr = np.asarray(arrays["nz_ptr"], dtype=np.int64)
    blk = np.repeat(np.arange(nblk), np.diff(ptr))
    vals = (np.asarray(arrays["nz_val"], dtype=np.float64) *
            C.reshape(nblk, 16 * BW)[blk, np.asarray(arrays["nz_pos"], dtype=np.int64)])
    out[np.asarray(arrays["nz_out"], dtype=np.int64)] = round_to(vals, dtype) if ti else vals
    return out
