"""Pre-tuned knowledge: a model that ranks candidate configs for matrices it has never seen.

The project ships measurements (``spcompile/autotune/data/knowledge_<arch>.json``): for every
shared graph, op/reduce, dtype and K, the kernel time of each member of a fixed **portfolio** of
configs (template x pipeline x parameters, described relative to the template's own heuristics
so that a portfolio member means the same thing at every K), and the vendor baseline's time.
``benchmarks/collect_knowledge.py`` produces the file on a GPU.

The model is a distance-weighted k-nearest-neighbour ranking over cheap matrix features
(:func:`features`: size, row-length statistics, column skew, window reuse, locality): a new
matrix's candidates are ranked by the mean, over its nearest training graphs, of
``log(time / best time of that graph)``; the expected speed-up over the baseline is the same
mean of ``log(baseline / time)``.  Its quality is reported by leave-one-graph-out
cross-validation (:func:`cross_validate`), so the numbers are those of a graph the model has not
seen.

:func:`ranked_configs` is what :func:`spcompile.build` (quick selection) and the tuner (seeds)
call; for 16-bit inputs :func:`cross_dtype_configs` adds the ``float32`` class's first choice when
the 16-bit portfolio never measured it; on matrices whose row windows reuse their columns many
times :func:`reuse_configs` adds the tensor-core template on condensed row windows.
"""
from __future__ import annotations

import json
import math
import os
import weakref
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..core.config import Config
from ..core.ir import SparseOp, pattern_hash

__all__ = ["ranked_configs", "cross_dtype_configs", "reuse_configs", "beside_ranking", "features", "portfolio", "candidate_config", "Knowledge", "load_knowledge",
           "cross_validate", "excluded", "FEATURES", "KNOWLEDGE_K"]

#: feature names, in the model's order
FEATURES = ("log_rows", "log_cols", "log_nnz", "log_mean_row", "row_cv", "log_max_over_mean", "empty_rows",
            "col_cv", "window_reuse", "locality")
#: the widths the shipped knowledge was measured at
KNOWLEDGE_K = (32, 64, 128, 256, 512)
#: smallest spread a feature gets when distances are standardised
SD_FLOOR = 0.05

_DATA_DIR = os.path.join(os.path.dirname(__file__), "data")


# -- features --------------------------------------------------------------------------------
#: features of the canonical CSR matrices they were computed for (read-only arrays: a matrix's
#: features never change), so that the model's ranking and the candidates added beside it
#: (:func:`cross_dtype_configs`, :func:`reuse_configs`) compute them once per build (2-3 s on a
#: 2-core host for 24.6M entries)
_FEATURE_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def features(A) -> dict[str, float]:
    """Cheap structure features of a CSR matrix (vectorised, O(nnz)); see :data:`FEATURES`.

    * ``window_reuse``: nonzeros per distinct column inside windows of 32 consecutive rows (how
      often a gathered X row is reused by neighbouring rows; sampled on up to 4096 windows);
    * ``locality``: mean ``|i - j| / n`` (1 - ...: near 1 for banded patterns).

    Computed once per :class:`~spcompile.core.formats.CSR` object (kept while it lives); other
    inputs (scipy matrices) are computed on every call.
    """
    from ..core.formats import CSR

    if isinstance(A, CSR):
        got = _FEATURE_CACHE.get(A)
        if got is None:
            got = _FEATURE_CACHE[A] = _features(A)
        return dict(got)
    return _features(A)


def _features(A) -> dict[str, float]:
    m, n = A.shape
    nnz = int(A.nnz)
    lens = np.diff(np.asarray(A.indptr, dtype=np.int64)).astype(np.float64)
    mean = float(lens.mean()) if m else 0.0
    f = {"log_rows": math.log2(m + 1), "log_cols": math.log2(n + 1), "log_nnz": math.log2(nnz + 1),
         "log_mean_row": math.log2(mean + 1), "row_cv": float(lens.std() / mean) if mean > 0 else 0.0,
         "log_max_over_mean": math.log2(float(lens.max()) / mean) if mean > 0 else 0.0,
         "empty_rows": float(np.count_nonzero(lens == 0) / m) if m else 0.0}
    if nnz == 0:
        f.update(col_cv=0.0, window_reuse=1.0, locality=1.0)
        return f
    idx = np.asarray(A.indices, dtype=np.int64)
    cc = np.bincount(idx, minlength=n).astype(np.float64)
    f["col_cv"] = float(cc.std() / cc.mean()) if cc.mean() > 0 else 0.0
    W = 32
    nwin = -(-m // W)
    rng = np.random.default_rng(0)
    wins = np.arange(nwin) if nwin <= 4096 else np.sort(rng.choice(nwin, 4096, replace=False))
    indptr = np.asarray(A.indptr, dtype=np.int64)
    starts, ends = indptr[wins * W], indptr[np.minimum((wins + 1) * W, m)]
    cnt = ends - starts
    tot = int(cnt.sum())
    if tot:
        pos = np.repeat(starts - np.cumsum(cnt) + cnt, cnt) + np.arange(tot)
        keys = np.repeat(np.arange(wins.size, dtype=np.int64), cnt) * (n + 1) + idx[pos]
        f["window_reuse"] = float(tot / np.unique(keys).size)
    else:
        f["window_reuse"] = 1.0
    rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(indptr))
    f["locality"] = float(1.0 - np.mean(np.abs(rows - idx)) / max(1, n))
    return f


def _vector(f: Mapping[str, float]) -> np.ndarray:
    return np.array([float(f.get(k, 0.0)) for k in FEATURES], dtype=np.float64)


# -- the portfolio ---------------------------------------------------------------------------
_PIPES = {"none": [], "degree": [{"name": "reorder.degree", "options": {"descending": True}}],
          "rcm": [{"name": "reorder.rcm", "options": {"symmetric_mode": True}}]}


def portfolio(op: str, reduce: str | None, dtype: str) -> list[str]:
    """The candidate ids measured for a workload class: ``template|pipeline|variant``."""
    out: list[str] = []
    if op == "spmm":
        segs = (0, 16, 32, 64, 256) if dtype == "float32" else (0, 32, 64)
        shapes = ("u2", "u8", "w8r2") if dtype == "float32" else ("u2", "w8r2")
        for pipe in ("none", "degree", "rcm"):
            for s in segs:
                for shape in shapes:
                    out.append(f"csr.crc_cwm|{pipe}|ms{s}-{shape}")
        if dtype == "float32":
            out.append("aspt.tiled|p0|default")
        if dtype != "float32" and reduce in ("sum", "mean"):
            out += ["tc.wmma_sgt|p0|default", "tc.wmma_sgt|p1|default", "sptc.vnm|p0|default", "sptc.vnm|p3|default"]
        if reduce in ("sum", "mean") and dtype in ("float32", "float16"):
            out.append("extern.cusparse|none|default")
    elif op == "sddmm":
        for pipe in ("none", "degree"):
            for npw in (8, 32, 128):
                for g in ("d", "g16", "g8"):
                    out.append(f"csr.sddmm|{pipe}|npw{npw}-{g}")
        if dtype == "float32":   # cuSPARSE's SDDMM (torch.sparse.sampled_addmm) has no 16-bit kernels
            out.append("extern.cusparse|none|default")
    return out


def _crc_params(tpl, mod, variant: str) -> dict:
    ms, shape = variant.split("-")
    d = dict(tpl.default_params(mod))
    d["max_seg"] = int(ms[2:])
    if shape not in tpl.SHAPES:
        raise ValueError(f"unknown csr.crc_cwm variant {variant!r}")
    d.update(tpl.shape_params(shape, int(d["cf"])))
    return d


def _sddmm_params(tpl, mod, variant: str) -> dict:
    npw, g = variant.split("-")
    d = dict(tpl.default_params(mod))
    d["nnz_per_warp"] = int(npw[3:])
    if g != "d":
        group = int(g[1:])
        K, vec = mod.op.K, int(d["vec"])
        if group < d["group"]:
            xc = min(4, max(1, -(-K // (group * vec))))
            d.update(group=group, k_chunks=1 << (xc - 1).bit_length() if xc > 1 else 1)
    return d


def candidate_config(cid: str, op: SparseOp, target: str = "cuda") -> Config:
    """The config of portfolio member ``cid`` for ``op`` (parameters from the template's own
    heuristics at this K and dtype, modified as the member says)."""
    from ..core.ir import SparseModule
    from ..kernels import get_template
    from ..passes import Pipeline

    tname, pipe, variant = cid.split("|")
    tpl = get_template(tname)
    mod0 = SparseModule.from_op(op)
    if pipe.startswith("p"):
        spec = Pipeline(tpl.pipelines(mod0)[int(pipe[1:])]).spec()
    else:
        spec = Pipeline(_PIPES[pipe]).spec()
    if tname == "csr.crc_cwm":
        params = _crc_params(tpl, mod0, variant)
    elif tname == "csr.sddmm":
        params = _sddmm_params(tpl, mod0, variant)
    elif variant == "default":
        # the shipped templates' defaults depend on the op (K, dtype) only: no pipeline run here
        # (ranking would otherwise run every candidate's preprocessing once more)
        params = tpl.default_params(mod0)
    else:
        raise ValueError(f"unknown portfolio member {cid!r}")
    return tpl.make_config(params, spec, target, op.dtype)


# -- the data and the model ------------------------------------------------------------------
def workload_class(op: str, reduce: str | None, dtype: str, K: int) -> str:
    return f"{op}/{reduce or '-'}/{dtype}/{int(K)}"


@dataclass
class Table:
    """One workload class: candidate ids, and per training graph its features, baseline and
    kernel times (``nan``: the candidate failed or does not apply)."""

    candidates: list[str]
    names: list[str]
    digests: list[str]
    X: np.ndarray          # graphs x features
    times: np.ndarray      # graphs x candidates (seconds)
    baseline: np.ndarray   # graphs (seconds; nan when unknown)


class Knowledge:
    """Measured portfolio times per workload class and the k-NN ranking over them."""

    def __init__(self, doc: Mapping):
        self.doc = doc
        self.device = doc.get("device", "")
        self.arch = doc.get("arch", "")
        self.tables: dict[str, Table] = {}
        for cls, t in (doc.get("workloads") or {}).items():
            cands = list(t["candidates"])
            gs = t["graphs"]
            if not gs:
                continue
            X = np.array([_vector(g["features"]) for g in gs])
            T = np.array([[np.nan if v is None else float(v) for v in g["times"]] for g in gs], dtype=np.float64)
            B = np.array([np.nan if g.get("baseline_s") is None else float(g["baseline_s"]) for g in gs])
            self.tables[cls] = Table(cands, [g["name"] for g in gs], [g["digest"] for g in gs], X, T, B)

    #: a dtype without measurements of its own uses those of a dtype of the same width
    SAME_WIDTH = {"bfloat16": "float16"}

    def table_for(self, op: str, reduce: str | None, dtype: str, K: int) -> Table | None:
        """The class measured at the nearest K (log scale); SpMM max/min/mean fall back to the
        sum's measurements (same kernels and shapes) when they have none of their own, and
        ``bfloat16`` to ``float16``'s (same element width, same kernels)."""
        for dt in [dtype] + ([self.SAME_WIDTH[dtype]] if dtype in self.SAME_WIDTH else []):
            for red in ([reduce, "sum"] if op == "spmm" and reduce != "sum" else [reduce]):
                best = None
                for cls in self.tables:
                    o, r, d, k = cls.split("/")
                    if o == op and (r if r != "-" else None) == red and d == dt:
                        dist = abs(math.log2(int(k)) - math.log2(max(1, K)))
                        if best is None or dist < best[0]:
                            best = (dist, cls)
                if best is not None:
                    return self.tables[best[1]]
        return None

    @staticmethod
    def rank(table: Table, x: np.ndarray, exclude: Iterable[int] = (), k: int = 5,
             allowed: Iterable[str] | None = None) -> list[tuple[str, float, float | None]]:
        """Candidates best first as ``(id, predicted log time ratio to the best, expected speed-up
        over the baseline)`` from the ``k`` nearest training graphs not in ``exclude``."""
        keep = np.array([i for i in range(len(table.names)) if i not in set(exclude)], dtype=np.int64)
        if keep.size == 0:
            return []
        X = table.X[keep]
        mu, sd = X.mean(axis=0), X.std(axis=0)
        # a floor on the spread: a feature (nearly) constant over the training graphs must not
        # dominate the distance of a matrix that differs from them in it a little
        sd = np.maximum(sd, SD_FLOOR)
        d = np.sqrt((((X - mu) / sd - (x - mu) / sd) ** 2).sum(axis=1))
        nn = np.argsort(d, kind="stable")[:max(1, k)]
        w = 1.0 / (d[nn] + 0.25)
        T = table.times[keep][nn]
        best = np.nanmin(T, axis=1, keepdims=True)
        ratio = np.log(T / best)
        base = np.log(table.baseline[keep][nn][:, None] / T)
        ok = np.isfinite(ratio)
        # a failed candidate counts as 4x slower than the best of that graph
        ratio = np.where(ok, ratio, math.log(4.0))
        score = (w[:, None] * ratio).sum(axis=0) / w.sum()
        bw = np.where(np.isfinite(base), w[:, None], 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            sp = np.exp(np.nansum(np.where(np.isfinite(base), base, 0.0) * bw, axis=0) / bw.sum(axis=0))
        allowed = None if allowed is None else set(allowed)
        out = []
        for j in np.argsort(score, kind="stable"):
            cid = table.candidates[j]
            if allowed is not None and cid not in allowed:
                continue
            out.append((cid, float(score[j]), float(sp[j]) if np.isfinite(sp[j]) else None))
        return out


_CACHE: dict[str, Knowledge | None] = {}
_EXCLUDED: set[str] = set()


def knowledge_path(arch: str) -> str:
    return os.path.join(_DATA_DIR, f"knowledge_{arch}.json")


def load_knowledge(target: str = "cuda", arch: str | None = None) -> Knowledge | None:
    """The shipped knowledge for ``target`` (CUDA: the GPU's architecture, else the nearest
    shipped one of the same major version, else sm_90's), or ``None``.  ``SPCOMPILE_KNOWLEDGE``
    names another file."""
    path = os.environ.get("SPCOMPILE_KNOWLEDGE")
    if not path:
        if target == "cpu":
            path = os.path.join(_DATA_DIR, "knowledge_cpu.json")
        else:
            names = sorted(f for f in os.listdir(_DATA_DIR) if f.startswith("knowledge_sm_")) if os.path.isdir(_DATA_DIR) else []
            want = f"knowledge_{arch}.json" if arch else None
            path = os.path.join(_DATA_DIR, want if want in names else (names[-1] if names else "knowledge_sm_90.json"))
    if path not in _CACHE:
        try:
            with open(path) as fh:
                _CACHE[path] = Knowledge(json.load(fh))
        except FileNotFoundError:
            _CACHE[path] = None
    return _CACHE[path]


class excluded:
    """``with excluded(A, ...):`` the model ignores the training graphs with these matrices'
    patterns (leave-one-graph-out evaluation of the product path)."""

    def __init__(self, *mats):
        self.digests = {pattern_hash(_as_csr(a)) for a in mats}

    def __enter__(self):
        self._added = self.digests - _EXCLUDED
        _EXCLUDED.update(self._added)
        return self

    def __exit__(self, *exc):
        _EXCLUDED.difference_update(self._added)


def _as_csr(A):
    from ..core.formats import as_csr

    return as_csr(A)


def ranked_configs(op: SparseOp, target: str, precision: str = "fp32", k: int = 8) -> list[tuple[Config, float | None]]:
    """Up to ``k`` configs, best first, as ``(config, expected speed-up over the baseline)``.
    Empty when no knowledge applies (the caller falls back to its heuristics)."""
    from ..core.numerics import allowed_precisions
    from ..kernels import get_template

    kn = load_knowledge(target, _arch(target))
    if kn is None:
        return []
    table = kn.table_for(op.op, op.reduce, op.dtype, op.K)
    if table is None:
        return []
    x = _vector(features(op.A))
    exclude = [i for i, dg in enumerate(table.digests) if dg in _EXCLUDED]
    allowed_prec = set(allowed_precisions(precision, op.dtype))
    out: list[tuple[Config, float | None]] = []
    for cid, _score, sp in Knowledge.rank(table, x, exclude):
        tname = cid.split("|")[0]
        if not _applies(tname, op, target):
            continue
        try:
            cfg = candidate_config(cid, op, target)
        except Exception:
            continue
        if cfg.precision not in allowed_prec:
            continue
        tpl = get_template(tname)
        if not tpl.available():
            continue
        out.append((cfg, sp))
        if len(out) >= k:
            break
    return out


def cross_dtype_configs(op: SparseOp, target: str, precision: str = "fp32", k: int = 1) -> list[tuple[Config, None]]:
    """For 16-bit inputs: the ``float32`` class's first choices (same op, nearest K) that the
    ``op.dtype`` portfolio never measured, as configs for ``op.dtype``.

    The 16-bit portfolios are smaller than the ``float32`` one (fewer CUDA-core shapes, room for
    the tensor-core templates), so a shape that wins in ``float32`` on matrices like this one
    (say, eight loads in flight for a graph with one very long row) would otherwise never be
    tried; the kernels and their load balance are the same at both widths.  No expected speed-up
    is claimed (none was measured at this dtype).  Empty for ``float32`` or without knowledge."""
    from ..core.numerics import allowed_precisions
    from ..kernels import get_template

    if op.dtype == "float32":
        return []
    kn = load_knowledge(target, _arch(target))
    if kn is None:
        return []
    t32 = kn.table_for(op.op, op.reduce, "float32", op.K)
    if t32 is None:
        return []
    own = kn.table_for(op.op, op.reduce, op.dtype, op.K)
    measured = set(own.candidates) if own is not None else set()
    x = _vector(features(op.A))
    exclude = [i for i, dg in enumerate(t32.digests) if dg in _EXCLUDED]
    allowed_prec = set(allowed_precisions(precision, op.dtype))
    out: list[tuple[Config, None]] = []
    for cid, _score, _sp in Knowledge.rank(t32, x, exclude):
        tname = cid.split("|")[0]
        if cid in measured or tname.startswith("extern.") or not _applies(tname, op, target):
            continue
        try:
            cfg = candidate_config(cid, op, target)
        except Exception:
            continue
        if cfg.precision not in allowed_prec or not get_template(tname).available():
            continue
        out.append((cfg, None))
        if len(out) >= k:
            break
    return out


#: ``window_reuse`` (nonzeros per distinct column of 32-row windows, the matrix's own order) from
#: which :func:`reuse_configs` offers the tensor-core template on condensed 16-row windows.  Such
#: matrices (dense diagonal blocks: batches of dense ego networks, stiffness matrices) let a
#: window gather each X row once for many of its rows, which the CSR kernels do not: on the H200
#: tu_collab (24.6M entries, 14.5) ran 2.3-3.4x faster on it than on the CSR module ``build()``
#: kept at K = 64-256.  In the H100 oracle tables (fastest seed of each template) no shared graph
#: below 3 gains from it at K=128 (2.71-2.85: 1.5-2.0x slower than the best other template), and
#: ss_bcsstk25_pattern (3.65) runs it at 1.11 / 1.23x that time at K = 128 / 256; quick selection
#: measures it, so a matrix near the threshold pays build time only
#: (``docs/benchmarks/h100_crc_cwm_experiments.md`` section 15, ``h200_tu_collab_oracle.md``)
REUSE_MIN = 3.0
#: the template :func:`reuse_configs` offers
REUSE_TEMPLATE = "tc.wmma_sgt"


def reuse_configs(op: SparseOp, target: str, precision: str = "fp32") -> list[Config]:
    """Configs quick selection measures (and the tuner seeds) beside the model's ranking on a
    matrix whose row windows reuse their columns (``window_reuse`` at least :data:`REUSE_MIN`):
    :data:`REUSE_TEMPLATE` with its default parameters, on its condensed 16-row windows of the
    matrix's own order and of an RCM order.  For float32 inputs the split-tf32 precision
    (``3xtf32``, fp32-level results) when the precision policy admits it, else nothing (the
    portfolio of float32 has no tensor-core member); 16-bit inputs in their own precision.
    Empty where the template does not apply (target, op, GPU) or the reuse is lower."""
    from ..core.ir import SparseModule
    from ..core.numerics import allowed_precisions
    from ..kernels import get_template
    from ..passes import Pipeline

    if target != "cuda" or not _applies(REUSE_TEMPLATE, op, target) or op.A.nnz == 0:
        return []
    tpl = get_template(REUSE_TEMPLATE)
    if not tpl.available() or features(op.A)["window_reuse"] < REUSE_MIN:
        return []
    allowed = set(allowed_precisions(precision, op.dtype))
    mod0 = SparseModule.from_op(op)
    params = dict(tpl.default_params(mod0))
    if op.dtype == "float32":
        params["precision"] = "3xtf32"
    if params["precision"] not in allowed:
        return []
    own = list(tpl.pipelines(mod0)[0])
    out = []
    for spec in (own, list(_PIPES["rcm"]) + own):
        try:
            out.append(tpl.make_config(params, Pipeline(spec).spec(), target, op.dtype))
        except Exception:  # noqa: BLE001 - a candidate the template refuses is not offered
            continue
    return out


def _applies(tname: str, op: SparseOp, target: str) -> bool:
    from ..kernels import get_template

    try:
        tpl = get_template(tname)
    except Exception:
        return False
    return tpl.target == target and (op.op, op.reduce) in tpl.ops and op.dtype in tpl.dtypes


def _arch(target: str) -> str | None:
    if target != "cuda":
        return None
    try:
        from ..runtime import cuda as rt

        return f"sm_{rt.device_arch()}"
    except Exception:
        return None


# -- evaluation ------------------------------------------------------------------------------
def probe_ids(cid: str) -> list[str]:
    """The portfolio members that quick selection's second round measures when ``cid`` is the
    fastest of its first (the template's ``probe_variants``, in portfolio ids: csr.crc_cwm's
    neighbouring ``max_seg`` and other block shapes on the same pipeline; none for the others)."""
    from ..kernels import get_template

    tname, pipe, variant = cid.split("|")
    if tname != "csr.crc_cwm":
        return []
    tpl = get_template(tname)
    ms, shape = variant.split("-")
    ms = int(ms[2:])
    return ([f"{tname}|{pipe}|ms{m}-{shape}" for m in tpl.probe_max_segs(ms)]
            + [f"{tname}|{pipe}|ms{ms}-{s}" for s in tpl.SHAPES if s != shape])


def cross_validate(kn: Knowledge, quick: int | None = None, k: int = 5, more: int | None = None,
                   probe: bool | None = None) -> dict:
    """Leave-one-graph-out: for each class and graph, rank with that graph's measurements left
    out, and report the held-out graph's real time of the model's first choice ("model") and of
    the fastest of the choices quick selection measures (its first ``quick`` and up to ``more``
    of the next, :func:`spcompile.autotune.select.pick_candidates`, then with ``probe`` the
    second round next to the fastest of those, :func:`~spcompile.autotune.select.probe_leads` and
    :func:`probe_ids`; defaults as ``build()``) plus
    the baseline ("quick"), against the graph's oracle (fastest candidate) and baseline."""
    from .select import DEFAULT_CANDIDATES, MORE_CANDIDATES, PROBE, pick_candidates, probe_leads

    quick = DEFAULT_CANDIDATES if quick is None else quick
    more = MORE_CANDIDATES if more is None else more
    probe = PROBE if probe is None else probe

    def pipeline_of(cid):
        pipe = cid.split("|")[1]
        return pipe, ([p["name"] for p in _PIPES[pipe]] if pipe in _PIPES else None)

    out = {}
    for cls, t in kn.tables.items():
        rows = []
        base_idx = [j for j, c in enumerate(t.candidates) if c.startswith("extern.")]
        for i, name in enumerate(t.names):
            tt = t.times[i]
            if not np.isfinite(tt).any():
                continue
            order = [c for c, _, _ in Knowledge.rank(t, t.X[i], exclude=[i], k=k)]
            idx = {c: j for j, c in enumerate(t.candidates)}
            first = next((tt[idx[c]] for c in order if np.isfinite(tt[idx[c]])), np.nan)
            first_round = [c for c in pick_candidates(order, quick, more, pipeline_of) if np.isfinite(tt[idx[c]])]
            picks = [tt[idx[c]] for c in first_round] + [tt[j] for j in base_idx]
            if probe and first_round:
                for lead in probe_leads({c: tt[idx[c]] for c in first_round},
                                        probed=lambda c: any(x in idx for x in probe_ids(c))):
                    picks += [tt[idx[c]] for c in probe_ids(lead) if c in idx]
            picks = [p for p in picks if np.isfinite(p)]
            qk = min(picks) if picks else np.nan
            oracle = np.nanmin(tt)
            rows.append({"graph": name, "oracle_s": oracle, "model_s": first, "quick_s": qk,
                         "baseline_s": t.baseline[i]})
        if not rows:
            continue

        def gm(vals):
            v = [x for x in vals if np.isfinite(x) and x > 0]
            return float(np.exp(np.mean(np.log(v)))) if v else None

        out[cls] = {"graphs": len(rows),
                    "model_over_oracle": gm([r["oracle_s"] / r["model_s"] for r in rows]),
                    "quick_over_oracle": gm([r["oracle_s"] / r["quick_s"] for r in rows]),
                    "oracle_speedup": gm([r["baseline_s"] / r["oracle_s"] for r in rows]),
                    "model_speedup": gm([r["baseline_s"] / r["model_s"] for r in rows]),
                    "quick_speedup": gm([r["baseline_s"] / r["quick_s"] for r in rows]),
                    "quick_worst": min((r["baseline_s"] / r["quick_s"] for r in rows
                                        if np.isfinite(r["baseline_s"] / r["quick_s"])), default=None),
                    "rows": rows}
    return out


#: passes whose only purpose is load balance (long rows first, so no hub row starts last): on a
#: matrix whose stored order keeps neighbours together (batches of small graphs, crawl-ordered
#: graphs) they scatter the gathers of X, and without hub rows they balance nothing.  Measured on
#: the H100 at K=64 / 128 / 256: tu_dd 1.47x / 1.71x / 1.79x slower in degree order than in its
#: own order (same kernel), tu_nci1 1.02-1.25x; snap_sx_askubuntu (hub rows) 1.22x faster at K=64.
BALANCE_ONLY = ("reorder.degree",)


def _first_of_each_template(ranked):
    """``(config, template)`` of the first-ranked config of each template in ``ranked``."""
    from ..kernels import get_template

    seen = set()
    for cfg, _sp in ranked:
        if cfg.template not in seen:
            seen.add(cfg.template)
            yield cfg, get_template(cfg.template)


def native_order_variants(ranked, target: str, dtype: str, op=None) -> list:
    """Configs quick selection measures beside the model's ranking when the first-ranked config
    of a template runs on a load-balancing order only (:data:`BALANCE_ONLY`): the same config, and
    its template's unranked variants, on the matrix's own order (no pipeline).  Templates whose
    format needs a pass (tiles, condensed blocks) are left out."""
    out = []
    for cfg, tpl in _first_of_each_template(ranked):
        if tpl.format != "csr" or not cfg.pipeline or any(p["name"] not in BALANCE_ONLY for p in cfg.pipeline):
            continue
        out += _with_variants_on(cfg, tpl, (), target, dtype, op)
    return out


def _with_variants_on(cfg, tpl, pipeline, target: str, dtype: str, op=None) -> list:
    """``cfg``'s parameters and its template's unranked variants of them, on ``pipeline``."""
    return [tpl.make_config(p, pipeline, target, dtype)
            for p in [dict(cfg.params)] + list(tpl.unranked_variants(dict(cfg.params), op))]


def locality_order_variants(ranked, target: str, dtype: str, op=None) -> list:
    """Configs quick selection measures beside the model's ranking on orders the portfolio never
    measured: for the first-ranked config of each template, the same config and its template's
    unranked variants on each of the template's ``locality_orders`` for ``op`` (other than the
    config's own pipeline)."""
    from ..passes import Pipeline

    out = []
    for cfg, tpl in _first_of_each_template(ranked):
        for spec in tpl.locality_orders(op):
            spec = Pipeline(spec).spec()
            if list(spec) != list(cfg.pipeline):
                out += _with_variants_on(cfg, tpl, spec, target, dtype, op)
    return out


def unranked_variants(ranked, target: str, dtype: str, op=None) -> list:
    """Configs quick selection measures beside the model's ranking: for the first-ranked config of
    each template, the variants of it that its template says the portfolio never measured
    (``Template.unranked_variants``)."""
    return [tpl.make_config(p, cfg.pipeline, target, dtype)
            for cfg, tpl in _first_of_each_template(ranked) for p in tpl.unranked_variants(dict(cfg.params), op)]


#: the kinds of :func:`beside_ranking`, in its order
BESIDE_KINDS = ("variant", "native", "locality", "reuse")


def beside_ranking(ranked, op: SparseOp, target: str, precision: str = "fp32") -> list[tuple[str, Config]]:
    """``[(kind, config)]``: what quick selection measures beside the model's ranking ``ranked``
    (and the tuner seeds right behind its first choice), in :data:`BESIDE_KINDS` order: the
    unranked variants of each template's first choice, its native-order and locality-order
    versions, and the row-window reuse candidates."""
    dtype = op.dtype
    return ([("variant", c) for c in unranked_variants(ranked, target, dtype, op)]
            + [("native", c) for c in native_order_variants(ranked, target, dtype, op)]
            + [("locality", c) for c in locality_order_variants(ranked, target, dtype, op)]
            + [("reuse", c) for c in reuse_configs(op, target, precision)])
