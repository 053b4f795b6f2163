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

from ...passes.recipes import ASPT_PANEL_HEIGHT
from ...runtime import cuda as rt
from ..base import register_template, unique_params
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
