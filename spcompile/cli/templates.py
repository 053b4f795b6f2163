"""``spcompile templates``: the kernel templates, whether they can be built and run on this
machine, and (``--params``) their tunable parameters.

The listing is quick: it looks for each template's toolchain (a TVM with its compiler library,
nvcc, torch) without importing any of them, and for a usable GPU.  ``--check`` asks every
template itself (:meth:`Template.available`), which imports TVM and takes seconds.
"""
from __future__ import annotations

import functools
import importlib.util
import os

#: toolchains of the shipped templates whose modules are hashed into their tuning records (an
#: attribute there would change the hash and invalidate every stored record and artifact)
_BUILTIN_TOOLS = {"spcompile.kernels.tvm.cpu_csr": ("tvm-llvm",),
                  "spcompile.kernels.tvm.cuda_csr": ("nvcc", "tvm-cuda"),
                  "spcompile.kernels.cusparse": ("torch",)}


@functools.lru_cache(maxsize=None)
def _tvm_compiler_library() -> str | None:
    """Path of TVM's compiler library when TVM is installed with it (a runtime-only TVM, as on
    a serving machine, has none), found without importing TVM."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
    for name in ("libtvm_compiler.so", "libtvm_compiler.dylib", "tvm_compiler.dll", "libtvm.so"):
        if os.path.isfile(os.path.join(lib, name)):
            return os.path.join(lib, name)
    return None


def tool_status(tool: str) -> tuple[bool, str]:
    """(present, what was found or what is missing) for one toolchain name, without importing it."""
    from ..runtime.cuda import nvcc_path

    if tool in ("tvm-llvm", "tvm-cuda"):
        lib = _tvm_compiler_library()
        return (lib is not None, "TVM compiler" if lib else "no TVM compiler (pip install apache-tvm)")
    if tool == "nvcc":
        p = nvcc_path()
        return (p is not None, f"nvcc {p}" if p else "no nvcc")
    if tool == "torch":
        ok = importlib.util.find_spec("torch") is not None
        return ok, "torch" if ok else "no torch (pip install torch)"
    return False, f"unknown tool {tool!r}"


def template_tools(t) -> tuple[str, ...] | None:
    tools = getattr(t, "tools", None)
    if tools is not None:
        return tuple(tools)
    return _BUILTIN_TOOLS.get(type(t).__module__)


def buildable(t, check: bool) -> tuple[bool, str]:
    """Whether template ``t`` can be built here and, when not, why."""
    tools = template_tools(t)
    if check or tools is None:
        ok = bool(t.available())
        return ok, "" if ok else "toolchain missing (see the template's documentation)"
    missing = [why for ok, why in map(tool_status, tools) if not ok]
    return not missing, "; ".join(missing)


def example_module(t, K: int = 64):
    """A small random matrix prepared for ``t`` (its first op, its first pipeline), on which its
    parameters and their defaults are shown."""
    import numpy as np
    import scipy.sparse as sp

    from ..compile import make_op
    from ..core.ir import SparseModule
    from ..passes import Pipeline

    op, reduce = t.ops[0]
    A = sp.random(256, 256, density=0.05, format="csr", dtype=np.float32, random_state=0)
    mod = SparseModule.from_op(make_op(A, op, K, reduce, t.dtypes[0]))
    pipelines = t.pipelines(mod)
    return Pipeline(pipelines[0])(mod) if pipelines else mod


def template_params(t, K: int = 64) -> dict:
    """``{name: {"values": [...] or a description, "default": value}}`` of template ``t``, shown
    for a 256 x 256 random matrix at width K (some choices and defaults depend on the matrix)."""
    mod = example_module(t, K)
    space, defaults = t.space(mod), t.default_params(mod)
    out = {}
    for name in [*defaults, *(k for k in space if k not in defaults)]:
        dist = space.get(name)
        if dist is None:
            values = "fixed"
        elif hasattr(dist, "choices"):
            values = list(dist.choices)
        elif hasattr(dist, "low"):
            values = f"{dist.low}..{dist.high}"
        else:
            values = repr(dist)
        out[name] = {"values": values, "default": defaults.get(name)}
    return out


def runnable(t, gpu: bool) -> tuple[bool, str]:
    """Whether saved modules of template ``t`` can run here (no compiler needed: a CPU module
    needs TVM's runtime, a CUDA module a usable GPU, cuSPARSE modules torch too) and, when not, why."""
    tools = template_tools(t)
    if t.target == "cpu":
        if tools is None or not any(x.startswith("tvm") for x in tools):  # not a TVM kernel: runs where it builds
            return buildable(t, check=False)
        ok = importlib.util.find_spec("tvm") is not None
        return ok, "" if ok else "no TVM runtime"
    if not gpu:
        return False, "no GPU"
    if "torch" in (tools or ()) and importlib.util.find_spec("torch") is None:
        return False, "no torch"
    return True, ""


def cmd_templates(args) -> int:
    from ..kernels import list_templates
    from ..runtime import cuda_available

    gpu = cuda_available()
    for t in list_templates(args.target):
        ops = ", ".join(o + ("/" + r if r else "") for o, r in t.ops)
        ok, why = buildable(t, args.check)
        run, why_not_run = runnable(t, gpu)
        if ok and run:
            state = "available"
        elif ok:
            state = f"build only: {why_not_run}"
        elif run:
            state = f"run only: {why}"
        else:
            state = f"unavailable: {why}" + (f"; {why_not_run}" if why_not_run and why_not_run not in why else "")
        print(f"{t.name:22s} target={t.target:5s} build={'yes' if ok else 'no':3s} "
              f"run={'yes' if run else 'no':3s} {state:24s} "
              f"dtypes={','.join(t.dtypes)} ops: {ops}")
        if args.params:
            params = template_params(t, args.K)
            if not params:
                print(f"{'':4s}(no parameters)")
            for name, p in params.items():
                print(f"{'':4s}{name:18s} default {p['default']!r:10s} values {p['values']}")
    if args.target in (None, "cuda") and not gpu:
        print("(no usable CUDA GPU here: CUDA modules can be built and saved, and run where a GPU is)")
    if args.params:
        print(f"(parameters and defaults shown for a 256 x 256 random matrix at K={args.K}; some depend on "
              "the matrix. Force them with build(..., template=NAME, params={...}) or "
              "spcompile build --template NAME --params JSON)")
    elif not args.check:
        print("(toolchains found without loading them; --check asks each template, --params lists parameters)")
    return 0


def add_command(sub) -> None:
    t = sub.add_parser("templates", help="list kernel templates, their availability here and (--params) "
                                         "their parameters")
    t.add_argument("--target", default=None, choices=["cpu", "cuda"])
    t.add_argument("--params", action="store_true", help="also list each template's parameters and defaults")
    t.add_argument("-K", type=int, default=64, help="--params: the width the defaults are shown for")
    t.add_argument("--check", action="store_true",
                   help="ask each template whether it can be built (loads TVM: seconds)")
    t.set_defaults(func=cmd_templates)
