"""Community order: rows renumbered so that each community of the graph (Leiden, modularity;
python-igraph's C implementation) is a run of consecutive rows, ordered inside by reverse
Cuthill-McKee of its own edges.  Neighbouring rows then share most of their columns, which a
kernel that gives each SM a run of consecutive rows (csr.crc_cwm ``sm_local``) turns into L1 hits
of the gathered X rows."""
from __future__ import annotations

import random

import numpy as np
import scipy.sparse as sp

from .base import Pass, register_pass
from .reorder_simple import RCMSkipped, _mean_bandwidth, _pattern, rcm_order


def leiden_membership(S: sp.csr_matrix, resolution: float = 1.0, seed: int = 0, iterations: int = 2) -> np.ndarray:
    """Community of every vertex of the symmetric pattern ``S`` (Leiden on modularity, igraph),
    deterministic for a given ``seed`` (igraph draws from a seeded ``random.Random`` for the
    call; the process-wide generator is restored afterwards)."""
    import igraph

    n = S.shape[0]
    C = sp.triu(S, k=1).tocoo()
    g = igraph.Graph(n=n, edges=np.column_stack([C.row, C.col]).astype(np.int64), directed=False)
    igraph.set_random_number_generator(random.Random(seed))
    try:
        part = g.community_leiden(objective_function="modularity", resolution=float(resolution),
                                  n_iterations=int(iterations))
    finally:
        igraph.set_random_number_generator(random)
    return np.asarray(part.membership, dtype=np.int64)


def community_order(S: sp.csr_matrix, membership: np.ndarray) -> tuple[np.ndarray, str]:
    """Vertices grouped by community, each community's run ordered by RCM of its own edges,
    communities in the order RCM of those edges reaches them first.  Vectorised: one RCM of the
    pattern without the edges between communities.  Returns the order and the RCM method."""
    C = S.tocoo()
    keep = membership[C.row] == membership[C.col]
    intra = sp.csr_matrix((np.ones(int(keep.sum()), np.int8), (C.row[keep], C.col[keep])), shape=S.shape)
    rcm, method = rcm_order(intra)
    pos = np.empty_like(rcm)
    pos[rcm] = np.arange(rcm.size)
    ncomm = int(membership.max()) + 1 if membership.size else 0
    first = np.full(ncomm, np.iinfo(np.int64).max)
    np.minimum.at(first, membership, pos)
    return np.lexsort((pos, first[membership])).astype(np.int64), method


@register_pass("reorder.community")
class CommunityReorder(Pass):
    """Rows and columns renumbered by community (Leiden on the pattern of A + A^T, igraph), RCM
    inside each community; square matrices only (others are left as they are, the pass says
    so in its metrics).  Time about linear in nnz (igraph's Leiden, one RCM)."""

    default_options = {"resolution": 1.0, "seed": 0}

    def transform(self, mod, ctx):
        A = mod.A
        m, n = A.shape
        before = _mean_bandwidth(A)
        if m != n:
            return mod.with_metrics(self.name, {"skipped": True, "skip_reason": "not square",
                                                "bandwidth_before": before, "bandwidth_after": before})
        S = _pattern(A)
        S = (S + S.T).tocsr()
        S.setdiag(0)
        S.eliminate_zeros()
        member = leiden_membership(S, self.options["resolution"], int(self.options["seed"]))
        try:
            perm, method = community_order(S, member)
        except RCMSkipped as e:
            return mod.with_metrics(self.name, {"skipped": True, "skip_reason": str(e),
                                                "bandwidth_before": before, "bandwidth_after": before})
        out = mod.permute(perm, perm)
        return out.with_metrics(self.name, {"communities": int(member.max()) + 1 if member.size else 0,
                                            "bandwidth_before": before, "bandwidth_after": _mean_bandwidth(out.A),
                                            "method": method, "skipped": False})
