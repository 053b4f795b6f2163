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


from ._version import __version__, tvm_version
from .artifact import FORMAT_VERSION, ArtifactError, check_manifest_digest, read_arrays, read_artifact, write_artifact
from .core.config import Config
from .core.formats import as_csr
from .core.ir import WorkloadKey, pattern_hash, values_hash
from .kernels import get_template
from .runtime import cuda as rt_cuda
from .runtime.arrays import ArrayAdapter, adapter_for

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
        self._plans: dict = {}   # (adapter, device) -> _Plan, made by the first checked call of each
        self._plan = None        # the plan of the last checked call

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
    def __call__(self, *inputs, out=None):
        plan = self._plan
        if plan is None or not plan.same(inputs, out):
            plan, inputs = self._checked(inputs, out)
        if out is not None:
            overlaps = plan.overlaps
            for i, x in enumerate(inputs):
                if overlaps(x, out):
                    raise ValueError(f"out shares memory with input {'XY'[i]}: the kernel would read values it "
                                     "has already overwritten; pass a separate output array")
        return plan.run(inputs, out)

    def _checked(self, inputs, out) -> tuple["_Plan", list]:
        """Every check of a call, with the errors a caller sees; returns the plan for the inputs'
        framework and device (made once, then kept as the module's plan: calls of the same
        signature pass its cheap check and skip this) and the inputs made C-contiguous."""
        n = len(self._in_shapes)
        if len(inputs) != n:
            raise TypeError(f"{self.op} module takes {n} input(s) ({'X' if n == 1 else 'X, Y'}), got {len(inputs)}")
        adapter = None
        for i, x in enumerate(inputs):
            name = "X" if i == 0 else "Y"
            a = adapter_for(x)
            if a is None:
                raise TypeError(f"{name} must be a numpy array, torch tensor or cupy array, got {type(x).__name__}")
            a.check(x, name, self._in_shapes[i], self.key.dtype)
            if adapter is not None and a is not adapter:
                raise TypeError(f"inputs mix array types {[adapter.name, a.name]}; pass them all of one kind")
            adapter = a
        if self.config.target == "cpu":
            if any(adapter.device(x) is not None for x in inputs):
                raise ValueError("this module was built for target='cpu' but got GPU arrays; move them to "
                                 "the host or build with target='cuda'")
            device = None
        else:
            device = rt_cuda.placement(self.kernel, adapter, inputs)
        if out is not None:
            adapter.check_out(out, self._out_shape, self.key.dtype, device)
        plan = self._plans.get((adapter, device))
        if plan is None:
            plan = self._plans[(adapter, device)] = _Plan(
                adapter.matcher(self._in_shapes, self._out_shape, self.key.dtype, device), self._runner(adapter, device),
                adapter.overlaps)
        self._plan = plan
        return plan, [adapter.contiguous(x) for x in inputs]

    def _runner(self, adapter: ArrayAdapter, device: int | None):
        """The run step for checked, C-contiguous ``adapter`` arrays on ``device``."""
        if self.config.target != "cpu":
            return rt_cuda.runner(self.kernel, adapter, device, self._out_shape, self.key.dtype)
        alloc, kernel = adapter.allocator(self._out_shape, self.key.dtype, None), self.kernel
        if self.key.nnz == 0:
            # no stored entries: every SpMM row is empty (0 by convention), SDDMM has no output;
            # zero-size arrays cannot be passed to the kernels (DLPack reports them non-compact)
            def run_empty(inputs, out):
                out = alloc() if out is None else out
                out[...] = 0
                return out

            return run_empty
        return lambda inputs, out: kernel(*inputs, out=alloc() if out is None else out)

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

    def save(self, path: str, *, as_dir: bool | None = None, sign_key=None) -> str:
        """Write the artifact (see :mod:`spcompile.artifact`).  A path that is an existing
        directory, ends with a separator, or ``as_dir=True`` gives a directory; otherwise one zip
        file (e.g. ``model.spc``).  Either replaces an older artifact there atomically.
        ``sign_key`` (bytes or str, at least 16 bytes; default ``$SPCOMPILE_ARTIFACT_KEY``, ``False``
        for none) adds an HMAC-SHA256 signature that ``load(..., require_signature=True)`` checks."""
        return write_artifact(path, self._manifest(), self.kernel.arrays, self.kernel.artifact_files(), as_dir=as_dir,
                              sign_key=sign_key)

    @classmethod
    def load(cls, path: str, A=None, *, require_signature: bool | None = None, key=None) -> "CompiledModule":
        return load(path, A, require_signature=require_signature, key=key)


class _Plan:
    """How a module runs arrays of one framework on one device: ``same(inputs, out)``, the cheap
    check that a call has exactly that signature (see :meth:`ArrayAdapter.matcher`), and
    ``run(inputs, out)``, the run step."""

    __slots__ = ("same", "run", "overlaps")

    def __init__(self, same, run, overlaps):
        self.same, self.run, self.overlaps = same, run, overlaps


def _compatible(saved: str, current: str) -> bool:
    """Same major.minor version."""
    return saved.split(".")[:2] == current.split(".")[:2]


def _check_key(key: WorkloadKey) -> None:
    """The manifest's workload key must be well-formed before anything is sized from it."""
    from .core.ir import DTYPES, check_op

    check_op(key.op, key.reduce)
    for what in ("rows", "cols", "nnz", "K"):
        v = getattr(key, what)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > (1 << 48):
            raise ValueError(f"{what} must be a non-negative integer, got {v!r}")
    if key.K < 1:
        raise ValueError(f"K must be at least 1, got {key.K}")
    if key.nnz > key.rows * key.cols:
        raise ValueError(f"nnz={key.nnz} does not fit a {key.rows} x {key.cols} matrix")
    if key.dtype not in DTYPES or not isinstance(key.pattern, str):
        raise ValueError(f"dtype {key.dtype!r} / pattern {key.pattern!r} are not valid")


def _verified(path, workdir: str, A, require_signature, key):
    """Every check of :func:`load` that needs no kernel code: files, sizes, checksums, signature,
    versions, template, matrix, arrays.  Returns (manifest, key, config, template, arrays, paths, meta)."""
    manifest, paths = read_artifact(os.fspath(path), workdir, key=key, require_signature=require_signature)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {manifest.get('format_version')} is not supported "
                            f"(this spcompile reads version {FORMAT_VERSION})")
    if not _compatible(str(manifest.get("spcompile_version", "")), __version__):
        raise ArtifactError(f"artifact was written by spcompile {manifest.get('spcompile_version')}, "
                            f"incompatible with {__version__}; rebuild it")
    try:
        config = Config.from_dict(manifest["config"])
        wkey = WorkloadKey.from_dict(manifest["workload_key"])
        _check_key(wkey)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ArtifactError(f"artifact manifest is incomplete or malformed ({type(e).__name__}: {e})") from None
    if config.target == "cpu" and manifest.get("tvm_version") != tvm_version():
        raise ArtifactError(f"artifact's CPU kernel was built with TVM {manifest.get('tvm_version')}, "
                            f"this runtime has {tvm_version()}; rebuild it")
    # versions are checked first (their errors say more); everything else must be intact
    check_manifest_digest(manifest)
    try:
        tpl = get_template(config.template)
    except (ValueError, TypeError):
        raise ArtifactError(f"artifact uses template {config.template!r}, unknown to this spcompile") from None
    saved_tpl = manifest.get("template", {})
    if (not isinstance(saved_tpl, dict) or saved_tpl.get("version") != tpl.version
            or saved_tpl.get("source_hash") != tpl.source_hash()):
        raise ArtifactError(f"artifact was built by another version of template {tpl.name!r}; rebuild it")
    if tpl.target != config.target or (wkey.op, wkey.reduce) not in tpl.ops:
        raise ArtifactError(f"artifact's template {tpl.name!r} does not compute {wkey.op}/{wkey.reduce} "
                            f"on target {config.target!r}")
    meta = manifest.get("kernel_meta", {})
    if not isinstance(meta, dict) or not isinstance(config.params, dict):
        raise ArtifactError("artifact manifest is incomplete or malformed (kernel_meta / params)")
    if A is not None:
        C = as_csr(A)
        if C.shape != (wkey.rows, wkey.cols) or pattern_hash(C) != wkey.pattern:
            raise ArtifactError("artifact was built for a different matrix (sparsity pattern differs)")
        if values_hash(C) != manifest.get("values_hash"):
            raise ArtifactError("artifact was built for a different matrix (values differ)")
    arrays = read_arrays(paths.pop("arrays.npz"), manifest.get("arrays"))
    try:
        # structure of every array against the manifest, before any kernel sees it
        tpl.check_arrays(wkey, config.params, arrays, meta, manifest.get("values_hash"))
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ArtifactError(f"artifact arrays do not fit its manifest: {e}") from None
    return manifest, wkey, config, tpl, arrays, paths, meta


def describe(path: str, *, require_signature: bool | None = None, key=None) -> dict:
    """What a saved artifact holds (workload, config, pass log), after every check of
    :func:`load` but without loading its kernel library (nothing in it is executed)."""
    workdir = tempfile.mkdtemp(prefix="spcompile-info-")
    try:
        manifest, wkey, config, tpl, arrays, paths, meta = _verified(os.fspath(path), workdir, None,
                                                                     require_signature, key)
        return {"key": wkey, "config": config, "pass_log": manifest.get("pass_log", []),
                "signed": "signature" in manifest, "tuning": manifest.get("tuning")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def load(path: str, A=None, *, require_signature: bool | None = None, key=None) -> CompiledModule:
    """Load a saved module.  With ``A`` (any supported sparse input) the artifact must have been
    built for exactly that matrix (pattern and values), else :class:`ArtifactError`.

    Artifacts are code: load only artifacts from trusted sources.  ``key`` (default
    ``$SPCOMPILE_ARTIFACT_KEY``) verifies the artifact's signature when it has one;
    ``require_signature=True`` (default: ``$SPCOMPILE_ARTIFACT_REQUIRE_SIGNATURE=1``) refuses an
    artifact that is not signed with that key.  Every malformed artifact -- corrupt, resealed
    with arrays that do not fit its manifest, over the size limits, naming unknown kernels --
    raises :class:`ArtifactError` before any kernel code runs on its data."""
    workdir = tempfile.mkdtemp(prefix="spcompile-load-")
    try:
        manifest, wkey, config, tpl, arrays, paths, meta = _verified(os.fspath(path), workdir, A,
                                                                     require_signature, key)
        try:
            kernel = tpl.load(config.params, arrays, paths, meta)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, OSError) as e:
            raise ArtifactError(f"artifact's kernel cannot be loaded by template {tpl.name!r} "
                                f"({type(e).__name__}: {e})") from None
        mod = CompiledModule(wkey, config, kernel, manifest.get("pass_log", []), manifest.get("values_hash", ""),
                             manifest.get("tuning"))
        mod._tmpdir = workdir
        weakref.finalize(mod, shutil.rmtree, workdir, True)  # binaries stay while the module lives
        return mod
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
