"""Measurement: the one timing rule (:class:`Timer`) and the runners that build, check and time
a configuration for the tuner.

:class:`Timer` is how spcompile times anything -- the runner, the tuner, the benchmarks and the
docs all use it.  On CUDA its default ("graph") is what a deployed module costs: many calls of
``mod(X, out=Y)`` captured in one CUDA graph and replayed between events; "launches" times the
same calls launched back to back, "cold_l2" single calls after flushing the L2 cache.  On the
CPU it is one calibrated loop ("autorange").  Each reports the median of repeats, per call.

A runner (:class:`CPURunner`, :class:`CUDARunner`) checks the result first (output poisoned
with NaN, compared with the float64 reference) and only then times it, with the input sets
rotated; the pass pipeline (preprocessing) and the template build are timed apart.  By default
it measures in a worker process that a timeout or a crash stops for real.  A compile error,
launch error, timeout, crash or wrong result gives ``MeasureResult(ok=False, status=...,
error=...)`` -- never an exception.
"""
from __future__ import annotations

import itertools
import math
import os
import pickle
import statistics
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ..compile import build_from_config
from ..core import numerics, reference
from ..core.config import Config
from ..core.ir import SparseModule, SparseOp
from ..core.numerics import round_to
from ..kernels import get_template
from ..module import CompiledModule
from ..passes import run_prefixed

__all__ = ["Timer", "Timing", "MODES", "Pruned", "DeadlineExceeded", "MeasureResult", "Runner", "CPURunner",
           "CUDARunner", "make_runner", "build_timed", "make_inputs", "device_rel_error",
           "OK", "PRUNED", "COMPILE_ERROR", "RUN_ERROR", "WRONG_RESULT", "TIMEOUT"]

#: result statuses
OK, PRUNED, COMPILE_ERROR, RUN_ERROR, WRONG_RESULT, TIMEOUT = (
    "ok", "pruned", "compile_error", "run_error", "wrong_result", "timeout")


@dataclass
class MeasureResult:
    """One measurement: ``ok`` with kernel seconds (median per call), or a failure ``status``
    ("compile_error", "run_error", "wrong_result", "timeout") with its ``error`` text.
    ``status == "pruned"`` means timing was cut short because the config was clearly slow;
    ``kernel_s`` is then the estimate that showed it.  ``mode`` is the :class:`Timer` mode that
    measured it; ``note`` says why it differs from the mode asked for."""

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
    mode: str = ""     # the Timer mode that measured it (or would have)
    note: str = ""     # why the Timer used another mode than asked ("" when it did not)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        return {"status": self.status, "kernel_ms": self.kernel_s * 1e3 if math.isfinite(self.kernel_s) else None,
                "preprocess_ms": self.preprocess_s * 1e3, "compile_ms": self.compile_s * 1e3,
                "rel_error": self.rel_error, "error": self.error[-2000:], "name": self.name,
                "timing_mode": self.mode, "timing_note": self.note}


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
                # the calibration above includes the launch cost from Python, which a replay does
                # not pay: measure one replay and capture again with enough calls when it is short
                start.record()
                replay()
                end.record()
                per_replay = gpu.elapsed_s(start, end)
                if per_replay < self.min_sample_s and number < self.max_calls:
                    want = math.ceil(number * self.min_sample_s / max(per_replay, 1e-9) * 1.1)
                    number = int(min(self.max_calls, max(want, number + 1)))
                    replay = gpu.capture(body)
                    replay()
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


def make_inputs(op: SparseOp, n_sets: int, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    """``n_sets`` independent random input tuples for ``op``: float32 arrays (float64 for a float64
    op) whose values are exactly representable in the op's dtype (so the float64 reference sees
    the inputs the kernel sees).  Set ``i`` is drawn from the ``i``-th child of ``seed``'s
    ``SeedSequence`` (so fewer sets are a prefix of more), large sets on several threads."""
    from ..core.reference import PARALLEL_WORK, host_threads

    def one(child) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng(child)
        return tuple(round_to(rng.standard_normal(s, dtype=np.float32), op.dtype) for s in op.input_shapes)

    children = np.random.SeedSequence(seed).spawn(n_sets)
    size = sum(int(np.prod(s)) for s in op.input_shapes)
    threads = min(host_threads(), n_sets)
    if threads <= 1 or size < PARALLEL_WORK:
        return [one(c) for c in children]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(one, children))


def device_rel_error(out, ref) -> float:
    """:func:`spcompile.core.reference.rel_error` computed where ``out`` lives (a torch CUDA
    tensor, or a CuPy array: ``ref`` its float64 reference there): a non-finite output entry (NaN
    poison left unwritten, an overflow) makes it infinite; nothing is copied to the host."""
    if hasattr(out, "get"):   # CuPy
        import cupy as cp

        d = cp.nan_to_num(out.astype(cp.float64) - ref, nan=cp.inf)
        num, den = float(cp.linalg.norm(d)), float(cp.linalg.norm(ref))
    else:
        import torch

        d = torch.nan_to_num(out.double() - ref, nan=float("inf"))
        num, den = float(torch.linalg.vector_norm(d)), float(torch.linalg.vector_norm(ref))
    return num / den if den > 0 else num


class _BoundedCache(dict):
    """A dict of at most ``size`` entries: adding one more drops the oldest."""

    def __init__(self, size: int):
        super().__init__()
        self.size = max(1, int(size))

    def __setitem__(self, key, value):
        if key not in self:
            while len(self) >= self.size:
                self.pop(next(iter(self)))
        super().__setitem__(key, value)


def build_timed(op: SparseOp, config: Config, pipelines: dict | None = None,
                deadline: float | None = None) -> tuple[CompiledModule, float, float]:
    """Replay ``config`` like :func:`spcompile.compile.build_from_config`, timing the pass
    pipeline (preprocessing) and the template build (compilation) separately.  ``pipelines``: this
    op's cache of pipeline outputs (:func:`~spcompile.passes.run_prefixed`: a hit reuses the module
    and reports the seconds its pipeline took when it ran; a pipeline that starts with a cached one
    continues from that module).  ``deadline`` (perf_counter):
    :class:`DeadlineExceeded` when it has passed after the pipeline (the build is not started)."""
    tpl = get_template(config.template)
    if tpl.target != config.target:
        raise ValueError(f"template {tpl.name!r} is for target {tpl.target!r}, not {config.target!r}")
    if not tpl.available():
        raise RuntimeError(f"template {tpl.name!r} cannot be built on this machine")
    # a pipeline that starts with a cached one continues from it (RCM alone, then RCM + LSH +
    # SGT: RCM runs once); the seconds are the whole pipeline's
    mod, pre_s = run_prefixed(config.pipeline, SparseModule.from_op(op), {} if pipelines is None else pipelines)
    Timer._check(deadline)
    t1 = time.perf_counter()
    cm = build_from_config(op, config, module=mod)
    return cm, pre_s, time.perf_counter() - t1


def _short_error(e: BaseException) -> str:
    tb = traceback.format_exception_only(type(e), e)
    return "".join(tb).strip()[-2000:]


class Runner:
    """Measures one configuration: build it (pass pipeline and template build timed apart), check
    its result against the float64 reference with the output poisoned with NaN, then time the
    module call ``mod(X, out=Y)`` with the :class:`Timer` (``mode``: the timer's mode, None for
    the target's default).  Failures come back as data, never as exceptions::

        runner.measure(op, config, *, timeout=None, prune_above=None, stop_after=None) -> MeasureResult
        runner.baseline(op) -> MeasureResult          # .name says what was measured

    ``isolate=True`` (the default) measures in a worker process (spawned once and kept across
    measurements; the op's arrays are sent to it once per op).  A measurement that passes its
    ``timeout`` (build included) or a worker that dies (e.g. a kernel that crashes the process)
    ends that worker: the result is ``timeout`` / ``run_error`` with the reason, and the next
    measurement starts a fresh worker.  Templates and passes registered at run time in this process
    are registered in the worker too (they must be importable: defined at a module's top level).
    ``isolate=False`` measures in the calling process: the timeout is then only checked between
    steps and timing repeats, so a hung build or kernel blocks the caller.

    ``prune_above`` (seconds, the best kernel time so far): timing stops early with status
    ``pruned`` when the calibration estimate exceeds ``prune_factor`` times it."""

    target = "cpu"

    def __init__(self, *, mode: str | None = None, repeats: int | None = None, warmup: int = 3,
                 n_input_sets: int = 3, min_sample_s: float | None = None, max_calls: int = 1000,
                 rtol: float | None = None, seed: int = 0, prune_factor: float = 3.0,
                 default_timeout: float | None = 120.0, isolate: bool = True):
        self._settings = dict(mode=mode, repeats=repeats, warmup=warmup, n_input_sets=n_input_sets,
                              min_sample_s=min_sample_s, max_calls=max_calls, rtol=rtol, seed=seed,
                              prune_factor=prune_factor, default_timeout=default_timeout)
        self.timer = Timer(self.target, mode, repeats=repeats, warmup=warmup, min_sample_s=min_sample_s,
                           max_calls=max_calls)
        self.n_input_sets = max(3, int(n_input_sets))
        self.rtol = rtol
        self.seed = seed
        self.prune_factor = float(prune_factor)
        self.default_timeout = default_timeout
        self.isolate = bool(isolate)
        self._worker: _Worker | None = None
        self._cache: dict[int, tuple] = {}   # id(op) -> (op, inputs, refs)
        # the pass pipelines' outputs of the last op measured (a study measures many configs behind
        # a few pipelines; RCM on a 1.7M-nonzero graph takes 0.3 s a run): id(op) -> (op, {key: ..})
        self._pipes: tuple = (None, {})

    @property
    def mode(self) -> str:
        """The timing mode asked for (a result's ``mode`` says which one measured it)."""
        return self.timer.mode

    def __repr__(self):
        return f"{type(self).__name__}(mode={self.mode!r}, isolate={self.isolate})"

    # -- the public protocol ------------------------------------------------------------------
    #: ``measure`` takes ``stop_after`` (the tuner's deadline cuts without stopping the worker)
    soft_stops = True

    def measure(self, op: SparseOp, config: Config, *, timeout: float | None = None,
                prune_above: float | None = None, stop_after: float | None = None) -> MeasureResult:
        """``stop_after``: seconds after which the measurement gives up at its next step (after the
        pass pipeline, after the build, between timing repeats) with a ``timeout`` result, the
        worker kept; ``timeout`` stops the worker itself."""
        timeout = self.default_timeout if timeout is None else timeout
        if self._isolated():
            return self._remote(("measure", config, timeout, prune_above, stop_after), op, config, timeout)
        return self._measure_here(op, config, _deadline(timeout, stop_after), prune_above)

    def baseline(self, op: SparseOp) -> MeasureResult:
        """The vendor-style reference time (see the target's runner)."""
        if self._isolated():
            res = self._remote(("baseline",), op, None, self.default_timeout)
            if not res.name:
                res.name = "baseline"
            return res
        return self._baseline_here(op)

    def prestart(self) -> None:
        """Start the measuring worker now without waiting for it (its imports then overlap with the
        caller's work); the first measurement waits for it.  Nothing to do in-process."""
        if self._isolated() and (self._worker is None or not self._worker.alive()):
            if self._worker is not None:
                self._worker.close()
            self._worker = _Worker(type(self), self._settings, wait=False)

    def close(self) -> None:
        """Stop the worker process (a later measurement starts a new one)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the worker process -------------------------------------------------------------------
    def _isolated(self) -> bool:
        return bool(self.isolate)

    def _remote(self, request: tuple, op: SparseOp, config: Config | None, timeout: float | None) -> MeasureResult:
        if self._worker is None or not self._worker.alive():
            if self._worker is not None:
                self._worker.close()
            self._worker = _Worker(type(self), self._settings)
        w = self._worker
        try:
            reply = w.request(request, op, config, None if timeout is None else timeout + _slack(timeout))
        except _WorkerTimeout:
            self.close()
            return MeasureResult(TIMEOUT, error=f"no result within {timeout:.1f} s; the measuring process was "
                                 "stopped", config=config, mode=self.mode)
        except _WorkerDied as e:
            self.close()
            return MeasureResult(RUN_ERROR, error=f"the measuring process died ({e}) while measuring this "
                                 "configuration", config=config, mode=self.mode)
        except BaseException:   # Ctrl-C and the like: the work in flight is abandoned with its worker
            self.close()
            raise
        return reply

    # -- in this process ----------------------------------------------------------------------
    def _data(self, op: SparseOp):
        """Inputs (``n_input_sets`` sets) and float64 references, made once per op."""
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
        return numerics.result_tolerance(prec, op.dtype)

    def _time(self, op, fn, n, prune_above, deadline) -> Timing:
        limit = None if prune_above is None else self.prune_factor * prune_above
        return self.timer.time(fn, n, prune_above=limit, deadline=deadline)

    #: pipeline outputs kept per op (least recently added dropped first)
    PIPELINE_CACHE = 4

    def _pipelines(self, op) -> dict:
        if self._pipes[0] is not op:
            self._pipes = (op, _BoundedCache(self.PIPELINE_CACHE))
        return self._pipes[1]

    def _measure_here(self, op, config, deadline, prune_above) -> MeasureResult:
        try:
            cm, pre_s, comp_s = build_timed(op, config, self._pipelines(op), deadline)
        except DeadlineExceeded:
            return MeasureResult(TIMEOUT, error="the pass pipeline ran past the trial's time limit", config=config,
                                 mode=self.mode)
        except BaseException as e:  # noqa: BLE001 - failures are data
            if isinstance(e, KeyboardInterrupt):
                raise
            return MeasureResult(COMPILE_ERROR, error=_short_error(e), config=config, mode=self.mode)
        base = dict(preprocess_s=pre_s, compile_s=comp_s, config=cm.config)
        err = None
        try:
            Timer._check(deadline)
            err = self._check(op, cm)
            tol = self._tol(op, cm)
            if not (err <= tol):
                return MeasureResult(WRONG_RESULT, rel_error=err, error=f"relative error {err:.3g} > "
                                     f"tolerance {tol:.1g}", mode=self.mode, **base)
            fn, n = self._call(op, cm)
            t = self._time(op, fn, n, prune_above, deadline)
        except DeadlineExceeded:
            return MeasureResult(TIMEOUT, error="measurement ran past the trial's time limit", mode=self.mode, **base)
        except Pruned as p:
            return MeasureResult(PRUNED, kernel_s=p.estimate, rel_error=err, mode=self.mode, **base)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001
            return MeasureResult(RUN_ERROR, error=_short_error(e), mode=self.mode, **base)
        return MeasureResult(OK, kernel_s=t.seconds, rel_error=err, samples=t.samples, mode=t.mode,
                             note=t.note, **base)

    def _check(self, op, cm) -> float:
        """The worst relative error over the checked input sets (output poisoned with NaN)."""
        raise NotImplementedError

    def _call(self, op, cm) -> tuple[Callable[[int], Any], int]:
        """``(fn, n)``: ``fn(i)`` calls the module once on input set ``i < n``, as deployed code does."""
        raise NotImplementedError

    def _baseline_here(self, op) -> MeasureResult:
        raise NotImplementedError

    def _default_baseline(self, op) -> MeasureResult:
        from ..compile import default_config

        cfg = default_config(op, self.target)
        res = self.measure(op, cfg)
        res.name = f"default:{cfg.template}"
        return res


class CPURunner(Runner):
    """Host runner: numpy inputs, the module called as ``mod(X, out=Y)``, timed by the CPU
    :class:`Timer` (autorange).  Baseline: scipy's CSR product for SpMM-sum."""

    target = "cpu"

    def _check(self, op, cm) -> float:
        inputs, refs = self._data(op)
        worst = 0.0
        for ins, ref in zip(inputs, refs):
            out = np.full(op.output_shape, np.nan, dtype=op.dtype)  # poisoned: unwritten entries fail
            cm(*ins, out=out)
            worst = max(worst, reference.rel_error(out, ref))
        return worst

    def _call(self, op, cm):
        inputs, _ = self._data(op)
        outs = [np.empty(op.output_shape, dtype=op.dtype) for _ in inputs]
        return (lambda i: cm(*inputs[i], out=outs[i])), len(inputs)

    def _baseline_here(self, op: SparseOp) -> MeasureResult:
        """scipy CSR @ dense for SpMM-sum (single-threaded vendor-style baseline); the default
        heuristic config for every other op."""
        if not (op.op == "spmm" and op.reduce == "sum"):
            return self._default_baseline(op)
        S = op.A.to_scipy()
        inputs, refs = self._data(op)
        try:
            err = reference.rel_error(S @ inputs[0][0], refs[0])
            t = self.timer.time(lambda i: S @ inputs[i][0], len(inputs))
        except Exception as e:  # noqa: BLE001
            return MeasureResult(RUN_ERROR, error=_short_error(e), name="scipy.csr_matmul", mode=self.mode)
        return MeasureResult(OK, kernel_s=t.seconds, rel_error=err, samples=t.samples, name="scipy.csr_matmul",
                             mode=t.mode, note=t.note)


class CUDARunner(Runner):
    """GPU runner: inputs on the device as torch CUDA tensors when torch is importable (the
    deployed fast path of ``mod(X, out=Y)``), else CuPy arrays; result checked against the float64
    reference on the device (the references are uploaded once per op when they take at most
    ``DEVICE_CHECK_FRACTION`` of the free GPU memory; else on the host); timed by the CUDA :class:`Timer` (default: CUDA-graph replay; pass
    ``mode="cold_l2"`` for cold-cache single calls).  Baseline: ``extern.cusparse`` when available,
    else the default config.  Pruning: a config whose calibration pass (one timed pass over the
    input sets, after warm-up) is over twice the best kernel time so far is pruned (``prune_factor``
    2; the CPU runner's first estimate is a single call, noisier: 3 there)."""

    target = "cuda"

    #: float64 references (and the check's two temporaries of one output's size) are kept on the
    #: GPU when they take at most this fraction of its free memory: the check then copies nothing
    #: to the host (a 335k x 128 output is 171 MB; two host copies and norms took ~0.4 s a config)
    DEVICE_CHECK_FRACTION = 0.25

    def __init__(self, **kw):
        kw.setdefault("prune_factor", 2.0)
        super().__init__(**kw)
        self._dev_cache: dict[int, tuple] = {}
        self._ref_cache: tuple = (None, None)    # (op, float64 references on the device, or None)

    @staticmethod
    def _torch():
        try:
            import torch
        except ImportError:
            return None
        return torch if torch.cuda.is_available() else None

    def _dev_inputs(self, op):
        hit = self._dev_cache.get(id(op))
        if hit is not None and hit[0] is op:
            return hit[1]
        inputs, _ = self._data(op)
        torch = self._torch()
        if torch is not None:
            dt = getattr(torch, op.dtype)
            dev = [tuple(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).cuda().to(dt) for x in ins)
                   for ins in inputs]
        else:
            if op.dtype == "bfloat16":
                raise RuntimeError("bfloat16 workloads are measured through torch CUDA tensors, and torch "
                                   "is not importable here (CuPy has no bfloat16)")
            import cupy as cp

            dev = [tuple(cp.asarray(np.ascontiguousarray(x, dtype=np.dtype(op.dtype))) for x in ins)
                   for ins in inputs]
        self._dev_cache = {id(op): (op, dev)}
        return dev

    def _out(self, op, fill=None):
        torch = self._torch()
        if torch is not None:
            o = torch.empty(op.output_shape, dtype=getattr(torch, op.dtype), device="cuda")
            return o.fill_(fill) if fill is not None else o
        import cupy as cp

        o = cp.empty(op.output_shape, dtype=np.dtype(op.dtype))
        if fill is not None:
            o.fill(fill)
        return o

    def _sync(self):
        torch = self._torch()
        if torch is not None:
            torch.cuda.synchronize()
        else:
            import cupy as cp

            cp.cuda.runtime.deviceSynchronize()

    @staticmethod
    def _host(out) -> np.ndarray:
        if hasattr(out, "get"):   # CuPy
            return out.get().astype(np.float32)
        return out.float().cpu().numpy()

    def _dev_refs(self, op):
        """The float64 references on the device (uploaded once per op), or None when they would
        take more than ``DEVICE_CHECK_FRACTION`` of the free GPU memory."""
        if self._ref_cache[0] is op:
            return self._ref_cache[1]
        _, refs = self._data(op)
        need = (len(refs) + 2) * max((r.size for r in refs), default=0) * 8
        dev = None
        torch = self._torch()
        if torch is not None:
            free, _ = torch.cuda.mem_get_info()
            if need <= self.DEVICE_CHECK_FRACTION * free:
                dev = [torch.from_numpy(np.ascontiguousarray(r, dtype=np.float64)).cuda() for r in refs]
        else:
            import cupy as cp

            free, _ = cp.cuda.runtime.memGetInfo()
            if need <= self.DEVICE_CHECK_FRACTION * free:
                dev = [cp.asarray(np.ascontiguousarray(r, dtype=np.float64)) for r in refs]
        self._ref_cache = (op, dev)
        return dev

    def _check(self, op, cm) -> float:
        dev = self._dev_inputs(op)
        _, refs = self._data(op)
        drefs = self._dev_refs(op)
        worst = 0.0
        for i, (ins, ref) in enumerate(zip(dev, refs)):
            out = self._out(op, float("nan"))  # poisoned: unwritten entries fail
            cm(*ins, out=out)
            self._sync()  # surfaces launch errors here
            err = device_rel_error(out, drefs[i]) if drefs is not None else \
                reference.rel_error(self._host(out), ref)
            worst = max(worst, err)
        return worst

    def _call(self, op, cm):
        dev = self._dev_inputs(op)
        outs = [self._out(op) for _ in dev]
        return (lambda i: cm(*dev[i], out=outs[i])), len(dev)

    def _baseline_here(self, op: SparseOp) -> MeasureResult:
        from ..kernels import get_template

        try:
            tpl = get_template("extern.cusparse")
        except ValueError:
            tpl = None
        if tpl is not None:
            mod = SparseModule.from_op(op)
            if tpl.available() and tpl.supports(mod):
                res = self.measure(op, tpl.make_config(tpl.default_params(mod), (), "cuda", op.dtype))
                res.name = tpl.name
                if res.ok:
                    return res
        return self._default_baseline(op)


def make_runner(target: str, **kw) -> Runner:
    """The runner of ``target`` ("cpu" or "cuda"); ``kw`` go to :class:`Runner`."""
    if target == "cpu":
        return CPURunner(**kw)
    if target == "cuda":
        return CUDARunner(**kw)
    raise ValueError(f"no runner for target {target!r}")


# ---------------------------------------------------------------------------------------------
# The measuring worker process
# ---------------------------------------------------------------------------------------------
def _deadline(timeout: float | None, stop_after: float | None) -> float | None:
    """The measurement's deadline (perf_counter) from its limits in seconds (None: none)."""
    limits = [t for t in (timeout, stop_after) if t is not None]
    return time.perf_counter() + min(limits) if limits else None


def _slack(timeout: float) -> float:
    """Time beyond a measurement's timeout before its worker is stopped (the worker's own deadline
    checks usually answer first, with the build times)."""
    return min(2.0, 0.5 + 0.1 * timeout)


_START_S = 300.0      # a worker's start-up (imports; CUDA and TVM initialise lazily later)


class _WorkerTimeout(Exception):
    pass


class _WorkerDied(Exception):
    pass


def _registrations(config: Config | None) -> list[tuple]:
    """The template and passes ``config`` names, as objects the worker can register (pickled by
    reference, so they must be importable); the worker registers those it lacks."""
    if config is None:
        return []
    from ..kernels import base as kbase
    from ..passes import base as pbase

    out: list[tuple] = []
    tpl = kbase._TEMPLATES.get(config.template)
    if tpl is not None:
        out.append(("template", config.template, type(tpl)))
    for item in config.pipeline:
        name = item["name"] if isinstance(item, Mapping) else str(item)
        cls = pbase._REGISTRY.get(name)
        if cls is None:
            continue
        if issubclass(cls, pbase.FunctionPass) and cls.__module__ == pbase.__name__:
            out.append(("function_pass", name, (cls.func, dict(cls.default_options), tuple(cls.requires),
                                                 tuple(cls.produces))))
        else:
            out.append(("pass_class", name, cls))
    return out


def _picklable(obj) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - e.g. a class defined inside a function
        return False
    return True


def _register(items) -> None:
    from ..kernels import base as kbase
    from ..passes import base as pbase

    kbase._load_builtin()
    pbase._load_builtin()
    for kind, name, payload in items:
        if kind == "template" and name not in kbase._TEMPLATES:
            kbase.register_template(payload)
        elif kind == "function_pass" and name not in pbase._REGISTRY:
            func, options, requires, produces = payload
            pbase.register_pass(name, options=options, requires=requires, produces=produces)(func)
        elif kind == "pass_class" and name not in pbase._REGISTRY:
            pbase.register_pass(name)(payload)


def _worker_main(conn, runner_cls, settings) -> None:
    """The worker's loop: ``op`` messages install the op; ``measure`` / ``baseline`` requests are
    answered with a :class:`MeasureResult`.  Ctrl-C is left to the parent, which stops us."""
    import signal

    from ..kernels import base as kbase

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    runner = runner_cls(**settings, isolate=False)
    ops: dict[int, SparseOp] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "op":
            ops = {msg[1]: msg[2]}
            continue
        _, token, regs, request = msg
        try:
            _register(regs)
            op = ops[token]
            if request[0] == "measure":
                _, config, timeout, prune_above, stop_after = request
                if config.template not in kbase._TEMPLATES:
                    raise ValueError(f"template {config.template!r} is not registered in the measuring worker "
                                     "process: register it in a module the worker can import (a template class "
                                     "defined at a module's top level is sent over), or measure in-process with "
                                     "Runner(isolate=False)")
                res = runner.measure(op, config, timeout=timeout, prune_above=prune_above, stop_after=stop_after)
            else:
                res = runner.baseline(op)
        except BaseException as e:  # noqa: BLE001 - failures are data
            res = MeasureResult(RUN_ERROR, error=_short_error(e), config=request[1] if request[0] == "measure"
                                else None, mode=runner.mode)
        conn.send(res)


def _exit_reason(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Proc:
    """The measuring process: a fresh interpreter (``python -c``; never a fork -- CUDA does not
    survive one -- and, unlike multiprocessing's spawn, it does not re-import the caller's
    ``__main__``, so a script that tunes at its top level works) talking over a socket pair."""

    def __init__(self, runner_cls, settings):
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        parent, child = socket.socketpair()
        env = dict(os.environ)
        # the child sees the modules the caller sees (sys.path may have been extended at run time)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        code = "import sys; from spcompile.autotune.measure import _worker_entry; _worker_entry(int(sys.argv[1]))"
        self.popen = subprocess.Popen([sys.executable, "-c", code, str(child.fileno())], pass_fds=(child.fileno(),),
                                      stdin=subprocess.DEVNULL, env=env)
        child.close()
        self.conn = Connection(os.dup(parent.fileno()))
        parent.close()
        self.conn.send((runner_cls, settings))

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self):
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        import subprocess

        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()


def _worker_entry(fd: int) -> None:
    """Entry point of the measuring process (see :class:`_Proc`)."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    runner_cls, settings = conn.recv()
    _worker_main(conn, runner_cls, settings)


class _Worker:
    """One measuring process (:class:`_Proc`) and its connection."""

    _tokens = itertools.count(1)

    def __init__(self, runner_cls, settings, wait: bool = True):
        self.proc = _Proc(runner_cls, settings)
        self.conn = self.proc.conn
        self._finalizer = weakref.finalize(self, _Worker._shutdown, self.proc, self.conn)
        self._op = None          # (op, token) the worker holds
        self._registered: set = set()
        self._started = False
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait for the worker's "ready" (its imports done); a worker that does not start is closed."""
        if self._started:
            return
        try:
            if not self.conn.poll(_START_S):
                raise _WorkerTimeout()
            self.conn.recv()
        except (_WorkerTimeout, EOFError, OSError):
            code = self.proc.exitcode
            self.close()
            raise RuntimeError(f"the measuring worker process did not start ({_exit_reason(code)}); "
                               "Runner(isolate=False) measures in this process instead") from None
        self._started = True

    def alive(self) -> bool:
        return self.proc.is_alive()

    def request(self, request: tuple, op: SparseOp, config: Config | None, wait: float | None):
        self.wait_started()
        try:
            if self._op is None or self._op[0] is not op:
                token = next(self._tokens)
                self.conn.send(("op", token, op))
                self._op = (op, token)
            regs = [r for r in _registrations(config) if (r[0], r[1]) not in self._registered and _picklable(r)]
            self.conn.send(("request", self._op[1], regs, request))
            self._registered.update((r[0], r[1]) for r in regs)
            deadline = None if wait is None else time.monotonic() + wait
            while True:   # short polls: a dead worker is noticed at once
                left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if left <= 0:
                    raise _WorkerTimeout()
                if self.conn.poll(left):
                    return self.conn.recv()
                if not self.proc.is_alive():
                    raise EOFError
        except (EOFError, OSError):
            self.proc.join(1.0)
            raise _WorkerDied(_exit_reason(self.proc.exitcode)) from None

    def close(self):
        self._finalizer()

    @staticmethod
    def _shutdown(proc, conn):
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        try:
            conn.close()
        except OSError:
            pass
