"""TVM TensorIR CPU kernels (llvm target) for CSR SpMM (sum/max/min/mean) and SDDMM.

Both kernels run a ``T.parallel`` loop over *tasks*, each a contiguous block of rows whose
boundaries are computed at build time (``task_bounds``, an array handed to the kernel) so that
every task carries about the same work.  TVM's pool splits the task loop statically between its
threads, so balanced tasks mean balanced threads even on power-law graphs with very long rows.

Schedule parameters (tunable through ``space()``):

* ``parallel``: run the task loop on TVM's thread pool (False: one task, no pool wake-up),
* ``tasks_per_thread``: tasks per pool thread (more tasks: finer, smaller blocks of rows),
* ``balance``: ``"nnz"`` cuts tasks at equal ``nnz + rows`` (work), ``"rows"`` at equal row counts,
* ``k_tile`` (SpMM): width of the slice of K held in vector registers while a row's nonzeros are
  walked; a row's structure is re-read once per slice,
* ``tile_order`` (SpMM): ``"row"`` finishes all K slices of a row before the next row (X's rows
  are read once per nonzero); ``"task"`` sweeps all rows of a task once per K slice, so only a
  ``k_tile``-wide column slice of X has to stay in cache (wins when X does not fit in L2/L3),
* ``prefetch`` (SpMM): software-prefetch the K slice of X's row for the nonzero that many
  places ahead (0: off); the gathers from X are indirect, so the hardware cannot predict them,
* ``k_tile`` (SDDMM): the vector accumulator width of the dot products.

The compiled code depends only on (K, reduce, k_tile, tile_order, index dtype, dtype): the matrix
enters as data, so builds of the same configuration share one compiled library.  A float32
workload computes in float32, a float64 one in float64 throughout: X, Y, the values (``data``)
and the accumulators.
Row loops are written as ``for r in range(count): i = start + r``: a loop whose start depends on
the parallel variable lost its offset in TVM 0.27's lowering (rows were read from 0).

The kernels work in the caller's order: ``indices`` are original column ids and ``row_ids`` /
``nnz_ids`` say where outputs go (see :func:`~spcompile.kernels.base.csr_kernel_arrays`).
Scalar helpers are ``T.meta_var`` expressions and accumulators are ``global``-scope buffers on
purpose: TVM lowers let-bound scalars and ``local`` buffers inside a parallel body to
``TVMBackendAllocWorkspace`` calls, while small ``global`` buffers become stack slots that LLVM
keeps in registers.
"""
from __future__ import annotations

import functools
import hashlib
import math

import numpy as np

from ...core.ir import SparseModule
from ...core.numerics import DTYPES
from ...runtime import cpu as rt
from ..base import Kernel, Template, csr_kernel_arrays, register_template

PARALLEL_MIN_WORK = 600_000  # nnz * K below which the default runs on one thread (measured)
#: fewer usable threads than this: the default runs on one thread whatever the work.  A parallel
#: loop waits for every pool thread; with two cores, any other busy thread (another process, or
#: the OpenBLAS threads that spin for a while after each numpy BLAS call in the same process)
#: delays the pool's second thread by a scheduler quantum: measured on a 2-core machine, 80 us
#: -> 8 ms per call after one ``big @ big``, while one thread loses little there (the kernels
#: are memory-bound: 3.0x / 2.0x over SciPy at K=64 / 256 on one thread, 2.6x / 2.2x on two)
PARALLEL_MIN_THREADS = 3


def task_bounds(indptr: np.ndarray, ntasks: int, balance: str = "nnz", row_cost: float = 1.0) -> np.ndarray:
    """Row boundaries (length ``ntasks + 1``, from 0 to m) of ``ntasks`` contiguous row blocks of
    about equal work: ``nnz + row_cost * rows`` for ``balance="nnz"``, rows for ``"rows"``."""
    indptr = np.asarray(indptr, dtype=np.int64)
    m = indptr.shape[0] - 1
    ntasks = max(1, min(int(ntasks), max(m, 1)))
    if balance == "rows":
        return np.linspace(0, m, ntasks + 1).round().astype(np.int64)
    if balance != "nnz":
        raise ValueError(f"balance must be 'nnz' or 'rows', got {balance!r}")
    def work(i):  # work before row i, evaluated only where needed (no float64 array per row)
        return indptr[i].astype(np.float64) + row_cost * i.astype(np.float64)

    targets = np.linspace(0.0, float(work(np.array([m]))[0]), ntasks + 1)
    # first i with work(i) >= target (searchsorted side="left" on the monotone work), by a
    # vectorised bisection over the targets: O(ntasks log m), whatever the number of rows
    lo, hi = np.zeros(ntasks + 1, dtype=np.int64), np.full(ntasks + 1, m + 1, dtype=np.int64)
    while np.any(lo < hi):
        mid = (lo + hi) // 2
        below = work(np.minimum(mid, m)) < targets
        go = lo < hi
        lo = np.where(go & below, mid + 1, lo)
        hi = np.where(go & ~below, mid, hi)
    b = np.clip(lo, 1, m).astype(np.int64)
    # cut at the nearer of the two row boundaries around each target (a long row is not
    # dragged into the task before it)
    b -= (targets - work(b - 1)) < (work(b) - targets)
    b[0], b[-1] = 0, m
    return np.maximum.accumulate(b)


def _tiles(K: int, k_tile: int) -> tuple[int, int, int]:
    KT = max(1, min(int(k_tile), K))
    return KT, K // KT, K % KT


def _constants(dtype: str, *values: float):
    """``values`` as TIR constants of ``dtype``."""
    from tvm.script import tirx as T

    return tuple(getattr(T, dtype)(v) for v in values)


def _spmm_func(K: int, reduce: str, k_tile: int, tile_order: str, idx: str, parallel: bool = True,
               prefetch: int = 0, dtype: str = "float32"):
    from tvm.script import tirx as T

    LOOP = T.parallel if parallel else T.serial

    F = dtype   # X, Y, the values and the accumulators
    KT, NT, REM = _tiles(K, k_tile)
    # size-1 buffers become TIR scalars that do not survive the parallel lowering: keep >= 2
    AW, RW = max(KT, 2), max(REM, 2)
    SUM = reduce in ("sum", "mean")
    INIT, ZERO = _constants(F, 0.0 if SUM else (-math.inf if reduce == "max" else math.inf), 0.0)
    ROW_ORDER = tile_order == "row"
    PF = int(prefetch)
    LINE = 64 // DTYPES[F].bytes   # elements per cache line
    PFL = (KT + LINE - 1) // LINE  # cache lines of one K slice

    def combine(acc, v):
        """One step of the reduction."""
        if SUM:
            return acc + v
        # NaN propagates like the float64 reference (numpy maximum / minimum): a NaN product
        # replaces the accumulator and, once NaN, the accumulator is never replaced again
        better = (v > acc) if reduce == "max" else (v < acc)
        return T.Select(T.Or(better, T.isnan(v)), v, acc)

    def finish(acc, lo, hi):
        """A row's result from its accumulator (mean: divided by the row's length; an empty row
        gives 0 for every reduction)."""
        if reduce == "mean":
            return acc / T.Cast(F, T.max(hi - lo, 1))
        if SUM:
            return acc
        return T.Select(hi == lo, ZERO, acc)

    @T.macro
    def row_slice(indptr, indices, data, rows, nnz, X, Y, i, acc, width, base, pf):
        # row i, columns base .. base + width of K: reduce its nonzeros into acc, write Y
        lo = T.meta_var(T.Cast("int32", indptr[i]))
        hi = T.meta_var(T.Cast("int32", indptr[i + 1]))
        for k in T.vectorized(width):
            acc[k] = INIT
        for j in T.serial(lo, hi):
            col = T.meta_var(T.Cast("int64", indices[j]))
            if pf > 0:
                # X rows of the nonzero pf ahead (rows of a task are contiguous in indices, so
                # this runs into the next rows too)
                pcol = T.meta_var(T.Cast("int64", indices[T.min(j + pf, nnz - 1)]))
                for q in T.serial(PFL):
                    T.evaluate(T.call_intrin("void", "tirx.prefetch", T.address_of(X[pcol, base + q * LINE]), 0, 3, 1))
            for k in T.vectorized(width):
                acc[k] = combine(acc[k], data[j] * X[col, base + k])
        for k in T.vectorized(width):
            Y[T.Cast("int64", rows[i]), base + k] = finish(acc[k], lo, hi)

    @T.prim_func
    def spmm(a_bounds: T.handle, a_indptr: T.handle, a_indices: T.handle, a_data: T.handle,
             a_rows: T.handle, x: T.handle, y: T.handle):
        T.func_attr({"global_symbol": "spmm", "tir.noalias": True})
        m = T.int32()
        nnz = T.int32()
        n = T.int32()
        nb = T.int32()
        bounds = T.match_buffer(a_bounds, (nb,), idx, align=4)
        indptr = T.match_buffer(a_indptr, (m + 1,), idx, align=4)
        indices = T.match_buffer(a_indices, (nnz,), idx, align=4)
        data = T.match_buffer(a_data, (nnz,), F, align=4)
        rows = T.match_buffer(a_rows, (m,), idx, align=4)
        X = T.match_buffer(x, (n, K), F, align=4)
        Y = T.match_buffer(y, (m, K), F, align=4)
        for task in LOOP(nb - 1):
            acc = T.alloc_buffer((AW,), F, scope="global")
            racc = T.alloc_buffer((RW,), F, scope="global")
            first = T.meta_var(T.Cast("int32", bounds[task]))
            count = T.meta_var(T.Cast("int32", bounds[task + 1]) - T.Cast("int32", bounds[task]))
            if ROW_ORDER:
                for r in T.serial(count):
                    for t in T.serial(NT):
                        row_slice(indptr, indices, data, rows, nnz, X, Y, first + r, acc, KT, t * KT, PF)
                    if REM > 0:
                        row_slice(indptr, indices, data, rows, nnz, X, Y, first + r, racc, REM, NT * KT, 0)
            else:
                for t in T.serial(NT):
                    for r in T.serial(count):
                        row_slice(indptr, indices, data, rows, nnz, X, Y, first + r, acc, KT, t * KT, PF)
                if REM > 0:
                    for r in T.serial(count):
                        row_slice(indptr, indices, data, rows, nnz, X, Y, first + r, racc, REM, NT * KT, 0)

    return spmm


def _sddmm_func(K: int, k_tile: int, idx: str, parallel: bool = True, dtype: str = "float32"):
    from tvm.script import tirx as T

    LOOP = T.parallel if parallel else T.serial
    F = dtype   # X, Y, the values, the dot products and the output
    ZERO, = _constants(F, 0.0)

    KT, NT, REM = _tiles(K, k_tile)
    # horizontal sum of the KT-lane accumulator by halving (log2 steps) while the width is even
    halves = []
    w = KT
    while w % 2 == 0 and w > 1:
        w //= 2
        halves.append(w)
    TAIL = w  # lanes left after halving, summed one by one
    if len(halves) > 8:
        raise ValueError(f"SDDMM k_tile {KT} too wide (at most 256 lanes)")
    AW = max(KT, 2)  # size-1 buffers become TIR scalars that do not survive the parallel lowering

    @T.macro
    def halve(acc, width, again):
        # acc[:width // 2] += acc[width // 2:width], then the same on the first half, while the
        # width is even (a macro cannot name itself: it gets itself as ``again``)
        if width % 2 == 0 and width > 1:
            for k in T.vectorized(width // 2):
                acc[k] = acc[k] + acc[k + width // 2]
            again(acc, width // 2, again)

    @T.prim_func
    def sddmm(a_bounds: T.handle, a_indptr: T.handle, a_indices: T.handle, a_data: T.handle,
              a_rows: T.handle, a_nnz_ids: T.handle, x: T.handle, y: T.handle, o: T.handle):
        T.func_attr({"global_symbol": "sddmm", "tir.noalias": True})
        m = T.int32()
        nnz = T.int32()
        n = T.int32()
        mx = T.int32()
        nb = T.int32()
        bounds = T.match_buffer(a_bounds, (nb,), idx, align=4)
        indptr = T.match_buffer(a_indptr, (m + 1,), idx, align=4)
        indices = T.match_buffer(a_indices, (nnz,), idx, align=4)
        data = T.match_buffer(a_data, (nnz,), F, align=4)
        rows = T.match_buffer(a_rows, (m,), idx, align=4)
        nnz_ids = T.match_buffer(a_nnz_ids, (nnz,), idx, align=4)
        X = T.match_buffer(x, (mx, K), F, align=4)
        Y = T.match_buffer(y, (n, K), F, align=4)
        out = T.match_buffer(o, (nnz,), F, align=4)
        for task in LOOP(nb - 1):
            acc = T.alloc_buffer((AW,), F, scope="global")
            s = T.alloc_buffer((2,), F, scope="global")
            for r in T.serial(T.Cast("int32", bounds[task + 1]) - T.Cast("int32", bounds[task])):
                i = T.meta_var(T.Cast("int32", bounds[task]) + r)
                orow = T.meta_var(T.Cast("int64", rows[i]))
                for j in T.serial(T.Cast("int32", indptr[i]), T.Cast("int32", indptr[i + 1])):
                    col = T.meta_var(T.Cast("int64", indices[j]))
                    for k in T.vectorized(KT):
                        acc[k] = ZERO
                    for t in T.serial(NT):
                        for k in T.vectorized(KT):
                            acc[k] = acc[k] + X[orow, t * KT + k] * Y[col, t * KT + k]
                    halve(acc, KT, halve)
                    s[0] = ZERO
                    for k in T.serial(REM):
                        s[0] = s[0] + X[orow, NT * KT + k] * Y[col, NT * KT + k]
                    for k in T.serial(TAIL):
                        s[0] = s[0] + acc[k]
                    out[T.Cast("int64", nnz_ids[j])] = data[j] * s[0]

    return sddmm


@functools.lru_cache(maxsize=64)
def _compiled(kind: str, symbol: str, *key) -> bytes:
    """Compile (once per process and configuration) with the kernel exported as ``symbol``;
    returns the shared library's bytes, kept in memory (a file in a folder that something may
    clean is written again when needed)."""
    func = _spmm_func(*key) if kind == "spmm" else _sddmm_func(*key)
    return rt.library_bytes(rt.compile_primfunc(func.with_attr("global_symbol", symbol)))


class _CPUKernel(Kernel):
    target = "cpu"

    def __init__(self, template, params, arrays, files, meta, lib, entry, lib_bytes: bytes):
        super().__init__(template, params, arrays, files, meta)
        self._lib = lib
        self._fn = lib[entry]
        self._entry = entry
        self._lib_bytes = lib_bytes
        self._bound = [rt.as_tensor(arrays[k]) for k in meta["array_order"]]

    def artifact_files(self):
        # the library as compiled or loaded (kept in memory): a cached file that was removed,
        # truncated or altered since is written again, never saved as it is
        self.files = {**self.files, "kernel.so": rt.materialize(self._lib_bytes)}
        return self.files

    def __call__(self, *inputs, out):
        self._fn(*self._bound, *(rt.as_tensor(x) for x in inputs), rt.as_tensor(out))
        return out


class _CPUTemplate(Template):
    target = "cpu"
    version = "2"
    priority = 10
    csr_arrays = True
    #: X / Y / output, values and arithmetic all of one type (the dtype is in the code key)
    dtypes = ("float32", "float64")
    entry = ""
    array_order: tuple[str, ...] = ()

    def available(self) -> bool:
        try:
            from tvm.target import codegen
        except ImportError:  # a machine that only runs saved CUDA modules
            return False
        return (codegen.llvm_version_major(allow_none=True) or 0) > 0

    def _task_space(self):
        from optuna.distributions import CategoricalDistribution

        return {"parallel": CategoricalDistribution([True, False]),
                "tasks_per_thread": CategoricalDistribution([1, 2, 4, 8, 32]),
                "balance": CategoricalDistribution(["nnz", "rows"])}

    @staticmethod
    def _parallel_default(mod) -> bool:
        # waking the thread pool costs about as much as a tiny product: run those serially; and
        # on one or two cores a parallel loop is hostage to every other busy thread (see above)
        return mod.A.nnz * mod.op.K >= PARALLEL_MIN_WORK and rt.num_threads() >= PARALLEL_MIN_THREADS

    def quick_alternatives(self, params) -> list:
        """Quick selection also measures the one-thread variant of a parallel config (the pool's
        wake-up and wait can cost more than the second thread gains, depending on the machine's load)."""
        if params.get("parallel"):
            return [{**params, "parallel": False}]
        return []

    def _code_key(self, op, params, idx) -> tuple:
        """Everything compiled into the kernel's code (``op``: the SparseOp or WorkloadKey), in the
        order of the kernel function's arguments (the dtype last)."""
        raise NotImplementedError

    def entry_name(self, op, params, idx: str) -> str:
        """The kernel's symbol in its library: the entry and a digest of its code key, so that a
        library is only ever called for the workload and parameters it was compiled for (an
        artifact relabelled for another K, reduction, tiling or dtype names a symbol its library
        lacks)."""
        return self._symbol(self._code_key(op, params, str(idx)))

    def _symbol(self, code_key: tuple) -> str:
        return f"{self.entry}_{hashlib.sha256(repr(code_key).encode()).hexdigest()[:16]}"

    def build(self, mod: SparseModule, params) -> Kernel:
        params = self.check_params(mod, params)
        arrays = csr_kernel_arrays(mod)
        idt = arrays["indptr"].dtype
        nthreads = rt.num_threads()
        ntasks = nthreads * int(params["tasks_per_thread"]) if params["parallel"] else 1
        arrays["task_bounds"] = task_bounds(arrays["indptr"], ntasks, str(params["balance"])).astype(idt)
        arrays = {k: v for k, v in arrays.items() if k in self.array_order}
        code = self._code_key(mod.op, params, str(idt))
        symbol = self._symbol(code)
        data = _compiled(self.entry, symbol, *code)
        path = rt.materialize(data)
        meta = {"array_order": list(self.array_order), "llvm_target": rt.host_llvm_target(),
                "cpu_features": rt.host_cpu_features(), "entry": symbol, "threads": nthreads}
        return _CPUKernel(self.name, params, arrays, {"kernel.so": path}, meta, rt.load(path), symbol, data)

    def check_arrays(self, key, params, arrays, meta, values=None):
        if sorted(arrays) != sorted(self.array_order):
            raise ValueError(f"template {self.name!r} takes arrays {sorted(self.array_order)}, got {sorted(arrays)}")
        if np.asarray(arrays["indptr"]).dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise ValueError(f"index arrays must be int32 or int64, got {np.asarray(arrays['indptr']).dtype}")
        want = self.entry_name(key, params, str(np.asarray(arrays["indptr"]).dtype))
        if meta.get("entry") != want or list(meta.get("array_order", ())) != list(self.array_order):
            raise ValueError(f"kernel metadata names entry {meta.get('entry')!r} / arrays "
                             f"{meta.get('array_order')!r}; for this workload and these parameters template "
                             f"{self.name!r} compiles {want!r} / {list(self.array_order)}")
        super().check_arrays(key, params, arrays, meta, values)
        tb = np.asarray(arrays["task_bounds"])
        if tb.ndim != 1 or tb.shape[0] < 2 or tb[0] != 0 or tb[-1] != key.rows or np.any(tb[1:] < tb[:-1]):
            raise ValueError(f"array 'task_bounds' must rise monotonically from 0 to rows={key.rows}")

    def load(self, params, arrays, files, meta):
        if set(files) != {"kernel.so"}:
            raise ValueError(f"template {self.name!r} takes one library 'kernel.so', the artifact names {sorted(files)}")
        check_host(meta)
        with open(files["kernel.so"], "rb") as f:
            data = f.read()
        return _CPUKernel(self.name, params, arrays, files, {**meta, "array_order": list(self.array_order)},
                          rt.load(files["kernel.so"]), str(meta["entry"]), data)


def check_host(meta) -> None:
    """ValueError when the kernel was compiled for CPU features this host lacks (it could stop
    the process with an illegal instruction); artifacts without the record are checked by the
    CPU name only (a warning when it differs)."""
    want = meta.get("cpu_features")
    built_cpu = (meta.get("llvm_target") or {}).get("mcpu")
    if want is None:
        if built_cpu and built_cpu != rt.host_cpu_name():
            import warnings

            warnings.warn(f"this CPU kernel was compiled for a {built_cpu!r} CPU, this host is a "
                          f"{rt.host_cpu_name()!r} one; rebuild it if it stops with an illegal instruction",
                          RuntimeWarning, stacklevel=3)
        return
    if not isinstance(want, list) or not all(isinstance(f, str) for f in want):
        raise ValueError("kernel metadata 'cpu_features' is malformed")
    missing = sorted(set(want) - set(rt.host_cpu_features()))
    if missing:
        raise ValueError(f"the kernel was compiled for a {built_cpu!r} CPU with features this host lacks "
                         f"({', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}); rebuild it on this host")


def _k_tiles(K: int) -> list[int]:
    """Register-tile widths worth trying for width K: multiples of a vector up to 256, and K."""
    tiles = {t for t in (16, 32, 64, 128, 256) if t <= K}
    if K <= 256:
        tiles.add(K)
    return sorted(tiles)


@register_template
class CPUSpMM(_CPUTemplate):
    """CSR SpMM (sum/max/min/mean) as a TensorIR kernel: nnz-balanced parallel row blocks,
    K slices accumulated in vector registers."""

    name = "cpu.csr_spmm"
    ops = tuple(("spmm", r) for r in ("sum", "max", "min", "mean"))
    entry = "spmm"
    array_order = ("task_bounds", "indptr", "indices", "data", "row_ids")

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution

        return {**self._task_space(),
                "k_tile": CategoricalDistribution(_k_tiles(mod.op.K)),
                "tile_order": CategoricalDistribution(["row", "task"]),
                "prefetch": CategoricalDistribution([0, 4, 16])}

    def default_params(self, mod):
        K = mod.op.K
        # Measured on the shared graphs (2 threads, znver4): one register tile of up to 64 lanes
        # (4 zmm accumulators) per row, rows finished one after the other, wins or ties at K=64
        # and K=256 on every graph tried; wider tiles (128, 256) and the slice-by-slice "task"
        # order only help on some graphs, so they are left to the tuner.
        k_tile = K if K <= 64 else 64
        order = "row"
        # software prefetch distance (nonzeros ahead), measured: 16 wins at K <= 64; with wider
        # rows of X (several slices per nonzero) 4 wins or ties, 16 loses on dense huge graphs
        return {"parallel": self._parallel_default(mod), "tasks_per_thread": 4, "balance": "nnz",
                "k_tile": k_tile, "tile_order": order, "prefetch": 16 if K <= 64 else 4}

    def _code_key(self, op, params, idx):
        return (op.K, op.reduce, int(params["k_tile"]), str(params["tile_order"]), idx,
                bool(params["parallel"]), int(params["prefetch"]), op.dtype)


@register_template
class CPUSDDMM(_CPUTemplate):
    """CSR SDDMM as a TensorIR kernel: nnz-balanced parallel row blocks, vectorised dot products."""

    name = "cpu.csr_sddmm"
    ops = (("sddmm", None),)
    entry = "sddmm"
    array_order = ("task_bounds", "indptr", "indices", "data", "row_ids", "nnz_ids")

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution

        K = mod.op.K
        tiles = sorted({t for t in (16, 32, 64) if t <= K} | ({K} if K < 16 else set()))
        return {**self._task_space(), "k_tile": CategoricalDistribution(tiles)}

    def default_params(self, mod):
        K = mod.op.K
        return {"parallel": self._parallel_default(mod), "tasks_per_thread": 4, "balance": "nnz",
                "k_tile": 32 if K >= 64 else min(K, 16)}

    def _code_key(self, op, params, idx):
        return (op.K, int(params["k_tile"]), idx, bool(params["parallel"]), op.dtype)
