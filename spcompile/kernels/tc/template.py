"""``tc.wmma_sgt`` / ``tc.wmma_sgt_sddmm``: TC-GNN tensor-core SpMM and SDDMM (Wang et al., ATC'23)
on the ``tile.sgt`` layout.

SpMM, two implementations (parameter ``impl``, see ``tc_wmma_sgt.cu``):

* ``"mma"`` (default): register-direct ``mma.sync``; a row window's TC blocks are cut into
  balanced work items of at most ``max_blocks`` blocks (longest first, one thread block per item
  and K slice), partial 16 x K results of a split window are combined in the same launch by the
  last item to finish (fixed slot order: deterministic).  A fragments are packed at build time,
  X rows are loaded straight into registers as float4s (no shared memory, no block barriers).
* ``"wmma"``: the paper's scheme -- one thread block per 16-row window (and slice of K); warps run
  WMMA on the window's condensed TC blocks (``mod.formats["sgt"]``) against the gathered rows of
  X staged in shared memory.

SDDMM (``tc.wmma_sgt_sddmm``, ``tc_wmma_sddmm.cu``): one warp per TC block computes the 16 x BW
block of ``X[window rows] @ Y[block columns]^T`` with ``mma.sync`` and writes ``A.data * dot`` for
the block's stored nonzeros, in the caller's nonzero order.  Precisions: tf32 (m16n16k8, the paper's choice, any SGT block width that is a
multiple of 8), fp16 / bf16 (m16n16k16, needs 16-wide SGT blocks: ``tile.sgt[shape=fp16]``); all
accumulate in fp32.  SpMM ``sum`` (and ``mean``, by scaling the values with 1 / row length at build
time): tensor cores cannot do max/min.

Workload dtypes (``mod.op.dtype``): float32 (X / Y converted in registers to the chosen
precision) and float16 / bfloat16: X (and Y for SDDMM) are read as 16-bit with 16-byte loads (8
values per lane) and used as MMA operands as they are, so the precision is the input type (fp16
for float16, bf16 for bfloat16; other precisions are refused), accumulation is fp32 and the output
is written in the input dtype, rounded once (split SpMM windows add fp32 partials in a fixed order
and round the sum).  Both kernel sources include ``tc_frag.cuh`` (conversions, mma.sync wrappers,
guarded vector loads / stores), inlined by ``_NvccTemplate.source_text`` (``headers``).  Every launch goes through
``rt.Launch``.

Pipelines: ``tile.sgt`` alone (16x8 and 16x16 blocks), and :data:`spcompile.passes.recipes.WINDOW_REUSE` + ``tile.sgt``:
RCM then 16-row LSH clusters, which put rows with common neighbours in the same window (more
nonzeros per gathered X row, fewer TC blocks).

The kernel works in the caller's order: SGT does not permute, and any earlier reordering is
folded in (X rows of a TC block are original column ids, output rows go to ``row_ids``).
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

__all__ = ["TcWmmaSgt", "TcWmmaSgtSddmm", "tc_arrays", "emulate_tc_spmm", "mma_arrays", "emulate_mma_spmm",
           "split_windows", "sddmm_arrays", "emulate_tc_sddmm", "PRECISIONS", "INPUT_PRECISION",
           "round_to"]

#: the MMA operand precisions of the tensor-core kernels (code, MMA k: :mod:`spcompile.core.numerics`)
PRECISIONS = {p: numerics.PRECISIONS[p] for p in ("tf32", "fp16", "bf16")}
#: workload dtype -> the only MMA precision offered for it (16-bit inputs are MMA operands as they
#: are; fp32 inputs are converted in registers to any of PRECISIONS)
INPUT_PRECISION = NATIVE_PRECISION


def input_type(dtype: str, precision: str) -> int:
    """Kernel input-type code TI: 0 for float32 inputs (any precision), 1 for 16-bit inputs, whose
    precision must be their own type; a clear error otherwise."""
    if dtype == "float32":
        return 0
    want = INPUT_PRECISION.get(dtype)
    if want is None:
        raise ValueError(f"unsupported dtype {dtype!r}; expected float32, float16 or bfloat16")
    if precision != want:
        raise ValueError(f"precision {precision!r} does not match the {dtype} workload: {dtype} inputs run "
                         f"with precision {want!r} only")
    return 1


def _vec(K: int, ti: int) -> int:
    """Elements per 16-byte vector load when K allows it (fp32: 4, 16-bit: 8), else 1."""
    w = 8 if ti else 4
    return w if K % w == 0 else 1


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """Values of ``a`` rounded to ``dtype`` (float16 / bfloat16 round to nearest even), as float64."""
    return numerics.round_to(a, dtype).astype(np.float64)


_bf16_bits = numerics.bf16_bits
_bf16_to_f32 = numerics.bf16_from_bits


def tc_arrays(mod: SparseModule, precision: str = "tf32", dense_a: bool = True) -> dict[str, np.ndarray]:
    """Kernel arrays from ``mod.formats["sgt"]`` with permutations folded in:
    ``win_block_ptr`` (windows + 1), ``blk_cols`` (blocks x BW: original X row per tile column, -1
    padding), ``row_ids`` (original output row of each current row), and either ``tiles`` (dense
    16 x BW tiles in the MMA input type) or ``nz_ptr`` / ``nz_pos`` / ``nz_val`` (each block's
    nonzeros: position ``row * BW + col`` in its tile and value)."""
    fmt = mod.formats["sgt"]
    ka = csr_kernel_arrays(mod, np.int32)
    data = ka["data"].astype(np.float32)
    if mod.op.reduce == "mean":
        lens = np.diff(mod.A.indptr.astype(np.int64))
        data = (data / np.repeat(np.maximum(lens, 1), lens)).astype(np.float32)
    cols = np.asarray(fmt.block_cols, dtype=np.int64)
    if mod.col_perm is not None:
        cols = np.where(cols >= 0, np.asarray(mod.col_perm)[np.maximum(cols, 0)], -1)
    out = {"win_block_ptr": np.ascontiguousarray(fmt.win_block_ptr, dtype=np.int32),
           "blk_cols": np.ascontiguousarray(cols.reshape(-1), dtype=np.int32),
           "row_ids": np.ascontiguousarray(ka["row_ids"], dtype=np.int32)}
    BW = fmt.BLK_W
    if precision == "fp16" and data.size and float(np.abs(data).max()) > 65504.0:
        raise ValueError("matrix values exceed the fp16 range; use tf32 or bf16")
    if dense_a:
        t = fmt.dense_tiles(data, np.float32)
        if precision == "fp16":
            t = t.astype(np.float16)
        elif precision == "bf16":
            t = _bf16_bits(t)
        out["tiles"] = np.ascontiguousarray(t.reshape(-1))
    else:
        order = np.asarray(fmt.block_nnz_order, dtype=np.int64)
        pos = (np.asarray(fmt.block_row, dtype=np.int64) * BW + np.asarray(fmt.block_col, dtype=np.int64))[order]
        out["nz_ptr"] = np.ascontiguousarray(fmt.block_nnz_ptr, dtype=np.int32)
        out["nz_pos"] = np.ascontiguousarray(pos, dtype=np.uint8)
        out["nz_val"] = np.ascontiguousarray(data[order], dtype=np.float32)
    return out


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
        t = _bf16_to_f32(t) if meta["precision"] == "bf16" else t
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
    Y = np.zeros((m, K))
    Y[np.asarray(arrays["row_ids"], dtype=np.int64)] = acc.reshape(-1, K)[:m]
    return Y



# ------------------------------------------------------------------------------------------
# impl "mma": fragment packing, window splitting (vectorised), emulation of the kernel's lanes
# ------------------------------------------------------------------------------------------
_LANE = np.arange(32)
_G, _T = _LANE // 4, _LANE % 4


def a_frag_layout(precision: str) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) in the 16 x KS A operand of register element i of lane l, shape (32, n): the
    PTX ISA layouts of mma.m16n8k8 .tf32 (4 elements) and mma.m16n8k16 .f16/.bf16 (8)."""
    if precision == "tf32":
        i = np.arange(4)
        return _G[:, None] + 8 * (i % 2), _T[:, None] + 4 * (i // 2)
    i = np.arange(8)
    return _G[:, None] + 8 * ((i // 2) % 2), 2 * _T[:, None] + (i % 2) + 8 * (i // 4)


def b_frag_rows(precision: str) -> np.ndarray:
    """k index (row of the KS x 8 B operand, column n = g) of B register element e of lane l."""
    if precision == "tf32":
        return np.stack([_T, _T + 4], 1)
    return np.stack([2 * _T, 2 * _T + 1, 2 * _T + 8, 2 * _T + 9], 1)


_tf32_round = numerics.tf32_round


def split_windows(win_block_ptr: np.ndarray, max_blocks: int) -> dict[str, np.ndarray]:
    """Work items of at most ``max_blocks`` TC blocks (0: whole windows), balanced within a window,
    longest first.  ``items`` (n, 4) int32: first block, end block, window, partial slot (-1 when
    the window is one item); ``slot_grp`` (slot -> split window group), ``grp_ptr`` (group ->
    its contiguous slots).  Empty windows get one empty item (the kernel writes their zeros)."""
    wbp = np.asarray(win_block_ptr, dtype=np.int64)
    nb = np.diff(wbp)
    nwin = nb.size
    nch = np.maximum(1, -(-nb // int(max_blocks))) if max_blocks and max_blocks > 0 else np.ones(nwin, np.int64)
    win = np.repeat(np.arange(nwin, dtype=np.int64), nch)
    first = np.cumsum(nch) - nch
    within = np.arange(win.size, dtype=np.int64) - first[win]
    lo = wbp[win] + (within * nb[win]) // nch[win]
    hi = wbp[win] + ((within + 1) * nb[win]) // nch[win]
    split = nch[win] > 1
    slot = np.full(win.size, -1, dtype=np.int64)
    slot[split] = np.arange(int(split.sum()))
    sw = np.flatnonzero(nch > 1)
    grp_ptr = np.concatenate([[0], np.cumsum(nch[sw])]).astype(np.int64)
    slot_grp = np.repeat(np.arange(sw.size, dtype=np.int64), nch[sw])
    order = np.argsort(-(hi - lo), kind="stable")
    items = np.stack([lo, hi, win, slot], 1)[order]
    return {"items": np.ascontiguousarray(items, dtype=np.int32),
            "slot_grp": np.ascontiguousarray(slot_grp, dtype=np.int32),
            "grp_ptr": np.ascontiguousarray(grp_ptr, dtype=np.int32)}


def _folded_cols(mod: SparseModule) -> np.ndarray:
    fmt = mod.formats["sgt"]
    cols = np.asarray(fmt.block_cols, dtype=np.int64)
    if mod.col_perm is not None:
        cols = np.where(cols >= 0, np.asarray(mod.col_perm)[np.maximum(cols, 0)], -1)
    return cols


def _spmm_data(mod: SparseModule, ka) -> np.ndarray:
    data = ka["data"].astype(np.float32)
    if mod.op.reduce == "mean":
        lens = np.diff(mod.A.indptr.astype(np.int64))
        data = (data / np.repeat(np.maximum(lens, 1), lens)).astype(np.float32)
    return data


def mma_arrays(mod: SparseModule, precision: str = "tf32", max_blocks: int = 32) -> dict[str, np.ndarray]:
    """Arrays of the register-direct kernel: ``afrag`` (A fragments per MMA k-step and lane, 16
    bytes each: 4 tf32-rounded floats or 8 fp16/bf16), ``pcols`` (each k-step's X row ids in the
    order a lane loads them: tf32 columns (t, t+4) per lane, 16-bit (2t, 2t+1, 2t+8, 2t+9)),
    ``row_ids`` and the work items of :func:`split_windows`."""
    fmt = mod.formats["sgt"]
    BW = fmt.BLK_W
    KS = PRECISIONS[precision].mma_k
    if BW % KS:
        raise ValueError(f"precision {precision!r} needs a block width multiple of {KS}, got {BW}")
    ka = csr_kernel_arrays(mod, np.int32)
    data = _spmm_data(mod, ka)
    if precision == "fp16" and data.size and float(np.abs(data).max()) > 65504.0:
        raise ValueError("matrix values exceed the fp16 range; use tf32 or bf16")
    S = BW // KS
    nblk = fmt.num_blocks
    tiles = fmt.dense_tiles(data, np.float32).reshape(nblk, 16, S, KS).transpose(0, 2, 1, 3)  # (nblk, S, 16, KS)
    r, c = a_frag_layout(precision)
    frag = tiles[:, :, r, c]                                           # (nblk, S, 32, 4 | 8)
    if precision == "tf32":
        frag = _tf32_round(frag)
    elif precision == "fp16":
        frag = frag.astype(np.float16)
    else:
        frag = _bf16_bits(frag)
    cols = _folded_cols(mod).reshape(nblk, S, KS)
    order = b_frag_rows(precision)[:4].reshape(-1)                      # lanes t = 0..3 (g = 0)
    pcols = cols[:, :, order]
    out = {"afrag": np.ascontiguousarray(frag.reshape(-1)),
           "pcols": np.ascontiguousarray(pcols.reshape(-1), dtype=np.int32),
           "row_ids": np.ascontiguousarray(ka["row_ids"], dtype=np.int32)}
    out.update(split_windows(fmt.win_block_ptr, max_blocks))
    return out


def _frag_values(afrag: np.ndarray, precision: str, nsteps: int) -> np.ndarray:
    a = np.asarray(afrag)
    if precision == "bf16":
        a = _bf16_to_f32(a)
    return a.astype(np.float64).reshape(nsteps, 32, -1)


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
    A = np.zeros((nsteps, 16, KS))
    ar, ac = a_frag_layout(prec)
    A[:, ar, ac] = _frag_values(arrays["afrag"], prec, nsteps)           # (nsteps, 32, n)
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
        B = np.zeros((nsteps, NJ, KS, 8))
        for e in range(NR):
            B[:, :, brow[:, e], _G] = np.moveaxis(vals[:, :, e, :], 2, 1)
        C = np.einsum("srk,sjkn->sjrn", A, B).reshape(nblk, S, NJ, 16, 8).sum(1)   # (nblk, j, 16, 8)
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


class TcKernel(_NvccKernel):
    """Both impls launch through ``rt.Launch`` (argument buffer built once, the driver's
    cuLaunchKernel per call); the instance with VEC = 1 serves unaligned X / Y."""

    def prepare(self):
        if self.meta.get("impl", "wmma") == "mma":
            return self._prepare_mma()
        fns = self._load_functions()
        p, meta = self.params, self.meta
        K, m, nwin = int(meta["K"]), int(meta["m"]), int(meta["windows"])
        W, TPW = int(p["warps_per_block"]), int(p["tiles_per_warp"])
        names = ["win_block_ptr", "blk_cols", "row_ids"] + (["tiles"] if "tiles" in self.arrays
                                                             else ["nz_ptr", "nz_pos", "nz_val"])
        dev = dict(zip(names, self._upload(tuple(names))))
        z = 0
        args = [dev["win_block_ptr"], dev["blk_cols"], dev.get("tiles", z), dev.get("nz_ptr", z),
                dev.get("nz_pos", z), dev.get("nz_val", z), dev["row_ids"], None, None, np.int32(m), np.int32(K)]
        ktiles = -(-K // 16)
        grid = (max(nwin, 1), -(-ktiles // (W * TPW)), 1)
        smem = int(meta["smem_fixed"]) + W * int(meta["smem_per_warp"])
        for f in fns:
            rt.ensure_dynamic_smem(f, smem)
        self._launches = [rt.Launch(f, grid, (32 * W, 1, 1), args, smem) for f in (fns[0], fns[-1])]
        self._amask = 15 if int(meta["vec"]) > 1 else 0
        self._xmask = self._amask                      # wmma: only X is read with vector loads
        self._empty = nwin == 0 or m == 0
        self._ready = True

    def _prepare_mma(self):
        import cupy

        fns = self._load_functions()
        p, meta = self.params, self.meta
        K, m = int(meta["K"]), int(meta["m"])
        W, CG = int(p["warps_per_block"]), int(p["col_groups"])
        span = int(meta.get("span", 32))
        nitems = int(self.arrays["items"].shape[0])
        ngrp = int(self.arrays["grp_ptr"].size) - 1
        nslot = int(self.arrays["slot_grp"].size)
        ty = -(-K // (span * CG * W))
        dev = self._upload(("items", "slot_grp", "grp_ptr", "pcols", "afrag", "row_ids"))
        self._part = cupy.empty(max(1, nslot * 16 * K), dtype=cupy.float32)   # fp32 partials
        self._counters = cupy.zeros(max(1, ngrp * ty * W), dtype=cupy.int32)
        args = list(dev) + [None, None, int(self._part.data.ptr), int(self._counters.data.ptr),
                            np.int32(m), np.int32(K)]
        grid, block = (max(nitems, 1), ty, 1), (32 * W, 1, 1)
        self._launches = [rt.Launch(f, grid, block, args) for f in (fns[0], fns[-1])]
        self._amask = 15 if int(meta["vec"]) > 1 else 0
        self._xmask = None
        self._empty = nitems == 0 or m == 0
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x = in_ptrs[0]
        addr = x if self._xmask is not None else (x | out_ptr)
        self._launches[1 if addr & self._amask else 0]((x, out_ptr), stream)


def _pow2_at_most(x: int, hi: int) -> int:
    x = max(1, min(int(x), hi))
    return 1 << (x.bit_length() - 1) if x & (x - 1) else x


@register_template
class TcWmmaSgt(_NvccTemplate):
    """TC-GNN (ATC'23) tensor-core SpMM on SGT row windows: tf32 m16n8k8 / m16n16k8 (fp16 / bf16
    m16n8k16 / m16n16k16 as options) with fp32 accumulation.  impl "mma": register-direct
    mma.sync with balanced work items (windows split into runs of at most ``max_blocks`` TC
    blocks; tunable: warps per block, column groups per warp, blocks in flight per warp);
    impl "wmma": the paper's scheme (sparse tile and gathered X rows staged in shared memory;
    tunable: warps per block, 16-column tiles per warp, sparse-tile source).  X / Y in float32
    (converted to the MMA precision in registers) or float16 / bfloat16 (X loaded as 16-bit and
    used as the MMA operand directly, precision = the input type, fp32 accumulation, Y rounded
    once; split windows combine fp32 partials)."""

    name = "tc.wmma_sgt"
    precision_param = "precision"
    version = "3"
    dtypes = ("float32", "float16", "bfloat16")
    priority = 10
    ops = (("spmm", "sum"), ("spmm", "mean"))
    format = "sgt"
    source_file = "tc_wmma_sgt.cu"
    headers = ("tc_frag.cuh",)   # shared with tc_wmma_sddmm.cu
    instance_macro = "SPC_TC_SPMM_INSTANCE"

    def requires(self, mod):
        return ("sgt",)


    def supports(self, mod):
        if not super().supports(mod):
            return False
        fmt = mod.formats["sgt"]
        bws = (16,) if mod.op.dtype != "float32" else (8, 16)
        return fmt.BLK_H == 16 and fmt.BLK_W in bws and fmt.num_blocks < 2**31 // 256

    @staticmethod
    def _allowed_precisions(dtype: str) -> list[str]:
        return [INPUT_PRECISION[dtype]] if dtype in INPUT_PRECISION else list(PRECISIONS)

    def _precisions(self, mod) -> list[str]:
        fmt = mod.formats.get("sgt")
        bw = fmt.BLK_W if fmt is not None else 8
        return [p for p in self._allowed_precisions(mod.op.dtype) if bw % PRECISIONS[p].mma_k == 0]

    def check_params(self, mod, params):
        full = super().check_params(mod, params)
        input_type(mod.op.dtype, str(full["precision"]))     # 16-bit inputs: their own precision only
        return full

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"impl": C(["mma", "wmma"]), "warps_per_block": C([1, 2, 4, 8]), "col_groups": C([1, 2, 4]),
                "unroll": C([1, 2, 4]), "max_blocks": C([0, 8, 32, 128]), "tiles_per_warp": C([1, 2, 4]),
                "dense_a": C([0, 1]), "precision": C(self._allowed_precisions(mod.op.dtype))}

    @staticmethod
    def _span(dtype: str) -> int:
        """Output columns per column group of impl "mma": 32 (fp32 X), 64 (16-bit X)."""
        return 32 if dtype == "float32" else 64

    @staticmethod
    def _mma_shape(K: int, span: int = 32) -> tuple[int, int]:
        groups = -(-K // span)
        cg = 1 if groups <= 8 else 2
        return cg, _pow2_at_most(-(-groups // cg), 8)

    @staticmethod
    def _wmma_shape(K: int) -> tuple[int, int]:
        ktiles = -(-K // 16)
        tpw = 2 if ktiles >= 8 else 1
        W = max(1, min(8, -(-ktiles // tpw)))
        return tpw, min(1 << (W - 1).bit_length(), 8)

    def default_params(self, mod):
        K = mod.op.K
        tpw, _ = self._wmma_shape(K)
        cg, wm = self._mma_shape(K, self._span(mod.op.dtype))
        return {"impl": "mma", "warps_per_block": wm, "col_groups": cg, "unroll": 4 if cg == 1 else 2,
                "max_blocks": 32, "tiles_per_warp": tpw, "dense_a": 1,
                "precision": self._allowed_precisions(mod.op.dtype)[0]}

    def _defaults(self, mod):
        d = self.default_params(mod)
        return d, {**d, "impl": "wmma", "warps_per_block": self._wmma_shape(mod.op.K)[1]}

    def seed_params(self, mod):
        d, dw = self._defaults(mod)
        K = mod.op.K
        groups = -(-K // self._span(mod.op.dtype))
        seeds = [d]
        for mb in (0, 8, 128):
            seeds.append({**d, "max_blocks": mb})
        seeds += [{**d, "unroll": 1}, {**d, "unroll": 2}]
        if groups >= 2:
            cg2 = 2 if d["col_groups"] == 1 else 1
            seeds.append({**d, "col_groups": cg2, "unroll": 1 if cg2 == 2 else 4,
                          "warps_per_block": _pow2_at_most(-(-groups // cg2), 8)})
        for prec in self._precisions(mod):
            seeds.append({**d, "precision": prec})
        seeds += [dw, {**dw, "dense_a": 0}]
        return unique_params(seeds)

    # -- rendering / instances ---------------------------------------------------------------
    def render(self, instances):
        lines = [self.source_text(), ""]
        for n, args in instances:
            macro = "SPC_TC_MMA_INSTANCE" if n.startswith("tc_mma") else self.instance_macro
            lines.append(f"{macro}({n}, {', '.join(str(int(a)) for a in args)})")
        return "\n".join(lines) + "\n"

    @staticmethod
    def instance_name(P, BW, TPW, DENSE_A, VEC, TI=0) -> str:
        return f"tc_spmm_p{P}_bw{BW}_t{TPW}_d{DENSE_A}_v{VEC}" + ("_x16" if TI else "")

    def instances(self, precision: str, BW: int, tpw: int, dense_a: int, vec: int, ti: int = 0) -> list:
        P = PRECISIONS[precision].code
        inst = [(self.instance_name(P, BW, tpw, dense_a, vec, ti), (P, BW, tpw, dense_a, vec, ti))]
        if vec > 1:
            inst.append((self.instance_name(P, BW, tpw, dense_a, 1, ti), (P, BW, tpw, dense_a, 1, ti)))
        return inst

    def mma_instances(self, precision: str, BW: int, cg: int, unroll: int, vec: int, ti: int = 0) -> list:
        P = PRECISIONS[precision].code
        name = lambda v: f"tc_mma_p{P}_bw{BW}_c{cg}_u{unroll}_v{v}" + ("_x16" if ti else "")  # noqa: E731
        inst = [(name(vec), (P, BW, cg, unroll, vec, ti))]
        if vec > 1:
            inst.append((name(1), (P, BW, cg, unroll, 1, ti)))
        return inst

    @staticmethod
    def mma_ok(precision: str, BW: int, cg: int, unroll: int, ti: int = 0) -> bool:
        """Register budget: 16-byte X vectors in flight per lane (CG x U x k-steps x rows) <= 16;
        16-bit X (8 n-tiles per column group, 32 accumulators each): at most 2 column groups."""
        KS = PRECISIONS[precision].mma_k
        nr = 2 if precision == "tf32" else 4
        return cg * unroll * (BW // KS) * nr <= 16 and (not ti or cg <= 2)

    @staticmethod
    def smem_bytes(precision: str, BW: int, tpw: int, dense_a: int) -> tuple[int, int]:
        """(per block, per warp) dynamic shared memory of impl "wmma", mirroring ``layout<>``."""
        size = 4 if precision == "tf32" else 2
        pad = 4 if precision == "tf32" else 8
        r128 = lambda x: -(-x // 128) * 128  # noqa: E731
        xs = r128(BW * (16 * tpw + pad) * size)
        return (0 if dense_a else r128(16 * BW * size)), xs + 16 * 16 * 4

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        dtype = mod.op.dtype
        if dtype not in self.dtypes:
            raise ValueError(f"tc.wmma_sgt supports dtypes {list(self.dtypes)}, not {dtype!r}")
        if "sgt" not in mod.formats or not self.supports(mod):
            raise ValueError("tc.wmma_sgt needs a 16-row SGT format (run tile.sgt first; 16-bit inputs need "
                             "16-wide blocks: tile.sgt[shape=fp16])")
        fmt = mod.formats["sgt"]
        prec = str(params["precision"])
        impl = str(params.get("impl", "mma"))
        W = int(params["warps_per_block"])
        if prec not in PRECISIONS or fmt.BLK_W % PRECISIONS[prec].mma_k:
            raise ValueError(f"precision {prec!r} needs an SGT block width that is a multiple of "
                             f"{getattr(PRECISIONS.get(prec), 'mma_k', '?')}, got BLK_W={fmt.BLK_W}")
        ti = input_type(dtype, prec)
        K = mod.op.K
        vec = _vec(K, ti)
        arch = rt.device_arch()
        if arch < 80:
            raise ValueError("tc.wmma_sgt needs sm_80 or newer (tf32 / bf16 tensor cores)")
        meta = {"K": K, "m": mod.A.shape[0], "BW": fmt.BLK_W, "windows": fmt.num_windows, "vec": vec,
                "precision": prec, "arch": arch, "impl": impl,
                "dtype": dtype}
        if impl == "mma":
            cg, un, mb = int(params["col_groups"]), int(params["unroll"]), int(params["max_blocks"])
            if W not in (1, 2, 4, 8) or cg not in (1, 2, 4) or un not in (1, 2, 4) or mb < 0:
                raise ValueError(f"invalid tc.wmma_sgt parameters {params}")
            if not self.mma_ok(prec, fmt.BLK_W, cg, un, ti):
                raise ValueError(f"col_groups x unroll too large for {prec} with {fmt.BLK_W}-wide blocks "
                                 f"and {dtype} inputs (registers would spill)")
            arrays = mma_arrays(mod, prec, mb)
            inst = self.mma_instances(prec, fmt.BLK_W, cg, un, vec, ti)
            meta.update(items=int(arrays["items"].shape[0]), slots=int(arrays["slot_grp"].size),
                        span=self._span(dtype))
        elif impl == "wmma":
            tpw, dense_a = int(params["tiles_per_warp"]), int(params["dense_a"])
            if W not in (1, 2, 4, 8, 16) or tpw not in (1, 2, 4) or dense_a not in (0, 1):
                raise ValueError(f"invalid tc.wmma_sgt parameters {params}")
            arrays = tc_arrays(mod, prec, bool(dense_a))
            inst = self.instances(prec, fmt.BLK_W, tpw, dense_a, vec, ti)
            fixed, per_warp = self.smem_bytes(prec, fmt.BLK_W, tpw, dense_a)
            meta.update(smem_fixed=fixed, smem_per_warp=per_warp)
        else:
            raise ValueError(f"tc.wmma_sgt: unknown impl {impl!r}")
        path = self.compile(inst, arch=arch, name=inst[0][0])
        meta["instances"] = [[n, list(a)] for n, a in inst]
        return TcKernel(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        return TcKernel(self.name, params, arrays, files, meta, self)


# ------------------------------------------------------------------------------------------
# SDDMM on SGT blocks
# ------------------------------------------------------------------------------------------
def sddmm_arrays(mod: SparseModule) -> dict[str, np.ndarray]:
    """Arrays of ``tc_wmma_sddmm.cu``: ``blk_win`` (window of each TC block), ``blk_cols``
    (original Y row per block column, -1 padding), ``nz_ptr`` / ``nz_pos`` (position row * BW +
    col in the block) / ``nz_val`` (A.data) / ``nz_out`` (caller's nonzero index) of each block's
    nonzeros, ``row_ids`` (original X row of each current row)."""
    fmt = mod.formats["sgt"]
    BW = fmt.BLK_W
    ka = csr_kernel_arrays(mod, np.int32)
    order = np.asarray(fmt.block_nnz_order, dtype=np.int64)
    pos = (np.asarray(fmt.block_row, dtype=np.int64) * BW + np.asarray(fmt.block_col, dtype=np.int64))[order]
    return {"blk_win": np.ascontiguousarray(fmt.block_window, dtype=np.int32),
            "blk_cols": np.ascontiguousarray(_folded_cols(mod).reshape(-1), dtype=np.int32),
            "nz_ptr": np.ascontiguousarray(fmt.block_nnz_ptr, dtype=np.int32),
            "nz_pos": np.ascontiguousarray(pos, dtype=np.uint8),
            "nz_val": np.ascontiguousarray(ka["data"][order], dtype=np.float32),
            "nz_out": np.ascontiguousarray(np.asarray(ka["nnz_ids"])[order], dtype=np.int32),
            "row_ids": np.ascontiguousarray(ka["row_ids"], dtype=np.int32)}


def emulate_tc_sddmm(arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any], X: np.ndarray,
                     Y: np.ndarray) -> np.ndarray:
    """What the SDDMM kernel computes (float64), lane by lane: A / B fragments built from the
    vectors each lane loads under the kernel's k-index mapping (fp32: float4s, 32-feature chunks;
    16-bit ``meta["dtype"]``: 8 values, 64-feature chunks), C scattered through the PTX C layout
    into the 16 x BW block, then each stored nonzero's value times its block entry (rounded once
    to a 16-bit output type).  For 16-bit workloads X / Y hold the 16-bit values."""
    m, BW, prec, nnz = int(meta["m"]), int(meta["BW"]), str(meta["precision"]), int(meta["nnz"])
    dtype = str(meta.get("dtype", "float32"))
    if input_type(dtype, prec):
        return _emulate_tc_sddmm16(arrays, meta, X, Y)
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    K = X.shape[1]
    win = np.asarray(arrays["blk_win"], dtype=np.int64)
    nblk = win.size
    cols = np.asarray(arrays["blk_cols"], dtype=np.int64).reshape(nblk, BW)
    row_ids = np.asarray(arrays["row_ids"], dtype=np.int64)
    Kp = -(-K // 32) * 32
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
    for kc in range(0, Kp, 32):
        # lane (g, t): float4 q at features kc + 16q + 4t + (0..3)
        f = kc + 16 * np.arange(2)[:, None, None] + 4 * _T[None, :, None] + np.arange(4)[None, None, :]  # (2, 32, 4)
        steps = range(4) if prec == "tf32" else range(2)
        for j in steps:
            # feature of k index k for this step: tf32 k = t (q=0, el j), t+4 (q=1, el j);
            # 16-bit k = 2t+e (q=0, el 2j+e), 2t+8+e (q=1, el 2j+e)
            KS = 8 if prec == "tf32" else 16
            feat = np.zeros(KS, dtype=np.int64)
            for lane in range(4):
                if prec == "tf32":
                    feat[lane], feat[lane + 4] = f[0, lane, j], f[1, lane, j]
                else:
                    for e in range(2):
                        feat[2 * lane + e], feat[2 * lane + 8 + e] = f[0, lane, 2 * j + e], f[1, lane, 2 * j + e]
            # A register element i of lane l holds X[row ar][feat[ac]]; rebuild A through the layout
            Aop = np.zeros((nblk, 16, KS))
            Aop[:, ar, ac] = Xp[xr[:, ar], feat[ac]]
            for n0 in range(0, BW, 8):
                Bop = np.zeros((nblk, KS, 8))
                for e in range(brow.shape[1]):
                    Bop[:, brow[:, e], _G] = Yp[yc[:, n0 + _G], feat[brow[:, e]]]
                C[:, :, n0:n0 + 8] += Aop @ Bop
    out = np.full(nnz, np.nan)
    ptr = np.asarray(arrays["nz_ptr"], dtype=np.int64)
    blk = np.repeat(np.arange(nblk), np.diff(ptr))
    out[np.asarray(arrays["nz_out"], dtype=np.int64)] = (np.asarray(arrays["nz_val"], dtype=np.float64) *
                                                         C.reshape(nblk, -1)[blk, arrays["nz_pos"].astype(np.int64)])
    return out


def _emulate_tc_sddmm16(arrays, meta, X, Y) -> np.ndarray:
    m, BW, nnz, dtype = int(meta["m"]), int(meta["BW"]), int(meta["nnz"]), str(meta["dtype"])
    X, Y = np.asarray(X, dtype=np.float64), np.asarray(Y, dtype=np.float64)
    K = X.shape[1]
    win = np.asarray(arrays["blk_win"], dtype=np.int64)
    nblk = win.size
    cols = np.asarray(arrays["blk_cols"], dtype=np.int64).reshape(nblk, BW)
    row_ids = np.asarray(arrays["row_ids"], dtype=np.int64)
    Kp = -(-K // 64) * 64
    Xp = np.zeros((m + 1, Kp))
    Xp[:m, :K] = X[row_ids]
    Yp = np.zeros((Y.shape[0] + 1, Kp))
    Yp[:-1, :K] = Y
    rows = win[:, None] * 16 + np.arange(16)
    xr = np.where(rows < m, rows, m)
    yc = np.where(cols < 0, Y.shape[0], cols)
    ar, ac = a_frag_layout("fp16")
    brow = b_frag_rows("fp16")
    C = np.zeros((nblk, 16, BW))
    for kc in range(0, Kp, 64):
        for j in range(4):
            # k index 2t + e <-> feature kc + 8t + 2j + e (q = 0); 2t + 8 + e <-> kc + 32 + 8t + 2j + e
            feat = np.zeros(16, dtype=np.int64)
            for t in range(4):
                for e in range(2):
                    feat[2 * t + e] = kc + 8 * t + 2 * j + e
                    feat[2 * t + 8 + e] = kc + 32 + 8 * t + 2 * j + e
            Aop = np.zeros((nblk, 16, 16))
            Aop[:, ar, ac] = Xp[xr[:, ar], feat[ac]]
            for n0 in range(0, BW, 8):
                Bop = np.zeros((nblk, 16, 8))
                for e in range(brow.shape[1]):
                    Bop[:, brow[:, e], _G] = Yp[yc[:, n0 + _G], feat[brow[:, e]]]
                C[:, :, n0:n0 + 8] += Aop @ Bop
    out = np.full(nnz, np.nan)
    ptr = np.asarray(arrays["nz_ptr"], dtype=np.int64)
    blk = np.repeat(np.arange(nblk), np.diff(ptr))
    vals = (np.asarray(arrays["nz_val"], dtype=np.float32).astype(np.float64) *
            C.reshape(nblk, -1)[blk, arrays["nz_pos"].astype(np.int64)])
    out[np.asarray(arrays["nz_out"], dtype=np.int64)] = round_to(vals, dtype)
    return out


class TcSddmmKernel(_NvccKernel):
    def prepare(self):
        fns = self._load_functions()
        p, meta = self.params, self.meta
        K, m = int(meta["K"]), int(meta["m"])
        nblk = int(self.arrays["blk_win"].size)
        W = int(p["warps_per_block"])
        dev = self._upload(("blk_win", "blk_cols", "nz_ptr", "nz_pos", "nz_val", "nz_out", "row_ids"))
        args = list(dev) + [None, None, None, np.int32(nblk), np.int32(m), np.int32(K)]
        grid, block = (max(1, -(-nblk // W)), 1, 1), (32 * W, 1, 1)
        self._launches = [rt.Launch(f, grid, block, args) for f in (fns[0], fns[-1])]
        self._amask = 15 if int(meta["vec"]) > 1 else 0
        self._empty = nblk == 0
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        x, y = in_ptrs
        self._launches[1 if (x | y) & self._amask else 0]((x, y, out_ptr), stream)


@register_template
class TcWmmaSgtSddmm(_NvccTemplate):
    """TC-GNN (ATC'23) tensor-core SDDMM on SGT blocks: per TC block the 16 x BW block of
    X[window rows] @ Y[block columns]^T with mma.sync (tf32 m16n8k8; fp16 / bf16 m16n8k16 as
    options; fp32 accumulate), sampled at the block's stored nonzeros and scaled by A's values,
    written in the caller's nonzero order.  Tunable: warps per block, feature chunks in flight,
    precision; the SGT block width comes from the pipeline (16x16 as the paper, or 16x8).  X / Y /
    output in float32 or float16 / bfloat16 (16-bit: the loaded values are the MMA operands,
    precision = the input type, 64-feature chunks, each output rounded once)."""

    name = "tc.wmma_sgt_sddmm"
    precision_param = "precision"
    version = "2"
    dtypes = ("float32", "float16", "bfloat16")
    priority = 10
    ops = (("sddmm", None),)
    format = "sgt"
    source_file = "tc_wmma_sddmm.cu"
    headers = ("tc_frag.cuh",)
    instance_macro = "SPC_TC_SDDMM_INSTANCE"

    def requires(self, mod):
        return ("sgt",)


    def supports(self, mod):
        if not super().supports(mod):
            return False
        fmt = mod.formats["sgt"]
        bws = (16,) if mod.op.dtype != "float32" else (8, 16)
        return fmt.BLK_H == 16 and fmt.BLK_W in bws and fmt.num_blocks < 2**31 // 256

    _allowed_precisions = staticmethod(TcWmmaSgt._allowed_precisions)

    def _precisions(self, mod) -> list[str]:
        fmt = mod.formats.get("sgt")
        bw = fmt.BLK_W if fmt is not None else 16
        return [p for p in self._allowed_precisions(mod.op.dtype) if p == "tf32" or bw % 16 == 0]

    def check_params(self, mod, params):
        full = super().check_params(mod, params)
        input_type(mod.op.dtype, str(full["precision"]))     # 16-bit inputs: their own precision only
        return full

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution as C

        return {"warps_per_block": C([2, 4, 8]), "k_unroll": C([1, 2]),
                "precision": C(self._allowed_precisions(mod.op.dtype))}

    def default_params(self, mod):
        chunk = 32 if mod.op.dtype == "float32" else 64
        return {"warps_per_block": 4, "k_unroll": 2 if mod.op.K > chunk else 1,
                "precision": self._allowed_precisions(mod.op.dtype)[0]}

    def seed_params(self, mod):
        d = self.default_params(mod)
        seeds = [d, {**d, "k_unroll": 3 - d["k_unroll"]}, {**d, "warps_per_block": 8}, {**d, "warps_per_block": 2}]
        seeds += [{**d, "precision": p} for p in self._precisions(mod)]
        return unique_params(seeds)

    def instances(self, precision: str, BW: int, ku: int, vec: int, ti: int = 0) -> list:
        P = PRECISIONS[precision].code
        name = lambda v: f"tc_sddmm_p{P}_bw{BW}_k{ku}_v{v}" + ("_x16" if ti else "")  # noqa: E731
        inst = [(name(vec), (P, BW, ku, vec, ti))]
        if vec > 1:
            inst.append((name(1), (P, BW, ku, 1, ti)))
        return inst

    def build(self, mod: SparseModule, params: Mapping[str, Any]):
        params = self.check_params(mod, params)
        dtype = mod.op.dtype
        if dtype not in self.dtypes:
            raise ValueError(f"tc.wmma_sgt_sddmm supports dtypes {list(self.dtypes)}, not {dtype!r}")
        if "sgt" not in mod.formats or not self.supports(mod):
            raise ValueError("tc.wmma_sgt_sddmm needs a 16-row SGT format (run tile.sgt first; 16-bit inputs "
                             "need 16-wide blocks)")
        fmt = mod.formats["sgt"]
        prec, W, ku = str(params["precision"]), int(params["warps_per_block"]), int(params["k_unroll"])
        if prec not in PRECISIONS or (prec != "tf32" and fmt.BLK_W % 16):
            raise ValueError(f"precision {prec!r} needs 16-wide SGT blocks, got BLK_W={fmt.BLK_W}")
        ti = input_type(dtype, prec)
        if W not in (1, 2, 4, 8) or ku not in (1, 2):
            raise ValueError(f"invalid tc.wmma_sgt_sddmm parameters {params}")
        arch = rt.device_arch()
        if arch < 80:
            raise ValueError("tc.wmma_sgt_sddmm needs sm_80 or newer")
        K = mod.op.K
        vec = _vec(K, ti)
        arrays = sddmm_arrays(mod)
        inst = self.instances(prec, fmt.BLK_W, ku, vec, ti)
        path = self.compile(inst, arch=arch, name=inst[0][0])
        meta = {"K": K, "m": mod.A.shape[0], "nnz": int(mod.A.nnz), "BW": fmt.BLK_W, "vec": vec,
                "precision": prec, "arch": arch, "dtype": dtype,
                "instances": [[n, list(a)] for n, a in inst]}
        return TcSddmmKernel(self.name, params, arrays, {"kernel.fatbin": path}, meta, self)

    def load(self, params, arrays, files, meta):
        return TcSddmmKernel(self.name, params, arrays, files, meta, self)
