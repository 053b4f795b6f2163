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
    if not codegen.llvm_is_valid_cpu(cpu, tgt.get("mtriple", codegen.llvm_get_system_triple())):
        tgt.pop("mcpu")
    return tgt


def host_cpu_name() -> str | None:
    """LLVM's name of this CPU; None where TVM is not installed (a machine that only runs saved
    CUDA modules)."""
    try:
        from tvm.target import codegen
    except ImportError:
        return None
    return codegen.llvm_get_system_cpu()


def compile_primfunc(func):
    """Compile a TIR PrimFunc for the host; returns the TVM runtime module."""
    import tvm

    return tvm.compile(func, target=host_llvm_target())


_TEMP_DIRS: list = []


def _remove_temp_dirs():
    import shutil

    for d in _TEMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)


def export(lib, directory: str | None = None, name: str = "kernel.so") -> str:
    """Write ``lib`` as a shared library; without ``directory``, into a temporary directory that is
    removed when the process exits (saved artifacts copy the file)."""
    if directory is None:
        if not _TEMP_DIRS:
            import atexit

            atexit.register(_remove_temp_dirs)
        directory = tempfile.mkdtemp(prefix="spcompile-")
        _TEMP_DIRS.append(directory)
    path = os.path.join(directory, name)
    lib.export_library(path)
    return path


def load(path: str):
    import tvm

    configure_threads()
    return tvm.runtime.load_module(path)


@functools.lru_cache(maxsize=None)
def num_threads() -> int:
    """Worker threads TVM's pool runs parallel loops on: ``TVM_NUM_THREADS`` when set, else every
    CPU this process may run on (TVM's own default halves the count on x86, assuming SMT, which
    leaves half of a small VM idle)."""
    env = os.environ.get("TVM_NUM_THREADS")
    if env and env.strip().isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def configure_threads() -> int:
    """Size TVM's thread pool (see :func:`num_threads`) before its first parallel launch; returns
    the count.  TVM creates its pool lazily and reads ``TVM_NUM_THREADS`` then (the runtime's
    ``config_threadpool`` call cannot grow an existing pool), so the variable is set for this
    process when the user has not set it."""
    n = num_threads()
    os.environ.setdefault("TVM_NUM_THREADS", str(n))
    return n


def as_tensor(a):
    """Zero-copy TVM view of a C-contiguous numpy array (or anything with __dlpack__)."""
    import tvm_ffi

    # kernels declare 4-byte alignment (align=4 in match_buffer), so any float32 view is fine
    return tvm_ffi.from_dlpack(a, require_alignment=0)
