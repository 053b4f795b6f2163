"""The :class:`Template` protocol, built :class:`Kernel` objects and the template registry.

A template turns a :class:`~spcompile.core.ir.SparseModule` (the matrix after passes) plus a dict of
parameters into a :class:`Kernel`.  Two families implement it: TVM TensorIR schedules (this
package) and CUDA C++ templates (``spcompile.kernels``); external library calls
(cuSPARSE) are templates too.  ``space(mod)`` returns the tunable parameters as Optuna
distributions; ``default_params`` and ``seed_params`` give the starting points for the tuner.

Kernels receive inputs and write outputs in the *caller's* order: the permutations recorded by
passes are folded into the kernel data (see :func:`csr_kernel_arrays`), so no extra pass over
X or Y is made at call time.
"""
from __future__ import annotations

import hashlib
import inspect
import threading
from typing import Any, Mapping

import numpy as np

from ..core.config import Config
from ..core.ir import SparseModule
from ..passes import recipes
from ..runtime.kernel import Kernel


__all__ = ["Template", "Kernel", "register_template", "get_template", "list_templates",
           "csr_kernel_arrays", "source_hash_of"]


def unique_params(seeds) -> list[dict]:
    """``seeds`` without repeated parameter sets, first occurrence kept (for ``seed_params``)."""
    out, seen = [], set()
    for s in seeds:
        t = tuple(sorted(s.items()))
        if t not in seen:
            seen.add(t)
            out.append(s)
    return out


class Template:
    """Base class of kernel templates.  Subclasses set ``name`` (dotted), ``version``, ``target``
    ("cpu" or "cuda"), ``ops`` (supported (op, reduce) pairs) and implement the methods below."""

    name: str = ""
    version: str = "1"
    target: str = "cpu"
    ops: tuple[tuple[str, str | None], ...] = ()
    format: str = "csr"
    #: preferred when the tuner/heuristics choose a default; higher first
    priority: int = 0
    #: the parameter that selects the arithmetic precision (tensor-core templates), or None:
    #: every configuration computes in exact fp32
    precision_param: str | None = None
    #: toolchains that building needs, by name ("tvm-llvm", "tvm-cuda", "nvcc", "torch"): what a
    #: quick listing (``spcompile templates``) checks without importing them; None: unknown, the
    #: listing calls :meth:`available` (the full check)
    tools: tuple[str, ...] | None = None

    @property
    def call_values_array(self) -> str | None:
        """The kernel array holding the matrix values as one float32 entry per stored entry of
        the permuted CSR (``csr_kernel_arrays``' ``data``), so that a call may pass new values
        (``mod(X, values=v)``); None where the format bakes the values into a packed layout.
        Declared in :data:`CALL_VALUE_ARRAYS`."""
        return CALL_VALUE_ARRAYS.get(self.name)

    # -- availability / applicability --------------------------------------------------------
    def available(self) -> bool:
        """Whether this machine has the toolchain to *build* this template."""
        return True

    #: input/output dtypes the template computes for (16-bit ones need explicit support)
    dtypes: tuple = ("float32",)

    def supports(self, mod: SparseModule) -> bool:
        return ((mod.op.op, mod.op.reduce) in self.ops and mod.op.dtype in self.dtypes
                and all(f in mod.formats for f in self.requires(mod)))

    def requires(self, mod: SparseModule) -> tuple[str, ...]:
        """Format data (``mod.formats`` names) this template needs from passes."""
        return ()

    def pipelines(self, mod: SparseModule) -> list[list[dict]]:
        """Pass pipelines that prepare this template's format (the tuner offers these): the
        recipes of :mod:`spcompile.passes.recipes` for ``format``."""
        return recipes.pipelines_for(self.format, mod.op.op, mod.op.dtype)

    # -- search space ------------------------------------------------------------------------
    def space(self, mod: SparseModule) -> dict:
        """Tunable parameters as ``{name: optuna.distributions.BaseDistribution}``."""
        return {}

    def default_params(self, mod: SparseModule) -> dict:
        return {}

    def seed_params(self, mod: SparseModule) -> list[dict]:
        """Known-good configurations (papers' heuristics) to enqueue before searching."""
        return [self.default_params(mod)]

    def check_params(self, mod: SparseModule, params: Mapping[str, Any]) -> dict:
        """Defaults filled in; unknown names are an error."""
        defaults = self.default_params(mod)
        full = {**defaults, **dict(params)}
        known = set(defaults) | set(self.space(mod))
        unknown = set(full) - known
        if unknown:
            raise ValueError(f"template {self.name!r} got unknown parameter(s) {sorted(unknown)}; its parameters "
                             f"are {sorted(known)} (defaults here: {defaults})")
        return full

    def precision_of(self, params: Mapping[str, Any]) -> str:
        """The precision a configuration with ``params`` computes in."""
        if self.precision_param is None:
            return "fp32"
        return str(params.get(self.precision_param, "fp32"))

    def make_config(self, params: Mapping[str, Any], pipeline=(), target: str | None = None) -> Config:
        """A :class:`Config` of this template (its format and precision filled in)."""
        return Config(self.name, dict(params), tuple(pipeline), target or self.target, self.format,
                      self.precision_of(params))

    # -- build / load ------------------------------------------------------------------------
    def build(self, mod: SparseModule, params: Mapping[str, Any]) -> Kernel:
        raise NotImplementedError

    def load(self, params: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
             files: Mapping[str, str], meta: Mapping[str, Any]) -> Kernel:
        """Rebuild a kernel from a saved artifact without compiling anything."""
        raise NotImplementedError

    def source_hash(self) -> str:
        """Hash of everything that defines this template's code (its module source + version)."""
        return source_hash_of(type(self), self.version)

    def __repr__(self):
        return f"<Template {self.name} v{self.version} ({self.target})>"


def source_hash_of(obj, *extra: str, paths: tuple = ()) -> str:
    h = hashlib.sha256()
    try:
        h.update(inspect.getsource(inspect.getmodule(obj)).encode())
    except (OSError, TypeError):
        h.update(repr(obj).encode())
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    for e in extra:
        h.update(str(e).encode())
    return h.hexdigest()[:16]


#: templates whose kernels read the matrix values from one array laid out like the permuted
#: CSR's stored entries (template name -> the array): their modules take values at call time.
#: Kept here rather than on the template classes, so that declaring it leaves the templates'
#: source hashes (which key tuning records and artifacts) as they are.  cuSPARSE is absent (its
#: mean pre-scales the values; its library matrix is built once); the tensor-core and tiled
#: formats pack the values into fragments and tiles.
CALL_VALUE_ARRAYS: dict[str, str] = {
    "cpu.csr_spmm": "data", "cpu.csr_sddmm": "data",
    "csr.crc_cwm": "data", "csr.sddmm": "data",
    "tvm.cuda_csr_spmm": "data", "tvm.cuda_csr_sddmm": "data",
}

_TEMPLATES: dict[str, Template] = {}
_LOCK = threading.Lock()


def register_template(cls_or_obj):
    """Class decorator (or call with an instance) adding a template to the registry."""
    obj = cls_or_obj() if isinstance(cls_or_obj, type) else cls_or_obj
    if not obj.name:
        raise ValueError("templates need a name")
    with _LOCK:
        _TEMPLATES[obj.name] = obj
    return cls_or_obj


def _load_builtin():
    from . import builtin  # noqa: F401


def get_template(name: str) -> Template:
    _load_builtin()
    try:
        return _TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown template {name!r}; registered: {sorted(_TEMPLATES)}") from None


def list_templates(target: str | None = None, *, op: str | None = None, reduce: str | None = None,
                   available_only: bool = False) -> list[Template]:
    """Registered templates, highest priority first, optionally filtered."""
    _load_builtin()
    out = []
    for t in _TEMPLATES.values():
        if target is not None and t.target != target:
            continue
        if op is not None and not any(o == op and (r == reduce or op == "sddmm") for o, r in t.ops):
            continue
        if available_only and not t.available():
            continue
        out.append(t)
    return sorted(out, key=lambda t: (-t.priority, t.name))


def csr_kernel_arrays(mod: SparseModule, index_dtype=np.int32) -> dict[str, np.ndarray]:
    """CSR arrays of ``mod.A`` with the passes' permutations folded in, for kernels that work in
    the caller's order: ``indices`` are *original* column ids, ``row_ids[i]`` is the original row
    of current row i (where its output goes), ``nnz_ids[p]`` the original position of stored
    entry p (where an SDDMM output goes)."""
    A = mod.A
    m = A.shape[0]
    idt = np.dtype(index_dtype) if max(A.nnz, *A.shape) <= np.iinfo(np.int32).max else np.dtype(np.int64)
    indices = A.indices if mod.col_perm is None else mod.col_perm[A.indices]
    row_ids = np.arange(m) if mod.row_perm is None else mod.row_perm
    nnz_ids = np.arange(A.nnz) if mod.nnz_perm is None else mod.nnz_perm
    # fresh writable copies: DLPack cannot export the read-only arrays of a CSR
    return {
        "indptr": np.array(A.indptr, dtype=idt),
        "indices": np.array(indices, dtype=idt),
        "data": np.array(A.data, dtype=np.float32),
        "row_ids": np.array(row_ids, dtype=idt),
        "nnz_ids": np.array(nnz_ids, dtype=idt),
    }
