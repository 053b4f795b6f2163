"""The public entry points: :func:`build`, :func:`load`, :func:`tune`.

Decision order of :func:`build`: an explicit ``template``/``pipeline``/``params`` from the caller,
else the tuning database's best record for this workload and target, else (or with
``tune=True``) the autotuner, else the shipped knowledge (on a GPU: quick selection among the
model's first choices and the vendor library), else the default heuristics of the
highest-priority template (:mod:`spcompile.autotune.policy`).
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Sequence

from .compile import build_from_config, check_dtype, default_config, make_op, workload_target
from .core.numerics import allowed_precisions
from .kernels import get_template
from .module import CompiledModule, load
from .passes import PassContext, Pipeline

__all__ = ["build", "load"]   # and `tune`, resolved on first use (__getattr__ below)


def build(A, op: str = "spmm", K: int | None = None, reduce: str | None = None, *, target: str = "auto",
          dtype: str = "float32", template: str | None = None, params: Mapping[str, Any] | None = None,
          pipeline: Sequence | None = None, storage: str | None = None, tune: bool = False,
          trials: int | None = None, timeout: float | None = None, ctx: PassContext | None = None,
          precision: str = "fp32", select_budget: float | None = None, call_values: bool = False,
          **tune_options) -> CompiledModule:
    """Compile ``A`` for ``op`` ("spmm" with reduce sum/max/min/mean, or "sddmm") at width ``K``.

    ``target``: "auto" (cuda when a GPU is usable and a CUDA template computes ``dtype``, else
    cpu: float64 modules are CPU modules), "cpu" or "cuda".
    ``template`` / ``params`` / ``pipeline``: force a decision (skips the database and tuner).
    ``storage``: Optuna storage URL of the tuning database (default: the embedded SQLite file).
    ``tune`` / ``trials`` / ``timeout``: tune on a database miss instead of using heuristics.
    ``precision``: the lowest arithmetic precision the chosen kernel may compute in: "fp32" (the
    default: exact fp32 kernels only), "tf32", "fp16" or "bf16" (tensor-core templates, with fp32
    accumulation).  An explicit ``template``/``params`` choice is built as given.
    ``select_budget``: seconds of GPU measurement a build may spend on a database miss choosing
    among the shipped model's first choices and the vendor library (default 1.0; 0: take the
    model's first choice unmeasured).  ``mod.tuning`` says where the decision came from:
    ``source`` is "database" (an exact tuning record), "tuned" (tuned by this call), "quick"
    (quick selection), "model" (the shipped model's first choice), "heuristic" or "explicit"
    (the caller's template/params/pipeline); records add their measured speed-up over the
    baseline measured with them (``measured_speedup``, ``baseline_name``), ``study``, ``trial``
    and the tuned ``graph`` file; the model adds its ``expected_speedup``.  A database record
    that fails to build is skipped with a warning (the next decision is used).
    ``call_values``: the module will be called with new values (``mod(X, values=v)``, e.g. attention
    weights in training): only templates that read the values per call are considered.
    """
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of template parameters (e.g. {{'k_tile': 32}}), "
                        f"got {type(params).__name__}")
    if pipeline is not None and (isinstance(pipeline, (str, bytes)) or not isinstance(pipeline, Iterable)):
        raise TypeError(f"pipeline must be a list of passes (e.g. ['reorder.rcm']), got {type(pipeline).__name__} "
                        f"{str(pipeline)[:60]!r}")
    sop = make_op(A, op, K, reduce, dtype)
    target = workload_target(sop, target, template)
    allowed_precisions(precision, sop.dtype)  # a clear error for a bad policy, whatever path is taken
    if template is not None or params is not None or pipeline is not None:
        if template is None:
            template = default_config(sop, target).template
            check_dtype(sop, target, template)
        tpl = get_template(template)
        cfg = tpl.make_config(dict(params or {}), Pipeline(pipeline or ()).spec(), target, sop.dtype)
        return build_from_config(sop, cfg, ctx, {"source": "explicit"})
    from .autotune.policy import decide   # the autotuner's stack: imported by building only

    skipped: list[int] = []
    while True:
        cfg, info, mod = decide(sop, target, storage=storage, tune=tune, trials=trials, timeout=timeout,
                                precision=precision, select_budget=select_budget, ctx=ctx,
                                skip_records=tuple(skipped),
                                **({"call_values": True} if call_values else {}), **tune_options)
        if mod is not None:
            check_dtype(sop, target, cfg.template)
            mod.tuning = dict(info)
            if mod.matrix is None:
                mod.matrix = sop.A
            return mod
        rid = info.get("record_id") if info.get("source") in ("database", "tuned") else None
        if rid is None or len(skipped) >= 8:
            check_dtype(sop, target, cfg.template)
            return build_from_config(sop, cfg, ctx, info)
        try:   # a record that does not build (damaged, or from another setup): the next decision
            check_dtype(sop, target, cfg.template)
            return build_from_config(sop, cfg, ctx, info)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"tuning record {rid} ({cfg.template}) in {info.get('storage')} does not build here "
                          f"({type(e).__name__}: {str(e)[:200]}); using the next choice", RuntimeWarning,
                          stacklevel=2)
            skipped.append(rid)
            tune = False
            trials = timeout = None


def __getattr__(name):
    # ``tune`` (the autotuner) is imported on first use: loading and running saved modules never
    # pays for the tuner's imports
    if name == "tune":
        from .autotune.tuner import tune

        return tune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
