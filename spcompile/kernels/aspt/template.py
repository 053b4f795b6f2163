"""``aspt.tiled``: ASpT tiled SpMM (Hong et al. PPoPP'19; ASpT-RR with ``cluster.lsh``, Jiang et al.
PPoPP'20) on the ``tile.aspt`` layout (``mod.formats["aspt"]``).

The point of ASpT is reuse: the X rows of a panel's dense columns are staged in shared memory
once and read by every entry of the panel that needs them, so the L2 -> SM gather traffic that
bounds a CSR SpMM on power-law graphs shrinks to (remainder entries + staged dense columns) rows.

Work decomposition (see ``aspt_tiled.cu``), all balanced at build time (vectorised numpy):

* dense *tasks* = (row panel, chunk of at most ``chunk`` of the panel's dense columns): one
  thread block per (task, K tile) stages the chunk once; its warps split the task's entries evenly
  (a hub row's dense entries are spread over the block) and combine each row's partial result
  into Y atomically;
* the remainder (CSR entries outside dense tiles) of each row: its first ``max_seg`` entries by a
  warp of the row kernel, which also initialises every output row with a plain store; further
  segments of long rows by warps of the tile kernel (atomics).

Two launches (row kernel, then tile kernel).  SpMM ``sum``, ``mean`` (values scaled by
1 / row length at build time), ``max`` and ``min`` (empty rows give 0).  Works in the caller's
order: ``cluster.lsh`` row permutations go to the output row ids, column permutations into the
staged / loaded X row ids.

Pipelines offered to the tuner: ``tile.aspt`` alone and ``cluster.lsh -> tile.aspt`` (round 1
forms panels of similar rows; its dense-ratio skip rule is disabled here, since the tile.aspt-only
pipeline is offered beside it and the tuner keeps the faster; ASpT-RR's round 2 only reorders the remainder's processing order,
which the row kernel does not depend on, so it is not offered), both with ``panel_height``
``PANEL_HEIGHT`` (tall panels: more rows share a staged X row; the work inside a panel is split by
chunks and entries, so a tall panel costs no parallelism).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...core.ir import SparseModule
from ...runtime import cuda as rt
from ...passes.recipes import ASPT_PANEL_HEIGHT
from ..base import csr_kernel_arrays, register_template, unique_params
from ..csr.template import _largest_vec
from ..nvcc import _NvccKernel, _NvccTemplate

__all__ = ["AsptTiled", "aspt_arrays", "emulate_aspt_spmm", "PANEL_HEIGHT"]

#: dynamic shared memory cap for the staged chunk (the H100 allows up to 227 KiB per block; two
#: blocks per SM at most this much each)
_SMEM_CAP = 112 * 1024
#: panel height of the offered pipelines
PANEL_HEIGHT = ASPT_PANEL_HEIGHT
_REDUCE = {"sum": 0, "mean": 0, "max": 1, "min": 2}


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


def emulate_aspt_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray) -> np.ndarray:
    """What the two kernels compute from the uploaded ``arrays``, in float64 (for tests): the row
    kernel's plain stores into a NaN-filled output, then the tile kernel's atomic combines (dense
    entries read X through their task's staged column list, tail segments)."""
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
    Y = np.full((m, K), np.nan)
    # row kernel
    n1 = a["rem_end1"].astype(np.int64) - rp[:-1]
    idx = _segments(n1, rp[:-1])
    acc = np.full((m, K), ident)
    ufunc.at(acc, np.repeat(np.arange(m), n1), rval[idx][:, None] * X[rcol[idx]])
    acc[a["row_len"] == 0] = 0.0
    Y[a["row_ids"].astype(np.int64)] = acc
    # tile kernel: dense tasks
    te = a["task_eptr"].astype(np.int64)
    et = np.repeat(np.arange(te.size - 1), np.diff(te))
    assert np.all(a["ent_slot"] < a["task_nc"][et]), "entry outside its task's staged chunk"
    xs_rows = a["dense_xrow"].astype(np.int64)[a["task_x0"].astype(np.int64)[et] + a["ent_slot"]]
    ufunc.at(Y, a["ent_out"].astype(np.int64), a["ent_val"].astype(np.float64)[:, None] * X[xs_rows])
    # tile kernel: tail segments
    tl, th = a["tail_lo"].astype(np.int64), a["tail_hi"].astype(np.int64)
    idx = _segments(th - tl, tl)
    ufunc.at(Y, np.repeat(a["tail_out"].astype(np.int64), th - tl), rval[idx][:, None] * X[rcol[idx]])
    return Y


#: SM count the panel scheme's block split aims at (the H100 SXM; only a balance target)
_NSM = 132
#: relative cost of a staged (shared-memory) entry vs a gathered (L2) entry, a staged X row and a
#: step (barrier), for the panel scheme's work balance
_W_DENSE, _W_STAGE, _W_STEP = 0.3, 1.0, 24.0


def smem_cap(arch: int) -> int:
    """Dynamic shared memory a block may use (opt-in maximum of the arch, minus static/slack)."""
    arch = int(arch)
    return (232448 if arch >= 90 else 166912 if arch == 80 or arch == 87 else 101376) - 1024


def panel_chunk(H: int, vec: int, nbuf: int, chunk: int, arch: int) -> int:
    """Chunk (staged dense columns per step) of the panel scheme that fits next to the H x KT
    accumulator in shared memory; 0 when even 8 rows do not fit."""
    KT = 32 * int(vec)
    room = smem_cap(arch) - int(H) * KT * 4
    c = min(int(chunk), room // (int(nbuf) * KT * 4)) if room > 0 else 0
    return c if c >= 8 else 0


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


def emulate_panel_spmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray) -> np.ndarray:
    """What the panel kernel computes from the uploaded ``arrays``, in float64 (for tests): every
    block reduces its steps' entries into its own accumulator (gather steps read X directly,
    staged steps through the step's chunk of ``dense_xrow``), whole panels write their rows into
    a NaN-filled output, split panels write partials that are combined in slot order."""
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
    for b in np.flatnonzero(whole):          # per block (tests only): rows of one panel
        r0, nr = a["blk_row0"][b], a["blk_nrows"][b]
        o = acc[b, :nr].copy()
        o[empty[r0:r0 + nr]] = 0.0
        Y[a["row_ids"][r0:r0 + nr]] = o
    part = {int(a["blk_slot"][b]): (b, int(a["blk_grp"][b])) for b in np.flatnonzero(~whole)}
    for gi in range(a["grp_n"].size):
        slots = range(a["grp_first"][gi], a["grp_first"][gi] + a["grp_n"][gi])
        bs = [part[s][0] for s in slots]
        assert all(part[s][1] == gi for s in slots)
        r0, nr = a["blk_row0"][bs[0]], a["blk_nrows"][bs[0]]
        assert all(a["blk_row0"][b] == r0 for b in bs)
        o = np.full((nr, K), ident)
        for b in bs:
            o = ufunc(o, acc[b, :nr])
        o[empty[r0:r0 + nr]] = 0.0
        Y[a["row_ids"][r0:r0 + nr]] = o
    return Y


class AsptKernel(_NvccKernel):
    """scheme "tasks" (v3): row kernel + tile kernel, atomics combine."""

    _ROWS = ("rem_ptr", "rem_end1", "row_len", "rem_col", "rem_val", "row_ids")
    _TILES = ("task_x0", "task_nc", "task_eptr", "dense_xrow", "ent_out", "ent_slot", "ent_val", "tail_lo", "tail_hi",
              "tail_out", "rem_col", "rem_val")

    def prepare(self):
        fns = self._load_functions()                          # [main instance, VEC = 1 instance]
        meta = self.meta
        K, m, W = int(meta["K"]), int(meta["m"]), int(meta["warps"])
        rpw = int(self.params["rows_per_warp"])
        names = list(dict.fromkeys(self._ROWS + self._TILES))   # each array uploaded once
        ptr = dict(zip(names, self._upload(names)))
        rows = tuple(ptr[k] for k in self._ROWS)
        tiles = tuple(ptr[k] for k in self._TILES)
        ntask = int(self.arrays["task_eptr"].size) - 1
        ntail = int(self.arrays["tail_lo"].size)
        ntb = -(-ntail // W)
        block = (32 * W, 1, 1)
        gx_rows = max(1, -(-m // (W * rpw)))
        kt = (int(meta["KT"]), int(meta["KT1"]))
        smem = (int(meta["smem"]), int(meta["smem1"]))
        self._has_tiles = ntb + ntask > 0
        self._launches = []
        for fn_pair, x, s in zip((fns[0], fns[-1]), kt, smem):
            f_rows, f_tiles = fn_pair
            lr = rt.Launch(f_rows, (gx_rows, -(-K // x), 1), block,
                           rows + (None, None, np.int32(m), np.int32(K), np.int32(rpw)))
            lt = None
            if self._has_tiles:
                rt.ensure_dynamic_smem(f_tiles, s)
                lt = rt.Launch(f_tiles, (ntb + ntask, -(-K // x), 1), block,
                               tiles + (None, None, np.int32(ntail), np.int32(ntb), np.int32(K)), s)
            self._launches.append((lr, lt))
        self._amask = 4 * int(meta["vec"]) - 1
        self._empty = m == 0 or K == 0
        self._ready = True

    def _load_functions(self):
        mod = self._load_module()
        return [(mod.get_function(n + "_rows"), mod.get_function(n + "_tiles")) for n, _ in self.meta["instances"]]

    def _load_module(self):
        import cupy

        self.device_id = cupy.cuda.runtime.getDevice()
        if not rt.check_arch(int(self.meta["arch"]), self.device_id):
            if not rt.nvcc_available():
                raise RuntimeError(f"kernel was built for sm_{self.meta['arch']} and cannot run on this GPU "
                                   f"(sm_{rt.device_arch(self.device_id)}); rebuild the module here")
            arch = rt.device_arch(self.device_id)
            path = self._tpl.compile([tuple(x) for x in self.meta["instances"]], arch=arch)
            self.files = {**self.files, "kernel.fatbin": path}
            self.meta = {**self.meta, "arch": arch}
        return rt.load_module(self.files["kernel.fatbin"])

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x = in_ptrs[0]
        lr, lt = self._launches[1 if (x | out_ptr) & self._amask else 0]
        lr((x, out_ptr), stream)
        if lt is not None:
            lt((x, out_ptr), stream)


class AsptPanelKernel(AsptKernel):
    """scheme "panel" (v4): one launch, block per (panel part, K tile), no global atomics."""

    _ARGS = ("blk_row0", "blk_nrows", "blk_s0", "blk_sf", "blk_s1", "blk_slot", "blk_grp", "st_x0", "st_nc",
             "st_eptr", "dense_xrow", "ent_row", "ent_col", "ent_val", "row_len", "row_ids", "grp_first", "grp_n")

    def _load_functions(self):
        mod = self._load_module()
        return [mod.get_function(n + "_panels") for n, _ in self.meta["instances"]]

    def prepare(self):
        import cupy

        fns = self._load_functions()
        meta = self.meta
        K, m, W, H = int(meta["K"]), int(meta["m"]), int(meta["warps"]), int(meta["H"])
        B = int(self.arrays["blk_s0"].size)
        ptrs = self._upload(self._ARGS)
        nslot = int((self.arrays["blk_slot"] >= 0).sum())
        ngrp = int(self.arrays["grp_n"].size)
        kt = (int(meta["KT"]), int(meta["KT1"]))
        self._part = cupy.empty(max(1, nslot * H * K), dtype=cupy.float32)
        self._counters = cupy.zeros(max(1, ngrp * -(-K // min(kt))), dtype=cupy.int32)
        self._launches = []
        for fn, x, s in zip((fns[0], fns[-1]), kt, (int(meta["smem"]), int(meta["smem1"]))):
            rt.ensure_dynamic_smem(fn, s)
            args = ptrs + (None, None, int(self._part.data.ptr), int(self._counters.data.ptr), np.int32(K),
                           np.int32(H), np.int32(meta["chunk"]))
            self._launches.append((rt.Launch(fn, (max(B, 1), -(-K // x), 1), (32 * W, 1, 1), args, s), None))
        self._amask = 4 * int(meta["vec"]) - 1
        self._empty = m == 0 or K == 0 or B == 0
        self._ready = True




@register_template
class AsptTiled(_NvccTemplate):
    """ASpT (PPoPP'19/'20) tiled SpMM, two schemes (param ``scheme``):

    * ``"panel"`` (v4): one block per (row panel part, K tile) keeps the panel's output rows in
      shared memory, gathers the remainder entries, stages the dense-column chunks (cp.async,
      double-buffered), and writes every output element once (no global atomics, one launch;
      panels with far more work than the mean are split and combined deterministically).
    * ``"tasks"`` (v3): dense tasks (panel x chunk) combined into Y with atomics after a row kernel.

    sum / mean / max / min.  Tunable: scheme, chunk, max_ent, vec, warps; panel: nbuf, split;
    tasks: max_seg, cf, rows_per_warp.  Pipelines: tile.aspt, cluster.lsh -> tile.aspt."""

    name = "aspt.tiled"
    version = "4"
    priority = 10
    ops = (("spmm", "sum"), ("spmm", "mean"), ("spmm", "max"), ("spmm", "min"))
    format = "aspt"
    source_file = "aspt_tiled.cu"
    instance_macro = "SPC_ASPT_SPMM_INSTANCE"

    def requires(self, mod):
        return ("aspt",)

    def supports(self, mod):
        if not super().supports(mod):
            return False
        return mod.formats["aspt"].panel_height >= 1

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"scheme": C(["panel", "tasks"]), "chunk": C([32, 64, 96, 128, 192, 256, 512]),
                "max_seg": C([0, 64, 256, 1024]), "max_ent": C([0, 256, 1024, 2048, 4096]), "vec": C([1, 2, 4]),
                "cf": C([1, 2, 4]), "warps": C([4, 8, 16, 32]), "rows_per_warp": C([1, 2, 4]),
                "nbuf": C([1, 2]), "split": C([0, 1, 2, 4, 8])}

    def default_params(self, mod):
        # v3 ("tasks") stays the default: on the H100 v4 ("panel") won only on a few graphs
        # (docs/aspt_benchmark.md); the panel seeds are offered beside it
        return {"scheme": "tasks", "chunk": 128, "max_seg": 256, "max_ent": 1024, "vec": _largest_vec(mod.op.K, 4),
                "cf": 1, "warps": 8, "rows_per_warp": 1, "nbuf": 1, "split": 2}

    def seed_params(self, mod):
        d = self.default_params(mod)
        K = mod.op.K
        v2 = _largest_vec(K, 2)
        # v3 seeds (as measured in the v3 benchmark)
        tasks = [d, {**d, "chunk": 256, "warps": 16}, {**d, "chunk": 64}, {**d, "max_ent": 256},
                 {**d, "max_ent": 4096, "warps": 16}, {**d, "vec": v2, "chunk": 256},
                 {**d, "max_seg": 64}, {**d, "max_seg": 1024, "max_ent": 0}]
        if K >= 256:
            tasks.append({**d, "cf": 2})
        # v4 seeds: 32 warps, large chunks won every graph of the first H100 run
        p = {**d, "scheme": "panel", "chunk": 192, "max_ent": 2048, "warps": 32, "nbuf": 1, "split": 2}
        panel = [p, {**p, "chunk": 96, "nbuf": 2, "split": 1}, {**p, "split": 4}, {**p, "split": 0},
                 {**p, "vec": v2, "chunk": 256, "nbuf": 2}]
        return unique_params(tasks + panel)

    @staticmethod
    def instance_name(R, VEC, CF, scheme: str = "tasks") -> str:
        if scheme == "panel":
            return f"aspt_panel_r{R}_v{VEC}_b{CF}"
        return f"aspt_spmm_r{R}_v{VEC}_cf{CF}"

    def instances(self, vec: int, cf: int, rows_per_warp: int = 1, reduce: str = "sum", scheme: str = "tasks",
                  nbuf: int = 2) -> list:
        """Instances for a parameter set: the VEC-wide one and the VEC = 1 alignment fallback.
        scheme "tasks": each holds ``<name>_rows`` and ``<name>_tiles`` (``rows_per_warp`` is a
        launch argument); scheme "panel": ``<name>_panels`` with ``nbuf`` chunk buffers."""
        R = _REDUCE[reduce]
        S, A = (1, int(nbuf)) if scheme == "panel" else (0, int(cf))
        inst = [(self.instance_name(R, vec, A, scheme), (S, R, vec, A))]
        if vec > 1:
            inst.append((self.instance_name(R, 1, A, scheme), (S, R, 1, A)))
        return inst

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        if not self.supports(mod):
            raise ValueError("aspt.tiled needs an ASpT format (run tile.aspt first)")
        scheme = params.get("scheme", "tasks")
        cf, chunk, W = int(params["cf"]), int(params["chunk"]), int(params["warps"])
        max_seg, rpw, max_ent = int(params["max_seg"]), int(params["rows_per_warp"]), int(params["max_ent"])
        nbuf, split = int(params.get("nbuf", 2)), int(params.get("split", 2))
        if scheme not in ("panel", "tasks") or cf not in (1, 2, 4) or int(params["vec"]) not in (1, 2, 4) \
                or chunk < 1 or W not in (1, 2, 4, 8, 16, 32) or max_seg < 0 or rpw < 1 or max_ent < 0 \
                or nbuf not in (1, 2) or split < 0:
            raise ValueError(f"invalid aspt.tiled parameters {params}")
        K = mod.op.K
        vec = _largest_vec(K, int(params["vec"]))
        fmt = mod.formats["aspt"]
        H = int(fmt.panel_height)
        arch = rt.device_arch()
        meta = {"K": K, "m": mod.A.shape[0], "H": H, "warps": W, "vec": vec, "reduce": mod.op.reduce, "arch": arch,
                "dense_ratio": float(fmt.dense_ratio), "scheme": scheme}
        if scheme == "panel":
            KT, KT1 = 32 * vec, 32
            chunk = panel_chunk(H, vec, nbuf, chunk, arch)
            if chunk == 0:
                raise ValueError(f"aspt.tiled panel: a {H}-row accumulator of {KT} columns leaves no room for "
                                 f"staged columns in shared memory (use a smaller vec or panel height)")
            arrays = aspt_panel_arrays(mod, chunk, max_ent, split, -(-K // KT))
            inst = self.instances(vec, 1, 1, mod.op.reduce, "panel", nbuf)
            meta.update({"KT": KT, "KT1": KT1, "chunk": chunk, "nbuf": nbuf,
                         "smem": (H + nbuf * chunk) * KT * 4, "smem1": (H + nbuf * chunk) * KT1 * 4,
                         "blocks": int(arrays["blk_s0"].size), "steps": int(arrays["st_nc"].size),
                         "split_panels": int(arrays["grp_n"].size)})
            cls = AsptPanelKernel
        else:
            KT, KT1 = 32 * vec * cf, 32 * cf
            chunk = max(1, min(chunk, _SMEM_CAP // (KT * 4)))
            arrays = aspt_arrays(mod, chunk, max_seg, max_ent)
            inst = self.instances(vec, cf, rpw, mod.op.reduce, "tasks")
            meta.update({"KT": KT, "KT1": KT1, "chunk": chunk, "smem": chunk * KT * 4, "smem1": chunk * KT1 * 4,
                         "tasks": int(arrays["task_eptr"].size) - 1, "tails": int(arrays["tail_lo"].size)})
            cls = AsptKernel
        path = self.compile(inst, arch=arch, name=inst[0][0])
        meta["instances"] = [[n, list(a)] for n, a in inst]
        return cls(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        cls = AsptPanelKernel if meta.get("scheme") == "panel" else AsptKernel
        return cls(self.name, params, arrays, files, meta, self)
