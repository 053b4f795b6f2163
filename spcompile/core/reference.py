"""float64 scipy reference implementations of every op (used by tests and the tuner's runner)."""
from __future__ import annotations

import os

import numpy as np

from .formats import CSR

#: products (nonzeros x K) from which the host references run on several threads
PARALLEL_WORK = 1 << 22


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def host_threads() -> int:
    """CPUs this process may run on (at most 16): the threads of the large host references."""
    return min(16, available_cpus())


def row_blocks(indptr, parts: int) -> list[tuple[int, int]]:
    """``parts`` ranges of whole rows holding about equal numbers of nonzeros (empty ones dropped)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    m, nnz = indptr.shape[0] - 1, int(indptr[-1])
    cuts = np.searchsorted(indptr, np.linspace(0, nnz, parts + 1)[1:-1], side="left")
    cuts = np.unique(np.concatenate(([0], np.clip(cuts, 0, m), [m])))
    return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _csr_matmul(S, X: np.ndarray) -> np.ndarray:
    """``S @ X`` (float64), over row blocks on several threads for large products (scipy's kernel
    releases the GIL; each row is summed in its stored order either way: the same bits)."""
    threads = host_threads()
    if threads == 1 or S.nnz * X.shape[1] < PARALLEL_WORK:
        return np.asarray(S @ X)
    from concurrent.futures import ThreadPoolExecutor

    Y = np.empty((S.shape[0], X.shape[1]), dtype=np.float64)

    def block(r):
        Y[r[0]:r[1]] = S[r[0]:r[1]] @ X

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(block, row_blocks(S.indptr, 4 * threads)))
    return Y


def spmm(A: CSR, X: np.ndarray, reduce: str = "sum") -> np.ndarray:
    """float64 ``reduce_j A[i, j] * X[j, :]``; empty rows give 0 for every reduction."""
    import scipy.sparse as sp

    X = np.asarray(X, dtype=np.float64)
    S = sp.csr_matrix((A.data.astype(np.float64), A.indices, A.indptr), shape=A.shape)
    lens = A.row_lengths
    if reduce in ("sum", "mean"):
        Y = _csr_matmul(S, X)
        if reduce == "mean":
            Y = Y / np.maximum(lens, 1)[:, None]
        return np.asarray(Y)
    if reduce not in ("max", "min"):
        raise ValueError(f"unknown reduce {reduce!r}")
    m, K = A.shape[0], X.shape[1]
    prod = A.data.astype(np.float64)[:, None] * X[A.indices]
    ufunc = np.maximum if reduce == "max" else np.minimum
    Y = np.zeros((m, K))
    nonempty = lens > 0
    if A.nnz:
        starts = A.indptr[:-1][nonempty]
        Y[nonempty] = ufunc.reduceat(prod, starts, axis=0)
    return Y


def sddmm(A: CSR, X: np.ndarray, Y: np.ndarray, block: int = 1 << 24) -> np.ndarray:
    """float64 ``A.data[p] * dot(X[i], Y[j])`` for each stored (i, j), in A's CSR order.  Computed
    over blocks of whole rows of about ``block`` gathered doubles, so memory stays bounded (never
    nnz x K doubles at once on a large graph)."""
    X = np.asarray(X, dtype=np.float64)
    Y = np.asarray(Y, dtype=np.float64)
    indptr = np.asarray(A.indptr, dtype=np.int64)
    m, K = A.shape[0], X.shape[1] if X.ndim == 2 else 1
    out = np.empty(A.nnz, dtype=np.float64)
    per = max(1, block // max(K, 1))
    r0 = 0
    while r0 < m:
        r1 = int(np.searchsorted(indptr, indptr[r0] + per, side="right")) - 1
        r1 = min(m, max(r1, r0 + 1))
        p0, p1 = int(indptr[r0]), int(indptr[r1])
        rows = np.repeat(np.arange(r0, r1), np.diff(indptr[r0:r1 + 1]))
        out[p0:p1] = A.data[p0:p1].astype(np.float64) * np.einsum("ij,ij->i", X[rows], Y[A.indices[p0:p1]])
        r0 = r1
    return out


def run(op: str, reduce, A: CSR, *inputs) -> np.ndarray:
    return spmm(A, inputs[0], reduce) if op == "spmm" else sddmm(A, *inputs)


def rel_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / denom) if denom > 0 else float(num)
