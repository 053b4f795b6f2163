"""``build()``: from a sparse matrix to a :class:`~spcompile.module.CompiledModule`.

Decision order: an explicit ``template``/``pipeline``/``params`` from the caller, else the
tuning database's best record for this workload and target, else (or with ``tune=True``)
the autotuner, else the default heuristics of the highest-priority template.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from .formats import as_csr
from .ir import SparseModule, SparseOp, values_hash
from .module import CompiledModule, Config
from .passes import PassContext, Pipeline
from .runtime import resolve_target
from .schedules import get_template, list_templates

__all__ = ["build", "make_op", "default_config", "build_from_config"]


_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "f32": "float32", "half": "float16", "fp16": "float16",
                  "f16": "float16", "bf16": "bfloat16"}


def dtype_name(dtype) -> str:
    """Normalise a dtype given as a string ("float16", "half", "bf16", ...), numpy dtype or torch
    dtype to one of :data:`spcompile.ir.DTYPES` (other names pass through and fail validation)."""
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.split(".")[0] == "torch":
        name = str(dtype).replace("torch.", "")
    else:
        try:
            import numpy as _np

            name = _np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    return _DTYPE_ALIASES.get(name, name)


def make_op(A, op: str = "spmm", K: int | None = None, reduce: str | None = None,
            dtype: str = "float32") -> SparseOp:
    if K is None:
        raise TypeError("K (the dense feature width) is required, e.g. build(A, op='spmm', K=64)")
    return SparseOp(op, reduce, as_csr(A), K, dtype_name(dtype))


def _templates_for_dtype(sop: SparseOp, target: str) -> list[str]:
    return [t.name for t in list_templates(target, op=sop.op, reduce=sop.reduce)
            if sop.dtype in t.dtypes]


def _check_dtype(sop: SparseOp, target: str, template: str | None) -> None:
    """float16 / bfloat16 workloads only build with templates that declare them
    (``Template.dtypes``, float32 only by default); a clear error otherwise."""
    if sop.dtype == "float32":
        return
    if target == "cpu":
        raise ValueError(f"unsupported dtype {sop.dtype!r} on target 'cpu': the CPU templates compute in "
                         f"float32 only; {sop.dtype} inputs (fp32 accumulation) are supported on target='cuda' "
                         f"by {_templates_for_dtype(sop, 'cuda') or 'no template'}")
    if template is not None:
        tpl = get_template(template)
        if sop.dtype not in tpl.dtypes:
            raise ValueError(f"unsupported dtype {sop.dtype!r} for template {tpl.name!r} (it supports "
                             f"{list(tpl.dtypes)}); templates with {sop.dtype} "
                             f"inputs for op={sop.op!r} reduce={sop.reduce!r}: "
                             f"{_templates_for_dtype(sop, 'cuda') or 'none'}")


def default_config(op: SparseOp, target: str) -> Config:
    """The heuristic choice without tuning: the highest-priority available template for the op."""
    mod = SparseModule.from_op(op)
    for tpl in list_templates(target, op=op.op, reduce=op.reduce, available_only=True):
        pipes = tpl.pipelines(mod)
        if pipes and pipes[0]:
            continue  # templates that need a preprocessing pipeline are left to the tuner
        if tpl.supports(mod):
            return Config(tpl.name, tpl.default_params(mod), (), target, tpl.format)
    raise RuntimeError(f"no template on target {target!r} supports op={op.op!r} reduce={op.reduce!r}")


def build_from_config(op: SparseOp, config: Config, ctx: PassContext | None = None,
                      tuning: Mapping[str, Any] | None = None, module: SparseModule | None = None) -> CompiledModule:
    """Replay a decision: run its pipeline, build its template with its parameters.  ``module``:
    the pipeline's output when the caller already has it (e.g. one pipeline run reused for
    several templates or widths; its ``op`` must be ``op``)."""
    tpl = get_template(config.template)
    if tpl.target != config.target:
        raise ValueError(f"template {tpl.name!r} is for target {tpl.target!r}, not {config.target!r}")
    if not tpl.available():
        raise RuntimeError(f"template {tpl.name!r} cannot be built on this machine (toolchain missing)")
    pipeline = Pipeline(config.pipeline)
    if module is not None and module.op is not op:
        raise ValueError("module was produced for another op")
    mod = module if module is not None else pipeline(SparseModule.from_op(op), ctx)
    if not tpl.supports(mod):
        raise ValueError(f"template {tpl.name!r} does not support op={op.op!r} reduce={op.reduce!r} "
                         f"after pipeline {[p['name'] for p in pipeline.spec()]}")
    params = tpl.check_params(mod, config.params)
    kernel = tpl.build(mod, params)
    # the options each pass actually ran with (PassContext overrides included), so that the
    # config replays to exactly this module
    ran = tuple({"name": r.name, "options": dict(r.options)} for r in mod.log)
    cfg = Config(tpl.name, params, ran, config.target, tpl.format)
    return CompiledModule(op.key(), cfg, kernel, [r.to_dict() for r in mod.log], values_hash(op.A), tuning)


def build(A, op: str = "spmm", K: int | None = None, reduce: str | None = None, *, target: str = "auto",
          dtype: str = "float32", template: str | None = None, params: Mapping[str, Any] | None = None,
          pipeline: Sequence | None = None, storage: str | None = None, tune: bool = False,
          trials: int | None = None, timeout: float | None = None, ctx: PassContext | None = None,
          precision: str = "fp32", **tune_options) -> CompiledModule:
    """Compile ``A`` for ``op`` ("spmm" with reduce sum/max/min/mean, or "sddmm") at width ``K``.

    ``target``: "auto" (cuda when a GPU is usable, else cpu), "cpu" or "cuda".
    ``template`` / ``params`` / ``pipeline``: force a decision (skips the database and tuner).
    ``storage``: Optuna storage URL of the tuning database (default: the embedded SQLite file).
    ``tune`` / ``trials`` / ``timeout``: tune on a database miss instead of using heuristics.
    ``precision``: the lowest arithmetic precision the chosen kernel may compute in: "fp32" (the
    default: exact fp32 kernels only), "tf32", "fp16" or "bf16" (tensor-core templates, with fp32
    accumulation).  An explicit ``template``/``params`` choice is built as given.
    """
    sop = make_op(A, op, K, reduce, dtype)
    target = resolve_target(target)
    from .tuner import allowed_precisions

    allowed_precisions(precision)  # a clear error for a bad policy, whatever path is taken
    _check_dtype(sop, target, template)
    if template is not None or params is not None or pipeline is not None:
        if template is None:
            template = default_config(sop, target).template
            _check_dtype(sop, target, template)
        tpl = get_template(template)
        cfg = Config(template, dict(params or {}), tuple(Pipeline(pipeline or ()).spec()), target, tpl.format)
        return build_from_config(sop, cfg, ctx)
    try:
        from . import tuner as _tuner
    except ImportError:  # the tuner is optional at this layer
        _tuner = None
    if _tuner is not None and hasattr(_tuner, "choose_config"):
        cfg, info = _tuner.choose_config(sop, target, storage=storage, tune=tune, trials=trials,
                                         timeout=timeout, precision=precision, **tune_options)
        _check_dtype(sop, target, cfg.template)
        return build_from_config(sop, cfg, ctx, info)
    if tune or trials:
        raise RuntimeError("tuning is not available in this build of spcompile")
    return build_from_config(sop, default_config(sop, target), ctx)
