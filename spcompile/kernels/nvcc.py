"""The nvcc template base: what every CUDA C++ template family shares.

A family is one folder under ``spcompile/kernels/`` holding its ``.cu`` source, ``template.py``
(an :class:`NvccTemplate` and an :class:`NvccKernel` subclass), ``packer.py`` (the host arrays
its kernels read) and ``emulate.py`` (a numpy emulation of the kernels over those arrays, for
tests on machines without a GPU), plus one line in :mod:`spcompile.kernels.builtin`.

The base owns the skeleton: parameters checked (defaults filled in, unknown names refused, each
value checked against :meth:`NvccTemplate.checks`), arrays packed, the instances rendered (the
source plus one ``extern "C"`` wrapper per instance, with an unaligned ``VEC = 1`` variant where
the family has one) and compiled (cached on disk), the meta recorded, the kernel made; loading a
kernel from an artifact; rebuilding a binary made for another GPU generation; uploading the
arrays once; binding every launch argument by the parameter names of the rendered signature
(:class:`~spcompile.runtime.cuda.LaunchPlan`); choosing the aligned or the fallback launch per
call.  A call may be several launches in stream order (helper kernels the source defines, named in
``entry_points``: zeroing, finishing), bound the same way into a
:class:`~spcompile.runtime.cuda.LaunchSequence`.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..core.ir import SparseModule
from ..core.numerics import DTYPES
from ..runtime import cuda as rt
from ..runtime.driver import DeviceArray
from .base import ENTRY_SRC, Template, source_hash_of

__all__ = ["NvccTemplate", "NvccKernel", "LaunchSpec", "LaunchSequence", "AtLeast", "_NvccTemplate", "_NvccKernel"]


@dataclass(frozen=True)
class AtLeast:
    """Allowed values of an integer parameter: every integer >= ``low``."""

    low: int

    def __contains__(self, v) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= self.low

    def __str__(self) -> str:
        return f"an integer >= {self.low}"


@dataclass(frozen=True)
class LaunchSpec:
    """Grid, block, dynamic shared memory and the scalar arguments (by parameter name) of one
    launch; the matrix arrays and workspaces are bound by their names.  ``entry``: the entry point
    launched is the instance's name plus this suffix (for an instance macro that defines several
    kernels, e.g. ``"_rows"`` / ``"_tiles"``; "" for the one named like the instance)."""

    grid: tuple
    block: tuple
    smem: int = 0
    args: Mapping[str, Any] = field(default_factory=dict)
    #: the kernel launched: None (or "") = the instance's own entry point; a name starting with
    #: "_" = that suffix of the instance's entry name (an instance macro defining several kernels,
    #: e.g. "_rows" and "_tiles"); any other name = one of the template's ``entry_points`` (a helper
    #: kernel such as a zeroing or finishing kernel)
    entry: str | None = None
    #: ``{parameter: name}`` for parameters that receive an array, workspace or per-call pointer
    #: of another name (a helper kernel's ``rows`` receiving the array ``zero_rows``)
    bind: Mapping[str, str] = field(default_factory=dict)


#: the launches of one call (re-exported: families and tests name it here)
LaunchSequence = rt.LaunchSequence


# ------------------------------------------------------------------------------------------
class NvccTemplate(Template):
    """Base of the nvcc-compiled templates.  A family sets ``name``, ``version``, ``ops``,
    ``dtypes``, ``source_file`` (its ``.cu``), ``instance_macro`` (the macro of the source that
    defines one ``extern "C"`` entry point), ``kernel_class`` and ``fallback_param``, and defines
    :meth:`space` / :meth:`default_params` (as every template), :meth:`checks`, :meth:`pack`,
    :meth:`instance_args` and :meth:`instance`."""

    target = "cuda"
    source_file = ""
    instance_macro = ""
    #: headers in this folder that ``source_file`` includes (``#include "name"``): inlined by
    #: :meth:`source_text` (nvcc compiles a copy in a temporary folder) and part of the hash
    headers: tuple = ()
    #: the :class:`NvccKernel` subclass built and loaded
    kernel_class: type | None = None
    #: the compile-time argument of :meth:`instance` that is the vector width: the build adds the
    #: same instance with width 1, launched when a per-call pointer is not aligned to the vector
    #: (None: the family has no such fallback)
    fallback_param: str | None = None
    #: the oldest GPU generation the kernels run on (compute capability as an int, 0: any)
    min_arch: int = 0
    #: ``extern "C"`` kernels that ``source_file`` defines itself, besides the instances of
    #: ``instance_macro`` (helper kernels: zeroing, finishing), launched by :attr:`LaunchSpec.entry`
    entry_points: tuple[str, ...] = ()

    # -- what a family defines ---------------------------------------------------------------
    def checks(self, mod: SparseModule) -> dict:
        """Allowed values of each parameter: ``{name: collection or AtLeast(n)}``."""
        return {}

    def pack(self, mod: SparseModule, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The host arrays the kernels read, named as their parameters (the family's packer)."""
        raise NotImplementedError

    def instance_args(self, mod: SparseModule, params: Mapping[str, Any]) -> dict:
        """The keyword arguments of :meth:`instance` for a checked parameter set."""
        raise NotImplementedError

    def instance(self, **args) -> tuple[str, tuple]:
        """``(entry point name, template arguments of instance_macro)`` of one instance."""
        raise NotImplementedError

    def extra_meta(self, mod: SparseModule, params: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict:
        """Family-specific values the kernel needs at load time besides the common ones."""
        return {}

    def kernel_class_for(self, meta: Mapping[str, Any]) -> type:
        """The :class:`NvccKernel` subclass of a kernel with ``meta`` (default: ``kernel_class``;
        a family with one kernel class per scheme picks it from the meta)."""
        return self.kernel_class

    # -- skeleton ----------------------------------------------------------------------------
    tools = ("nvcc",)

    def available(self) -> bool:
        return rt.nvcc_available()

    def supports(self, mod: SparseModule) -> bool:
        A = mod.A
        ok_size = max(A.nnz, A.shape[0] + 1, A.shape[1]) < 2**31 - 1
        return super().supports(mod) and ok_size

    #: named choices (strings) are the family's to check (:meth:`checks`, :meth:`check_params`)
    strict_choices = False

    def check_values(self, mod, full, given):
        # the bounds every template shares; where they object, the family's own checks speak
        # first (they name every bad parameter at once)
        try:
            super().check_values(mod, full, given)
        except ValueError:
            self.validate(mod, full)
            raise

    def validate(self, mod: SparseModule, params: Mapping[str, Any]) -> None:
        """ValueError naming every parameter whose value :meth:`checks` does not allow, or an
        input dtype the template does not compute for."""
        if mod.op.dtype not in self.dtypes:
            raise ValueError(f"{self.name} supports dtypes {list(self.dtypes)}, not {mod.op.dtype!r}")
        bad = [f"{k}={params[k]!r} (must be {allowed if isinstance(allowed, AtLeast) else 'one of ' + str(list(allowed))})"
               for k, allowed in self.checks(mod).items() if k in params and params[k] not in allowed]
        if bad:
            raise ValueError(f"invalid {self.name} parameters for {mod.op.dtype} inputs: {', '.join(bad)}")

    def instances(self, *args, **kwargs) -> list[tuple[str, tuple]]:
        """The instance of :meth:`instance`'s arguments, then (where the family has one and the
        vector width is above 1) its ``VEC = 1`` alignment fallback."""
        bound = inspect.signature(self.instance).bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        out = [self.instance(**a)]
        if self.fallback_param is not None and int(a[self.fallback_param]) > 1:
            out.append(self.instance(**{**a, self.fallback_param: 1}))
        return out

    def build(self, mod: SparseModule, params: Mapping[str, Any], *, compile: bool = True):
        """The kernel of ``params`` on ``mod``.  ``compile=False`` leaves out the binary (for
        inspecting the arrays and launches on machines without nvcc; such a kernel cannot run)."""
        params = self.check_params(mod, params)
        self.validate(mod, params)
        arch = rt.device_arch()
        if arch < self.min_arch:
            raise ValueError(f"{self.name} needs sm_{self.min_arch} or newer, this GPU is sm_{arch}")
        arrays = self.pack(mod, params)
        entry_src = arrays.pop(ENTRY_SRC, None)
        args = self.instance_args(mod, params)
        inst = self.instances(**args)
        meta = {"K": mod.op.K, "m": mod.A.shape[0], "dtype": mod.op.dtype, "arch": arch,
                **({"vec": int(args[self.fallback_param])} if self.fallback_param else {}),
                **self.extra_meta(mod, params, arrays), "instances": [[n, list(a)] for n, a in inst]}
        files = {"kernel.fatbin": self.compile(inst, arch=arch, name=inst[0][0])} if compile else {}
        kernel = self.kernel_class_for(meta)(self.name, params, arrays, files, meta, self)
        kernel.entry_src = entry_src
        return kernel

    def load(self, params, arrays, files, meta):
        return self.kernel_class_for(meta)(self.name, params, arrays, files, meta, self)

    # -- source ------------------------------------------------------------------------------
    def source_dir(self) -> str:
        """The folder of the template's family (its .cu / .cuh files sit beside its module)."""
        return os.path.dirname(os.path.abspath(inspect.getfile(type(self))))

    def _source(self, fname: str) -> str:
        with open(os.path.join(self.source_dir(), fname)) as f:
            return f.read()

    def source_hash(self) -> str:
        """Hash of the template module, its sources and its packer (the arrays' layout)."""
        d = self.source_dir()
        files = [self.source_file, *self.headers]
        if os.path.isfile(os.path.join(d, "packer.py")):
            files.append("packer.py")
        return source_hash_of(type(self), self.version, paths=tuple(os.path.join(d, f) for f in files))

    def source_text(self) -> str:
        """``source_file`` with its local headers inlined."""
        src = self._source(self.source_file)
        for h in self.headers:
            src = src.replace(f'#include "{h}"', self._source(h))
        return src

    def render(self, instances: list[tuple[str, tuple]]) -> str:
        """The template source plus one extern "C" wrapper per ``(name, template args)``."""
        lines = [self.source_text(), ""]
        lines += [f"{self.instance_macro_of(n)}({n}, {', '.join(str(int(a)) for a in args)})" for n, args in instances]
        return "\n".join(lines) + "\n"

    def instance_macro_of(self, name: str) -> str:
        """The macro that defines instance ``name``: ``instance_macro``, unless the family's source
        has several entry-point macros (it then picks one by the instance's name)."""
        return self.instance_macro

    def compile(self, instances, arch: int | None = None, name: str = "") -> str:
        return rt.compile_cuda(self.render(instances), arch=arch, name=name or self.name.replace(".", "_"))


class NvccKernel(rt.CUDAKernel):
    """A kernel of an :class:`NvccTemplate`: its binary, host arrays and meta.  A family names
    the entry point's per-call pointer parameters (``inputs``, ``output``) and defines
    :meth:`launch_spec` (and :meth:`workspaces` when its kernels need device scratch memory);
    the base does the rest."""

    #: the entry point's parameters that receive the call's inputs (in order) and output
    inputs: tuple[str, ...] = ("X",)
    output: str = "Y"
    #: the per-call pointers the vector instance needs aligned to its width (default: all)
    aligned: tuple[str, ...] | None = None

    #: set by the build when the packer moved the stored entries (:data:`~spcompile.kernels.base.ENTRY_SRC`)
    entry_src: np.ndarray | None = None

    def __init__(self, template, params, arrays, files, meta, tpl):
        super().__init__(template, params, arrays, files, meta)
        self._tpl = tpl

    # -- what a family defines ---------------------------------------------------------------
    def launch_spec(self, vec: int) -> LaunchSpec | Sequence[LaunchSpec]:
        """Grid, block, shared memory and scalar arguments of the instance of width ``vec``; or
        the launches of one call in stream order (each naming its kernel by ``entry``), bound into
        a :class:`~spcompile.runtime.cuda.LaunchSequence`."""
        raise NotImplementedError

    def workspaces(self) -> dict[str, tuple[int, Any]]:
        """Device scratch arrays bound by name: ``{name: (elements, dtype)}``, zero-filled once."""
        return {}

    def empty(self) -> bool:
        """True when a call has nothing to do (no launch)."""
        return False

    # -- skeleton ----------------------------------------------------------------------------
    def launch_specs(self, vec: int) -> tuple[LaunchSpec, ...]:
        """:meth:`launch_spec` as a tuple of launches."""
        s = self.launch_spec(vec)
        return (s,) if isinstance(s, LaunchSpec) else tuple(s)

    def instance_vecs(self) -> list[int]:
        """The vector width of each instance of ``meta["instances"]`` (main, then fallback)."""
        v = int(self.meta.get("vec", 1))
        return [v if i == 0 else 1 for i in range(len(self.meta["instances"]))]

    def _binary(self, device: int) -> str:
        """The fatbin for ``device``: the built one, or the same instances compiled here for that
        GPU's generation (an artifact made for another one; needs nvcc)."""
        if "kernel.fatbin" not in self.files:
            raise RuntimeError(f"{self.template} kernel was built without its binary (compile=False)")
        inst = [(n, tuple(a)) for n, a in self.meta["instances"]]
        path, arch = rt.binary_for_device(self.files["kernel.fatbin"], int(self.meta["arch"]), device,
                                          lambda arch: self._tpl.compile(inst, arch=arch, name=inst[0][0]))
        if arch != int(self.meta["arch"]):
            self.files = {**self.files, "kernel.fatbin": path}
            self.meta = {**self.meta, "arch": arch}
        return path

    def _load_module(self):
        self.device_id = rt.current_device()
        return rt.load_module(self._binary(self.device_id), self.device_id)

    def _upload(self, names):
        # keep every uploaded array referenced by the kernel: the launch passes raw pointers
        dev = self.__dict__.setdefault("_dev", {})
        for k in names:
            dev[k] = DeviceArray.from_host(self.arrays[k], self.device_id)
        return tuple(dev[k].ptr for k in names)

    def _device_arguments(self) -> dict[str, int]:
        """Every array uploaded and every workspace allocated once: name -> device pointer."""
        ptrs = dict(zip(self.arrays, self._upload(tuple(self.arrays))))
        for k, (n, dt) in self.workspaces().items():
            self._dev[k] = DeviceArray.zeros(max(1, int(n)), dt, self.device_id)
            ptrs[k] = self._dev[k].ptr
        return ptrs

    def make_plans(self, functions, device: Mapping[str, int]) -> list:
        """Per instance its launch: a :class:`LaunchPlan` (a :class:`LaunchSequence` of them when
        :meth:`launch_spec` gives several), each binding by name the ``device`` pointers its entry
        point takes (arrays a launch does not take are left out), the spec's scalars (every one a
        parameter of the entry point) and the inputs and output per call.  ``functions``: per
        instance its function or ``{kernel name: function}``; None (no GPU) builds the plans
        without functions."""
        inst = [(n, tuple(a)) for n, a in self.meta["instances"]]
        src = self._tpl.render(inst)
        fns = functions if functions is not None else [None] * len(inst)
        plans = []
        for (name, _), fn, vec in zip(inst, fns, self.instance_vecs()):
            plans.append(self._sequence(self.launch_specs(vec), fn, name, src, device))
        return plans

    def entry_name(self, instance: str, entry: str | None) -> str:
        """The kernel a launch of ``instance`` with :attr:`LaunchSpec.entry` ``entry`` runs."""
        if not entry:
            return instance
        if entry.startswith("_"):
            return instance + entry
        if entry not in self._tpl.entry_points:
            raise ValueError(f"{self.template}: launch of {entry!r}, not one of the template's entry points "
                             f"{list(self._tpl.entry_points)}")
        return entry

    def _sequence(self, specs, fn, name: str, source: str, device: Mapping[str, int]):
        """The launches ``specs`` of instance ``name``: one :class:`LaunchPlan` when it is the
        instance's kernel alone, else a :class:`LaunchSequence`.  Each kernel's parameters are bound
        by name (through ``spec.bind`` where named otherwise): the call's inputs and output in their
        slots, the spec's scalars, the arrays / workspaces it reads (``device`` holds every one; a
        kernel takes those it names).  ``fn``: the instance's function, or ``{kernel name:
        function}``; None builds the plans without functions (no GPU needed)."""
        per_call = (*self.inputs, self.output)
        plans, slots = [], []
        for s in specs:
            kname = self.entry_name(name, s.entry)
            sig = rt.kernel_signature(source, kname)
            stray = sorted(set(s.bind) - set(sig.names))
            if stray:
                raise ValueError(f"kernel {sig.name}: bind names unknown parameters {stray}")
            bound, pc, idx = dict(s.args), [], []
            for p in sig.names:
                src = s.bind.get(p, p)
                if src in per_call:
                    pc.append(p)
                    idx.append(per_call.index(src))
                elif p not in bound and src in device:
                    bound[p] = device[src]
            f = fn.get(kname) if isinstance(fn, Mapping) else (fn if kname == name else None)
            if f is not None:
                rt.ensure_dynamic_smem(f, s.smem)
            plans.append(rt.LaunchPlan(f, sig, s.grid, s.block, s.smem, bound=bound, per_call=pc))
            slots.append(tuple(idx))
        if len(plans) == 1 and slots[0] == tuple(range(len(per_call))):
            return plans[0]
        return rt.LaunchSequence(plans, slots)

    def _entry_functions(self) -> list[dict]:
        """Per instance the kernels its launches run: ``{kernel name: function}``."""
        mod = self._load_module()
        out = []
        for (n, _), v in zip(self.meta["instances"], self.instance_vecs()):
            names = [self.entry_name(n, s.entry) for s in self.launch_specs(v)]
            out.append({k: mod.get_function(k) for k in dict.fromkeys(names)})
        return out

    def prepare(self):
        self.use_plans(self.make_plans(self._entry_functions(), self._device_arguments()))

    def use_plans(self, plans: list) -> None:
        """Launch through ``plans`` (the main instance's, then the fallback's) from now on."""
        per_call = (*self.inputs, self.output)
        self._plans = (plans[0], plans[-1])
        self._aligned_idx = tuple(per_call.index(n) for n in (self.aligned or per_call))
        vec = int(self.meta.get("vec", 1))
        self._amask = DTYPES[self.meta.get("dtype", "float32")].bytes * vec - 1 if len(plans) > 1 else 0
        self._empty = self.empty()
        self._ready = True

    def launch(self, in_ptrs, out_ptr, stream):
        if self._empty:
            return
        ptrs = (*in_ptrs, out_ptr)
        bits = 0
        for i in self._aligned_idx:
            bits |= ptrs[i]
        self._plans[1 if bits & self._amask else 0](ptrs, stream)


# the names the tc / sptc / aspt families subclass
_NvccTemplate = NvccTemplate
_NvccKernel = NvccKernel
