"""Array frameworks the modules accept -- numpy, torch, CuPy -- one adapter per framework.

An adapter is what the call path needs to know of a framework, so that nothing above it tests
"which framework is this" again:

* ``adapter_for(x)``: the adapter of an array (``None`` for anything else); the framework is
  recognised by the array's type, without importing it.
* ``check(x, name, shape, dtype)``: shape and dtype of an input, with the errors users see;
  ``check_out(out, shape, dtype, device)`` likewise for a caller's output buffer.
* ``dtype(x)``, ``device(x)`` (a CUDA device index, ``None`` for host memory),
  ``contiguous(x)`` (itself, or a C-contiguous copy).
* ``ptr(x)``: the data pointer (a C-level callable: no Python frame per call).
* ``allocator(shape, dtype, device)`` and ``stream(device)``: prepared zero-argument callables
  for the hot path (a new output; the raw handle of the framework's current stream there).
* ``to_device(x, device)`` / ``to_host(d)``: host arrays through a CUDA device and back;
  ``device_adapter`` is the framework of the device copy (the driver's ``DeviceArray`` for
  numpy arrays: no GPU framework is imported for them).
* ``matcher(in_shapes, out_shape, dtype, device)``: the cheap signature check a module keeps
  after a first checked call: ``same(inputs, out)`` is True when every array is exactly of this
  framework, dtype, shape and device and C-contiguous, and (torch) does not require grad
  (``out`` may be None) -- a few attribute
  reads, so that repeated calls skip the full checks and their error formatting.
"""
from __future__ import annotations

import functools
import operator
import sys
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["ArrayAdapter", "NUMPY", "TORCH", "CUPY", "ADAPTERS", "adapter_for"]

Shape = tuple[int, ...]


class ArrayAdapter:
    """What the call path needs of one array framework (one instance per framework)."""

    #: the framework's name, as users know it ("numpy", "torch", "cupy")
    name = ""
    #: the word for one of its arrays in error messages
    noun = "array"
    #: module dtypes the framework can hold
    dtypes: frozenset[str] = frozenset(("float32", "float16", "float64"))
    #: data pointer of an array (C-level)
    ptr: Callable[[Any], int]

    @property
    def device_adapter(self) -> "ArrayAdapter":
        """The framework of this framework's arrays once copied to a CUDA device."""
        return self

    def __repr__(self):
        return f"<{self.name} arrays>"

    # -- what an array is ------------------------------------------------------------------
    def dtype(self, x) -> str:
        return x.dtype.name

    def device(self, x) -> int | None:
        raise NotImplementedError

    def is_contiguous(self, x) -> bool:
        return x.flags.c_contiguous

    def contiguous(self, x):
        raise NotImplementedError

    def cast_hint(self, name: str, dtype: str) -> str:
        return f"{name}.astype({self.name}.{dtype})"

    def device_name(self, device: int | None) -> str:
        return "the host" if device is None else f"CUDA device {device}"

    # -- checks (the errors users see) --------------------------------------------------------
    def check(self, x, name: str, shape: Shape, dtype: str) -> None:
        """Shape and dtype of input ``name`` (TypeError / ValueError saying what is wrong)."""
        got = tuple(x.shape)
        if got != shape:
            hint = ""
            if len(got) == 2 and got[0] == shape[0] and got[1] != shape[1]:
                hint = f" (the module was built for K={shape[1]})"
            raise ValueError(f"{name} has shape {got}, expected {shape}{hint}")
        if dtype not in self.dtypes:
            raise TypeError(f"{name} is a {self.name} {self.noun}, but this module takes {dtype} inputs and "
                            f"{self.name} has no {dtype} dtype: pass a torch.{dtype} tensor (e.g. "
                            f"{self._torch_hint(name, dtype)})")
        got_dt = self.dtype(x)
        if got_dt != dtype:
            raise TypeError(f"{name} has dtype {got_dt}, expected {dtype} (the module was built with "
                            f"dtype={dtype!r}; cast it first, e.g. {self.cast_hint(name, dtype)})")

    def _torch_hint(self, name: str, dtype: str) -> str:
        return f"torch.from_dlpack({name}).{dtype}()"

    def check_out(self, out, shape: Shape, dtype: str, device: int | None) -> None:
        """``out`` must be a C-contiguous, writable array of this framework, ``dtype`` and ``shape``
        on ``device``; ValueError otherwise."""
        if not (self.owns(out) and tuple(out.shape) == shape and self.dtype(out) == dtype
                and self.device(out) == device and self.is_contiguous(out) and self._writable(out)):
            raise ValueError(f"out must be a C-contiguous, writable {dtype} {self.name} {self.noun} of shape "
                             f"{shape} on {self.device_name(device)} (like the inputs)")

    def _writable(self, x) -> bool:
        return True

    def overlaps(self, a, b) -> bool:
        """Whether the memory of arrays ``a`` and ``b`` (C-contiguous) overlaps."""
        pa, pb = self.ptr(a), self.ptr(b)
        return pa < pb + self.nbytes(b) and pb < pa + self.nbytes(a) and self.nbytes(a) > 0 and self.nbytes(b) > 0

    def nbytes(self, x) -> int:
        return int(x.nbytes)

    def owns(self, x) -> bool:
        return adapter_for(x) is self

    # -- allocation, streams, copies ----------------------------------------------------------
    def allocator(self, shape: Shape, dtype: str, device: int | None) -> Callable[[], Any]:
        raise NotImplementedError

    def stream(self, device: int) -> Callable[[], int]:
        raise TypeError(f"{self.name} arrays have no CUDA streams")

    def to_device(self, x, device: int):
        """A copy of host array ``x`` on CUDA device ``device`` (a ``device_adapter`` array)."""
        raise NotImplementedError

    def to_host(self, d):
        """A host array of this framework holding device array ``d`` (synchronous)."""
        raise NotImplementedError

    # -- the cheap signature check ------------------------------------------------------------
    def exact(self, dtype: str, device: int | None) -> Callable[[Any, Shape], bool]:
        """``exact(x, shape)``: x is of this framework, ``dtype``, ``shape`` and ``device``, and
        C-contiguous (attribute reads only; no errors)."""
        raise NotImplementedError

    def exact_out(self, dtype: str, device: int | None) -> Callable[[Any, Shape], bool]:
        """Like :meth:`exact`, for an output buffer."""
        return self.exact(dtype, device)

    def matcher(self, in_shapes: Sequence[Shape], out_shape: Shape, dtype: str,
                device: int | None) -> Callable[[Sequence[Any], Any], bool]:
        exact, exact_out = self.exact(dtype, device), self.exact_out(dtype, device)
        shapes = tuple(tuple(s) for s in in_shapes)
        oshape = tuple(out_shape)
        n = len(shapes)

        def same(inputs, out) -> bool:
            if len(inputs) != n:
                return False
            for x, s in zip(inputs, shapes):
                if not exact(x, s):
                    return False
            return out is None or exact_out(out, oshape)

        return same


class _Numpy(ArrayAdapter):
    name = "numpy"

    @property
    def device_adapter(self):
        return DEVICE

    def device(self, x):
        return None

    def contiguous(self, x):
        x = np.ascontiguousarray(x)
        if not x.flags.writeable:
            x = _readable_alias(x)
        return x

    def overlaps(self, a, b):
        return bool(np.may_share_memory(a, b))  # exact for the C-contiguous arrays compared here

    def cast_hint(self, name, dtype):
        return f"{name}.astype(np.{dtype})"

    def _torch_hint(self, name, dtype):
        return f"torch.from_numpy({name}).{dtype}()"

    def _writable(self, x):
        return x.flags.writeable

    def allocator(self, shape, dtype, device=None):
        return functools.partial(np.empty, tuple(shape), np.dtype(dtype))

    def to_device(self, x, device):
        from .driver import DeviceArray

        return DeviceArray.from_host(x, device)

    def to_host(self, d):
        return d.get()

    def exact(self, dtype, device):
        # read-only arrays take the checked path, which passes the kernels a zero-copy alias
        nd, dt = np.ndarray, np.dtype(dtype)
        return lambda x, s: (type(x) is nd and x.dtype == dt and x.shape == s and x.flags.c_contiguous
                             and x.flags.writeable)


def _readable_alias(x: np.ndarray) -> np.ndarray:
    """A writable-flagged, zero-copy view of read-only C-contiguous ``x`` (``np.frombuffer`` of
    bytes, ``setflags(write=False)``, ``np.memmap(mode="r")``): DLPack, through which the kernels
    receive arrays, cannot export read-only arrays.  Only for kernel *inputs*, which kernels never
    write; the view keeps ``x`` alive."""
    import ctypes

    if x.nbytes == 0:
        return np.empty(x.shape, x.dtype)
    buf = (ctypes.c_char * x.nbytes).from_address(x.ctypes.data)
    buf._spcompile_owner = x  # keep the memory's owner alive as long as the view
    return np.frombuffer(buf, dtype=x.dtype).reshape(x.shape)


class _Torch(ArrayAdapter):
    name = "torch"
    noun = "tensor"
    dtypes = frozenset(("float32", "float16", "bfloat16", "float64"))

    @functools.cached_property
    def ptr(self):
        # torch.Tensor.data_ptr itself (no wrapper); first read once a tensor has been seen
        return sys.modules["torch"].Tensor.data_ptr

    def dtype(self, x):
        return str(x.dtype).rpartition(".")[2]

    def nbytes(self, x):
        return int(x.numel()) * int(x.element_size())

    def device(self, x):
        i = x.get_device()
        return None if i < 0 else i

    def is_contiguous(self, x):
        return x.is_contiguous()

    def contiguous(self, x):
        return x if x.is_contiguous() else x.contiguous()

    def cast_hint(self, name, dtype):
        method = {"float32": "float", "float16": "half", "float64": "double"}.get(dtype, dtype)
        return f"{name}.{method}()"

    def device_name(self, device):
        return "the CPU" if device is None else f"cuda:{device}"

    @staticmethod
    def _device(torch, device):
        return torch.device("cpu") if device is None else torch.device("cuda", device)

    def allocator(self, shape, dtype, device=None):
        torch = sys.modules["torch"]
        return functools.partial(torch.empty, tuple(shape), dtype=getattr(torch, dtype),
                                 device=self._device(torch, device))

    def stream(self, device):
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return functools.partial(raw, device)
        return lambda: torch.cuda.current_stream(device).cuda_stream

    def to_device(self, x, device):
        return x.detach().to(self._device(sys.modules["torch"], device))

    def to_host(self, d):
        return d.cpu()

    def matcher(self, in_shapes, out_shape, dtype, device):
        # the generic check inlined (one Python frame per call, not one per tensor): torch CUDA
        # tensors are the path whose per-call cost is measured (benchmarks/bench.py --call-overhead)
        torch = sys.modules["torch"]
        T, dt, idx = torch.Tensor, getattr(torch, dtype), -1 if device is None else device
        shapes = tuple(torch.Size(s) for s in in_shapes)
        oshape = torch.Size(out_shape)
        n = len(shapes)

        def same(inputs, out) -> bool:
            if len(inputs) != n:
                return False
            for x, s in zip(inputs, shapes):
                if (type(x) is not T or x.dtype is not dt or x.shape != s or x.get_device() != idx
                        or not x.is_contiguous() or x.requires_grad):
                    return False
            return out is None or (type(out) is T and out.dtype is dt and out.shape == oshape
                                   and out.get_device() == idx and out.is_contiguous())

        return same


class _Cupy(ArrayAdapter):
    name = "cupy"
    ptr = operator.attrgetter("data.ptr")

    def device(self, x):
        return x.device.id

    def contiguous(self, x):
        return x if x.flags.c_contiguous else sys.modules["cupy"].ascontiguousarray(x)

    def allocator(self, shape, dtype, device):
        cupy = sys.modules["cupy"]
        empty, dev = functools.partial(cupy.empty, tuple(shape), np.dtype(dtype)), cupy.cuda.Device(device)

        def alloc():
            with dev:
                return empty()

        return alloc

    def stream(self, device):
        get = sys.modules["cupy"].cuda.get_current_stream
        return lambda: get().ptr

    def exact(self, dtype, device):
        cp_nd, dt = sys.modules["cupy"].ndarray, np.dtype(dtype)
        return lambda x, s: (type(x) is cp_nd and x.dtype == dt and x.shape == s and x.device.id == device
                             and x.flags.c_contiguous)


class _Device(ArrayAdapter):
    """Device copies of host arrays (:class:`spcompile.runtime.driver.DeviceArray`): what the
    kernels see of numpy inputs, on the legacy default stream.  Internal: users pass numpy, torch
    or CuPy arrays."""

    name = "device"
    ptr = operator.attrgetter("ptr")

    def device(self, x):
        return x.device

    def contiguous(self, x):
        return x

    def allocator(self, shape, dtype, device):
        from .driver import DeviceArray

        return functools.partial(DeviceArray, tuple(shape), np.dtype(dtype), device)

    def stream(self, device):
        return lambda: 0


NUMPY, TORCH, CUPY, DEVICE = _Numpy(), _Torch(), _Cupy(), _Device()
ADAPTERS = (NUMPY, TORCH, CUPY)
_BY_MODULE = {"torch": TORCH, "cupy": CUPY}


def adapter_for(x) -> ArrayAdapter | None:
    """The adapter of array ``x`` (numpy, torch or CuPy), or None for anything else.  Recognised
    by type, so that no framework is imported to look at another's arrays."""
    if isinstance(x, np.ndarray):
        return NUMPY
    return _BY_MODULE.get(type(x).__module__.partition(".")[0])
