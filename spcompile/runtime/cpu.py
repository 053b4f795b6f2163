"""CPU runtime: compiling TensorIR for the host with TVM's llvm backend, loading exported
libraries, and zero-copy DLPack views of numpy arrays."""
from __future__ import annotations

import functools
import os
import platform
import tempfile


@functools.lru_cache(maxsize=None)
def host_llvm_target() -> dict:
    """The llvm target for this host CPU (mcpu detected by LLVM)."""
    from tvm.target import codegen

    cpu = codegen.llvm_get_system_cpu()
    tgt = {"kind": "llvm", "mcpu": cpu}
    if platform.system() == "Linux" and platform.machine() == "x86_64":
        tgt["mtriple"] = "x86_64-pc-linux-gnu"
    try:
        if not codegen.llvm_is_valid_cpu(cpu, tgt.get("mtriple", codegen.llvm_get_system_triple())):
            tgt.pop("mcpu")
    except Exception:
        pass
    return tgt


def host_cpu_name() -> str | None:
    try:
        from tvm.target import codegen

        return codegen.llvm_get_system_cpu()
    except Exception:
        return None


def compile_primfunc(func):
    """Compile a TIR PrimFunc for the host; returns the TVM runtime module."""
    import tvm

    return tvm.compile(func, target=host_llvm_target())


def export(lib, directory: str | None = None, name: str = "kernel.so") -> str:
    directory = directory or tempfile.mkdtemp(prefix="spcompile-")
    path = os.path.join(directory, name)
    lib.export_library(path)
    return path


def load(path: str):
    import tvm

    return tvm.runtime.load_module(path)


def as_tensor(a):
    """Zero-copy TVM view of a C-contiguous numpy array (or anything with __dlpack__)."""
    import tvm_ffi

    # kernels declare 4-byte alignment (align=4 in match_buffer), so any float32 view is fine
    return tvm_ffi.from_dlpack(a, require_alignment=0)
