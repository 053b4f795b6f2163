"""The package version and the versions of the libraries artifacts depend on."""
from __future__ import annotations

__version__ = "0.1.0"


def tvm_version() -> str | None:
    try:
        import tvm

        return tvm.__version__
    except Exception:
        return None
