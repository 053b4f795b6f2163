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

from ..ir import SparseModule
from ..runtime import cuda as rt
from ..schedules.base import csr_kernel_arrays, register_template, unique_params
from .templates import _NvccKernel, _NvccTemplate, _largest_vec

__all__ = ["AsptTiled", "aspt_arrays", "emulate_aspt_spmm", "PANEL_HEIGHT"]

#: dynamic shared memory cap for the staged chunk (the H100 allows up to 227 KiB per block; two
#: blocks per SM at most this much each)
_SMEM_CAP = 112 * 1024
#: panel height of the offered pipelines
PANEL_HEIGHT = 256
_REDUCE = {"sum": 0, "mean": 0, "max": 1, "min": 2}


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _segments(counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Flat indices ``starts[i] .. starts[i] + counts[i]`` for every i (vectorised)."""
    counts = np.asarray(counts, dtype=np.int64)
    tot = int(counts.sum())
    first = np.cumsum(counts) - counts
    return np.repeat(np.asarray(starts, dtype=np.int64) - first, counts) + np.arange(tot, dtype=np.int64)


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
    fmt = mod.formats["aspt"]
    m = fmt.shape[0]
    H = int(fmt.panel_height)
    ka = csr_kernel_arrays(mod, np.int32)
    row_ids = np.asarray(ka["row_ids"], dtype=np.int64)
    cp = None if mod.col_perm is None else np.asarray(mod.col_perm, dtype=np.int64)
    mapc = (lambda c: np.asarray(c, dtype=np.int64)) if cp is None else (lambda c: cp[np.asarray(c, dtype=np.int64)])
    lens = np.diff(np.asarray(mod.A.indptr, dtype=np.int64))
    inv_len = 1.0 / np.maximum(lens, 1).astype(np.float64)
    mean = mod.op.reduce == "mean"

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


class AsptKernel(_NvccKernel):
    _ROWS = ("rem_ptr", "rem_end1", "row_len", "rem_col", "rem_val", "row_ids")
    _TILES = ("task_x0", "task_nc", "task_eptr", "dense_xrow", "ent_out", "ent_slot", "ent_val", "tail_lo", "tail_hi",
              "tail_out", "rem_col", "rem_val")

    def _module(self):
        """The fatbin's module on the current device (rebuilt here for another GPU generation)."""
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

    def prepare(self):
        mod = self._module()
        names = [n for n, _ in self.meta["instances"]]
        self._rows = [mod.get_function(n + "_rows") for n in (names[0], names[-1])]
        self._tiles = [mod.get_function(n + "_tiles") for n in (names[0], names[-1])]
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
        self._rows_pre, self._rows_post = rows, (np.int32(m), np.int32(K), np.int32(rpw))
        self._tiles_pre, self._tiles_post = tiles, (np.int32(ntail), np.int32(ntb), np.int32(K))
        self._block = (32 * W, 1, 1)
        gx_rows = max(1, -(-m // (W * rpw)))
        kt = (int(meta["KT"]), int(meta["KT1"]))
        self._grid_rows = [(gx_rows, -(-K // x), 1) for x in kt]
        self._grid_tiles = [(ntb + ntask, -(-K // x), 1) for x in kt]
        self._smem = [int(meta["smem"]), int(meta["smem1"])]
        for f, s in zip(self._tiles, self._smem):
            rt.ensure_dynamic_smem(f, s)
        self._has_tiles = ntb + ntask > 0
        self._amask = 4 * int(meta["vec"]) - 1
        self._empty = m == 0 or K == 0
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x = in_ptrs[0]
        i = 1 if (x | out_ptr) & self._amask else 0
        st = rt._stream(stream)
        self._rows[i](self._grid_rows[i], self._block, self._rows_pre + (x, out_ptr) + self._rows_post, stream=st)
        if self._has_tiles:
            self._tiles[i](self._grid_tiles[i], self._block, self._tiles_pre + (x, out_ptr) + self._tiles_post,
                           shared_mem=self._smem[i], stream=st)


@register_template
class AsptTiled(_NvccTemplate):
    """ASpT (PPoPP'19/'20) tiled SpMM: dense tasks (panel x chunk of dense columns) with their X rows
    staged in shared memory and entries split evenly over warps, remainder rows GE-SpMM style with
    long rows split; atomics combine.  sum / mean / max / min.  Tunable: chunk, max_seg, vector
    width, CF, warps per block, rows per warp.  Pipelines: tile.aspt, cluster.lsh -> tile.aspt."""

    name = "aspt.tiled"
    version = "3"
    priority = 10
    ops = (("spmm", "sum"), ("spmm", "mean"), ("spmm", "max"), ("spmm", "min"))
    format = "aspt"
    source_file = "aspt_tiled.cu"
    instance_macro = "SPC_ASPT_SPMM_INSTANCE"

    def requires(self, mod):
        return ("aspt",)

    def pipelines(self, mod):
        opts = {"panel_height": PANEL_HEIGHT, "dense_threshold": 2}
        return [[{"name": "tile.aspt", "options": dict(opts)}],
                [{"name": "cluster.lsh", "options": {"panel_height": PANEL_HEIGHT, "skip_dense_ratio": 1.0}},
                 {"name": "tile.aspt", "options": dict(opts)}]]

    def supports(self, mod):
        if not super().supports(mod):
            return False
        return mod.formats["aspt"].panel_height >= 1

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"chunk": C([32, 64, 128, 256, 512]), "max_seg": C([0, 64, 256, 1024]),
                "max_ent": C([0, 256, 1024, 4096]), "vec": C([1, 2, 4]),
                "cf": C([1, 2, 4]), "warps": C([4, 8, 16]), "rows_per_warp": C([1, 2, 4])}

    def default_params(self, mod):
        return {"chunk": 128, "max_seg": 256, "max_ent": 1024, "vec": _largest_vec(mod.op.K, 4), "cf": 1, "warps": 8,
                "rows_per_warp": 1}

    def seed_params(self, mod):
        d = self.default_params(mod)
        K = mod.op.K
        seeds = [d, {**d, "chunk": 256, "warps": 16}, {**d, "chunk": 64}, {**d, "max_ent": 256},
                 {**d, "max_ent": 4096, "warps": 16}, {**d, "vec": _largest_vec(K, 2), "chunk": 256},
                 {**d, "max_seg": 64}, {**d, "max_seg": 1024, "max_ent": 0}]
        if K >= 256:
            seeds.append({**d, "cf": 2})
        return unique_params(seeds)

    @staticmethod
    def instance_name(R, VEC, CF) -> str:
        return f"aspt_spmm_r{R}_v{VEC}_cf{CF}"

    def instances(self, vec: int, cf: int, rows_per_warp: int = 1, reduce: str = "sum") -> list:
        """Instances for a parameter set: the VEC-wide one and the VEC = 1 alignment fallback.  Each
        instance holds two kernels, ``<name>_rows`` and ``<name>_tiles``.  ``rows_per_warp`` is a
        launch argument (it does not change the binary; accepted for callers that pass it)."""
        R = _REDUCE[reduce]
        inst = [(self.instance_name(R, vec, cf), (R, vec, cf))]
        if vec > 1:
            inst.append((self.instance_name(R, 1, cf), (R, 1, cf)))
        return inst

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        if not self.supports(mod):
            raise ValueError("aspt.tiled needs an ASpT format (run tile.aspt first)")
        cf, chunk, W = int(params["cf"]), int(params["chunk"]), int(params["warps"])
        max_seg, rpw, max_ent = int(params["max_seg"]), int(params["rows_per_warp"]), int(params["max_ent"])
        if cf not in (1, 2, 4) or int(params["vec"]) not in (1, 2, 4) or chunk < 1 or W not in (1, 2, 4, 8, 16, 32) \
                or max_seg < 0 or rpw < 1 or max_ent < 0:
            raise ValueError(f"invalid aspt.tiled parameters {params}")
        K = mod.op.K
        vec = _largest_vec(K, int(params["vec"]))
        KT, KT1 = 32 * vec * cf, 32 * cf
        chunk = max(1, min(chunk, _SMEM_CAP // (KT * 4)))
        arrays = aspt_arrays(mod, chunk, max_seg, max_ent)
        inst = self.instances(vec, cf, rpw, mod.op.reduce)
        arch = rt.device_arch()
        path = self.compile(inst, arch=arch, name=inst[0][0])
        fmt = mod.formats["aspt"]
        meta = {"K": K, "m": mod.A.shape[0], "H": int(fmt.panel_height), "warps": W, "vec": vec, "KT": KT,
                "KT1": KT1, "chunk": chunk, "reduce": mod.op.reduce, "smem": chunk * KT * 4, "smem1": chunk * KT1 * 4,
                "arch": arch, "dense_ratio": float(fmt.dense_ratio), "tasks": int(arrays["task_eptr"].size) - 1,
                "tails": int(arrays["tail_lo"].size), "instances": [[n, list(a)] for n, a in inst]}
        return AsptKernel(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        return AsptKernel(self.name, params, arrays, files, meta, self)
