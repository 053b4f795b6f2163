"""From a decision to a module: :func:`make_op` (the workload), :func:`default_config` (the
heuristic decision) and :func:`build_from_config` (run the pipeline, build the template).

This layer knows nothing of the tuner: :func:`spcompile.build` (``spcompile.api``) decides
*which* config to build (explicit choice, database, tuner, heuristics) and calls down here.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .core.formats import as_csr
from .core import numerics
from .core.ir import SparseModule, SparseOp, values_hash
from .core.config import Config
from .module import CompiledModule
from .passes import PassContext, Pipeline
from .kernels import get_template, list_templates

__all__ = ["make_op", "default_config", "build_from_config", "check_dtype"]


def make_op(A, op: str = "spmm", K: int | None = None, reduce: str | None = None,
            dtype: str = "float32") -> SparseOp:
    if K is None:
        raise TypeError("K (the dense feature width) is required, e.g. build(A, op='spmm', K=64)")
    dt = numerics.dtype(dtype)
    return SparseOp(op, reduce, as_csr(A, dt.compute), K, dt.name)   # the values never rounded below it


def _templates_for_dtype(sop: SparseOp, target: str) -> list[str]:
    return [t.name for t in list_templates(target, op=sop.op, reduce=sop.reduce)
            if sop.dtype in t.dtypes]


def check_dtype(sop: SparseOp, target: str, template: str | None) -> None:
    """A workload builds only with templates that declare its dtype (``Template.dtypes``: float32
    by default; float16 / bfloat16 on some CUDA templates, float64 on the CPU ones); a clear error
    otherwise, naming the target and templates that compute it."""
    if sop.dtype == "float32":
        return
    here = _templates_for_dtype(sop, target)
    if not here:
        other = "cuda" if target == "cpu" else "cpu"
        computes = sorted({d for t in list_templates(target) for d in t.dtypes})
        raise ValueError(f"unsupported dtype {sop.dtype!r} on target {target!r}: the {target.upper()} templates "
                         f"take {' / '.join(computes)} inputs only ({_DTYPE_NOTES[target]}); {sop.dtype} "
                         f"{sop.op} is supported on target={other!r} by "
                         f"{_templates_for_dtype(sop, other) or 'no template'}")
    if template is not None:
        tpl = get_template(template)
        if sop.dtype not in tpl.dtypes:
            raise ValueError(f"unsupported dtype {sop.dtype!r} for template {tpl.name!r} (it supports "
                             f"{list(tpl.dtypes)}); templates with {sop.dtype} "
                             f"inputs for op={sop.op!r} reduce={sop.reduce!r}: {here}")


def workload_target(sop: SparseOp, target: str, template: str | None = None) -> str:
    """``target`` resolved for this workload: "auto" is cuda when a GPU is usable and a CUDA
    template computes the workload's dtype, else cpu (float64 is computed on the CPU only); an
    explicit target whose templates do not compute the dtype is a clear error, said before any
    GPU is looked for."""
    from .runtime import resolve_target

    if target in ("cpu", "cuda"):
        check_dtype(sop, target, template)
    elif target == "auto":
        try:
            check_dtype(sop, "cuda", None)   # does any CUDA template compute the dtype?
        except ValueError:
            target = "cpu"
    target = resolve_target(target)
    check_dtype(sop, target, template)
    return target


#: what each target's kernels compute in, for the errors of :func:`check_dtype`
_DTYPE_NOTES = {"cpu": "float32 computed in float32, float64 in float64",
                "cuda": "computed in float32 or tensor-core precisions, 16-bit inputs with fp32 accumulation"}


def default_config(op: SparseOp, target: str) -> Config:
    """The heuristic choice without tuning: the highest-priority available template for the op."""
    mod = SparseModule.from_op(op)
    for tpl in list_templates(target, op=op.op, reduce=op.reduce, available_only=True):
        pipes = tpl.pipelines(mod)
        if pipes and pipes[0]:
            continue  # templates that need a preprocessing pipeline are left to the tuner
        if tpl.supports(mod):
            return tpl.make_config(tpl.default_params(mod), (), target, op.dtype)
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
    cfg = tpl.make_config(params, ran, config.target, op.dtype)
    out = CompiledModule(op.key(), cfg, kernel, [r.to_dict() for r in mod.log], values_hash(op.A), tuning)
    out.matrix = op.A
    # call-time values' slots: the passes' entry order, then any move the packer made
    src = getattr(kernel, "entry_src", None)
    out.values_src = mod.nnz_perm if src is None else (
        np.asarray(src, np.int64) if mod.nnz_perm is None else np.asarray(mod.nnz_perm)[np.asarray(src, np.int64)])
    return out
