"""The one timing rule (:class:`spcompile.autotune.measure.Timer`) and the runners built on it.

CPU: the autorange loop against a function of controlled cost, and the GPU modes' logic
(calibration, graph capture, fallback, cold-L2 flushing) against a fake GPU backend with a
virtual clock.  GPU (``@pytest.mark.gpu``): graph replay vs back-to-back launches on a real
module, and the fallback when capture fails."""
from __future__ import annotations

import time

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.autotune.measure import MODES, DeadlineExceeded, Pruned, Timer, Timing
from spcompile.runtime.target import cuda_available

from conftest import count_pass_runs


def busy(seconds: float):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


# -- CPU: autorange ------------------------------------------------------------------------------
def test_cpu_autorange_measures_the_cost_per_call():
    seen = []

    def fn(i):
        seen.append(i)
        busy(2e-4)

    t = Timer("cpu", repeats=5, min_sample_s=2e-3).time(fn, n_sets=3)
    assert isinstance(t, Timing) and t.mode == "autorange" and t.note == "" and t.target == "cpu"
    assert len(t.samples) == 5 and t.seconds == pytest.approx(float(np.median(t.samples)))
    assert 2e-4 <= t.seconds < 2e-3   # the busy wait is a floor; a loaded 2-core CI box stays far below 10x
    # one repeat lasts at least min_sample_s: about 10 calls of 0.2 ms
    assert t.calls_per_sample * 2e-4 >= 2e-3 * 0.9 and t.calls_per_sample <= 20
    assert set(seen) == {0, 1, 2}
    d = t.to_dict()
    assert d["mode"] == "autorange" and d["calls_per_sample"] == t.calls_per_sample and len(d["samples"]) == 5


def test_cpu_autorange_slow_call_is_timed_once_per_repeat():
    calls = []
    t = Timer("cpu", repeats=3, warmup=1, min_sample_s=1e-3).time(lambda i: (calls.append(i), busy(3e-3)))
    assert t.calls_per_sample == 1 and len(calls) == 1 + 1 + 3   # warm-up, calibration, repeats
    assert t.seconds >= 3e-3


def test_cpu_autorange_caps_the_calls_per_repeat():
    t = Timer("cpu", repeats=2, min_sample_s=10.0, max_calls=50).time(lambda i: None)
    assert t.calls_per_sample == 50


def test_timer_prunes_and_honours_the_deadline():
    with pytest.raises(Pruned) as e:
        Timer("cpu", repeats=50).time(lambda i: busy(2e-3), prune_above=1e-3)
    assert e.value.estimate >= 2e-3
    t0 = time.perf_counter()
    with pytest.raises(DeadlineExceeded):
        Timer("cpu", repeats=1000, min_sample_s=1e-2).time(lambda i: busy(1e-3), deadline=time.perf_counter() + 0.1)
    assert time.perf_counter() - t0 < 1.0


def test_timer_modes_and_bad_arguments():
    assert Timer("cpu").mode == "autorange" and Timer("cuda").mode == "graph"
    assert Timer("cuda", mode="cold_l2").repeats == 30 and Timer("cuda").repeats == 10
    assert MODES["cuda"] == ("graph", "launches", "cold_l2")
    with pytest.raises(ValueError, match="timing mode 'cold_l2'"):
        Timer("cpu", mode="cold_l2")
    with pytest.raises(ValueError, match="no timer for target"):
        Timer("tpu")


# -- GPU modes against a fake backend ----------------------------------------------------------
class FakeGPU:
    """A virtual device: a call of ``fn`` adds its cost to the clock; events read the clock; a
    captured graph replays the recorded calls at ``graph_speedup`` times their cost."""

    def __init__(self, cost=1e-5, capture_error=None, graph_speedup=1.0):
        self.clock = 0.0
        self.cost = cost
        self.capture_error = capture_error
        self.graph_speedup = graph_speedup
        self.capturing = None
        self.calls = []        # (input set, "eager" | "captured")
        self.flushes = 0
        self.log = []          # what happened, in order: "flush", "call", "replay"
        self.syncs = 0

    def run(self, i):
        if self.capturing is not None:
            self.capturing.append(i)
            self.calls.append((i, "captured"))
        else:
            self.clock += self.cost
            self.calls.append((i, "eager"))
            self.log.append("call")

    def synchronize(self):
        self.syncs += 1

    def warm(self, body):
        body()

    class Event:
        def __init__(self, gpu):
            self.gpu, self.t = gpu, None

        def record(self):
            self.t = self.gpu.clock

    def events(self):
        return self.Event(self), self.Event(self)

    def elapsed_s(self, start, end):
        return end.t - start.t

    def capture(self, body):
        self.capturing = []
        try:
            body()
            if self.capture_error:
                raise RuntimeError(self.capture_error)
        finally:
            recorded, self.capturing = self.capturing, None

        def replay():
            self.clock += len(recorded) * self.cost / self.graph_speedup
            self.log.append("replay")
        return replay

    def flush_l2(self):
        self.flushes += 1
        self.log.append("flush")


def test_graph_mode_captures_enough_calls_and_times_replays():
    gpu = FakeGPU(cost=1e-5, graph_speedup=2.0)
    t = Timer("cuda", repeats=4, warmup=2, backend=gpu).time(gpu.run, n_sets=3)
    assert t.mode == "graph" and t.note == ""
    # the eager calibration (10 us a call) asks for 100 calls; their replay lasts 0.5 ms (< 1 ms), so
    # the graph is captured again with enough calls (+10 %) for one replay to last >= 1 ms
    assert t.calls_per_sample == 220
    captured = [i for i, how in gpu.calls if how == "captured"]
    assert captured == [j % 3 for j in range(100)] + [j % 3 for j in range(220)]   # rotating over the sets
    assert gpu.log.count("replay") == 1 + 1 + 1 + 4      # upload, check, upload again, then the repeats
    assert len(t.samples) == 4 and t.seconds == pytest.approx(5e-6)   # the replayed cost per call
    assert t.seconds * t.calls_per_sample >= 1e-3
    assert gpu.flushes == 0


def test_graph_mode_keeps_a_long_enough_first_capture():
    gpu = FakeGPU(cost=1e-5, graph_speedup=1.0)
    t = Timer("cuda", repeats=3, warmup=2, backend=gpu).time(gpu.run, n_sets=3)
    assert t.mode == "graph" and t.calls_per_sample == 100
    assert gpu.log.count("replay") == 1 + 1 + 3          # upload, check, then the repeats


def test_graph_capture_failure_falls_back_to_launches_and_says_why():
    gpu = FakeGPU(cost=2e-5, capture_error="operation not permitted when stream is capturing")
    t = Timer("cuda", repeats=3, backend=gpu).time(gpu.run, n_sets=2)
    assert t.mode == "launches"
    assert "capture failed" in t.note and "not permitted" in t.note
    assert t.seconds == pytest.approx(2e-5) and t.calls_per_sample == 50 and len(t.samples) == 3
    assert "replay" not in gpu.log


def test_launches_mode_times_back_to_back_calls():
    gpu = FakeGPU(cost=4e-4)
    t = Timer("cuda", mode="launches", repeats=5, backend=gpu).time(gpu.run, n_sets=3)
    assert t.mode == "launches" and t.note == "" and t.calls_per_sample == 3   # >= n_sets, >= 1 ms
    assert t.seconds == pytest.approx(4e-4)
    assert not [c for c in gpu.calls if c[1] == "captured"]


def test_cold_l2_flushes_before_every_timed_call():
    gpu = FakeGPU(cost=1e-5)
    t = Timer("cuda", mode="cold_l2", repeats=6, warmup=1, backend=gpu).time(gpu.run, n_sets=3)
    assert t.mode == "cold_l2" and t.calls_per_sample == 1 and len(t.samples) == 6
    assert gpu.flushes == 6
    timed = gpu.log[gpu.log.index("flush"):]
    assert timed == ["flush", "call"] * 6
    assert [i for i, _ in gpu.calls[-6:]] == [0, 1, 2, 0, 1, 2]


def test_gpu_modes_prune_on_the_calibration():
    for mode in ("graph", "launches", "cold_l2"):
        gpu = FakeGPU(cost=1e-3)
        with pytest.raises(Pruned):
            Timer("cuda", mode=mode, backend=gpu).time(gpu.run, n_sets=3, prune_above=5e-4)
        assert "replay" not in gpu.log


# -- GPU: the real thing -------------------------------------------------------------------------
needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")]


@pytest.fixture
def cuda_spmm(no_tuning_db):
    """A real CUDA SpMM module with three input sets and outputs as torch tensors."""
    torch = pytest.importorskip("torch")
    import spcompile

    A = sp.random(30000, 30000, density=3e-4, format="csr", random_state=0, dtype=np.float32)
    mod = spcompile.build(A, "spmm", K=64, target="cuda")
    X = [torch.randn(30000, 64, device="cuda") for _ in range(3)]
    Y = [torch.empty(30000, 64, device="cuda") for _ in range(3)]
    return torch, mod, A, X, Y


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
def test_gpu_graph_and_launches_agree_on_a_real_module(cuda_spmm):
    torch, mod, A, X, Y = cuda_spmm
    fn = lambda i: mod(X[i], out=Y[i])  # noqa: E731
    g = Timer("cuda").time(fn, n_sets=3)
    la = Timer("cuda", mode="launches").time(fn, n_sets=3)
    cold = Timer("cuda", mode="cold_l2").time(fn, n_sets=3)
    assert g.mode == "graph" and g.note == "", g.note
    assert la.mode == "launches" and cold.mode == "cold_l2" and cold.calls_per_sample == 1
    assert g.calls_per_sample * g.seconds >= 0.9e-3 or g.calls_per_sample == 1000
    assert 0.5 < g.seconds / la.seconds < 2.0, (g.seconds, la.seconds)
    assert all(s > 0 for s in g.samples + la.samples + cold.samples)
    # the replays really ran the kernel: the outputs hold the product
    for i in range(3):
        Y[i].fill_(float("nan"))
    Timer("cuda", repeats=1).time(fn, n_sets=3)
    torch.cuda.synchronize()
    ref = A @ X[0].cpu().numpy().astype(np.float64)
    np.testing.assert_allclose(Y[0].cpu().numpy(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
def test_gpu_capture_failure_is_reported(cuda_spmm):
    torch, mod, A, X, Y = cuda_spmm

    def fn(i):   # synchronising is not allowed while a stream is being captured
        mod(X[i], out=Y[i])
        torch.cuda.synchronize()

    t = Timer("cuda", repeats=3).time(fn, n_sets=3)
    assert t.mode == "launches" and "capture failed" in t.note and t.seconds > 0
    # the device is still usable afterwards, and graph mode works again
    assert Timer("cuda", repeats=3).time(lambda i: mod(X[i], out=Y[i]), n_sets=3).mode == "graph"


# -- the runner's worker process -----------------------------------------------------------------
from spcompile.autotune.measure import CPURunner, MeasureResult  # noqa: E402
from spcompile.compile import make_op  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.kernels import base as kbase  # noqa: E402
from spcompile.kernels.base import Kernel, Template  # noqa: E402


class _ScriptedKernel(Kernel):
    """Correct SpMM-sum (scipy), after doing what ``mode`` says."""

    def __init__(self, S, mode, **kw):
        super().__init__(**kw)
        self.S, self.mode = S, mode

    def __call__(self, X, out):
        if self.mode == "hang_run":
            time.sleep(60)
        elif self.mode == "exit":
            import os

            os._exit(7)          # the process dies mid-measurement (like a crashing kernel)
        out[...] = self.S @ X
        return out


class _Scripted(Template):
    """A test-only template whose build or kernel hangs, crashes or works, by parameter; it is
    importable (module level), so the runner's worker registers it too."""

    name = "test.scripted"
    target = "cpu"
    priority = -100
    ops = (("spmm", "sum"),)

    def default_params(self, mod):
        return {"mode": "ok"}

    def build(self, mod, params):
        if params["mode"] == "hang_build":
            time.sleep(60)
        return _ScriptedKernel(mod.op.A.to_scipy(), params["mode"], template=self.name, params=params, arrays={})


@pytest.fixture
def scripted():
    kbase.register_template(_Scripted)
    yield
    with kbase._LOCK:
        kbase._TEMPLATES.pop(_Scripted.name, None)


def _cfg(mode):
    return Config(_Scripted.name, {"mode": mode}, (), "cpu")


def test_worker_stops_a_hung_build_or_kernel_and_the_next_trial_runs(scripted):
    op = make_op(sp.random(80, 80, density=0.05, format="csr", random_state=1, dtype=np.float32), "spmm", 8)
    with CPURunner(repeats=3, warmup=1, min_sample_s=2e-4) as runner:
        assert runner.isolate
        ok = runner.measure(op, _cfg("ok"), timeout=30)
        assert ok.ok and ok.mode == "autorange" and ok.kernel_s > 0 and ok.rel_error < 1e-6, ok.error
        first = runner._worker.proc.pid
        for mode in ("hang_build", "hang_run"):
            t0 = time.perf_counter()
            res = runner.measure(op, _cfg(mode), timeout=0.5)
            took = time.perf_counter() - t0
            assert res.status == "timeout" and "stopped" in res.error and not res.ok
            assert took < 0.5 + 0.55 + 1.5, took      # timeout + the slack + killing
            assert runner._worker is None             # the hung worker is gone ...
        again = runner.measure(op, _cfg("ok"), timeout=30)
        assert again.ok, again.error                  # ... and a fresh one serves the next trial
        assert runner._worker.proc.pid != first


def test_worker_crash_is_a_run_error_not_fatal(scripted):
    op = make_op(sp.random(60, 60, density=0.05, format="csr", random_state=2, dtype=np.float32), "spmm", 4)
    runner = CPURunner(repeats=2, warmup=0, min_sample_s=1e-4)
    try:
        res = runner.measure(op, _cfg("exit"), timeout=30)
        assert res.status == "run_error" and "died" in res.error and "exit code 7" in res.error
        assert runner.measure(op, _cfg("ok"), timeout=30).ok
    finally:
        runner.close()


def test_worker_gets_the_op_once_and_is_reused(scripted, monkeypatch):
    from spcompile.autotune import measure as m

    sent = []
    orig = m._Worker.request

    def spy(self, request, op, config, wait):
        before = self._op
        out = orig(self, request, op, config, wait)
        sent.append(before is None or before[0] is not op)
        return out

    monkeypatch.setattr(m._Worker, "request", spy)
    A = sp.random(50, 50, density=0.1, format="csr", random_state=3, dtype=np.float32)
    op1, op2 = make_op(A, "spmm", 4), make_op(A, "spmm", 8)
    with CPURunner(repeats=2, warmup=0, min_sample_s=1e-4) as runner:
        for op in (op1, op1, op1, op2, op2):
            assert runner.measure(op, _cfg("ok"), timeout=30).ok
        assert runner._worker.proc.pid  # one worker served all five
        base = runner.baseline(op1)
        assert base.ok and base.name == "scipy.csr_matmul" and base.mode == "autorange"
    assert sent == [True, False, False, True, False, True]
    assert runner._worker is None


def test_in_process_runner_and_result_records_the_mode(scripted):
    op = make_op(sp.random(40, 40, density=0.1, format="csr", random_state=4, dtype=np.float32), "spmm", 4)
    runner = CPURunner(repeats=2, warmup=0, min_sample_s=1e-4, isolate=False)
    res = runner.measure(op, _cfg("ok"))
    assert res.ok and runner._worker is None
    d = res.to_dict()
    assert d["timing_mode"] == "autorange" and d["timing_note"] == ""
    with pytest.raises(ValueError, match="timing mode"):
        CPURunner(mode="graph")
    # pruning: the calibration estimate against the best so far
    pr = runner.measure(op, _cfg("ok"), prune_above=1e-12)
    assert pr.status == "pruned" and pr.kernel_s > 3e-12


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
def test_gpu_runner_measures_in_its_worker_by_graph_replay():
    from spcompile.autotune.measure import CUDARunner
    from spcompile.compile import default_config

    A = sp.random(20000, 20000, density=5e-4, format="csr", random_state=5, dtype=np.float32)
    op = make_op(A, "spmm", 32)
    cfg = default_config(op, "cuda")
    with CUDARunner() as runner:
        res = runner.measure(op, cfg, timeout=300)
        assert res.ok and res.mode == "graph" and res.note == "", (res.status, res.error, res.note)
        assert res.rel_error <= 1e-5 and 0 < res.kernel_s < 0.1
        base = runner.baseline(op)
        assert base.ok and base.name and base.mode == "graph", (base.status, base.error)
    with CUDARunner(mode="cold_l2", isolate=False) as cold:
        rc = cold.measure(op, cfg, timeout=300)
        assert rc.ok and rc.mode == "cold_l2" and len(rc.samples) == 30


def test_worker_reports_a_template_it_cannot_get():
    class Local(_Scripted):    # defined in a function: cannot be sent to the worker
        name = "test.local_only"

    kbase.register_template(Local)
    try:
        op = make_op(sp.random(30, 30, density=0.1, format="csr", random_state=6, dtype=np.float32), "spmm", 4)
        with CPURunner(repeats=2, warmup=0, min_sample_s=1e-4) as runner:
            res = runner.measure(op, Config(Local.name, {"mode": "ok"}, (), "cpu"), timeout=30)
            assert res.status == "run_error" and "not registered in the measuring worker" in res.error
            inproc = CPURunner(repeats=2, warmup=0, min_sample_s=1e-4, isolate=False)
            assert inproc.measure(op, Config(Local.name, {"mode": "ok"}, (), "cpu")).ok
    finally:
        with kbase._LOCK:
            kbase._TEMPLATES.pop(Local.name, None)


def test_a_script_that_tunes_at_its_top_level_works(tmp_path):
    """The measuring process is a fresh interpreter that does not re-import the caller's
    ``__main__`` (multiprocessing's spawn does: a script without a main guard re-ran itself)."""
    import subprocess
    import sys

    script = tmp_path / "tune_here.py"
    script.write_text(
        "import scipy.sparse as sp, spcompile\n"
        "A = sp.random(40, 40, density=0.1, format='csr', random_state=0)\n"
        f"mod = spcompile.build(A, 'spmm', K=8, target='cpu', tune=True, trials=2, storage={str(tmp_path / 'd.db')!r})\n"
        "print('SOURCE', mod.tuning['source'], mod.tuning.get('study') or mod.tuning.get('tune_study'))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**__import__('os').environ, "PYTHONPATH": __import__('os').pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    # tuned (or, when the search's best lost to scipy / the default measured in the same run, quick
    # selection or the heuristics, with the study that was tuned named in the module's provenance)
    line = next(x for x in r.stdout.splitlines() if x.startswith("SOURCE"))
    assert line.split()[1] in ("tuned", "quick", "heuristic") and "spcompile-spmm" in line, line


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")
def test_gpu_runner_checks_on_the_device_and_on_the_host(monkeypatch, no_tuning_db):
    """The CUDA runner's check against the float64 references: on the device (references uploaded
    once per op) or, when they would take more than DEVICE_CHECK_FRACTION of the free memory, on
    the host; both give the same error for a correct module, and a wrong entry or an unwritten
    (NaN) row fails either way."""
    import torch

    from spcompile.autotune.measure import CUDARunner, build_timed
    from spcompile.compile import default_config

    A = sp.random(3000, 2000, density=0.002, format="csr", random_state=3, dtype=np.float32)
    op = make_op(A, "spmm", 33)
    cfg = default_config(op, "cuda")
    errs = {}
    for fraction in (0.25, 0.0):
        monkeypatch.setattr(CUDARunner, "DEVICE_CHECK_FRACTION", fraction)
        r = CUDARunner(isolate=False)
        res = r.measure(op, cfg)
        assert res.ok and res.rel_error <= 1e-6, res
        assert (r._ref_cache[1] is not None) == (fraction > 0)
        cm, _, _ = build_timed(op, cfg)

        def wrong(*ins, out):
            cm(*ins, out=out)
            out[5, 3] += 1.0

        def unwritten(*ins, out):
            cm(*ins, out=out)
            out[7].fill_(float("nan"))

        errs[fraction] = r._check(op, cm)
        assert 1e-4 < r._check(op, wrong) < float("inf")
        assert r._check(op, unwritten) == float("inf")
        torch.cuda.synchronize()
    assert errs[0.25] == pytest.approx(errs[0.0], rel=1e-6, abs=1e-12)


def test_runner_reuses_its_pipelines_per_op(monkeypatch):
    """A runner runs each pass pipeline once per op and reports the preprocessing seconds of that
    run for every config behind it; another op, or more pipelines than PIPELINE_CACHE, run again."""
    import spcompile
    from spcompile.compile import default_config
    from spcompile.passes import base as passes_base

    calls = []

    class Counting(passes_base.Pipeline):
        def __call__(self, mod, ctx=None):
            calls.append([p["name"] for p in self.spec()])
            return super().__call__(mod, ctx)

    monkeypatch.setattr(passes_base, "Pipeline", Counting)
    A = sp.random(400, 400, density=0.02, format="csr", random_state=1, dtype=np.float32)
    op, op2 = make_op(A, "spmm", 8), make_op(A, "spmm", 8)
    r = CPURunner(isolate=False)
    base = default_config(op, "cpu")
    tpl = spcompile.get_template(base.template)

    def cfg(*pipeline):
        return tpl.make_config(dict(base.params), list(pipeline), "cpu")

    rcm = cfg({"name": "reorder.rcm"})
    first, again = r.measure(op, rcm), r.measure(op, rcm)
    assert first.ok and again.ok and calls == [["reorder.rcm"]]
    assert again.preprocess_s == first.preprocess_s
    r.measure(op2, rcm)                                   # another op: its own pipelines
    assert len(calls) == 2
    for p in ({"name": "reorder.degree", "options": {"descending": True}},
              {"name": "reorder.degree", "options": {"descending": False}},
              {"name": "reorder.rcm", "options": {"symmetric_mode": False}}):
        r.measure(op2, cfg(p))
    r.measure(op2, cfg())                                 # the empty pipeline runs no pass
    n = len(calls)
    assert n == 5
    r.measure(op2, rcm)                                   # five pipelines since: the first was dropped
    assert len(calls) == n + 1


def test_runner_continues_a_pipeline_from_its_cached_prefix(monkeypatch):
    """A pipeline that starts with one the runner already ran (RCM, then RCM + degree) continues
    from its module: RCM runs once; the module is the one the whole pipeline gives (its pass log)
    and its preprocessing seconds are the whole pipeline's (the prefix's plus the rest, so at least
    the prefix's); the longer pipeline's own prefix is cached too (RCM after it: no run)."""
    import spcompile
    from spcompile.compile import default_config
    from spcompile.passes.reorder_simple import DegreeSort, RCMReorder

    calls = count_pass_runs(monkeypatch, RCMReorder, DegreeSort)
    A = sp.random(400, 400, density=0.02, format="csr", random_state=2, dtype=np.float32)
    base = default_config(make_op(A, "spmm", 8), "cpu")
    tpl = spcompile.get_template(base.template)
    rcm = [{"name": "reorder.rcm", "options": {}}]
    both = rcm + [{"name": "reorder.degree", "options": {}}]
    for first, second in ((rcm, both), (both, rcm)):
        op = make_op(A, "spmm", 8)
        r = CPURunner(isolate=False)
        calls.clear()
        a = r.measure(op, tpl.make_config(dict(base.params), first, "cpu"))
        b = r.measure(op, tpl.make_config(dict(base.params), second, "cpu"))
        assert a.ok and b.ok and calls == ["RCMReorder", "DegreeSort"]
        short, long_ = (a, b) if first is rcm else (b, a)
        assert long_.preprocess_s >= short.preprocess_s > 0
    from spcompile.autotune.measure import build_timed

    cache = {}
    cm, pre1, _ = build_timed(op, tpl.make_config(dict(base.params), rcm, "cpu"), cache)
    cm2, pre2, _ = build_timed(op, tpl.make_config(dict(base.params), both, "cpu"), cache)
    log = [p["name"] if isinstance(p, dict) else p.name for p in cm2.pass_log]
    assert log == ["reorder.rcm", "reorder.degree"] and pre2 >= pre1
    X = np.random.default_rng(0).standard_normal((400, 8)).astype(np.float32)
    ref = A.astype(np.float64) @ X
    assert np.allclose(cm2(X), ref, rtol=1e-4, atol=1e-4)
