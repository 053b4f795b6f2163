"""Preprocessing passes.  ``run(name, A, **options)`` runs one pass on its own."""
from __future__ import annotations

from .base import (ENTRY_POINT_GROUP, FunctionPass, Pass, PassContext, PassInfo, PassInstrument,
                   Pipeline, TimingInstrument, get_pass, list_passes, pipeline_key, register_pass, run_prefixed)

__all__ = ["Pass", "PassInfo", "FunctionPass", "PassContext", "PassInstrument", "TimingInstrument",
           "Pipeline", "register_pass", "get_pass", "list_passes", "run", "ENTRY_POINT_GROUP", "pipeline_key",
           "run_prefixed"]


def run(name: str, A, *, op: str = "spmm", K: int = 1, reduce: str | None = None,
        ctx: PassContext | None = None, **options):
    """Run the single pass ``name`` on matrix ``A`` (any supported input) and return the
    :class:`~spcompile.core.ir.SparseModule` after it: ``.row_perm``, ``.col_perm``, ``.A``,
    ``.formats`` and ``.metrics[name]``."""
    from ..core.formats import as_csr
    from ..core.ir import SparseModule, SparseOp

    mod = SparseModule.from_op(SparseOp(op, reduce, as_csr(A), K))
    return Pipeline([get_pass(name, **options)])(mod, ctx)
