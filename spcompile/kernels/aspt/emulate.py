"""numpy emulation of the aspt family's kernels over their packed arrays (what tests run on
machines without a GPU to check the packers and the launches against the float64 reference).

:func:`emulate_aspt_spmm` (scheme "tasks": the row kernel's plain stores into a NaN-filled
output, then the tile kernel's atomic combines) and :func:`emulate_panel_spmm` (scheme "panel":
per-block accumulators, whole-panel stores, split panels' partials combined in slot order)
follow the kernels' data flow in float64 and assert the layout invariants the kernels rely on.
:func:`emulate_kernel` runs a built kernel (no binary needed) through them with what its launches
cover: the rows / blocks / tasks / tail segments of each grid, the columns of its K tiles, and
checks its scalar arguments, dynamic shared memory and workspace sizes; anything a launch would
leave unwritten stays NaN.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..csr.emulate import spmm_columns
from .packer import _segments

__all__ = ["emulate_aspt_spmm", "emulate_panel_spmm", "emulate_kernel"]

_REDUCE = {"sum": 0, "mean": 0, "max": 1, "min": 2}


def emulate_aspt_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray, *,
                      rows: int | None = None, tasks: int | None = None, tails: int | None = None,
                      row_columns: np.ndarray | None = None, tile_columns: np.ndarray | None = None) -> np.ndarray:
    """What the two kernels compute from the uploaded ``arrays``, in float64 (for tests): the row
    kernel's plain stores into a NaN-filled output, then the tile kernel's atomic combines (dense
    entries read X through their task's staged column list, tail segments).

    What the launches reach (default: everything): the first ``rows`` module rows (row kernel),
    ``tasks`` dense tasks and ``tails`` tail segments (tile kernel), the columns with a nonzero
    count in ``row_columns`` / ``tile_columns`` (:func:`~spcompile.kernels.csr.emulate.spmm_columns`
    of each launch's K tiles).  ValueError for a launch that reaches past the arrays."""
    m = int(meta["m"])
    reduce = meta.get("reduce", "sum")
    R = _REDUCE[reduce]
    X = np.asarray(X, dtype=np.float64)
    K = X.shape[1]
    ufunc = (np.add, np.maximum, np.minimum)[R]
    ident = (0.0, -np.inf, np.inf)[R]
    a = {k: np.asarray(v) for k, v in arrays.items()}
    rp = a["rem_ptr"].astype(np.int64)
    rcol = a["rem_col"].astype(np.int64)
    rval = a["rem_val"].astype(np.float64)
    te = a["task_eptr"].astype(np.int64)
    tl, th = a["tail_lo"].astype(np.int64), a["tail_hi"].astype(np.int64)
    rows = m if rows is None else min(int(rows), m)       # the kernel returns past row m - 1
    tasks = te.size - 1 if tasks is None else int(tasks)
    tails = tl.size if tails is None else min(int(tails), tl.size)   # guarded by ntail
    if tasks > te.size - 1:
        raise ValueError(f"the tile launch runs {tasks} dense tasks, the arrays hold {te.size - 1}")
    rc = np.arange(K) if row_columns is None else np.flatnonzero(row_columns)
    tc = np.arange(K) if tile_columns is None else np.flatnonzero(tile_columns)
    Y = np.full((m, K), np.nan)
    # row kernel
    n1 = a["rem_end1"].astype(np.int64) - rp[:-1]
    idx = _segments(n1, rp[:-1])
    acc = np.full((m, K), ident)
    ufunc.at(acc, np.repeat(np.arange(m), n1), rval[idx][:, None] * X[rcol[idx]])
    acc[a["row_len"] == 0] = 0.0
    Y[np.ix_(a["row_ids"].astype(np.int64)[:rows], rc)] = acc[:rows][:, rc]
    # tile kernel: dense tasks
    et = np.repeat(np.arange(te.size - 1), np.diff(te))
    assert np.all(a["ent_slot"] < a["task_nc"][et]), "entry outside its task's staged chunk"
    run = et < tasks
    xs_rows = a["dense_xrow"].astype(np.int64)[a["task_x0"].astype(np.int64)[et] + a["ent_slot"]]
    ufunc.at(Y, (a["ent_out"].astype(np.int64)[run][:, None], tc[None, :]),
             (a["ent_val"].astype(np.float64)[:, None] * X[xs_rows])[run][:, tc])
    # tile kernel: tail segments
    tl, th = tl[:tails], th[:tails]
    idx = _segments(th - tl, tl)
    ufunc.at(Y, (np.repeat(a["tail_out"].astype(np.int64)[:tails], th - tl)[:, None], tc[None, :]),
             (rval[idx][:, None] * X[rcol[idx]])[:, tc])
    return Y


def emulate_panel_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray, *,
                       blocks: int | None = None, columns: np.ndarray | None = None) -> np.ndarray:
    """What the panel kernel computes from the uploaded ``arrays``, in float64 (for tests): every
    block reduces its steps' entries into its own accumulator (gather steps read X directly,
    staged steps through the step's chunk of ``dense_xrow``), whole panels write their rows into
    a NaN-filled output, split panels write partials that are combined in slot order.

    What the launch reaches (default: everything): the first ``blocks`` blocks (a split panel is
    written only once all its blocks ran) and the columns with a nonzero count in ``columns``.
    ValueError for a launch that reaches past the arrays."""
    m, H = int(meta["m"]), int(meta["H"])
    R = _REDUCE[meta.get("reduce", "sum")]
    X = np.asarray(X, dtype=np.float64)
    K = X.shape[1]
    ufunc = (np.add, np.maximum, np.minimum)[R]
    ident = (0.0, -np.inf, np.inf)[R]
    a = {k: np.asarray(v).astype(np.int64) if np.asarray(v).dtype.kind == "i" else np.asarray(v)
         for k, v in arrays.items()}
    B = a["blk_s0"].size
    S = a["st_nc"].size
    blocks = B if blocks is None else int(blocks)
    if blocks > B:
        raise ValueError(f"the launch runs {blocks} blocks, the arrays hold {B}")
    cols = np.arange(K) if columns is None else np.flatnonzero(columns)
    ep = a["st_eptr"]
    assert ep[0] == 0 and np.all(np.diff(ep) >= 1), "empty or unordered steps"
    assert np.all(a["blk_s0"] <= a["blk_s1"]) and np.all(a["blk_s0"] <= a["blk_sf"]) and np.all(a["blk_sf"] <= a["blk_s1"])
    s_blk = np.full(S, -1, dtype=np.int64)
    s_blk[_segments(a["blk_s1"] - a["blk_s0"], a["blk_s0"])] = np.repeat(np.arange(B), a["blk_s1"] - a["blk_s0"])
    assert np.all(s_blk >= 0), "a step belongs to no block"
    s_gather = np.arange(S) < a["blk_sf"][s_blk]
    assert np.all(s_gather == (a["st_nc"] == 0)), "gather / staged steps out of order"
    e_step = np.repeat(np.arange(S), np.diff(ep))
    e_blk = s_blk[e_step]
    lr = a["ent_row"]
    assert np.all(lr >= 0) and np.all(lr < a["blk_nrows"][e_blk]), "entry outside its block's rows"
    g = s_gather[e_step]
    xrow = a["ent_col"].copy()
    assert np.all(xrow[~g] < a["st_nc"][e_step[~g]]), "entry outside its step's staged chunk"
    xrow[~g] = a["dense_xrow"][a["st_x0"][e_step[~g]] + xrow[~g]]
    acc = np.full((B * H, K), ident)
    ufunc.at(acc, e_blk * H + lr, a["ent_val"].astype(np.float64)[:, None] * X[xrow])
    acc = acc.reshape(B, H, K)
    Y = np.full((m, K), np.nan)
    empty = a["row_len"] == 0
    whole = a["blk_slot"] < 0
    for b in np.flatnonzero(whole[:blocks]):     # per block (tests only): rows of one panel
        r0, nr = a["blk_row0"][b], a["blk_nrows"][b]
        o = acc[b, :nr].copy()
        o[empty[r0:r0 + nr]] = 0.0
        Y[np.ix_(a["row_ids"][r0:r0 + nr], cols)] = o[:, cols]
    part = {int(a["blk_slot"][b]): (b, int(a["blk_grp"][b])) for b in np.flatnonzero(~whole)}
    for gi in range(a["grp_n"].size):
        slots = range(a["grp_first"][gi], a["grp_first"][gi] + a["grp_n"][gi])
        bs = [part[s][0] for s in slots]
        assert all(part[s][1] == gi for s in slots)
        r0, nr = a["blk_row0"][bs[0]], a["blk_nrows"][bs[0]]
        assert all(a["blk_row0"][b] == r0 for b in bs)
        if max(bs) >= blocks:                     # the group's last block never arrives
            continue
        o = np.full((nr, K), ident)
        for b in bs:
            o = ufunc(o, acc[b, :nr])
        o[empty[r0:r0 + nr]] = 0.0
        Y[np.ix_(a["row_ids"][r0:r0 + nr], cols)] = o[:, cols]
    return Y


def _expect(kernel: str, entry: str, args: Mapping[str, Any], **want) -> None:
    bad = {k: (args.get(k), v) for k, v in want.items() if args.get(k) != v}
    if bad:
        raise ValueError(f"{kernel}{entry}: scalar arguments (given, expected) {bad}")


def emulate_kernel(kernel, X: np.ndarray, fallback: bool = False) -> np.ndarray:
    """Run a built ``aspt.tiled`` kernel (no binary needed) through the emulation of its scheme with
    what its launches cover: its main instance, or with ``fallback`` its ``VEC = 1`` instance.
    ValueError when a launch's scalar arguments, shared memory or workspaces do not match the
    arrays (what would make the kernel read or write out of bounds)."""
    meta, a = kernel.meta, {k: np.asarray(v) for k, v in kernel.arrays.items()}
    name, (scheme, _, vec, targ) = meta["instances"][-1 if fallback else 0]
    K, m = int(meta["K"]), int(meta["m"])
    X = np.asarray(X)
    if X.shape[1] != K:
        raise ValueError(f"X has {X.shape[1]} columns, the kernel was built for K = {K}")
    if kernel.empty():
        return np.full((m, K), np.nan)
    specs = {}
    for s in kernel.launch_specs(int(vec)):
        if s.entry in specs:
            raise ValueError(f"{name}{s.entry} launched twice")
        if not (0 < s.block[0] <= 1024 and s.block[0] % 32 == 0) or min(s.grid) < 1:
            raise ValueError(f"{name}{s.entry}: block {s.block}, grid {s.grid}")
        specs[s.entry] = s
    if scheme == 1:                                          # "panel": <name>_panels
        kt, H = 32 * int(vec), int(meta["H"])
        p = specs.pop("_panels")
        chunk = int(p.args.get("chunk", 0))
        _expect(name, "_panels", p.args, K=K, H=H)
        if a["st_nc"].max(initial=0) > chunk or a["blk_nrows"].max(initial=0) > H:
            raise ValueError(f"{name}_panels: a step stages more than chunk = {chunk} columns or a block "
                             f"holds more than H = {H} rows")
        if p.smem < (H + int(targ) * chunk) * kt * 4:
            raise ValueError(f"{name}_panels: {p.smem} bytes of shared memory for {H} rows and {targ} x {chunk} "
                             f"staged columns of {kt}")
        ws = kernel.workspaces()
        nslot, ngrp = int((a["blk_slot"] >= 0).sum()), int(a["grp_n"].size)
        if ws["part"][0] < nslot * H * K or ws["counters"][0] < ngrp * p.grid[1]:
            raise ValueError(f"{name}_panels: workspaces {ws} too small for {nslot} slots / {ngrp} groups")
        out = emulate_panel_spmm(a, meta, X, blocks=p.grid[0], columns=spmm_columns(K, 32, int(vec), 1, p.grid[1]))
    else:                                                    # "tasks": <name>_rows, then <name>_tiles
        kt, cf = 32 * int(vec) * int(targ), int(targ)
        r = specs.pop("_rows")
        _expect(name, "_rows", r.args, m=m, K=K)
        rows = r.grid[0] * (r.block[0] // 32) * int(r.args["rpw"])
        ntask, ntail = int(a["task_eptr"].size) - 1, int(a["tail_lo"].size)
        t = specs.pop("_tiles", None)
        if t is None:
            if ntask or ntail:
                raise ValueError(f"{name}: {ntask} dense tasks and {ntail} tail segments but no tile launch")
            tasks = tails = 0
            tile_cols = None
        else:
            _expect(name, "_tiles", t.args, ntail=ntail, K=K)
            ntb = int(t.args["ntail_blocks"])
            tasks, tails = t.grid[0] - ntb, min(ntail, ntb * (t.block[0] // 32))
            if t.smem < int(a["task_nc"].max(initial=0)) * kt * 4:
                raise ValueError(f"{name}_tiles: {t.smem} bytes of shared memory for a chunk of "
                                 f"{int(a['task_nc'].max())} staged columns of {kt}")
            tile_cols = spmm_columns(K, 32, int(vec), cf, t.grid[1])
        out = emulate_aspt_spmm(a, meta, X, rows=rows, tasks=tasks, tails=tails,
                                row_columns=spmm_columns(K, 32, int(vec), cf, r.grid[1]), tile_columns=tile_cols)
    if specs:
        raise ValueError(f"{name}: launches of unknown entry points {sorted(specs)}")
    return out
