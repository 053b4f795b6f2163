"""Shared machinery of the nvcc-compiled templates: render one parametrised ``.cu`` source
plus ``extern "C"`` instances, compile it (cached), load the binary on the device."""
from __future__ import annotations

import inspect
import os

from ..core.ir import SparseModule
from ..runtime import cuda as rt
from .base import Template, source_hash_of

__all__ = ["_NvccTemplate", "_NvccKernel"]


# ------------------------------------------------------------------------------------------
class _NvccTemplate(Template):
    target = "cuda"
    source_file = ""
    instance_macro = ""
    #: headers in this folder that ``source_file`` includes (``#include "name"``): inlined by
    #: :meth:`source_text` (nvcc compiles a copy in a temporary folder) and part of the hash
    headers: tuple = ()

    def available(self) -> bool:
        return rt.nvcc_available()

    def source_dir(self) -> str:
        """The folder of the template's family (its .cu / .cuh files sit beside its module)."""
        return os.path.dirname(os.path.abspath(inspect.getfile(type(self))))

    def _source(self, fname: str) -> str:
        with open(os.path.join(self.source_dir(), fname)) as f:
            return f.read()

    def source_hash(self) -> str:
        d = self.source_dir()
        return source_hash_of(type(self), self.version,
                              paths=tuple(os.path.join(d, f) for f in (self.source_file, *self.headers)))

    def source_text(self) -> str:
        """``source_file`` with its local headers inlined."""
        src = self._source(self.source_file)
        for h in self.headers:
            src = src.replace(f'#include "{h}"', self._source(h))
        return src

    def render(self, instances: list[tuple[str, tuple]]) -> str:
        """The template source plus one extern "C" wrapper per ``(name, template args)``."""
        lines = [self.source_text(), ""]
        lines += [f"{self.instance_macro}({n}, {', '.join(str(int(a)) for a in args)})" for n, args in instances]
        return "\n".join(lines) + "\n"

    def compile(self, instances, arch: int | None = None, name: str = "") -> str:
        return rt.compile_cuda(self.render(instances), arch=arch, name=name or self.name.replace(".", "_"))

    def supports(self, mod: SparseModule) -> bool:
        A = mod.A
        ok_size = max(A.nnz, A.shape[0] + 1, A.shape[1]) < 2**31 - 1
        return super().supports(mod) and ok_size


class _NvccKernel(rt.CUDAKernel):
    """Kernel bound to a fatbin and matrix arrays; subclasses define the launch arguments."""

    def __init__(self, template, params, arrays, files, meta, tpl):
        super().__init__(template, params, arrays, files, meta)
        self._tpl = tpl

    def _load_functions(self):
        import cupy

        self.device_id = cupy.cuda.runtime.getDevice()
        path = self.files["kernel.fatbin"]
        if not rt.check_arch(int(self.meta["arch"]), self.device_id):
            # an artifact for another GPU generation: rebuild the same variant here if we can
            if not rt.nvcc_available():
                raise RuntimeError(f"kernel was built for sm_{self.meta['arch']} and cannot run on this GPU "
                                   f"(sm_{rt.device_arch(self.device_id)}); rebuild the module here")
            arch = rt.device_arch(self.device_id)
            path = self._tpl.compile([tuple(x) for x in self.meta["instances"]], arch=arch)
            self.files = {**self.files, "kernel.fatbin": path}
            self.meta = {**self.meta, "arch": arch}
        mod = rt.load_module(path)
        return [mod.get_function(n) for n, _ in self.meta["instances"]]

    def _upload(self, names):
        import cupy

        # keep every uploaded array referenced by the kernel: the launch passes raw pointers
        dev = self.__dict__.setdefault("_dev", {})
        for k in names:
            dev[k] = cupy.asarray(self.arrays[k])
        return tuple(int(dev[k].data.ptr) for k in names)


