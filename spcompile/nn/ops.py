r"""The torch ops: ``torch.ops.spcompile.spmm`` / ``torch.ops.spcompile.sddmm``, registered with
:func:`torch.library.custom_op` (so ``torch.compile(..., fullgraph=True)`` traces them, with
fake-tensor shape functions) and differentiable (:func:`torch.library.register_autograd`).

* ``spmm(X, values, graph, reduce) -> Y``: ``Y = A X`` with ``A``'s stored entries holding
  ``values`` (None: the graph's own values), reduce "sum", "mean", "max" or "min" (empty rows
  give 0).
* ``sddmm(X, Y, values, graph) -> out``: ``out[e] = values[e] * <X[row e], Y[col e]>``.

Gradients (``A_v``: A with values v; ``T``: the transposed graph, ``g.tperm[q]`` the entry of A that is T's q-th):

* SpMM sum: ``dX = A_v^T dY`` (SpMM through a module built once on ``A^T``), ``dv[e] =
  <dY[row e], X[col e]>`` (SDDMM on A's pattern with unit values).  Mean: the same with ``v / n_row``.
* SpMM max / min: the winning entry of every output element, found on the torch side in the
  backward (vectorised: the products ``v[e] * X[col e]`` (nnz x K), their row maximum by
  ``scatter_reduce``, the lowest entry equal to it by a second ``scatter_reduce``; ties go to the
  first entry in CSR order); ``dX[col e*, k] += v[e*] dY[i, k]``, ``dv[e*] += X[col e*, k] dY[i, k]``.
  Memory: one nnz x K temporary in the backward.
* SDDMM: ``dX = A_{v*dO} Y``, ``dY = A_{v*dO}^T X`` (two SpMMs), ``dv = dO * SDDMM_1(X, Y)``.

Outside ``torch.compile`` the same computations run as :class:`torch.autograd.Function`\ s
(:class:`SpmmFunction`, :class:`SddmmFunction`), which skip the custom-op dispatch.  Each
backward is one op of its own (``spcompile::spmm_backward``, ``spcompile::sddmm_backward``,
with fake shape functions), so that AOT autograd traces the backward graph without touching the
graph's index tensors.  Second derivatives are not supported.

Dtypes: float32 everywhere; float16 / bfloat16 on CUDA where a template computes them (fp32
accumulation); on the CPU, 16-bit inputs are computed in float32 and the result rounded back.
float64 on the CPU: computed in float64 throughout (values, kernels and gradients; so
``torch.autograd.gradcheck`` holds at its float64 defaults); float64 CUDA tensors are refused
(the CUDA kernels compute in float32 or take 16-bit inputs).  Values are float32, float64 for
float64 inputs (a graph's own values then in float64: :meth:`SparseGraph.typed`); gradients
with respect to values come back in the values' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch

from .graph import SparseGraph, graph_by_id

__all__ = ["spmm_op", "sddmm_op", "spmm_backward_op", "sddmm_backward_op", "SpmmFunction", "SddmmFunction"]

_REDUCES = ("sum", "mean", "max", "min")


def _plan(X: torch.Tensor, what: str):
    """(module dtype, target, input to hand the module) for a float input tensor."""
    if X.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(f"{what}: inputs must be float32, float64, float16 or bfloat16, got {X.dtype}")
    if X.device.type == "cuda":
        if X.dtype == torch.float64:
            raise TypeError(f"{what}: float64 CUDA tensors are not supported (the CUDA kernels compute in "
                            f"float32, or take float16 / bfloat16 inputs); pass float32 (or float16 / "
                            f"bfloat16), or compute in float64 on the CPU")
        return str(X.dtype).rpartition(".")[2], "cuda", X.detach()
    if X.device.type != "cpu":
        raise ValueError(f"{what}: unsupported device {X.device}")
    if X.dtype == torch.float64:
        return "float64", "cpu", X.detach()
    return "float32", "cpu", X.detach().float()


def _compute(X: torch.Tensor) -> torch.dtype:
    """The dtype of the values and the arithmetic for inputs like ``X``: float64 for float64
    inputs, else float32."""
    return torch.float64 if X.dtype == torch.float64 else torch.float32


def _check_graph_device(g: SparseGraph, device) -> None:
    """ValueError unless the graph's index and value tensors are on ``device`` (the inputs')."""
    if g.device != device:
        raise ValueError(f"the graph's tensors are on {g.device} but the inputs on {device}: call graph.to({str(device)!r})")


def _values(g: SparseGraph, values: Optional[torch.Tensor], device, dtype=torch.float32) -> torch.Tensor:
    """The values for a call (``dtype``: the arithmetic's, for the graph's own values)."""
    if values is None:
        _check_graph_device(g, device)
        return g.typed("values", dtype)
    if values.shape != (g.nnz,):
        raise ValueError(f"values has shape {tuple(values.shape)}, expected ({g.nnz},) (one per stored entry)")
    return values.detach()


# -- SpMM -----------------------------------------------------------------------------------
def _spmm(g: SparseGraph, X: torch.Tensor, values: Optional[torch.Tensor], reduce: str) -> torch.Tensor:
    if reduce not in _REDUCES:
        raise ValueError(f"reduce must be one of {_REDUCES}, got {reduce!r}")
    if X.dim() != 2 or X.shape[0] != g.shape[1]:
        raise ValueError(f"X has shape {tuple(X.shape)}, expected ({g.shape[1]}, K) for a graph of shape {g.shape}")
    dtype, target, Xc = _plan(X, "spmm")
    key = ("spmm", X.shape[1], reduce, dtype, target)
    mod = g.module(*key)
    if values is None and g._user.get(key) is mod:
        Y = mod(Xc)                      # the caller's module with its own values
    else:
        Y = mod(Xc, values=_values(g, values, X.device, _compute(X)))
    return Y if Y.dtype == X.dtype else Y.to(X.dtype)


def _sddmm(g: SparseGraph, X: torch.Tensor, Y: torch.Tensor, values: Optional[torch.Tensor]) -> torch.Tensor:
    if X.dim() != 2 or Y.dim() != 2 or X.shape[0] != g.shape[0] or Y.shape[0] != g.shape[1] or X.shape[1] != Y.shape[1]:
        raise ValueError(f"X, Y have shapes {tuple(X.shape)}, {tuple(Y.shape)}; expected ({g.shape[0]}, K) and "
                         f"({g.shape[1]}, K) for a graph of shape {g.shape}")
    if X.dtype != Y.dtype:
        raise TypeError(f"X and Y must have one dtype, got {X.dtype} and {Y.dtype}")
    dtype, target, Xc = _plan(X, "sddmm")
    _, _, Yc = _plan(Y, "sddmm")
    key = ("sddmm", X.shape[1], None, dtype, target)
    mod = g.module(*key)
    if values is None and g._user.get(key) is mod:
        out = mod(Xc, Yc)
    else:
        out = mod(Xc, Yc, values=_values(g, values, X.device, _compute(X)))
    return out if out.dtype == X.dtype else out.to(X.dtype)


def _transposed(g: SparseGraph, X: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``A_w^T X`` (w in A's entry order) through the transposed graph's module."""
    T = g.transpose()
    # the graph's own values: the transposed graph holds them in its order already (one tensor,
    # so the module need not rewrite them each call)
    return _spmm(T, X, None if w is g.typed("values", w.dtype) else w[g.tperm], "sum")


@torch.library.custom_op("spcompile::spmm", mutates_args=())
def spmm_op(X: torch.Tensor, values: Optional[torch.Tensor], graph: int, reduce: str) -> torch.Tensor:
    return _spmm(graph_by_id(graph), X, values, reduce)


@spmm_op.register_fake
def _spmm_fake(X, values, graph, reduce):
    g = graph_by_id(graph)
    return X.new_empty((g.shape[0], X.shape[1]))


def _arg_entries(g: SparseGraph, X, v, reduce):
    """Per output element (m x K) the entry that won the max / min (``g.nnz``: an empty row)."""
    m, K, ct = g.shape[0], X.shape[1], _compute(X)
    P = v.to(ct)[:, None] * X.to(ct)[g.cols]
    idx = g.rows[:, None].expand(-1, K)
    fill = float("-inf") if reduce == "max" else float("inf")
    best = torch.full((m, K), fill, dtype=P.dtype, device=P.device).scatter_reduce(
        0, idx, P, "amax" if reduce == "max" else "amin", include_self=True)
    ent = torch.arange(g.nnz, device=P.device)[:, None].expand(-1, K)
    cand = torch.where(P == best[g.rows], ent, torch.full_like(ent, g.nnz))
    return torch.full((m, K), g.nnz, dtype=torch.long, device=P.device).scatter_reduce(
        0, idx, cand, "amin", include_self=True)


@torch.library.custom_op("spcompile::spmm_backward", mutates_args=())
def spmm_backward_op(dY: torch.Tensor, X: torch.Tensor, values: Optional[torch.Tensor], graph: int, reduce: str,
                     need_x: bool, need_v: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, dvalues) of ``spmm``; an empty tensor for a gradient not asked for."""
    return _spmm_backward_impl(dY, X, values, graph, reduce, need_x, need_v)


def _spmm_backward_impl(dY, X, values, graph, reduce, need_x, need_v):
    g = graph_by_id(graph)
    ct = _compute(X)
    dX = X.new_empty((0,))
    dv = torch.empty((0,), dtype=ct, device=X.device)
    try:
        v = values.detach().to(ct) if values is not None else _values(g, None, X.device, ct)
        dY = dY.detach()
        X = X.detach()
        if reduce in ("sum", "mean"):
            w = v if reduce == "sum" else v / g.typed("row_len", ct)
            if need_x:
                dX = _transposed(g, dY, w).to(X.dtype)
            if need_v:
                dv = _sddmm(g, dY, X.to(dY.dtype), g.typed("ones", ct)).to(ct)
                if reduce == "mean":
                    dv = dv / g.typed("row_len", ct)
        else:
            E = _arg_entries(g, X, v, reduce)
            valid = E < g.nnz
            Ec = E.clamp(max=max(g.nnz - 1, 0))
            gy = torch.where(valid, dY.to(ct), torch.zeros((), dtype=ct, device=dY.device))
            cols = g.cols[Ec]
            if need_x:
                dX = torch.zeros((g.shape[1], X.shape[1]), dtype=ct, device=X.device)
                dX.scatter_add_(0, cols, gy * v[Ec])
                dX = dX.to(X.dtype)
            if need_v:
                dv = torch.zeros(g.nnz, dtype=ct, device=X.device)
                dv.index_add_(0, Ec.reshape(-1), (gy * X.to(ct).gather(0, cols)).reshape(-1))
    except (RuntimeError, ValueError, TypeError) as e:
        raise RuntimeError(f"spcompile: the gradient of spmm (reduce={reduce!r}) cannot be computed: {e}") from e
    return dX, dv


@spmm_backward_op.register_fake
def _spmm_backward_fake(dY, X, values, graph, reduce, need_x, need_v):
    g = graph_by_id(graph)
    dX = X.new_empty((g.shape[1], X.shape[1]) if need_x else (0,))
    dv = X.new_empty((g.nnz,) if need_v else (0,), dtype=_compute(X))
    return dX, dv


def _spmm_setup(ctx, inputs, output):
    X, values, graph, reduce = inputs
    ctx.graph, ctx.reduce = graph, reduce
    ctx.save_for_backward(X, values)


def _spmm_backward(ctx, dY):
    X, values = ctx.saved_tensors
    need_x, need_v = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dX, dv = torch.ops.spcompile.spmm_backward(dY, X, values, ctx.graph, ctx.reduce, need_x, need_v)
    return (dX if need_x else None), (dv.to(values.dtype) if need_v else None), None, None


torch.library.register_autograd("spcompile::spmm", _spmm_backward, setup_context=_spmm_setup)


# -- SDDMM ----------------------------------------------------------------------------------
@torch.library.custom_op("spcompile::sddmm", mutates_args=())
def sddmm_op(X: torch.Tensor, Y: torch.Tensor, values: Optional[torch.Tensor], graph: int) -> torch.Tensor:
    return _sddmm(graph_by_id(graph), X, Y, values)


@sddmm_op.register_fake
def _sddmm_fake(X, Y, values, graph):
    g = graph_by_id(graph)
    return X.new_empty((g.nnz,))


@torch.library.custom_op("spcompile::sddmm_backward", mutates_args=())
def sddmm_backward_op(dO: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, values: Optional[torch.Tensor],
                      graph: int, need_x: bool, need_y: bool,
                      need_v: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dX, dY, dvalues) of ``sddmm``; an empty tensor for a gradient not asked for."""
    return _sddmm_backward_impl(dO, X, Y, values, graph, need_x, need_y, need_v)


def _sddmm_backward_impl(dO, X, Y, values, graph, need_x, need_y, need_v):
    g = graph_by_id(graph)
    ct = _compute(X)
    dX, dY = X.new_empty((0,)), Y.new_empty((0,))
    dv = torch.empty((0,), dtype=ct, device=X.device)
    try:
        X, Y, dO = X.detach(), Y.detach(), dO.detach()
        v = (values if values is not None else _values(g, None, X.device, ct)).detach().to(ct)
        gw = v * dO.to(ct)
        if need_x:
            dX = _spmm(g, Y, gw, "sum").to(X.dtype)
        if need_y:
            dY = _transposed(g, X, gw).to(Y.dtype)
        if need_v:
            dv = dO.to(ct) * _sddmm(g, X, Y, g.typed("ones", ct)).to(ct)
    except (RuntimeError, ValueError, TypeError) as e:
        raise RuntimeError(f"spcompile: the gradient of sddmm cannot be computed: {e}") from e
    return dX, dY, dv


@sddmm_backward_op.register_fake
def _sddmm_backward_fake(dO, X, Y, values, graph, need_x, need_y, need_v):
    g = graph_by_id(graph)
    return (X.new_empty(tuple(X.shape) if need_x else (0,)), Y.new_empty(tuple(Y.shape) if need_y else (0,)),
            X.new_empty((g.nnz,) if need_v else (0,), dtype=_compute(X)))


def _sddmm_setup(ctx, inputs, output):
    X, Y, values, graph = inputs
    ctx.graph = graph
    ctx.save_for_backward(X, Y, values)


def _sddmm_backward(ctx, dO):
    X, Y, values = ctx.saved_tensors
    need_x, need_y, need_v = ctx.needs_input_grad[:3]
    dX, dY, dv = torch.ops.spcompile.sddmm_backward(dO, X, Y, values, ctx.graph, need_x, need_y, need_v)
    return (dX if need_x else None), (dY if need_y else None), (dv.to(values.dtype) if need_v else None), None


torch.library.register_autograd("spcompile::sddmm", _sddmm_backward, setup_context=_sddmm_setup)


# -- eager mode -----------------------------------------------------------------------------
# The same computations as autograd Functions: outside torch.compile the functions of
# spcompile.nn call these, which skip the custom-op dispatch (tens of microseconds a call).
class SpmmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, values, graph, reduce):
        ctx.graph, ctx.reduce = graph, reduce
        ctx.save_for_backward(X, values)
        return _spmm(graph_by_id(graph), X, values, reduce)

    @staticmethod
    def backward(ctx, dY):
        X, values = ctx.saved_tensors
        need_x, need_v = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dX, dv = _spmm_backward_impl(dY, X, values, ctx.graph, ctx.reduce, need_x, need_v)
        return (dX if need_x else None), (dv.to(values.dtype) if need_v else None), None, None


class SddmmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, Y, values, graph):
        ctx.graph = graph
        ctx.save_for_backward(X, Y, values)
        return _sddmm(graph_by_id(graph), X, Y, values)

    @staticmethod
    def backward(ctx, dO):
        X, Y, values = ctx.saved_tensors
        need_x, need_y, need_v = ctx.needs_input_grad[:3]
        dX, dY, dv = _sddmm_backward_impl(dO, X, Y, values, ctx.graph, need_x, need_y, need_v)
        return (dX if need_x else None), (dY if need_y else None), (dv.to(values.dtype) if need_v else None), None
