"""Target resolution: "auto" picks "cuda" when a GPU is usable, else "cpu"."""
from __future__ import annotations

import functools
import os

TARGETS = ("auto", "cpu", "cuda")


class TargetUnavailableError(RuntimeError):
    """The requested target cannot be used on this machine."""


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when a CUDA GPU is visible to the driver and CuPy (which building and tuning for
    it use) is installed; neither imports CuPy nor creates a CUDA context.  (Loading and calling
    a saved CUDA module needs the driver only.)"""
    if os.environ.get("SPCOMPILE_DISABLE_CUDA"):
        return False
    import importlib.util

    from . import driver

    try:
        return driver.device_count() > 0 and importlib.util.find_spec("cupy") is not None
    except Exception:
        return False


def resolve_target(target: str) -> str:
    if not isinstance(target, str) or target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {TARGETS}")
    if target == "auto":
        return "cuda" if cuda_available() else "cpu"
    if target == "cuda" and not cuda_available():
        raise TargetUnavailableError(
            "target='cuda' but no usable CUDA GPU was found (CuPy with a visible device is needed: "
            "pip install 'spcompile[cuda]'); use target='cpu' or 'auto'")
    return target
