"""The package version and the versions of the libraries artifacts depend on."""
from __future__ import annotations

__version__ = "0.1.0"


def tvm_version() -> str | None:
    """TVM's version; None where it is not installed (a machine that only runs saved CUDA modules)."""
    try:
        import tvm
    except ImportError:
        return None
    return tvm.__version__
