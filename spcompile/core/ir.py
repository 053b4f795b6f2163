"""The sparse-op IR: what to compute (:class:`SparseOp`), its identity (:class:`WorkloadKey`) and
the data after preprocessing passes (:class:`SparseModule`).

Semantics (all in float64-exact terms, ``A`` canonical CSR with m rows and n columns):

* ``spmm`` + ``sum``:  ``Y[i, k] = sum_j A[i, j] * X[j, k]``  (X: n x K, Y: m x K)
* ``spmm`` + ``mean``: the sum divided by the number of *stored* entries of row i
* ``spmm`` + ``max`` / ``min``: ``max_j`` / ``min_j`` of ``A[i, j] * X[j, k]`` over the stored entries
* an empty row gives 0 for every reduction (the convention of PyG / torch_scatter)
* ``sddmm``: ``out[p] = A.data[p] * dot(X[i], Y[j])`` for the p-th stored entry (i, j) in A's
  canonical CSR order (X: m x K, Y: n x K)

Explicit zeros stored in A count as entries (they are neighbours for max/min/mean).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from . import numerics as _numerics
from .formats import CSR, permute_csr

OPS: dict[str, tuple] = {"spmm": ("sum", "max", "min", "mean"), "sddmm": (None,)}
#: input/output dtypes of a workload (:data:`spcompile.core.numerics.DTYPES`).  float16 /
#: bfloat16: X (and Y) and the result in that dtype, the matrix values and all arithmetic in fp32
#: (one rounding of the output); only some CUDA templates support them.  float64: X, Y, the
#: result, the matrix values and all arithmetic in float64; the CPU templates only.  Which
#: template computes which dtypes: its ``dtypes``.
DTYPES = tuple(_numerics.DTYPES)
#: the widest dense operand supported (K columns of X and Y)
MAX_K = 1 << 20

__all__ = ["OPS", "SparseOp", "WorkloadKey", "SparseModule", "PassRecord", "matrix_features",
           "pattern_hash", "values_hash"]


def check_op(op: str, reduce: str | None) -> tuple[str, str | None]:
    """Validate an op/reduce pair; returns the normalised pair (sddmm has reduce None)."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(OPS)}")
    if op == "sddmm":
        if reduce not in (None, "sum"):
            raise ValueError(f"op 'sddmm' takes no reduce (it computes dot products), got reduce={reduce!r}")
        return op, None
    reduce = "sum" if reduce is None else reduce
    if reduce not in OPS[op]:
        raise ValueError(f"unknown reduce {reduce!r} for op {op!r}; expected one of {list(OPS[op])}")
    return op, reduce


_HASH_CHUNK = 1 << 20


def _hash_arrays(*arrays, as_dtype=None) -> str:
    """SHA-256 of the arrays' dtypes and bytes (``as_dtype``: of the arrays converted to it),
    converted and hashed in chunks, so memory stays bounded on huge arrays."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a).reshape(-1)
        dt = a.dtype if as_dtype is None else np.dtype(as_dtype)
        h.update(str(dt.str).encode())
        for s in range(0, a.shape[0], _HASH_CHUNK):
            h.update(np.ascontiguousarray(a[s:s + _HASH_CHUNK], dtype=dt).data)
    return h.hexdigest()[:32]


def pattern_hash(A: CSR) -> str:
    """Exact identity of the sparsity pattern (independent of the index dtype)."""
    return _hash_arrays(np.asarray(A.shape, dtype=np.int64), A.indptr, A.indices, as_dtype=np.int64)


def values_hash(A: CSR) -> str:
    return _hash_arrays(A.data)


def matrix_features(A: CSR) -> dict[str, float]:
    """Coarse features used to find 'similar' matrices in the tuning database."""
    m, n = A.shape
    lens = A.row_lengths  # the index dtype: no float64 copy per row (huge, mostly empty matrices)
    nnz = float(A.nnz)
    mean = nnz / m if m else 0.0
    sq = sum(float(np.square(lens[s:s + _HASH_CHUNK], dtype=np.float64).sum()) for s in range(0, m, _HASH_CHUNK))
    feats = {
        "rows": float(m), "cols": float(n), "nnz": nnz,
        "density": nnz / max(1.0, float(m) * float(n)),
        "mean_row": mean,
        "max_row": float(lens.max()) if m else 0.0,
        "std_row": float(np.sqrt(max(sq / m - mean * mean, 0.0))) if m else 0.0,
        "empty_rows": float(m - np.count_nonzero(lens)) / m if m else 0.0,
    }
    if A.nnz:
        # mean |i - j| / n: how banded / local the pattern is
        feats["bandwidth"] = float(np.mean(np.abs(A.row_ids.astype(np.int64) - A.indices)) / max(1, n))
    else:
        feats["bandwidth"] = 0.0
    return feats


@dataclass(frozen=True)
class WorkloadKey:
    """Identity of a workload: op, reduce, shape, nnz, dtype, K and the sparsity-pattern hash.

    ``features`` are carried along for similarity search but are not part of equality."""

    op: str
    reduce: str | None
    rows: int
    cols: int
    nnz: int
    dtype: str
    K: int
    pattern: str
    features: Mapping[str, float] = field(default_factory=dict, compare=False, hash=False)

    def digest(self) -> str:
        d = {k: v for k, v in self.to_dict().items() if k != "features"}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:24]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["features"] = dict(self.features)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "WorkloadKey":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True, eq=False)
class SparseOp:
    """Frozen description of the work: op, reduce, canonical CSR matrix, feature width K, dtype.
    ``A``'s values are held in the dtype's arithmetic type (float32; float64 for float64)."""

    op: str
    reduce: str | None
    A: CSR
    K: int
    dtype: str = "float32"

    def __post_init__(self):
        op, reduce = check_op(self.op, self.reduce)
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "reduce", reduce)
        if isinstance(self.K, bool) or not isinstance(self.K, (int, np.integer)):
            raise TypeError(f"K must be an int, got {type(self.K).__name__}")
        if int(self.K) < 1:
            raise ValueError(f"K must be >= 1, got {self.K}")
        if int(self.K) > MAX_K:
            raise ValueError(f"K={self.K} is above the supported maximum K={MAX_K} (dense feature width)")
        object.__setattr__(self, "K", int(self.K))
        if str(self.dtype) not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {DTYPES}")
        object.__setattr__(self, "dtype", str(self.dtype))
        if not isinstance(self.A, CSR):
            raise TypeError("SparseOp.A must be a canonical CSR (use spcompile.core.formats.as_csr)")
        compute = np.dtype(_numerics.DTYPES[self.dtype].compute)
        if self.A.data.dtype != compute:   # the values in the workload's arithmetic type
            object.__setattr__(self, "A", self.A.astype(compute))

    @property
    def shape(self) -> tuple[int, int]:
        return self.A.shape

    @property
    def input_shapes(self) -> tuple[tuple[int, int], ...]:
        m, n = self.A.shape
        if self.op == "spmm":
            return ((n, self.K),)
        return ((m, self.K), (n, self.K))

    @property
    def output_shape(self) -> tuple[int, ...]:
        return (self.A.shape[0], self.K) if self.op == "spmm" else (self.A.nnz,)

    def key(self) -> WorkloadKey:
        cached = self.__dict__.get("_key")
        if cached is None:
            m, n = self.A.shape
            cached = WorkloadKey(self.op, self.reduce, m, n, self.A.nnz, self.dtype, self.K,
                                 pattern_hash(self.A), matrix_features(self.A))
            object.__setattr__(self, "_key", cached)
        return cached


@dataclass(frozen=True)
class PassRecord:
    """One entry of a module's pass log."""

    name: str
    options: Mapping[str, Any]
    seconds: float
    metrics: Mapping[str, Any]

    def to_dict(self) -> dict:
        return {"name": self.name, "options": dict(self.options), "seconds": self.seconds,
                "metrics": dict(self.metrics)}


def _compose(outer: np.ndarray | None, inner: np.ndarray | None) -> np.ndarray | None:
    """Permutation 'inner' applied on top of 'outer' (both new -> old)."""
    if inner is None:
        return outer
    inner = np.asarray(inner, dtype=np.int64)
    return inner if outer is None else outer[inner]


@dataclass(frozen=True, eq=False)
class SparseModule:
    """The op plus everything the passes produced.  Immutable: each pass returns a new one.

    ``A`` is the matrix in its current (permuted) order: ``A = op.A[row_perm][:, col_perm]``.
    ``row_perm`` / ``col_perm``: numpy int64 arrays, new position -> original index (None when
    unchanged).  ``nnz_perm[p]``: position in ``op.A``'s canonical arrays of the p-th stored entry
    of ``A`` (None when unchanged).  ``formats``: format data by name (e.g. ``"sgt"``).
    ``metrics``: per-pass quality metrics (plain dicts).  ``log``: the pass log.
    """

    op: SparseOp
    A: CSR
    row_perm: np.ndarray | None = None
    col_perm: np.ndarray | None = None
    nnz_perm: np.ndarray | None = None
    formats: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    metrics: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: MappingProxyType({}))
    log: tuple = ()
    attrs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_op(cls, op: SparseOp) -> "SparseModule":
        return cls(op=op, A=op.A)

    def replace(self, **changes) -> "SparseModule":
        for k in ("formats", "metrics", "attrs"):
            if k in changes:
                changes[k] = MappingProxyType(dict(changes[k]))
        return dataclasses.replace(self, **changes)

    def with_format(self, name: str, data: Any) -> "SparseModule":
        return self.replace(formats={**self.formats, name: data})

    def with_metrics(self, name: str, metrics: Mapping[str, Any]) -> "SparseModule":
        return self.replace(metrics={**self.metrics, name: dict(metrics)})

    def permute(self, row_perm=None, col_perm=None) -> "SparseModule":
        """Apply a row and/or column permutation (new position -> current index) on top of the
        current order.  Format data computed for the old order is dropped (it no longer applies)."""
        m, n = self.A.shape
        for name, p, size in (("row_perm", row_perm, m), ("col_perm", col_perm, n)):
            if p is not None:
                p = np.asarray(p)
                if p.shape != (size,) or not np.array_equal(np.sort(p), np.arange(size)):
                    raise ValueError(f"{name} must be a permutation of range({size})")
        if row_perm is None and col_perm is None:
            return self
        newA, src = permute_csr(self.A, row_perm, col_perm)
        nnz_perm = src if self.nnz_perm is None else self.nnz_perm[src]
        return self.replace(A=newA, row_perm=_compose(self.row_perm, row_perm),
                            col_perm=_compose(self.col_perm, col_perm), nnz_perm=nnz_perm, formats={})

    @property
    def symmetric_perm(self) -> bool:
        return self.row_perm is not None and self.col_perm is not None and \
            np.array_equal(self.row_perm, self.col_perm)
