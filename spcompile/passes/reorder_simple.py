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


@register_pass("reorder.rcm")
class RCMReorder(Pass):
    """Reverse Cuthill-McKee renumbering (symmetric on square matrices, rows only otherwise)."""

    default_options = {"symmetric_mode": True}

    def transform(self, mod, ctx):
        A = mod.A
        m, n = A.shape
        before = _mean_bandwidth(A)
        if m == n:
            S = A.to_scipy()
            S = (S + S.T).tocsr() if self.options["symmetric_mode"] else S
            perm = reverse_cuthill_mckee(sp.csr_matrix(S), symmetric_mode=True).astype(np.int64)
            out = mod.permute(perm, perm)
        else:  # rows by RCM of A A^T's pattern
            S = A.to_scipy()
            S = (S @ S.T).tocsr()
            perm = reverse_cuthill_mckee(S, symmetric_mode=True).astype(np.int64)
            out = mod.permute(perm, None)
        return out.with_metrics(self.name, {"bandwidth_before": before, "bandwidth_after": _mean_bandwidth(out.A)})


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
