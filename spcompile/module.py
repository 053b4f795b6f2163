""":class:`CompiledModule`: the callable result of :func:`spcompile.build`, and its artifact format.

Artifact (a directory, or the same files in one uncompressed zip file):

* ``manifest.json`` — format version, spcompile / TVM versions, op, shapes, workload key,
  config (pipeline, template, params), target, kernel metadata, pass log, the SHA-256 of
  every other file and (``manifest_sha256``) of its own content,
* ``arrays.npz`` — the kernel's matrix data (loaded with ``allow_pickle=False``),
* the kernel binaries the manifest names (a TVM ``export_library`` .so, cubin / PTX).

Loading verifies every checksum, the format and library versions and the template's version
and source hash, and (when the caller passes the matrix) that it is the same matrix.  Nothing in
an artifact is unpickled or executed except the kernel library its manifest names.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import weakref
import zipfile
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from . import __version__
from .ir import WorkloadKey

FORMAT = "spcompile-artifact"
FORMAT_VERSION = 1
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

__all__ = ["Config", "CompiledModule", "ArtifactError", "load"]


class ArtifactError(ValueError):
    """A saved module cannot be loaded: corrupt, tampered, incompatible or for another matrix."""


@dataclass(frozen=True)
class Config:
    """A compilation decision: pass pipeline (with options), template, its parameters, target."""

    template: str
    params: Mapping[str, Any] = field(default_factory=dict)
    pipeline: tuple = ()
    target: str = "cpu"
    format: str = "csr"

    def to_dict(self) -> dict:
        return {"template": self.template, "params": dict(self.params),
                "pipeline": [dict(p) for p in self.pipeline], "target": self.target, "format": self.format}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Config":
        return cls(template=d["template"], params=dict(d.get("params", {})),
                   pipeline=tuple(dict(p) for p in d.get("pipeline", ())), target=d.get("target", "cpu"),
                   format=d.get("format", "csr"))

    def __str__(self) -> str:
        pipe = " -> ".join(p["name"] + (str(p["options"]) if p.get("options") else "") for p in self.pipeline)
        return (f"target={self.target} pipeline=[{pipe}] format={self.format} "
                f"template={self.template} params={dict(self.params)}")


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tvm_version() -> str | None:
    try:
        import tvm

        return tvm.__version__
    except Exception:
        return None


def _array_kind(x) -> str:
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    return "other"


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
        kind = _array_kind(x)
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
    def _manifest(self, files: dict[str, str]) -> dict:
        from .schedules import get_template

        tpl = get_template(self.config.template)
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "spcompile_version": __version__, "tvm_version": _tvm_version(),
            "op": self.op, "reduce": self.reduce, "shape": list(self.shape), "nnz": self.key.nnz,
            "K": self.K, "dtype": self.key.dtype,
            "workload_key": self.key.to_dict(), "values_hash": self.values_hash,
            "config": self.config.to_dict(),
            "template": {"name": tpl.name, "version": tpl.version, "source_hash": tpl.source_hash()},
            "kernel_meta": self.kernel.meta, "pass_log": self.pass_log, "tuning": self.tuning,
            "files": files,
        }

    def save(self, path: str, *, as_dir: bool | None = None) -> str:
        """Write the artifact.  A path that is an existing directory, ends with a separator, or
        ``as_dir=True`` gives a directory; otherwise one zip file (e.g. ``model.spc``)."""
        path = os.fspath(path)
        if as_dir is None:
            as_dir = os.path.isdir(path) or path.endswith(os.sep)
        with tempfile.TemporaryDirectory(prefix="spcompile-save-") as tmp:
            buf = io.BytesIO()
            np.savez(buf, **self.kernel.arrays)
            with open(os.path.join(tmp, "arrays.npz"), "wb") as f:
                f.write(buf.getvalue())
            for name, src in self.kernel.files.items():
                if not _SAFE_NAME.match(name) or name in ("manifest.json", "arrays.npz"):
                    raise ValueError(f"bad kernel file name {name!r}")
                shutil.copyfile(src, os.path.join(tmp, name))
            files = {n: _sha256_file(os.path.join(tmp, n)) for n in ["arrays.npz", *self.kernel.files]}
            # normalise through JSON first so that the checksum is over exactly what load() reads
            body = json.loads(json.dumps(self._manifest(files), default=_json_default))
            body[_MANIFEST_SUM] = _manifest_digest(body)
            manifest = json.dumps(body, indent=1, sort_keys=True)
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                f.write(manifest)
            names = ["manifest.json", *files]
            if as_dir:
                os.makedirs(path, exist_ok=True)
                for n in names:
                    shutil.copyfile(os.path.join(tmp, n), os.path.join(path, n))
            else:
                d = os.path.dirname(os.path.abspath(path))
                fd, part = tempfile.mkstemp(dir=d, prefix=".spc-")
                os.close(fd)
                with zipfile.ZipFile(part, "w", zipfile.ZIP_STORED) as z:
                    for n in names:
                        z.write(os.path.join(tmp, n), n)
                os.replace(part, path)  # atomic: a reader never sees half an artifact
        return path

    @classmethod
    def load(cls, path: str, A=None) -> "CompiledModule":
        return load(path, A)


_MANIFEST_SUM = "manifest_sha256"


def _manifest_digest(manifest: Mapping) -> str:
    """SHA-256 of the manifest's content (all keys but the checksum itself), canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != _MANIFEST_SUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def _read_artifact(path: str, workdir: str) -> tuple[dict, dict[str, str]]:
    """Copy the artifact's files into ``workdir`` (safe names only), return (manifest, paths)."""
    if os.path.isdir(path):
        def read(n):
            p = os.path.join(path, n)
            if not os.path.isfile(p):
                raise ArtifactError(f"artifact {path!r} is missing {n!r}")
            with open(p, "rb") as f:
                return f.read()

        return _read_files(read, path, workdir)
    if os.path.isfile(path):
        try:
            z = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            raise ArtifactError(f"{path!r} is not a spcompile artifact (not a directory or zip file)") from None

        def read(n):
            try:
                return z.read(n)
            except KeyError:
                raise ArtifactError(f"artifact {path!r} is missing {n!r}") from None
            except (zipfile.BadZipFile, OSError, EOFError) as e:  # corrupt member (bad CRC, truncated)
                raise ArtifactError(f"artifact {path!r}: cannot read {n!r}: {e}") from None

        with z:
            return _read_files(read, path, workdir)
    raise FileNotFoundError(f"no artifact at {path!r}")


def _read_files(read, path: str, workdir: str) -> tuple[dict, dict[str, str]]:
    try:
        manifest = json.loads(read("manifest.json").decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact manifest is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path!r} is not a spcompile artifact")
    files = manifest.get("files")
    if not isinstance(files, dict) or "arrays.npz" not in files:
        raise ArtifactError("artifact manifest lists no files")
    paths = {}
    for name, digest in files.items():
        if not isinstance(name, str) or not _SAFE_NAME.match(name) or name == "manifest.json":
            raise ArtifactError(f"artifact names a file with an unsafe name: {name!r}")
        data = read(name)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ArtifactError(f"checksum mismatch for {name!r}: the artifact was modified or corrupted")
        p = os.path.join(workdir, name)
        with open(p, "wb") as f:
            f.write(data)
        paths[name] = p
    return manifest, paths


def _compatible(saved: str, current: str) -> bool:
    """Same major.minor version."""
    return saved.split(".")[:2] == current.split(".")[:2]


def load(path: str, A=None) -> CompiledModule:
    """Load a saved module.  With ``A`` (any supported sparse input) the artifact must have been
    built for exactly that matrix (pattern and values), else :class:`ArtifactError`."""
    from .formats import as_csr
    from .ir import pattern_hash, values_hash
    from .schedules import get_template

    workdir = tempfile.mkdtemp(prefix="spcompile-load-")
    try:
        manifest, paths = _read_artifact(os.fspath(path), workdir)
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
        if config.target == "cpu" and manifest.get("tvm_version") != _tvm_version():
            raise ArtifactError(f"artifact's CPU kernel was built with TVM {manifest.get('tvm_version')}, "
                                f"this runtime has {_tvm_version()}; rebuild it")
        # versions are checked first (their errors say more); everything else must be intact
        if manifest.get(_MANIFEST_SUM) != _manifest_digest(manifest):
            raise ArtifactError("checksum mismatch for 'manifest.json': the artifact was modified or corrupted")
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
        try:
            with np.load(paths.pop("arrays.npz"), allow_pickle=False) as z:
                arrays = {k: np.array(z[k]) for k in z.files}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:  # object arrays refused here
            raise ArtifactError(f"artifact arrays.npz cannot be read without unpickling or is corrupt: {e}") from None
        kernel = tpl.load(config.params, arrays, paths, manifest.get("kernel_meta", {}))
        mod = CompiledModule(key, config, kernel, manifest.get("pass_log", []), manifest.get("values_hash", ""),
                             manifest.get("tuning"))
        mod._tmpdir = workdir
        weakref.finalize(mod, shutil.rmtree, workdir, True)  # binaries stay while the module lives
        return mod
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
