"""Array frameworks the modules accept: numpy, torch, CuPy."""
from __future__ import annotations

import numpy as np

__all__ = ["array_kind"]


def array_kind(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    return "other"
