"""Functions on graphs: :func:`spmm`, :func:`sddmm` (differentiable), :func:`edge_softmax`, and
the graph preparations of the layers: :func:`graph_from_edge_index`, :func:`gcn_norm`,
:func:`gat_graph`."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..module import CompiledModule
from .graph import SparseGraph
from . import ops  # noqa: F401  (registers torch.ops.spcompile.*)

__all__ = ["spmm", "sddmm", "edge_softmax", "as_graph", "graph_from_edge_index", "gcn_norm", "gat_graph"]


def as_graph(A, **build_options: Any) -> SparseGraph:
    """``A`` as a :class:`SparseGraph`: a graph as is, a compiled module's graph (made once and
    kept on the module), or any sparse input of :func:`spcompile.as_csr`."""
    if isinstance(A, SparseGraph):
        return A
    if isinstance(A, CompiledModule):
        g = getattr(A, "_nn_graph", None)
        if g is None:
            g = A._nn_graph = SparseGraph.from_module(A)
        return g
    return SparseGraph(A, **build_options)


def spmm(A, X: torch.Tensor, values: torch.Tensor | None = None, reduce: str | None = None) -> torch.Tensor:
    """``A @ X`` (or the max / min / mean reduction), differentiable in ``X`` and ``values``.

    ``A``: a :class:`SparseGraph` or a compiled SpMM module (its reduce is the default; the
    module runs the calls it was built for, with its own tuning; the transposed module of the
    backward is built once, on first use).  ``values``: the matrix values for this call (one per
    stored entry, canonical CSR order), e.g. attention weights; None: the matrix's own.

    A module loaded without its matrix (``spcompile.load(path)``) runs forward only: with an
    ``X`` that requires grad it raises, saying how to load it with its matrix."""
    if isinstance(A, CompiledModule):
        if A.op != "spmm":
            raise ValueError(f"spmm needs an op='spmm' module, got op={A.op!r}")
        reduce = reduce or A.reduce
        if A.matrix is None:
            if (X.requires_grad or (values is not None and values.requires_grad)) and torch.is_grad_enabled():
                SparseGraph.from_module(A)   # raises: no matrix, no gradient
            if values is not None:
                return A(X.detach(), values=values.detach())
            return A(X.detach())
    g = as_graph(A)
    if isinstance(A, CompiledModule) and g.device != X.device:
        g.to(X.device)          # a module's graph follows its inputs
    if torch.compiler.is_compiling():
        return torch.ops.spcompile.spmm(X, values, g.id, reduce or "sum")
    return ops.SpmmFunction.apply(X, values, g.id, reduce or "sum")


def sddmm(A, X: torch.Tensor, Y: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """``out[e] = values[e] * <X[row e], Y[col e]>`` over ``A``'s stored entries e (canonical CSR
    order), differentiable in ``X``, ``Y`` and ``values`` (None: the matrix's own values)."""
    if isinstance(A, CompiledModule) and A.op != "sddmm":
        raise ValueError(f"sddmm needs an op='sddmm' module (or a SparseGraph), got op={A.op!r}")
    g = as_graph(A)
    if isinstance(A, CompiledModule) and g.device != X.device:
        g.to(X.device)
    if torch.compiler.is_compiling():
        return torch.ops.spcompile.sddmm(X, Y, values, g.id)
    return ops.SddmmFunction.apply(X, Y, values, g.id)


def edge_softmax(logits: torch.Tensor, graph: SparseGraph) -> torch.Tensor:
    """Softmax of per-entry ``logits`` (nnz or nnz x heads) over each row of ``graph`` (a target
    node's incoming edges); computed in float32 (float64 logits: in float64).  The gathers are
    ``index_select`` calls (their backward is an ``index_add``, cheaper than advanced indexing's)."""
    rows = graph.rows
    e = logits.to(ops._compute(logits))
    shape = (graph.shape[0],) + tuple(e.shape[1:])
    idx = rows.view(-1, *([1] * (e.dim() - 1))).expand_as(e)
    with torch.no_grad():   # the shift cancels in the softmax: no gradient through it
        mx = torch.full(shape, float("-inf"), dtype=e.dtype, device=e.device).scatter_reduce(
            0, idx, e, "amax", include_self=True)
    ex = (e - mx.index_select(0, rows)).exp()
    den = torch.zeros(shape, dtype=e.dtype, device=e.device).index_add(0, rows, ex)
    return ex / den.index_select(0, rows)


# -- graphs from edge lists -------------------------------------------------------------------
def _edges(edge_index, num_nodes: int | None):
    ei = edge_index.detach().cpu().numpy() if isinstance(edge_index, torch.Tensor) else np.asarray(edge_index)
    if ei.ndim != 2 or ei.shape[0] != 2:
        raise ValueError(f"edge_index must have shape (2, E), got {ei.shape}")
    if ei.size and ei.dtype.kind not in "iu":
        raise TypeError(f"edge_index must hold integers, got {ei.dtype}")
    ei = ei.astype(np.int64, copy=False)
    n = int(num_nodes) if num_nodes is not None else (int(ei.max()) + 1 if ei.size else 0)
    if ei.size and (ei.min() < 0 or ei.max() >= n):
        raise ValueError(f"edge_index holds node ids outside [0, {n})")
    return ei[0], ei[1], n


def graph_from_edge_index(edge_index, num_nodes: int | None = None, edge_weight=None,
                          **build_options: Any) -> SparseGraph:
    """The graph of messages ``source -> target`` (PyG's ``flow="source_to_target"``): row =
    target ``edge_index[1]``, column = source ``edge_index[0]``; repeated edges are summed."""
    src, dst, n = _edges(edge_index, num_nodes)
    w = np.ones(src.size, np.float64) if edge_weight is None else _weights(edge_weight, src.size)
    import scipy.sparse as sp

    A = sp.coo_matrix((w, (dst, src)), shape=(n, n)).tocsr()
    A.sum_duplicates()
    return SparseGraph(A, **build_options)


def _weights(edge_weight, E: int) -> np.ndarray:
    w = edge_weight.detach().cpu().double().numpy() if isinstance(edge_weight, torch.Tensor) else \
        np.asarray(edge_weight, np.float64)
    if w.shape != (E,):
        raise ValueError(f"edge_weight has shape {w.shape}, expected ({E},)")
    return w


def gcn_norm(edge_index, num_nodes: int | None = None, edge_weight=None, add_self_loops: bool = True,
             **build_options: Any) -> SparseGraph:
    """GCN's propagation matrix ``D^-1/2 (A + I) D^-1/2`` (Kipf & Welling) as a graph: ``A[i, j]``
    the weight of edge ``j -> i`` (repeated edges summed), a self loop of weight 1 added to every
    node that has none (an existing self loop keeps its weight), ``D`` the row sums (in-degree
    plus the loop).  ``edge_index`` may also be a sparse adjacency (any :func:`spcompile.as_csr`
    input; rows are targets)."""
    import scipy.sparse as sp

    if isinstance(edge_index, torch.Tensor) and not edge_index.is_sparse and edge_index.layout == torch.strided:
        src, dst, n = _edges(edge_index, num_nodes)
        w = np.ones(src.size, np.float64) if edge_weight is None else _weights(edge_weight, src.size)
        A = sp.coo_matrix((w, (dst, src)), shape=(n, n)).tocsr()
    else:
        if edge_weight is not None:
            raise ValueError("edge_weight goes with an edge_index; a sparse adjacency carries its own values")
        from ..core.formats import as_csr

        A = as_csr(edge_index).to_scipy().astype(np.float64)
        if A.shape[0] != A.shape[1]:
            raise ValueError(f"a GCN adjacency must be square, got {A.shape}")
        n = A.shape[0]
    A.sum_duplicates()
    if add_self_loops:
        has = np.zeros(n, bool)
        C = A.tocoo()
        has[C.row[C.row == C.col]] = True
        A = (A + sp.diags((~has).astype(np.float64))).tocsr()
    deg = np.asarray(A.sum(axis=1)).ravel()
    dinv = np.zeros_like(deg)
    np.power(deg, -0.5, out=dinv, where=deg > 0)
    A = sp.diags(dinv) @ A @ sp.diags(dinv)
    A = A.tocsr()
    A.sort_indices()
    return SparseGraph(A.astype(np.float32), **build_options)


def gat_graph(edge_index, num_nodes: int | None = None, add_self_loops: bool = True,
              **build_options: Any) -> SparseGraph:
    """GAT's attention pattern: edges ``source -> target`` (row = target), existing self loops
    removed and one added per node (``add_self_loops``); repeated edges count once.  Values 1."""
    import scipy.sparse as sp

    if isinstance(edge_index, torch.Tensor) and not edge_index.is_sparse and edge_index.layout == torch.strided:
        src, dst, n = _edges(edge_index, num_nodes)
    else:
        from ..core.formats import as_csr

        C = as_csr(edge_index).to_scipy().tocoo()
        dst, src, n = C.row.astype(np.int64), C.col.astype(np.int64), C.shape[0]
    if add_self_loops:
        keep = src != dst
        loops = np.arange(n, dtype=np.int64)
        src, dst = np.concatenate([src[keep], loops]), np.concatenate([dst[keep], loops])
    A = sp.coo_matrix((np.ones(src.size, np.float32), (dst, src)), shape=(n, n)).tocsr()
    A.sum_duplicates()
    A.data[:] = 1.0
    return SparseGraph(A, **build_options)
