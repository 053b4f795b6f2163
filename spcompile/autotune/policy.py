"""Where a build's decision comes from: the database's best valid record; else tuning (when
asked); else the shipped knowledge -- on a GPU, quick selection among the model's first choices
and the vendor library within a small measurement budget, without one the model's first choice;
else the default heuristics."""
from __future__ import annotations

import os

from ..compile import default_config
from ..core.config import Config
from ..core.ir import SparseOp
from ..core.numerics import allowed_precisions
from .database import normalize_url, open_database, sqlite_path
from .measure import MODES
from .tuner import Tuner, objective_name, precision_name

__all__ = ["choose_config", "decide", "safe_url", "record_info", "describe"]


def choose_config(sop: SparseOp, target: str, storage: str | None = None, tune: bool = False,
                  trials: int | None = None, timeout: float | None = None, objective: str = "kernel_time",
                  expected_calls: float | None = None, precision: str = "fp32", **options) -> tuple[Config, dict]:
    """The decision :func:`spcompile.build` replays (see :func:`decide`): ``(config, info)``."""
    cfg, info, _ = decide(sop, target, storage, tune, trials, timeout, objective, expected_calls, precision, **options)
    return cfg, info


#: quick selection's source labels of the candidates measured beside the model's ranking
#: (:func:`~spcompile.autotune.knowledge.beside_ranking`'s kinds)
_BESIDE_LABELS = {"variant": "model (variant)", "native": "model (native order)",
                  "locality": "model (locality order)", "reuse": "model (row-window reuse)"}


def decide(sop: SparseOp, target: str, storage: str | None = None, tune: bool = False,
           trials: int | None = None, timeout: float | None = None, objective: str = "kernel_time",
           expected_calls: float | None = None, precision: str = "fp32", select_budget: float | None = None,
           ctx=None, skip_records=(), call_values: bool = False, **options):
    """The database's best valid record (a hit: no tuning); on a miss, tuning when
    ``tune``/``trials``/``timeout`` asks for it, else the shipped knowledge (quick selection on a
    GPU within ``select_budget`` seconds of measurement, default
    :data:`~spcompile.autotune.select.DEFAULT_BUDGET_S`; 0 turns it off), else the heuristics.
    Returns ``(config, info, module)``: ``info`` says where the decision came from (``source``:
    "database" -- an exact record --, "tuned" -- a record this call's tuning stored --, "quick",
    "model" or "heuristic"; for records their measured speed-up over the baseline measured with
    them, the study, trial and graph file; for the model its expected speed-up); ``module``
    is the already-built module when quick selection built it (else None).  ``skip_records``:
    ids of database records not to use (records that failed to build).  ``call_values``: only
    templates that take the matrix values at call time (records of others are passed over, and
    the vendor library only where it takes them: SciPy does, cuSPARSE does not)."""
    from ..kernels import get_template

    def takes_values(cfg) -> bool:
        return not call_values or get_template(cfg.template).call_values_array is not None

    obj = objective_name(objective, expected_calls)
    precision = precision_name(precision)
    url = normalize_url(storage)
    want_tune = bool(tune or trials or timeout)
    db = None
    path = sqlite_path(url)
    if want_tune or path is None or os.path.exists(path):
        try:
            db = open_database(url)
        except Exception as e:
            if storage is not None or want_tune:
                raise
            db = None
            db_error = str(e)
            _warn_default_db(url, db_error)
    if db is not None:
        try:
            rec = db.lookup(sop.key(), target, obj, precision=precision, timing=(MODES[target][0], ""),
                            skip=skip_records)
        except Exception as e:  # an unreadable default database must not break build()
            if storage is not None:
                raise
            rec, db_error = None, str(e)
            _warn_default_db(url, db_error)
        if rec is not None and rec.config.precision in allowed_precisions(precision, sop.dtype) \
                and takes_values(rec.config):
            return rec.config, record_info(rec, "database", url, obj, precision), None
    extra = {}
    if want_tune:
        if "start_from" not in options:
            start = untuned_config(sop, target, storage=url, objective=objective, expected_calls=expected_calls,
                                   precision=precision, select_budget=select_budget, ctx=ctx,
                                   skip_records=skip_records, call_values=call_values)
            if start is not None:
                options["start_from"] = start
        res = Tuner(sop, target, storage=url, objective=objective, expected_calls=expected_calls,
                    precision=precision, **options).run(trials, timeout)
        rec = None
        try:
            rec = db.lookup(sop.key(), target, obj, precision=precision, timing=(MODES[target][0], ""),
                            skip=skip_records)
        except Exception:  # noqa: BLE001
            rec = None
        if rec is not None and rec.config.precision in allowed_precisions(precision, sop.dtype):
            mine = rec.study_name == res.study_name
            info = record_info(rec, "tuned" if mine else "database", url, obj, precision)
            info["trials"] = res.n_trials
            info["tune_seconds"] = dict(res.seconds)
            if not mine:
                info["tune_note"] = res.store_note
            return rec.config, info, None
        # nothing stored (the search's best was slower than the default or the baseline, or
        # nothing worked): the other paths decide, and the info says why
        extra["tune_note"] = res.store_note or "tuning found no working config"
        extra["tune_study"] = res.study_name
    if db is None and "db_error" in locals():
        extra["db_error"] = db_error[-300:]
    ranked, cross, model_error = [], [], None
    if obj == "kernel_time":
        try:
            from .knowledge import ranked_configs
            from .select import RANKED

            ranked = [r for r in ranked_configs(sop, target, precision, k=RANKED) if takes_values(r[0])]
            if ranked:
                from .knowledge import beside_ranking, cross_dtype_configs

                cross = [("model (float32 shape)", c, sp) for c, sp in cross_dtype_configs(sop, target, precision)
                         if takes_values(c)]
                cross += [(_BESIDE_LABELS[kind], c, None) for kind, c in beside_ranking(ranked, sop, target, precision)
                          if takes_values(c)]
        except Exception as e:  # noqa: BLE001 - knowledge is an optimisation: never a reason to fail
            model_error = f"{type(e).__name__}: {e}"[:300]
    if model_error:
        extra["model_error"] = model_error
    from .select import DEFAULT_BUDGET_S, quick_select, vendor_config

    budget = DEFAULT_BUDGET_S if select_budget is None else float(select_budget)
    vendor = vendor_config(sop, target)
    vendor_ok = vendor is not None and takes_values(vendor)
    if budget > 0 and obj == "kernel_time" and (ranked or vendor_ok):
        label = "model" if ranked else "heuristic"
        if not ranked:
            dflt = default_config(sop, target)
            tpl = get_template(dflt.template)
            ranked = [(dflt, None)] + [(tpl.make_config(p, dflt.pipeline, target, sop.dtype), None)
                                       for p in tpl.quick_alternatives(dict(dflt.params))]
        try:
            mod, qinfo = quick_select(sop, target, ranked, budget_s=budget, ctx=ctx, label=label, vendor=vendor_ok,
                                      extra=cross)
        except Exception as e:  # noqa: BLE001
            mod, qinfo = None, {"error": f"{type(e).__name__}: {e}"[:300]}
        if mod is not None:
            return mod.config, {"source": "quick", "objective": obj, "precision": precision, **qinfo, **extra}, mod
        extra["quick_error"] = qinfo.get("error") or "no candidate worked"
    if ranked:
        cfg, sp = ranked[0]
        return cfg, {"source": "model", "objective": obj, "precision": precision,
                     **({"expected_speedup": sp} if sp else {}), **extra}, None
    return default_config(sop, target), {"source": "heuristic", "objective": obj, **extra}, None


def untuned_config(sop: SparseOp, target: str, objective: str = "kernel_time", expected_calls: float | None = None,
                   **kw) -> Config | None:
    """What :func:`decide` without tuning picks for ``sop`` (``kw``: its other arguments, storage
    among them): the database's record, else quick selection's measured pick, else the model's or
    the heuristics'.  A study's first seed (``Tuner(start_from=...)``), so that a short study does
    not store or return a config slower than an untuned build would use.  None for the amortized
    objective (quick selection measures kernel time only) or when that fails."""
    try:
        if objective_name(objective, expected_calls) != "kernel_time":
            return None
        return decide(sop, target, objective=objective, expected_calls=expected_calls, **kw)[0]
    except Exception:  # noqa: BLE001 - a seed is an optimisation, never a reason to fail
        return None


_WARNED_DEFAULT: set = set()


def _warn_default_db(url: str, error: str) -> None:
    """The default database is unusable: build() goes on without it, saying so once."""
    if url in _WARNED_DEFAULT:
        return
    _WARNED_DEFAULT.add(url)
    import warnings

    warnings.warn(f"the tuning database {safe_url(url)} cannot be used ({error[:300]}); building without its "
                  "records", RuntimeWarning, stacklevel=4)


def record_info(rec, source: str, url: str, objective: str, precision: str) -> dict:
    """What a decision taken from a database record says about itself."""
    info = {"source": source, "storage": safe_url(url), "objective": objective, "precision": precision,
            "timing": rec.timing, "kernel_ms": rec.kernel_ms, "preprocess_ms": rec.preprocess_ms,
            "baseline_ms": rec.baseline_ms, "baseline_name": rec.baseline_name,
            "study": rec.study_name, "trial": rec.trial_number, "record_id": rec.id, "measured": rec.created}
    if rec.speedup is not None:
        info["measured_speedup"] = rec.speedup
    extra = rec.extra or {}
    for k in ("graph", "default_ms", "confirmed"):
        if extra.get(k) is not None:
            info[k] = extra[k]
    return info


_SOURCES = {"database": "tuning record", "tuned": "tuned by this build", "quick": "quick selection",
            "model": "shipped model's first choice", "heuristic": "default heuristics",
            "explicit": "chosen by the caller"}


def describe(info: dict | None) -> str:
    """One line saying where a module's decision came from (``mod.tuning``), for people."""
    info = dict(info or {})
    src = info.get("source")
    if not src:
        return "decision: unknown (built by an older spcompile)"
    parts = [f"decision: {src} ({_SOURCES.get(src, src)})"]
    sp, base = info.get("measured_speedup"), info.get("baseline_name")
    if sp is None and info.get("baseline_ms") and info.get("kernel_ms") and src in ("database", "tuned", "quick"):
        sp = info["baseline_ms"] / info["kernel_ms"]
    if sp is not None:
        parts.append(f"measured {sp:.2f}x over {base or 'the baseline'}"
                     + (f" ({info['kernel_ms']:.4g} ms vs {info['baseline_ms']:.4g} ms)"
                        if info.get("kernel_ms") and info.get("baseline_ms") else ""))
    elif info.get("expected_speedup") is not None:
        parts.append(f"expected {float(info['expected_speedup']):.2f}x over the vendor library")
    where = []
    if info.get("graph"):
        where.append(f"graph {info['graph']}")
    if info.get("study"):
        where.append(f"study {info['study']}")
    if info.get("trial") is not None:
        where.append(f"trial {info['trial']}")
    if info.get("storage") and src in ("database", "tuned"):
        where.append(f"in {info['storage']}")
    if where:
        parts.append(", ".join(where))
    for k in ("tune_note", "quick_error", "model_error", "db_error"):
        if info.get(k):
            parts.append(f"{k.replace('_', ' ')}: {info[k]}")
    return "; ".join(parts)


def safe_url(url: str) -> str:
    """The URL without its password (it goes into artifacts)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]
