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


def export(lib, directory: str | None = None, name: str = "kernel.so") -> str:
    """Write ``lib`` as a shared library into ``directory``; without one, into the per-user
    library cache (:func:`materialize`)."""
    if directory is None:
        return materialize(library_bytes(lib))
    path = os.path.join(directory, name)
    lib.export_library(path)
    return path


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
    fd, part = tempfile.mkstemp(dir=d, prefix=".part-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(part, 0o644)
        os.replace(part, path)
    except BaseException:
        try:
            os.remove(part)
        except OSError:
            pass
        raise
    return path


def host_cpu_features() -> list[str]:
    """LLVM's feature names of this host CPU (what a kernel compiled here may use)."""
    from tvm.target import Target, codegen

    return sorted(str(f) for f in codegen.llvm_get_cpu_features(Target(host_llvm_target())))


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
