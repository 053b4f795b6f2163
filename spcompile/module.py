""":class:`CompiledModule`: the callable result of :func:`spcompile.build`, and :func:`load`.

Saving writes the artifact files through :mod:`spcompile.artifact`; loading verifies every
checksum, the format and library versions and the template's version and source hash, and
(when the caller passes the matrix) that it is the same matrix.  Nothing in an artifact is
unpickled or executed except the kernel library its manifest names.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any, Mapping

import numpy as np

from ._version import __version__, tvm_version
from .artifact import FORMAT_VERSION, ArtifactError, check_manifest_digest, read_arrays, read_artifact, write_artifact
from .core.config import Config
from .core.formats import as_csr
from .core.ir import WorkloadKey, pattern_hash, values_hash
from .kernels import get_template
from .runtime.arrays import array_kind

__all__ = ["CompiledModule", "load"]


class CompiledModule:
    """A compiled sparse kernel for one matrix.

    ``mod(X)`` (SpMM) or ``mod(X, Y)`` (SDDMM) returns the result in the caller's row/column
    order; ``out=`` may pass a preallocated output.  ``config`` is the decision that built it;
    ``key`` the workload key; ``pass_log`` what the passes did and measured."""

    def __init__(self, key: WorkloadKey, config: Config, kernel, pass_log=(), values_hash: str = "",
                 tuning: Mapping[str, Any] | None = None):
        self.key = key
        self.config = config
        self.kernel = kernel
        self.pass_log = list(pass_log)
        self.values_hash = values_hash
        self.tuning = dict(tuning or {})
        self._in_shapes = ((key.cols, key.K),) if key.op == "spmm" else ((key.rows, key.K), (key.cols, key.K))
        self._out_shape = (key.rows, key.K) if key.op == "spmm" else (key.nnz,)
        self._tmpdir = None  # holds extracted binaries of a loaded single-file artifact
        self._fast = None    # the checked fast call path (torch CUDA tensors), set after a first call

    # -- properties -----------------------------------------------------------------------
    op = property(lambda self: self.key.op)
    reduce = property(lambda self: self.key.reduce)
    K = property(lambda self: self.key.K)
    shape = property(lambda self: (self.key.rows, self.key.cols))
    target = property(lambda self: self.config.target)

    def __repr__(self):
        return (f"CompiledModule(op={self.op!r}, reduce={self.reduce!r}, shape={self.shape}, "
                f"nnz={self.key.nnz}, K={self.K}, {self.config})")

    # -- calling ---------------------------------------------------------------------------
    def _check(self, x, i: int):
        name = "X" if i == 0 else "Y"
        kind = array_kind(x)
        if kind == "other":
            raise TypeError(f"{name} must be a numpy array, torch tensor or cupy array, got {type(x).__name__}")
        shape = tuple(x.shape)
        want = self._in_shapes[i]
        if shape != want:
            hint = ""
            if len(shape) == 2 and shape[0] == want[0] and shape[1] != want[1]:
                hint = f" (the module was built for K={self.K})"
            raise ValueError(f"{name} has shape {shape}, expected {want}{hint}")
        dt = str(x.dtype).replace("torch.", "")
        want_dt = self.key.dtype
        if kind == "numpy" and want_dt == "bfloat16":
            raise TypeError(f"{name} is a numpy array, but this module takes bfloat16 inputs and numpy has no "
                            f"bfloat16 dtype: pass a torch.bfloat16 tensor (e.g. torch.from_numpy(x).bfloat16())")
        if dt != want_dt:
            cast = {"float32": "X.astype(np.float32) / X.float()", "float16": "X.astype(np.float16) / X.half()",
                    "bfloat16": "X.bfloat16() (torch; numpy has no bfloat16)"}.get(want_dt, want_dt)
            raise TypeError(f"{name} has dtype {dt}, expected {want_dt} (the module was built with "
                            f"dtype={want_dt!r}; cast it first, e.g. {cast})")
        return kind

    def __call__(self, *inputs, out=None):
        fast = self._fast
        if fast is not None:
            res = fast(inputs, out)
            if res is not None:
                return res
        n = len(self._in_shapes)
        if len(inputs) != n:
            raise TypeError(f"{self.op} module takes {n} input(s) ({'X' if n == 1 else 'X, Y'}), got {len(inputs)}")
        kinds = {self._check(x, i) for i, x in enumerate(inputs)}
        if len(kinds) > 1:
            raise TypeError(f"inputs mix array types {sorted(kinds)}; pass them all as the same kind")
        kind = kinds.pop()
        if self.config.target == "cpu":
            return self._call_cpu(kind, inputs, out)
        from .runtime import cuda as rt_cuda

        res = rt_cuda.call(self.kernel, kind, inputs, out, self._out_shape, self.key.dtype)
        if kind == "torch" and self._fast is None and inputs[0].device.type == "cuda":
            self._fast = self._make_fast_torch(inputs[0].device)
        return res

    def _make_fast_torch(self, device):
        """The call path for the common case, set up after a first checked call: torch CUDA tensors
        of exactly the module's dtype and shapes, contiguous, on its device, current stream.  It
        checks just that (a few attribute reads), allocates the output when none is given and
        launches; anything else returns None and takes the full path (with its errors).  No
        allocation besides the output, no conversion, no synchronisation."""
        import torch

        from .runtime.cuda import _torch_stream

        kernel = self.kernel
        T = torch.Tensor
        dt = getattr(torch, self.key.dtype)     # inputs and output: the module's dtype
        idx = device.index if device.index is not None else torch.cuda.current_device()
        dev = torch.device("cuda", idx)
        shapes = tuple(torch.Size(s) for s in self._in_shapes)
        oshape = torch.Size(self._out_shape)
        empty = torch.empty
        run = kernel.run
        get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        stream_of = (lambda: get_stream(idx)) if get_stream is not None else (lambda: _torch_stream(torch, idx))

        def fast(inputs, out):
            if len(inputs) != len(shapes):
                return None
            for x, shp in zip(inputs, shapes):
                if (type(x) is not T or x.dtype is not dt or x.shape != shp or x.get_device() != idx
                        or not x.is_contiguous()):
                    return None
            if out is None:
                out = empty(oshape, dtype=dt, device=dev)
            elif (type(out) is not T or out.dtype is not dt or out.shape != oshape or out.get_device() != idx
                  or not out.is_contiguous()):
                return None
            run("torch", inputs, out, stream_of())
            return out

        return fast

    def _call_cpu(self, kind, inputs, out):
        if kind == "cupy" or (kind == "torch" and any(x.device.type != "cpu" for x in inputs)):
            raise ValueError("this module was built for target='cpu' but got GPU arrays; move them to "
                             "the host or build with target='cuda'")
        if kind == "torch":
            import torch

            arrs = [x.detach().contiguous().numpy() for x in inputs]
            res = self._call_cpu("numpy", arrs, None)
            if out is not None:
                out.copy_(torch.from_numpy(res))
                return out
            return torch.from_numpy(res)
        arrs = [np.ascontiguousarray(x) for x in inputs]
        if out is None:
            out = np.empty(self._out_shape, dtype=np.float32)
        elif not (isinstance(out, np.ndarray) and out.shape == self._out_shape and out.dtype == np.float32
                  and out.flags.c_contiguous and out.flags.writeable):
            raise ValueError(f"out must be a writable C-contiguous float32 numpy array of shape {self._out_shape}")
        if self.key.nnz == 0:
            # no stored entries: every SpMM row is empty (0 by convention), SDDMM has no output;
            # zero-size arrays cannot be passed to the kernels (DLPack reports them non-compact)
            out[...] = 0
            return out
        return self.kernel(*arrs, out=out)

    # -- artifacts -------------------------------------------------------------------------
    def _manifest(self) -> dict:
        tpl = get_template(self.config.template)
        return {
            "spcompile_version": __version__, "tvm_version": tvm_version(),
            "op": self.op, "reduce": self.reduce, "shape": list(self.shape), "nnz": self.key.nnz,
            "K": self.K, "dtype": self.key.dtype,
            "workload_key": self.key.to_dict(), "values_hash": self.values_hash,
            "config": self.config.to_dict(),
            "template": {"name": tpl.name, "version": tpl.version, "source_hash": tpl.source_hash()},
            "kernel_meta": self.kernel.meta, "pass_log": self.pass_log, "tuning": self.tuning,
        }

    def save(self, path: str, *, as_dir: bool | None = None) -> str:
        """Write the artifact (see :mod:`spcompile.artifact`).  A path that is an existing
        directory, ends with a separator, or ``as_dir=True`` gives a directory; otherwise one zip
        file (e.g. ``model.spc``)."""
        return write_artifact(path, self._manifest(), self.kernel.arrays, self.kernel.files, as_dir=as_dir)

    @classmethod
    def load(cls, path: str, A=None) -> "CompiledModule":
        return load(path, A)


def _compatible(saved: str, current: str) -> bool:
    """Same major.minor version."""
    return saved.split(".")[:2] == current.split(".")[:2]


def load(path: str, A=None) -> CompiledModule:
    """Load a saved module.  With ``A`` (any supported sparse input) the artifact must have been
    built for exactly that matrix (pattern and values), else :class:`ArtifactError`."""
    workdir = tempfile.mkdtemp(prefix="spcompile-load-")
    try:
        manifest, paths = read_artifact(os.fspath(path), workdir)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"artifact format version {manifest.get('format_version')} is not supported "
                                f"(this spcompile reads version {FORMAT_VERSION})")
        if not _compatible(str(manifest.get("spcompile_version", "")), __version__):
            raise ArtifactError(f"artifact was written by spcompile {manifest.get('spcompile_version')}, "
                                f"incompatible with {__version__}; rebuild it")
        try:
            config = Config.from_dict(manifest["config"])
            key = WorkloadKey.from_dict(manifest["workload_key"])
        except (KeyError, TypeError, AttributeError) as e:
            raise ArtifactError(f"artifact manifest is incomplete or malformed ({type(e).__name__}: {e})") from None
        if config.target == "cpu" and manifest.get("tvm_version") != tvm_version():
            raise ArtifactError(f"artifact's CPU kernel was built with TVM {manifest.get('tvm_version')}, "
                                f"this runtime has {tvm_version()}; rebuild it")
        # versions are checked first (their errors say more); everything else must be intact
        check_manifest_digest(manifest)
        try:
            tpl = get_template(config.template)
        except ValueError:
            raise ArtifactError(f"artifact uses template {config.template!r}, unknown to this spcompile") from None
        saved_tpl = manifest.get("template", {})
        if saved_tpl.get("version") != tpl.version or saved_tpl.get("source_hash") != tpl.source_hash():
            raise ArtifactError(f"artifact was built by another version of template {tpl.name!r}; rebuild it")
        if A is not None:
            C = as_csr(A)
            if C.shape != (key.rows, key.cols) or pattern_hash(C) != key.pattern:
                raise ArtifactError("artifact was built for a different matrix (sparsity pattern differs)")
            if values_hash(C) != manifest.get("values_hash"):
                raise ArtifactError("artifact was built for a different matrix (values differ)")
        arrays = read_arrays(paths.pop("arrays.npz"))
        kernel = tpl.load(config.params, arrays, paths, manifest.get("kernel_meta", {}))
        mod = CompiledModule(key, config, kernel, manifest.get("pass_log", []), manifest.get("values_hash", ""),
                             manifest.get("tuning"))
        mod._tmpdir = workdir
        weakref.finalize(mod, shutil.rmtree, workdir, True)  # binaries stay while the module lives
        return mod
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
