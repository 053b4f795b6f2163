r"""Fused multi-head GAT aggregation: ``torch.ops.spcompile.gat_aggregate`` (a
:func:`torch.library.custom_op` with fake shape functions and an autograd formula, so
``torch.compile(fullgraph=True)`` traces it) and :func:`gat_aggregate`, what
:class:`~spcompile.nn.GATConv` calls once for all its heads.

For a graph ``A`` (rows: targets i, columns: sources j; :func:`~spcompile.nn.gat_graph` adds
the self loops), ``h`` (``n_cols x H x C``), ``a_src`` (``n_cols x H``), ``a_dst``
(``n_rows x H``) and every row i and head k::

    z_ij = a_src[j, k] + a_dst[i, k],   e_ij = leaky_relu(z_ij, negative_slope)
    alpha_ij = softmax over row i's entries j of e_ij
    out[i, k, :] = sum_j alpha_ij h[j, k, :]          (empty rows: 0)

The op returns ``(out, lse)``, ``lse[i, k] = log sum_j exp(e_ij)`` (-inf for an empty row; not
differentiable), which the backward uses to recompute ``alpha`` without storing it.  Backward,
with ``dalpha_ij = <dout_i, h_j>`` and ``D_ik = <dout_i, out_i>``: ``dz_ij = alpha_ij (dalpha_ij -
D_ik) leaky_relu'(z_ij)`` (``leaky_relu'(z) = 1`` for ``z > 0``, else ``negative_slope``),
``da_dst[i] = sum_j dz_ij``, ``da_src[j] = sum_i dz_ij``, ``dh[j] = sum_i alpha_ij dout_i``.
Second derivatives are not supported.

Two implementations of the same formulas:

* **CUDA** (float32 / float16 / bfloat16 ``h`` on a GPU, through the kernels of ``gat.cu``,
  compiled with nvcc for the device's arch and cached on disk): the forward is one pass with an
  online softmax (plus a merge kernel when some row is longer than a segment); the backward is
  ``D`` (one kernel), one pass over the *transposed* graph that gives ``dh``, ``da_src`` and the
  per-entry ``dz`` (plus a merge kernel for split columns), and a row sum of ``dz`` for
  ``da_dst``.  No atomics (results are deterministic), no host synchronisation, allocations
  through torch's caching allocator only, launches on torch's current stream: capturable in a
  CUDA graph once a first call has built the launch plans.  Index arrays are int32, built once
  per graph (and segment length) and kept on the graph (:meth:`SparseGraph.cached`), as are the
  launch plans per (device, dtype, H, C, slope, vector width).  ``a_src`` / ``a_dst`` are read
  in float32 (converted when given in 16 bits); ``h``, ``out``, ``dh`` in ``h``'s dtype; every
  sum in float32.
* **Composite** (everything else: CPU tensors, float64, graphs whose entries do not fit int32,
  an empty graph, a machine without a usable CUDA driver, ``FORCE_COMPOSITE`` /
  ``SPCOMPILE_GAT_COMPOSITE=1``):
  torch ops (``index_select`` / ``index_add`` / ``scatter_reduce``), in float64 for float64
  ``h`` (``torch.autograd.gradcheck`` holds) and in float32 otherwise.

Outputs: ``out`` in ``h``'s dtype, ``lse`` in float32 (float64 for float64 ``h``); gradients in
each input's dtype.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import torch

from ..runtime import cuda as rt
from .graph import SparseGraph, graph_by_id
from .ops import _check_graph_device, _compute

__all__ = ["gat_aggregate", "gat_aggregate_op", "gat_aggregate_backward_op", "GatAggregateFunction", "config",
           "segment_length", "render", "instance_suffix", "source_text", "uses_cuda", "partition"]

SOURCE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gat.cu")
#: torch dtype of h -> (template code TN, kernel-name suffix)
DTYPES = {torch.float32: (0, "f32"), torch.float16: (1, "f16"), torch.bfloat16: (2, "bf16")}
#: template code TN -> the C++ element type
CTYPES = {0: "float", 1: "__half", 2: "__nv_bfloat16"}
THREADS = 256
#: a segment holds at most max(MIN_SEGMENT, SEGMENT_BATCHES * G) entries (G: lanes per group)
SEGMENT_BATCHES = 8
MIN_SEGMENT = 64
#: True: every call takes the composite implementation (tests, comparisons)
FORCE_COMPOSITE = bool(os.environ.get("SPCOMPILE_GAT_COMPOSITE"))


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Every buffer the CUDA path allocates (a hook for tests that poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


# -- kernel configuration -----------------------------------------------------------------------
def config(C: int, itemsize: int, vec_max: int = 16) -> tuple[int, int, int]:
    """``(VEC, G, CH)`` for rows of ``C`` elements of ``itemsize`` bytes: the widest vector load (at
    most 16 bytes and ``vec_max`` elements) that divides C while leaving at least min(8, C) lanes,
    G = lanes per group (a power of two up to 32), CH = vector chunks per lane (the tile is
    G * VEC * CH <= 512 columns wide; wider rows run in column tiles)."""
    C = int(C)
    vec = min(16 // itemsize, int(vec_max))
    while vec > 1 and (C % vec or C // vec < min(8, C)):
        vec //= 2
    lanes = -(-C // vec)
    G = 1
    while G < min(lanes, 32):
        G *= 2
    CH = max(1, min(-(-lanes // G), 16 // vec))
    return vec, G, CH


def segment_length(G: int) -> int:
    """Entries per segment for groups of ``G`` lanes (longer rows are split)."""
    return max(MIN_SEGMENT, SEGMENT_BATCHES * int(G))


def source_text() -> str:
    with open(SOURCE_FILE) as f:
        return f.read()


def instance_suffix(tn: int, vec: int, G: int, CH: int) -> str:
    short = {code: s for code, s in DTYPES.values()}[int(tn)]
    return f"{short}_v{int(vec)}_g{int(G)}_c{int(CH)}"


def render(instances) -> str:
    """``gat.cu`` plus the extern "C" kernels of every ``(TN, VEC, G, CH)`` in ``instances`` (and
    the merge kernels of each TN once)."""
    instances = list(dict.fromkeys((int(a), int(b), int(c), int(d)) for a, b, c, d in instances))
    shorts = {code: s for code, s in DTYPES.values()}
    lines = [source_text(), ""]
    lines += [f"SPC_GAT_MERGE({shorts[tn]}, {CTYPES[tn]})" for tn in sorted({i[0] for i in instances})]
    lines += [f"SPC_GAT_INSTANCE({instance_suffix(*i)}, {CTYPES[i[0]]}, {i[1]}, {i[2]}, {i[3]})" for i in instances]
    return "\n".join(lines) + "\n"


_KERNELS: dict = {}
_KERNELS_LOCK = threading.Lock()


def _kernels(tn: int, vec: int, G: int, CH: int, device_index: int) -> dict:
    """name -> (function, signature) of the kernels of one instance on a device (compiled and
    loaded once)."""
    key = (tn, vec, G, CH, device_index)
    got = _KERNELS.get(key)
    if got is not None:
        return got
    with _KERNELS_LOCK:
        got = _KERNELS.get(key)
        if got is None:
            sfx = instance_suffix(tn, vec, G, CH)
            short = sfx.split("_")[0]
            src = render([(tn, vec, G, CH)])
            names = {"fwd": f"gat_fwd_{sfx}", "dot": f"gat_dot_{sfx}", "bwd_col": f"gat_bwd_col_{sfx}",
                     "fwd_merge": f"gat_fwd_merge_{short}", "sum_merge": f"gat_sum_merge_{short}",
                     "row_sum": "gat_row_sum"}
            path = rt.compile_cuda(src, arch=rt.device_arch(device_index), name=f"gat_{sfx}")
            mod = rt.load_module(path, device_index)
            got = {k: (mod.get_function(n), rt.kernel_signature(src, n)) for k, n in names.items()}
            _KERNELS[key] = got
    return got


# -- per-graph arrays ---------------------------------------------------------------------------
def partition(indptr: np.ndarray, S: int) -> dict:
    """Rows of a CSR ``indptr`` cut into segments of at most ``S`` entries (balanced slices of a
    row; an empty row is one empty segment).  ``seg_ptr`` (nseg + 1), ``seg_row``; ``seg_slot``: -1
    for a segment that is a whole row, else its partial-result slot; the split rows
    ``split_row`` with their slots ``split_ptr[r]:split_ptr[r + 1]`` (consecutive, in order)."""
    indptr = np.asarray(indptr, np.int64)
    n = indptr.size - 1
    lens = np.diff(indptr)
    ns = np.maximum(1, -(-lens // int(S)))
    seg_row = np.repeat(np.arange(n, dtype=np.int64), ns)
    first = np.cumsum(ns) - ns
    kk = np.arange(seg_row.size, dtype=np.int64) - first[seg_row]
    lo = indptr[seg_row] + (kk * lens[seg_row]) // ns[seg_row]
    seg_ptr = np.append(lo, indptr[-1])
    split = ns[seg_row] > 1
    seg_slot = np.full(seg_row.size, -1, np.int64)
    seg_slot[split] = np.arange(int(split.sum()))
    split_row = np.flatnonzero(ns > 1)
    split_ptr = np.concatenate([[0], np.cumsum(ns[split_row])]).astype(np.int64)
    return {"seg_ptr": seg_ptr, "seg_row": seg_row, "seg_slot": seg_slot, "split_row": split_row,
            "split_ptr": split_ptr}


class _Arrays:
    """The int32 device arrays of a graph for one segment length: A's indptr / indices and
    segments, its transpose's indices (the target rows), ``tperm`` and segments."""

    def __init__(self, g: SparseGraph, device, S: int):
        C = g.csr
        indptr = np.asarray(C.indptr, np.int64)
        T = g.transpose()
        t_indptr = np.asarray(T.csr.indptr, np.int64)
        fw, bw = partition(indptr, S), partition(t_indptr, S)
        host = {"indptr": indptr, "indices": np.asarray(C.indices, np.int64),
                "t_idx": np.asarray(T.csr.indices, np.int64), "t_perm": np.asarray(g._tperm_np, np.int64)}
        host.update({k: v for k, v in fw.items()})
        host.update({"t_" + k: v for k, v in bw.items()})
        self.t = {k: torch.from_numpy(np.ascontiguousarray(v, np.int32)).to(device) for k, v in host.items()}
        self.ptr = {k: int(v.data_ptr()) for k, v in self.t.items()}
        self.nseg, self.nsplit, self.nslots = fw["seg_row"].size, fw["split_row"].size, int(fw["split_ptr"][-1])
        self.tnseg, self.tsplit, self.tslots = bw["seg_row"].size, bw["split_row"].size, int(bw["split_ptr"][-1])


def _fits_int32(g: SparseGraph) -> bool:
    return g.nnz < 2**31 - 1 and max(g.shape) < 2**31 - 1


# -- launch plans -------------------------------------------------------------------------------
def _blocks(threads: int) -> int:
    return max(1, -(-int(threads) // THREADS))


class _Plans:
    """Every launch of one (graph, device, dtype, H, C, slope, vector width): built once."""

    def __init__(self, g: SparseGraph, device, dtype, H: int, C: int, slope: float, vec_max: int):
        tn, _ = DTYPES[dtype]
        itemsize = dtype.itemsize
        vec, G, CH = config(C, itemsize, vec_max)
        self.vec = vec
        A = g.cached(("gat.arrays", str(device), segment_length(G)),
                     lambda: _Arrays(g, device, segment_length(G)))
        self.arrays = A
        k = _kernels(tn, vec, G, CH, device.index)
        n_rows = g.shape[0]
        tiles = -(-C // (G * vec * CH))
        block = (THREADS, 1, 1)
        p = A.ptr

        def plan(name, grid, bound, per_call):
            fn, sig = k[name]
            return rt.LaunchPlan(fn, sig, grid, block, 0, bound=bound, per_call=per_call)

        self.fwd = plan("fwd", (_blocks(A.nseg * H * G), tiles, 1),
                        {"seg_ptr": p["seg_ptr"], "seg_row": p["seg_row"], "seg_slot": p["seg_slot"],
                         "indices": p["indices"], "nseg": A.nseg, "H": H, "C": C, "slope": slope},
                        ("h", "a_src", "a_dst", "out", "lse", "part_acc", "part_ml"))
        self.fwd_merge = None if not A.nsplit else plan(
            "fwd_merge", (_blocks(A.nsplit * H * 32), 1, 1),
            {"split_ptr": p["split_ptr"], "split_row": p["split_row"], "nsplit": A.nsplit, "H": H, "C": C},
            ("part_acc", "part_ml", "out", "lse"))
        self.dot = plan("dot", (_blocks(n_rows * H * G), 1, 1), {"nrows": n_rows * H, "C": C}, ("dout", "out", "D"))
        self.bwd_col = plan("bwd_col", (_blocks(A.tnseg * H * G), tiles, 1),
                            {"tseg_ptr": p["t_seg_ptr"], "tseg_row": p["t_seg_row"], "tseg_slot": p["t_seg_slot"],
                             "t_idx": p["t_idx"], "t_perm": p["t_perm"], "nseg": A.tnseg, "H": H, "C": C,
                             "slope": slope},
                            ("h", "a_src", "a_dst", "lse", "D", "dout", "dh", "da_src", "dz", "part_acc", "part_s"))
        self.sum_merge = None if not A.tsplit else plan(
            "sum_merge", (_blocks(A.tsplit * H * 32), 1, 1),
            {"split_ptr": p["t_split_ptr"], "split_row": p["t_split_row"], "nsplit": A.tsplit, "H": H, "C": C},
            ("part_acc", "part_s", "dh", "da_src"))
        self.row_sum = plan("row_sum", (_blocks(n_rows * 32), 1, 1), {"indptr": p["indptr"], "nrows": n_rows, "H": H},
                            ("dz", "da_dst"))


def _plans(g: SparseGraph, device, dtype, H: int, C: int, slope: float, vec_max: int) -> _Plans:
    return g.cached(("gat.plans", str(device), dtype, H, C, float(slope), vec_max),
                    lambda: _Plans(g, device, dtype, H, C, float(slope), vec_max))


def _aligned(nbytes: int, *ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % nbytes == 0 for t in ts)


def _vec_max(C: int, dtype, *ts: torch.Tensor) -> int:
    """16 when the tensors' pointers allow the vector width :func:`config` picks, else 1."""
    itemsize = dtype.itemsize
    vec = config(C, itemsize)[0]
    return 16 if _aligned(vec * itemsize, *ts) else 1


_CUDA_RUNTIME: list = []


def _cuda_runtime() -> bool:
    """Whether the kernels can be loaded here (the CUDA driver with a GPU); checked once."""
    if not _CUDA_RUNTIME:
        from ..runtime import driver

        _CUDA_RUNTIME.append(driver.device_count() > 0)
    return _CUDA_RUNTIME[0]


def uses_cuda(g: SparseGraph, h: torch.Tensor) -> bool:
    """Whether a call with ``h`` on graph ``g`` runs the CUDA kernels (else the composite)."""
    return (not FORCE_COMPOSITE and h.device.type == "cuda" and h.dtype in DTYPES and g.nnz > 0
            and h.shape[1] > 0 and h.shape[2] > 0 and _fits_int32(g) and _cuda_runtime())


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _on_device(launch, dev, *args):
    """``launch(*args, stream)`` with ``dev`` the current device and its current stream."""
    if dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            return launch(*args, torch.cuda.current_stream(dev).cuda_stream)
    return launch(*args, torch.cuda.current_stream(dev).cuda_stream)


def _cuda_forward(g, h, a_src, a_dst, slope):
    return _on_device(_launch_forward, h.device, g, h, a_src, a_dst, slope)


def _launch_forward(g, h, a_src, a_dst, slope, stream):
    """The forward's launches on ``stream`` (raw handle) into buffers on ``h``'s device."""
    dev = h.device
    n, H, C = g.shape[0], h.shape[1], h.shape[2]
    h = h.contiguous()
    a_src = a_src.to(torch.float32).contiguous()
    a_dst = a_dst.to(torch.float32).contiguous()
    P = _plans(g, dev, h.dtype, H, C, slope, _vec_max(C, h.dtype, h))
    A = P.arrays
    out = _alloc((n, H, C), h.dtype, dev)
    lse = _alloc((n, H), torch.float32, dev)
    pa = _alloc((A.nslots * H * C,), torch.float32, dev) if A.nslots else None
    pml = _alloc((A.nslots * H * 2,), torch.float32, dev) if A.nslots else None
    P.fwd((h.data_ptr(), a_src.data_ptr(), a_dst.data_ptr(), out.data_ptr(), lse.data_ptr(), _ptr(pa), _ptr(pml)),
          stream)
    if P.fwd_merge is not None:
        P.fwd_merge((pa.data_ptr(), pml.data_ptr(), out.data_ptr(), lse.data_ptr()), stream)
    return out, lse


def _cuda_backward(g, dout, h, a_src, a_dst, out, lse, slope):
    return _on_device(_launch_backward, h.device, g, dout, h, a_src, a_dst, out, lse, slope)


def _launch_backward(g, dout, h, a_src, a_dst, out, lse, slope, stream):
    """The backward's launches on ``stream`` (raw handle) into buffers on ``h``'s device."""
    dev = h.device
    n, m, H, C = g.shape[0], g.shape[1], h.shape[1], h.shape[2]
    h = h.contiguous()
    dout = dout.to(h.dtype).contiguous()
    out = out.to(h.dtype).contiguous()
    lse = lse.to(torch.float32).contiguous()
    as32 = a_src.to(torch.float32).contiguous()
    ad32 = a_dst.to(torch.float32).contiguous()
    P = _plans(g, dev, h.dtype, H, C, slope, _vec_max(C, h.dtype, h, dout, out))
    A = P.arrays
    f32 = torch.float32
    D = _alloc((n, H), f32, dev)
    dz = _alloc((g.nnz * H,), f32, dev)
    dh = _alloc((m, H, C), h.dtype, dev)
    da_src = _alloc((m, H), f32, dev)
    da_dst = _alloc((n, H), f32, dev)
    pa = _alloc((A.tslots * H * C,), f32, dev) if A.tslots else None
    ps = _alloc((A.tslots * H,), f32, dev) if A.tslots else None
    P.dot((dout.data_ptr(), out.data_ptr(), D.data_ptr()), stream)
    P.bwd_col((h.data_ptr(), as32.data_ptr(), ad32.data_ptr(), lse.data_ptr(), D.data_ptr(), dout.data_ptr(),
               dh.data_ptr(), da_src.data_ptr(), dz.data_ptr(), _ptr(pa), _ptr(ps)), stream)
    if P.sum_merge is not None:
        P.sum_merge((pa.data_ptr(), ps.data_ptr(), dh.data_ptr(), da_src.data_ptr()), stream)
    P.row_sum((dz.data_ptr(), da_dst.data_ptr()), stream)
    return dh, da_src, da_dst


# -- the composite implementation ---------------------------------------------------------------
def _index(g: SparseGraph, device):
    _check_graph_device(g, device)
    return g.rows, g.cols


def _composite_forward(g, h, a_src, a_dst, slope):
    rows, cols = _index(g, h.device)
    ct = _compute(h)
    n, H, C = g.shape[0], h.shape[1], h.shape[2]
    z = a_src.to(ct).index_select(0, cols) + a_dst.to(ct).index_select(0, rows)      # nnz x H
    e = torch.nn.functional.leaky_relu(z, slope)
    mx = torch.full((n, H), float("-inf"), dtype=ct, device=h.device).scatter_reduce(
        0, rows[:, None].expand(-1, H), e, "amax", include_self=True)
    ex = (e - mx.index_select(0, rows)).exp()
    den = torch.zeros((n, H), dtype=ct, device=h.device).index_add(0, rows, ex)
    alpha = ex / den.index_select(0, rows)
    out = torch.zeros((n, H, C), dtype=ct, device=h.device).index_add(
        0, rows, alpha[:, :, None] * h.to(ct).index_select(0, cols))
    return out.to(h.dtype), mx + den.log()


def _composite_backward(g, dout, h, a_src, a_dst, out, lse, slope, need_h, need_src, need_dst):
    rows, cols = _index(g, h.device)
    ct = _compute(h)
    n, m, H, C = g.shape[0], g.shape[1], h.shape[1], h.shape[2]
    z = a_src.to(ct).index_select(0, cols) + a_dst.to(ct).index_select(0, rows)
    zf = torch.where(z > 0, torch.ones((), dtype=ct, device=z.device), torch.full((), slope, dtype=ct, device=z.device))
    alpha = (z * zf - lse.to(ct).index_select(0, rows)).exp()
    dout_r = dout.to(ct).index_select(0, rows)                                         # nnz x H x C
    dh = da_src = da_dst = None
    if need_h:
        dh = torch.zeros((m, H, C), dtype=ct, device=h.device).index_add(0, cols, alpha[:, :, None] * dout_r)
    if need_src or need_dst:
        dal = (dout_r * h.to(ct).index_select(0, cols)).sum(-1)
        D = (dout.to(ct) * out.to(ct)).sum(-1)
        dz = alpha * (dal - D.index_select(0, rows)) * zf
        if need_src:
            da_src = torch.zeros((m, H), dtype=ct, device=h.device).index_add(0, cols, dz)
        if need_dst:
            da_dst = torch.zeros((n, H), dtype=ct, device=h.device).index_add(0, rows, dz)
    return dh, da_src, da_dst


# -- the ops --------------------------------------------------------------------------------------
def _check(g: SparseGraph, h, a_src, a_dst):
    if h.dim() != 3 or h.shape[0] != g.shape[1]:
        raise ValueError(f"h has shape {tuple(h.shape)}, expected ({g.shape[1]}, heads, C) for a graph of "
                         f"shape {g.shape}")
    H = h.shape[1]
    if tuple(a_src.shape) != (g.shape[1], H) or tuple(a_dst.shape) != (g.shape[0], H):
        raise ValueError(f"a_src, a_dst have shapes {tuple(a_src.shape)}, {tuple(a_dst.shape)}; expected "
                         f"({g.shape[1]}, {H}) and ({g.shape[0]}, {H})")
    for name, t in (("h", h), ("a_src", a_src), ("a_dst", a_dst)):
        if t.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(f"gat_aggregate: {name} must be float32, float64, float16 or bfloat16, got {t.dtype}")
        if t.device != h.device:
            raise ValueError(f"gat_aggregate: {name} is on {t.device}, h on {h.device}")


def _forward(g: SparseGraph, h, a_src, a_dst, slope: float):
    _check(g, h, a_src, a_dst)
    h, a_src, a_dst = h.detach(), a_src.detach(), a_dst.detach()
    if uses_cuda(g, h):
        return _cuda_forward(g, h, a_src, a_dst, float(slope))
    return _composite_forward(g, h, a_src, a_dst, float(slope))


def _backward(g: SparseGraph, dout, h, a_src, a_dst, out, lse, slope, need_h, need_src, need_dst):
    h, a_src, a_dst, dout = h.detach(), a_src.detach(), a_dst.detach(), dout.detach()
    try:
        if uses_cuda(g, h):
            dh, ds, dd = _cuda_backward(g, dout, h, a_src, a_dst, out.detach(), lse.detach(), float(slope))
        else:
            dh, ds, dd = _composite_backward(g, dout, h, a_src, a_dst, out.detach(), lse.detach(), float(slope),
                                             need_h, need_src, need_dst)
    except (RuntimeError, ValueError, TypeError) as e:
        raise RuntimeError(f"spcompile: the gradient of gat_aggregate cannot be computed: {e}") from e
    return ((dh.to(h.dtype) if need_h else h.new_empty((0,))),
            (ds.to(a_src.dtype) if need_src else a_src.new_empty((0,))),
            (dd.to(a_dst.dtype) if need_dst else a_dst.new_empty((0,))))


@torch.library.custom_op("spcompile::gat_aggregate", mutates_args=())
def gat_aggregate_op(h: torch.Tensor, a_src: torch.Tensor, a_dst: torch.Tensor, graph: int,
                     negative_slope: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the fused GAT aggregation on graph ``graph`` (an id)."""
    return _forward(graph_by_id(graph), h, a_src, a_dst, negative_slope)


@gat_aggregate_op.register_fake
def _gat_aggregate_fake(h, a_src, a_dst, graph, negative_slope):
    g = graph_by_id(graph)
    return h.new_empty((g.shape[0], h.shape[1], h.shape[2])), h.new_empty((g.shape[0], h.shape[1]),
                                                                          dtype=_compute(h))


@torch.library.custom_op("spcompile::gat_aggregate_backward", mutates_args=())
def gat_aggregate_backward_op(dout: torch.Tensor, h: torch.Tensor, a_src: torch.Tensor, a_dst: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, graph: int, negative_slope: float,
                              need_h: bool, need_src: bool,
                              need_dst: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh, da_src, da_dst) of ``gat_aggregate``; an empty tensor for a gradient not asked for."""
    return _backward(graph_by_id(graph), dout, h, a_src, a_dst, out, lse, negative_slope,
                     need_h, need_src, need_dst)


@gat_aggregate_backward_op.register_fake
def _gat_aggregate_backward_fake(dout, h, a_src, a_dst, out, lse, graph, negative_slope, need_h, need_src, need_dst):
    return (h.new_empty(tuple(h.shape) if need_h else (0,)), a_src.new_empty(tuple(a_src.shape) if need_src else (0,)),
            a_dst.new_empty(tuple(a_dst.shape) if need_dst else (0,)))


def _setup(ctx, inputs, output):
    h, a_src, a_dst, graph, slope = inputs
    out, lse = output
    ctx.graph, ctx.slope = graph, slope
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(h, a_src, a_dst, out, lse)


def _grads(ctx, dout, dlse):
    h, a_src, a_dst, out, lse = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    dh, ds, dd = torch.ops.spcompile.gat_aggregate_backward(dout, h, a_src, a_dst, out, lse, ctx.graph, ctx.slope,
                                                             *need)
    return (dh if need[0] else None), (ds if need[1] else None), (dd if need[2] else None), None, None


torch.library.register_autograd("spcompile::gat_aggregate", _grads, setup_context=_setup)


class GatAggregateFunction(torch.autograd.Function):
    """The op outside ``torch.compile`` (skips the custom-op dispatch); returns ``out`` only."""

    @staticmethod
    def forward(ctx, h, a_src, a_dst, graph, slope):
        out, lse = _forward(graph_by_id(graph), h, a_src, a_dst, slope)
        ctx.graph, ctx.slope = graph, slope
        ctx.save_for_backward(h, a_src, a_dst, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        h, a_src, a_dst, out, lse = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        dh, ds, dd = _backward(graph_by_id(ctx.graph), dout, h, a_src, a_dst, out, lse, ctx.slope, *need)
        return (dh if need[0] else None), (ds if need[1] else None), (dd if need[2] else None), None, None


def gat_aggregate(graph: SparseGraph, h: torch.Tensor, a_src: torch.Tensor, a_dst: torch.Tensor,
                  negative_slope: float = 0.2) -> torch.Tensor:
    """``out[i, k, :] = sum_j softmax_j(leaky_relu(a_src[j, k] + a_dst[i, k])) h[j, k, :]`` over
    the entries j of each row i of ``graph`` (a :class:`SparseGraph` on ``h``'s device), for every
    head k: ``h`` is ``n_cols x H x C``, ``a_src`` ``n_cols x H``, ``a_dst`` ``n_rows x H``;
    differentiable in all three (see the module's docstring)."""
    if not isinstance(graph, SparseGraph):
        raise TypeError(f"gat_aggregate takes a SparseGraph, got {type(graph).__name__}")
    if torch.compiler.is_compiling():
        return torch.ops.spcompile.gat_aggregate(h, a_src, a_dst, graph.id, float(negative_slope))[0]
    return GatAggregateFunction.apply(h, a_src, a_dst, graph.id, float(negative_slope))
