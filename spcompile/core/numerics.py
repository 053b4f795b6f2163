"""Numbers: the element types a workload's dense inputs take (:class:`DType`) and the arithmetic
precisions a kernel may compute in (:class:`Precision`) -- one table each, one vocabulary.

* A *dtype* is what the caller's X / Y / output hold: ``"float32"``, ``"float16"``,
  ``"bfloat16"``, ``"float64"`` (aliases such as ``"fp16"``, ``"half"``, ``"double"``, numpy and
  torch dtypes are accepted by :func:`dtype`).  The matrix values and all accumulation are fp32
  (:attr:`DType.compute`), except for float64 workloads, which compute in float64 throughout
  (values included; the CPU templates only).
* A *precision* is the lowest precision a kernel's multiplications use: ``"fp32"`` (exact fp32
  CUDA-core / CPU kernels), ``"tf32"``, ``"fp16"``, ``"bf16"`` (tensor-core operands), and
  ``"fp64"`` (float64 workloads).  A build's *precision policy* (``build(precision=...)``) admits
  every precision from fp32 down to the one named (:func:`allowed_precisions`); a workload always
  admits its own (16-bit inputs already are 16-bit; a float64 workload computes in fp64, the one
  precision above fp32, which no other workload is computed in).
* Each precision has a relative Frobenius-error tolerance against the float64 reference
  (:func:`tolerance`); a kernel's result is checked at the tolerance of its own precision.

Rounding helpers (:func:`round_to`, :func:`bf16_bits`, :func:`tf32_round`) live here, once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DType", "Precision", "DTYPES", "PRECISIONS", "dtype", "dtype_name", "precision",
           "allowed_precisions", "tolerance", "result_tolerance", "round_to", "bf16_bits", "bf16_from_bits", "tf32_round",
           "NATIVE_PRECISION", "exact_precision"]


@dataclass(frozen=True)
class Precision:
    """An arithmetic precision.  ``rank``: 0 is fp32-level, higher is less exact, negative more
    exact than fp32 (fp64: admitted only for float64 workloads); ``code``: the kernel-template
    code of the operand type (tensor-core templates); ``mma_k``: the k of one MMA step; ``bytes``:
    operand size; ``tolerance``: relative error allowed against float64 (fp32 accumulation; fp64:
    float64 accumulation)."""

    name: str
    rank: int
    tolerance: float
    code: int
    mma_k: int
    bytes: int

    def round(self, x) -> np.ndarray:
        """float64 copy of ``x`` with every value rounded to this precision's operand type."""
        return _ROUND[self.name](x)


@dataclass(frozen=True)
class DType:
    """An element type of the dense inputs / output.  ``code``: the kernel-template code (TN / E),
    ``short``: the suffix in kernel names, ``precision``: the precision of inputs of this type
    (a tensor-core kernel uses it on them), ``compute``: the element type of the matrix values and
    of the arithmetic (float32, but float64 for float64 inputs)."""

    name: str
    short: str
    code: int
    bytes: int
    precision: str
    compute: str = "float32"

    @property
    def tolerance(self) -> float:
        return PRECISIONS[self.precision].tolerance

    @property
    def is_16bit(self) -> bool:
        return self.bytes == 2

    def round(self, x) -> np.ndarray:
        """Copy of ``x`` in :attr:`compute` with every value exactly representable in this dtype."""
        return round_to(x, self.name)


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    # float64 arithmetic (float64 workloads on the CPU): float64-level results; the error of a
    # sum of n products grows like n * 2^-53 at worst, so 1e-12 holds rows of thousands of entries
    Precision("fp64", -1, 1e-12, -1, 1, 8),
    Precision("fp32", 0, 1e-5, -1, 1, 4),
    # error-compensated split tf32 on tensor cores (a = hi + lo, each tf32; a*b ~ hi*hi + hi*lo +
    # lo*hi, fp32 accumulation): fp32-level results, so admitted wherever fp32 is
    Precision("3xtf32", 0, 1e-5, 3, 8, 4),
    Precision("tf32", 1, 2e-3, 0, 8, 4),
    Precision("fp16", 2, 1e-2, 1, 16, 2),
    Precision("bf16", 3, 1e-2, 2, 16, 2),
)}
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", "f32", 0, 4, "fp32"),
    DType("float16", "f16", 1, 2, "fp16"),
    DType("bfloat16", "bf16", 2, 2, "bf16"),
    DType("float64", "f64", 3, 8, "fp64", "float64"),
)}
#: a 16-bit workload's own precision (its inputs are MMA operands as they are)
NATIVE_PRECISION = {d.name: d.precision for d in DTYPES.values() if d.is_16bit}

_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "f32": "float32", "half": "float16", "fp16": "float16",
                  "f16": "float16", "bf16": "bfloat16", "double": "float64", "fp64": "float64", "f64": "float64"}
_PRECISION_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


def dtype_name(d) -> str:
    """Normalise a dtype given as a string ("float16", "half", "bf16", ...), numpy dtype or torch
    dtype to its canonical name (unknown names pass through: :func:`dtype` rejects them)."""
    if isinstance(d, DType):
        return d.name
    if isinstance(d, str):
        name = d
    elif type(d).__module__.split(".")[0] == "torch":
        name = str(d).replace("torch.", "")
    else:
        try:
            name = np.dtype(d).name
        except TypeError:
            name = str(d)
    return _DTYPE_ALIASES.get(name, name)


def dtype(d) -> DType:
    """The :class:`DType` of ``d`` (any spelling :func:`dtype_name` accepts); ValueError otherwise."""
    name = dtype_name(d)
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {d!r}; expected one of {tuple(DTYPES)}") from None


def precision(p) -> Precision:
    """The :class:`Precision` named ``p`` ("fp32", "tf32", "fp16", "bf16", "fp64"; dtype names are
    accepted as aliases); ValueError otherwise."""
    if isinstance(p, Precision):
        return p
    name = _PRECISION_ALIASES.get(str(p), str(p))
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)} (the lowest precision the module may "
                         f"compute in; 'fp32' admits only exact fp32 kernels), got {p!r}") from None


def allowed_precisions(policy: str | None, dtype_: str | None = None) -> tuple[str, ...]:
    """Precisions a build under ``policy`` may use, most exact first: fp32 and every precision down
    to the one named, and the workload's own where ``dtype_`` is given (a 16-bit one's: its inputs
    already are 16-bit; float64's fp64).  Policy "fp64" admits fp64 alone, so float64 workloads
    only (ValueError for another ``dtype_``)."""
    pol = precision("fp32" if policy is None else policy)
    own = DTYPES[dtype_name(dtype_)].precision if dtype_ is not None and dtype_name(dtype_) in DTYPES else None
    if pol.rank < 0 and dtype_ is not None and own != pol.name:
        raise ValueError(f"precision={pol.name!r} admits only kernels computing in {pol.name}, which only "
                         f"{[d.name for d in DTYPES.values() if d.precision == pol.name]} workloads have; "
                         f"got dtype={dtype_name(dtype_)!r}")
    out = [p for p in PRECISIONS.values() if 0 <= p.rank <= pol.rank or p.name in (own, pol.name)]
    return tuple(p.name for p in sorted(out, key=lambda p: p.rank))


def exact_precision(dtype_) -> str:
    """The precision a kernel without reduced-precision operands (CUDA cores, CPU) computes a
    workload of ``dtype_`` in: fp32, or the workload's own where that is more exact (fp64)."""
    own = PRECISIONS[dtype(dtype_).precision]
    return own.name if own.rank < PRECISIONS["fp32"].rank else "fp32"


def tolerance(name: str = "float32") -> float:
    """Relative Frobenius-error tolerance of a result computed in precision or dtype ``name``."""
    if name in DTYPES:
        return DTYPES[name].tolerance
    return precision(name).tolerance


def result_tolerance(precision_: str, dtype_: str) -> float:
    """Tolerance of a result computed in precision ``precision_`` and returned in dtype ``dtype_``:
    the looser of the two (a 16-bit result is rounded once, whatever the kernel's precision)."""
    return max(tolerance(precision_), tolerance(dtype_))


# -- rounding --------------------------------------------------------------------------------
def bf16_bits(a) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_from_bits(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def tf32_round(a) -> np.ndarray:
    """float32 -> nearest tf32 (10-bit mantissa, ties away from zero: ``cvt.rna``), as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return u.view(np.float32)


def round_to(x, name: str) -> np.ndarray:
    """float32 copy of ``x`` rounded to dtype or precision ``name`` (round to nearest even; tf32
    as the tensor cores' ``cvt.rna``); for float64 / fp64 a float64 copy, unrounded."""
    p = _PRECISION_ALIASES.get(name, name)
    if p == "fp64":
        return np.array(x, dtype=np.float64, order="C")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if p == "fp16":
        return x.astype(np.float16).astype(np.float32)
    if p == "bf16":
        return bf16_from_bits(bf16_bits(x))
    if p == "tf32":
        return tf32_round(x)
    if p in ("fp32", "3xtf32"):      # split tf32 keeps an fp32 operand (as hi + lo)
        return x
    raise ValueError(f"cannot round to {name!r}")


_ROUND = {p: (lambda x, p=p: round_to(x, p).astype(np.float64)) for p in PRECISIONS}
