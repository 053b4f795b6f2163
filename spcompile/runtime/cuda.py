"""CUDA runtime: compiling CUDA C++ to device binaries, loading them, launching, DLPack-free calls.

Choice of runtime (why nvcc + the driver API):

* **Compilation with nvcc, offline** — templates are compiled once to a fatbin holding SASS for
  the device's arch (``sm_90`` on the H100) plus PTX of the same arch (forward compatibility).
  nvcc is installed on the CPU/CI machines, so every template is compiled (and checked) there;
  NVRTC would need a GPU at build time and gives no CI check.  Binaries are cached on disk
  (``$SPCOMPILE_KERNEL_CACHE`` or ``~/.cache/spcompile/kernels``) keyed by
  ``sha256(source, options, arch, nvcc version)`` and are stored inside saved artifacts, so
  :func:`spcompile.load` on an inference server compiles nothing.
* **Loading and launching through the CUDA driver API** (:mod:`spcompile.runtime.driver`,
  ctypes): ``cuModuleLoadData`` of the fatbin in the device's primary context (the one torch and
  CuPy use), device copies of the module's arrays by ``cuMemAlloc``, and one prepared
  ``cuLaunchKernel`` per call with raw device pointers, so torch tensors need no conversion at
  all: we pass ``tensor.data_ptr()`` and launch on torch's *current stream* (raw handle), CuPy
  arrays likewise on CuPy's current stream.  No host synchronisation, no allocation but the
  output (none when ``out=`` is given), no format conversion on the call path.  No GPU framework
  is imported to load and run a module: a serving process calling it on numpy arrays pays for
  neither CuPy's import nor torch's (CuPy stays the declared GPU dependency for building and
  tuning, ``spcompile[cuda]``).
* numpy inputs are copied to the device (:class:`driver.DeviceArray`) and the result back
  (synchronous).

Kernel protocol (used by every CUDA template, including TVM-generated ones): a
:class:`CUDAKernel` implements :meth:`CUDAKernel.launch` (raw pointers + stream handle) or, for
library calls that need framework tensors, overrides :meth:`CUDAKernel.run`.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from . import driver
from .arrays import ArrayAdapter, adapter_for
from .files import write_atomically
from .kernel import Kernel

__all__ = ["CUDAKernel", "call", "compile_cuda", "nvcc_path", "nvcc_available", "nvcc_version",
           "device_arch", "cache_dir", "load_module", "placement", "runner", "DEFAULT_ARCH", "CompileError",
           "LaunchPlan", "LaunchSequence", "Launch", "KernelSignature", "kernel_signature", "binary_for_device"]

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
    major, minor = driver.compute_capability(current_device() if device < 0 else device)
    return 10 * major + minor


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
        with open(outp, "rb") as f:
            binary = f.read()
        with _COMPILE_LOCK:
            write_atomically(path, binary)  # concurrent builders never see half a file
    return path


# -- loading --------------------------------------------------------------------------------
_MODULES: dict = {}


def load_module(path: str, device: int | None = None) -> "driver.Module":
    """The cubin / fatbin / PTX file ``path`` loaded on ``device`` (default:
    :func:`current_device`), cached per file and device."""
    device = current_device() if device is None else int(device)
    key = (os.path.realpath(path), device)
    mod = _MODULES.get(key)
    if mod is None:
        mod = _MODULES[key] = driver.load_module(path, device)
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



# -- the driver API (spcompile.runtime.driver) --------------------------------------------
def _driver_launch():
    """``cuLaunchKernel`` through ctypes, or None (no ``libcuda``): launches then go through the
    function object itself (CuPy's kernel objects)."""
    return driver.raw_launch() if driver.init() else None


def current_device() -> int:
    """The device a module prepared now runs on: torch's current device once torch has used
    CUDA, else CuPy's when CuPy is imported, else the device of this thread's driver context
    (0 when there is none)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            return int(cupy.cuda.runtime.getDevice())
        except Exception:
            pass
    d = driver.current_device()
    return 0 if d is None else d


# -- kernel signatures ----------------------------------------------------------------------
#: C parameter types -> (ctypes type of the argument buffer, numpy type of CuPy's argument tuple)
ARG_TYPES: dict[str, tuple[Any, Any]] = {
    "ptr": (ctypes.c_uint64, int),
    "int32": (ctypes.c_int32, np.int32), "uint32": (ctypes.c_uint32, np.uint32),
    "int64": (ctypes.c_int64, np.int64), "uint64": (ctypes.c_uint64, np.uint64),
    "float32": (ctypes.c_float, np.float32), "float64": (ctypes.c_double, np.float64),
}
_C_SCALARS = {
    "int": "int32", "signed": "int32", "signed int": "int32", "int32_t": "int32",
    "unsigned": "uint32", "unsigned int": "uint32", "uint32_t": "uint32",
    "long": "int64", "long int": "int64", "long long": "int64", "long long int": "int64", "int64_t": "int64",
    "unsigned long": "uint64", "unsigned long long": "uint64", "uint64_t": "uint64", "size_t": "uint64",
    "float": "float32", "double": "float64",
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}
_ENTRY = r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?'


@dataclass(frozen=True)
class KernelSignature:
    """Parameter names and types of a kernel entry point, in order; each type is a key of
    :data:`ARG_TYPES` ("ptr" for every pointer)."""

    name: str
    params: tuple[tuple[str, str], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.params)


def _strip_source(src: str) -> str:
    """``src`` without comments and with macro line continuations joined."""
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    src = re.sub(r"//[^\n]*?(\\?)\n", lambda m: m.group(1) + "\n", src)
    return src.replace("\\\n", " ")


def _balanced(text: str, start: int) -> str:
    """The text inside the parentheses that open at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    raise ValueError("unbalanced parentheses in a kernel signature")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _param(decl: str, kernel: str) -> tuple[str, str]:
    m = re.match(r"^(.*?)\b([A-Za-z_]\w*)\s*$", decl, flags=re.S)
    if not m or not m.group(1).strip():
        raise ValueError(f"cannot read parameter {decl!r} of kernel {kernel!r}")
    ctype, name = m.group(1), m.group(2)
    if "*" in ctype:
        return name, "ptr"
    words = " ".join(w for w in ctype.split() if w not in _QUALIFIERS)
    if words not in _C_SCALARS:
        raise ValueError(f"kernel {kernel!r}: parameter {name!r} has type {words!r}, which launches "
                         f"do not support (pointers and {sorted(_C_SCALARS)})")
    return name, _C_SCALARS[words]


def _macros(src: str) -> dict[str, tuple[list[str], str]]:
    """Function-like macros of ``src`` (continuations joined): name -> (parameters, body)."""
    out = {}
    for d in re.finditer(r"^\s*#\s*define\s+([A-Za-z_]\w*)\(", src, flags=re.M):
        ptext = _balanced(src, d.end() - 1)
        start = d.end() + len(ptext) + 1
        end = src.find("\n", start)
        out[d.group(1)] = (_split_top(ptext), src[start:end if end >= 0 else len(src)])
    return out


def _expand(text: str, macros: Mapping[str, tuple[list[str], str]]) -> str:
    """``text`` with the function-like ``macros`` expanded (arguments substituted, ``##`` pasted,
    rescanned until none is left)."""
    call = re.compile(r"\b(" + "|".join(map(re.escape, macros)) + r")\s*\(") if macros else None
    for _ in range(32):
        m = call.search(text) if call else None
        if m is None:
            return text
        params, body = macros[m.group(1)]
        inner = _balanced(text, m.end() - 1)
        subst = dict(zip(params, _split_top(inner)))
        if subst:
            body = re.sub(r"\b(" + "|".join(map(re.escape, subst)) + r")\b", lambda t: subst[t.group(1)], body)
        text = text[:m.start()] + re.sub(r"\s*##\s*", "", body) + text[m.end() + len(inner) + 1:]
    raise ValueError("macro expansion does not end")


def kernel_signature(source: str, name: str) -> KernelSignature:
    """The signature of kernel ``name`` in CUDA ``source``: an ``extern "C" __global__`` function
    defined there, or one that the source's instance lines (``MACRO(args)`` at the start of a
    line, ``MACRO`` a function-like macro of the source) define once their macros are expanded.
    ValueError when it is not found or a parameter has a type launches do not support."""
    src = _strip_source(source)
    entry = re.compile(_ENTRY + re.escape(name) + r"\s*\(")
    text, m = src, entry.search(src)
    if m is None:
        macros = _macros(src)
        lines = [ln for ln in src.splitlines() if re.match(r"\s*([A-Za-z_]\w*)\s*\(", ln)
                 and re.match(r"\s*([A-Za-z_]\w*)", ln).group(1) in macros]
        # the instance line that names the kernel, where one does (each line is expanded on its
        # own: the expansion's bound on rescans is per line, whatever the number of instances)
        named = [ln for ln in lines if re.search(r"\b" + re.escape(name) + r"\b", ln)]
        text = "\n".join(_expand(ln, macros) for ln in (named or lines))
        m = entry.search(text)
    if m is None:
        raise ValueError(f"no extern \"C\" __global__ signature of kernel {name!r} in the source")
    body = _balanced(text, m.end() - 1)
    return KernelSignature(name, tuple(_param(p, name) for p in _split_top(body) if p != "void"))


# -- launching ------------------------------------------------------------------------------
class LaunchPlan:
    """One prepared kernel launch: function, grid, block, dynamic shared memory and the arguments,
    bound by the parameter names of the kernel's signature (:func:`kernel_signature`).

    ``bound`` gives the fixed arguments (device pointers as ints, scalars) once; ``per_call``
    names the pointer parameters each call passes, in the order a call gives them.  Every
    parameter must be named exactly once; the ctypes type of each comes from its C type.  The
    argument buffer is built here, so a call only writes the new pointers and calls
    ``cuLaunchKernel`` (about a microsecond from Python).  A function object without a driver
    handle (a CuPy kernel) launches itself with the same arguments, typed."""

    __slots__ = ("fn", "signature", "grid", "block", "smem", "per_call", "_vals", "_slots", "_slot_idx",
                 "_cupy_args", "_params", "_handle", "_launch")

    def __init__(self, fn, signature: KernelSignature, grid: Sequence[int], block: Sequence[int], smem: int = 0, *,
                 bound: Mapping[str, Any], per_call: Sequence[str]):
        names = signature.names
        per_call = tuple(per_call)
        unknown = sorted((set(bound) | set(per_call)) - set(names))
        twice = sorted(set(bound) & set(per_call)) or sorted({n for n in per_call if per_call.count(n) > 1})
        missing = [n for n in names if n not in bound and n not in per_call]
        if unknown or twice or missing:
            what = "; ".join(f"{label} {lst}" for label, lst in (("unknown", unknown), ("bound twice", twice),
                                                                 ("missing", missing)) if lst)
            raise ValueError(f"kernel {signature.name}: {what} (its parameters: {list(names)})")
        types = dict(signature.params)
        for n in per_call:
            if types[n] != "ptr":
                raise TypeError(f"kernel {signature.name}: per-call argument {n!r} has type {types[n]}, not a pointer")
        self.fn, self.signature, self.smem = fn, signature, int(smem)
        self.grid, self.block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
        self.per_call = per_call
        vals, cupy_args = [], []
        for n, t in signature.params:
            v = 0 if n in per_call else _check_arg(signature.name, n, t, bound[n])
            ct, nt = ARG_TYPES[t]
            vals.append(ct(v))
            cupy_args.append(nt(v))
        self._vals = vals
        self._slot_idx = tuple(names.index(n) for n in per_call)
        self._slots = tuple(vals[i] for i in self._slot_idx)
        self._cupy_args = cupy_args
        self._params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        handle = getattr(fn, "ptr", None)      # driver.Function (or a CuPy function)
        self._handle = int(handle) if handle else None
        self._launch = _driver_launch() if self._handle else None

    def arguments(self, ptrs: Sequence[int] = ()) -> list[tuple[str, str, Any]]:
        """``(name, type, value)`` of every parameter in signature order, as the argument buffer
        holds them (with ``ptrs`` written into the per-call slots when given)."""
        for v, p in zip(self._slots, ptrs):
            v.value = p
        return [(n, t, ARG_TYPES[t][0].from_address(self._params[i]).value)
                for i, (n, t) in enumerate(self.signature.params)]

    def __call__(self, ptrs: Sequence[int], stream: int) -> None:
        """Launch with the per-call pointers ``ptrs`` (in ``per_call`` order) on ``stream``."""
        launch = self._launch
        if launch is not None:
            for v, p in zip(self._slots, ptrs):
                v.value = p
            if not _THREAD.__dict__:
                _bind_thread(self.fn)
            g, b = self.grid, self.block
            rc = launch(self._handle, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream, self._params, None)
            if rc == driver.INVALID_CONTEXT and driver.make_current(getattr(self.fn, "device", 0)):
                # the thread's context was taken away since (someone popped it)
                rc = launch(self._handle, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream, self._params, None)
            if rc == 0:
                return
            raise RuntimeError(f"cuLaunchKernel({self.signature.name}) failed with CUresult {rc}")
        args = list(self._cupy_args)
        for i, p in zip(self._slot_idx, ptrs):
            args[i] = p
        self.fn(self.grid, self.block, tuple(args), shared_mem=self.smem, stream=_stream(stream))


_THREAD = threading.local()


def _bind_thread(fn) -> None:
    """Once per thread, before its first launch (:func:`driver.ensure_current`), so that a launch
    from a thread without a current context does not fail with CUDA_ERROR_INVALID_CONTEXT first
    (which compute-sanitizer reports as an error even though the launch is retried)."""
    driver.ensure_current(getattr(fn, "device", 0))
    _THREAD.bound = True


class LaunchSequence:
    """The launches of one call, in order on its stream: ``plans`` (:class:`LaunchPlan`) and for
    each the positions in the call's pointers of its per-call parameters (``slots``; a helper
    kernel may take only the output, or none of them)."""

    __slots__ = ("plans", "slots", "_steps")

    def __init__(self, plans: Sequence[LaunchPlan], slots: Sequence[Sequence[int]]):
        self.plans = tuple(plans)
        self.slots = tuple(tuple(int(i) for i in s) for s in slots)
        if len(self.slots) != len(self.plans):
            raise ValueError("one slot list per launch")
        for p, s in zip(self.plans, self.slots):
            if len(s) != len(p.per_call):
                raise ValueError(f"kernel {p.signature.name}: {len(p.per_call)} per-call pointers, {len(s)} slots")
        self._steps = tuple(zip(self.plans, self.slots))

    def arguments(self, ptrs: Sequence[int] = ()) -> list[list[tuple[str, str, Any]]]:
        """:meth:`LaunchPlan.arguments` of every launch (the call's ``ptrs`` in their slots)."""
        return [p.arguments(tuple(ptrs[i] for i in s) if ptrs else ()) for p, s in self._steps]

    def __call__(self, ptrs: Sequence[int], stream: int) -> None:
        for plan, slots in self._steps:
            plan([ptrs[i] for i in slots], stream)


_RANGES = {"int32": (-2**31, 2**31 - 1), "uint32": (0, 2**32 - 1), "int64": (-2**63, 2**63 - 1),
           "uint64": (0, 2**64 - 1), "ptr": (0, 2**64 - 1)}


def _check_arg(kernel: str, name: str, ctype: str, value):
    """``value`` as the Python number parameter ``name`` of type ``ctype`` takes; TypeError /
    ValueError for a value of another kind or out of the type's range."""
    if ctype.startswith("float"):
        if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
            raise TypeError(f"kernel {kernel}: argument {name!r} ({ctype}) got {type(value).__name__}")
        return float(value)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"kernel {kernel}: argument {name!r} ({ctype}) got {type(value).__name__}")
    lo, hi = _RANGES[ctype]
    if not lo <= int(value) <= hi:
        raise ValueError(f"kernel {kernel}: argument {name!r} = {int(value)} does not fit {ctype}")
    return int(value)


def Launch(fn, grid, block, args: Sequence[Any], smem: int = 0) -> LaunchPlan:
    """A :class:`LaunchPlan` from positional arguments, for templates that do not bind by name yet:
    ``None`` marks a per-call pointer (in order), ``np.int32`` / ``np.float32`` are 4-byte values,
    other ints 8-byte (pointers)."""
    params, bound, per_call = [], {}, []
    for i, a in enumerate(args):
        n = f"a{i}"
        if a is None:
            params.append((n, "ptr"))
            per_call.append(n)
            continue
        if isinstance(a, np.int32):
            t = "int32"
        elif isinstance(a, np.float32):
            t = "float32"
        elif isinstance(a, (int, np.integer)):
            t, a = "ptr", int(a) & 0xFFFFFFFFFFFFFFFF
        else:
            raise TypeError(f"unsupported kernel argument type {type(a).__name__}")
        params.append((n, t))
        bound[n] = a
    return LaunchPlan(fn, KernelSignature(getattr(fn, "__name__", "kernel"), tuple(params)), grid, block, smem,
                      bound=bound, per_call=per_call)


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


def check_arch(built_arch: int, device: int) -> bool:
    """Whether a binary with SASS + PTX for ``built_arch`` runs on ``device`` (same major, not
    older; a newer major runs the PTX through the driver's JIT)."""
    arch = _device_arch(device)
    return arch >= built_arch and (arch // 10 == built_arch // 10 or arch // 10 > built_arch // 10)


def binary_for_device(path: str, built_arch: int, device: int, rebuild=None) -> tuple[str, int]:
    """The binary to load on ``device``: ``path`` when its arch (``built_arch``) runs there
    (:func:`check_arch`), else ``rebuild(arch)`` -- the same kernels compiled here for the
    device's arch -- when nvcc is installed.  Returns ``(path, arch)``; RuntimeError when the
    binary cannot run and cannot be rebuilt."""
    if check_arch(int(built_arch), device):
        return path, int(built_arch)
    arch = device_arch(device)
    if rebuild is None or not nvcc_available():
        raise RuntimeError(f"kernel was built for sm_{built_arch} and cannot run on this GPU (sm_{arch}); "
                           f"rebuild the module here")
    return rebuild(arch), arch
