"""Target resolution: "auto" picks "cuda" when a GPU is usable, else "cpu"."""
from __future__ import annotations

import functools
import os

TARGETS = ("auto", "cpu", "cuda")


class TargetUnavailableError(RuntimeError):
    """The requested target cannot be used on this machine."""


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """True when a CUDA GPU is usable through CuPy (the GPU runtime of spcompile)."""
    if os.environ.get("SPCOMPILE_DISABLE_CUDA"):
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
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
