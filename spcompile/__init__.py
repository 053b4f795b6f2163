"""spcompile: a sparse compiler and autotuner for sparse x dense kernels (SpMM, SDDMM and
SpMM-like reductions) on GPUs and CPUs.

    mod = spcompile.build(A, op="spmm", K=64)      # A: scipy / torch sparse or (indptr, indices, data, shape)
    Y = mod(X)                                     # == A @ X
    mod.save("a.spc"); mod = spcompile.load("a.spc")
"""
from ._version import __version__
from .api import build, load
from .artifact import ArtifactError
from .core.config import Config
from .core.formats import CSR, as_csr
from .core.ir import SparseModule, SparseOp, WorkloadKey
from .kernels import Template, get_template, list_templates, register_template
from .module import CompiledModule
from .passes import Pass, PassContext, Pipeline, TimingInstrument, register_pass
from .runtime import TargetUnavailableError
from . import passes  # noqa: F401

__all__ = ["__version__", "build", "load", "tune", "CompiledModule", "Config", "ArtifactError", "SparseOp",
           "SparseModule", "WorkloadKey", "CSR", "as_csr", "Pass", "PassContext", "Pipeline", "TimingInstrument",
           "register_pass", "Template", "register_template", "get_template", "list_templates",
           "TargetUnavailableError", "passes"]


def __getattr__(name):
    # the autotuner's entry point, imported on first use by spcompile.api
    if name == "tune":
        from .api import tune

        return tune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
