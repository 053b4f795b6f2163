"""CUDA runtime: compiling CUDA C++ to device binaries, loading them, launching, DLPack-free calls.

Choice of runtime (why CuPy + nvcc):

* **Compilation with nvcc, offline** — templates are compiled once to a fatbin holding SASS for
  the device's arch (``sm_90`` on the H100) plus PTX of the same arch (forward compatibility).
  nvcc is installed on the CPU/CI machines, so every template is compiled (and checked) there;
  NVRTC would need a GPU-capable CuPy at build time and gives no CI check.  Binaries are cached
  on disk (``$SPCOMPILE_KERNEL_CACHE`` or ``~/.cache/spcompile/kernels``) keyed by
  ``sha256(source, options, arch, nvcc version)`` and are stored inside saved artifacts, so
  :func:`spcompile.load` on an inference server compiles nothing.
* **Loading and launching with CuPy** — ``cupy.RawModule(path=...)`` is ``cuModuleLoad`` (cubin,
  fatbin or PTX); its kernel objects launch from Cython with little per-call overhead and take raw
  device pointers (Python ints) as arguments, so torch tensors need no conversion at all: we pass
  ``tensor.data_ptr()`` and launch on torch's *current stream* (raw handle), CuPy arrays likewise
  on CuPy's current stream.  No host synchronisation, no allocation but the output (none when
  ``out=`` is given), no format conversion on the call path.  cuda-python would work too but its
  Python-level ``cuLaunchKernel`` argument packing is slower per call, and CuPy is the declared
  GPU dependency of the package (``spcompile[cuda]``).
* numpy inputs are copied to the device and the result back (synchronous).

Kernel protocol (used by every CUDA template, including TVM-generated ones): a
:class:`CUDAKernel` implements :meth:`CUDAKernel.launch` (raw pointers + stream handle) or, for
library calls that need framework tensors, overrides :meth:`CUDAKernel.run`.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from .arrays import ArrayAdapter, adapter_for
from .kernel import Kernel

__all__ = ["CUDAKernel", "call", "compile_cuda", "nvcc_path", "nvcc_available", "nvcc_version",
           "device_arch", "cache_dir", "load_module", "placement", "runner", "DEFAULT_ARCH", "CompileError",
           "Launch"]

#: arch compiled for when no GPU is visible (the project's target, the H100)
DEFAULT_ARCH = 90


class CompileError(RuntimeError):
    """nvcc failed; the message holds its output."""


# -- toolchain ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def nvcc_path() -> str | None:
    env = os.environ.get("SPCOMPILE_NVCC")
    if env:
        return env
    p = shutil.which("nvcc")
    if p:
        return p
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def nvcc_available() -> bool:
    return nvcc_path() is not None


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    p = nvcc_path()
    if p is None:
        return "none"
    try:
        out = subprocess.run([p, "--version"], capture_output=True, text=True, timeout=60).stdout
    except Exception:
        return "unknown"
    # the release ("13.0") keys the cache: patch builds of one release emit the same code, and a
    # cache filled on a CPU machine stays valid on a GPU machine with the same release
    import re

    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else out.strip()[-80:]


def cache_dir() -> str:
    d = os.environ.get("SPCOMPILE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "spcompile", "kernels")
    os.makedirs(d, exist_ok=True)
    return d


def device_arch(device: int | None = None) -> int:
    """Compute capability of ``device`` as an int (90 for sm_90); DEFAULT_ARCH without a GPU."""
    from .target import cuda_available

    if not cuda_available():
        return DEFAULT_ARCH
    return _device_arch(-1 if device is None else int(device))


@functools.lru_cache(maxsize=None)
def _device_arch(device: int) -> int:
    import cupy

    dev = cupy.cuda.Device() if device < 0 else cupy.cuda.Device(device)
    return int(dev.compute_capability)


_COMPILE_LOCK = threading.Lock()


def compile_cuda(source: str, *, arch: int | None = None, options: Sequence[str] = (), name: str = "kernel",
                 ptx: bool = True) -> str:
    """Compile CUDA C++ ``source`` with nvcc for ``arch`` (an int such as 90) into a fatbin (SASS
    for that arch, plus its PTX when ``ptx``); returns the path of the cached binary."""
    nvcc = nvcc_path()
    arch = DEFAULT_ARCH if arch is None else int(arch)
    opts = ["-O3", "-std=c++17", "--extra-device-vectorization", *options]
    gencode = [f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    if ptx:
        gencode.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    h = hashlib.sha256()
    for part in (source, "\0".join(opts), "\0".join(gencode), nvcc_version()):
        h.update(part.encode())
        h.update(b"\0\1")
    digest = h.hexdigest()[:32]
    safe = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in name)[:48]
    path = os.path.join(cache_dir(), f"{safe}-sm{arch}-{digest}.fatbin")
    if os.path.isfile(path):
        return path
    if nvcc is None:
        raise CompileError("nvcc was not found (set SPCOMPILE_NVCC or CUDA_HOME) and the kernel is not cached")
    with tempfile.TemporaryDirectory(prefix="spcompile-nvcc-") as tmp:
        src = os.path.join(tmp, safe + ".cu")
        with open(src, "w") as f:
            f.write(source)
        outp = os.path.join(tmp, safe + ".fatbin")
        cmd = [nvcc, "-fatbin", *opts, *gencode, "-o", outp, src]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise CompileError(f"nvcc failed ({' '.join(cmd)}):\n{r.stderr[-6000:]}{r.stdout[-2000:]}")
        with _COMPILE_LOCK:
            fd, part = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".part-")
            os.close(fd)
            shutil.copyfile(outp, part)
            os.chmod(part, 0o644)
            os.replace(part, path)  # atomic: concurrent builders never see half a file
    return path


# -- loading --------------------------------------------------------------------------------
_MODULES: dict = {}


def load_module(path: str):
    """``cupy.RawModule`` of a cubin / fatbin / PTX file on the current device (cached)."""
    import cupy

    key = (os.path.realpath(path), cupy.cuda.runtime.getDevice())
    mod = _MODULES.get(key)
    if mod is None:
        mod = _MODULES[key] = cupy.RawModule(path=path)
    return mod


_STREAMS: dict = {}


def _stream(handle: int):
    """A CuPy stream object for a raw ``cudaStream_t`` handle (cached: no per-call construction)."""
    s = _STREAMS.get(handle)
    if s is None:
        import cupy

        import warnings

        # CuPy 14 deprecates ExternalStream for Stream.from_external (which may itself go through
        # it); either way the warning says nothing to our callers
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            s = None
            ctor = getattr(cupy.cuda.Stream, "from_external", None)   # CuPy >= 14
            if ctor is not None:
                try:
                    s = ctor(handle)
                except Exception:   # another signature: fall back to the old class
                    s = None
            if s is None:
                s = cupy.cuda.ExternalStream(handle)
        _STREAMS[handle] = s
    return s


# -- launching ------------------------------------------------------------------------------
def ensure_dynamic_smem(fn, nbytes: int) -> None:
    """Let ``fn`` launch with ``nbytes`` of dynamic shared memory.  The attribute belongs to the
    CUfunction, which every kernel object built from the same cached binary shares: it is only
    ever raised, so one module's setting never breaks another's launches."""
    nbytes = int(nbytes)
    if nbytes <= 48 * 1024:
        return
    try:
        cur = int(fn.max_dynamic_shared_size_bytes)
    except Exception:
        cur = 0
    if nbytes > cur:
        fn.max_dynamic_shared_size_bytes = nbytes



_LIBCUDA: Any = None


@functools.lru_cache(maxsize=None)
def _driver():
    """The CUDA driver library through ctypes, or None."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _libcuda():
    """``cuLaunchKernel`` of the driver through ctypes (argtypes fixed once), or None."""
    global _LIBCUDA
    if _LIBCUDA is None:
        lib = None if os.environ.get("SPCOMPILE_CUPY_LAUNCH") else _driver()
        try:
            f = lib.cuLaunchKernel
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            _LIBCUDA = f
        except AttributeError:  # no driver (lib is None) or no such symbol
            _LIBCUDA = False
    return _LIBCUDA or None


_CTX_SET = threading.local()


def _make_context_current() -> bool:
    """Make the current device's primary context current for this thread in the *driver* API.

    The CUDA runtime (used by torch and CuPy) keeps its primary context without necessarily making
    it the thread's current driver context, which ``cuLaunchKernel`` needs.  Done once per thread;
    returns False when it cannot be done (the CuPy launch path is used instead)."""
    if getattr(_CTX_SET, "done", False):
        return False
    _CTX_SET.done = True
    try:
        import cupy

        lib = _driver()
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(cupy.cuda.runtime.getDevice())) != 0:
            return False
        ctx = ctypes.c_void_p()
        if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
            return False
        return lib.cuCtxSetCurrent(ctx) == 0
    except Exception:
        return False


class Launch:
    """One prepared kernel launch: function, grid, block, dynamic shared memory and the argument
    list with ``None`` placeholders for the per-call device pointers (inputs, output, in order).

    The argument buffer is built once (ctypes values of the kernel's parameter types: Python ints
    are 64-bit pointers, ``np.int32`` / ``np.float32`` 4-byte values, ``np.int64`` 8-byte), so a
    call only writes the new pointers and calls ``cuLaunchKernel`` -- about a microsecond from
    Python, against several for CuPy's generic argument packing, which remains the fallback (no
    libcuda, another thread without the context current, or ``SPCOMPILE_CUPY_LAUNCH=1``)."""

    __slots__ = ("fn", "grid", "block", "smem", "args", "_slots", "_vals", "_params", "_handle", "_launch")

    def __init__(self, fn, grid, block, args: Sequence[Any], smem: int = 0):
        self.fn, self.grid, self.block, self.smem = fn, tuple(int(g) for g in grid), tuple(int(b) for b in block), int(smem)
        self.args = list(args)
        vals, slots = [], []
        for i, a in enumerate(self.args):
            if a is None:
                slots.append(i)
                vals.append(ctypes.c_uint64(0))
            elif isinstance(a, np.int32):
                vals.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.float32):
                vals.append(ctypes.c_float(float(a)))
            elif isinstance(a, (int, np.integer)):
                vals.append(ctypes.c_uint64(int(a) & 0xFFFFFFFFFFFFFFFF))
            else:
                raise TypeError(f"unsupported kernel argument type {type(a).__name__}")
        self._slots = tuple(vals[i] for i in slots)
        self._vals = vals
        self._params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        handle = getattr(fn, "ptr", None)      # cupy Function
        if handle is None:                      # cupy RawKernel (what RawModule.get_function returns)
            try:
                handle = getattr(fn.kernel, "ptr", None)
            except Exception:
                handle = None
        self._handle = int(handle) if handle else None
        self._launch = _libcuda() if self._handle else None

    def __call__(self, ptrs: Sequence[int], stream: int) -> None:
        """Launch with the per-call pointers ``ptrs`` (one per placeholder) on ``stream``."""
        launch = self._launch
        if launch is not None:
            for v, p in zip(self._slots, ptrs):
                v.value = p
            g, b = self.grid, self.block
            rc = launch(self._handle, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream, self._params, None)
            if rc == 201 and _make_context_current():  # CUDA_ERROR_INVALID_CONTEXT: none current here yet
                rc = launch(self._handle, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream, self._params, None)
            if rc == 0:
                return
            if rc != 201:
                raise RuntimeError(f"cuLaunchKernel failed with CUresult {rc}")
        it = iter(ptrs)
        args = tuple(next(it) if a is None else a for a in self.args)
        self.fn(self.grid, self.block, args, shared_mem=self.smem, stream=_stream(stream))


# -- kernels --------------------------------------------------------------------------------
class CUDAKernel(Kernel):
    """A kernel that runs on a CUDA device.

    Subclasses implement :meth:`prepare` (upload matrix arrays, load the binary; called once,
    lazily, so that building and loading work on machines without a GPU) and :meth:`launch`
    (``in_ptrs``: device pointers of the C-contiguous float32 inputs, ``out_ptr``: output,
    ``stream``: raw stream handle; must not synchronise).  Library-backed kernels override
    :meth:`run`, which receives the arrays themselves.
    """

    target = "cuda"
    device_id: int = 0
    _ready = False

    def prepare(self) -> None:
        self._ready = True

    def launch(self, in_ptrs: Sequence[int], out_ptr: int, stream: int) -> None:
        raise NotImplementedError

    def run(self, adapter: ArrayAdapter, inputs: Sequence[Any], out: Any, stream: int) -> None:
        """Run on C-contiguous ``adapter`` arrays on the kernel's device (the default: their
        pointers to :meth:`launch`)."""
        ptr = adapter.ptr
        self.launch([ptr(x) for x in inputs], ptr(out), stream)

    def __call__(self, *inputs, out):
        """Generic entry used by runners: numpy, CuPy or torch arrays, the module's run step."""
        return call(self, inputs, out)


def placement(kernel: CUDAKernel, adapter: ArrayAdapter, inputs: Sequence[Any]) -> int | None:
    """Prepare ``kernel`` (once) and say where ``inputs`` are: its device, or None when they are
    all host arrays (copied through the device); ValueError for any other placement."""
    if not kernel._ready:
        kernel.prepare()
    devices = {adapter.device(x) for x in inputs}
    if devices == {None}:
        return None
    if devices != {kernel.device_id}:
        raise ValueError(f"inputs must be on CUDA device {kernel.device_id} (the module's device) or all on "
                         f"the host, got {sorted(adapter.device_name(d) for d in devices)}")
    return kernel.device_id


def runner(kernel: CUDAKernel, adapter: ArrayAdapter, device: int | None, out_shape: tuple, dtype: str):
    """The run step ``run(inputs, out) -> out`` of ``kernel`` for C-contiguous ``adapter`` arrays
    of ``dtype`` on ``device`` (see :func:`placement`; ``out``: None or a checked buffer).

    Device arrays stay where they are: the kernel runs on the framework's current stream, into
    ``out`` or a new array, without synchronising and without other allocation.  Host arrays
    (numpy, CPU torch) are copied to the kernel's device as ``adapter.device_adapter`` arrays and
    the result back (synchronous)."""
    if device is not None:
        alloc, stream, run_kernel = adapter.allocator(out_shape, dtype, device), adapter.stream(device), kernel.run

        def run(inputs, out):
            if out is None:
                out = alloc()
            run_kernel(adapter, inputs, out, stream())
            return out

        return run
    dev, index = adapter.device_adapter, kernel.device_id
    alloc, stream = dev.allocator(out_shape, dtype, index), dev.stream(index)

    def run_through_device(inputs, out):
        res = alloc()
        kernel.run(dev, [adapter.to_device(x, index) for x in inputs], res, stream())
        res = adapter.to_host(res)
        if out is None:
            return res
        out[...] = res
        return out

    return run_through_device


def call(kernel: CUDAKernel, inputs: Sequence[Any], out=None, out_shape: tuple | None = None,
         dtype: str | None = None) -> Any:
    """Run ``kernel`` on numpy, torch or CuPy arrays (all of one framework) of the shapes and
    dtype it was built for (not checked here: the module checks them), through the module's run
    step (:func:`runner`).  ``out`` (checked) or ``out_shape`` gives the output's shape; ``dtype``
    (default: the kernel's ``meta["dtype"]``, else float32) is that of the inputs and the result
    (kernels accumulate in fp32 and round the result once)."""
    adapter = adapter_for(inputs[0])
    if adapter is None or any(adapter_for(x) is not adapter for x in inputs):
        raise TypeError(f"inputs must all be numpy arrays, torch tensors or cupy arrays of one kind, got "
                        f"{[type(x).__name__ for x in inputs]}")
    out_shape = tuple(out.shape if out_shape is None else out_shape)
    dtype = dtype or kernel.meta.get("dtype", "float32")
    if dtype not in adapter.dtypes:
        raise TypeError(f"{adapter.name} has no {dtype} dtype: pass torch.{dtype} tensors")
    device = placement(kernel, adapter, inputs)
    if out is not None:
        adapter.check_out(out, out_shape, dtype, device)
    return runner(kernel, adapter, device, out_shape, dtype)([adapter.contiguous(x) for x in inputs], out)


def current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def check_arch(built_arch: int, device: int) -> bool:
    """Whether a binary with SASS + PTX for ``built_arch`` runs on ``device`` (same major, not
    older; a newer major runs the PTX through the driver's JIT)."""
    arch = _device_arch(device)
    return arch >= built_arch and (arch // 10 == built_arch // 10 or arch // 10 > built_arch // 10)


def meta_json(d: Mapping[str, Any]) -> dict:
    return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in d.items()}
