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

from .files import write_atomically


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
    """LLVM's name of this CPU; None where TVM is not installed, or installed without LLVM (a
    runtime-only TVM: a machine that only runs saved CUDA modules)."""
    try:
        from tvm.target import codegen

        return codegen.llvm_get_system_cpu()
    except (ImportError, AttributeError):
        return None


def compile_primfunc(func):
    """Compile a TIR PrimFunc for the host; returns the TVM runtime module."""
    import tvm

    return tvm.compile(func, target=host_llvm_target())


def export(lib, directory: str | None = None, name: str = "kernel.so") -> str:
    """Write ``lib`` as a shared library into ``directory``; without one, into the per-user
    library cache (:func:`materialize`)."""
    if directory is None:
        return materialize(library_bytes(lib))
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


def library_bytes(lib) -> bytes:
    """The bytes of ``lib`` exported as a shared library (the temporary folder is removed)."""
    with tempfile.TemporaryDirectory(prefix="spcompile-export-") as d:
        path = os.path.join(d, "kernel.so")
        lib.export_library(path)
        with open(path, "rb") as f:
            return f.read()


def library_cache_dir() -> str:
    """Per-user folder of compiled CPU libraries (``SPCOMPILE_CPU_CACHE``, else
    ``$XDG_CACHE_HOME/spcompile/cpu`` or ``~/.cache/spcompile/cpu``; a private folder in the
    temporary directory where the home folder cannot be written)."""
    d = os.environ.get("SPCOMPILE_CPU_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "spcompile", "cpu")
    try:
        os.makedirs(d, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = os.path.join(tempfile.gettempdir(), f"spcompile-cpu-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def materialize(data: bytes) -> str:
    """The path of a file holding library ``data`` (content-addressed in
    :func:`library_cache_dir`), written again (atomically) when it is missing or altered -- so
    that a module keeps working, and saving, when something cleans the folder."""
    import hashlib

    digest = hashlib.sha256(data).hexdigest()
    d = library_cache_dir()
    path = os.path.join(d, f"kernel-{digest[:32]}.so")
    try:
        if os.path.getsize(path) == len(data):
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() == digest:
                    return path
    except OSError:
        pass
    return write_atomically(path, data, suffix=".so")


def host_cpu_features() -> list[str]:
    """This host CPU's feature flags (what a kernel compiled here for the host CPU may use): the
    kernel's ``flags`` of ``/proc/cpuinfo`` on Linux (read without TVM's compiler, so that loading
    a saved module stays cheap), else LLVM's feature names."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return sorted(set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    from tvm.target import Target, codegen

    return sorted(str(f) for f in codegen.llvm_get_cpu_features(Target(host_llvm_target())))


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
    from ..core.reference import available_cpus

    env = os.environ.get("TVM_NUM_THREADS")
    if env and env.strip().isdigit() and int(env) > 0:
        return int(env)
    return available_cpus()


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
    # kernels declare 4-byte alignment (align=4 in match_buffer), so any float32 / float64 view is fine
    return ffi().from_dlpack(a, require_alignment=0)
