"""LaunchPlan and kernel signatures (CPU): the parameter names and C types of an entry point are
read from CUDA source (plain definitions, instance macros with token pasting, nested macros,
comments); arguments are bound by name into a ctypes buffer of the right types (read back from
the buffer's addresses, as the driver reads it); unknown / missing / doubly bound names, wrong
value kinds and out-of-range values are errors at bind time; a call writes only its pointer
slots; the CuPy fallback gets the same arguments, typed; the positional ``Launch`` keeps its
old typing; the "built for another arch" decision."""
import ctypes

import numpy as np
import pytest

from spcompile.runtime import cuda as rt

SRC = r'''
#include <cuda_runtime.h>
// a comment with a fake entry: extern "C" __global__ void ghost(int a) {}
/* and a block comment: extern "C" __global__ void ghost2(int a) {} */
extern "C" __global__ void __launch_bounds__(256, 2) plain(const float* __restrict__ x, int n,
                                                            unsigned flags, long long big, float alpha,
                                                            double beta, size_t count, float* y) {}
#define ELEM_0 float
#define ELEM_1 __half
#define ELEM(T) ELEM_##T
#define INST(NAME, T, V)                                                       \
  extern "C" __global__ void NAME(const int* rows, const ELEM(T)* X,           \
                                  ELEM(T)* Y, int n, int K) {}                 \
  extern "C" __global__ void NAME##_aux(const int* rows, int n) {}
#define AUX(SUFFIX, E) extern "C" __global__ void helper##SUFFIX(float* S, int n) {}
#define CAT(a, b) a##b
#define DISPATCH_0(NAME, V) extern "C" __global__ void NAME##_zero(int* p, int v) {}
#define DISPATCH(NAME, S, V) CAT(DISPATCH_, S)(NAME, V)
INST(inst_a, 0, 4)
INST(inst_b, 1, 1)
AUX(_h, 1)
DISPATCH(nested, 0, 3)
'''


def test_signatures_from_definitions_and_macros():
    sig = rt.kernel_signature(SRC, "plain")
    assert sig.params == (("x", "ptr"), ("n", "int32"), ("flags", "uint32"), ("big", "int64"),
                          ("alpha", "float32"), ("beta", "float64"), ("count", "uint64"), ("y", "ptr"))
    assert rt.kernel_signature(SRC, "inst_b").params == (("rows", "ptr"), ("X", "ptr"), ("Y", "ptr"),
                                                         ("n", "int32"), ("K", "int32"))
    assert rt.kernel_signature(SRC, "inst_a_aux").names == ("rows", "n")
    assert rt.kernel_signature(SRC, "helper_h").params == (("S", "ptr"), ("n", "int32"))
    assert rt.kernel_signature(SRC, "nested_zero").params == (("p", "ptr"), ("v", "int32"))
    for missing in ("ghost", "ghost2", "inst_c", "helper_b"):
        with pytest.raises(ValueError, match="no extern"):
            rt.kernel_signature(SRC, missing)
    bad = 'extern "C" __global__ void k(struct pair p, int n) {}'
    with pytest.raises(ValueError, match="type 'struct pair'"):
        rt.kernel_signature(bad, "k")


def test_signatures_of_sources_with_many_instance_lines():
    # every line needs several expansions (INST -> ELEM x 2): the bound on rescans holds per line,
    # so a source of many instances still gives each kernel's signature (named or token-pasted)
    many = SRC + "\n".join(f"INST(k{i}, {i % 2}, 4)" for i in range(40)) + "\n"
    assert rt.kernel_signature(many, "k39").names == ("rows", "X", "Y", "n", "K")
    assert rt.kernel_signature(many, "k17_aux").names == ("rows", "n")
    loop = "#define SELF(a) SELF(a)\nSELF(x)\n"
    with pytest.raises(ValueError, match="does not end"):
        rt.kernel_signature(loop, "x")


def _plan(**kw):
    sig = rt.kernel_signature(SRC, "plain")
    args = dict(bound={"x": 0x7F0000001000, "n": -5, "flags": 2**32 - 1, "big": -(2**40), "alpha": 0.5,
                       "beta": 1e300, "count": 2**63}, per_call=("y",))
    args.update(kw)
    return rt.LaunchPlan(None, sig, (3, 2, 1), (128, 1, 1), 64, **args)


def test_bind_by_name_builds_the_typed_buffer():
    p = _plan()
    assert p._launch is None            # no function handle: no driver launch
    got = p.arguments((0xABCDEF00,))
    assert got == [("x", "ptr", 0x7F0000001000), ("n", "int32", -5), ("flags", "uint32", 2**32 - 1),
                   ("big", "int64", -(2**40)), ("alpha", "float32", 0.5), ("beta", "float64", 1e300),
                   ("count", "uint64", 2**63), ("y", "ptr", 0xABCDEF00)]
    # the buffer holds one address per parameter, each pointing at a value of the C type's size
    sizes = [ctypes.sizeof(rt.ARG_TYPES[t][0]) for _, t, _ in got]
    assert sizes == [8, 4, 4, 8, 4, 8, 8, 8]
    assert len(p._params) == 8 and all(a for a in p._params)
    # a call writes only its slots
    assert p.arguments((17,))[-1] == ("y", "ptr", 17) and p.arguments()[0] == ("x", "ptr", 0x7F0000001000)


def test_bind_errors():
    with pytest.raises(ValueError, match=r"unknown \['z'\]"):
        _plan(bound={"x": 1, "n": 1, "flags": 1, "big": 1, "alpha": 1.0, "beta": 1.0, "count": 1, "z": 3})
    with pytest.raises(ValueError, match=r"missing \['count'\]"):
        _plan(bound={"x": 1, "n": 1, "flags": 1, "big": 1, "alpha": 1.0, "beta": 1.0})
    with pytest.raises(ValueError, match=r"bound twice \['x'\]"):
        _plan(per_call=("y", "x"))
    with pytest.raises(ValueError, match=r"unknown \['out'\]"):
        _plan(per_call=("out",))
    with pytest.raises(TypeError, match="'n' has type int32, not a pointer"):
        _plan(bound={"x": 1, "flags": 1, "big": 1, "alpha": 1.0, "beta": 1.0, "count": 1, "y": 2}, per_call=("n",))
    base = {"x": 1, "n": 1, "flags": 1, "big": 1, "alpha": 1.0, "beta": 1.0, "count": 1}
    with pytest.raises(ValueError, match="'n' = 2147483648 does not fit int32"):
        _plan(bound={**base, "n": 2**31})
    with pytest.raises(ValueError, match="'x' = -1 does not fit ptr"):
        _plan(bound={**base, "x": -1})
    with pytest.raises(TypeError, match="'n' \\(int32\\) got float"):
        _plan(bound={**base, "n": 1.5})
    with pytest.raises(TypeError, match="'alpha' \\(float32\\) got str"):
        _plan(bound={**base, "alpha": "1"})


class _FakeFunction:
    """Stands in for a CuPy kernel object without a driver handle: records its launches."""

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem, stream):
        self.calls.append((grid, block, args, shared_mem, stream))


def test_cupy_fallback_gets_typed_arguments(monkeypatch):
    monkeypatch.setattr(rt, "_stream", lambda handle: ("stream", handle))
    fn = _FakeFunction()
    sig = rt.kernel_signature(SRC, "inst_a")
    p = rt.LaunchPlan(fn, sig, (4, 1, 1), (64, 1, 1), bound={"rows": 4096, "n": 7, "K": 33}, per_call=("Y", "X"))
    p((111, 222), 5)     # per-call order is the order named at bind time: Y, then X
    (grid, block, args, smem, stream), = fn.calls
    assert grid == (4, 1, 1) and block == (64, 1, 1) and smem == 0 and stream == ("stream", 5)
    assert args == (4096, 222, 111, 7, 33)
    assert [type(a) for a in args] == [int, int, int, np.int32, np.int32]


def test_positional_launch_keeps_its_typing():
    p = rt.Launch(None, (1, 1, 1), (32, 1, 1), [12345, None, np.int32(-3), np.float32(2.5), None, np.int64(9)])
    assert p.per_call == ("a1", "a4")
    assert p.arguments((7, 8)) == [("a0", "ptr", 12345), ("a1", "ptr", 7), ("a2", "int32", -3),
                                   ("a3", "float32", 2.5), ("a4", "ptr", 8), ("a5", "ptr", 9)]
    with pytest.raises(TypeError, match="unsupported kernel argument type"):
        rt.Launch(None, (1, 1, 1), (32, 1, 1), ["x"])


def test_binary_for_device(monkeypatch):
    monkeypatch.setattr(rt, "_device_arch", lambda device: 80)
    monkeypatch.setattr(rt, "device_arch", lambda device=None: 80)
    rebuilt = []

    def rebuild(arch):
        rebuilt.append(arch)
        return f"/cache/k-sm{arch}.fatbin"

    assert rt.binary_for_device("/a/k.fatbin", 80, 0, rebuild) == ("/a/k.fatbin", 80)
    assert rt.binary_for_device("/a/k.fatbin", 75, 0, rebuild) == ("/a/k.fatbin", 75)   # older arch, same major
    assert rebuilt == []
    monkeypatch.setattr(rt, "nvcc_available", lambda: True)
    assert rt.binary_for_device("/a/k.fatbin", 90, 0, rebuild) == ("/cache/k-sm80.fatbin", 80)
    assert rebuilt == [80]
    monkeypatch.setattr(rt, "nvcc_available", lambda: False)
    with pytest.raises(RuntimeError, match="built for sm_90 and cannot run on this GPU \\(sm_80\\)"):
        rt.binary_for_device("/a/k.fatbin", 90, 0, rebuild)
