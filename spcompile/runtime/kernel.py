"""The :class:`Kernel` base: a compiled kernel bound to its matrix data (what templates build
and artifacts store)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["Kernel"]


class Kernel:
    """A compiled kernel bound to its matrix data.

    ``arrays``: host numpy arrays the kernel needs (saved in artifacts, .npz).
    ``files``: artifact file name -> local path of a binary (TVM library, cubin, PTX).
    ``__call__(*inputs, out)`` runs on validated inputs already on the kernel's device and
    writes ``out`` (same device), returning it.
    """

    template: str = ""
    target: str = "cpu"

    def __init__(self, template: str, params: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                 files: Mapping[str, str] | None = None, meta: Mapping[str, Any] | None = None):
        self.template = template
        self.params = dict(params)
        self.arrays = dict(arrays)
        self.files = dict(files or {})
        self.meta = dict(meta or {})

    def __call__(self, *inputs, out):
        raise NotImplementedError

    def values_written(self) -> None:
        """Called after the module wrote call-time (or the built) values into a host kernel's
        values array in place: a kernel that derives other arrays from the values updates them."""

    def artifact_files(self) -> Mapping[str, str]:
        """``files`` for saving: artifact name -> a path that exists now."""
        return self.files
