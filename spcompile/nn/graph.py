""":class:`SparseGraph`: one sparse matrix (a graph's adjacency) as the torch ops see it -- its
pattern, default values and index tensors on one device, its transpose, and the compiled modules
of every (op, width, reduce, dtype, device) a model asks for, built once and cached.

The torch ops (:mod:`spcompile.nn.ops`) receive a graph as an integer id (custom ops take no
Python objects): graphs register themselves in a weak registry under :attr:`SparseGraph.id`.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import numpy as np

from ..api import build
from ..core.formats import CSR, as_csr
from ..kernels import list_templates
from ..module import CompiledModule

__all__ = ["SparseGraph", "graph_by_id"]

_IDS = itertools.count(1)
_GRAPHS: "weakref.WeakValueDictionary[int, SparseGraph]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def graph_by_id(gid: int) -> "SparseGraph":
    g = _GRAPHS.get(int(gid))
    if g is None:
        raise RuntimeError(f"spcompile graph {gid} no longer exists (the SparseGraph was garbage collected "
                           f"while a computation still used it; keep a reference to it)")
    return g


def _torch():
    import torch

    return torch


class SparseGraph:
    """A sparse matrix ``A`` (rows: targets, columns: sources) for the torch ops.

    ``A``: any sparse input :func:`spcompile.as_csr` takes (scipy, torch sparse COO/CSR,
    ``(indptr, indices, data, shape)``).  Its stored entries, in canonical CSR order, are the
    *edges* the ops' ``values`` follow.  ``build_options`` go to :func:`spcompile.build` for every
    module the graph builds (e.g. ``tune=True``, ``storage=...``, ``select_budget=...``).

    ``rows``, ``cols`` (int64), ``values`` (float32) are tensors on :attr:`device`
    (:meth:`to` moves them); :meth:`typed` gives the values in float64 for float64 inputs (the
    input's own float64 values where it held them, unrounded).  Modules are built lazily on first
    use, per (op, K, reduce, dtype, device), on the *pattern* (values are always passed at call
    time), so one graph serves any edge values -- GCN normalisation, attention -- without
    rebuilding."""

    def __init__(self, A, **build_options: Any):
        C = as_csr(A)
        self.csr: CSR = C
        #: the values of an input that held float64 ones, unrounded (float64 calls use them), else None
        self._values64 = as_csr(A, np.float64).data if _holds_float64(A) else None
        self._typed: dict = {}
        self.shape = (int(C.shape[0]), int(C.shape[1]))
        self.nnz = C.nnz
        self.build_options = dict(build_options)
        self._modules: dict[tuple, CompiledModule] = {}
        self._user: dict[tuple, CompiledModule] = {}   # modules given by the caller (their own values)
        self._transpose: SparseGraph | None = None
        self._tperm_np: np.ndarray | None = None
        self._aux: dict = {}     # other modules' per-graph caches (:meth:`cached`)
        self._lock = threading.RLock()
        with _LOCK:
            self.id = next(_IDS)
            _GRAPHS[self.id] = self
        self.device = None
        self.to("cpu")

    def __repr__(self):
        return f"SparseGraph(shape={self.shape}, nnz={self.nnz}, device={self.device})"

    def __reduce__(self):
        # the matrix, build options and device; modules are built again where it is unpickled
        # (a new graph: new id; modules given by the caller travel pickled with it)
        C = self.csr
        return (_rebuild, ((C.indptr, C.indices, self._data(), self.shape), self.build_options,
                           str(self.device), list(self._user.values())))

    def _data(self) -> np.ndarray:
        """The values at the precision the graph was given them in (float64 or float32)."""
        return self.csr.data if self._values64 is None else self._values64

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_module(cls, mod: CompiledModule) -> "SparseGraph":
        """The graph of a built module (its matrix and values); the module itself runs the
        calls it fits (its op, width, reduce, dtype and target), with its own tuning."""
        if mod.matrix is None:
            raise RuntimeError("this module does not know its matrix (it was loaded without it), so no gradient "
                               "can be computed through it: load it with spcompile.load(path, A)")
        g = cls(mod.matrix)
        g._user[(mod.op, mod.K, mod.reduce, mod.key.dtype, mod.target)] = mod
        return g

    def to(self, device) -> "SparseGraph":
        """Put the index and value tensors on ``device`` (in place; returns the graph)."""
        torch = _torch()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        C = self.csr
        rows = torch.from_numpy(np.asarray(C.row_ids, np.int64))
        self.rows = rows.to(device)
        self.cols = torch.from_numpy(np.asarray(C.indices, np.int64)).to(device)
        self.values = torch.from_numpy(np.array(C.data, np.float32)).to(device)
        self.ones = torch.ones(self.nnz, dtype=torch.float32, device=device)
        lens = np.maximum(np.diff(np.asarray(C.indptr, np.int64)), 1).astype(np.float32)
        #: per stored entry, the length of its row (at least 1): mean's divisor
        self.row_len = torch.from_numpy(lens).to(device)[self.rows]
        self._typed = {}
        self._aux = {}           # their device tensors were on the old device
        self.device = device
        if self._transpose is not None:
            self._transpose.to(device)
            self.tperm = torch.from_numpy(self._tperm_np).to(device)
        return self

    def typed(self, name: str, dtype):
        """The float32 tensor ``name`` ("values", "ones", "row_len") in torch ``dtype`` (float64 for
        float64 inputs; the values unrounded where the graph was given float64 ones), made once
        per device and kept, so that modules see the same tensor on every call."""
        t = getattr(self, name)
        if t.dtype == dtype:
            return t
        got = self._typed.get((name, dtype))
        if got is None:
            src = self._values64 if name == "values" and dtype == _torch().float64 else None
            got = t.to(dtype) if src is None else _torch().from_numpy(np.array(src)).to(self.device)
            self._typed[(name, dtype)] = got
        return got

    def cached(self, key, make):
        """``make()``, made once per ``key`` and kept while the graph lives on its device (:meth:`to`
        drops these caches): the place of per-graph state other modules derive, e.g. the device
        arrays and launch plans of :mod:`spcompile.nn.gat`."""
        got = self._aux.get(key)
        if got is None:
            with self._lock:
                got = self._aux.get(key)
                if got is None:
                    got = self._aux[key] = make()
        return got

    # -- transpose ------------------------------------------------------------------------
    def transpose(self) -> "SparseGraph":
        """The graph of ``A^T`` (built once); ``tperm[q]``: the entry of ``A`` that ``A^T``'s stored
        entry q is (so ``values[tperm]`` are ``A^T``'s values)."""
        with self._lock:
            if self._transpose is None:
                C = self.csr
                rows = np.asarray(C.row_ids, np.int64)
                cols = np.asarray(C.indices, np.int64)
                order = np.lexsort((rows, cols))   # by column, then row: A^T's canonical order
                indptr = np.zeros(self.shape[1] + 1, np.int64)
                np.cumsum(np.bincount(cols, minlength=self.shape[1]), out=indptr[1:])
                T = SparseGraph((indptr, rows[order], self._data()[order],
                                 (self.shape[1], self.shape[0])), **self.build_options)
                T._transpose, T._tperm_np = self, np.argsort(order)
                T.to(self.device)
                T.tperm = _torch().from_numpy(T._tperm_np).to(self.device)
                self._tperm_np = order
                self.tperm = _torch().from_numpy(order).to(self.device)
                self._transpose = T
            return self._transpose

    # -- modules --------------------------------------------------------------------------
    def module(self, op: str, K: int, reduce: str | None, dtype: str, target: str,
               user: bool = True) -> CompiledModule:
        """The module for (op, K, reduce, dtype, target): the caller's own (``user``) when one
        fits, else one built on the pattern (once), taking values at call time."""
        key = (op, int(K), reduce if op == "spmm" else None, dtype, target)
        if user and key in self._user:
            return self._user[key]
        mod = self._modules.get(key)
        if mod is None:
            with self._lock:
                mod = self._modules.get(key)
                if mod is None:
                    mod = self._modules[key] = self._build(*key)
        return mod

    def _build(self, op, K, reduce, dtype, target) -> CompiledModule:
        C = self.csr
        pattern = (C.indptr, C.indices, np.ones(self.nnz, np.float32), self.shape)
        opts = dict(self.build_options)
        if not any(k in opts for k in ("template", "params", "pipeline")):
            opts.setdefault("call_values", True)   # the values come with every call
        mod = build(pattern, op, K=K, reduce=reduce, target=target, dtype=dtype, **opts)
        if mod.supports_call_values:
            return mod
        # the decision's format bakes the values in: the best template that reads them per call
        errors = []
        for tpl in list_templates(target, op=op, reduce=reduce, available_only=True):
            if tpl.call_values_array is None or dtype not in tpl.dtypes:
                continue
            try:
                return build(pattern, op, K=K, reduce=reduce, target=target, dtype=dtype, template=tpl.name)
            except (ValueError, RuntimeError) as e:
                errors.append(f"{tpl.name}: {e}")
        raise RuntimeError(f"no template on target {target!r} takes call-time values for op={op!r} "
                           f"reduce={reduce!r} dtype={dtype!r} ({'; '.join(errors) or 'none available'})")


def _holds_float64(A) -> bool:
    """Whether sparse input ``A`` (anything :func:`spcompile.as_csr` takes) holds float64 values."""
    if isinstance(A, CSR):
        dt = A.data.dtype
    elif isinstance(A, tuple) and len(A) == 4:
        dt = np.asarray(A[2]).dtype
    else:
        dt = getattr(A, "dtype", None)   # scipy sparse, torch sparse
    return str(dt).rpartition(".")[2] == "float64"


def _rebuild(A, build_options, device, user) -> SparseGraph:
    g = SparseGraph(A, **build_options)
    for mod in user:
        g._user[(mod.op, mod.K, mod.reduce, mod.key.dtype, mod.target)] = mod
    return g.to(device)
