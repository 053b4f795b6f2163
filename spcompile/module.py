""":class:`CompiledModule`: the callable result of :func:`spcompile.build`, and :func:`load`.

Saving writes the artifact files through :mod:`spcompile.artifact`; loading verifies every
checksum, the format and library versions and the template's version and source hash, and
(when the caller passes the matrix) that it is the same matrix.  Nothing in an artifact is
unpickled or executed except the kernel library its manifest names.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import weakref
from typing import Any, Mapping

import numpy as np

from ._version import __version__, tvm_version
from .artifact import FORMAT_VERSION, ArtifactError, check_manifest_digest, read_arrays, read_artifact, write_artifact
from .core.config import Config
from .core.formats import as_csr
from .core.ir import WorkloadKey, pattern_hash, values_hash
from .core.numerics import DTYPES
from .kernels import get_template
from .runtime import cuda as rt_cuda
from .runtime.arrays import ArrayAdapter, adapter_for

__all__ = ["CompiledModule", "load", "loads"]

#: the arrays.npz entry holding a module's value permutation (not one of the kernel's arrays)
_VALUES_SRC = "_module_values_src"


class CompiledModule:
    """A compiled sparse kernel for one matrix.

    ``mod(X)`` (SpMM) or ``mod(X, Y)`` (SDDMM) returns the result in the caller's row/column
    order; ``out=`` may pass a preallocated output.  ``config`` is the decision that built it;
    ``key`` the workload key; ``pass_log`` what the passes did and measured.  Inputs, ``out`` and
    the result are of the module's dtype (``key.dtype``)."""

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
        self.matrix = None       # the canonical CSR (set by build and by load(path, A))
        #: values_src[p]: the caller's stored entry whose value the kernel's value slot p holds
        #: (the passes' nonzero permutation); None: the identity
        self.values_src = None
        self._swapped = False    # the kernel holds call-time values (restored before a plain call)
        self._values_state: dict = {}

    # -- properties -----------------------------------------------------------------------
    op = property(lambda self: self.key.op)
    reduce = property(lambda self: self.key.reduce)
    K = property(lambda self: self.key.K)
    shape = property(lambda self: (self.key.rows, self.key.cols))
    target = property(lambda self: self.config.target)
    #: the element type of the matrix values the kernel reads (call-time ``values`` are cast to
    #: it): float32, float64 for a float64 module
    _value_dtype = property(lambda self: DTYPES[self.key.dtype].compute)

    def __repr__(self):
        return (f"CompiledModule(op={self.op!r}, reduce={self.reduce!r}, shape={self.shape}, "
                f"nnz={self.key.nnz}, K={self.K}, {self.config})")

    # -- calling ---------------------------------------------------------------------------
    @property
    def supports_call_values(self) -> bool:
        """Whether calls may pass new matrix values (``mod(X, values=v)``): the template reads
        the values from one array laid out like the matrix's stored entries.  Formats that bake
        the values into a packed layout (tiles, tensor-core fragments) say False."""
        return get_template(self.config.template).call_values_array is not None

    def __call__(self, *inputs, out=None, values=None):
        """Run the op.  ``values``: the matrix's values for this call, one per stored entry of
        the CSR it was built for, in that CSR's order (``spcompile.as_csr(A)``: row by row,
        columns sorted, duplicates summed); numpy / torch / CuPy, cast to the module's value type
        (float32; float64 for a float64 module); on the module's device.  Later calls without ``values`` use the built values again."""
        if values is not None or self._swapped:
            self._use_values(values)
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
            if a.name == "torch" and x.requires_grad and sys.modules["torch"].is_grad_enabled():
                raise RuntimeError(
                    f"{name} requires grad, but calling a compiled module directly is not differentiable "
                    f"(its output would silently carry no gradient): use spcompile.nn.spmm(mod, X) / "
                    f"spcompile.nn.sddmm(mod, X, Y) for autograd, or pass {name}.detach() / call under "
                    f"torch.no_grad()")
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

    # -- call-time values -----------------------------------------------------------------
    def _use_values(self, values) -> None:
        """Write ``values`` (None: the built values) into the kernel's value array, permuted like
        the kernel's stored entries.  CPU kernels read the host array in place; CUDA kernels read
        their device copy, written on the caller's current stream (ordered before the launch)."""
        st = self._values_state
        name = get_template(self.config.template).call_values_array
        if name is None:
            raise ValueError(
                f"template {self.config.template!r} bakes the matrix values into its packed format, so this "
                f"module cannot take values at call time; build one for the new values, or build with a "
                f"template that supports them (e.g. template='cpu.csr_spmm' / 'csr.crc_cwm')")
        nnz = self.key.nnz
        if values is None:            # back to the built values
            values, self._swapped = None, False
            st["last"] = None
        else:
            last = st.get("last")
            # the same torch tensor, unmodified since it was written (its version counter counts
            # in-place changes): the kernel holds these values already
            if last is not None and last[0] is values and last[1] == values._version:
                return
            a = adapter_for(values)
            if a is None:
                raise TypeError(f"values must be a numpy array, torch tensor or cupy array, got {type(values).__name__}")
            if tuple(values.shape) != (nnz,):
                raise ValueError(f"values has shape {tuple(values.shape)}, expected ({nnz},): one value per stored "
                                 f"entry of the matrix the module was built for")
            if a.dtype(values) not in ("float32", "float64", "float16", "bfloat16"):
                raise TypeError(f"values must be floating point, got {a.dtype(values)}")
            self._swapped = True
        # remembered only once written: a call that fails below never leaves a stale "written"
        st["last"] = None
        if nnz != 0:
            if self.config.target == "cpu":
                self._use_host_values(name, values, st)
                self.kernel.values_written()
            else:
                self._use_device_values(name, values, self.values_src, st)
        if values is not None and a.name == "torch":
            st["last"] = (values, values._version)

    def _use_host_values(self, name, values, st) -> None:
        buf = self.kernel.arrays[name]      # the kernel reads this array in place (zero-copy)
        if "baked" not in st:
            st["baked"] = buf.copy()
        if values is None:
            np.copyto(buf, st["baked"])
            return
        a, vt = adapter_for(values), self._value_dtype
        if a.name == "torch" and values.device.type == "cpu":
            v = values.detach().to(getattr(sys.modules["torch"], vt)).numpy()
        elif a.name == "numpy":
            v = np.asarray(values, dtype=vt)
        else:
            raise ValueError("values must be on the host for a target='cpu' module")
        if self.values_src is None:
            np.copyto(buf, v)
        else:
            np.take(v, self.values_src, out=buf)

    def _use_device_values(self, name, values, src, st) -> None:
        kernel = self.kernel
        if not kernel._ready:
            kernel.prepare()
        dev = getattr(kernel, "_dev", {}).get(name)
        if dev is None:
            raise ValueError(f"template {self.config.template!r} keeps no device copy of {name!r}: call-time "
                             f"values are not supported by this module")
        a = None if values is None else adapter_for(values)
        if values is None and st.get("torch_buf") is not None:
            # torch wrote the device copy: restore on torch's stream too (ordered after its launches)
            st["torch_buf"].copy_(st["torch_baked"])
            return
        if values is None or a.name != "torch":
            host = self.kernel.arrays[name]
            if values is None:
                dev.set(host)
                return
            if a.name == "numpy":
                v = np.asarray(values, dtype=self._value_dtype)
                dev.set(v if src is None else np.take(v, src))
                return
            cupy = sys.modules["cupy"]
            v = values.astype(self._value_dtype, copy=False)
            with cupy.cuda.Device(kernel.device_id):
                view = cupy.asarray(dev)      # the kernel's device copy, viewed (no copy)
                view[...] = v if src is None else cupy.take(v, cupy.asarray(src))
            return
        torch = sys.modules["torch"]
        if values.device.type != "cuda" or values.device.index != kernel.device_id:
            raise ValueError(f"values must be on cuda:{kernel.device_id} (the module's device), got {values.device}")
        if st.get("torch_buf") is None:
            st["torch_buf"] = torch.as_tensor(dev, device=values.device)   # a view of the device copy
            st["torch_src"] = None if src is None else torch.from_numpy(np.asarray(src, np.int64)).to(values.device)
            st["torch_baked"] = torch.from_numpy(self.kernel.arrays[name]).to(values.device)
        v = values.detach().to(getattr(torch, self._value_dtype))
        if st["torch_src"] is None:
            st["torch_buf"].copy_(v)
        else:
            torch.index_select(v, 0, st["torch_src"], out=st["torch_buf"])

    # -- pickling ----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The artifact (:meth:`save`) as bytes, for :func:`loads`."""
        with tempfile.TemporaryDirectory(prefix="spcompile-bytes-") as d:
            p = self.save(os.path.join(d, "module.spc"))
            with open(p, "rb") as f:
                return f.read()

    def __reduce__(self):
        # pickled through the artifact: the binaries and arrays, checked again on unpickling
        m = self.matrix
        mat = None if m is None else (m.indptr, m.indices, m.data, tuple(m.shape))
        return (_unpickle, (self.to_bytes(), mat))

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
        if self._swapped:
            self._use_values(None)   # the artifact holds the built values
        arrays = dict(self.kernel.arrays)
        if self.values_src is not None:
            arrays[_VALUES_SRC] = np.asarray(self.values_src)
        return write_artifact(path, self._manifest(), arrays, self.kernel.artifact_files(), as_dir=as_dir,
                              sign_key=sign_key)

    @classmethod
    def load(cls, path: str, A=None, *, require_signature: bool | None = None, key=None,
             warm_up: bool | int = False) -> "CompiledModule":
        return load(path, A, require_signature=require_signature, key=key, warm_up=warm_up)


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


def _matrix_of(key: WorkloadKey, A):
    """``A`` canonical, its values in the workload's arithmetic type (as the module was built)."""
    return as_csr(A, DTYPES[key.dtype].compute)


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
    if not isinstance(manifest.get("pass_log", []), list) or not isinstance(manifest.get("tuning") or {}, dict):
        raise ArtifactError("artifact manifest is incomplete or malformed (pass_log must be a list, tuning a dict)")
    if wkey.dtype not in tpl.dtypes:
        raise ArtifactError(f"artifact's template {tpl.name!r} does not compute dtype {wkey.dtype!r} "
                            f"(it supports {list(tpl.dtypes)})")
    if A is not None:
        C = _matrix_of(wkey, A)
        if C.shape != (wkey.rows, wkey.cols) or pattern_hash(C) != wkey.pattern:
            raise ArtifactError("artifact was built for a different matrix (sparsity pattern differs)")
        if values_hash(C) != manifest.get("values_hash"):
            raise ArtifactError("artifact was built for a different matrix (values differ)")
    arrays = read_arrays(paths.pop("arrays.npz"), manifest.get("arrays"))
    values_src = arrays.pop(_VALUES_SRC, None)
    try:
        # structure of every array against the manifest, before any kernel sees it
        tpl.check_arrays(wkey, config.params, arrays, meta, manifest.get("values_hash"))
        if values_src is not None:   # call-time values' order: a permutation of the stored entries
            vs = np.asarray(values_src)
            if vs.dtype.kind not in "iu" or vs.shape != (wkey.nnz,) or (
                    wkey.nnz and not np.array_equal(np.bincount(vs, minlength=wkey.nnz), np.ones(wkey.nnz, np.int64))):
                raise ValueError(f"{_VALUES_SRC} is not a permutation of the {wkey.nnz} stored entries")
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ArtifactError(f"artifact arrays do not fit its manifest: {e}") from None
    if values_src is not None:
        arrays[_VALUES_SRC] = values_src
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


def load(path: str, A=None, *, require_signature: bool | None = None, key=None,
         warm_up: bool | int = False) -> CompiledModule:
    """Load a saved module.  With ``A`` (any supported sparse input) the artifact must have been
    built for exactly that matrix (pattern and values), else :class:`ArtifactError`.

    ``warm_up`` (a CUDA module; True for device 0, or a device index): start creating the CUDA
    context in a background thread while the artifact is read and checked, so that the first
    call does not wait for all of it (the context costs about 0.4 s on an H100).  Off by
    default: a process that loads modules and then forks workers must not hold a CUDA context
    when it forks.

    Artifacts are code: load only artifacts from trusted sources.  ``key`` (default
    ``$SPCOMPILE_ARTIFACT_KEY``) verifies the artifact's signature when it has one;
    ``require_signature=True`` (default: ``$SPCOMPILE_ARTIFACT_REQUIRE_SIGNATURE=1``) refuses an
    artifact that is not signed with that key.  Every malformed artifact -- corrupt, resealed
    with arrays that do not fit its manifest, over the size limits, naming unknown kernels --
    raises :class:`ArtifactError` before any kernel code runs on its data."""
    if warm_up is not False:
        if not (warm_up is True or (type(warm_up) is int and warm_up >= 0)):
            raise TypeError(f"warm_up must be a bool or a CUDA device index, got {warm_up!r}")
        from .runtime import driver

        driver.warm_up(0 if warm_up is True else warm_up)
    workdir = tempfile.mkdtemp(prefix="spcompile-load-")
    try:
        manifest, wkey, config, tpl, arrays, paths, meta = _verified(os.fspath(path), workdir, A,
                                                                     require_signature, key)
        try:
            values_src = arrays.pop(_VALUES_SRC, None)
            kernel = tpl.load(config.params, arrays, paths, meta)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, OSError) as e:
            raise ArtifactError(f"artifact's kernel cannot be loaded by template {tpl.name!r} "
                                f"({type(e).__name__}: {e})") from None
        mod = CompiledModule(wkey, config, kernel, manifest.get("pass_log", []), manifest.get("values_hash", ""),
                             manifest.get("tuning"))
        mod.values_src = values_src
        if A is not None:
            mod.matrix = _matrix_of(wkey, A)
        mod._tmpdir = workdir
        weakref.finalize(mod, shutil.rmtree, workdir, True)  # binaries stay while the module lives
        return mod
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


def loads(data: bytes, A=None) -> CompiledModule:
    """A module from the bytes of :meth:`CompiledModule.to_bytes` (checked like :func:`load`)."""
    fd, path = tempfile.mkstemp(prefix="spcompile-", suffix=".spc")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return load(path, A)
    finally:
        os.remove(path)


def _unpickle(data: bytes, mat) -> CompiledModule:
    mod = loads(data)
    if mat is not None:
        mod.matrix = _matrix_of(mod.key, mat)
    return mod
