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

The family on the :class:`~spcompile.kernels.nvcc.NvccTemplate` base: arrays from ``packer.py``,
numpy emulation of both schemes in ``emulate.py``; every launch argument bound by name
(``<name>_rows`` + ``<name>_tiles`` of scheme "tasks" are one call's two launches).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...passes.recipes import ASPT_PANEL_HEIGHT
from ...runtime import cuda as rt
from ..base import (check_entries, check_instances, index_array, meta_equal, meta_int, pointer_array,
                    register_template, typed_array, unique_params)
from ..csr.template import _largest_vec
from ..nvcc import AtLeast, LaunchSpec, NvccKernel, NvccTemplate
from .emulate import emulate_aspt_spmm, emulate_panel_spmm  # noqa: F401 (public here too)
from .packer import aspt_arrays, aspt_panel_arrays  # noqa: F401 (public here too)

__all__ = ["AsptTiled", "AsptKernel", "AsptPanelKernel", "aspt_arrays", "aspt_panel_arrays", "emulate_aspt_spmm",
           "emulate_panel_spmm", "smem_cap", "panel_chunk", "PANEL_HEIGHT"]

#: dynamic shared memory cap for the staged chunk (the H100 allows up to 227 KiB per block; two
#: blocks per SM at most this much each)
_SMEM_CAP = 112 * 1024
#: panel height of the offered pipelines
PANEL_HEIGHT = ASPT_PANEL_HEIGHT
_REDUCE = {"sum": 0, "mean": 0, "max": 1, "min": 2}
#: the arrays of each scheme's kernels (``aspt_arrays`` / ``aspt_panel_arrays``) with the element
#: type of their kernel parameters
TASK_ARRAYS = {**{k: np.int32 for k in ("task_x0", "task_nc", "task_eptr", "dense_xrow", "ent_out", "ent_slot",
                                          "rem_ptr", "rem_end1", "row_len", "rem_col", "row_ids", "tail_lo",
                                          "tail_hi", "tail_out")},
               "ent_val": np.float32, "rem_val": np.float32}
PANEL_ARRAYS = {**{k: np.int32 for k in ("blk_row0", "blk_nrows", "blk_s0", "blk_sf", "blk_s1", "blk_slot",
                                           "blk_grp", "st_x0", "st_nc", "st_eptr", "dense_xrow", "ent_row",
                                           "ent_col", "row_len", "row_ids", "grp_first", "grp_n")},
                "ent_val": np.float32}
_INT_MAX = 2**31 - 1


_typed = typed_array


def _index(arrays, name: str, lo: int, hi: int, size: int | None = None, of: str = "") -> np.ndarray:
    _typed(arrays, name, np.int32, size, of)
    return index_array(arrays, name, lo, hi, size)


def _staging(arrays, prefix: str, units: str, chunk: int, ndense: int):
    """``ent_val`` and the units (tasks, steps) that stage X rows for it: ``<prefix>_eptr`` from 0
    to the entries, per unit ``<prefix>_x0`` and ``0 <= <prefix>_nc <= chunk`` staged rows of
    ``dense_xrow`` (inside its ``ndense``).  Returns (ent_val, eptr, x0, nc)."""
    ent_val = _typed(arrays, "ent_val", np.float32)
    eptr = _pointer(arrays, f"{prefix}_eptr", ent_val.size, last_of="the entries of 'ent_val'")
    of = f"the {units} of '{prefix}_eptr'"
    x0 = _index(arrays, f"{prefix}_x0", 0, ndense + 1, eptr.size - 1, of)
    nc = _index(arrays, f"{prefix}_nc", 0, chunk + 1, eptr.size - 1, of)
    if np.any(x0 + nc > ndense):
        raise ValueError(f"arrays '{prefix}_x0' / '{prefix}_nc' stage columns past the end of 'dense_xrow'")
    return ent_val, eptr, x0, nc


def _pointer(arrays, name: str, last: int, size: int | None = None, of: str = "", last_of: str = "") -> np.ndarray:
    """A pointer array (``size`` entries) rising from 0 to ``last`` (``last_of``: what it counts)."""
    _typed(arrays, name, np.int32, size, of)
    try:
        return pointer_array(arrays, name, last, size)
    except ValueError as e:
        raise ValueError(f"{e}" + (f" ({last_of})" if last_of else "")) from None


def _param(params, name: str, allowed=None, lo: int = 0):
    """Parameter ``name``: one of ``allowed`` (strings or integers), else an integer >= ``lo``."""
    v = params.get(name)
    if allowed is not None and all(isinstance(a, str) for a in allowed):
        if v not in allowed:
            raise ValueError(f"parameter {name!r} must be one of {list(allowed)}, got {v!r}")
        return v
    if (not isinstance(v, (int, np.integer)) or isinstance(v, bool)
            or (int(v) not in allowed if allowed is not None else not lo <= int(v) <= _INT_MAX)):
        raise ValueError(f"parameter {name!r} must be " + (f"one of {list(allowed)}" if allowed is not None else
                                                          f"an integer >= {lo}") + f", got {v!r}")
    return int(v)


def _cover(starts: np.ndarray, ends: np.ndarray, size: int) -> np.ndarray:
    """How many of the ranges ``[starts[i], ends[i])`` (inside ``[0, size]``) hold each of
    ``0 .. size - 1``."""
    d = np.bincount(starts, minlength=size + 1) - np.bincount(ends, minlength=size + 1)
    return np.cumsum(d)[:size]


def _row_counts(row_len: np.ndarray, row_ids: np.ndarray, out_rows: np.ndarray, m: int) -> None:
    """``row_len`` (per module row) must count the entries that land in its output row."""
    if not np.array_equal(np.bincount(out_rows, minlength=m)[row_ids], row_len):
        raise ValueError("array 'row_len' does not count the entries of each row")


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



# ------------------------------------------------------------------------------------------
class AsptKernel(NvccKernel):
    """scheme "tasks" (v3): ``<name>_rows`` (a warp per ``rows_per_warp`` module rows stores every
    output row once), then ``<name>_tiles`` (tail segments of long rows, then one block per dense
    task; atomics combine) -- left out when there is neither."""

    inputs, output = ("X",), "Y"

    def launch_spec(self, vec):
        meta, a = self.meta, self.arrays
        K, m, W = int(meta["K"]), int(meta["m"]), int(meta["warps"])
        rpw = int(self.params["rows_per_warp"])
        kt = 32 * int(vec) * int(self.params["cf"])
        block = (32 * W, 1, 1)
        rows = LaunchSpec((max(1, -(-m // (W * rpw))), -(-K // kt), 1), block, 0,
                          {"m": m, "K": K, "rpw": rpw}, entry="_rows")
        ntask, ntail = int(a["task_eptr"].size) - 1, int(a["tail_lo"].size)
        ntb = -(-ntail // W)
        if ntb + ntask == 0:
            return (rows,)
        tiles = LaunchSpec((ntb + ntask, -(-K // kt), 1), block, int(meta["chunk"]) * kt * 4,
                           {"ntail": ntail, "ntail_blocks": ntb, "K": K}, entry="_tiles")
        return rows, tiles

    def empty(self):
        return int(self.meta["m"]) == 0 or int(self.meta["K"]) == 0


class AsptPanelKernel(NvccKernel):
    """scheme "panel" (v4): one launch of ``<name>_panels``, a block per (panel part, K tile); split
    panels combine through the ``part`` / ``counters`` workspaces, no global atomics on Y."""

    inputs, output = ("X",), "Y"

    def launch_spec(self, vec):
        meta = self.meta
        K, H, chunk = int(meta["K"]), int(meta["H"]), int(meta["chunk"])
        kt = 32 * int(vec)
        B = int(self.arrays["blk_s0"].size)
        return LaunchSpec((max(B, 1), -(-K // kt), 1), (32 * int(meta["warps"]), 1, 1),
                          (H + int(meta["nbuf"]) * chunk) * kt * 4, {"K": K, "H": H, "chunk": chunk}, entry="_panels")

    def workspaces(self):
        K, H, a = int(self.meta["K"]), int(self.meta["H"]), self.arrays
        return {"part": (int((a["blk_slot"] >= 0).sum()) * H * K, "float32"),
                "counters": (int(a["grp_n"].size) * -(-K // 32), "int32")}     # VEC = 1 has the most K tiles

    def empty(self):
        return int(self.meta["m"]) == 0 or int(self.meta["K"]) == 0 or self.arrays["blk_s0"].size == 0


# ------------------------------------------------------------------------------------------
@register_template
class AsptTiled(NvccTemplate):
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
    kernel_class = AsptKernel
    fallback_param = "vec"

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
        # (H100, the retired aspt benchmark); the panel seeds are offered beside it
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

    def checks(self, mod):
        return {"scheme": ("panel", "tasks"), "chunk": AtLeast(1), "max_seg": AtLeast(0), "max_ent": AtLeast(0),
                "vec": (1, 2, 4), "cf": (1, 2, 4), "warps": (1, 2, 4, 8, 16, 32), "rows_per_warp": AtLeast(1),
                "nbuf": (1, 2), "split": AtLeast(0)}

    def validate(self, mod, params):
        if not self.supports(mod):
            raise ValueError("aspt.tiled needs an ASpT format (run tile.aspt first)")
        super().validate(mod, params)
        if params["scheme"] == "panel" and self._chunk(mod, params) == 0:
            H, KT = int(mod.formats["aspt"].panel_height), 32 * self._vec(mod, params)
            raise ValueError(f"aspt.tiled panel: a {H}-row accumulator of {KT} columns leaves no room for "
                             f"staged columns in shared memory (use a smaller vec or panel height)")

    @staticmethod
    def _vec(mod, params) -> int:
        return _largest_vec(mod.op.K, int(params["vec"]))

    def _chunk(self, mod, params) -> int:
        """The staged columns per chunk: ``chunk`` capped by the shared memory of the build's GPU
        generation (panel scheme: next to the H x KT accumulator; 0 when nothing fits)."""
        vec, chunk = self._vec(mod, params), int(params["chunk"])
        if params["scheme"] == "panel":
            return panel_chunk(int(mod.formats["aspt"].panel_height), vec, int(params["nbuf"]), chunk,
                               rt.device_arch())
        return max(1, min(chunk, _SMEM_CAP // (32 * vec * int(params["cf"]) * 4)))

    def pack(self, mod, params):
        chunk = self._chunk(mod, params)
        if params["scheme"] == "panel":
            return aspt_panel_arrays(mod, chunk, int(params["max_ent"]), int(params["split"]),
                                     -(-mod.op.K // (32 * self._vec(mod, params))))
        return aspt_arrays(mod, chunk, int(params["max_seg"]), int(params["max_ent"]))

    def instance_args(self, mod, params):
        panel = params["scheme"] == "panel"
        return {"vec": self._vec(mod, params), "cf": 1 if panel else int(params["cf"]), "reduce": mod.op.reduce,
                "scheme": params["scheme"], "nbuf": int(params["nbuf"])}

    def extra_meta(self, mod, params, arrays):
        fmt, vec, chunk = mod.formats["aspt"], self._vec(mod, params), self._chunk(mod, params)
        H, W = int(fmt.panel_height), int(params["warps"])
        meta = {"H": H, "warps": W, "reduce": mod.op.reduce, "dense_ratio": float(fmt.dense_ratio),
                "scheme": params["scheme"], "chunk": chunk}
        if params["scheme"] == "panel":
            nbuf = int(params["nbuf"])
            return {**meta, "KT": 32 * vec, "KT1": 32, "nbuf": nbuf, "smem": (H + nbuf * chunk) * 32 * vec * 4,
                    "smem1": (H + nbuf * chunk) * 32 * 4, "blocks": int(arrays["blk_s0"].size),
                    "steps": int(arrays["st_nc"].size), "split_panels": int(arrays["grp_n"].size)}
        cf = int(params["cf"])
        return {**meta, "KT": 32 * vec * cf, "KT1": 32 * cf, "smem": chunk * 32 * vec * cf * 4,
                "smem1": chunk * 32 * cf * 4, "tasks": int(arrays["task_eptr"].size) - 1,
                "tails": int(arrays["tail_lo"].size)}

    def check_arrays(self, key, params, arrays, meta, values=None):
        """Every index the kernels follow stays inside its array, X (``key.cols`` rows), Y
        (``key.rows`` rows), the dynamic shared memory of its launch and the workspaces, and the
        launches are the ones these arrays were built for (see ``aspt_tiled.cu``):

        * the parameters / meta that shape the launches and the instances (``m``, ``K``, dtype,
          scheme, reduce, warps, vec, cf, nbuf, chunk, H, the shared-memory sizes, the counts of
          tasks / tails / blocks / steps / split panels, ``instances``) agree with the workload key,
          with each other and with the arrays;
        * every array has the element type of its kernel parameter; ``row_ids`` is a permutation
          of the output rows, ``row_len`` counts each row's entries;
        * per scheme the structure below, and in the end the entries (output row, original
          column) rebuild the manifest's matrix (pattern hash; the values hash too, except for
          ``mean``, whose values are pre-scaled): no entry lost, repeated or invented."""
        m, n, K = key.rows, key.cols, key.K
        for what, v in (("rows", m), ("cols", n), ("K", K)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 0 <= v <= _INT_MAX:
                raise ValueError(f"workload {what} must be an integer in [0, 2**31), got {v!r}")
        if key.dtype not in self.dtypes or key.reduce not in _REDUCE:
            raise ValueError(f"{self.name} computes spmm {sorted(_REDUCE)} in {list(self.dtypes)}, "
                             f"not {key.reduce!r} in {key.dtype!r}")
        scheme = _param(params, "scheme", ("panel", "tasks"))
        names = PANEL_ARRAYS if scheme == "panel" else TASK_ARRAYS
        if sorted(arrays) != sorted(names):
            raise ValueError(f"{self.name} scheme {scheme!r} takes arrays {sorted(names)}, got {sorted(arrays)}")
        # --- launch scalars, parameters, instances
        meta_int(meta, "m", m)
        meta_int(meta, "K", K, lo=1)
        meta_equal(meta, "dtype", key.dtype)
        meta_equal(meta, "scheme", scheme)
        meta_equal(meta, "reduce", key.reduce)
        vec = _largest_vec(K, _param(params, "vec", (1, 2, 4)))
        cf = _param(params, "cf", (1, 2, 4))
        W = _param(params, "warps", (1, 2, 4, 8, 16, 32))
        nbuf = _param(params, "nbuf", (1, 2))
        chunk_p = _param(params, "chunk", lo=1)
        _param(params, "rows_per_warp", lo=1)
        for p in ("max_seg", "max_ent", "split"):
            _param(params, p, lo=0)
        meta_int(meta, "vec", vec)
        meta_int(meta, "warps", W)
        arch = meta_int(meta, "arch")
        H = meta_int(meta, "H", lo=1)
        check_instances(meta, [[nm, list(a)] for nm, a in self.instances(
            vec=vec, cf=1 if scheme == "panel" else cf, reduce=key.reduce, scheme=scheme, nbuf=nbuf)])
        row_ids = _index(arrays, "row_ids", 0, m, m, "m")
        if m and not np.all(np.bincount(row_ids, minlength=m) == 1):
            raise ValueError("array 'row_ids' is not a permutation of the rows")
        row_len = _index(arrays, "row_len", 0, n + 1, m, "m")
        dense_xrow = _index(arrays, "dense_xrow", 0, n)
        if scheme == "panel":
            chunk = panel_chunk(H, vec, nbuf, chunk_p, arch)
            if chunk < 1:
                raise ValueError(f"kernel meta 'H' = {H}: no room for staged columns in shared memory")
            meta_int(meta, "chunk", chunk)
            meta_int(meta, "nbuf", nbuf)
            for k, kt in (("KT", 32 * vec), ("KT1", 32)):
                meta_int(meta, k, kt)
                try:
                    meta_int(meta, "smem" + k[2:], (H + nbuf * chunk) * kt * 4)
                except ValueError as e:
                    raise ValueError(f"{e} (kernel meta 'H' = {H}, 'nbuf' = {nbuf}, 'chunk' = {chunk})") from None
            r, c, v = self._check_panel(arrays, meta, m, n, H, chunk, dense_xrow.size)
        else:
            chunk = max(1, min(chunk_p, _SMEM_CAP // (32 * vec * cf * 4)))
            meta_int(meta, "chunk", chunk)
            for k, kt in (("KT", 32 * vec * cf), ("KT1", 32 * cf)):
                meta_int(meta, k, kt)
                meta_int(meta, "smem" + k[2:], chunk * kt * 4)
            r, c, v = self._check_tasks(arrays, meta, m, n, chunk, row_ids, dense_xrow.size)
        # every entry once, in range: the matrix of the manifest
        _row_counts(row_len, row_ids, r, m)
        if r.size != key.nnz:
            raise ValueError(f"the entries of the arrays ({r.size}) are not the matrix's nnz={key.nnz}")
        check_entries(r, c, v if key.reduce != "mean" else None, m, n, key.pattern,
                      values if key.reduce != "mean" else None)

    @staticmethod
    def _check_tasks(arrays, meta, m, n, chunk, row_ids, ndense):
        """Scheme "tasks": the row kernel's first segments ``rem_ptr[r] .. rem_end1[r]`` and the
        tail segments ``tail_lo .. tail_hi`` split every row's remainder entries (``rem_ptr``
        from 0 to them; ``rem_col`` X rows) exactly once, a tail inside one row and writing that
        row's output (``tail_out``); every dense task stages ``task_nc <= chunk`` (the shared
        memory of the launch) X rows ``dense_xrow[task_x0 ..]`` inside ``dense_xrow``, its entries
        (``task_eptr`` from 0 to them) read a staged row (``ent_slot < task_nc``) and write an
        output row (``ent_out``).  Returns the entries (output row, original column, value)."""
        dx = np.asarray(arrays["dense_xrow"], np.int64)
        # remainder
        rem_val = _typed(arrays, "rem_val", np.float32)
        nrem = rem_val.size
        rem_col = _index(arrays, "rem_col", 0, n, nrem, "the entries of 'rem_val'")
        rem_ptr = _pointer(arrays, "rem_ptr", nrem, m + 1, "m + 1", "the entries of 'rem_val'")
        rem_end1 = _index(arrays, "rem_end1", 0, nrem + 1, m, "m")
        if np.any(rem_end1 < rem_ptr[:-1]) or np.any(rem_end1 > rem_ptr[1:]):
            raise ValueError("array 'rem_end1' must end each row's first segment inside the row (rem_ptr)")
        tail_lo = _index(arrays, "tail_lo", 0, nrem)
        ntail = tail_lo.size
        tail_hi = _index(arrays, "tail_hi", 0, nrem + 1, ntail, "the segments of 'tail_lo'")
        tail_out = _index(arrays, "tail_out", 0, m, ntail, "the segments of 'tail_lo'")
        if np.any(tail_hi <= tail_lo):
            raise ValueError("array 'tail_hi' must end every tail segment after its start (tail_lo)")
        if np.any(_cover(np.concatenate([rem_ptr[:-1], tail_lo]), np.concatenate([rem_end1, tail_hi]), nrem) != 1):
            raise ValueError("arrays 'rem_end1' / 'tail_lo' / 'tail_hi' must cover every remainder entry exactly once")
        rrow = np.repeat(np.arange(m, dtype=np.int64), np.diff(rem_ptr))       # module row of each entry
        trow = rrow[tail_lo] if ntail else np.zeros(0, np.int64)
        if np.any(tail_hi > rem_ptr[trow + 1]):
            raise ValueError("array 'tail_hi' runs a tail segment past its row's entries (rem_ptr)")
        if not np.array_equal(tail_out, row_ids[trow]):
            raise ValueError("array 'tail_out' must be the output row of each tail segment's row")
        # dense tasks
        ent_val, task_eptr, task_x0, task_nc = _staging(arrays, "task", "tasks", chunk, ndense)
        nent, ntask = ent_val.size, task_eptr.size - 1
        ent_out = _index(arrays, "ent_out", 0, m, nent, "the entries of 'ent_val'")
        ent_slot = _index(arrays, "ent_slot", 0, chunk, nent, "the entries of 'ent_val'")
        etask = np.repeat(np.arange(ntask, dtype=np.int64), np.diff(task_eptr))
        if np.any(ent_slot >= task_nc[etask]):
            raise ValueError("array 'ent_slot' names a column its task does not stage (task_nc)")
        meta_int(meta, "tasks", ntask)
        meta_int(meta, "tails", ntail)
        return (np.concatenate([row_ids[rrow], ent_out]), np.concatenate([rem_col, dx[task_x0[etask] + ent_slot]]),
                np.concatenate([rem_val, ent_val]))

    @staticmethod
    def _check_panel(arrays, meta, m, n, H, chunk, ndense):
        """Scheme "panel": blocks own ``blk_nrows <= H`` (the shared accumulator) rows from
        ``blk_row0`` inside Y's rows and the steps ``blk_s0 <= blk_sf <= blk_s1`` (``st_*``
        arrays, ``st_eptr`` from 0 to the entries); the blocks' step ranges cover every step
        exactly once; a block's steps before ``blk_sf`` gather (``st_nc`` = 0, ``ent_col`` an X
        row), the rest stage ``1 <= st_nc <= chunk`` X rows of ``dense_xrow`` (``ent_col`` one of
        them); ``ent_row`` a row of the step's block, ordered inside a step.  Split blocks have
        distinct scratch slots ``blk_slot`` (``part`` holds one per split block), each inside its
        group ``blk_grp`` (``grp_first .. + grp_n``, ``grp_n`` blocks, one panel), the groups
        index the ``counters``; every output row is written by exactly one whole block or group.
        Returns the entries (output row, original column, value)."""
        dx = np.asarray(arrays["dense_xrow"], np.int64)
        row_ids = np.asarray(arrays["row_ids"], np.int64)
        # steps and entries
        ent_val, st_eptr, st_x0, st_nc = _staging(arrays, "st", "steps", chunk, ndense)
        nent, S = ent_val.size, st_eptr.size - 1
        # blocks
        blk_s0 = _index(arrays, "blk_s0", 0, S + 1)
        B = blk_s0.size
        blk_sf = _index(arrays, "blk_sf", 0, S + 1, B, "the blocks of 'blk_s0'")
        blk_s1 = _index(arrays, "blk_s1", 0, S + 1, B, "the blocks of 'blk_s0'")
        if np.any(blk_sf < blk_s0) or np.any(blk_s1 < blk_sf):
            raise ValueError("arrays 'blk_s0' / 'blk_sf' / 'blk_s1' must be ordered s0 <= sf <= s1")
        if np.any(_cover(blk_s0, blk_s1, S) != 1):
            raise ValueError("arrays 'blk_s0' / 'blk_s1' must give every step to exactly one block")
        blk_row0 = _index(arrays, "blk_row0", 0, m + 1, B, "the blocks of 'blk_s0'")
        blk_nrows = _index(arrays, "blk_nrows", 0, H + 1, B, "the blocks of 'blk_s0'")
        if np.any(blk_row0 + blk_nrows > m):
            raise ValueError("arrays 'blk_row0' / 'blk_nrows' name rows past the matrix's")
        # the block of every step (block ranges are disjoint and cover the steps)
        own = blk_s0 < blk_s1
        at = np.full(S, -1, np.int64)
        at[blk_s0[own]] = np.flatnonzero(own)
        start = np.maximum.accumulate(np.where(at >= 0, np.arange(S), 0)) if S else np.zeros(0, np.int64)
        sblk = at[start]
        gather = np.arange(S) < blk_sf[sblk]
        if np.any(st_nc[gather] != 0) or np.any(st_nc[~gather] == 0):
            raise ValueError("arrays 'st_nc' / 'blk_sf': a block's steps before blk_sf gather (st_nc = 0), "
                             "the others stage columns (st_nc >= 1)")
        ent_row = _index(arrays, "ent_row", 0, H, nent, "the entries of 'ent_val'")
        ent_col = _index(arrays, "ent_col", 0, max(n, chunk), nent, "the entries of 'ent_val'")
        estep = np.repeat(np.arange(S, dtype=np.int64), np.diff(st_eptr))
        eblk = sblk[estep]
        if np.any(ent_row >= blk_nrows[eblk]):
            raise ValueError("array 'ent_row' names a row outside its block (blk_nrows)")
        if nent > 1 and np.any((ent_row[1:] < ent_row[:-1]) & (estep[1:] == estep[:-1])):
            raise ValueError("array 'ent_row' must be ordered inside each step")
        eg = gather[estep]
        if np.any(ent_col[eg] >= n) or np.any(ent_col[~eg] >= st_nc[estep[~eg]]):
            raise ValueError("array 'ent_col' names an X row (gather steps) or staged column (st_nc) out of range")
        # split panels: scratch slots and groups
        grp_n = _index(arrays, "grp_n", 1, B + 1)
        G = grp_n.size
        blk_slot = _index(arrays, "blk_slot", -1, B, B, "the blocks of 'blk_s0'")
        split = blk_slot >= 0
        nslots = int(split.sum())
        grp_first = _index(arrays, "grp_first", 0, nslots + 1, G, "the groups of 'grp_n'")
        blk_grp = _index(arrays, "blk_grp", 0, max(G, 1), B, "the blocks of 'blk_s0'")
        sl, sg = blk_slot[split], blk_grp[split]
        if nslots and (sl.max() >= nslots or np.any(np.bincount(sl, minlength=nslots) != 1)):
            raise ValueError(f"array 'blk_slot' must give the split blocks the scratch slots 0 .. {nslots - 1}, each once")
        if nslots and sg.max() >= G or np.any(grp_first + grp_n > nslots):
            raise ValueError("arrays 'blk_grp' / 'grp_first' / 'grp_n' name a group or slot that does not exist")
        if np.any(sl < grp_first[sg]) or np.any(sl >= grp_first[sg] + grp_n[sg]) or not np.array_equal(
                np.bincount(sg, minlength=G), grp_n):
            raise ValueError("arrays 'blk_grp' / 'grp_first' / 'grp_n' must hold exactly the slots of each group's blocks")
        rep = np.zeros((2, G), np.int64)
        rep[0, sg], rep[1, sg] = blk_row0[split], blk_nrows[split]
        if np.any(rep[0, sg] != blk_row0[split]) or np.any(rep[1, sg] != blk_nrows[split]):
            raise ValueError("array 'blk_grp': the blocks of a group must own the same rows")
        whole = ~split
        first = np.zeros(G, bool)
        if G:
            first[sg] = True
        r0 = np.concatenate([blk_row0[whole], rep[0][first]])
        if np.any(_cover(r0, r0 + np.concatenate([blk_nrows[whole], rep[1][first]]), m) != 1):
            raise ValueError("arrays 'blk_row0' / 'blk_nrows' must give every output row to exactly one block or group")
        meta_int(meta, "blocks", B)
        meta_int(meta, "steps", S)
        meta_int(meta, "split_panels", G)
        rows = row_ids[blk_row0[eblk] + ent_row]
        cols = np.where(eg, ent_col, dx[np.where(eg, 0, st_x0[estep] + ent_col)] if dx.size else 0)
        return rows, cols, ent_val

    def kernel_class_for(self, meta):
        return AsptPanelKernel if meta.get("scheme") == "panel" else AsptKernel

    @staticmethod
    def instance_name(R, VEC, CF, scheme: str = "tasks") -> str:
        if scheme == "panel":
            return f"aspt_panel_r{R}_v{VEC}_b{CF}"
        return f"aspt_spmm_r{R}_v{VEC}_cf{CF}"

    def instance(self, vec: int, cf: int, rows_per_warp: int = 1, reduce: str = "sum", scheme: str = "tasks",
                 nbuf: int = 2) -> tuple[str, tuple]:
        """One instance: scheme "tasks" defines ``<name>_rows`` and ``<name>_tiles`` (column slices
        ``cf``), scheme "panel" ``<name>_panels`` with ``nbuf`` chunk buffers.  ``rows_per_warp``
        is a launch argument (kept in the signature for callers that pass it)."""
        R = _REDUCE[reduce]
        S, A = (1, int(nbuf)) if scheme == "panel" else (0, int(cf))
        return self.instance_name(R, vec, A, scheme), (S, R, vec, A)
