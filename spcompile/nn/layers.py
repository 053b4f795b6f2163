"""PyG-style layers on the spcompile ops: :class:`GCNConv` and :class:`GATConv`.

Both take ``forward(x, graph)`` where ``graph`` is either a prepared :class:`SparseGraph` (made
with :func:`~spcompile.nn.gcn_norm` / :func:`~spcompile.nn.gat_graph`; the form
``torch.compile(fullgraph=True)`` traces) or what PyG layers take -- an ``edge_index`` (2 x E,
messages ``edge_index[0] -> edge_index[1]``) or a sparse adjacency (rows: targets) -- prepared
on the first call and cached by the layer while the same object is passed (like PyG's
``cached=True``: the graph must not change in place).
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from .functional import gat_graph, gcn_norm, spmm
from .gat import gat_aggregate
from .graph import SparseGraph

__all__ = ["GCNConv", "GATConv"]


def _glorot(t: torch.Tensor) -> None:
    """Uniform in +-sqrt(6 / (fan_in + fan_out)) over the last two dimensions (Glorot & Bengio)."""
    a = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        t.uniform_(-a, a)


class _GraphCache:
    """The graph a layer prepared from the last edge_index / adjacency object it was given."""

    def __init__(self):
        self._src = None
        self._graph = None

    def __getstate__(self):      # pickled / copied layers prepare their graph again
        return {}

    def __setstate__(self, state):
        self._src = self._graph = None

    def get(self, obj, make):
        src = self._src() if self._src is not None else None
        if src is not obj or self._graph is None:
            g = make(obj)
            try:
                self._src = weakref.ref(obj)
            except TypeError:    # objects that take no weak reference are not cached
                self._src = None
                return g
            self._graph = g
        return self._graph


def _on(graph: SparseGraph, x: torch.Tensor) -> SparseGraph:
    if graph.device != x.device:
        graph.to(x.device)
    return graph


class GCNConv(nn.Module):
    """``out = D^-1/2 (A + I) D^-1/2 (x W^T) + b`` -- PyG's ``GCNConv`` (Kipf & Welling): a linear
    map without bias, aggregation over in-edges with the symmetric normalisation and self loops,
    then the bias.  ``build_options`` go to :func:`spcompile.build` for the graph's modules."""

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True, add_self_loops: bool = True,
                 **build_options: Any):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.add_self_loops = add_self_loops
        self.build_options = build_options
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self._cache = _GraphCache()
        self.reset_parameters()

    def reset_parameters(self):
        _glorot(self.lin.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def graph(self, edge_index, num_nodes: int | None = None) -> SparseGraph:
        """The normalised propagation graph of ``edge_index`` (cached for the same object)."""
        return self._cache.get(edge_index, lambda e: gcn_norm(e, num_nodes, add_self_loops=self.add_self_loops,
                                                              **self.build_options))

    def forward(self, x: torch.Tensor, graph, edge_weight=None) -> torch.Tensor:
        if not isinstance(graph, SparseGraph):
            if edge_weight is not None:
                graph = gcn_norm(graph, x.shape[0], edge_weight, self.add_self_loops, **self.build_options)
            else:
                graph = self.graph(graph, x.shape[0])
        graph = _on(graph, x)
        out = spmm(graph, self.lin(x))
        if self.bias is not None:
            out = out + self.bias
        return out

    def __repr__(self):
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels})"


class GATConv(nn.Module):
    """PyG's ``GATConv`` (Velickovic et al.): ``h = x W^T`` split into ``heads`` x
    ``out_channels``; per edge ``j -> i`` and head, ``e = LeakyReLU(<h_j, a_src> + <h_i, a_dst>)``;
    ``alpha`` = softmax of e over each target's in-edges (self loops included); ``out_i =
    sum_j alpha_ij h_j``, all heads in one fused op (:func:`~spcompile.nn.gat.gat_aggregate`:
    logits, softmax and aggregation in one pass, CUDA kernels on a GPU); heads concatenated (or
    averaged, ``concat=False``); plus the bias.  No attention dropout."""

    def __init__(self, in_channels: int, out_channels: int, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, add_self_loops: bool = True, bias: bool = True,
                 **build_options: Any):
        super().__init__()
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.concat, self.negative_slope, self.add_self_loops = concat, negative_slope, add_self_loops
        self.build_options = build_options
        self.lin = nn.Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        self.bias = nn.Parameter(torch.empty(heads * out_channels if concat else out_channels)) if bias else None
        self._cache = _GraphCache()
        self.reset_parameters()

    def reset_parameters(self):
        _glorot(self.lin.weight)
        _glorot(self.att_src)
        _glorot(self.att_dst)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def graph(self, edge_index, num_nodes: int | None = None) -> SparseGraph:
        """The attention pattern of ``edge_index`` (cached for the same object)."""
        return self._cache.get(edge_index, lambda e: gat_graph(e, num_nodes, add_self_loops=self.add_self_loops,
                                                               **self.build_options))

    def forward(self, x: torch.Tensor, graph) -> torch.Tensor:
        if not isinstance(graph, SparseGraph):
            graph = self.graph(graph, x.shape[0])
        graph = _on(graph, x)
        N, H, C = x.shape[0], self.heads, self.out_channels
        h = self.lin(x).view(N, H, C)
        a_src = (h * self.att_src).sum(-1)          # N x H
        a_dst = (h * self.att_dst).sum(-1)
        out = gat_aggregate(graph, h, a_src, a_dst, self.negative_slope)   # N x H x C, h's dtype
        out = out.reshape(N, H * C) if self.concat else out.mean(dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out

    def __repr__(self):
        return f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"
