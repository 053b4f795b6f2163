"""Host arrays of the aspt family's kernels (``aspt_tiled.cu``), built vectorised from
``mod.formats["aspt"]`` (the ``tile.aspt`` layout) with the passes' permutations folded in
(original column ids, output row ids).  Array names are the kernels' parameter names.

* :func:`aspt_arrays`: scheme "tasks" (v3) -- dense tasks (panel x chunk of dense columns) for
  ``<name>_tiles`` and the remainder regrouped by row for ``<name>_rows`` (long rows' further
  segments as tail segments of ``<name>_tiles``).
* :func:`aspt_panel_arrays`: scheme "panel" (v4) -- per row panel its gather steps (remainder)
  then staged steps (dense chunks), cut into blocks of balanced work for ``<name>_panels``; heavy
  panels become groups of blocks combined in slot order.
"""
from __future__ import annotations

import numpy as np

from ...core.ir import SparseModule
from ..base import csr_kernel_arrays

__all__ = ["aspt_arrays", "aspt_panel_arrays"]


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _segments(counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Flat indices ``starts[i] .. starts[i] + counts[i]`` for every i (vectorised)."""
    counts = np.asarray(counts, dtype=np.int64)
    tot = int(counts.sum())
    first = np.cumsum(counts) - counts
    return np.repeat(np.asarray(starts, dtype=np.int64) - first, counts) + np.arange(tot, dtype=np.int64)


def _module_rows(mod: SparseModule):
    """What both packings need of the module: the ASpT format, its rows and panel height, the
    output row of every module row, a map from module to original columns, the row lengths,
    1 / length (for ``mean``) and whether the reduction is ``mean``."""
    fmt = mod.formats["aspt"]
    ka = csr_kernel_arrays(mod, np.int32)
    row_ids = np.asarray(ka["row_ids"], dtype=np.int64)
    cp = None if mod.col_perm is None else np.asarray(mod.col_perm, dtype=np.int64)
    mapc = (lambda c: np.asarray(c, dtype=np.int64)) if cp is None else (lambda c: cp[np.asarray(c, dtype=np.int64)])
    lens = np.diff(np.asarray(mod.A.indptr, dtype=np.int64))
    inv_len = 1.0 / np.maximum(lens, 1).astype(np.float64)
    return fmt, fmt.shape[0], int(fmt.panel_height), row_ids, mapc, lens, inv_len, mod.op.reduce == "mean"


def aspt_arrays(mod: SparseModule, chunk: int = 128, max_seg: int = 256, max_ent: int = 0) -> dict[str, np.ndarray]:
    """Kernel arrays from ``mod.formats["aspt"]`` with permutations folded in (original column
    ids, output row ids).

    Dense tasks: task t stages ``dense_xrow[task_x0[t] : task_x0[t] + task_nc[t]]`` (X row of
    each staged column; a chunk of at most ``chunk`` of a panel's dense columns);
    ``task_eptr`` (T + 1) slices the task's entries ``ent_out`` (output row, caller's order),
    ``ent_slot`` (shared-memory row inside the task), ``ent_val`` -- ordered by row, then slot.
    A chunk with more than ``max_ent`` entries (0: no limit) is split into several tasks that
    stage the same columns (balanced entry ranges).
    Remainder, regrouped by module row: ``rem_ptr`` (m + 1), ``rem_col``, ``rem_val``; the row
    kernel takes ``rem_ptr[r] .. rem_end1[r]`` (at most ``max_seg`` entries, all for 0), the
    tile kernel the segments ``tail_lo .. tail_hi`` (output row ``tail_out``).  ``row_len``:
    entries of each module row (0: the row's output is 0).  ``row_ids``: output row of each
    module row.  ``mean`` values are pre-scaled by 1 / row length."""
    chunk, max_seg = int(chunk), int(max_seg)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    fmt, m, H, row_ids, mapc, lens, inv_len, mean = _module_rows(mod)

    # ---- dense tasks
    dp = np.asarray(fmt.dense_ptr, dtype=np.int64)
    npan = dp.size - 1
    nch = -(-np.diff(dp) // chunk)
    tfirst = np.cumsum(nch) - nch
    T = int(nch.sum())
    t_pan = np.repeat(np.arange(npan, dtype=np.int64), nch)
    task_xptr = np.append(dp[t_pan] + (np.arange(T, dtype=np.int64) - tfirst[t_pan]) * chunk, dp[-1] if npan else 0)
    tp = np.asarray(fmt.tile_indptr, dtype=np.int64)
    erow = np.repeat(np.arange(m, dtype=np.int64), np.diff(tp))
    slot = np.asarray(fmt.tile_slots, dtype=np.int64)
    etask = tfirst[erow // H] + slot // chunk if erow.size else np.zeros(0, dtype=np.int64)
    order = np.argsort(etask, kind="stable")             # inside a task: by row, then slot
    tile_val = np.asarray(fmt.tile_data, dtype=np.float64)
    if mean:
        tile_val = tile_val * inv_len[erow]
    cnt = np.bincount(etask, minlength=T).astype(np.int64)
    nsub = np.ones(T, dtype=np.int64) if max_ent <= 0 else np.maximum(1, -(-cnt // max_ent))
    S = int(nsub.sum())
    s_task = np.repeat(np.arange(T, dtype=np.int64), nsub)
    s_i = np.arange(S, dtype=np.int64) - np.repeat(np.cumsum(nsub) - nsub, nsub)
    cstart = np.cumsum(cnt) - cnt
    task_eptr = np.append(cstart[s_task] + (s_i * cnt[s_task]) // nsub[s_task], cnt.sum())
    task_x0 = task_xptr[:-1][s_task]
    task_nc = np.diff(task_xptr)[s_task]

    # ---- remainder, regrouped by module row
    rem_rows = np.asarray(fmt.rem_rows, dtype=np.int64)
    rem_len = np.diff(np.asarray(fmt.rem_indptr, dtype=np.int64))
    ent_row = np.repeat(rem_rows, rem_len)
    rorder = np.argsort(ent_row, kind="stable")          # processing order -> module-row order
    rem_val = np.asarray(fmt.rem_data, dtype=np.float64)[rorder]
    counts = np.zeros(m, dtype=np.int64)
    counts[rem_rows] = rem_len
    rem_ptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(counts, out=rem_ptr[1:])
    if mean:
        rem_val = rem_val * np.repeat(inv_len, counts)
    first = counts if max_seg <= 0 else np.minimum(counts, max_seg)
    ntl = np.zeros(m, dtype=np.int64) if max_seg <= 0 else np.maximum(0, -(-counts // max_seg) - 1)
    t_row = np.repeat(np.arange(m, dtype=np.int64), ntl)
    within = np.arange(t_row.size, dtype=np.int64) - np.repeat(np.cumsum(ntl) - ntl, ntl) + 1
    tail_lo = rem_ptr[t_row] + within * max(max_seg, 1)
    tail_hi = np.minimum(tail_lo + max(max_seg, 1), rem_ptr[t_row + 1])

    return {"task_x0": _i32(task_x0), "task_nc": _i32(task_nc), "task_eptr": _i32(task_eptr),
            "dense_xrow": _i32(mapc(fmt.dense_cols)),
            "ent_out": _i32(row_ids[erow[order]]), "ent_slot": _i32((slot % chunk)[order]),
            "ent_val": np.ascontiguousarray(tile_val[order], dtype=np.float32),
            "rem_ptr": _i32(rem_ptr), "rem_end1": _i32(rem_ptr[:-1] + first), "row_len": _i32(lens),
            "rem_col": _i32(mapc(np.asarray(fmt.rem_indices)[rorder])),
            "rem_val": np.ascontiguousarray(rem_val, dtype=np.float32), "row_ids": _i32(row_ids),
            "tail_lo": _i32(tail_lo), "tail_hi": _i32(tail_hi), "tail_out": _i32(row_ids[t_row])}


#: SM count the panel scheme's block split aims at (the H100 SXM; only a balance target)
_NSM = 132
#: relative cost of a staged (shared-memory) entry vs a gathered (L2) entry, a staged X row and a
#: step (barrier), for the panel scheme's work balance
_W_DENSE, _W_STAGE, _W_STEP = 0.3, 1.0, 24.0


def aspt_panel_arrays(mod: SparseModule, chunk: int = 96, max_ent: int = 2048, split: int = 2,
                      ktiles: int = 1) -> dict[str, np.ndarray]:
    """Kernel arrays of the panel scheme (v4) from ``mod.formats["aspt"]``, permutations folded in.

    Entries, in *step* order: per row panel p (rows ``p*H .. p*H + H``), its remainder entries
    (ordered by row; ``ent_col`` = X row, gathered from global memory), then its dense entries
    chunk by chunk (``chunk`` dense columns per chunk; ordered by row, then slot; ``ent_col`` =
    slot inside the chunk); ``ent_row`` = row inside the panel.  A step is a run of at most
    ``max_ent`` entries of one such unit (0: no limit): ``st_eptr`` (S + 1), ``st_nc`` (staged X
    rows, 0 for a gather step), ``st_x0`` (first of them in ``dense_xrow``).
    Blocks: with target ``t = total work / (split * 132 / ktiles)``, a panel of work W is cut into
    ``max(1, round(W / t))`` blocks of equal work at step boundaries (``split = 0``: never cut);
    ``blk_s0 .. blk_s1``, gather steps first, ``blk_sf`` = first staged step; blocks are ordered
    heaviest first.  A panel cut into several blocks is a *group*: each of its blocks writes a
    partial into scratch slot ``blk_slot`` and the last one combines ``grp_first .. + grp_n`` in
    slot order (``blk_slot`` = -1, ``blk_grp`` = 0 for a whole panel).  ``row_len`` / ``row_ids``
    per module row; ``mean`` values pre-scaled by 1 / row length.  ``meta``: block / step counts."""
    chunk = int(chunk)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    fmt, m, H, row_ids, mapc, lens, inv_len, mean = _module_rows(mod)
    dp = np.asarray(fmt.dense_ptr, dtype=np.int64)
    npan = dp.size - 1

    # ---- remainder entries, by module row (hence by panel)
    rem_rows = np.asarray(fmt.rem_rows, dtype=np.int64)
    rem_len = np.diff(np.asarray(fmt.rem_indptr, dtype=np.int64))
    g_row = np.repeat(rem_rows, rem_len)
    rorder = np.argsort(g_row, kind="stable")
    g_row = g_row[rorder]
    g_col = mapc(np.asarray(fmt.rem_indices)[rorder])
    g_val = np.asarray(fmt.rem_data, dtype=np.float64)[rorder]
    if mean:
        g_val = g_val * inv_len[g_row]
    g_cnt = np.bincount(g_row // H, minlength=npan).astype(np.int64) if npan else np.zeros(0, np.int64)

    # ---- dense entries, by (panel, chunk), inside a chunk by (row, slot)
    nch = -(-np.diff(dp) // chunk)
    tfirst = np.cumsum(nch) - nch
    T = int(nch.sum())
    t_pan = np.repeat(np.arange(npan, dtype=np.int64), nch)
    t_x0 = dp[t_pan] + (np.arange(T, dtype=np.int64) - tfirst[t_pan]) * chunk
    t_nc = np.minimum(dp[t_pan + 1] - t_x0, chunk)
    tp = np.asarray(fmt.tile_indptr, dtype=np.int64)
    d_row = np.repeat(np.arange(m, dtype=np.int64), np.diff(tp))
    slot = np.asarray(fmt.tile_slots, dtype=np.int64)
    d_task = tfirst[d_row // H] + slot // chunk if d_row.size else np.zeros(0, dtype=np.int64)
    dorder = np.argsort(d_task, kind="stable")
    d_row, d_task = d_row[dorder], d_task[dorder]
    d_slot = (slot % chunk)[dorder]
    d_val = np.asarray(fmt.tile_data, dtype=np.float64)[dorder]
    if mean:
        d_val = d_val * inv_len[d_row]
    d_cnt = np.bincount(d_task, minlength=T).astype(np.int64)

    # ---- units in step order: per panel its gather unit (if any), then its chunks
    u_pan = np.concatenate([np.arange(npan, dtype=np.int64), t_pan])
    u_key = np.concatenate([tfirst + np.arange(npan), t_pan + 1 + np.arange(T)])     # panel's gather unit first
    u_cnt = np.concatenate([g_cnt, d_cnt])
    u_x0 = np.concatenate([np.zeros(npan, dtype=np.int64), t_x0])
    u_nc = np.concatenate([np.zeros(npan, dtype=np.int64), t_nc])
    uo = np.argsort(u_key, kind="stable")
    uo = uo[u_cnt[uo] > 0]
    U = uo.size
    upos = np.empty(npan + T, dtype=np.int64)
    upos[uo] = np.arange(U)
    u_start = np.cumsum(u_cnt[uo]) - u_cnt[uo]
    nent = int(u_cnt.sum())
    # destination of every entry
    g_first = np.cumsum(g_cnt) - g_cnt
    g_pan = g_row // H
    g_dst = u_start[upos[g_pan]] + np.arange(g_row.size, dtype=np.int64) - g_first[g_pan]
    d_first = np.cumsum(d_cnt) - d_cnt
    d_dst = u_start[upos[npan + d_task]] + np.arange(d_row.size, dtype=np.int64) - d_first[d_task]
    ent_row = np.empty(nent, dtype=np.int64)
    ent_col = np.empty(nent, dtype=np.int64)
    ent_val = np.empty(nent, dtype=np.float64)
    ent_row[g_dst], ent_col[g_dst], ent_val[g_dst] = g_row - g_pan * H, g_col, g_val
    ent_row[d_dst], ent_col[d_dst], ent_val[d_dst] = d_row - (d_row // H) * H, d_slot, d_val

    # ---- steps: units cut into balanced runs of at most max_ent entries
    cnt = u_cnt[uo]
    nsub = np.ones(U, dtype=np.int64) if max_ent <= 0 else np.maximum(1, -(-cnt // int(max_ent)))
    S = int(nsub.sum())
    s_unit = np.repeat(np.arange(U, dtype=np.int64), nsub)
    s_i = np.arange(S, dtype=np.int64) - np.repeat(np.cumsum(nsub) - nsub, nsub)
    st_eptr = np.append(u_start[s_unit] + (s_i * cnt[s_unit]) // nsub[s_unit], nent)
    s_pan = u_pan[uo][s_unit]
    st_nc = u_nc[uo][s_unit]
    st_x0 = u_x0[uo][s_unit]
    s_ne = np.diff(st_eptr)
    s_work = np.where(st_nc > 0, _W_DENSE, 1.0) * s_ne + _W_STAGE * st_nc + _W_STEP

    # ---- blocks: each panel's steps cut at multiples of the target work
    ktiles = max(1, int(ktiles))
    split = int(split)
    cw = np.cumsum(s_work) - s_work
    p_first = np.searchsorted(s_pan, np.arange(npan), side="left") if S else np.zeros(npan, dtype=np.int64)
    p_base = np.append(cw, 0.0)[p_first]
    p_work = np.bincount(s_pan, weights=s_work, minlength=npan) if S else np.zeros(npan)
    if split > 0:
        # a panel of work W becomes round(W / target) blocks of equal work (1 when W < 1.5 target)
        target_blocks = max(1, (split * _NSM) // ktiles)
        tgt = max(float(s_work.sum()) / target_blocks, 1e-9)
        pieces = np.maximum(1, np.rint(p_work / tgt)).astype(np.int64)
    else:                                                    # never split a panel
        pieces = np.ones(npan, dtype=np.int64)
    tgt_p = np.maximum(p_work / pieces, 1e-9)
    sub = (np.minimum(np.floor((cw - p_base[s_pan] + 0.5 * s_work) / tgt_p[s_pan]), pieces[s_pan] - 1).astype(np.int64)
           if S else np.zeros(0, np.int64))
    new = np.ones(S, dtype=bool)
    if S > 1:
        new[1:] = (s_pan[1:] != s_pan[:-1]) | (sub[1:] != sub[:-1])
    b_s0 = np.flatnonzero(new)
    B = b_s0.size
    b_s1 = np.append(b_s0[1:], S)
    b_pan = s_pan[b_s0] if B else np.zeros(0, dtype=np.int64)
    is_g = st_nc == 0
    # first staged step of each block (gather steps come first inside a panel)
    ng = np.add.reduceat(is_g.astype(np.int64), b_s0) if B else np.zeros(0, dtype=np.int64)
    b_sf = b_s0 + ng
    b_work = np.add.reduceat(s_work, b_s0) if B else np.zeros(0)
    nb_pan = np.bincount(b_pan, minlength=npan)
    # panels without any entry still get a (step-less) block: it writes their rows (0)
    ep = np.flatnonzero(nb_pan == 0)
    if ep.size:
        b_pan = np.concatenate([b_pan, ep])
        b_s0 = np.concatenate([b_s0, np.full(ep.size, S, dtype=np.int64)])
        b_s1 = np.concatenate([b_s1, np.full(ep.size, S, dtype=np.int64)])
        b_sf = np.concatenate([b_sf, np.full(ep.size, S, dtype=np.int64)])
        b_work = np.concatenate([b_work, np.zeros(ep.size)])
        nb_pan[ep] = 1
        B = b_pan.size
    split_b = nb_pan[b_pan] > 1
    b_slot = np.full(B, -1, dtype=np.int64)
    b_slot[split_b] = np.arange(int(split_b.sum()))
    gp = np.flatnonzero(nb_pan > 1)
    gidx = np.zeros(npan, dtype=np.int64)
    gidx[gp] = np.arange(gp.size)
    b_grp = np.where(split_b, gidx[b_pan], 0)
    grp_n = nb_pan[gp]
    grp_first = np.cumsum(grp_n) - grp_n
    row0 = b_pan * H
    nrows = np.minimum(row0 + H, m) - row0
    bo = np.argsort(-b_work, kind="stable")                  # heaviest first
    return {"blk_row0": _i32(row0[bo]), "blk_nrows": _i32(nrows[bo]), "blk_s0": _i32(b_s0[bo]),
            "blk_sf": _i32(b_sf[bo]), "blk_s1": _i32(b_s1[bo]), "blk_slot": _i32(b_slot[bo]),
            "blk_grp": _i32(b_grp[bo]), "st_x0": _i32(st_x0), "st_nc": _i32(st_nc), "st_eptr": _i32(st_eptr),
            "dense_xrow": _i32(mapc(fmt.dense_cols)), "ent_row": _i32(ent_row), "ent_col": _i32(ent_col),
            "ent_val": np.ascontiguousarray(ent_val, dtype=np.float32), "row_len": _i32(lens),
            "row_ids": _i32(row_ids), "grp_first": _i32(grp_first), "grp_n": _i32(grp_n)}
