"""Training graph neural networks through spcompile modules (needs torch).

* :func:`spmm`, :func:`sddmm`: differentiable ops (``torch.ops.spcompile.spmm`` / ``sddmm``,
  registered with ``torch.library.custom_op``: ``torch.compile(fullgraph=True)`` traces them);
* :class:`SparseGraph`: a matrix with its compiled modules (forward, transpose, SDDMM) built once
  per width and dtype, edge values passed at call time;
* :class:`GCNConv`, :class:`GATConv`: PyG-style layers; :func:`gcn_norm`, :func:`gat_graph`,
  :func:`edge_softmax`;
* :func:`gat_aggregate`: GAT's fused multi-head attention aggregation
  (``torch.ops.spcompile.gat_aggregate``: CUDA kernels on a GPU, torch ops elsewhere).
"""
from .graph import SparseGraph
from .functional import as_graph, edge_softmax, gat_graph, gcn_norm, graph_from_edge_index, sddmm, spmm
from .gat import gat_aggregate
from .layers import GATConv, GCNConv

__all__ = ["SparseGraph", "spmm", "sddmm", "edge_softmax", "as_graph", "graph_from_edge_index", "gcn_norm",
           "gat_graph", "gat_aggregate", "GCNConv", "GATConv"]
