"""Runners: build a configuration, check it against the float64 reference, then time it.

Protocol (what the tuner needs; tests inject fakes)::

    runner.measure(op, config, *, timeout=None, prune_above=None) -> MeasureResult
    runner.baseline(op) -> MeasureResult          # .name says what was measured

Measurement rules: the result is checked (output poisoned with NaN first) before any timing
counts; warm-up calls; the median of repeats; inputs rotated over several sets (and on CUDA
the L2 cache flushed) so that a small graph does not time the cache; preprocessing (the pass
pipeline) timed separately from the kernel.  A compile error, launch error, timeout or wrong
result gives ``MeasureResult(ok=False, status=..., error=...)`` — never an exception.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from ..core import numerics, reference
from ..core.numerics import round_to
from ..core.ir import SparseModule, SparseOp
from ..core.config import Config
from ..module import CompiledModule

__all__ = ["Timer", "Timing", "MODES", "Pruned", "DeadlineExceeded", "MeasureResult", "Runner", "CPURunner", "CUDARunner", "make_runner", "build_timed", "make_inputs"]

#: result statuses
OK, PRUNED, COMPILE_ERROR, RUN_ERROR, WRONG_RESULT, TIMEOUT = (
    "ok", "pruned", "compile_error", "run_error", "wrong_result", "timeout")


@dataclass
class MeasureResult:
    """One measurement: ``ok`` with kernel seconds (median per call), or a failure ``status``
    ("compile_error", "run_error", "wrong_result", "timeout") with its ``error`` text.
    ``status == "pruned"`` means timing was cut short because the config was clearly slow;
    ``kernel_s`` is then the estimate that showed it."""

    status: str
    kernel_s: float = math.inf
    preprocess_s: float = 0.0
    compile_s: float = 0.0
    rel_error: float | None = None
    error: str = ""
    samples: list = field(default_factory=list)
    name: str = ""
    config: Config | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        return {"status": self.status, "kernel_ms": self.kernel_s * 1e3 if math.isfinite(self.kernel_s) else None,
                "preprocess_ms": self.preprocess_s * 1e3, "compile_ms": self.compile_s * 1e3,
                "rel_error": self.rel_error, "error": self.error[-2000:], "name": self.name}


# ---------------------------------------------------------------------------------------------
# The one timing rule
# ---------------------------------------------------------------------------------------------
#: timing modes per target; the first is the default
MODES = {"cuda": ("graph", "launches", "cold_l2"), "cpu": ("autorange",)}


class Pruned(Exception):
    """Raised by :meth:`Timer.time` when the calibration estimate is above ``prune_above``."""

    def __init__(self, estimate: float):
        super().__init__(f"estimated {estimate:.3g} s per call")
        self.estimate = estimate


class DeadlineExceeded(Exception):
    """Raised by :meth:`Timer.time` when ``deadline`` passes between repeats."""


@dataclass
class Timing:
    """What :meth:`Timer.time` measured: ``seconds`` is the median of ``samples`` (seconds per call,
    one per timed repeat of ``calls_per_sample`` calls); ``mode`` is the mode actually used and
    ``note`` says why it differs from the one asked for ("" when it does not)."""

    seconds: float
    samples: list
    mode: str
    calls_per_sample: int
    target: str = ""
    note: str = ""

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "samples": list(self.samples), "mode": self.mode,
                "calls_per_sample": self.calls_per_sample, "target": self.target, "note": self.note}


class _TorchGPU:
    """Events, capture and L2 flushing through torch (the GPU image's usual case)."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch
        self._flush_buf = None

    def synchronize(self):
        self.torch.cuda.synchronize()

    def warm(self, body):
        # torch's advice for code that will be captured: warm up on a side stream
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()

    def events(self):
        E = self.torch.cuda.Event
        return E(enable_timing=True), E(enable_timing=True)

    def elapsed_s(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    def capture(self, body):
        torch = self.torch
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        torch.cuda.synchronize()
        return g.replay

    def l2_bytes(self) -> int:
        props = self.torch.cuda.get_device_properties(self.torch.cuda.current_device())
        return int(getattr(props, "L2_cache_size", 0) or 0)

    def flush_l2(self):
        if self._flush_buf is None:
            n = max(2 * self.l2_bytes(), 64 << 20)
            self._flush_buf = self.torch.empty(n // 4, dtype=self.torch.float32, device="cuda")
        self._flush_buf.fill_(0.0)


class _CupyGPU:
    """The same through CuPy (when torch is not importable)."""

    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy
        self._flush_buf = None

    def synchronize(self):
        self.cp.cuda.runtime.deviceSynchronize()

    def warm(self, body):
        body()
        self.synchronize()

    def events(self):
        return self.cp.cuda.Event(), self.cp.cuda.Event()

    def elapsed_s(self, start, end) -> float:
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end) * 1e-3

    def capture(self, body):
        cp = self.cp
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                body()
            finally:
                graph = stream.end_capture()
        stream.synchronize()

        def replay():
            graph.launch(cp.cuda.get_current_stream())
        return replay

    def l2_bytes(self) -> int:
        cp = self.cp
        try:
            return int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id).get("l2CacheSize", 0))
        except Exception:  # noqa: BLE001 - the 64 MiB floor below covers every current GPU
            return 0

    def flush_l2(self):
        if self._flush_buf is None:
            n = max(2 * self.l2_bytes(), 64 << 20)
            self._flush_buf = self.cp.empty(n // 4, dtype=self.cp.float32)
        self._flush_buf.fill(0)


def _gpu_backend():
    try:
        import torch

        if torch.cuda.is_available():
            return _TorchGPU()
    except ImportError:
        pass
    try:
        return _CupyGPU()
    except ImportError:
        raise RuntimeError("timing on target 'cuda' needs torch (with CUDA) or CuPy") from None


class Timer:
    """The one timing rule of spcompile: the runner, the tuner, the benchmarks and the docs time
    with it.

    ``Timer(target, mode=None)``: target ``"cuda"`` or ``"cpu"``; ``mode`` None picks the default.

    * ``"graph"`` (CUDA default; what a deployed module costs): warm-up calls, then N calls
      (rotating over the input sets; N chosen so that one replay lasts at least ``min_sample_s``,
      at most ``max_calls``) captured in one CUDA graph and replayed ``repeats`` times, each replay
      timed between CUDA events.  Capture goes through ``torch.cuda.CUDAGraph`` when torch is
      importable, else CuPy stream capture.  The calls must launch on the framework's current
      stream (spcompile modules called with torch tensors or CuPy arrays do).  When capture fails
      the timer falls back to ``"launches"`` and says why in ``Timing.note``.
    * ``"launches"``: the same N calls launched back to back between events.
    * ``"cold_l2"``: the L2 cache flushed (a buffer of at least twice its size written) before
      each single timed call; a cold-cache number, not comparable with the other two.
    * ``"autorange"`` (CPU, the only mode): one calibrated loop -- the number of calls per repeat
      grows until a repeat lasts at least ``min_sample_s`` -- timed with ``time.perf_counter``.

    Every mode reports the median over ``repeats`` of the seconds per call.
    """

    def __init__(self, target: str, mode: str | None = None, *, repeats: int | None = None, warmup: int = 3,
                 min_sample_s: float | None = None, max_calls: int = 1000, backend=None):
        if target not in MODES:
            raise ValueError(f"no timer for target {target!r}; expected one of {sorted(MODES)}")
        mode = MODES[target][0] if mode is None else mode
        if mode not in MODES[target]:
            raise ValueError(f"timing mode {mode!r} is not one of target {target!r}'s: {list(MODES[target])}")
        self.target = target
        self.mode = mode
        self.repeats = max(1, int(repeats if repeats is not None else (30 if mode == "cold_l2" else 10)))
        self.warmup = max(0, int(warmup))
        self.min_sample_s = float(min_sample_s if min_sample_s is not None else (2e-3 if target == "cpu" else 1e-3))
        self.max_calls = max(1, int(max_calls))
        self._backend = backend

    def __repr__(self):
        return f"Timer({self.target!r}, mode={self.mode!r}, repeats={self.repeats})"

    def _gpu(self):
        if self._backend is None:
            self._backend = _gpu_backend()
        return self._backend

    def time(self, fn: Callable[[int], Any], n_sets: int = 1, *, prune_above: float | None = None,
             deadline: float | None = None) -> Timing:
        """Time ``fn(i)`` (one call on input set ``i`` in ``range(n_sets)``).  ``prune_above``:
        raise :class:`Pruned` when the calibration's per-call estimate exceeds it (seconds);
        ``deadline``: a ``time.perf_counter()`` value after which :class:`DeadlineExceeded` is
        raised between repeats."""
        n_sets = max(1, int(n_sets))
        if self.target == "cpu":
            return self._autorange(fn, n_sets, prune_above, deadline)
        return self._cuda(fn, n_sets, prune_above, deadline)

    @staticmethod
    def _check(deadline):
        if deadline is not None and time.perf_counter() > deadline:
            raise DeadlineExceeded("timing ran past its deadline")

    def _done(self, samples, mode, calls, note="") -> Timing:
        return Timing(float(statistics.median(samples)), samples, mode, calls, self.target, note)

    def _autorange(self, fn, n_sets, prune_above, deadline) -> Timing:
        clock = time.perf_counter
        k = 0
        for _ in range(self.warmup):
            fn(k % n_sets)
            k += 1

        def loop(number):
            nonlocal k
            t0 = clock()
            for _ in range(number):
                fn(k % n_sets)
                k += 1
            return (clock() - t0) / number

        number = 1
        while True:   # calibrate: 1, 2, 5, 10, 20, 50, ... calls until one repeat is long enough
            per_call = loop(number)
            if prune_above is not None and per_call > prune_above:
                raise Pruned(per_call)
            if per_call * number >= self.min_sample_s or number >= self.max_calls:
                break
            self._check(deadline)
            want = math.ceil(self.min_sample_s / max(per_call, 1e-9) - 1e-6)
            number = min(self.max_calls, max(want, 2 * number))
        samples = []
        for _ in range(self.repeats):
            self._check(deadline)
            samples.append(loop(number))
        return self._done(samples, "autorange", number)

    def _cuda(self, fn, n_sets, prune_above, deadline) -> Timing:
        gpu = self._gpu()
        warm = max(self.warmup, n_sets)
        gpu.warm(lambda: [fn(i % n_sets) for i in range(warm)])
        start, end = gpu.events()

        def launches(number, first=0):
            start.record()
            for j in range(number):
                fn((first + j) % n_sets)
            end.record()
            return gpu.elapsed_s(start, end) / number

        if self.mode == "cold_l2":
            samples = []
            for r in range(self.repeats):
                self._check(deadline)
                gpu.flush_l2()
                samples.append(launches(1, r))
                if r == 0 and prune_above is not None and samples[0] > prune_above:
                    raise Pruned(samples[0])
            return self._done(samples, "cold_l2", 1)

        per_call = launches(n_sets)        # calibration: one pass over the input sets
        if prune_above is not None and per_call > prune_above:
            raise Pruned(per_call)
        number = int(min(self.max_calls, max(n_sets, math.ceil(self.min_sample_s / max(per_call, 1e-9) - 1e-6))))
        mode, note = self.mode, ""
        if mode == "graph":
            def body():
                for j in range(number):
                    fn(j % n_sets)
            try:
                replay = gpu.capture(body)
                replay()                    # one untimed replay (uploads the graph)
                gpu.synchronize()
            except Exception as e:  # noqa: BLE001 - any capture failure falls back, with its reason
                mode = "launches"
                note = f"CUDA graph capture failed ({type(e).__name__}: {str(e)[:300]}); timed back-to-back launches"
                gpu.synchronize()
            else:
                samples = []
                for _ in range(self.repeats):
                    self._check(deadline)
                    start.record()
                    replay()
                    end.record()
                    samples.append(gpu.elapsed_s(start, end) / number)
                return self._done(samples, "graph", number)
        samples = []
        for r in range(self.repeats):
            self._check(deadline)
            samples.append(launches(number, r * number))
        return self._done(samples, mode, number, note)


class Runner(Protocol):
    target: str

    def measure(self, op: SparseOp, config: Config, *, timeout: float | None = None,
                prune_above: float | None = None) -> MeasureResult: ...

    def baseline(self, op: SparseOp) -> MeasureResult: ...


class _Timeout(Exception):
    pass


class _Pruned(Exception):
    def __init__(self, estimate: float):
        self.estimate = estimate


def make_inputs(op: SparseOp, n_sets: int, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    """``n_sets`` independent random input tuples for ``op``: float32 arrays whose values are
    exactly representable in the op's dtype (so the float64 reference sees the inputs the kernel
    sees)."""
    rng = np.random.default_rng(seed)
    return [tuple(round_to(rng.standard_normal(s, dtype=np.float32), op.dtype) for s in op.input_shapes)
            for _ in range(n_sets)]


def build_timed(op: SparseOp, config: Config) -> tuple[CompiledModule, float, float]:
    """Replay ``config`` like :func:`spcompile.compile.build_from_config`, timing the pass
    pipeline (preprocessing) and the template build (compilation) separately."""
    from ..compile import build_from_config
    from ..passes import Pipeline
    from ..kernels import get_template

    tpl = get_template(config.template)
    if tpl.target != config.target:
        raise ValueError(f"template {tpl.name!r} is for target {tpl.target!r}, not {config.target!r}")
    if not tpl.available():
        raise RuntimeError(f"template {tpl.name!r} cannot be built on this machine")
    t0 = time.perf_counter()
    mod = Pipeline(config.pipeline)(SparseModule.from_op(op))
    t1 = time.perf_counter()
    cm = build_from_config(op, config, module=mod)
    t2 = time.perf_counter()
    return cm, t1 - t0, t2 - t1


def _short_error(e: BaseException) -> str:
    tb = traceback.format_exception_only(type(e), e)
    return "".join(tb).strip()[-2000:]


class _BaseRunner:
    """Shared flow: run the measurement in a worker thread with a deadline; failures as data."""

    target = "cpu"

    def __init__(self, *, warmup: int = 2, repeats: int = 7, n_input_sets: int = 3, min_repeat_s: float = 2e-3,
                 max_number: int = 1000, rtol: float | None = None, seed: int = 0, prune_factor: float = 3.0,
                 default_timeout: float | None = 120.0):
        self.warmup = max(0, int(warmup))
        self.repeats = max(1, int(repeats))
        self.n_input_sets = max(3, int(n_input_sets))
        self.min_repeat_s = float(min_repeat_s)
        self.max_number = max(1, int(max_number))
        self.rtol = rtol
        self.seed = seed
        self.prune_factor = prune_factor
        self.default_timeout = default_timeout
        self._cache: dict[int, tuple] = {}  # id(op) -> (op, inputs, refs)

    # inputs and references are made once per op (float64 reference of every set)
    def _data(self, op: SparseOp):
        hit = self._cache.get(id(op))
        if hit is not None and hit[0] is op:
            return hit[1], hit[2]
        inputs = make_inputs(op, self.n_input_sets, self.seed)
        refs = [reference.run(op.op, op.reduce, op.A, *ins) for ins in inputs[:2]]
        if len(self._cache) > 8:
            self._cache.clear()
        self._cache[id(op)] = (op, inputs, refs)
        return inputs, refs

    def _tol(self, op: SparseOp, cm=None) -> float:
        """The caller's rtol, else the looser of the tolerances of the precision the config computes
        in and of the op's dtype (a 16-bit result is rounded once)."""
        if self.rtol is not None:
            return self.rtol
        prec = cm.config.precision if cm is not None else "fp32"
        return max(numerics.tolerance(prec), numerics.tolerance(op.dtype))

    def measure(self, op: SparseOp, config: Config, *, timeout: float | None = None,
                prune_above: float | None = None) -> MeasureResult:
        timeout = self.default_timeout if timeout is None else timeout
        deadline = None if timeout is None else time.perf_counter() + timeout
        box: dict[str, Any] = {}
        cancel = threading.Event()

        def work():
            try:
                box["res"] = self._measure(op, config, deadline, prune_above, cancel)
            except BaseException as e:  # noqa: BLE001 - failures are data
                box["res"] = MeasureResult(RUN_ERROR, error=_short_error(e), config=config)

        th = threading.Thread(target=work, name="spcompile-measure", daemon=True)
        th.start()
        try:
            th.join(None if timeout is None else timeout + 1.0)
        except BaseException:
            cancel.set()
            raise
        if th.is_alive():  # a hung compile or kernel: give up on it, the search goes on
            cancel.set()
            return MeasureResult(TIMEOUT, error=f"no result within {timeout:.1f} s", config=config)
        return box["res"]

    def _check_deadline(self, deadline, cancel):
        if cancel.is_set() or (deadline is not None and time.perf_counter() > deadline):
            raise _Timeout()

    def _measure(self, op, config, deadline, prune_above, cancel) -> MeasureResult:
        try:
            cm, pre_s, comp_s = build_timed(op, config)
        except BaseException as e:  # noqa: BLE001
            return MeasureResult(COMPILE_ERROR, error=_short_error(e), config=config)
        base = dict(preprocess_s=pre_s, compile_s=comp_s, config=cm.config)
        try:
            self._check_deadline(deadline, cancel)
            err = self._check(op, cm)
            tol = self._tol(op, cm)
            if not (err <= tol):
                return MeasureResult(WRONG_RESULT, rel_error=err, error=f"relative error {err:.3g} > "
                                     f"tolerance {tol:.1g}", **base)
            samples = self._time(op, cm, deadline, prune_above, cancel)
        except _Timeout:
            return MeasureResult(TIMEOUT, error="measurement ran past the trial's time limit", **base)
        except _Pruned as p:
            return MeasureResult(PRUNED, kernel_s=p.estimate, rel_error=err, **base)
        except BaseException as e:  # noqa: BLE001
            return MeasureResult(RUN_ERROR, error=_short_error(e), **base)
        return MeasureResult(OK, kernel_s=float(statistics.median(samples)), rel_error=err, samples=samples, **base)

    def _check(self, op, cm) -> float:
        raise NotImplementedError

    def _time(self, op, cm, deadline, prune_above, cancel) -> list[float]:
        raise NotImplementedError


class CPURunner(_BaseRunner):
    """Host runner: numpy inputs, ``time.perf_counter``, warm-up, median of repeats, each
    repeat a calibrated number of calls rotating over >= 3 input sets."""

    target = "cpu"

    def _check(self, op, cm) -> float:
        inputs, refs = self._data(op)
        worst = 0.0
        for ins, ref in zip(inputs, refs):
            out = np.full(op.output_shape, np.nan, dtype=np.float32)  # poisoned: unwritten entries fail
            cm.kernel(*ins, out=out)
            worst = max(worst, reference.rel_error(out, ref))
        return worst

    def _time(self, op, cm, deadline, prune_above, cancel) -> list[float]:
        inputs, _ = self._data(op)
        outs = [np.empty(op.output_shape, dtype=np.float32) for _ in inputs]
        fn = cm.kernel
        n = len(inputs)
        for i in range(self.warmup):
            fn(*inputs[i % n], out=outs[i % n])
        t0 = time.perf_counter()
        fn(*inputs[0], out=outs[0])
        one = time.perf_counter() - t0
        if prune_above is not None and one > self.prune_factor * prune_above:
            raise _Pruned(one)
        number = int(min(self.max_number, max(1, math.ceil(self.min_repeat_s / max(one, 1e-9)))))
        samples = []
        for r in range(self.repeats):
            self._check_deadline(deadline, cancel)
            t0 = time.perf_counter()
            for j in range(number):
                k = (r * number + j) % n
                fn(*inputs[k], out=outs[k])
            samples.append((time.perf_counter() - t0) / number)
            if r == 1 and prune_above is not None and min(samples) > self.prune_factor * prune_above:
                raise _Pruned(min(samples))
        return samples

    def baseline(self, op: SparseOp) -> MeasureResult:
        """scipy CSR @ dense for SpMM-sum (single-threaded vendor-style baseline); the default
        heuristic config for every other op."""
        if op.op == "spmm" and op.reduce == "sum":
            S = op.A.to_scipy()
            inputs, refs = self._data(op)
            err = reference.rel_error(S @ inputs[0][0], refs[0])
            for i in range(self.warmup):
                S @ inputs[i % len(inputs)][0]
            t0 = time.perf_counter()
            S @ inputs[0][0]
            one = time.perf_counter() - t0
            number = int(min(self.max_number, max(1, math.ceil(self.min_repeat_s / max(one, 1e-9)))))
            samples = []
            for r in range(self.repeats):
                t0 = time.perf_counter()
                for j in range(number):
                    S @ inputs[(r * number + j) % len(inputs)][0]
                samples.append((time.perf_counter() - t0) / number)
            return MeasureResult(OK, kernel_s=float(statistics.median(samples)), rel_error=err,
                                 samples=samples, name="scipy.csr_matmul")
        from ..compile import default_config

        cfg = default_config(op, "cpu")
        res = self.measure(op, cfg)
        res.name = f"default:{cfg.template}"
        return res


class CUDARunner(_BaseRunner):
    """GPU runner (CuPy): result checked against the float64 reference with the output poisoned
    with NaN, then timed with CUDA events, the L2 cache flushed before every timed launch
    (``flush_l2=True``) or, without flushing, many launches rotating over the input sets."""

    target = "cuda"

    def __init__(self, *, flush_l2: bool = True, repeats: int = 30, warmup: int = 3, **kw):
        super().__init__(repeats=repeats, warmup=warmup, **kw)
        self.flush_l2 = flush_l2
        self._flush_buf = None
        self._dev_cache: dict[int, tuple] = {}

    def _dev_inputs(self, op):
        import cupy as cp

        hit = self._dev_cache.get(id(op))
        if hit is not None and hit[0] is op:
            return hit[1]
        inputs, _ = self._data(op)
        dev = [tuple(self._to_device(x, op.dtype) for x in ins) for ins in inputs]
        self._dev_cache = {id(op): (op, dev)}
        return dev

    @staticmethod
    def _to_device(x, dtype: str):
        """A device array of ``dtype``: CuPy for float32/float16, a torch tensor for bfloat16
        (CuPy has no bfloat16); the kernels take either."""
        import cupy as cp

        if dtype == "bfloat16":
            import torch

            return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).cuda().to(torch.bfloat16)
        return cp.asarray(np.ascontiguousarray(x, dtype=np.dtype(dtype)))

    @staticmethod
    def _out(op, fill=None):
        if op.dtype == "bfloat16":
            import torch

            o = torch.empty(op.output_shape, dtype=torch.bfloat16, device="cuda")
            return o.fill_(fill) if fill is not None else o
        import cupy as cp

        o = cp.empty(op.output_shape, dtype=np.dtype(op.dtype))
        if fill is not None:
            o.fill(fill)
        return o

    @staticmethod
    def _host(out) -> np.ndarray:
        import cupy as cp

        if isinstance(out, cp.ndarray):
            return cp.asnumpy(out).astype(np.float32)
        return out.float().cpu().numpy()

    def _flush(self):
        import cupy as cp

        if self._flush_buf is None:
            try:
                l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id).get("l2CacheSize", 0))
            except Exception:
                l2 = 0
            self._flush_buf = cp.empty(max(2 * l2, 64 << 20) // 4, dtype=cp.float32)
        self._flush_buf.fill(0)

    def _check(self, op, cm) -> float:
        import cupy as cp

        dev = self._dev_inputs(op)
        _, refs = self._data(op)
        worst = 0.0
        for ins, ref in zip(dev, refs):
            out = self._out(op, float("nan"))  # poisoned: unwritten entries fail
            cm.kernel(*ins, out=out)
            cp.cuda.runtime.deviceSynchronize()  # surfaces launch errors here
            worst = max(worst, reference.rel_error(self._host(out), ref))
        return worst

    def _time(self, op, cm, deadline, prune_above, cancel) -> list[float]:
        import cupy as cp

        dev = self._dev_inputs(op)
        outs = [self._out(op) for _ in dev]
        fn = cm.kernel
        n = len(dev)
        for i in range(self.warmup):
            fn(*dev[i % n], out=outs[i % n])
        cp.cuda.runtime.deviceSynchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()

        def timed(number: int, first: int) -> float:
            if self.flush_l2:
                self._flush()
            start.record()
            for j in range(number):
                k = (first + j) % n
                fn(*dev[k], out=outs[k])
            end.record()
            end.synchronize()
            return cp.cuda.get_elapsed_time(start, end) * 1e-3 / number

        one = timed(1, 0)
        if prune_above is not None and one > self.prune_factor * prune_above:
            raise _Pruned(one)
        # with flushing, each sample is one cold launch; without, enough launches to fill min_repeat_s
        number = 1 if self.flush_l2 else int(min(self.max_number, max(1, math.ceil(self.min_repeat_s / max(one, 1e-9)))))
        samples = []
        for r in range(self.repeats):
            self._check_deadline(deadline, cancel)
            samples.append(timed(number, r * number))
        return samples

    def baseline(self, op: SparseOp) -> MeasureResult:
        """The template ``extern.cusparse`` when registered and available, else the default config."""
        from ..compile import default_config
        from ..kernels import get_template

        try:
            tpl = get_template("extern.cusparse")
            mod = SparseModule.from_op(op)
            if tpl.available() and tpl.supports(mod):
                res = self.measure(op, tpl.make_config(tpl.default_params(mod), (), "cuda"))
                res.name = tpl.name
                if res.ok:
                    return res
        except ValueError:
            pass
        cfg = default_config(op, "cuda")
        res = self.measure(op, cfg)
        res.name = f"default:{cfg.template}"
        return res


def make_runner(target: str, **kw) -> Runner:
    if target == "cpu":
        return CPURunner(**kw)
    if target == "cuda":
        return CUDARunner(**kw)
    raise ValueError(f"no runner for target {target!r}")
