"""spcompile: a sparse compiler and autotuner for sparse x dense kernels (SpMM, SDDMM and
SpMM-like reductions) on GPUs and CPUs.

    mod = spcompile.build(A, op="spmm", K=64)      # A: scipy / torch sparse or (indptr, indices, data, shape)
    Y = mod(X)                                     # == A @ X
    mod.save("a.spc"); mod = spcompile.load("a.spc")
"""
__version__ = "0.1.0"

from .compiler import build  # noqa: E402
from .formats import CSR, as_csr  # noqa: E402
from .ir import SparseModule, SparseOp, WorkloadKey  # noqa: E402
from .module import ArtifactError, CompiledModule, Config, load  # noqa: E402
from .passes import Pass, PassContext, Pipeline, TimingInstrument, register_pass  # noqa: E402
from .runtime import TargetUnavailableError  # noqa: E402
from .schedules import Template, get_template, list_templates, register_template  # noqa: E402
from . import passes  # noqa: E402,F401

__all__ = ["build", "load", "tune", "CompiledModule", "Config", "ArtifactError", "SparseOp", "SparseModule",
           "WorkloadKey", "CSR", "as_csr", "Pass", "PassContext", "Pipeline", "TimingInstrument",
           "register_pass", "Template", "register_template", "get_template", "list_templates",
           "TargetUnavailableError", "passes"]


def tune(*args, **kwargs):
    """Tune workloads and store the best configs (see :mod:`spcompile.tuner`)."""
    from .tuner import tune as _tune

    return _tune(*args, **kwargs)
