"""``cluster.lsh``: row reordering by MinHash-LSH + hierarchical clustering (Jiang, Hong, Agrawal,
"A Novel Data Transformation and Execution Strategy for Accelerating Sparse Matrix Multiplication
on GPUs", PPoPP'20, Algorithm 3).

Pipeline of the pass (vectorised numpy throughout):

1. MinHash signatures of every row's column set (``siglen`` random hash tables over the column
   ids; per row ``np.minimum.reduceat``).
2. Banding: ``siglen / bsize`` bands of ``bsize`` signature values; rows whose band values agree
   fall into one bucket.  Inside a bucket (rows in random order) each row is paired with its next
   ``window`` rows, so a bucket of s rows gives at most ``s * window`` pairs instead of s^2/2; a
   bucket of at most ``window + 1`` rows gives all its pairs, as in the paper.  If more than
   ``max_pairs`` distinct pairs remain, those colliding in the most bands are kept.
3. Jaccard similarity of each candidate pair (exact, or estimated from the signatures when the
   exact work would be too large: ``similarity="auto"``).
4. Algorithm 3: pairs by decreasing similarity, union-find clusters, the smaller cluster merged
   into the larger (ties: the smaller row index represents), a cluster reaching ``threshold_size``
   rows is closed; pairs whose rows no longer represent their clusters are re-queued with the
   representatives' similarity.  The heap's sequential pops become rounds (``cluster_rows``): each
   round merges every pair that is the most similar pair of both its clusters.  Rows are then
   output cluster by cluster (clusters in order of their representative, rows ascending inside a
   cluster).

Rounds (ASpT-RR, the paper's Fig. 5): ``round=1`` permutes the module's rows (``row_perm``; the
dense input X is not permuted, only the output rows, which the compiled module un-permutes) so
that similar rows share ASpT row panels.  It is skipped when the dense-tile ratio before it is
above ``skip_dense_ratio`` (10 %).  ``round=2`` reorders the *sparse remainder*: when the module
holds an ASpT format (``tile.aspt`` ran before), only the processing order of the remainder rows
(``formats["aspt"].rem_rows``) is permuted and the panels / dense tiles stay as they are; without
an ASpT format the whole matrix is the remainder and its rows are permuted.  It is skipped when
the average Jaccard similarity of consecutive (remainder) rows is above ``skip_similarity`` (0.1).
``round="auto"`` (default) means 2 when an ASpT format is present, else 1.  ASpT-RR is therefore
``["cluster.lsh", "tile.aspt", "cluster.lsh"]``.  A round-1 run on a module that already holds an
ASpT format re-tiles it with the same parameters (``SparseModule.permute`` drops format data).
"""
from __future__ import annotations

import time

import numpy as np

from ..core.formats import CSR
from .base import Pass, register_pass
from .tile_aspt import build_aspt, dense_ratio

__all__ = ["minhash_signatures", "lsh_candidate_pairs", "jaccard_pairs", "consecutive_similarity",
           "cluster_rows", "lsh_order", "row_pattern", "ClusterLSH"]

_U32_MAX = np.uint32(0xFFFFFFFF)
#: the merge rounds stop once they have looked at this many times the candidate pairs (the shared
#: graphs need at most 85x, with threshold_size=256)
MAX_MERGE_WORK = 256.0
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _lengths(A: CSR) -> np.ndarray:
    return np.diff(A.indptr.astype(np.int64))


def minhash_signatures(A: CSR, siglen: int = 128, seed: int = 0, block: int = 16,
                       chunk_nnz: int = 1 << 21) -> np.ndarray:
    """(m, siglen) uint32 MinHash signatures of the rows' column sets: ``sig[i, k] = min over the
    columns c of row i of H_k[c]`` with ``H_k`` a random uint32 table over the columns.  Empty rows
    get 0xFFFFFFFF everywhere.  Work: siglen x nnz gathers, ``block`` hash functions at a time."""
    m, n = A.shape
    sig = np.full((m, siglen), _U32_MAX, dtype=np.uint32)
    if A.nnz == 0 or siglen == 0:
        return sig
    rng = np.random.default_rng(seed)
    indptr = A.indptr.astype(np.int64)
    lens = np.diff(indptr)
    ind = A.indices
    # blocks of hash functions on several threads (each writes its own columns), at most
    # ``threads`` tables of n x block drawn ahead, in the order one thread draws them
    threads = min(_pass_threads(A.nnz * siglen // 64), max(1, (1 << 29) // max(1, 4 * n * block)))
    chunk_nnz = max(1 << 16, chunk_nnz // threads)
    # row-aligned chunks of about chunk_nnz entries keep the gathered (chunk, block) array small
    cuts = np.unique(np.clip(np.searchsorted(indptr, np.arange(0, A.nnz + chunk_nnz, chunk_nnz)), 0, m))
    cuts = np.unique(np.concatenate(([0], cuts, [m])))

    def fill(job):
        k0, H = job
        kb = H.shape[1]
        for a, b in zip(cuts[:-1], cuts[1:]):
            s = indptr[a:b]
            nz = lens[a:b] > 0
            if not nz.any():
                continue
            g = H[ind[s[0]:indptr[b]]]
            sig[a:b, k0:k0 + kb][nz] = np.minimum.reduceat(g, (s - s[0])[nz], axis=0)

    tables = ((k0, rng.integers(0, 1 << 32, size=(n, min(block, siglen - k0)), dtype=np.uint32))
              for k0 in range(0, siglen, block))
    for _ in _in_order(fill, tables, threads):
        pass
    return sig


def oph_signatures(A: CSR, siglen: int = 128, seed: int = 0, chunk_rows: int = 1 << 15) -> np.ndarray:
    """(m, siglen) uint32 signatures by densified one-permutation hashing: one random hash per
    column, its top bits choose one of ``siglen`` bins, the row's minimum per bin is kept, and
    empty bins borrow the next non-empty bin (circularly) plus an offset per step.  Collision
    probability per bin is still the Jaccard similarity; cost is one pass over the entries instead
    of ``siglen`` (used for large matrices, see ``lsh_order``)."""
    m, n = A.shape
    sig = np.full((m, siglen), _U32_MAX, dtype=np.uint32)
    if A.nnz == 0 or siglen == 0:
        return sig
    rng = np.random.default_rng(seed)
    H = rng.integers(0, 1 << 32, size=n, dtype=np.uint32)
    h = H[A.indices]
    b = ((h.astype(np.uint64) * np.uint64(siglen)) >> np.uint64(32)).astype(np.int64)
    flat = np.repeat(np.arange(m, dtype=np.int64), _lengths(A)) * siglen + b
    np.minimum.at(sig.reshape(-1), flat, h)
    nonempty_rows = np.flatnonzero(_lengths(A) > 0)
    ar = np.arange(2 * siglen)
    for a in range(0, nonempty_rows.shape[0], chunk_rows):
        rows = nonempty_rows[a:a + chunk_rows]
        s2 = np.concatenate([sig[rows], sig[rows]], axis=1)
        idx = np.where(s2 != _U32_MAX, ar, 4 * siglen)
        nxt = np.minimum.accumulate(idx[:, ::-1], axis=1)[:, ::-1][:, :siglen]
        dist = (nxt - ar[:siglen]).astype(np.uint64)
        val = np.take_along_axis(s2, nxt, axis=1).astype(np.uint64)
        sig[rows] = ((val + dist * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return sig


def _band_keys(sig: np.ndarray, b: int, bsize: int) -> np.ndarray:
    cols = sig[:, b * bsize:(b + 1) * bsize].astype(np.uint64)
    if bsize == 1:
        return cols[:, 0]
    if bsize == 2:  # exact: two 32-bit values side by side
        return (cols[:, 0] << np.uint64(32)) | cols[:, 1]
    key = np.zeros(cols.shape[0], dtype=np.uint64)
    for c in range(bsize):  # 64-bit mix; a rare false collision only adds a candidate pair
        key = (key ^ cols[:, c]) * _MIX
        key ^= key >> np.uint64(29)
    return key


def _merge_counts(keys, counts, new_keys):
    if keys is None:
        u, c = np.unique(new_keys, return_counts=True)
        return u, c.astype(np.int64)
    allk = np.concatenate([keys, new_keys])
    u, inv = np.unique(allk, return_inverse=True)
    w = np.concatenate([counts, np.ones(new_keys.shape[0], dtype=np.int64)])
    return u, np.bincount(inv, weights=w, minlength=u.shape[0]).astype(np.int64)


def _pass_threads(work: int) -> int:
    """Threads for a pass step of ``work`` elements: one below 2**20, else the host's."""
    from ..core.reference import host_threads

    return host_threads() if work >= 1 << 20 else 1


def _in_order(fn, items, threads: int):
    """``fn(item)`` for each item, yielded in order; on ``threads`` > 1 threads computing at most
    ``threads`` items ahead of the consumer (which may stop early: the rest is not started)."""
    if threads <= 1:
        for it in items:
            yield fn(it)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as ex:
        it = iter(items)
        ahead = deque(ex.submit(fn, x) for _, x in zip(range(threads), it))
        try:
            while ahead:
                res = ahead.popleft().result()
                nxt = next(it, None)
                if nxt is not None:
                    ahead.append(ex.submit(fn, nxt))
                yield res
        finally:
            for f in ahead:
                f.cancel()


def _band_pairs(sig: np.ndarray, rows: np.ndarray, b0: int, b1: int, bsize: int, window: int) -> list:
    """Bands ``b0 <= b < b1``: for each, the keys ``lo * m + hi`` of the pairs of rows it puts in
    one bucket, each row paired with its next ``window`` rows there (a list of arrays per band).
    The bands' signature columns are read once, in row order; the keys are then taken in the
    random order of ``rows``."""
    m = sig.shape[0]
    block = np.ascontiguousarray(sig[:, b0 * bsize:b1 * bsize])
    out = []
    for b in range(b1 - b0):
        bk = _band_keys(block, b, bsize)[rows]
        order = np.argsort(bk, kind="stable")
        sk = bk[order]
        ro = rows[order]
        parts = []
        for d in range(1, window + 1):
            if d >= ro.shape[0]:
                break
            same = sk[d:] == sk[:-d]
            if not same.any():
                break  # no bucket has more than d rows
            a, c = ro[:-d][same], ro[d:][same]
            parts.append(np.minimum(a, c) * m + np.maximum(a, c))
        out.append(parts)
    return out


def lsh_candidate_pairs(sig: np.ndarray, rows: np.ndarray | None = None, bsize: int = 2, window: int = 8,
                        max_pairs: int | None = None, seed: int = 0):
    """Candidate pairs by banding the signatures of ``rows`` (default: all rows).

    Returns ``(i, j, hits)``: int64 row ids with i < j and the number of bands in which the pair
    collided (a similarity estimate used to keep the best ``max_pairs`` pairs)."""
    m, siglen = sig.shape
    rows = np.arange(m, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    e = np.zeros(0, dtype=np.int64)
    if rows.shape[0] < 2 or siglen < bsize:
        return e, e, e
    rng = np.random.default_rng(seed + 0x5EED)
    rows = rows[rng.permutation(rows.shape[0])]  # random order inside each bucket
    keys = counts = None
    pending: list[np.ndarray] = []
    pending_n = generated = 0
    flush_at = max(1 << 22, 4 * rows.shape[0], 2 * (max_pairs or 0))
    per = max(1, 16 // bsize)   # bands per slice: 16 signature values (one 64-byte line) a row
    nb = siglen // bsize
    groups = [(g, min(g + per, nb)) for g in range(0, nb, per)]
    done = False
    for bands in _in_order(lambda g: _band_pairs(sig, rows, g[0], g[1], bsize, window), groups,
                           _pass_threads(rows.shape[0] * per)):
        for parts in bands:
            pending += parts
            n = sum(p.shape[0] for p in parts)
            pending_n += n
            generated += n
            if pending_n > flush_at:
                keys, counts = _merge_counts(keys, counts, np.concatenate(pending))
                pending, pending_n = [], 0
                if max_pairs is not None and (keys.shape[0] >= 2 * max_pairs or generated >= 8 * max_pairs):
                    done = True  # enough pairs: the most similar ones collide in almost every band anyway
                    break
        if done:
            break
    if pending:
        keys, counts = _merge_counts(keys, counts, np.concatenate(pending))
    if keys is None:
        return e, e, e
    if max_pairs is not None and keys.shape[0] > max_pairs:
        keep = np.sort(np.argsort(-counts, kind="stable")[:max_pairs])
        keys, counts = keys[keep], counts[keep]
    return keys // m, keys % m, counts


def row_pattern(A: CSR):
    """The column sets of ``A``'s rows as a scipy CSR matrix of ones (duplicates summed to one)."""
    import scipy.sparse as sp

    P = sp.csr_matrix((np.ones(A.nnz, dtype=np.int32), A.indices, A.indptr), shape=A.shape)
    P.sum_duplicates()
    P.data[:] = 1
    return P


def jaccard_pairs(A: CSR, i, j, pattern=None, chunk: int = 1 << 22) -> np.ndarray:
    """Exact Jaccard similarity |S_i & S_j| / |S_i | S_j| of the column sets of row pairs (i, j):
    the intersections are scipy's row-by-row merge of the two rows (``P[i].multiply(P[j])`` on the
    pattern ``P``, see :func:`row_pattern`), about ``chunk`` entries at a time.  Two empty rows
    have similarity 0."""
    i = np.asarray(i, dtype=np.int64)
    j = np.asarray(j, dtype=np.int64)
    out = np.zeros(i.shape[0])
    if i.shape[0] == 0 or A.nnz == 0:
        return out
    P = row_pattern(A) if pattern is None else pattern
    lens = np.diff(P.indptr.astype(np.int64))
    li, lj = lens[i], lens[j]
    csum = np.cumsum(li + lj)
    inter = np.zeros(i.shape[0])
    start = 0
    while start < i.shape[0]:
        # pairs [start, stop) hold about `chunk` entries
        stop = int(np.searchsorted(csum, (csum[start - 1] if start else 0) + chunk, side="right"))
        stop = max(stop, start + 1)
        inter[start:stop] = np.asarray(P[i[start:stop]].multiply(P[j[start:stop]]).sum(axis=1)).ravel()
        start = stop
    union = li + lj - inter
    np.divide(inter, union, out=out, where=union > 0)
    return out


def consecutive_similarity(A: CSR) -> float:
    """Average Jaccard similarity of consecutive rows (the paper's §4 indicator; 0 if m < 2)."""
    m = A.shape[0]
    if m < 2 or A.nnz == 0:
        return 0.0
    r = np.arange(m - 1, dtype=np.int64)
    return float(jaccard_pairs(A, r, r + 1).mean())


class _Similarity:
    """Similarity of representative rows inside the merge rounds (exact Jaccard, or MinHash).
    ``many(i, j)`` scores arrays of pairs at once; ``self(i, j)`` one pair."""

    def __init__(self, A: CSR, sig: np.ndarray | None, exact: bool):
        self.A = A
        self.sig = sig
        self.exact = exact
        self._pattern = None   # the rows' column sets (exact), made at the first call

    def many(self, i, j) -> np.ndarray:
        i = np.asarray(i, dtype=np.int64)
        j = np.asarray(j, dtype=np.int64)
        if self.exact:
            if self._pattern is None:
                self._pattern = row_pattern(self.A)
            return jaccard_pairs(self.A, i, j, self._pattern)
        out = np.empty(i.shape[0])
        for a in range(0, i.shape[0], 1 << 16):
            b = a + (1 << 16)
            out[a:b] = np.count_nonzero(self.sig[i[a:b]] == self.sig[j[a:b]], axis=1) / self.sig.shape[1]
        return out

    def __call__(self, i, j) -> float:
        return float(self.many([i], [j])[0])


def _score(similarity, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Similarities of the pairs ``(i[k], j[k])``: ``similarity.many`` when it has one, else one
    call per pair (a plain function, as in tests), else 0."""
    if similarity is None:
        return np.zeros(i.shape[0])
    many = getattr(similarity, "many", None)
    if many is not None:
        return np.asarray(many(i, j), dtype=np.float64)
    return np.array([similarity(int(x), int(y)) for x, y in zip(i.tolist(), j.tolist())], dtype=np.float64)


def cluster_rows(m: int, pi, pj, sims, threshold_size: int = 256, similarity=None,
                 min_similarity: float = 0.0, seed: int = 0, max_rounds: int | None = None,
                 max_work: float | None = None, stats: dict | None = None) -> np.ndarray:
    """Algorithm 3's clustering on candidate pairs ``(pi[k], pj[k])`` with similarities ``sims``,
    in vectorised rounds.

    Algorithm 3 pops pairs from a max-heap of similarities: two clusters merge (the smaller into
    the larger; equal sizes: the smaller row index represents), a cluster of ``threshold_size``
    rows or more is closed, and a pair whose rows no longer represent their clusters is put back
    as the pair of representatives, with ``similarity(a, b)`` of the representative rows.  Here
    every round merges at once each pair that is the most similar pair of both its clusters (the
    pairs the heap would pop before any other pair touching them; equal similarities are ordered
    by a random priority drawn from ``seed``), then moves the pairs of merged clusters to their
    representatives and scores them there (``similarity.many(a, b)`` on arrays when it has one;
    once per pair of representatives, as Algorithm 3 re-queues a pair once).  The heap's first
    pair is always merged, so every round merges; rounds run until no pair is left, or
    ``max_rounds``, or until the rounds have looked at ``max_work`` times the initial pairs (a
    cluster that takes one row a round, or a chain of ever less similar pairs, needs many rounds;
    the pairs then left are not merged).  ``stats`` (a dict) receives ``rounds``, ``pairs_left``,
    ``rescored`` and ``visits`` (pairs looked at, summed over the rounds).

    Pairs with similarity <= ``min_similarity`` are never merged (deviation from Alg. 3, which
    would merge re-queued pairs of similarity 0 and so interleave unrelated clusters, since rows
    are output in index order inside a cluster).

    Returns the row order (new position -> row): clusters in order of their representative row,
    rows ascending inside each cluster."""
    pi = np.asarray(pi, dtype=np.int64)
    pj = np.asarray(pj, dtype=np.int64)
    sims = np.asarray(sims, dtype=np.float64)
    if not (pi.shape == pj.shape == sims.shape):
        raise ValueError(f"pi, pj and sims must have one shape, got {pi.shape}, {pj.shape}, {sims.shape}")
    keep = (sims > min_similarity) & (pi != pj)
    a, b, s = pi[keep], pj[keep], sims[keep]
    # one copy of each unordered pair (the first), in the caller's orientation; the pairs are kept
    # sorted by their key (lo * m + hi), which filtering preserves
    key = np.minimum(a, b) * m + np.maximum(a, b)
    key, first = np.unique(key, return_index=True)
    a, b, s = a[first], b[first], s[first]
    prio = np.random.default_rng(seed).permutation(a.shape[0]).astype(np.int64)
    parent = np.arange(m, dtype=np.int64)
    size = np.ones(m, dtype=np.int64)
    closed = np.zeros(m, dtype=bool)
    smax = np.empty(m)
    pbest = np.empty(m, dtype=np.int64)
    rounds = scored = visits = 0
    work_cap = None if max_work is None else max_work * max(a.shape[0], 1)
    while a.shape[0] and (max_rounds is None or rounds < max_rounds) and (work_cap is None or visits < work_cap):
        rounds += 1
        visits += a.shape[0]
        # each cluster's first pair in the heap's order: the highest similarity, then the lowest
        # priority
        smax.fill(-np.inf)
        np.maximum.at(smax, a, s)
        np.maximum.at(smax, b, s)
        pbest.fill(np.iinfo(np.int64).max)
        top = s == smax[a]
        np.minimum.at(pbest, a[top], prio[top])
        top = s == smax[b]
        np.minimum.at(pbest, b[top], prio[top])
        sel = (pbest[a] == prio) & (pbest[b] == prio)   # disjoint: one first pair per cluster
        x, y = a[sel], b[sel]
        sx, sy = size[x], size[y]
        x_keeps = (sx > sy) | ((sx == sy) & (x < y))
        kept, gone = np.where(x_keeps, x, y), np.where(x_keeps, y, x)
        parent[gone] = kept
        size[kept] = sx + sy
        closed[kept] = size[kept] >= threshold_size
        # the other pairs, moved to their clusters' representatives
        a2, b2 = parent[a], parent[b]
        live = ~sel & (a2 != b2) & ~closed[a2] & ~closed[b2]
        moved = live & ((a2 != a) | (b2 != b))
        stay = live & ~moved
        ma, mb, mp = a2[moved], b2[moved], prio[moved]
        a, b, s, prio, key = a[stay], b[stay], s[stay], prio[stay], key[stay]
        if ma.shape[0]:
            # Algorithm 3 re-queues a pair of representatives once: a moved pair whose clusters
            # already have a pair is dropped, and of moved copies the lowest priority stays
            mk = np.minimum(ma, mb) * m + np.maximum(ma, mb)
            o = np.lexsort((mp, mk))
            mk, ma, mb, mp = mk[o], ma[o], mb[o], mp[o]
            new = np.ones(mk.shape[0], dtype=bool)
            new[1:] = mk[1:] != mk[:-1]
            if key.shape[0]:
                at = np.minimum(np.searchsorted(key, mk), key.shape[0] - 1)
                new &= key[at] != mk
            mk, ma, mb, mp = mk[new], ma[new], mb[new], mp[new]
            ms = _score(similarity, ma, mb)
            scored += ms.shape[0]
            ok = ms > min_similarity
            if ok.any():
                key = np.concatenate([key, mk[ok]])
                o = np.argsort(key, kind="stable")   # two sorted runs: a merge
                key = key[o]
                a = np.concatenate([a, ma[ok]])[o]
                b = np.concatenate([b, mb[ok]])[o]
                s = np.concatenate([s, ms[ok]])[o]
                prio = np.concatenate([prio, mp[ok]])[o]
    if stats is not None:
        stats.update(rounds=rounds, pairs_left=int(a.shape[0]), rescored=scored, visits=visits)
    roots = parent
    while True:  # vectorised pointer jumping to the representatives
        nxt = roots[roots]
        if np.array_equal(nxt, roots):
            break
        roots = nxt
    return np.argsort(roots, kind="stable")


def lsh_order(A: CSR, siglen: int = 128, bsize: int = 2, threshold_size: int = 256, seed: int = 0,
              window: int = 8, max_pairs: int | None = 2_000_000, similarity: str = "auto",
              exact_budget: int = 1 << 25, signatures: str = "auto",
              max_work: float | None = MAX_MERGE_WORK) -> tuple[np.ndarray, dict]:
    """Row order of ``A`` by LSH + clustering (new position -> row) and some statistics.
    ``signatures``: "minhash" (siglen hash functions), "oph" (densified one-permutation hashing)
    or "auto" (minhash up to 2**28 hash evaluations, i.e. siglen x nnz, else oph)."""
    m = A.shape[0]
    t0 = time.perf_counter()
    use_oph = signatures == "oph" or (signatures == "auto" and siglen * A.nnz > (1 << 28))
    sig = oph_signatures(A, siglen, seed) if use_oph else minhash_signatures(A, siglen, seed)
    t1 = time.perf_counter()
    rows = np.flatnonzero(_lengths(A) > 0)
    pi, pj, hits = lsh_candidate_pairs(sig, rows, bsize, window, max_pairs, seed)
    t2 = time.perf_counter()
    lens = _lengths(A)
    work = int(np.minimum(lens[pi], lens[pj]).sum()) if pi.size else 0
    exact = similarity == "exact" or (similarity == "auto" and work <= exact_budget)
    if similarity not in ("auto", "exact", "minhash"):
        raise ValueError(f"similarity must be 'auto', 'exact' or 'minhash', got {similarity!r}")
    scorer = _Similarity(A, sig, exact)
    sims = scorer.many(pi, pj)
    t3 = time.perf_counter()
    rounds: dict = {}
    order = cluster_rows(m, pi, pj, sims, threshold_size, scorer, seed=seed, max_work=max_work, stats=rounds)
    t4 = time.perf_counter()
    return order, {"candidate_pairs": int(pi.shape[0]), "exact_similarity": bool(exact),
                   "merge_rounds": rounds["rounds"], "pairs_left": rounds["pairs_left"],
                   "signatures": "oph" if use_oph else "minhash",
                   "seconds_minhash": t1 - t0, "seconds_banding": t2 - t1,
                   "seconds_similarity": t3 - t2, "seconds_clustering": t4 - t3}


def _is_identity(p: np.ndarray) -> bool:
    return bool(np.array_equal(p, np.arange(p.shape[0])))


@register_pass("cluster.lsh")
class ClusterLSH(Pass):
    """Row reordering by MinHash-LSH candidate pairs + hierarchical clustering (Jiang et al. PPoPP'20)."""

    default_options = {
        "siglen": 128, "bsize": 2, "threshold_size": 256,
        "round": "auto",               # 1, 2 or "auto" (2 when an ASpT format is present)
        "skip": True,                  # apply the paper's skip rules
        "skip_dense_ratio": 0.1,       # round 1 skipped when the dense-tile ratio is above this
        "skip_similarity": 0.1,        # round 2 skipped when consecutive-row similarity is above this
        "panel_height": 32, "dense_threshold": 2,  # ASpT parameters for the dense-ratio rule/metric
        "window": 4,                   # pairs per row per band inside a bucket
        "max_pairs": 2_000_000,        # cap on candidate pairs (the merge loop is per pair) ...
        "pairs_per_row": 8,            # ... and at most this many per clustered row (E ~ N)
        "similarity": "auto",          # "exact", "minhash" or "auto"
        "max_signature_bytes": 1 << 30,  # signatures (rows x siglen x 4 bytes) above this: fewer
        "min_siglen": 16,              # hash functions, down to min_siglen; below it the pass is skipped
    }

    def _siglen(self, A) -> tuple[int, str | None]:
        """The signature length that keeps the signatures within ``max_signature_bytes`` (memory
        linear in the rows with a fixed cap), or (0, reason) when even ``min_siglen`` does not fit."""
        o = self.options
        siglen, bsize, m = int(o["siglen"]), int(o["bsize"]), max(1, A.shape[0])
        fit = int(o["max_signature_bytes"]) // (4 * m) // bsize * bsize
        if fit >= siglen:
            return siglen, None
        if fit < max(int(o["min_siglen"]), bsize):
            return 0, (f"{A.shape[0]} rows need {4 * A.shape[0] * int(o['min_siglen'])} bytes of signatures even at "
                       f"min_siglen={o['min_siglen']}, above max_signature_bytes={o['max_signature_bytes']}")
        return fit, None

    def _order(self, A, ctx, siglen: int):
        o = self.options
        n_rows = int(np.count_nonzero(_lengths(A)))
        cap = [c for c in (o["max_pairs"], None if o["pairs_per_row"] is None else int(o["pairs_per_row"] * n_rows))
               if c is not None]
        return lsh_order(A, siglen, int(o["bsize"]), int(o["threshold_size"]), ctx.seed,
                         int(o["window"]), min(cap) if cap else None, o["similarity"])

    def transform(self, mod, ctx):
        t0 = time.perf_counter()
        o = self.options
        rnd = o["round"]
        if rnd == "auto":
            rnd = 2 if "aspt" in mod.formats else 1
        if rnd not in (1, 2):
            raise ValueError(f"round must be 1, 2 or 'auto', got {o['round']!r}")
        fmt = mod.formats.get("aspt")
        ph = fmt.panel_height if fmt is not None else int(o["panel_height"])
        dt = fmt.dense_threshold if fmt is not None else int(o["dense_threshold"])
        metrics: dict = {"round": rnd, "skipped": False, "reordered": False}
        if rnd == 2 and fmt is not None:
            R = fmt.remainder_csr()
            metrics["target"] = "aspt_remainder"
            metrics["dense_ratio_before"] = metrics["dense_ratio_after"] = fmt.dense_ratio
            sim_before = consecutive_similarity(R)
            metrics["avg_similarity_before"] = sim_before
            out = mod
            siglen, reason = self._siglen(R)
            if o["skip"] and sim_before > o["skip_similarity"]:
                metrics.update(skipped=True, avg_similarity_after=sim_before,
                               skip_reason=f"consecutive remainder rows are already similar ({sim_before:.3g} > "
                                           f"skip_similarity {o['skip_similarity']})")
            elif reason is not None:
                metrics.update(skipped=True, skip_reason=reason, avg_similarity_after=sim_before)
            else:
                metrics["siglen"] = siglen
                perm, info = self._order(R, ctx, siglen)
                metrics.update(info)
                if not _is_identity(perm):
                    fmt2 = fmt.reorder_remainder(perm)
                    out = mod.with_format("aspt", fmt2)
                    metrics["reordered"] = True
                    metrics["avg_similarity_after"] = consecutive_similarity(fmt2.remainder_csr())
                else:
                    metrics["avg_similarity_after"] = sim_before
        else:
            A = mod.A
            metrics["target"] = "rows"
            dr_before = dense_ratio(A, ph, dt)
            sim_before = consecutive_similarity(A)
            metrics["dense_ratio_before"] = dr_before
            metrics["avg_similarity_before"] = sim_before
            skip = o["skip"] and ((rnd == 1 and dr_before > o["skip_dense_ratio"]) or
                                  (rnd == 2 and sim_before > o["skip_similarity"]))
            siglen, reason = self._siglen(A)
            out = mod
            if skip:
                metrics["skipped"] = True
                metrics["skip_reason"] = (
                    f"the rows already fill dense panels (dense ratio {dr_before:.3g} > skip_dense_ratio "
                    f"{o['skip_dense_ratio']})" if rnd == 1 else
                    f"consecutive rows are already similar ({sim_before:.3g} > skip_similarity {o['skip_similarity']})")
            elif reason is not None:
                metrics.update(skipped=True, skip_reason=reason)
            else:
                metrics["siglen"] = siglen
                perm, info = self._order(A, ctx, siglen)
                metrics.update(info)
                if not _is_identity(perm):
                    out = mod.permute(perm, None)
                    metrics["reordered"] = True
                    if fmt is not None:  # keep the pipeline's ASpT tiling valid for the new order
                        out = out.with_format("aspt", build_aspt(out.A, ph, dt))
            if metrics["reordered"]:
                metrics["dense_ratio_after"] = dense_ratio(out.A, ph, dt)
                metrics["avg_similarity_after"] = consecutive_similarity(out.A)
            else:
                metrics["dense_ratio_after"] = dr_before
                metrics["avg_similarity_after"] = sim_before
        metrics["seconds"] = time.perf_counter() - t0
        return out.with_metrics(self.name, metrics)
