"""Simple reorderings from scipy.sparse.csgraph: reverse Cuthill-McKee and degree sort."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import reverse_cuthill_mckee

from .base import Pass, register_pass


def _mean_bandwidth(A) -> float:
    if A.nnz == 0:
        return 0.0
    return float(np.mean(np.abs(A.row_ids.astype(np.int64) - A.indices.astype(np.int64))))


def _pattern(A, shape=None) -> sp.csr_matrix:
    """The pattern of CSR ``A`` as a scipy matrix (int8 ones: values play no part in RCM)."""
    return sp.csr_matrix((np.ones(A.nnz, dtype=np.int8), A.indices, A.indptr), shape=shape or A.shape)


#: above this many insertion-sort steps (sum of squared degrees) scipy's RCM, which sorts the
#: children of every vertex by insertion, would be quadratic in the largest degree: the
#: vectorised level-synchronous version below is used instead
SCIPY_RCM_MAX_WORK = 1 << 30
#: the vectorised version makes one numpy step per BFS level: a graph needing more is skipped
RCM_MAX_LEVELS = 20_000


class RCMSkipped(Exception):
    """RCM would cost more than its documented cap on this graph (the pass is skipped)."""


def _rcm_vectorised(P: sp.csr_matrix, max_levels: int = RCM_MAX_LEVELS) -> np.ndarray:
    """Reverse Cuthill-McKee of symmetric pattern ``P``, one vectorised step per BFS level for all
    components at once: each component starts at its lowest-degree vertex (components in the
    order of those vertices' degrees), a level's new vertices are ordered by their first parent's
    position, then by degree.  Time O(nnz log nnz + levels), memory O(nnz + n)."""
    from scipy.sparse.csgraph import connected_components

    n = P.shape[0]
    indptr = P.indptr.astype(np.int64)
    ind = P.indices.astype(np.int64)
    deg = np.diff(indptr)
    ncomp, labels = connected_components(P, directed=False)
    by_deg = np.lexsort((np.arange(n), deg))
    _, first = np.unique(labels[by_deg], return_index=True)
    comp_rank = np.empty(ncomp, dtype=np.int64)
    comp_rank[np.argsort(first, kind="stable")] = np.arange(ncomp)
    seeds = by_deg[np.sort(first)]
    visited = np.zeros(n, dtype=bool)
    visited[seeds] = True
    levels, frontier, nlev = [seeds], seeds, 0
    while frontier.size:
        nlev += 1
        if nlev > max_levels:
            raise RCMSkipped(f"more than {max_levels} BFS levels with vertices of degree up to {int(deg.max())}")
        lens = deg[frontier]
        total = int(lens.sum())
        if total == 0:
            break
        rep = np.repeat(np.arange(frontier.size, dtype=np.int64), lens)
        offs = np.cumsum(lens) - lens
        nb = ind[indptr[frontier][rep] + (np.arange(total, dtype=np.int64) - offs[rep])]
        keep = ~visited[nb]
        nb, rep = nb[keep], rep[keep]
        if nb.size == 0:
            break
        u, at = np.unique(nb, return_index=True)   # first occurrence: the first parent reaching it
        nxt = u[np.lexsort((at, deg[u], rep[at]))]
        visited[nxt] = True
        levels.append(nxt)
        frontier = nxt
    seq = np.concatenate(levels)
    lvl = np.repeat(np.arange(len(levels)), [a.size for a in levels])
    order = seq[np.lexsort((np.arange(seq.size), lvl, comp_rank[labels[seq]]))]
    return order[::-1].copy()


def rcm_order(P: sp.csr_matrix) -> tuple[np.ndarray, str]:
    """RCM order of symmetric pattern ``P`` and the method used: scipy's where its cost (the sum
    of squared degrees) is small, else the vectorised version.  :class:`RCMSkipped` when even
    that would exceed :data:`RCM_MAX_LEVELS`."""
    deg = np.diff(P.indptr).astype(np.float64)
    if float(np.dot(deg, deg)) <= SCIPY_RCM_MAX_WORK:
        return reverse_cuthill_mckee(P, symmetric_mode=True).astype(np.int64), "scipy"
    return _rcm_vectorised(P), "vectorised"


def bipartite_rcm_rows(A) -> tuple[np.ndarray, str]:
    """Row order of a non-square (or unsymmetric) matrix by RCM of its bipartite graph: rows and
    columns are the vertices, stored entries the edges (the symmetric (m+n) x (m+n) matrix
    [[0, A], [A^T, 0]]); the rows in the order RCM visits them.  Linear in nnz + m + n (never
    forms A A^T, whose size grows with the square of the column lengths).  Returns the order and
    the method (see :func:`rcm_order`)."""
    m, n = A.shape
    P = _pattern(A)
    B = sp.bmat([[None, P], [P.T, None]], format="csr", dtype=np.int8) if m and n else sp.csr_matrix((m + n, m + n))
    order, how = rcm_order(B)
    return order[order < m], how


@register_pass("reorder.rcm")
class RCMReorder(Pass):
    """Reverse Cuthill-McKee renumbering: on square matrices rows and columns by RCM of the
    pattern of A + A^T (``symmetric_mode=False``: of A's pattern as given), otherwise rows only,
    by RCM of the bipartite row/column graph.  Time and memory linear in nnz + rows + columns."""

    default_options = {"symmetric_mode": True}

    def transform(self, mod, ctx):
        A = mod.A
        m, n = A.shape
        before = _mean_bandwidth(A)
        try:
            if m == n:
                S = _pattern(A)
                S = (S + S.T).tocsr() if self.options["symmetric_mode"] else S
                if not self.options["symmetric_mode"]:
                    perm = reverse_cuthill_mckee(S, symmetric_mode=False).astype(np.int64)
                    method = "scipy"
                else:
                    perm, method = rcm_order(S)
                out = mod.permute(perm, perm)
                how = "symmetric" if self.options["symmetric_mode"] else "pattern"
            else:
                perm, method = bipartite_rcm_rows(A)
                out = mod.permute(perm, None)
                how = "bipartite"
        except RCMSkipped as e:
            return mod.with_metrics(self.name, {"bandwidth_before": before, "bandwidth_after": before,
                                                "skipped": True, "skip_reason": str(e)})
        return out.with_metrics(self.name, {"bandwidth_before": before, "bandwidth_after": _mean_bandwidth(out.A),
                                            "graph": how, "method": method, "skipped": False})


@register_pass("reorder.degree")
class DegreeSort(Pass):
    """Rows sorted by decreasing number of stored entries (load balance for row-parallel kernels)."""

    default_options = {"descending": True}

    def transform(self, mod, ctx):
        lens = mod.A.row_lengths
        key = -lens if self.options["descending"] else lens
        perm = np.argsort(key, kind="stable").astype(np.int64)
        out = mod.permute(perm, None)
        return out.with_metrics(self.name, {"max_row": int(lens.max()) if lens.size else 0,
                                            "first_row_len": int(out.A.row_lengths[0]) if lens.size else 0})
