"""The CUDA driver API through ctypes: everything that loading and running a saved CUDA module
needs -- the device and its primary context, loading a fatbin, kernel handles, device memory
and copies -- with no GPU framework imported.

Why not CuPy here: importing CuPy costs about 0.3 s (more than numpy) and a serving process that
only loads a module and calls it on numpy arrays needs none of it; torch and CuPy callers keep
their own arrays and streams (their pointers and stream handles are what the kernels take).
Everything runs in the device's *primary* context, the one the CUDA runtime (and so torch and
CuPy) uses, so modules, arrays and streams of all of them mix.

``libcuda`` is opened on first use; without it (a machine with no NVIDIA driver) :func:`init`
is False and nothing else is called.  Errors are :class:`CudaError` with the driver's name of the
result code.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from typing import Any

import numpy as np

__all__ = ["CudaError", "init", "device_count", "compute_capability", "primary_context", "context",
           "make_current", "ensure_current", "load_module", "Module", "Function", "DeviceArray", "stream_synchronize",
           "warm_up", "raw_launch", "current_device", "INVALID_CONTEXT"]

_c_int, _c_uint, _c_size, _c_void_p, _c_u64 = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64
_P = ctypes.POINTER

#: driver API attributes used here
_CC_MAJOR, _CC_MINOR = 75, 76                      # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_*
_FUNC_MAX_DYNAMIC_SMEM = 8                         # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
INVALID_CONTEXT = 201                              # CUDA_ERROR_INVALID_CONTEXT

_SIGNATURES = {
    "cuInit": [_c_uint],
    "cuDeviceGetCount": [_P(_c_int)],
    "cuDeviceGet": [_P(_c_int), _c_int],
    "cuDeviceGetAttribute": [_P(_c_int), _c_int, _c_int],
    "cuDevicePrimaryCtxRetain": [_P(_c_void_p), _c_int],
    "cuCtxGetCurrent": [_P(_c_void_p)],
    "cuCtxSetCurrent": [_c_void_p],
    "cuCtxPushCurrent_v2": [_c_void_p],
    "cuCtxPopCurrent_v2": [_P(_c_void_p)],
    "cuModuleLoadData": [_P(_c_void_p), _c_void_p],
    "cuModuleGetFunction": [_P(_c_void_p), _c_void_p, ctypes.c_char_p],
    "cuFuncGetAttribute": [_P(_c_int), _c_int, _c_void_p],
    "cuFuncSetAttribute": [_c_void_p, _c_int, _c_int],
    "cuMemAlloc_v2": [_P(_c_u64), _c_size],
    "cuMemFree_v2": [_c_u64],
    "cuMemcpyHtoD_v2": [_c_u64, _c_void_p, _c_size],
    "cuMemcpyDtoH_v2": [_c_void_p, _c_u64, _c_size],
    "cuMemsetD8_v2": [_c_u64, ctypes.c_ubyte, _c_size],
    "cuStreamSynchronize": [_c_void_p],
    "cuLaunchKernel": [_c_void_p] + [_c_uint] * 7 + [_c_void_p] * 3,
    "cuGetErrorName": [_c_int, _P(ctypes.c_char_p)],
}


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``code`` is its CUresult."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class _Api:
    def __init__(self, lib):
        for name, argtypes in _SIGNATURES.items():
            f = getattr(lib, name)
            f.restype, f.argtypes = _c_int, argtypes
            setattr(self, name.removesuffix("_v2"), f)


@functools.lru_cache(maxsize=None)
def _api() -> _Api | None:
    try:
        return _Api(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def _error_name(rc: int) -> str:
    api, s = _api(), ctypes.c_char_p()
    if api is not None and api.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
        return s.value.decode()
    return "CUDA_ERROR"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CudaError(f"{what} failed: {_error_name(rc)} ({rc})", rc)


_INIT_LOCK = threading.Lock()
_INIT: list = []          # [True] / [False] once tried


def init() -> bool:
    """``cuInit`` once per process (thread-safe); False when there is no driver or no usable GPU."""
    if _INIT:
        return _INIT[0]
    with _INIT_LOCK:
        if not _INIT:
            api = _api()
            _INIT.append(api is not None and api.cuInit(0) == 0)
    return _INIT[0]


def _ready_api() -> _Api:
    if not init():
        raise CudaError("the CUDA driver is not usable on this machine (no libcuda, or cuInit failed)", 100)
    return _api()


def device_count() -> int:
    """Visible CUDA devices (0 without a driver)."""
    if not init():
        return 0
    n = _c_int()
    return n.value if _api().cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


@functools.lru_cache(maxsize=None)
def compute_capability(device: int) -> tuple[int, int]:
    api, major, minor = _ready_api(), _c_int(), _c_int()
    _check(api.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, int(device)), "cuDeviceGetAttribute")
    _check(api.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, int(device)), "cuDeviceGetAttribute")
    return major.value, minor.value


_CTX_LOCK = threading.Lock()
_PRIMARY: dict[int, int] = {}


def primary_context(device: int) -> int:
    """The primary context of ``device`` (retained once for the process; the one the CUDA
    runtime, torch and CuPy use)."""
    ctx = _PRIMARY.get(device)
    if ctx is None:
        api = _ready_api()
        with _CTX_LOCK:
            ctx = _PRIMARY.get(device)
            if ctx is None:
                dev, h = _c_int(), _c_void_p()
                _check(api.cuDeviceGet(ctypes.byref(dev), int(device)), f"cuDeviceGet({device})")
                _check(api.cuDevicePrimaryCtxRetain(ctypes.byref(h), dev.value), "cuDevicePrimaryCtxRetain")
                ctx = _PRIMARY[device] = int(h.value)
    return ctx


@contextlib.contextmanager
def context(device: int):
    """``device``'s primary context current on this thread for the block (the thread's own
    current context, if any, is current again afterwards)."""
    api = _ready_api()
    _check(api.cuCtxPushCurrent(primary_context(device)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        api.cuCtxPopCurrent(ctypes.byref(_c_void_p()))


def make_current(device: int) -> bool:
    """Make ``device``'s primary context this thread's current one (what a launch on a thread
    that never used the driver needs); False when it cannot."""
    try:
        return _ready_api().cuCtxSetCurrent(primary_context(device)) == 0
    except CudaError:
        return False


def _current_context() -> int:
    """This thread's current driver context (0: none, or no usable driver)."""
    if not init():
        return 0
    h = _c_void_p()
    return int(h.value or 0) if _api().cuCtxGetCurrent(ctypes.byref(h)) == 0 else 0


def ensure_current(device: int) -> None:
    """Make ``device``'s primary context current on a thread that has no current context (a
    fresh thread, e.g. autograd's backward thread); a thread's own context is left alone."""
    if not _current_context():
        make_current(device)


def current_device() -> int | None:
    """The device of this thread's current driver context, or None when there is none."""
    ctx = _current_context()
    if not ctx:
        return None
    for dev, primary in list(_PRIMARY.items()):
        if primary == ctx:
            return dev
    return None


def stream_synchronize(stream: int, device: int = 0) -> None:
    with context(device):
        _check(_api().cuStreamSynchronize(stream or None), "cuStreamSynchronize")


_WARM: dict[int, threading.Thread] = {}


def warm_up(device: int = 0) -> threading.Thread:
    """Start creating ``device``'s primary context in a background thread (``cuInit`` and the
    context cost about 0.4 s on an H100, during which the driver releases the GIL); later driver
    calls wait for it.  Errors are left for those calls to report."""
    t = _WARM.get(device)
    if t is None:
        def work():
            try:
                if init():
                    primary_context(device)
            except Exception:   # reported by the first real use
                pass

        t = _WARM[device] = threading.Thread(target=work, name=f"spcompile-cuda-init-{device}", daemon=True)
        t.start()
    return t


# -- modules and kernels --------------------------------------------------------------------
class Function:
    """A kernel of a loaded module: ``ptr`` (the CUfunction handle, what ``cuLaunchKernel``
    takes) and its device."""

    __slots__ = ("ptr", "device", "name", "module")

    def __init__(self, ptr: int, device: int, name: str, module: "Module"):
        self.ptr, self.device, self.name, self.module = ptr, device, name, module

    def __repr__(self):
        return f"<CUDA kernel {self.name} on device {self.device}>"

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        v = _c_int()
        with context(self.device):
            _check(_api().cuFuncGetAttribute(ctypes.byref(v), _FUNC_MAX_DYNAMIC_SMEM, self.ptr), "cuFuncGetAttribute")
        return v.value

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        with context(self.device):
            _check(_api().cuFuncSetAttribute(self.ptr, _FUNC_MAX_DYNAMIC_SMEM, int(nbytes)),
                   f"setting {nbytes} B of dynamic shared memory on {self.name}")


class Module:
    """A fatbin / cubin / PTX image loaded on a device (``cuModuleLoadData``; kept for the
    process's lifetime, as the kernels of cached modules are)."""

    def __init__(self, image: bytes, device: int, name: str = "module"):
        self.device, self.name = int(device), name
        h = _c_void_p()
        with context(self.device):
            _check(_api().cuModuleLoadData(ctypes.byref(h), image), f"loading {name}")
        self.handle = int(h.value)
        self._functions: dict[str, Function] = {}

    def get_function(self, name: str) -> Function:
        f = self._functions.get(name)
        if f is None:
            h = _c_void_p()
            _check(_api().cuModuleGetFunction(ctypes.byref(h), self.handle, name.encode()),
                   f"kernel {name!r} in {self.name}")
            f = self._functions[name] = Function(int(h.value), self.device, name, self)
        return f


def load_module(path: str, device: int) -> Module:
    with open(path, "rb") as f:
        image = f.read()
    return Module(image, device, name=path)


def raw_launch():
    """``cuLaunchKernel`` itself (the ctypes function: ``(function, gx, gy, gz, bx, by, bz, smem,
    stream, params, extra) -> CUresult``), for prepared launches that call it directly."""
    return _ready_api().cuLaunchKernel


# -- device memory --------------------------------------------------------------------------
class DeviceArray:
    """A C-contiguous array in device memory (``cuMemAlloc``, freed with the object): ``ptr``,
    ``shape``, ``dtype``, ``nbytes``, ``device``; :meth:`set` / :meth:`get` copy from / to the
    host (synchronously).  Exposes ``__cuda_array_interface__``, so torch (``torch.as_tensor``)
    and CuPy (``cupy.asarray``) can view it without a copy."""

    __slots__ = ("ptr", "shape", "dtype", "nbytes", "device", "_owner", "__weakref__")

    def __init__(self, shape, dtype, device: int = 0):
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.device = int(device)
        p = _c_u64()
        with context(self.device):
            _check(_api().cuMemAlloc(ctypes.byref(p), max(1, self.nbytes)), f"allocating {self.nbytes} B")
        self.ptr = int(p.value)
        self._owner = True

    @classmethod
    def from_host(cls, x, device: int = 0) -> "DeviceArray":
        x = np.ascontiguousarray(x)
        d = cls(x.shape, x.dtype, device)
        d.set(x)
        return d

    @classmethod
    def zeros(cls, shape, dtype, device: int = 0) -> "DeviceArray":
        d = cls(shape, dtype, device)
        with context(d.device):
            _check(_api().cuMemsetD8(d.ptr, 0, max(1, d.nbytes)), "cuMemsetD8")
            _check(_api().cuStreamSynchronize(None), "cuStreamSynchronize")
        return d

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def set(self, x) -> None:
        """Copy host array ``x`` (same number of bytes) in; done when this returns."""
        x = np.ascontiguousarray(x)
        if x.nbytes != self.nbytes:
            raise ValueError(f"cannot copy {x.nbytes} B into a device array of {self.nbytes} B")
        if not self.nbytes:
            return
        with context(self.device):
            _check(_api().cuMemcpyHtoD(self.ptr, x.ctypes.data, self.nbytes), "cuMemcpyHtoD")
            # a pageable copy may still be in flight when cuMemcpyHtoD returns: wait, so that
            # launches on any stream (torch's non-blocking ones too) see the data
            _check(_api().cuStreamSynchronize(None), "cuStreamSynchronize")

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        """The contents as a new host array (or into C-contiguous ``out``)."""
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif not (out.flags.c_contiguous and out.nbytes == self.nbytes):
            raise ValueError("out must be a C-contiguous host array of the same size")
        if self.nbytes:
            with context(self.device):
                _check(_api().cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return out

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": None}

    def __repr__(self):
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device})"

    def __del__(self):
        if getattr(self, "_owner", False):
            self._owner = False
            try:
                with context(self.device):
                    _api().cuMemFree(self.ptr)
            except Exception:   # the driver is gone (interpreter exit): nothing to free
                pass
