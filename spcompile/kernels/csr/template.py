"""The csr family of CUDA C++ templates: ``csr.crc_cwm`` (GE-SpMM SpMM) and ``csr.sddmm``, on
the :class:`~spcompile.kernels.nvcc.NvccTemplate` base; arrays from ``packer.py``, numpy
emulation of both kernels in ``emulate.py``.

Each CUDA template has ONE parametrised source (``*.cu`` beside this file).  Parameters that shape
registers and unrolled loops are C++ template arguments; for a parameter set we render the source
plus one ``extern "C"`` wrapper instantiating it (``SPC_*_INSTANCE``), compile with nvcc (cached on
disk, see :mod:`spcompile.runtime.cuda`) and keep the binary in the kernel's ``files`` so saved
artifacts carry it.  Parameters that do not need to be compile-time (K, warps per block, rows per
warp, the row partition) are launch arguments, so one binary serves every K and block shape.

Load balance: rows longer than ``max_seg`` nonzeros are cut into balanced slices processed by
different row groups and combined in the same launch (see ``spmm_crc_cwm.cu``); with
``max_seg=0`` every row is one segment (the paper's plain mapping).
"""
from __future__ import annotations

import re

from ...core.numerics import DTYPES
import numpy as np

from ..base import (check_entries, float_array, index_array, meta_int, pointer_array, register_template,
                    typed_array, unique_params)
from ..nvcc import AtLeast, LaunchSpec, NvccKernel, NvccTemplate
from .packer import WARP_ROW, WARP_SLICES, ell_split, pack_ell, pack_sddmm, pack_spmm, sddmm_partition, spmm_partition  # noqa: F401 (public here too)

_REDUCE = {"sum": 0, "max": 1, "min": 2, "mean": 3}
#: the element types of X / Y / output the kernels compile for (template argument TN = DTYPES code);
#: the matrix values stay fp32 and all arithmetic is fp32 (one rounding of the output)
_SHORT = {d.code: d.short for d in DTYPES.values()}


def _vec_choices(dtype: str) -> list[int]:
    """Vector widths (elements) up to 16 bytes per load for ``dtype``."""
    return [1, 2, 4, 8] if DTYPES[dtype].bytes == 2 else [1, 2, 4]


def _largest_vec(K: int, vec: int) -> int:
    v = int(vec)
    while v > 1 and K % v:
        v //= 2
    return max(v, 1)


#: csr.crc_cwm's deepest ``unroll``: 16 X rows in flight a lane, read from chunks of
#: ``chunk_entries`` column ids (two a lane in an 8-lane group); its split-row combine is always
#: capped at 16 values a lane (``combine_vals`` has no effect on it)
DEEP_UNROLL = 16
#: ``unroll`` of the staged kernels (``flat`` 2 or 3) only: chunks of 32 nonzeros staged in
#: shared memory
STAGED_UNROLL = 32


def flat_layout(flat) -> bool:
    """``flat`` 1 / 2: row groups stream runs of consecutive segments (``grp_seg``); 0 / 3: each
    takes ``rows_per_warp`` segments one after another."""
    return int(flat) in (1, 2)


def ell(flat) -> bool:
    """``flat`` 4: ELL rows (every row of at most ``unroll`` nonzeros, its column ids padded to
    ``unroll`` a row, read without a row pointer before them)."""
    return int(flat) == 4


def staged(flat) -> bool:
    """``flat`` 2 / 3: a chunk's X slices are copied to shared memory with ``cp.async`` (all in
    flight, no registers held) and accumulated from there; 0 / 1: ``unroll`` X rows in registers."""
    return int(flat) in (2, 3)


#: ``unroll`` values of csr.crc_cwm's search space, ``DEEP_UNROLL`` included (quick selection
#: measures it for every dtype: :meth:`CrcCwm.deep_unroll`)
UNROLL_SPACE = (1, 2, 4, 8, DEEP_UNROLL)


def _ell_widths(dtype: str) -> list[int]:
    """Widths of ELL rows quick selection offers: the ``unroll`` choices, ``DEEP_UNROLL`` for
    16-bit X / Y only (the widths measured, section 32 of
    ``docs/benchmarks/h100_crc_cwm_experiments.md``)."""
    return [u for u in UNROLL_SPACE if u != DEEP_UNROLL or DTYPES[dtype].bytes == 2]


def chunk_entries(group: int, unroll: int, flat: int = 0) -> int:
    """Nonzeros of one chunk of ``spmm_crc_cwm.cu``'s coalesced row cache (its ``chunk_of``):
    ``group`` for ``unroll`` <= 8, else the larger of the two; staged (``flat`` 2 / 3): ``unroll``,
    at least 4."""
    if staged(flat):
        return max(4, int(unroll))
    return max(int(group), int(unroll)) if int(unroll) > 8 else int(group)


# ------------------------------------------------------------------------------------------
# csr.crc_cwm — GE-SpMM
# ------------------------------------------------------------------------------------------
class CrcCwmKernel(NvccKernel):
    """Launch of ``spmm_crc_cwm.cu``: row groups of G lanes over segments, blockIdx.y over column
    tiles; split rows combine through the ``part`` / ``counters`` workspaces."""

    inputs, output = ("X",), "Y"

    def _tiles(self, vec: int) -> int:
        p = self.params
        return -(-int(self.meta["K"]) // (int(p["group"]) * vec * int(p["cf"])))

    def workspaces(self):
        K, a = int(self.meta["K"]), self.arrays
        return {"part": (a["slot_grp"].size * K, "float32"),
                "counters": (a["grp_len"].size * self._tiles(1), "int32")}   # VEC = 1 has the most tiles

    def launch_spec(self, vec):
        p = self.params
        nseg = int(self.arrays["seg_out"].size)
        threads, rpw = 32 * int(p["warps_per_block"]), int(p["rows_per_warp"])
        groups = threads // int(p["group"])
        # flat layout: the row groups of grp_seg; else rows_per_warp segments per group
        ngroups = int(self.arrays["grp_seg"].size) - 1 if self.arrays["grp_seg"].size else -(-nseg // rpw)
        # shared memory: a chunk of column ids and values per row group (chunk_entries); 32-lane
        # groups that combine a block's slices reduce their accumulators through it as well
        chunk = 0 if ell(p.get("flat", 0)) else chunk_entries(int(p["group"]), int(p["unroll"]), int(p.get("flat", 0)))
        smem = groups * chunk * 8 + groups * CrcCwm.stage_bytes(p, vec, self.meta.get("dtype", "float32"))
        if int(p["group"]) == 32 and CrcCwm.warp_slices(p) > 1:
            smem = max(smem, CrcCwm.block_combine_smem(int(p["warps_per_block"]), int(p["cf"]), vec))
        return LaunchSpec(grid=(-(-ngroups // groups), self._tiles(vec), 1), block=(threads, 1, 1),
                          smem=smem, args={"nseg": nseg, "ngroups": ngroups, "K": int(self.meta["K"]),
                                                  "segs_per_group": rpw})

    def empty(self):
        return self.arrays["seg_out"].size == 0


@register_template
class CrcCwm(NvccTemplate):
    """GE-SpMM (SC'20) CSR SpMM with sum/max/min/mean: coalesced row caching in shared memory,
    coarse-grained warp merging (CF), vector loads, sub-warp row groups for narrow K, split long
    rows for load balance, and ``unroll`` nonzeros' X loads in flight before accumulating;
    ``flat=1``: each row group streams consecutive segments as one run of nonzeros (X loads in
    flight across row ends): ``rows_per_warp`` of them (for short, even rows), or with
    ``flat_nnz`` > 0 runs of about ``flat_nnz`` nonzeros (many short rows or one slice of a long
    one, cut by ``max_seg``: an nnz-balanced schedule for graphs of short rows and hubs);
    ``flat=2``: the flat layout, staged (a chunk of ``unroll`` nonzeros' X slices copied to shared
    memory with cp.async, all in flight without registers, then accumulated); ``flat=3``: segments
    one after another (as ``flat=0``), staged; ``flat=4``: ELL rows (a matrix whose rows hold at
    most ``unroll`` nonzeros: each row's column ids padded to ``unroll``, read at a fixed place
    with no row pointer before them, the values in CSR order; ``rows_per_warp`` rows a row group,
    the next row's ids loading while this row's X rows do);
    ``warp_combine=1``: a row of at least a combine unit's worth of slices (the 32 / ``group``
    one-segment row groups of a warp, or for 32-lane groups the block's warps) has its slices
    reduced across the unit (shuffles; shared memory for a block) before one partial a unit
    goes to the split-row combine (hub rows combine from fewer partials), or is written by the
    unit when it holds all of it; ``warp_combine=2``: also rows of fewer slices, each cut into a
    unit's slices and written by it.  Any K >= 1.  X / Y in
    float32, float16 or bfloat16 (fp32 accumulation, one rounding of Y)."""

    name = "csr.crc_cwm"
    version = "2"
    dtypes = ("float32", "float16", "bfloat16")   # X / Y; fp32 accumulation
    priority = 30
    ops = tuple(("spmm", r) for r in ("sum", "max", "min", "mean"))
    source_file = "spmm_crc_cwm.cu"
    instance_macro = "SPC_SPMM_INSTANCE"
    kernel_class = CrcCwmKernel
    fallback_param = "vec"
    absent_params = {"flat": 0, "min_blocks": 1, "flat_nnz": 0, "combine_vals": 0, "warp_combine": 0}

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"cf": C([1, 2, 4, 8]), "vec": C(_vec_choices(mod.op.dtype)), "group": C([4, 8, 16, 32]),
                "warps_per_block": C([2, 4, 8]), "rows_per_warp": C([1, 2, 4, 8]),
                "max_seg": C(list(self.MAX_SEG_SPACE)), "unroll": C(list(UNROLL_SPACE)),
                "flat": C([0, 1, 2, 3, 4]),
                "min_blocks": C(list(self.MIN_BLOCKS)), "flat_nnz": C(list(self.FLAT_NNZ)),
                "combine_vals": C(list(self.COMBINE_VALS)), "warp_combine": C([0, 1, 2])}

    @staticmethod
    def heuristic(K: int, max_row: int, mean_row: float, dtype: str = "float32") -> dict:
        vec = _largest_vec(K, 16 // DTYPES[dtype].bytes)
        lanes = -(-K // vec)
        group = next(g for g in (4, 8, 16, 32) if g >= min(lanes, 32))
        cf = min(8, max(1, -(-K // (group * vec))))
        cf = 1 << (cf - 1).bit_length() if cf > 1 else 1
        cf = min(cf, 4)
        max_seg = 0 if max_row <= max(256, 4 * mean_row) else 256
        return {"cf": cf, "vec": vec, "group": group, "warps_per_block": 4, "rows_per_warp": 1,
                "max_seg": max_seg, "unroll": 2 if cf <= 2 else 1}

    def default_params(self, mod):
        lens = mod.A.row_lengths
        return self.heuristic(mod.op.K, int(lens.max()) if lens.size else 0,
                              float(lens.mean()) if lens.size else 0.0, mod.op.dtype)

    def seed_params(self, mod):
        d = self.default_params(mod)
        K = mod.op.K
        seeds = [d]
        for ms in (0, 32, 64, 256, 1024):
            seeds.append({**d, "max_seg": ms})
        # few rows with long-ish rows (small dense-ish graphs): short slices give parallelism
        vmax = 16 // DTYPES[mod.op.dtype].bytes
        vec4 = _largest_vec(K, vmax)
        cf4 = min(4, max(1, -(-K // (32 * vec4))))
        cf4 = 1 << (cf4 - 1).bit_length() if cf4 > 1 else 1
        for ms in (32, 64):
            seeds.append({**d, "group": 32, "vec": vec4, "cf": cf4, "max_seg": ms})
        vec = vec4
        for cf in (1, 2, 4, 8):
            if 32 * vec * cf <= max(32 * vec, 2 * K):
                seeds.append({**d, "group": 32, "vec": vec, "cf": cf, "unroll": 2 if cf <= 2 else 1})
        seeds.append({**d, "vec": 1, "group": 32, "cf": min(4, max(1, -(-K // 32)))})
        seeds.append({**d, "warps_per_block": 8, "rows_per_warp": 2})
        # tall row windows (32 consecutive rows per block): behind RCM, mesh-like and batched
        # graphs share X rows inside the window (measured: tu_nci1 / tu_dd 9-12% faster than 16)
        seeds.append({**d, "warps_per_block": 8, "rows_per_warp": 4})
        seeds.append({**d, "warps_per_block": 2})
        lens = mod.A.row_lengths
        if lens.size and self.short_rows(int(lens.max()), float(lens.mean())):
            # flat streams of consecutive short rows (measured: tu_nci1 17% faster than the tuned
            # one-row-at-a-time module behind RCM; slower wherever rows are long or split)
            for rpw in (4, 8):
                seeds.append({**d, "flat": 1, "rows_per_warp": rpw, "warps_per_block": 4, "unroll": 2})
        elif lens.size and float(lens.mean()) <= self.OCC_MAX_MEAN:
            # sparse rows around hub rows: flat groups of about 32 nonzeros, many short rows or one
            # slice of a hub (measured at K=128: snap_sx_askubuntu 3% faster than its tuned module,
            # slower on graphs without hubs and at any min_blocks above 1, where it spills)
            seeds.append({**d, "flat": 1, "flat_nnz": 32, "max_seg": 64, "unroll": 1, "warps_per_block": 4})
        width = self.ell_width(lens, mod.op.dtype)
        if width is not None:
            # ELL rows where every row fits a few nonzeros (meshes, batches of molecules)
            seeds.append({**d, "flat": 4, "unroll": width, "max_seg": 0, "rows_per_warp": self.ELL_ROWS,
                          "min_blocks": self.ell_min_blocks(width, d["cf"])})
        seeds.append({**d, "unroll": 1})
        seeds.append({**d, "unroll": 4 if d["cf"] <= 2 else 2})
        # more warps in flight (registers capped by the launch bounds), measured on the H100 at
        # K=128: one X load per lane at full occupancy 7-17% faster on graphs of sparse rows
        # (dimacs10_wing, rgg, gemsec_deezer_hu, askubuntu, tu_dd), 4 loads at 64 registers up to
        # 6% on social graphs; both slower elsewhere.  One column slice per lane (cf=1): at K=256
        # cf=2 spills at 32 registers (2-4x slower), cf=1 over two column tiles up to 12% faster
        seeds.append({**d, "cf": 1, "min_blocks": 8, "unroll": 1})
        seeds.append({**d, "min_blocks": 4, "unroll": 4})
        if mod.A.nnz <= 200_000:
            # small graphs are latency-bound: shorter slices of long rows and finer column tiles
            # (more row groups / blocks in flight), more X loads in flight per lane
            for ms in (8, 16, 32):
                seeds.append({**d, "group": 32, "vec": vec4, "cf": cf4, "max_seg": ms,
                              "unroll": max(1, min(8, 8 // cf4))})
            for g in (8, 16):
                if g * vec4 < K:
                    for ms in (16, 32):
                        seeds.append({**d, "group": g, "vec": vec4, "cf": 1, "max_seg": ms, "unroll": 8})
        return unique_params(seeds)

    #: ``min_blocks``: resident 256-thread blocks per SM the registers must allow (launch bounds):
    #: 1 leaves the registers to the compiler (48-70 per thread at unroll 2-4: 43-62% of the warp
    #: slots); 4 / 6 / 8 cap them at 64 / 40 / 32 for more warps, hence more gathers, in flight
    MIN_BLOCKS = (1, 4, 6, 8)
    #: rows at most this long on average make ``min_blocks=8`` a candidate of quick selection
    OCC_MAX_MEAN = 12.0

    #: ``flat_nnz``: nonzeros (plus one per segment) of a flat row group; 0: ``rows_per_warp``
    #: segments per group
    FLAT_NNZ = (0, 32, 64, 128)

    #: rows at most this long (and ``FLAT_MAX_MEAN`` on average) make the flat layout a candidate
    FLAT_MAX_ROW, FLAT_MAX_MEAN = 32, 8.0

    @classmethod
    def short_rows(cls, max_row: int, mean_row: float) -> bool:
        """Rows short and even enough for ``flat=1`` (consecutive rows streamed by one row group)
        to be worth measuring: a long row would be one group's serial work."""
        return max_row <= cls.FLAT_MAX_ROW and mean_row <= cls.FLAT_MAX_MEAN

    #: the staged stream (``flat=2``) as quick selection measures it: nnz-balanced groups of about
    #: 32 nonzeros, chunks of 8 staged in shared memory, two warps a block under launch bounds of
    #: 4 blocks (of the 24 staged shapes swept on the H200, the best geomean over four sparse-row
    #: graphs at K=128 and within 2% of the best over five at K=64: section 17 of
    #: ``docs/benchmarks/h100_crc_cwm_experiments.md``)
    STAGED = {"flat": 2, "flat_nnz": 32, "unroll": 8, "min_blocks": 4, "warps_per_block": 2, "rows_per_warp": 1}
    #: rows at most this long on average, or this share of rows of at most 2 nonzeros, make the
    #: staged stream a candidate
    STAGED_MAX_MEAN, STAGED_TINY_SHARE = 4.0, 0.5
    #: staged segments (``flat=3``) as quick selection measures them for 16-bit X / Y: the first
    #: choice's one-row groups with each chunk of 8 nonzeros' X slices staged, launch bounds of 4
    #: blocks, hub rows' slices reduced across the warp (of the 6 shapes swept on the H200 at
    #: K=64, all with that combine, the best on the 4 of 14 graphs where any won, by
    #: 1.09-1.14x; quick selection's measurement without the combine, on first choices that had
    #: none, was 1.16x / 1.26x slower on snap_sx_askubuntu / snap_email_enron; no shape won in
    #: fp32: section 18 of ``docs/benchmarks/h100_crc_cwm_experiments.md``)
    SEG_STAGED = {"flat": 3, "unroll": 8, "min_blocks": 4, "warp_combine": 1}

    #: ELL rows (``flat=4``) as quick selection measures them: rows of at most ``ELL_MAX_ROW``
    #: nonzeros, padded to the next ELL width (``_ell_widths``), at most ``ELL_MAX_PAD`` times the
    #: nonzeros
    ELL_MAX_ROW, ELL_MAX_PAD = 16, 2.0

    @classmethod
    def ell_width(cls, lens: np.ndarray, dtype: str = "float32") -> int | None:
        """The ``unroll`` of ELL rows for a matrix of row lengths ``lens``: the smallest ELL width
        of ``dtype`` (``_ell_widths``) that holds its longest row, where that is at most
        ``ELL_MAX_ROW`` and the padded ids are at most ``ELL_MAX_PAD`` times its nonzeros; else
        None."""
        if not lens.size:
            return None
        longest = int(lens.max())
        fit = [u for u in _ell_widths(dtype) if u >= longest and u <= cls.ELL_MAX_ROW]
        if not fit or lens.size * fit[0] > cls.ELL_MAX_PAD * max(int(lens.sum()), 1):
            return None
        return fit[0]

    @classmethod
    def tiny_rows(cls, lens: np.ndarray) -> bool:
        """Most rows hold a few nonzeros (``STAGED_MAX_MEAN`` on average, or ``STAGED_TINY_SHARE``
        of them at most 2): a row group waits on a chain of loads for each, and the staged stream
        (``flat=2``) keeps a chunk of many rows' gathers in flight."""
        return bool(lens.size) and (float(lens.mean()) <= cls.STAGED_MAX_MEAN
                                    or float(np.mean(lens <= 2)) >= cls.STAGED_TINY_SHARE)

    def unranked_variants(self, params, op=None) -> list:
        """Variants of the model's first choice that the shipped portfolio never measured:

        - on matrices of short, even rows, ``flat=1`` (8 rows per group up to 4 nonzeros per row
          on average, else 4);
        - on sparse rows (mean at most ``OCC_MAX_MEAN``), one-row groups at full occupancy
          (``min_blocks=8``, one X load per lane in flight, one column slice per lane: at 32
          registers a second one spills): the gathers of such graphs miss L2 and wait on DRAM
          latency, and more warps hide more of it;
        - where most rows hold a few nonzeros (:meth:`tiny_rows`), the staged stream ``STAGED``
          with the first choice's column shape and ``max_seg`` (measured on the H200: 1.12x /
          1.21x faster on snap_sx_askubuntu / a generated batch of reply threads at K=64, slower
          on meshes and molecules, hence measured, not ruled);
        - for 16-bit X / Y, staged segments ``SEG_STAGED`` next to a one-row first choice: a
          row's chunk of 8 gathers in flight without the registers that ``unroll`` 8 or 16 holds
          (H200, K=64: 1.09-1.14x faster on snap_email_enron, gemsec_fb_new_sites,
          gemsec_deezer_hu and snap_sx_askubuntu, 0.78-1.0x on the other 10 graphs, hence
          measured, not ruled), and on matrices of tiny rows also with narrower row groups
          (:meth:`narrow_groups`);
        - where every row fits a few nonzeros, ELL rows (:meth:`ell_variants`)."""
        p = {**self.absent_params, **params}
        if op is None or staged(p["flat"]):
            return []
        lens = op.A.row_lengths
        if not lens.size:
            return []
        stream = []
        tiny = self.tiny_rows(lens)
        if tiny:
            keep = {k: v for k, v in dict(params).items() if k not in ("warp_combine", "combine_vals")}
            stream = [{**keep, **self.STAGED}]
        stream += self.ell_variants(params, op)
        if int(p["flat"]) or int(p["min_blocks"]) > 1:
            return stream
        out = []
        mean = float(lens.mean())
        if self.short_rows(int(lens.max()), mean):
            out.append({**dict(params), "flat": 1, "rows_per_warp": 8 if mean <= 4 else 4, "warps_per_block": 4})
        if mean <= self.OCC_MAX_MEAN:
            out.append({**dict(params), "cf": 1, "min_blocks": 8, "unroll": 1})
        if DTYPES[op.dtype].bytes == 2:
            seg = {**{k: v for k, v in dict(params).items() if k != "combine_vals"}, **self.SEG_STAGED}
            out.append(seg)
            narrow = self.narrow_groups(seg) if tiny else None
            if narrow is not None:
                out.append(narrow)
        return out + stream

    #: rows a row group of ELL rows takes, the next one's ids loading while this one's X rows do
    ELL_ROWS = 4

    def ell_variants(self, params, op=None) -> list:
        """Where every row fits ELL rows (:meth:`ell_width`): ``params``' column shape with
        ``flat=4`` (all of a row's X loads in flight, ``ELL_ROWS`` rows a row group), and for one
        slice a lane in groups of at least 8 lanes the twin of half the lanes and two slices a
        lane, each under the launch bounds of :meth:`ell_min_blocks`.  On the H200, ``build()``
        with them ran 1.13-1.37x faster in fp32 on a mesh and a batch of molecules (dimacs10_wing,
        tu_nci1; K = 64 / 128 / 256) and 1.03-1.21x at 16 bits, where a shape of one row a group
        had lost to staged segments on the molecules: measured, not ruled (section 32 of
        ``docs/benchmarks/h100_crc_cwm_experiments.md``)."""
        p = {**self.absent_params, **params}
        if op is None or ell(p["flat"]):
            return []
        width = self.ell_width(op.A.row_lengths, op.dtype)
        if width is None:
            return []
        keep = {k: v for k, v in dict(params).items() if k not in ("warp_combine", "combine_vals", "flat_nnz")}
        shapes = [{**keep, "flat": 4, "unroll": width, "max_seg": 0, "rows_per_warp": self.ELL_ROWS}]
        narrow = self.narrow_groups(shapes[0])
        if narrow is not None:
            shapes.append({**narrow, "unroll": width})
        return [{**v, "min_blocks": self.ell_min_blocks(width, int(v["cf"]))} for v in shapes]

    @staticmethod
    def ell_min_blocks(width: int, cf: int) -> int:
        """Launch bounds of ELL rows with ``width`` x ``cf`` X loads a lane: 64 registers
        (``min_blocks`` 4) for up to 8 loads, else the compiler's choice (1).  On the H200, 40
        registers (6) ran the one-slice shapes at 0.89-1.38x the time of 64, never the best shape of
        a graph and K; at 32 (8) they spill."""
        return 4 if int(width) * int(cf) <= 8 else 1

    @staticmethod
    def narrow_groups(params) -> dict | None:
        """``params`` with half as many lanes a row group and twice the column slices a lane
        (``unroll`` 4), for one slice a lane (the case measured) and groups of at least 8 lanes;
        else None (:meth:`ell_variants` takes the same twin of ELL rows' column shape).
        Quick selection measures it beside staged segments (``SEG_STAGED``) on matrices of tiny
        rows, where twice the rows a warp are in flight: on the H200 at 16-bit, 1.10x / 1.32x faster
        on snap_sx_askubuntu at K = 64 / 128 (27.0 / 43.1 against 29.8 / 56.9 us), but 1.5x slower
        at K=64 on the hub graphs of longer rows whose staged segments won, and 2.8-6.5x slower
        from one-row groups of 8 launch-bounded blocks, whose registers two slices spill (section
        23 of ``docs/benchmarks/h100_crc_cwm_experiments.md``)."""
        g = int(params["group"])
        if g < 8 or int(params["cf"]) != 1:
            return None
        return {**dict(params), "group": g // 2, "cf": 2, "unroll": 4}

    #: rows at most this long on average make RCM a locality order quick selection measures
    RCM_MAX_MEAN = 12.0

    def locality_orders(self, op=None) -> list:
        """RCM, on matrices of sparse rows (mean at most ``RCM_MAX_MEAN``, as for ``csr.sddmm``):
        the model's first choice and its unranked variants are measured on it too.  Tuned modules
        of mesh-like graphs keep RCM where ``build()``'s stored or degree order does not reach it
        (H100, fp32 K=128: dimacs10_wing tuned 32.5 us behind RCM against ``build()``'s 40.8)."""
        return _rcm_on_sparse_rows(op, self.RCM_MAX_MEAN)

    #: ``max_seg`` values of the tuner's space (0: whole rows).  Every value quick selection
    #: measures is one of them, so that ``build()``'s pick can be a study's first trial
    #: (``Tuner(start_from=...)`` enqueues only configs inside the space)
    MAX_SEG_SPACE = (0, 8, 16, 32, 64, 128, 256, 1024, 4096)

    #: ``combine_vals``: 0, or the most fp32 partial values a lane loads at a time in the split-row
    #: combine (fewer registers for the whole kernel, a longer chain of loads in the combine)
    COMBINE_VALS = (0, 16)
    #: the knowledge portfolio's block shapes (warps per block, rows per warp, X loads in flight)
    SHAPES = ("u2", "u8", "w8r2")
    #: ``max_seg`` from the shortest slices to whole rows: quick selection's second round measures
    #: the neighbours of the fastest candidate's value in this order
    PROBE_MAX_SEG = (16, 32, 64, 256, 0)

    @classmethod
    def probe_max_segs(cls, max_seg: int) -> list[int]:
        """The ``max_seg`` values one step shorter and longer than ``max_seg`` in
        ``PROBE_MAX_SEG`` (none for a value outside it)."""
        if max_seg not in cls.PROBE_MAX_SEG:
            return []
        i = cls.PROBE_MAX_SEG.index(max_seg)
        return [cls.PROBE_MAX_SEG[j] for j in (i - 1, i + 1) if 0 <= j < len(cls.PROBE_MAX_SEG)]

    @staticmethod
    def shape_params(shape: str, cf: int) -> dict:
        """The block shape ``shape`` (one of ``SHAPES``) for ``cf`` column slices per lane: u2 = 4
        warps of one row each, 2 X loads in flight (1 from cf 4); u8 = the same with 8 (4 at cf 2,
        2 beyond); w8r2 = 8 warps of two rows each, as u2."""
        if shape == "u2":
            return {"warps_per_block": 4, "rows_per_warp": 1, "unroll": 2 if cf <= 2 else 1}
        if shape == "u8":
            return {"warps_per_block": 4, "rows_per_warp": 1, "unroll": {1: 8, 2: 4}.get(cf, 2)}
        if shape == "w8r2":
            return {"warps_per_block": 8, "rows_per_warp": 2, "unroll": 2 if cf <= 2 else 1}
        raise ValueError(f"unknown csr.crc_cwm shape {shape!r}; expected one of {CrcCwm.SHAPES}")

    def probe_variants(self, params, op=None) -> list:
        """Next to a one-row-at-a-time parameter set (``flat`` 0, ``min_blocks`` 1): ``max_seg``
        one step shorter and longer in ``PROBE_MAX_SEG`` (same shape), and the other block shapes
        of ``SHAPES`` (same ``max_seg``).  Leave-one-graph-out over the shipped measurements this
        second round lifts the fastest measured from 0.978 to 0.995 of the fastest portfolio member
        in fp32 SpMM at K=128 (rows below 0.9: 5 -> 1 of 58).  For 16-bit X / Y (``op``'s dtype)
        whose split-row combine would hold more than 16 values a lane (``unroll`` x ``vec``), the
        same parameters and those block shapes with ``combine_vals`` 16 as well
        (:meth:`capped_combine`)."""
        p = {**self.absent_params, **params}
        if int(p["flat"]) or int(p["min_blocks"]) > 1:
            return []
        out = [{**dict(params), "max_seg": ms} for ms in self.probe_max_segs(int(p["max_seg"]))]
        cf = int(p["cf"])
        for shape in self.SHAPES:
            out.append({**dict(params), **self.shape_params(shape, cf)})
        # the capped combine of the lead and of its block-shape neighbours (a u8 kernel may win
        # capped where it lost, uncapped, to the u2 lead of the first round)
        caps = [c for c in (self.capped_combine(v, op) for v in [dict(params)] + out[-len(self.SHAPES):])
                if c is not None]
        out += caps
        deep = self.deep_unroll(params, op)
        if deep is not None:
            out.append(deep)
        # warp-reduced hub rows on the lead and on its capped and deep variants
        for base in [dict(params)] + caps + ([deep] if deep is not None else []):
            out += self.warp_combined(base, op)
        return [v for v in unique_params(out) if v != dict(params)]

    def warp_combined(self, params, op=None) -> list:
        """Where ``params`` would cut a row of ``op`` into at least 32 / ``group`` slices (one per
        row group of a warp: :meth:`warp_slices` with ``warp_combine``): ``params`` with
        ``warp_combine`` 1, and that with the next longer ``max_seg`` of ``MAX_SEG_SPACE`` (twice
        as long up to 256; a warp-reduced hub has 32 / ``group`` times fewer partials to combine,
        so longer slices cost less there).
        :meth:`probe_variants` measures them on the lead and on its capped and deep variants
        (the 16-bit kernels of 8 rows in flight a lane take 151 registers uncapped).  On the H100,
        ``build()`` on the 17 graphs over 200k nonzeros kept one of them on 11 / 10 graphs at
        16-bit K = 64 / 128 and 10 in fp32 at K=64 (16-bit K=64: twitch_de 16.7 -> 13.1 us,
        wiki_squirrel 15.5 -> 12.5 us); as a rule it lost on others (fb100_mit8 at 16-bit K=64:
        15.1 -> 19.2 us with every split row warp-reduced), hence measured
        (``docs/benchmarks/h100_crc_cwm_experiments.md``)."""
        p = {**self.absent_params, **params}
        ms = int(p["max_seg"])
        W = self.warp_slices({**p, "warp_combine": 1})
        if op is None or int(p["warp_combine"]) or W == 1 or ms <= 0:
            return []
        lens = op.A.row_lengths
        if not lens.size or int(lens.max()) <= (W - 1) * ms:
            return []
        out = [{**dict(params), "warp_combine": 1}]
        longer = [v for v in self.MAX_SEG_SPACE if v > ms]
        if longer:
            out.append({**dict(params), "warp_combine": 1, "max_seg": longer[0]})
        return out

    def capped_combine(self, params, op=None) -> dict | None:
        """``params`` with ``combine_vals`` 16, where that changes the kernel of a 16-bit op: its
        split-row combine holds ``unroll`` x ``vec`` > 16 fp32 values a lane.  On the H100 the
        capped kernel takes 91 instead of 151 registers a thread (fp16, vec 8, unroll 8) and ran
        `build()` 1.06x faster over the 17 graphs over 200k nonzeros at K=64 (up to 1.42x), but up
        to 1.25x slower on small graphs whose longest row is combined from tens of slices: a
        choice to measure, not a rule (``docs/benchmarks/h100_crc_cwm_experiments.md``)."""
        p, cap = {**self.absent_params, **params}, self.COMBINE_VALS[-1]
        if op is None or DTYPES[op.dtype].bytes != 2 or int(p["combine_vals"]) or int(p["unroll"]) > 8:
            return None
        if int(p["unroll"]) * _largest_vec(op.K, int(p["vec"])) <= cap:
            return None
        return {**dict(params), "combine_vals": cap}

    #: fp32 slices of split rows with ``DEEP_UNROLL``: at least this many nonzeros (8 rounds of
    #: 16 gathers)
    DEEP_MAX_SEG_FP32 = 128

    def deep_unroll(self, params, op=None) -> dict | None:
        """For one column slice a lane (``cf`` 1) and row groups of at most 16 lanes (16-bit rows
        of at most 256 bytes, K <= 128; fp32 K <= 64): ``params`` in the u8 block shape with
        ``unroll`` ``DEEP_UNROLL`` (16 rows in flight a lane; ``combine_vals`` dropped, its combine
        is always capped), in fp32 with split rows cut into slices of at least
        ``DEEP_MAX_SEG_FP32`` nonzeros; unless that is ``params`` itself.
        16-bit: a gather-only kernel of these graphs' sizes ran 1.18x faster at K=64 with 32 rows
        in flight a lane than with 8; ``build()`` on the H100 kept this variant on 3 / 2 / 0 of the
        17 graphs over 200k nonzeros at K = 64 / 128 / 256 (up to 1.07x faster), hence no 32-lane
        groups.  fp32 K=64 on the H200, with 128-entry slices against ``build()``'s module: 1.11-1.22x
        faster on five hub graphs of long rows (wiki_squirrel, fb100_mit8, blogcatalog,
        amazon_computers, twitch_de), as fast or slower on the six other graphs of one-row groups
        swept, and slower with the leads' 32- or 64-entry slices on all but two: measured, not
        ruled (``docs/benchmarks/h100_crc_cwm_experiments.md``, sections 7 and 34)."""
        p = {k: v for k, v in dict(params).items() if k != "combine_vals"}
        if op is None or int(p.get("cf", 1)) != 1 or int(p.get("group", 32)) > 16:
            return None   # cf > 1: 16 x cf loads in flight, more registers than a thread has
        deep = {**p, **self.shape_params("u8", 1), "unroll": DEEP_UNROLL}
        ms = int(p.get("max_seg", 0))
        if DTYPES[op.dtype].bytes == 4 and 0 < ms < self.DEEP_MAX_SEG_FP32:
            deep["max_seg"] = self.DEEP_MAX_SEG_FP32
        return None if deep == dict(params) else deep

    def search_params(self, params):
        """``flat_nnz`` has no effect without ``flat`` (0 then), ``rows_per_warp`` none with
        ``flat_nnz`` > 0 (1 then), ``combine_vals`` none where ``unroll`` x ``vec`` partial
        values already fit it, ``unroll`` is ``DEEP_UNROLL`` or the kernel is staged (``flat`` 2 / 3:
        its combine loads two partials at a time; 0 then), ``warp_combine`` none where
        :meth:`warp_slices` is 1 (0 then), and ``max_seg`` and ``combine_vals`` none with ELL rows
        (``flat`` 4: whole rows, no combine; 0 then)."""
        p = dict(params)
        if not flat_layout(p.get("flat", 0)) and "flat_nnz" in p:
            p["flat_nnz"] = 0
        if flat_layout(p.get("flat", 0)) and int(p.get("flat_nnz", 0)) > 0 and "rows_per_warp" in p:
            p["rows_per_warp"] = 1
        if int(p.get("combine_vals", 0)) and (int(p.get("unroll", 4)) * int(p.get("vec", 1)) <= int(p["combine_vals"])
                                              or int(p.get("unroll", 4)) > 8 or staged(p.get("flat", 0))):
            p["combine_vals"] = 0
        if int(p.get("warp_combine", 0)) and self.warp_slices(p) == 1:
            p["warp_combine"] = 0
        if ell(p.get("flat", 0)):                    # whole rows, no split-row combine
            p.update({k: 0 for k in ("max_seg", "combine_vals") if k in p})
        return p

    def checks(self, mod):
        return {"cf": (1, 2, 4, 8), "vec": _vec_choices(mod.op.dtype), "group": (4, 8, 16, 32),
                "unroll": (1, 2, 4, 8, DEEP_UNROLL, STAGED_UNROLL), "warps_per_block": (1, 2, 4, 8),
                "rows_per_warp": AtLeast(1), "max_seg": AtLeast(0), "flat": (0, 1, 2, 3, 4), "min_blocks": self.MIN_BLOCKS,
                "flat_nnz": AtLeast(0), "combine_vals": self.COMBINE_VALS, "warp_combine": (0, 1, 2)}

    #: the most shared memory (bytes) the block-level combine of 32-lane groups may take: a float
    #: per lane, accumulator and warp (``warps_per_block`` x ``cf`` x ``vec`` x 128 bytes)
    BLOCK_COMBINE_SMEM = 20480

    @staticmethod
    def warp_slices(params) -> int:
        """Row groups of a combine unit that take slices of one row together and reduce them
        (``warp_combine``), for one-segment groups (``flat`` 0 / 3, ``rows_per_warp`` 1): the warp's
        32 / ``group`` groups (shuffles) for groups narrower than a warp; the block's
        ``warps_per_block`` warps (shared memory, at most ``BLOCK_COMBINE_SMEM`` bytes) for 32-lane
        groups; else 1 (``warp_combine`` has no effect).  ``warp_combine`` 1: rows of W slices or
        more (a multiple of W; one partial a unit, or the row itself when the unit holds all of
        it); 2: also rows of 2 .. W - 1 slices, cut into W and written by their unit (no partial,
        no combine)."""
        p = {**CrcCwm.absent_params, **params}
        g = int(p["group"])
        if not int(p["warp_combine"]) or flat_layout(p["flat"]) or ell(p["flat"]) or int(p["rows_per_warp"]) != 1:
            return 1
        if g < 32:
            return 32 // g
        w = int(p["warps_per_block"])
        if w < 2 or CrcCwm.block_combine_smem(w, int(p["cf"]), int(p["vec"])) > CrcCwm.BLOCK_COMBINE_SMEM:
            return 1
        return w

    #: the most shared memory (bytes) the X stage of a staged kernel (``flat`` 2 / 3) may take a block
    STAGE_SMEM = 96 * 1024

    @staticmethod
    def stage_bytes(params, vec: int, dtype: str) -> int:
        """Shared memory (bytes) of one row group's X stage (``flat`` 2 / 3; 0 otherwise): a chunk's
        (:func:`chunk_entries`) ``cf`` x ``group`` x ``vec`` elements of ``dtype`` per nonzero."""
        p = {**CrcCwm.absent_params, **params}
        if not staged(p["flat"]):
            return 0
        return (chunk_entries(int(p["group"]), int(p["unroll"]), p["flat"]) * int(p["cf"]) * int(p["group"]) * int(vec)
                * DTYPES[dtype].bytes)

    def validate(self, mod, params):
        """As every template's, and: ``unroll`` 32 only with a staged kernel (``flat`` 2 / 3: it sets
        the chunk of nonzeros staged; 32 rows in flight a lane do not fit in registers), its stage
        at most ``STAGE_SMEM`` bytes a block; ELL rows (``flat`` 4) only where no row holds more
        than ``unroll`` nonzeros."""
        super().validate(mod, params)
        p = {**self.absent_params, **params}
        if int(p.get("unroll", 1)) == STAGED_UNROLL and not staged(p["flat"]):
            raise ValueError(f"invalid {self.name} parameters: unroll={STAGED_UNROLL} needs flat=2 or 3 (a staged kernel)")
        if ell(p["flat"]):
            lens = mod.A.row_lengths
            longest = int(lens.max()) if lens.size else 0
            if longest > int(p["unroll"]):
                raise ValueError(f"invalid {self.name} parameters: flat=4 (ELL rows) holds rows of at most unroll="
                                 f"{int(p['unroll'])} nonzeros, and this matrix has a row of {longest}")
        vec = _largest_vec(mod.op.K, int(p["vec"]))
        stage = 32 * int(p["warps_per_block"]) // int(p["group"]) * self.stage_bytes(p, vec, mod.op.dtype)
        if stage > self.STAGE_SMEM:
            raise ValueError(f"invalid {self.name} parameters: flat={int(p['flat'])} stages {stage} bytes of X a block, more than "
                             f"{self.STAGE_SMEM} (fewer warps_per_block, a smaller cf or unroll)")

    @staticmethod
    def block_combine_smem(warps: int, cf: int, vec: int) -> int:
        """Shared memory (bytes) of the block-level combine (32-lane groups): ``warps`` x ``cf`` x
        ``vec`` x 32 floats and ``warps`` lengths (``spmm_crc_cwm.cu``'s ``red`` / ``red_len``)."""
        return 4 * warps * (cf * vec * 32 + 1)

    def pack(self, mod, params):
        p = {**self.absent_params, **params}
        if ell(p["flat"]):
            return pack_ell(mod, int(p["unroll"]))
        return pack_spmm(mod, int(p["max_seg"]), flat_layout(p["flat"]), int(p["rows_per_warp"]), int(p["flat_nnz"]),
                         self.warp_slices(p), int(p["warp_combine"]) == 2)

    def check_arrays(self, key, params, arrays, meta, values=None):
        """Every index the kernel follows stays in its array or in X / Y, and the entries rebuild
        the manifest's matrix: segments cover the nonzeros in order, whole-row segments name an
        output row, split ones a slot of a row group."""
        m, n, nnz = key.rows, key.cols, key.nnz
        meta_int(meta, "m", m)
        meta_int(meta, "K", key.K)
        _kernel_types(arrays, ("indices", "seg_ptr", "seg_out", "seg_slot", "grp_ptr", "slot_grp", "grp_out", "grp_len",
                               "grp_seg"))
        inst = meta.get("instances")
        if not (isinstance(inst, (list, tuple)) and inst and all(
                isinstance(i, (list, tuple)) and len(i) == 2 and isinstance(i[1], (list, tuple)) and len(i[1]) >= 7
                and isinstance(i[1][6], (int, np.integer)) and int(i[1][6]) in (0, 1, 2, 3, 4) for i in inst)):
            raise ValueError(f"kernel meta 'instances' must be SPC_SPMM_INSTANCE arguments, got {inst!r}")
        if len({int(i[1][6]) for i in inst}) != 1:
            raise ValueError("kernel meta 'instances' mix kernels of different flat values (segment layouts or staging)")
        width = int(inst[0][1][5]) if ell(inst[0][1][6]) else 0     # ELL rows (FL = 4): U ids a segment
        data = float_array(arrays, "data", nnz)
        seg_out = index_array(arrays, "seg_out", 0, max(m, 1))
        seg_ptr = pointer_array(arrays, "seg_ptr", nnz, seg_out.size + 1)
        if width:
            indices = self._check_ell(arrays, seg_ptr, width, n)
        else:
            indices = index_array(arrays, "indices", 0, max(n, 1), nnz)
        slot_grp = index_array(arrays, "slot_grp", 0, 2**31)
        grp_ptr = pointer_array(arrays, "grp_ptr", slot_grp.size)
        ngrp = grp_ptr.size - 1
        if slot_grp.size and int(slot_grp.max()) >= ngrp:
            raise ValueError(f"array 'slot_grp' holds values outside [0, {ngrp})")
        raw_slot = index_array(arrays, "seg_slot", WARP_ROW, WARP_SLICES + slot_grp.size, seg_out.size)
        if width and (np.any(raw_slot != -1) or ngrp):
            raise ValueError("ELL rows (flat=4) are whole rows: array 'seg_slot' must be all -1, with no row groups")
        warp = raw_slot >= WARP_SLICES                               # warp-reduced slices
        wrow = raw_slot == WARP_ROW                                  # slices of a row one warp holds
        seg_slot = np.where(warp, raw_slot - WARP_SLICES, raw_slot)
        if np.any(seg_slot >= slot_grp.size):
            raise ValueError(f"array 'seg_slot' holds values outside [-2, {slot_grp.size}) (flag bits aside)")
        grp_out = index_array(arrays, "grp_out", 0, max(m, 1), ngrp)
        grp_len = index_array(arrays, "grp_len", 0, nnz + 1, ngrp)
        split = seg_slot >= 0
        W = 1
        if warp.any() or wrow.any():
            # warp-reduced slices fill all W row groups of one combine unit (one segment each: the
            # kernel's full-warp shuffles, or for 32-lane groups its block barriers, must find
            # every lane there), with one slot or one row
            W = self.warp_slices(params)
            if W == 1 or flat_layout(inst[0][1][6]) or any(int(i[1][4]) != int(params["group"]) for i in inst):
                raise ValueError("array 'seg_slot' flags warp-reduced slices, which need warp_combine with "
                                 "one-segment row groups (flat 0 or 3, rows_per_warp 1): narrower than a warp, "
                                 "or 32-lane groups of a block of at least two warps")
            fill = -raw_slot.size % W
            pad = np.concatenate([raw_slot, np.full(fill, -1, np.int64)]).reshape(-1, W)
            outs = np.concatenate([seg_out, np.full(fill, -1, np.int64)]).reshape(-1, W)
            flagged = ((pad >= WARP_SLICES) | (pad == WARP_ROW)).any(axis=1)
            if not (np.all(pad[flagged] == pad[flagged][:, :1])
                    and np.all(outs[pad[:, 0] == WARP_ROW] == outs[pad[:, 0] == WARP_ROW][:, :1])):
                raise ValueError(f"array 'seg_slot': warp-reduced slices must be every one of a combine unit's "
                                 f"{W} segments (aligned), of one slot or one output row")
        # who writes each output row: a whole-row segment, a warp holding a row, a row group
        writers = np.concatenate([seg_out[seg_slot == -1], seg_out[np.flatnonzero(wrow)[::W]], grp_out])
        if writers.size != m or (m and not np.all(np.bincount(writers, minlength=m) == 1)):
            raise ValueError("every output row must be written by exactly one segment or row group")
        once = np.bincount(seg_slot[split & ~warp], minlength=slot_grp.size)
        in_warps = np.bincount(seg_slot[warp], minlength=slot_grp.size) // W
        if not np.all(once + in_warps == 1):
            raise ValueError("array 'seg_slot' must name every partial-result slot exactly once")
        row = np.where(split, grp_out[slot_grp[np.maximum(seg_slot, 0)]] if ngrp else 0, seg_out)
        lens = np.diff(seg_ptr)
        if ngrp and not np.array_equal(np.bincount(slot_grp[seg_slot[split]], weights=lens[split],
                                                   minlength=ngrp).astype(np.int64), grp_len):
            raise ValueError("array 'grp_len' does not match the nonzeros of its split rows")
        # the flat layout's row groups (FL = 1 / 2 instances follow grp_seg): non-empty runs covering
        # every segment; the one-segment-after-another layout (FL = 0 / 3) has none
        if flat_layout(inst[0][1][6]):
            grp_seg = pointer_array(arrays, "grp_seg", seg_out.size)
            if np.any(np.diff(grp_seg) <= 0):
                raise ValueError("array 'grp_seg' must rise strictly (every flat row group holds a segment)")
        else:
            index_array(arrays, "grp_seg", 0, 1, 0)
        check_entries(np.repeat(row, lens), indices, data, m, n, key.pattern, values)

    @staticmethod
    def _check_ell(arrays, seg_ptr: np.ndarray, width: int, n: int) -> np.ndarray:
        """ELL rows' ``indices`` (``width`` a segment: the segment's column ids, then -1; every
        segment at most ``width`` long, as the kernel reads no more); returns them in CSR order."""
        nseg = seg_ptr.size - 1
        ids = index_array(arrays, "indices", -1, max(n, 1), nseg * width)
        own, pad = ell_split(ids, np.diff(seg_ptr), width)
        if np.any(own < 0) or np.any(pad != -1):
            raise ValueError("array 'indices' (ELL rows) must hold each segment's column ids, then -1")
        return own

    def instance_args(self, mod, params):
        p = {**self.absent_params, **params}
        return {"reduce": mod.op.reduce, "cf": int(p["cf"]), "vec": _largest_vec(mod.op.K, int(p["vec"])),
                "group": int(p["group"]), "unroll": int(p["unroll"]), "dtype": mod.op.dtype,
                "flat": int(p["flat"]), "min_blocks": int(p["min_blocks"]), "combine_vals": int(p["combine_vals"])}

    @staticmethod
    def instance_name(TN, R, CF, VEC, G, U, FL=0, MB=1, CQ=0) -> str:
        return (f"spmm_crc_cwm_{_SHORT[TN]}_r{R}_cf{CF}_v{VEC}_g{G}_u{U}" + {0: "", 1: "_flat", 2: "_staged", 3: "_seg_staged", 4: "_ell"}[int(FL)]
                + (f"_mb{MB}" if MB > 1 else "") + (f"_cq{CQ}" if CQ else ""))

    def instance(self, reduce: str, cf: int, vec: int, group: int, unroll: int = 4, dtype: str = "float32",
                 flat: int = 0, min_blocks: int = 1, combine_vals: int = 0):
        R, TN, MB, CQ = _REDUCE[reduce], DTYPES[dtype].code, int(min_blocks), int(combine_vals)
        args = (TN, R, cf, vec, group, unroll, int(flat)) + ((MB,) if MB > 1 else ()) + ((CQ,) if CQ else ())
        return self.instance_name(TN, R, cf, vec, group, unroll, flat, MB, CQ), args

    def instance_macro_of(self, name: str) -> str:
        """``SPC_SPMM_INSTANCE_MB`` (launch bounds with a minimum of resident blocks) for the
        instances of ``min_blocks`` > 1 (name suffix ``_mb<N>``), ``..._CQ`` for those of
        ``combine_vals`` > 0 (suffix ``_cq<N>``, last), else ``SPC_SPMM_INSTANCE``."""
        mb, cq = re.search(r"_mb\d+(_cq\d+)?$", name), re.search(r"_cq\d+$", name)
        return self.instance_macro + ("_MB" if mb else "") + ("_CQ" if cq else "")


# ------------------------------------------------------------------------------------------
# csr.sddmm
# ------------------------------------------------------------------------------------------
class SddmmKernel(NvccKernel):
    """Launch of ``sddmm_csr.cu``: a warp per segment (one row's run of nonzeros, or with
    ``flat`` a run of stored entries across rows); only X and Y are read with vector loads."""

    inputs, output = ("X", "Y"), "out"
    aligned = ("X", "Y")

    def _nseg(self) -> int:
        return int(self.arrays["seg_ptr"].size) - 1

    def launch_spec(self, vec):
        nseg, wpb = self._nseg(), int(self.params["warps_per_block"])
        return LaunchSpec(grid=(max(1, -(-nseg // wpb)), 1, 1), block=(32 * wpb, 1, 1),
                          args={"nseg": nseg, "K": int(self.meta["K"])})

    def empty(self):
        return self._nseg() <= 0


@register_template
class CsrSddmm(NvccTemplate):
    """CSR SDDMM: a warp per bounded run of one row's nonzeros (X row reused from registers), or
    with ``flat=1`` a warp per run of ``nnz_per_warp`` stored entries spanning rows (each nonzero
    reads its own X row, hot in L1: for short rows), G-lane groups per nonzero with VEC-wide
    coalesced loads and shuffle reductions, XC column chunks per lane (K tiling), ``unroll``
    entries in flight a group (1: one entry's id then row at a time; 2 / 4: the warp reads 32
    entries' ids at once and each group loads that many rows before using any).  Any K >= 1.
    X / Y / output in float32, float16 or bfloat16 (fp32 dot products, one rounding of each
    output)."""

    name = "csr.sddmm"
    version = "2"
    dtypes = ("float32", "float16", "bfloat16")   # X / Y / output; fp32 dot products
    priority = 30
    ops = (("sddmm", None),)
    source_file = "sddmm_csr.cu"
    instance_macro = "SPC_SDDMM_INSTANCE"
    kernel_class = SddmmKernel
    fallback_param = "vec"
    absent_params = {"flat": 0, "unroll": 1}

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"group": C([4, 8, 16, 32]), "vec": C(_vec_choices(mod.op.dtype)), "k_chunks": C([1, 2, 4]),
                "nnz_per_warp": C([8, 16, 32, 64, 128, 256]), "warps_per_block": C([2, 4, 8]),
                "flat": C([0, 1]), "unroll": C([1, 2, 4])}

    @staticmethod
    def entries_in_flight(params, dtype: str = "float32") -> int:
        """``unroll`` of quick selection's batched variants: 4 entries a group when an entry is one
        16-byte load a lane (``k_chunks`` x ``vec`` elements), else 2."""
        return 4 if int(params["k_chunks"]) * int(params["vec"]) * DTYPES[dtype].bytes <= 16 else 2

    @staticmethod
    def k_chunks(K: int, group: int, vec: int) -> int:
        """Column chunks per lane that cover K with ``group`` lanes of ``vec`` elements in one tile,
        rounded up to a power of two, at most 4."""
        xc = min(4, max(1, -(-K // (group * vec))))
        return 1 << (xc - 1).bit_length() if xc > 1 else 1

    @staticmethod
    def heuristic(K: int, dtype: str = "float32") -> dict:
        vec = _largest_vec(K, 16 // DTYPES[dtype].bytes)
        lanes = -(-K // vec)
        group = 32 if lanes >= 32 else next(g for g in (4, 8, 16, 32) if g >= lanes)
        return {"group": group, "vec": vec, "k_chunks": CsrSddmm.k_chunks(K, group, vec), "nnz_per_warp": 32, "warps_per_block": 4, "flat": 0}

    def default_params(self, mod):
        return self.heuristic(mod.op.K, mod.op.dtype)

    def seed_params(self, mod):
        d = self.default_params(mod)
        K = mod.op.K
        vec = d["vec"]
        seeds = [d, {**d, "nnz_per_warp": 8}, {**d, "nnz_per_warp": 128}]
        shapes = [{}]
        for g in (8, 16):
            xc = self.k_chunks(K, g, vec)
            seeds.append({**d, "group": g, "k_chunks": xc})
            seeds.append({**d, "group": g, "k_chunks": xc, "nnz_per_warp": 64})
            shapes.append({"group": g, "k_chunks": xc})
        seeds.append({**d, "warps_per_block": 8})
        # nonzero-parallel segments across rows: short rows (mean ~5 nonzeros) leave most groups
        # of a one-row segment idle
        for shape in shapes:
            for npw in (32, 128):
                seeds.append({**d, **shape, "nnz_per_warp": npw, "flat": 1})
        # entries in flight a group (unroll): the default and its flat layout with the batched loads
        u = self.entries_in_flight(d, mod.op.dtype)
        seeds += [{**d, "unroll": u}, {**d, "nnz_per_warp": 32, "flat": 1, "unroll": u}]
        return unique_params(seeds)

    def check_arrays(self, key, params, arrays, meta, values=None):
        """Segments cover the nonzeros in order, each reads X rows in range (one row per segment,
        ``seg_xrow``; with ``flat`` one per entry, ``nnz_row``, and segments of at most
        ``nnz_per_warp`` entries); the output positions are a permutation of the entries, and the
        entries rebuild the manifest's matrix."""
        m, n, nnz = key.rows, key.cols, key.nnz
        meta_int(meta, "K", key.K)
        _kernel_types(arrays, ("indices", "nnz_ids", "seg_ptr", "seg_xrow", "nnz_row"))
        indices = index_array(arrays, "indices", 0, max(n, 1), nnz)
        data = float_array(arrays, "data", nnz)
        nnz_ids = index_array(arrays, "nnz_ids", 0, max(nnz, 1), nnz)
        if nnz and not np.all(np.bincount(nnz_ids, minlength=nnz) == 1):
            raise ValueError("array 'nnz_ids' is not a permutation of the stored entries")
        flat = _flat(params)
        _check_flat_instances(meta, flat)
        if flat:
            npw = params.get("nnz_per_warp")
            if npw not in AtLeast(1):
                raise ValueError(f"parameter 'nnz_per_warp' must be an integer >= 1, got {npw!r}")
            index_array(arrays, "seg_xrow", 0, 1, 0)
            seg_ptr = pointer_array(arrays, "seg_ptr", nnz)
            if np.any(np.diff(seg_ptr) > int(npw)):
                raise ValueError(f"array 'seg_ptr' has segments longer than nnz_per_warp={int(npw)}")
            row = index_array(arrays, "nnz_row", 0, max(m, 1), nnz)
        else:
            index_array(arrays, "nnz_row", 0, 1, 0)
            seg_xrow = index_array(arrays, "seg_xrow", 0, max(m, 1))
            seg_ptr = pointer_array(arrays, "seg_ptr", nnz, seg_xrow.size + 1)
            row = np.repeat(seg_xrow, np.diff(seg_ptr))
        order = np.empty(nnz, dtype=np.int64)
        order[nnz_ids] = np.arange(nnz, dtype=np.int64)
        check_entries(row, indices, data, m, n, key.pattern, values, order)

    def unranked_variants(self, params, op=None) -> list:
        """Variants of the model's first choice the shipped portfolio never measured: its
        nonzero-parallel segments (the portfolio measured one-row segments only, and on short rows
        the flat layout is up to 2x faster, H100), and both with several entries in flight a group
        (``unroll``, :meth:`entries_in_flight`; measured on the H200: 1.18x / 1.29x faster at 16-bit /
        fp32 K=64 over the 17 graphs, 1.20x at 16-bit K=128, but 0.83x at fp32 K=128 where an entry
        is four loads a lane, hence measured, not ruled)."""
        p = {**self.absent_params, **dict(params)}
        if int(p["unroll"]) > 1:
            return []
        dtype = op.dtype if op is not None else "float32"
        u = self.entries_in_flight(p, dtype)
        out = [] if _flat(p) else [{**dict(params), "flat": 1, "nnz_per_warp": 32}]
        return [{**dict(params), "unroll": u}] + out + [{**v, "unroll": u} for v in out]

    @staticmethod
    def group_shapes(K: int, vec: int) -> tuple:
        """The lane-group widths that cover K (at most 4 column chunks a lane, no lane beyond the
        power of two above K / ``vec`` idle): 4 / 8 / 16 / 32 lanes."""
        lanes = -(-max(int(K), 1) // _largest_vec(K, vec))
        top = max(4, 1 << (lanes - 1).bit_length())
        return tuple(g for g in (4, 8, 16, 32) if 4 * g >= lanes and g <= top)

    def probe_variants(self, params, op=None) -> list:
        """Next to a lead of quick selection's first round (on its pipeline and segments): the
        lead with several entries in flight (``unroll`` of :meth:`entries_in_flight`) where it has
        one, and the other lane-group widths of :meth:`group_shapes` (``k_chunks`` to cover K)
        with theirs.  The first round batches the model's first choice only, and the fastest
        batched module is often another width's: on the H200 over the 17 graphs over 200k
        nonzeros this made ``build()`` 1.16x / 1.04x / 1.06x faster at 16-bit K = 64 / 128 / 256
        (4-lane groups at K=64, a width the shipped measurements never held, won on all 17) and
        1.02x / 1.08x / 1.01x in fp32 (up to 1.49x on short rows at K=128), none more than 2%
        slower (``docs/benchmarks/h200_sddmm_fp*_default_big_v3.md``)."""
        if op is None:
            return []
        p = {**self.absent_params, **dict(params)}
        K, dtype = int(op.K), op.dtype
        vec = _largest_vec(K, int(p["vec"]))
        out = []
        if int(p["unroll"]) == 1:
            out.append({**dict(params), "unroll": self.entries_in_flight(p, dtype)})
        for g in self.group_shapes(K, vec):
            if g == int(p["group"]):
                continue
            q = {**dict(params), "group": g, "k_chunks": self.k_chunks(K, g, vec)}
            out.append({**q, "unroll": self.entries_in_flight(q, dtype)})
        return [v for v in unique_params(out) if v != dict(params)]

    #: rows at most this long on average make RCM a locality order quick selection measures
    RCM_MAX_MEAN = 12.0

    def locality_orders(self, op=None) -> list:
        """RCM, on matrices of sparse rows (mean at most ``RCM_MAX_MEAN``): the shipped portfolio
        measured the matrix's own and the degree order only, and on the mesh-like graphs of that
        kind RCM's locality made tuned SDDMM modules up to 1.4x faster (H100, K=64 / 256:
        dimacs10_wing, rgg, gemsec_deezer_hu in ``h100_sddmm_fp32_tuned_K*.md``)."""
        return _rcm_on_sparse_rows(op, self.RCM_MAX_MEAN)

    def checks(self, mod):
        return {"group": (4, 8, 16, 32), "k_chunks": (1, 2, 4, 8), "vec": _vec_choices(mod.op.dtype),
                "warps_per_block": (1, 2, 4, 8), "nnz_per_warp": AtLeast(1), "flat": (0, 1), "unroll": (1, 2, 4)}

    def pack(self, mod, params):
        return pack_sddmm(mod, int(params["nnz_per_warp"]), _flat(params))

    def instance_args(self, mod, params):
        return {"group": int(params["group"]), "vec": _largest_vec(mod.op.K, int(params["vec"])),
                "xc": int(params["k_chunks"]), "dtype": mod.op.dtype, "flat": int(_flat(params)),
                "unroll": int(params.get("unroll", 1))}

    @staticmethod
    def instance_name(TN, G, VEC, XC, FLAT=0, U=1) -> str:
        return f"sddmm_csr_{_SHORT[TN]}_g{G}_v{VEC}_xc{XC}" + ("_flat" if FLAT else "") + (f"_u{U}" if U > 1 else "")

    def instance(self, group: int, vec: int, xc: int, dtype: str = "float32", flat: int = 0, unroll: int = 1):
        TN, FLAT, U = DTYPES[dtype].code, int(bool(flat)), int(unroll)
        return self.instance_name(TN, group, vec, xc, FLAT, U), (TN, group, vec, xc, FLAT) + ((U,) if U > 1 else ())

    def instance_macro_of(self, name: str) -> str:
        """``SPC_SDDMM_INSTANCE_U`` for the instances of ``unroll`` > 1 (name suffix ``_u<N>``), else
        ``SPC_SDDMM_INSTANCE``."""
        return self.instance_macro + ("_U" if re.search(r"_u\d+$", name) else "")


def _rcm_on_sparse_rows(op, max_mean: float) -> list:
    """``[["reorder.rcm"]]`` for a matrix whose rows hold at most ``max_mean`` entries on
    average, else none (a locality order for quick selection to measure)."""
    if op is None:
        return []
    lens = op.A.row_lengths
    if not lens.size or float(lens.mean()) > max_mean:
        return []
    return [["reorder.rcm"]]


def _kernel_types(arrays, index_names) -> None:
    """The arrays have their kernel parameters' element types (``const int*`` indices, ``const
    float*`` values): another width would be read as other values, or past the array's end."""
    for name in index_names:
        typed_array(arrays, name, np.int32)
    typed_array(arrays, "data", np.float32)


def _flat(params) -> bool:
    """The ``flat`` parameter of a csr.sddmm parameter set: 0 or 1 (absent in configs saved
    before it existed: the one-row segments); ValueError for anything else."""
    v = params.get("flat", 0)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v not in (0, 1):
        raise ValueError(f"csr.sddmm parameter 'flat' must be 0 or 1, got {v!r}")
    return bool(v)


def _check_flat_instances(meta, flat: bool) -> None:
    """Every instance of the meta is compiled for the segment layout of the arrays (its FLAT
    template argument, the last of SPC_SDDMM_INSTANCE's): a FLAT = 1 entry point would follow
    ``nnz_row``, which a one-row-segment layout leaves empty."""
    inst = meta.get("instances")
    ok = isinstance(inst, (list, tuple)) and len(inst) > 0 and all(
        isinstance(i, (list, tuple)) and len(i) == 2 and isinstance(i[1], (list, tuple)) and len(i[1]) in (5, 6)
        and isinstance(i[1][4], (int, np.integer)) and not isinstance(i[1][4], bool) and int(i[1][4]) == int(flat)
        and (len(i[1]) == 5 or (isinstance(i[1][5], (int, np.integer)) and not isinstance(i[1][5], bool)
                                and int(i[1][5]) in (2, 4)))
        for i in inst)
    if not ok:
        raise ValueError(f"kernel meta 'instances' must be SPC_SDDMM_INSTANCE arguments with FLAT={int(flat)}, "
                         f"got {inst!r}")
