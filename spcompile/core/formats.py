"""CSR canonicalisation, input validation and permutation of sparse matrices.

Every input a user hands to spcompile (scipy sparse in any format, torch sparse COO/CSR,
or raw ``(indptr, indices, data, shape)`` arrays) is turned into one canonical form,
:class:`CSR`: sorted column indices inside each row, duplicates summed, explicit zeros kept
as stored entries, int32 indices when they fit and int64 otherwise.  Bad input raises a
``TypeError`` (wrong kind of object / dtype) or ``ValueError`` (wrong values) that says what
was wrong.  Format containers produced by passes (SGT blocks, V:N:M, ASpT tiles) live in the
modules of the passes that produce them and are stored in ``SparseModule.formats``.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

import numpy as np

# scipy is imported where a function needs it, not here: loading and calling a saved module
# (``import spcompile; spcompile.load(p)(X)``) never needs it

INT32_MAX = np.iinfo(np.int32).max

__all__ = ["CSR", "as_csr", "permute_csr", "index_dtype_for"]


def index_dtype_for(nnz: int, shape: tuple[int, int]) -> np.dtype:
    """int32 when every index and offset fits, int64 otherwise."""
    return np.dtype(np.int32) if max(nnz, shape[0], shape[1]) <= INT32_MAX else np.dtype(np.int64)


@dataclass(frozen=True, eq=False)
class CSR:
    """A canonical CSR matrix (sorted indices, no duplicates). Arrays are read-only."""

    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    shape: tuple[int, int]

    def __post_init__(self):
        for a in (self.indptr, self.indices, self.data):
            a.setflags(write=False)

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    @property
    def row_lengths(self) -> np.ndarray:
        return np.diff(self.indptr)

    @property
    def row_ids(self) -> np.ndarray:
        """Row index of every stored entry (length nnz).  On matrices with far fewer entries than
        rows (huge, mostly empty) found by binary search: memory O(nnz), not O(rows)."""
        m, nnz = self.shape[0], self.nnz
        if nnz * 8 < m:
            return (np.searchsorted(self.indptr, np.arange(nnz), side="right") - 1).astype(self.indices.dtype)
        return np.repeat(np.arange(m, dtype=self.indices.dtype), self.row_lengths)

    def to_scipy(self) -> "scipy.sparse.csr_matrix":  # noqa: F821
        import scipy.sparse as sp

        m = sp.csr_matrix((self.data, self.indices, self.indptr), shape=self.shape, copy=False)
        m.has_sorted_indices = True
        return m

    def astype(self, dtype) -> "CSR":
        return CSR(self.indptr, self.indices, self.data.astype(dtype, copy=False), self.shape)

    def __repr__(self) -> str:
        return f"CSR(shape={self.shape}, nnz={self.nnz}, dtype={self.data.dtype}, index={self.indices.dtype})"


def _check_shape(shape) -> tuple[int, int]:
    try:
        items = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a pair of ints, got {shape!r}") from None
    if any(isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) for s in items):
        raise TypeError(f"shape must be a pair of ints, got {shape!r}")
    shape = tuple(int(s) for s in items)
    if len(shape) != 2:
        raise ValueError(f"sparse matrix must be 2-D, got shape {shape}")
    if shape[0] < 0 or shape[1] < 0:
        raise ValueError(f"shape must be non-negative, got {shape}")
    return shape


def _check_value_dtype(data: np.ndarray, dtype) -> np.ndarray:
    if data.dtype.kind == "c":
        raise TypeError(f"complex matrix values ({data.dtype}) are not supported")
    if data.dtype.kind not in "biuf":
        raise TypeError(f"matrix values must be numeric, got dtype {data.dtype}")
    return np.ascontiguousarray(data, dtype=dtype)


def _from_arrays(indptr, indices, data, shape, dtype) -> CSR:
    shape = _check_shape(shape)
    m, n = shape
    indptr = np.asarray(indptr)
    indices = np.asarray(indices)
    data = np.asarray(data)
    for name, a in (("indptr", indptr), ("indices", indices)):
        if a.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got {a.ndim}-D")
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if data.ndim != 1:
        raise ValueError(f"data must be 1-D, got {data.ndim}-D")
    if indptr.shape[0] != m + 1:
        raise ValueError(f"indptr must have rows+1 = {m + 1} entries, got {indptr.shape[0]}")
    indptr = indptr.astype(np.int64, copy=False)
    if indptr[0] != 0:
        raise ValueError(f"indptr must start at 0, got {indptr[0]}")
    if m and np.any(np.diff(indptr) < 0):
        bad = int(np.flatnonzero(np.diff(indptr) < 0)[0])
        raise ValueError(f"indptr must be non-decreasing (monotone): indptr[{bad + 1}] < indptr[{bad}]")
    nnz = int(indptr[-1])
    if indices.shape[0] != nnz or data.shape[0] != nnz:
        raise ValueError(
            f"indptr[-1] = {nnz} but indices has {indices.shape[0]} and data {data.shape[0]} entries")
    if nnz:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0:
            raise ValueError(f"negative column index {lo}")
        if hi >= n:
            raise ValueError(f"column index {hi} out of range for {n} columns")
    data = _check_value_dtype(data, dtype)
    import scipy.sparse as sp

    mat = sp.csr_matrix((data, indices.astype(np.int64, copy=False), indptr), shape=shape)
    if not mat.has_canonical_format:
        # the arrays may be the caller's (no copy above): sort / merge a copy, never the caller's matrix
        mat = mat.copy()
        mat.sum_duplicates()  # sorts indices too; explicit zeros stay stored
    idt = index_dtype_for(mat.nnz, shape)
    return CSR(np.ascontiguousarray(mat.indptr, dtype=idt), np.ascontiguousarray(mat.indices, dtype=idt),
               np.ascontiguousarray(mat.data, dtype=dtype), shape)


def _from_torch(A, dtype) -> CSR:
    import torch  # only reached when torch is already imported

    if A.layout == torch.sparse_coo:
        if A.dim() != 2:
            raise ValueError(f"sparse matrix must be 2-D, got a {A.dim()}-D torch tensor")
        A = A.coalesce()
        idx = A.indices().detach().cpu().numpy()
        vals = A.values().detach().cpu()
        if vals.dim() != 1:
            raise ValueError("hybrid torch sparse tensors (dense trailing dims) are not supported")
        vals = vals.float().numpy() if vals.dtype in (torch.bfloat16,) else vals.numpy()
        shape = _check_shape(A.shape)
        if idx.size and idx.min() < 0:
            raise ValueError("negative index in torch COO tensor")
        import scipy.sparse as sp

        coo = sp.coo_matrix((vals, (idx[0], idx[1])), shape=shape)
        csr = coo.tocsr()
        return _from_arrays(csr.indptr, csr.indices, csr.data, shape, dtype)
    if A.layout == torch.sparse_csr:
        vals = A.values().detach().cpu()
        vals = vals.float().numpy() if vals.dtype in (torch.bfloat16,) else vals.numpy()
        return _from_arrays(A.crow_indices().cpu().numpy(), A.col_indices().cpu().numpy(), vals,
                            tuple(A.shape), dtype)
    if A.layout == torch.strided:
        raise TypeError("got a dense torch tensor; pass A.to_sparse_csr() or a scipy sparse matrix")
    raise TypeError(f"unsupported torch sparse layout {A.layout}; use COO or CSR")


def as_csr(A, dtype=np.float32) -> CSR:
    """Canonicalise any supported sparse input to :class:`CSR` with values of ``dtype``."""
    dtype = np.dtype(dtype)
    if isinstance(A, CSR):
        return A if A.data.dtype == dtype else A.astype(dtype)
    scipy_sparse = sys.modules.get("scipy.sparse")  # a scipy matrix means scipy is imported
    if scipy_sparse is not None and scipy_sparse.issparse(A):
        if A.ndim != 2:
            raise ValueError(f"sparse matrix must be 2-D, got {A.ndim}-D")
        if A.format == "csr":
            return _from_arrays(A.indptr, A.indices, A.data, A.shape, dtype)
        # scipy's conversions trust the index arrays (out-of-range entries are silently dropped or
        # crash the process), so every other format is checked before it is converted
        if A.format == "coo":
            for what, idx, size in (("row", A.row, A.shape[0]), ("column", A.col, A.shape[1])):
                idx = np.asarray(idx)
                if idx.size and idx.dtype.kind not in "iu":
                    raise TypeError(f"COO {what} indices must be integers, got dtype {idx.dtype}")
                if idx.size and idx.min() < 0:
                    raise ValueError(f"negative {what} index {int(idx.min())} in COO matrix")
                if idx.size and idx.max() >= size:
                    raise ValueError(f"{what} index {int(idx.max())} out of range for {size} {what}s in COO matrix")
        elif A.format in ("csc", "bsr"):
            for name in ("indptr", "indices"):
                a = np.asarray(getattr(A, name))
                if a.size and a.dtype.kind not in "iu":
                    raise TypeError(f"{A.format} {name} must hold integers, got dtype {a.dtype}")
            chk = A.copy()  # check_format may prune / recast arrays in place: never touch the caller's
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    chk.check_format(full_check=True)
            except ValueError as e:
                raise ValueError(f"invalid {A.format} matrix: {e}") from None
        try:
            csr = A.tocsr()
        except (ValueError, IndexError) as e:
            raise ValueError(f"invalid {A.format} matrix: {e}") from None
        return _from_arrays(csr.indptr, csr.indices, csr.data, A.shape, dtype)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(A, torch.Tensor):
        return _from_torch(A, dtype)
    if isinstance(A, tuple) and len(A) == 4:
        indptr, indices, data, shape = A
        return _from_arrays(indptr, indices, data, shape, dtype)
    if isinstance(A, np.ndarray):
        raise TypeError("got a dense numpy array; pass scipy.sparse.csr_matrix(A) to use it as a sparse matrix")
    raise TypeError(
        f"unsupported sparse input of type {type(A).__name__}; expected a scipy sparse matrix/array, "
        "a torch sparse COO/CSR tensor, or a tuple (indptr, indices, data, shape)")


def permute_csr(A: CSR, row_perm: np.ndarray | None, col_perm: np.ndarray | None):
    """Return ``(A[row_perm][:, col_perm], src)``, canonical, where ``src[p]`` is the position in
    ``A``'s arrays of the new matrix's p-th stored entry.  Permutations map new position -> old index.
    Vectorised: O(nnz log nnz) numpy work, no Python loop."""
    m, n = A.shape
    lengths = A.row_lengths.astype(np.int64)
    if row_perm is not None:
        row_perm = np.asarray(row_perm, dtype=np.int64)
        new_len = lengths[row_perm]
        starts = A.indptr.astype(np.int64)[row_perm]
        new_indptr = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(new_len, out=new_indptr[1:])
        # src[p] = starts[row] + (p - new_indptr[row])
        src = np.arange(A.nnz, dtype=np.int64) - np.repeat(new_indptr[:-1] - starts, new_len)
    else:
        new_indptr = A.indptr.astype(np.int64)
        src = np.arange(A.nnz, dtype=np.int64)
    cols = A.indices[src].astype(np.int64)
    if col_perm is not None:
        col_perm = np.asarray(col_perm, dtype=np.int64)
        inv = np.empty(n, dtype=np.int64)
        inv[col_perm] = np.arange(n, dtype=np.int64)
        cols = inv[cols]
        rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(new_indptr))
        order = np.lexsort((cols, rows))
        cols = cols[order]
        src = src[order]
    idt = A.indices.dtype
    out = CSR(new_indptr.astype(idt), cols.astype(idt), A.data[src], A.shape)
    return out, src
