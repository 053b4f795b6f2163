"""The search space: which templates, pipelines and parameters the tuner may offer for an op."""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from ..core.ir import SparseModule, SparseOp
from ..kernels import list_templates
from ..passes import Pipeline
from ..passes.base import list_passes

__all__ = ["DEFAULT_REORDERS", "candidates", "suggest", "contains"]

#: lossless reorderings the tuner may put in front of a template's own pipeline
DEFAULT_REORDERS = ("reorder.rcm", "reorder.degree")


def _pipeline_label(spec: Sequence[Mapping]) -> str:
    if not spec:
        return "none"
    return "+".join(p["name"] for p in spec)


def candidates(op: SparseOp, target: str, reorders: Iterable[str] = DEFAULT_REORDERS) -> dict[str, dict[str, list]]:
    """``{template: {pipeline label: pipeline spec}}`` offered for ``op`` on ``target``: templates
    that support the op and whose toolchain is available, each with its own pipelines and those
    pipelines behind each generic reordering."""
    mod0 = SparseModule.from_op(op)
    registered = set(list_passes())
    reorders = [r for r in reorders if r in registered]
    out: dict[str, dict[str, list]] = {}
    for tpl in list_templates(target, op=op.op, reduce=op.reduce, available_only=True):
        if (op.op, op.reduce) not in tpl.ops or op.dtype not in tpl.dtypes:
            continue   # (a 16-bit workload: only the templates that take 16-bit inputs)
        if not getattr(tpl, "tunable", True):
            continue   # offered by quick selection only (see the template)
        try:
            own = [Pipeline(p).spec() for p in tpl.pipelines(mod0)]
        except Exception:  # a template naming passes that are not registered: not offered
            continue
        if not own:
            continue
        pipes: dict[str, list] = {}

        def add(spec):
            if spec in pipes.values():
                return
            label = _pipeline_label(spec)
            i = 2
            while label in pipes:
                label = f"{_pipeline_label(spec)}#{i}"
                i += 1
            pipes[label] = spec

        for spec in own:
            add(spec)
        for spec in own:
            if spec and spec[0]["name"].startswith("reorder."):
                continue
            for r in reorders:
                add(Pipeline([r]).spec() + spec)
        if not own[0] and not tpl.supports(mod0):
            continue
        out[tpl.name] = pipes
    return out


def suggest(trial, name: str, dist):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, list(dist.choices))
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    raise TypeError(f"unsupported distribution for {name!r}: {dist!r}")


def contains(dist, value) -> bool:
    try:
        return bool(dist._contains(dist.to_internal_repr(value)))
    except Exception:
        return False
