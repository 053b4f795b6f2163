"""CPU runtime: compiling TensorIR for the host with TVM's llvm backend, loading exported
libraries, and zero-copy DLPack views of numpy arrays.

Loading and running a saved CPU module needs only TVM's FFI and runtime libraries, not the
compiler: :func:`load` opens the library through ``tvm_ffi`` with ``libtvm_runtime`` loaded
beside it (about 0.1 s), where ``import tvm`` would load the compiler, its Python packages and
torch (seconds).  Compiling (:func:`compile_primfunc`) imports ``tvm`` as usual.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import platform
import sys
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


def ffi():
    """The ``tvm_ffi`` module.  Its import tries ``import torch`` first (a work-around for a symbol
    clash seen on Windows), which costs a second or more where torch is installed and unused; on
    other systems, when the program has not imported torch itself, that attempt is made to fail
    (torch stays importable afterwards).  tvm_ffi then reads torch tensors through DLPack."""
    mod = sys.modules.get("tvm_ffi")
    if mod is not None:
        return mod
    block = "torch" not in sys.modules and not sys.platform.startswith("win")
    if block:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
    try:
        import tvm_ffi
    finally:
        if block and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tvm_ffi


@functools.lru_cache(maxsize=None)
def _runtime_library() -> bool:
    """Load TVM's runtime library (thread pool, workspace allocation: what exported kernels call)
    the way ``import tvm`` does, without importing tvm; False when it cannot be found here."""
    if "tvm" in sys.modules:
        return True
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("running a CPU module needs TVM's runtime: pip install apache-tvm")
    from pathlib import Path

    dirs = [Path(os.environ["TVM_LIBRARY_PATH"])] if os.environ.get("TVM_LIBRARY_PATH") else []
    dirs.append(Path(list(spec.submodule_search_locations)[0]) / "lib")
    try:
        ffi()  # first: tvm_ffi without torch
        from tvm_ffi.libinfo import load_lib_ctypes

        load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=dirs)
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def load(path: str):
    """A kernel library exported by :func:`export`, loaded without TVM's compiler."""
    configure_threads()
    if _runtime_library():
        return ffi().load_module(os.path.realpath(path))
    import tvm  # an unusual layout: let TVM find its libraries

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
    # kernels declare 4-byte alignment (align=4 in match_buffer), so any float32 view is fine
    return ffi().from_dlpack(a, require_alignment=0)
