"""The package version and the versions of the libraries artifacts depend on."""
from __future__ import annotations

__version__ = "0.1.0"


def tvm_version() -> str | None:
    """TVM's version; None where it is not installed (a machine that only runs saved CUDA modules).
    Read from TVM's ``_version.py`` without importing TVM (which loads its compiler: seconds)."""
    import sys

    tvm = sys.modules.get("tvm")
    if tvm is not None:
        return tvm.__version__
    import importlib.util
    import os

    spec = importlib.util.find_spec("tvm")
    if spec is None:
        return None
    try:
        path = os.path.join(list(spec.submodule_search_locations)[0], "_version.py")
        vspec = importlib.util.spec_from_file_location("_spcompile_tvm_version", path)
        mod = importlib.util.module_from_spec(vspec)
        vspec.loader.exec_module(mod)
        return str(mod.__version__)
    except Exception:  # another layout: ask TVM itself
        try:
            import tvm
        except ImportError:
            return None
        return tvm.__version__
