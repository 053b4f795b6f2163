"""Pre-tuned knowledge: a model that ranks candidate configs for a workload it has never seen.

Interface (the implementation is being written): :func:`ranked_configs` returns the configs the
model expects to be fastest for ``op`` on ``target`` under the precision policy, best first, each
with the model's expected speed-up over the vendor baseline (``None`` when unknown).
"""
from __future__ import annotations

from ..core.config import Config
from ..core.ir import SparseOp

__all__ = ["ranked_configs"]


def ranked_configs(op: SparseOp, target: str, precision: str = "fp32", k: int = 8) -> list[tuple[Config, float | None]]:
    """Up to ``k`` configs, best first, as ``(config, expected speed-up over the baseline)``.
    Empty when no knowledge applies (the caller falls back to its heuristics)."""
    return []
