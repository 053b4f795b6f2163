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
from ..core.numerics import DTYPES, exact_precision
from ..core.ir import SparseModule
from ..passes import recipes
from ..runtime.kernel import Kernel


__all__ = ["Template", "Kernel", "register_template", "get_template", "list_templates",
           "csr_kernel_arrays", "check_csr_arrays", "source_hash_of"]


def unique_params(seeds) -> list[dict]:
    """``seeds`` without repeated parameter sets, first occurrence kept (for ``seed_params``)."""
    out, seen = [], set()
    for s in seeds:
        t = tuple(sorted(s.items()))
        if t not in seen:
            seen.add(t)
            out.append(s)
    return out


#: the largest integer a template parameter may take (tile sizes, counts, unrolls)
MAX_PARAM = 1 << 16


def check_param_value(template: str, name: str, value, dist=None, default=None, strict: bool = True) -> None:
    """ValueError naming the parameter when ``value`` cannot be a value of it: of another kind than
    the space's choices (bool, str, int), a string or bool not among them, a negative integer,
    zero where every choice is positive, or an integer above ``max(MAX_PARAM, 64 x the largest
    choice)``.  ``strict=False``: any string where the choices are strings (the template checks
    them itself)."""
    choices = list(getattr(dist, "choices", ()) or ())
    tuned = bool(choices)
    if not choices and default is not None:
        # no tuned choices: only the kind of the default (and no negative / absurd integers)
        choices, strict = [default], False
    if not choices:
        return
    where = f"template {template!r} parameter {name!r}"
    if all(isinstance(c, bool) for c in choices):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{where} must be True or False, got {value!r}")
        return
    if all(isinstance(c, str) for c in choices):
        if strict and value not in choices:
            raise ValueError(f"{where} must be one of {choices}, got {value!r}")
        return
    if all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in choices):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{where} must be an integer (e.g. one of {choices}), got {value!r}")
        low = 1 if tuned and min(choices) >= 1 else 0
        high = max(MAX_PARAM, 64 * max(int(c) for c in choices))
        if not low <= int(value) <= high:
            raise ValueError(f"{where} must be between {low} and {high} (tuned choices {choices}), got {value}")


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
        """The kernel array holding the matrix values as one entry per stored entry of the permuted
        CSR (``csr_kernel_arrays``' ``data``, in the workload's arithmetic type), so that a call
        may pass new values (``mod(X, values=v)``); None where the format bakes the values into a
        packed layout.  Declared in :data:`CALL_VALUE_ARRAYS`.  A packer that moves the entries
        further says where each slot's entry came from (:data:`ENTRY_SRC`)."""
        return CALL_VALUE_ARRAYS.get(self.name)
    #: the saved arrays are :func:`csr_kernel_arrays` (or a subset of their names), checked by
    #: :func:`check_csr_arrays` when an artifact is loaded; ``csr_values``: ``data`` holds the
    #: matrix values unchanged (so that their hash can be checked too)
    csr_arrays: bool = False
    csr_values: bool = True
    #: string parameters must be one of the space's choices (see :func:`check_param_value`)
    strict_choices: bool = True
    #: the value a parameter takes when a parameter set lacks it (sets saved before the parameter
    #: existed, defaults and heuristics that leave it out): the tuner enqueues a seed with these,
    #: never with a value the sampler draws at random
    absent_params: dict = {}

    # -- availability / applicability --------------------------------------------------------
    def available(self) -> bool:
        """Whether this machine has the toolchain to *build* this template."""
        return True

    #: input/output dtypes the template computes for (16-bit ones need explicit support)
    dtypes: tuple = ("float32",)

    def supports(self, mod: SparseModule) -> bool:
        return ((mod.op.op, mod.op.reduce) in self.ops and mod.op.dtype in self.dtypes
                and all(f in mod.formats for f in self.requires(mod)))

    def quick_alternatives(self, params) -> list:
        """Parameter sets that quick selection measures beside ``params`` when it has only this
        template's heuristic default to try (none by default)."""
        return []

    def unranked_variants(self, params, op=None) -> list:
        """Parameter sets quick selection measures beside the shipped model's first choice of this
        template (``op``: the workload, when the choice depends on the matrix), for variants the
        model's portfolio never measured (none by default)."""
        return []

    def locality_orders(self, op=None) -> list:
        """Pass pipelines (specs) that quick selection also measures the model's first choice of
        this template on, for workloads (``op``) where the portfolio's orders may miss the
        locality a renumbering gives (none by default)."""
        return []

    def probe_variants(self, params, op=None) -> list:
        """Parameter sets next to ``params`` (the fastest candidate quick selection measured) that
        it measures in a second round, on the same pipeline (none by default)."""
        return []

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

    def search_params(self, params: Mapping[str, Any]) -> dict:
        """The parameter set a tuner trial stands for: parameters that have no effect under the
        others' values set to one value, so that equivalent trials share one config (one digest,
        one measurement).  Identity by default."""
        return dict(params)

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
        self.check_values(mod, full, params)
        return full

    def check_values(self, mod: SparseModule, full: Mapping[str, Any], given: Mapping[str, Any]) -> None:
        """ValueError naming a parameter the caller gave (``given``) whose value cannot be one of
        it (see :func:`check_param_value`); ``full`` holds the defaults too."""
        space, defaults = self.space(mod), self.default_params(mod)
        for name in sorted(given):
            check_param_value(self.name, name, full[name], space.get(name), defaults.get(name),
                              self.strict_choices)

    def precision_of(self, params: Mapping[str, Any], dtype: str = "float32") -> str:
        """The precision a configuration with ``params`` computes a ``dtype`` workload in."""
        if self.precision_param is None:
            return exact_precision(dtype)
        return str(params.get(self.precision_param, "fp32"))

    def make_config(self, params: Mapping[str, Any], pipeline=(), target: str | None = None,
                    dtype: str = "float32") -> Config:
        """A :class:`Config` of this template for a ``dtype`` workload (its format and precision
        filled in)."""
        return Config(self.name, dict(params), tuple(pipeline), target or self.target, self.format,
                      self.precision_of(params, dtype))

    # -- build / load ------------------------------------------------------------------------
    def build(self, mod: SparseModule, params: Mapping[str, Any]) -> Kernel:
        raise NotImplementedError

    def load(self, params: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
             files: Mapping[str, str], meta: Mapping[str, Any]) -> Kernel:
        """Rebuild a kernel from a saved artifact without compiling anything."""
        raise NotImplementedError

    def check_arrays(self, key, params: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                     meta: Mapping[str, Any], values: str | None = None) -> None:
        """Structural checks of a saved artifact's arrays against its workload ``key`` (rows,
        cols, nnz, pattern hash) before any kernel sees them; ValueError saying what is wrong.
        ``values``: the manifest's values hash.  Templates add their own arrays' checks."""
        if self.csr_arrays:
            check_csr_arrays(arrays, key.rows, key.cols, key.nnz, pattern=key.pattern,
                             values=values if self.csr_values else None, value_dtype=DTYPES[key.dtype].compute)

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
    "extern.scipy": "data",
}

#: the key under which a packer returns, beside its arrays, the position in ``mod.A``'s stored
#: entries of each slot of the call-time values array, when it moved the entries (not a kernel
#: array: the build takes it out and composes it into the module's ``values_src``)
ENTRY_SRC = "_entry_src"

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
    entry p (where an SDDMM output goes), ``data`` the values in the workload's arithmetic type
    (float32; float64 for float64 workloads: never rounded)."""
    A = mod.A
    m = A.shape[0]
    idt = np.dtype(index_dtype) if max(A.nnz, *A.shape) <= np.iinfo(np.int32).max else np.dtype(np.int64)
    indices = A.indices if mod.col_perm is None else mod.col_perm[A.indices]
    # (identity permutations made in the index dtype: no int64 array per row on huge matrices)
    row_ids = np.arange(m, dtype=idt) if mod.row_perm is None else mod.row_perm
    nnz_ids = np.arange(A.nnz, dtype=idt) if mod.nnz_perm is None else mod.nnz_perm
    # fresh writable copies: DLPack cannot export the read-only arrays of a CSR
    return {
        "indptr": np.array(A.indptr, dtype=idt),
        "indices": np.array(indices, dtype=idt),
        "data": np.array(A.data, dtype=DTYPES[mod.op.dtype].compute),
        "row_ids": row_ids if mod.row_perm is None else np.array(row_ids, dtype=idt),
        "nnz_ids": nnz_ids if mod.nnz_perm is None else np.array(nnz_ids, dtype=idt),
    }


def _index_array(arrays, name: str, length: int, bound: int) -> np.ndarray:
    x = np.asarray(arrays[name])
    if x.dtype.kind not in "iu" or x.ndim != 1 or x.shape[0] != length:
        raise ValueError(f"array {name!r} must be a 1-D integer array of length {length}, got "
                         f"{x.dtype}{list(x.shape)}")
    x = x.astype(np.int64, copy=False)
    if x.size and (int(x.min()) < 0 or int(x.max()) >= bound):
        raise ValueError(f"array {name!r} holds values outside [0, {bound})")
    return x


def index_array(arrays, name: str, lo: int, hi: int, size: int | None = None, ndim: int = 1) -> np.ndarray:
    """``arrays[name]`` as int64 after checking it: an integer array of ``ndim`` dimensions (and
    ``size`` elements in its first one, where given) with every value in ``[lo, hi)``;
    ValueError naming what is wrong.  For the structural checks of saved artifacts."""
    if name not in arrays:
        raise ValueError(f"array {name!r} is missing")
    x = np.asarray(arrays[name])
    if x.dtype.kind not in "iu" or x.ndim != ndim or (size is not None and x.shape[0] != size):
        want = f"{ndim}-D integer array" + (f" of length {size}" if size is not None else "")
        raise ValueError(f"array {name!r} must be a {want}, got {x.dtype}{list(x.shape)}")
    x = x.astype(np.int64, copy=False)
    if x.size and (int(x.min()) < lo or int(x.max()) >= hi):
        raise ValueError(f"array {name!r} holds values outside [{lo}, {hi})")
    return x


def typed_array(arrays, name: str, dtype, size: int | None = None, of: str = "") -> np.ndarray:
    """``arrays[name]``: 1-D, exactly of ``dtype`` (the element type its kernel parameter has:
    another width or byte order would be read as other values / past its end), ``size`` long
    (``of``: what that length follows, for the message)."""
    want = np.dtype(dtype)
    if name not in arrays:
        raise ValueError(f"array {name!r} is missing")
    x = np.asarray(arrays[name])
    if x.dtype != want or x.ndim != 1 or (size is not None and x.shape[0] != size):
        raise ValueError(f"array {name!r} must be a 1-D {want} array"
                         + (f" of length {size}" + (f" ({of})" if of else "") if size is not None else "")
                         + f", got {x.dtype.str}{list(x.shape)}")
    return x


def pointer_array(arrays, name: str, last: int, size: int | None = None, first: int | None = 0) -> np.ndarray:
    """A row / segment pointer: integers rising monotonically from ``first`` (any value >= 0 when
    None) to at most ``last`` (exactly ``last`` when ``first`` is given)."""
    x = index_array(arrays, name, 0, last + 1, size)
    if x.size == 0:
        raise ValueError(f"array {name!r} must hold at least one pointer")
    if np.any(x[1:] < x[:-1]) or (first is not None and (x[0] != first or x[-1] != last)):
        span = f"from {first} to {last}" if first is not None else f"within [0, {last}]"
        raise ValueError(f"array {name!r} must rise monotonically {span}")
    return x


def float_array(arrays, name: str, size: int | None = None) -> np.ndarray:
    """A 1-D floating-point (or raw 16-bit) array of ``size`` elements."""
    if name not in arrays:
        raise ValueError(f"array {name!r} is missing")
    x = np.asarray(arrays[name])
    if x.dtype.kind not in "fu" or x.ndim != 1 or (size is not None and x.shape[0] != size):
        raise ValueError(f"array {name!r} must hold {size if size is not None else 'some'} values, got "
                         f"{x.dtype}{list(x.shape)}")
    return x


def meta_int(meta, name: str, want: int | None = None, lo: int = 0) -> int:
    """An integer of a saved kernel's meta (``want``: the value it must have)."""
    v = meta.get(name)
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo or (want is not None and v != want):
        raise ValueError(f"kernel meta {name!r} must be " + (f"{want}" if want is not None else f"an integer >= {lo}")
                         + f", got {v!r}")
    return int(v)


def meta_equal(meta, name: str, want) -> None:
    """A value of a saved kernel's meta must be ``want`` (a bool never stands for a number)."""
    if meta.get(name) != want or type(meta.get(name)) is bool:
        raise ValueError(f"kernel meta {name!r} must be {want!r}, got {meta.get(name)!r}")


def check_instances(meta, want: list) -> None:
    """``meta["instances"]`` must name exactly the instances ``want`` (``[[name, [args]], ...]``):
    they select the compiled entry points and their compile-time layout."""
    inst = meta.get("instances")
    ok = isinstance(inst, (list, tuple)) and len(inst) == len(want) and all(
        isinstance(i, (list, tuple)) and len(i) == 2 and isinstance(i[1], (list, tuple))
        and i[0] == nm and len(i[1]) == len(a)
        and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x == y for x, y in zip(i[1], a))
        for i, (nm, a) in zip(inst, want))
    if not ok:
        raise ValueError(f"kernel meta 'instances' must be {want}, got {inst!r}")


def check_entries(r: np.ndarray, c: np.ndarray, data, rows: int, cols: int, pattern: str | None,
                  values: str | None, order: np.ndarray | None = None, value_dtype=np.float32) -> None:
    """The entries (row ``r[p]``, column ``c[p]``, value ``data[p]``) must form the matrix whose
    pattern / values hashes the manifest names (values hashed as ``value_dtype``, the workload's
    arithmetic type).  ``order``: the entries' canonical order as the arrays claim it (they must
    then be in (row, column) order along it), else any order; no entry may repeat."""
    from ..core.formats import CSR
    from ..core.ir import pattern_hash, values_hash

    if pattern is None and values is None:
        return
    nnz = int(r.size)
    if order is None:
        order = np.lexsort((c, r))
    r, c = r[order], c[order]
    if nnz > 1:
        key = r * np.int64(max(cols, 1)) + c
        if np.any(key[1:] <= key[:-1]):
            raise ValueError("the arrays do not describe a canonical matrix (entries out of order or repeated)")
    C = CSR(np.concatenate(([0], np.cumsum(np.bincount(r, minlength=rows)))).astype(np.int64), c,
            (np.asarray(data)[order] if data is not None else np.zeros(nnz, value_dtype)).astype(value_dtype),
            (rows, cols))
    if pattern is not None and pattern_hash(C) != pattern:
        raise ValueError("the arrays hold another matrix than the one the manifest names (pattern hash differs)")
    if values is not None and data is not None and values_hash(C) != values:
        raise ValueError("the arrays hold other values than the manifest names (values hash differs)")


def _is_permutation(x: np.ndarray, n: int) -> bool:
    return x.shape[0] == n and bool(np.all(np.bincount(x, minlength=n) == 1)) if n else True


def check_csr_arrays(arrays: Mapping[str, np.ndarray], rows: int, cols: int, nnz: int,
                     pattern: str | None = None, values: str | None = None, value_dtype=np.float32) -> None:
    """ValueError unless ``arrays`` (names of :func:`csr_kernel_arrays`, those present) describe a
    ``rows x cols`` matrix with ``nnz`` entries: ``indptr`` monotone from 0 to nnz, ``indices`` in
    [0, cols), ``row_ids`` a permutation of the rows, ``nnz_ids`` one of the entries, ``data``
    nnz values of exactly ``value_dtype`` (the workload's arithmetic type: what the kernel reads
    them as), every index array of one integer dtype; with ``pattern`` / ``values`` the matrix
    they rebuild (in the caller's order) must have that pattern hash / values hash.  Linear in
    rows + nnz (plus one sort of the entries for the hashes)."""

    for what, v in (("rows", rows), ("cols", cols), ("nnz", nnz)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"workload {what} must be a non-negative integer, got {v!r}")
    idx_dtypes = {np.asarray(arrays[k]).dtype for k in ("indptr", "indices", "row_ids", "nnz_ids", "task_bounds")
                  if k in arrays}
    if len(idx_dtypes) > 1:
        raise ValueError(f"index arrays mix dtypes {sorted(map(str, idx_dtypes))}")
    indptr = indices = row_ids = nnz_ids = data = None
    if "indptr" in arrays:
        indptr = _index_array(arrays, "indptr", rows + 1, nnz + 1)
        if indptr[0] != 0 or indptr[-1] != nnz or np.any(indptr[1:] < indptr[:-1]):
            raise ValueError(f"array 'indptr' must rise monotonically from 0 to nnz={nnz}")
    if "indices" in arrays:
        indices = _index_array(arrays, "indices", nnz, max(cols, 1) if nnz == 0 else cols)
    if "row_ids" in arrays:
        row_ids = _index_array(arrays, "row_ids", rows, max(rows, 1))
        if not _is_permutation(row_ids, rows):
            raise ValueError("array 'row_ids' is not a permutation of the rows")
    if "nnz_ids" in arrays:
        nnz_ids = _index_array(arrays, "nnz_ids", nnz, max(nnz, 1))
        if not _is_permutation(nnz_ids, nnz):
            raise ValueError("array 'nnz_ids' is not a permutation of the stored entries")
    if "data" in arrays:
        data, want = np.asarray(arrays["data"]), np.dtype(value_dtype)
        if data.dtype != want or data.ndim != 1 or data.shape[0] != nnz:   # csr_kernel_arrays' data
            raise ValueError(f"array 'data' must hold {nnz} {want} values, got {data.dtype}{list(data.shape)}")
    if (pattern is None and values is None) or indptr is None or indices is None:
        return
    # the matrix in the caller's order: current row i is original row row_ids[i]; entry p goes to
    # original position nnz_ids[p] (else the canonical (row, column) order)
    r = np.repeat(np.arange(rows, dtype=np.int64) if row_ids is None else row_ids, np.diff(indptr))
    order = None
    if nnz_ids is not None:
        order = np.empty(nnz, dtype=np.int64)
        order[nnz_ids] = np.arange(nnz, dtype=np.int64)
    check_entries(r, indices, data, rows, cols, pattern, values, order, value_dtype)
