"""``reorder.vnm``: N:M / V:N:M sparsity-oriented graph reordering (SOGRE, Chen et al., PPoPP'25).

Definitions (taken from the paper, §2-§4; "current" = the matrix after the permutation so far)
-----------------------------------------------------------------------------------------------
* The columns are cut into ``nseg = ceil(n / M)`` **segments**: segment ``s`` is the n-by-M
  submatrix of columns ``s*M .. s*M+M-1`` (the last one zero-padded when M does not divide n).
* A **segment vector** ``(i, s)`` is the M-element piece of row ``i`` inside segment ``s``, i.e.
  M consecutive columns of one row, aligned to a multiple of M.  It **violates N:M** when it
  holds more than N stored entries (explicit zeros count: they are stored entries).
* A **meta-block** ``(b, s)`` is the V-by-M tile of rows ``b*V .. b*V+V-1`` (the last row block
  may be short) and segment ``s``.  It **conforms to V:N:M** when (i) every row vector in it holds
  at most N entries (horizontal constraint) and (ii) at most ``k`` of its M columns hold any
  entry (vertical constraint; ``k = 4``, the SPTC value: VENOM selects 4 of the M columns and
  runs 2:4 on them).  For V = 1 and N <= k this is the plain N:M rule.
* **PScore** ``F_p`` = number of segment vectors violating N:M (per segment or summed);
  **MBScore** ``F_MB`` = number of meta-blocks that do not conform (either constraint).
* The **Hamming position code** of an M-bit string is its rank in the Hamming-distance order of all
  M-bit strings, which is the reflected Gray-code sequence; the rank is the inverse Gray code
  (prefix XOR of the bits).  The string of a segment vector has the segment's first column as its
  most significant bit (the paper's Listing 1).  Examples from the paper: the 2-bit order is
  00, 01, 11, 10 so code(11) = 2; the 2:8 violating vector 00010101 has code 25 and is encoded -25.

Algorithm (Algorithm 1 = repeat stage 1 + stage 2 until no progress or ``max_iter`` times)
-----------------------------------------------------------------------------------------
* Stage 1 (Algorithm 2): each row becomes the vector of its segment vectors' position codes,
  negated for vectors violating N:M; rows are sorted lexicographically (sparse: zero segment
  vectors are never materialised) and the order is applied as a vertex renumbering.  Repeated
  while MBScore strictly improves (an order that does not improve it is discarded).
* Stage 2 (Algorithm 3): greedy vertex swaps between a primary segment (worst PScore first) and
  target segments (the next-worst unhealthy ones; the sparsest healthy segments as the paper's
  "one unhealthy segment left" rule).  For a (primary, target) pair the gain of each of the M*M
  vertex pairs is the exact reduction of PScore of both segments; the best pair is taken.
  Implementation choices (documented deviations, for speed without a GPU): the pairs of one
  sub-round form a *matching* (each segment in at most one pair), so their swaps are independent,
  their gains exact, and all of them are computed in one vectorised step and applied together
  (the paper's "record, then apply together"); only swaps with positive gain are applied, so a
  sub-round never increases PScore (the paper also takes non-positive "freshtop" swaps; the
  targets the paper scans one after the other become the successive sub-rounds here).  A segment
  whose PScore reaches zero drops out (it is "frozen" as in the paper, line 9).
* The best state seen (lowest (MBScore, PScore)) is returned, so the pass never makes things worse.

Square matrices are renumbered symmetrically (``row_perm == col_perm``: P A Pᵀ, a symmetric A stays
symmetric).  Non-square matrices (not graphs) fall back to independent permutations: stage 1
permutes rows only, stage 2 swaps columns only.  PScore never depends on the row order, so for
V = 1 the row order of a non-square matrix is left unchanged.

Output
------
``mod.metrics["reorder.vnm"]``: V, N, M, k, symmetric, violations_before / violations_after
(segment vectors violating N:M), improvement_rate ((before - after) / before; 1.0 when before
is 0), mbscore_before / mbscore_after, conforms_before / conforms (whole matrix meets V:N:M),
violations_lower_bound (no permutation can do better: rows denser than N per segment on
average), iterations, stage1_accepted, swaps, seconds, and ``best_vnm`` (only with ``search_best=True``).

``mod.formats["vnm"]`` (a plain dict describing ``mod.A``, the reordered matrix) with keys:

* ``V, N, M, k`` (ints), ``shape`` (m, n), ``nseg`` = ceil(n / M), ``nblk`` = ceil(m / V);
* ``sv_row``, ``sv_seg``: int64 arrays, the row and segment of every *non-empty* segment vector,
  sorted by (row, seg); empty segment vectors are not listed (they conform trivially);
* ``sv_mask``: uint64, bit ``c`` (least significant = 0) set when column ``seg*M + c`` of that row
  holds a stored entry (note: the LSB-first order, unlike the MSB-first string of the Gray code);
* ``sv_nnz``: int64 popcount of ``sv_mask``; ``sv_violates``: bool, ``sv_nnz > N``;
* ``violations`` (int, = sv_violates.sum()); ``mb_violating``: int64 array (k, 2) of the
  (row block, segment) of meta-blocks that do not conform; ``conforms`` (bool).
A kernel packing ``mod.A`` in mma.sp form reads, per meta-block, the OR of its rows' masks to
pick its (at most k) columns and each row's mask for the 2:4 metadata.
"""
from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from .base import Pass, register_pass

__all__ = ["VNMReorder", "best_vnm", "sogre", "vnm_format", "violations_lower_bound", "stage1_codes",
           "stage1_order", "hamming_position_code", "segment_vectors", "pscore",
           "mbscore", "K_COLUMNS"]

K_COLUMNS = 4  # columns a V x M meta-block may use (SPTC hardware, paper §2)
_MAX_M = 32


def _popcount(x: np.ndarray) -> np.ndarray:
    return np.bitwise_count(x).astype(np.int64)


def hamming_position_code(bits, M: int) -> np.ndarray:
    """Rank of each M-bit string (an integer whose MSB is the first digit) in the Hamming-distance
    (reflected Gray code) order: the inverse Gray code, i.e. the prefix XOR of the digits."""
    b = np.asarray(bits, dtype=np.uint64).copy()
    shift = 1
    while shift < M:
        b ^= b >> np.uint64(shift)
        shift <<= 1
    return b.astype(np.int64)


def segment_vectors(rows: np.ndarray, cols: np.ndarray, M: int, nseg: int, msb_first: bool = True):
    """Non-empty segment vectors of the entries (rows[p], cols[p]): ``(row, seg, bits)`` sorted by
    (row, seg).  ``bits`` has column ``seg*M`` as MSB (msb_first) or as LSB."""
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    if rows.size == 0:
        e = np.zeros(0, np.int64)
        return e, e.copy(), np.zeros(0, np.uint64)
    order = np.argsort(rows * (nseg * M) + cols)
    return _group_sorted(rows[order], cols[order], M, nseg, msb_first)


def _group_sorted(rows, cols, M, nseg, msb_first):
    """segment_vectors for entries already sorted by (row, col)."""
    if rows.size == 0:
        e = np.zeros(0, np.int64)
        return e, e.copy(), np.zeros(0, np.uint64)
    seg = cols // M
    off = cols - seg * M
    key = rows * nseg + seg
    shift = (M - 1 - off) if msb_first else off
    bit = np.left_shift(np.uint64(1), shift.astype(np.uint64))
    start = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    bits = np.bitwise_or.reduceat(bit, start)
    ukey = key[start]
    return ukey // nseg, ukey % nseg, bits


def _mb_bad(rows, seg, bits, V, N, k, nseg):
    """Boolean per non-empty meta-block (and its keys) saying it does not conform to V:N:M."""
    pc = _popcount(bits)
    if V == 1:
        return (pc > N) | (pc > k), rows, seg
    key = (rows // V) * nseg + seg
    order = np.argsort(key, kind="stable")
    key = key[order]
    start = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    orb = np.bitwise_or.reduceat(bits[order], start)
    mx = np.maximum.reduceat(pc[order], start)
    ukey = key[start]
    return (mx > N) | (_popcount(orb) > k), ukey // nseg, ukey % nseg


def pscore(bits: np.ndarray, N: int) -> int:
    """PScore F_p: number of segment vectors with more than N entries."""
    return int(np.count_nonzero(_popcount(bits) > N))


def mbscore(rows, seg, bits, V, N, M, nseg, k: int = K_COLUMNS) -> int:
    """MBScore F_MB: number of V x M meta-blocks violating V:N:M (either constraint)."""
    if len(bits) == 0:
        return 0
    return int(np.count_nonzero(_mb_bad(rows, seg, bits, V, N, k, nseg)[0]))


# ---------------------------------------------------------------------------------------------
# the state: the original pattern plus the current row / column orders
# ---------------------------------------------------------------------------------------------
class _State:
    def __init__(self, A, V, N, M, k, symmetric):
        self.m, self.n = A.shape
        self.V, self.N, self.M, self.k = V, N, M, k
        self.symmetric = symmetric
        self.nseg = -(-self.n // M)
        self.row_ids = A.row_ids.astype(np.int64)
        self.indptr = A.indptr.astype(np.int64)
        self.row_len = np.diff(self.indptr)
        self.cols = A.indices.astype(np.int64)
        S = A.to_scipy().tocsc()
        S.sort_indices()
        self.colptr = S.indptr.astype(np.int64)
        self.colrows = S.indices.astype(np.int64)
        self.col_nnz = np.diff(self.colptr)
        self.rperm = np.arange(self.m, dtype=np.int64)  # new position -> original index
        self.cperm = np.arange(self.n, dtype=np.int64)

    # current positions of every stored entry
    def _positions(self):
        qr = np.empty(self.m, np.int64)
        qr[self.rperm] = np.arange(self.m)
        if self.symmetric:
            qc = qr
        else:
            qc = np.empty(self.n, np.int64)
            qc[self.cperm] = np.arange(self.n)
        return qr[self.row_ids], qc[self.cols]

    def segvecs(self, msb_first=True, original_rows=False):
        """Non-empty segment vectors of the current matrix, sorted by (row, seg): rows are gathered
        CSR-style and only the (short) rows are sorted (scipy's per-row sort), no global sort."""
        qc = np.empty(self.n, np.int64)
        qc[self.cperm] = np.arange(self.n)
        if original_rows:  # (PScore does not depend on the row order)
            nl, nip, src = self.row_len, self.indptr, np.arange(self.indptr[-1], dtype=np.int64)
        else:
            nl = self.row_len[self.rperm]
            nip = np.zeros(self.m + 1, np.int64)
            np.cumsum(nl, out=nip[1:])
            src = np.arange(nip[-1], dtype=np.int64) - np.repeat(nip[:-1] - self.indptr[self.rperm], nl)
        idt = np.int32 if max(self.n, int(nip[-1])) < 2**31 - 1 else np.int64
        c = qc[self.cols[src]].astype(idt)
        S = sp.csr_matrix((c, c, nip.astype(idt)), shape=(self.m, self.n))
        S.has_sorted_indices = False
        S.sort_indices()
        c = S.indices.astype(np.int64)
        r = np.repeat(np.arange(self.m, dtype=np.int64), nl)
        return _group_sorted(r, c, self.M, self.nseg, msb_first)

    def scores(self):
        rows, seg, bits = self.segvecs()
        return (mbscore(rows, seg, bits, self.V, self.N, self.M, self.nseg, self.k),
                pscore(bits, self.N))

    def seg_pscore(self):
        """PScore per segment (independent of the row order: rows are original ids here)."""
        _, seg, bits = self.segvecs(original_rows=True)
        viol = _popcount(bits) > self.N
        return np.bincount(seg[viol], minlength=self.nseg).astype(np.int64)

    def get(self):
        return self.rperm.copy(), self.cperm.copy()

    def set(self, st):
        self.rperm, self.cperm = st[0].copy(), st[1].copy()
        if self.symmetric:
            self.cperm = self.rperm


# ---------------------------------------------------------------------------------------------
# stage 1: Hamming position codes + sparse lexicographic row sort
# ---------------------------------------------------------------------------------------------
def _lex_row_order(m: int, rows: np.ndarray, seg: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Order of the m rows by lexicographic comparison of their dense code vectors (code of the
    absent, all-zero segment vectors = 0), given the non-zero codes sorted by (row, seg).

    Token order: at the first differing position one row has a code and the other 0 (or both
    codes), so a token (s, c<0) sorts before "end of row" which sorts before (s, c>0); negative
    tokens ascend by (s, c), positive ones by (-s, c).  Rows are then sorted by their token strings
    with an MSD refinement that only keeps still-tied groups."""
    if m == 0:
        return np.zeros(0, np.int64)
    neg = code < 0
    sk = np.where(neg, seg, -seg) + (1 << 26)
    tok = (np.where(neg, 0, 2).astype(np.int64) << 60) | (sk << 33) | (code + (1 << 32))
    end_tok = 1 << 60
    row_start = np.zeros(m + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=m), out=row_start[1:])
    lens = np.diff(row_start)

    grp = np.zeros(m, np.int64)  # group id = first position of the group in the final order
    active = np.arange(m, dtype=np.int64)
    kpos = 0
    while active.size:
        klen = lens[active]
        key = np.full(active.size, end_tok, np.int64)
        has = klen > kpos
        key[has] = tok[row_start[active[has]] + kpos]
        g = grp[active]
        o = np.lexsort((key, g))
        active, key, g = active[o], key[o], g[o]
        first_of_old = np.concatenate(([True], g[1:] != g[:-1]))
        idx = np.arange(active.size)
        old_start_idx = np.maximum.accumulate(np.where(first_of_old, idx, 0))
        newgrp = np.concatenate(([True], (g[1:] != g[:-1]) | (key[1:] != key[:-1])))
        sub_first = np.maximum.accumulate(np.where(newgrp, idx, 0))
        grp[active] = g + (sub_first - old_start_idx)
        # keep rows whose new group has >1 member and which are not finished (key END)
        gid = np.cumsum(newgrp) - 1
        size = np.bincount(gid)[gid]
        keep = (size > 1) & (key != end_tok)
        active = active[keep]
        kpos += 1
    return np.argsort(grp, kind="stable").astype(np.int64)


def _codes(bits, N, M):
    code = hamming_position_code(bits, M)
    return np.where(_popcount(bits) > N, -code, code)


def stage1_codes(A, N: int = 2, M: int = 4):
    """Algorithm 2, lines 4-10, for the canonical CSR ``A``: ``(row, seg, code)`` of every non-empty
    segment vector, code = Hamming position code, negated when the vector violates N:M (absent
    segment vectors have code 0)."""
    nseg = -(-A.shape[1] // M)
    rows, seg, bits = segment_vectors(A.row_ids, A.indices, M, nseg, msb_first=True)
    return rows, seg, _codes(bits, N, M)


def stage1_order(A, N: int = 2, M: int = 4) -> np.ndarray:
    """The row order of one stage-1 step (new position -> row): rows sorted lexicographically by
    their vectors of position codes."""
    rows, seg, code = stage1_codes(A, N, M)
    return _lex_row_order(A.shape[0], rows, seg, code)


def _stage1_order(st: _State) -> np.ndarray:
    rows, seg, bits = st.segvecs(msb_first=True)
    return _lex_row_order(st.m, rows, seg, _codes(bits, st.N, st.M))


def _stage1(st: _State, max_iter: int, best):
    """Algorithm 2; returns the number of accepted row sorts.  ``best`` = current (MB, P) scores."""
    accepted = 0
    for _ in range(max_iter):
        if best[0] == 0:
            break
        order = _stage1_order(st)
        if np.array_equal(order, np.arange(st.m)):
            break
        saved = st.get()
        st.rperm = st.rperm[order]
        if st.symmetric:
            st.cperm = st.rperm
        sc = st.scores()
        if sc < best:  # MBScore improves (PScore as tie breaker)
            best = sc
            accepted += 1
        else:
            st.set(saved)
            break
    return accepted, best


# ---------------------------------------------------------------------------------------------
# stage 2: exact-gain vertex swaps between disjoint (primary, target) segment pairs
# ---------------------------------------------------------------------------------------------
def _ragged(ptr, idx, sel):
    starts = ptr[sel]
    lens = ptr[sel + 1] - starts
    tot = int(lens.sum())
    owner = np.repeat(np.arange(sel.size, dtype=np.int64), lens)
    offs = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return owner, idx[np.repeat(starts, lens) + offs]


def _subround(st: _State, P: np.ndarray, T: np.ndarray, ps: np.ndarray, plateau: bool = False,
              rng: np.random.Generator | None = None) -> int:
    """One batch of disjoint segment pairs (P[b], T[b]): apply the best positive-gain vertex swap
    of every pair, update ``ps`` (PScore per segment) in place; returns the number of swaps."""
    M, N, n = st.M, st.N, st.n
    B = P.size
    if B == 0:
        return 0
    slot = np.arange(M, dtype=np.int64)
    posP = (P[:, None] * M + slot).ravel()          # (B*M,) column positions
    posT = (T[:, None] * M + slot).ravel()
    pos = np.concatenate((posP, posT))
    valid = pos < n
    verts = np.where(valid, st.cperm[np.minimum(pos, n - 1)], -1)
    side = np.repeat(np.array([0, 1]), B * M)
    pair = np.concatenate((np.repeat(np.arange(B), M), np.repeat(np.arange(B), M)))
    sl = np.concatenate((np.tile(slot, B), np.tile(slot, B)))
    vi = np.flatnonzero(valid)
    owner, row = _ragged(st.colptr, st.colrows, verts[vi])
    owner = vi[owner]
    e_pair, e_side, e_slot = pair[owner], side[owner], sl[owner]
    key = e_pair * st.m + row
    o = np.argsort(key, kind="stable")
    key, e_pair, e_side, e_slot = key[o], e_pair[o], e_side[o], e_slot[o]
    if key.size == 0:
        return 0
    newg = np.concatenate(([True], key[1:] != key[:-1]))
    gid = np.cumsum(newg) - 1
    G = int(gid[-1]) + 1
    pcP = np.bincount(gid, weights=(e_side == 0), minlength=G).astype(np.int64)
    pcT = np.bincount(gid, weights=(e_side == 1), minlength=G).astype(np.int64)
    gpair = e_pair[newg]
    # per-row gain coefficients (see the derivation in the module docstring / tests)
    xP = (pcP == N + 1).astype(np.int64)      # P loses a column the row has: P row gets fixed
    yP = -(pcP == N).astype(np.int64)         # P gains a column the row has: P row breaks
    xT = (pcT == N + 1).astype(np.int64)
    yT = -(pcT == N).astype(np.int64)
    wP = xP + yP
    wT = xT + yT
    # drop rows that cannot change any score
    rel = (wP != 0) | (wT != 0) | (xP != 0) | (yP != 0) | (xT != 0) | (yT != 0)
    erel = rel[gid]
    gidr, sider, slotr, pairr = gid[erel], e_side[erel], e_slot[erel], e_pair[erel]
    isP = sider == 0
    # linear terms: SP[b, a] = sum over rows with P-bit a of coefficient; ST[b, c] likewise
    idxP = pairr[isP] * M + slotr[isP]
    idxT = pairr[~isP] * M + slotr[~isP]
    gP, gT = gidr[isP], gidr[~isP]
    SPx = np.bincount(idxP, weights=xP[gP], minlength=B * M).reshape(B, M)
    SPy = np.bincount(idxP, weights=yT[gP], minlength=B * M).reshape(B, M)
    STy = np.bincount(idxT, weights=yP[gT], minlength=B * M).reshape(B, M)
    STx = np.bincount(idxT, weights=xT[gT], minlength=B * M).reshape(B, M)
    # cross terms: rows having both P-bit a and T-bit c
    CP = np.zeros((B, M, M))
    CT = np.zeros((B, M, M))
    if gP.size and gT.size:
        # enumerate (P entry, T entry) pairs of the same row: T entries grouped by row
        tord = np.argsort(gT, kind="stable")
        gT_s, slotT_s = gT[tord], slotr[~isP][tord]
        tstart = np.searchsorted(gT_s, gP, side="left")
        tend = np.searchsorted(gT_s, gP, side="right")
        cnt = tend - tstart
        rep = np.repeat(np.arange(gP.size), cnt)
        offs = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        tj = np.repeat(tstart, cnt) + offs
        g = gP[rep]
        flat = (pairr[isP][rep] * M + slotr[isP][rep]) * M + slotT_s[tj]
        CP = np.bincount(flat, weights=wP[g], minlength=B * M * M).reshape(B, M, M)
        CT = np.bincount(flat, weights=wT[g], minlength=B * M * M).reshape(B, M, M)
    gainP = SPx[:, :, None] + STy[:, None, :] - CP
    gainT = SPy[:, :, None] + STx[:, None, :] - CT
    gain = gainP + gainT
    vP = valid[:B * M].reshape(B, M)
    vT = valid[B * M:].reshape(B, M)
    gain = np.where(vP[:, :, None] & vT[:, None, :], gain, -np.inf)
    flatg = gain.reshape(B, M * M)
    if rng is not None:  # random tie breaking among equal gains
        best = np.argmax(flatg + rng.random(flatg.shape) * 0.5, axis=1)
    else:
        best = np.argmax(flatg, axis=1)
    bg = flatg[np.arange(B), best]
    ok = bg >= 0 if plateau else bg > 0
    if not np.any(ok):
        return 0
    b = np.flatnonzero(ok)
    a, c = best[b] // M, best[b] % M
    u, v = P[b] * M + a, T[b] * M + c
    cu, cv = st.cperm[u].copy(), st.cperm[v].copy()
    if st.symmetric:
        st.rperm[u], st.rperm[v] = cv, cu
        st.cperm = st.rperm
    else:
        st.cperm[u], st.cperm[v] = cv, cu
    ps[P[b]] -= gainP[b, a, c].astype(np.int64)
    ps[T[b]] -= gainT[b, a, c].astype(np.int64)
    return int(b.size)


def _offset_matching(L: np.ndarray, d: int):
    """Pairs (L[i], L[i+d]) for the i whose block of 2d has i in its first half: a matching."""
    i = np.arange(L.size)
    sel = ((i // d) % 2 == 0) & (i + d < L.size)
    return L[i[sel]], L[i[sel] + d]


def _stage2(st: _State, max_rounds: int, rng: np.random.Generator, max_offsets: int,
            patience: int = 3, plateau: bool = True):
    """Algorithm 3 (matching form); returns the number of swaps applied."""
    swaps = 0
    nseg = st.nseg
    ps = st.seg_pscore()
    best_total, stall = int(ps.sum()), 0
    for _ in range(max_rounds):
        if ps.sum() == 0:
            break
        applied = 0
        # primaries with the next-worst unhealthy targets (the paper's I.next()), by offset
        for d in range(1, max_offsets + 1):
            U = np.flatnonzero(ps > 0)
            if U.size < 2 or d >= U.size:
                break
            U = U[np.lexsort((U, -ps[U]))]
            P, T = _offset_matching(U, d)
            applied += _subround(st, P, T, ps)
        # unhealthy segments with the sparsest healthy segments (Algorithm 3, line 6), then
        # with random healthy ones
        for rep in range(2):
            U = np.flatnonzero(ps > 0)
            H = np.flatnonzero(ps == 0)
            if U.size == 0 or H.size == 0:
                break
            U = U[np.lexsort((U, -ps[U]))]
            if rep == 0:
                qc = np.empty(st.n, np.int64)
                qc[st.cperm] = np.arange(st.n)
                seg_nnz = np.bincount(qc // st.M, weights=st.col_nnz, minlength=nseg)
                H = H[np.lexsort((H, seg_nnz[H]))]
            else:
                H = rng.permutation(H)
            t = min(U.size, H.size)
            applied += _subround(st, U[:t], H[:t], ps)
        # exploration: unhealthy segments with random partners, zero-gain moves allowed
        U = np.flatnonzero(ps > 0)
        if U.size:
            others = rng.permutation(np.setdiff1d(np.arange(nseg), U))
            U = rng.permutation(U)
            t = min(U.size, others.size)
            applied += _subround(st, U[:t], others[:t], ps, plateau=plateau, rng=rng)
            if U.size - t >= 2:
                R = U[t:]
                h = R.size // 2
                applied += _subround(st, R[:h], R[h:2 * h], ps, plateau=plateau, rng=rng)
        swaps += applied
        total = int(ps.sum())
        if total < best_total:
            best_total, stall = total, 0
        else:
            stall += 1
            if stall >= patience or applied == 0:
                break
    return swaps


def _polish(st: _State, budget: int, rng: np.random.Generator, best):
    """End-game local search (not in the paper): for each non-conforming meta-block try swapping
    one of its rows' vertices with random vertices, keeping a swap only if (MBScore, PScore)
    improves.  Scored by full recomputation, so only run with a small evaluation budget."""
    rows, seg, bits = st.segvecs()
    bad, br, bs = _mb_bad(rows, seg, bits, st.V, st.N, st.k, st.nseg)
    blocks = np.flatnonzero(bad)
    rng.shuffle(blocks)
    evals = accepted = 0
    for b in blocks:
        if evals >= budget:
            break
        lo = int(br[b]) * st.V
        cand_u = np.arange(lo, min(lo + st.V, st.m))
        done = False
        for _ in range(max(1, 32 // cand_u.size)):
            for u in rng.permutation(cand_u):
                v = int(rng.integers(st.m))
                if v // st.V == u // st.V or evals >= budget:
                    continue
                evals += 1
                p = st.rperm
                p[u], p[v] = p[v], p[u]
                sc = st.scores()
                if sc < best:
                    best, done = sc, True
                    accepted += 1
                    break
                p[u], p[v] = p[v], p[u]
            if done or evals >= budget:
                break
    return accepted, best


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------
def violations_lower_bound(A, N: int, M: int) -> int:
    """A lower bound on the N:M-violating segment vectors under *any* row/column permutation: a row
    with d entries spread over nseg segments of which v violate holds at most N*(nseg-v) + M*v
    entries, so v >= ceil((d - N*nseg) / (M - N))."""
    nseg = -(-A.shape[1] // M)
    d = np.diff(A.indptr).astype(np.int64)
    return int(np.sum(np.maximum(0, -(-(d - N * nseg) // (M - N)))))


def _check(V, N, M, k):
    for name, x in (("V", V), ("N", N), ("M", M), ("k", k)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or int(x) < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if not (1 <= N < M <= _MAX_M):
        raise ValueError(f"need 1 <= N < M <= {_MAX_M}, got N={N}, M={M}")
    return int(V), int(N), int(M), int(k)


def sogre(A, V: int = 1, N: int = 2, M: int = 4, max_iter: int = 10, symmetric: bool | None = None,
          seed: int = 0, k: int = K_COLUMNS, max_offsets: int | None = None, polish: int = 256):
    """Run SOGRE on the canonical CSR ``A``.  Returns ``(row_perm, col_perm, info)`` with
    permutations new position -> original index and ``info`` the metric dict (no timing)."""
    V, N, M, k = _check(V, N, M, k)
    m, n = A.shape
    if symmetric is None:
        symmetric = m == n
    if symmetric and m != n:
        raise ValueError(f"a symmetric renumbering needs a square matrix, got {A.shape}")
    st = _State(A, V, N, M, k, symmetric)
    rng = np.random.default_rng(seed)
    offs = M if max_offsets is None else int(max_offsets)
    start = st.scores()
    best, best_state = start, st.get()
    it = acc_total = swaps_total = 0
    for it in range(1, max_iter + 1):
        if best[0] == 0 and best[1] == 0:
            it -= 1
            break
        before = best
        acc, best = _stage1(st, max_iter, best)
        best_state = st.get()
        acc_total += acc
        sw = _stage2(st, max_iter, rng, offs)
        swaps_total += sw
        sc = st.scores()
        if sc < best:
            best, best_state = sc, st.get()
        else:
            st.set(best_state)
        if not best < before:
            break
    polished = 0
    budget = min(int(polish), int(2e7 // max(A.nnz, 1)))
    if 0 < best[0] <= 64 and budget > 0:  # end game: few non-conforming meta-blocks left
        st.set(best_state)
        polished, best = _polish(st, budget, rng, best)
        best_state = st.get()
    st.set(best_state)
    info = {
        "V": V, "N": N, "M": M, "k": k, "symmetric": bool(symmetric),
        "violations_before": int(start[1]), "violations_after": int(best[1]),
        "improvement_rate": float((start[1] - best[1]) / start[1]) if start[1] else 1.0,
        "mbscore_before": int(start[0]), "mbscore_after": int(best[0]),
        "conforms_before": bool(start[0] == 0), "conforms": bool(best[0] == 0),
        "iterations": int(it), "stage1_accepted": int(acc_total), "swaps": int(swaps_total),
        "polish_swaps": int(polished),
        "segments": int(st.nseg),
        "violations_lower_bound": violations_lower_bound(A, N, M),
    }
    rperm, cperm = best_state
    if not symmetric and V == 1:
        rperm = np.arange(m, dtype=np.int64)  # the row order does not matter for N:M
    return rperm, cperm, info


def best_vnm(A, max_M: int = 32, max_V: int = 32, N: int = 2, max_iter: int = 10, k: int = K_COLUMNS,
             seed: int = 0, symmetric: bool | None = None) -> dict:
    """The paper's §5 search: 1:N:M with M = 4, 8, ... doubling while the reordered matrix still
    conforms, then V:N:M with V = 2, 4, ... doubling up to ``max_V`` at that M (skipped when
    M <= k, where the vertical constraint is void and every V behaves as V = 1).

    Returns ``{"V", "N", "M", "pattern", "conforms", "tried"}``; V/M/pattern are None when not
    even 1:N:4 can be reached.  ``tried`` lists every attempt with its metrics.  ``A``: anything
    :func:`spcompile.core.formats.as_csr` accepts."""
    from ..core.formats import as_csr

    A = as_csr(A)
    tried = []
    best = None

    def attempt(V, M):
        t0 = time.perf_counter()
        rp, cp, info = sogre(A, V=V, N=N, M=M, max_iter=max_iter, k=k, seed=seed, symmetric=symmetric)
        tried.append({"pattern": f"{V}:{N}:{M}", "conforms": info["conforms"],
                      "violations_after": info["violations_after"],
                      "mbscore_after": info["mbscore_after"], "seconds": time.perf_counter() - t0})
        return info["conforms"], (rp, cp)

    M = 4
    while M <= max_M and N < M:
        ok, perms = attempt(1, M)
        if not ok:
            break
        best = (1, M, perms)
        M *= 2
    if best is not None and best[1] > k:
        V = 2
        while V <= max_V:
            ok, perms = attempt(V, best[1])
            if not ok:
                break
            best = (V, best[1], perms)
            V *= 2
    out = {"V": None, "N": N, "M": None, "pattern": None, "conforms": best is not None, "tried": tried}
    if best is not None:
        out.update(V=best[0], M=best[1], pattern=f"{best[0]}:{N}:{best[1]}")
        out["_perms"] = best[2]
    return out


def vnm_format(A, V: int, N: int, M: int, k: int = K_COLUMNS) -> dict:
    """The ``formats["vnm"]`` dict of the (already reordered) canonical CSR ``A`` (see module doc)."""
    m, n = A.shape
    nseg = -(-n // M)
    rows, seg, mask = segment_vectors(A.row_ids, A.indices, M, nseg, msb_first=False)
    nnz = _popcount(mask)
    viol = nnz > N
    if len(mask):
        bad, br, bs = _mb_bad(rows, seg, mask, V, N, k, nseg)
        mbv = np.stack([br[bad], bs[bad]], axis=1).astype(np.int64)
    else:
        mbv = np.zeros((0, 2), np.int64)
    return {"V": V, "N": N, "M": M, "k": k, "shape": (m, n), "nseg": nseg, "nblk": -(-m // V),
            "sv_row": rows, "sv_seg": seg, "sv_mask": mask, "sv_nnz": nnz, "sv_violates": viol,
            "violations": int(viol.sum()), "mb_violating": mbv, "conforms": bool(mbv.shape[0] == 0)}


@register_pass("reorder.vnm")
class VNMReorder(Pass):
    """SOGRE N:M / V:N:M sparsity-oriented graph reordering (lossless vertex renumbering)."""

    default_options = {"V": 1, "N": 2, "M": 4, "max_iter": 10, "search_best": False, "max_M": 32,
                       "max_V": 32, "symmetric": None}
    produces = ("vnm",)

    def transform(self, mod, ctx):
        o = self.options
        t0 = time.perf_counter()
        A = mod.A
        seed = getattr(ctx, "seed", 0)
        V, N, M = o["V"], o["N"], o["M"]
        best = None
        if o["search_best"]:
            best = best_vnm(A, max_M=o["max_M"], max_V=o["max_V"], N=N, max_iter=o["max_iter"],
                            seed=seed, symmetric=o["symmetric"])
        perms = best.pop("_perms", None) if best is not None else None
        if perms is not None:  # the best conforming pattern found by the search is applied
            V, M = best["V"], best["M"]
            rp, cp = perms
            info = _metrics_for(A, rp, cp, V, N, M)
        else:
            rp, cp, info = sogre(A, V=V, N=N, M=M, max_iter=o["max_iter"], seed=seed,
                                 symmetric=o["symmetric"])
        ident_r = np.array_equal(rp, np.arange(A.shape[0]))
        ident_c = np.array_equal(cp, np.arange(A.shape[1]))
        out = mod.permute(None if ident_r else rp, None if ident_c else cp)
        out = out.with_format("vnm", vnm_format(out.A, V, N, M))
        info = dict(info)
        if best is not None:
            info["best_vnm"] = best
        info["seconds"] = time.perf_counter() - t0
        return out.with_metrics(self.name, info)


def _metrics_for(A, rp, cp, V, N, M, k=K_COLUMNS):
    """Metrics of a given permutation (used when best_vnm supplied it)."""
    m, n = A.shape
    nseg = -(-n // M)
    rows0, seg0, bits0 = segment_vectors(A.row_ids, A.indices, M, nseg)
    qr = np.empty(m, np.int64)
    qr[rp] = np.arange(m)
    qc = np.empty(n, np.int64)
    qc[cp] = np.arange(n)
    rows1, seg1, bits1 = segment_vectors(qr[A.row_ids.astype(np.int64)], qc[A.indices.astype(np.int64)],
                                         M, nseg)
    b, a = pscore(bits0, N), pscore(bits1, N)
    mb0 = mbscore(rows0, seg0, bits0, V, N, M, nseg, k)
    mb1 = mbscore(rows1, seg1, bits1, V, N, M, nseg, k)
    return {"V": V, "N": N, "M": M, "k": k, "symmetric": bool(np.array_equal(rp, cp) and m == n),
            "violations_before": b, "violations_after": a,
            "improvement_rate": float((b - a) / b) if b else 1.0,
            "mbscore_before": mb0, "mbscore_after": mb1, "conforms_before": mb0 == 0,
            "conforms": mb1 == 0, "segments": nseg,
            "violations_lower_bound": violations_lower_bound(A, N, M)}
