"""Tuner logic on CPU: the real CPU templates and an injected fake runner (seeding, FAIL handling,
pruning, duplicates, budgets, resume after interruption, amortisation, build() integration)."""
from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import optuna
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.core import numerics, reference  # noqa: F401
from spcompile.compile import make_op
from spcompile.autotune.database import Record, open_database, pass_hashes, target_digest, target_key, template_hash
from spcompile.core.config import Config
from spcompile.autotune.measure import CPURunner, MeasureResult
from spcompile.kernels import base as sched_base
from spcompile.kernels.base import Kernel, Template
from spcompile.autotune.policy import choose_config
from spcompile.autotune.space import candidates
from spcompile.autotune.tuner import Tuner, tune

from conftest import dense_blocks

optuna.logging.set_verbosity(optuna.logging.WARNING)
TV = optuna.trial.TrialState


def graph(n=120, density=0.05, seed=0):
    A = sp.random(n, n, density=density, format="csr", random_state=seed, dtype=np.float32)
    A.data[:] = 1.0
    return A


def _h(cfg: Config) -> int:
    return int(hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:8], 16)


class FakeRunner:
    """Deterministic times from the config; configs whose hash % fail_mod == 0 fail."""

    target = "cpu"

    def __init__(self, fail_mod=0, interrupt_at=None, preprocess=None, kernel=None):
        self.calls: list[Config] = []
        if kernel is not None:
            self.kernel_s = kernel
        self.prune_args = []
        self.fail_mod = fail_mod
        self.interrupt_at = interrupt_at
        self.preprocess = preprocess or (lambda cfg: 0.0)

    confirm_at = None

    def events(self, ev):
        """A Tuner callback: notes where the end-of-run confirmation starts measuring again."""
        if ev["event"] == "confirm" and self.confirm_at is None:
            self.confirm_at = len(self.calls)

    @property
    def searched(self):
        """The search's measurements (without the end-of-run confirmation's)."""
        return self.calls if self.confirm_at is None else self.calls[:self.confirm_at]

    def kernel_s(self, cfg):
        base = 1e-3 * (1 + (_h(cfg) % 97) / 10)
        return base * (0.5 if cfg.pipeline else 1.0)  # pipelines make the kernel faster

    def measure(self, op, cfg, *, timeout=None, prune_above=None):
        self.calls.append(cfg)
        self.prune_args.append(prune_above)
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        if self.fail_mod and _h(cfg) % self.fail_mod == 0:
            return MeasureResult("compile_error", error="fake compile error", config=cfg)
        t = self.kernel_s(cfg)
        if prune_above is not None and t > 3 * prune_above:
            return MeasureResult("pruned", kernel_s=t, config=cfg)
        return MeasureResult("ok", kernel_s=t, preprocess_s=self.preprocess(cfg), config=cfg, rel_error=0.0)

    def baseline(self, op):
        return MeasureResult("ok", kernel_s=50e-3, name="fake-baseline")


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "tune.db")


def test_space_only_available_templates_of_the_target(monkeypatch):
    op = make_op(graph(), "spmm", 16)
    space = candidates(op, "cpu")
    assert space and all(spcompile.get_template(t).target == "cpu" for t in space)
    assert all("none" in pipes for pipes in space.values())
    assert any("reorder.rcm" in pipes for pipes in space.values())
    name = next(iter(space))
    monkeypatch.setattr(type(spcompile.get_template(name)), "available", lambda self: False)
    assert name not in candidates(op, "cpu")


def test_seeds_defaults_first_and_fail_handling(db):
    op = make_op(graph(), "spmm", 16)
    runner = FakeRunner(fail_mod=3)
    res = Tuner(op, "cpu", storage=db, runner=runner, seed=0).run(trials=12)
    assert res.n_trials == 12 and res.stop_reason == "budget"
    tname = next(iter(candidates(op, "cpu")))
    tpl = spcompile.get_template(tname)
    first = runner.calls[0]
    assert first.template == tname and dict(first.params) == tpl.default_params(spcompile.SparseModule.from_op(op))
    tn = Tuner(op, "cpu", storage=db, runner=runner)
    trials = tn.study.get_trials()
    assert trials[0].user_attrs.get("seed") == "default"
    fails = [t for t in trials if t.state == TV.FAIL]
    assert fails and all(t.user_attrs["fail_reason"] == "compile_error" for t in fails)
    assert res.n_fail == len(fails)
    # the best is the fastest *successful* config, and failed configs are never stored
    ok = [t for t in trials if t.state == TV.COMPLETE and "duplicate_of" not in t.user_attrs]
    assert res.best_value_ms == pytest.approx(min(t.value for t in ok))
    rec = open_database(db).lookup(op.key(), "cpu")
    assert rec is not None and rec.value_ms == pytest.approx(res.best_value_ms)
    failed_cfgs = {json.dumps(t.user_attrs["config"], sort_keys=True) for t in fails}
    for r in open_database(db).records():
        assert json.dumps(r.config.to_dict(), sort_keys=True) not in failed_cfgs
    assert res.baseline_ms == pytest.approx(50.0) and res.speedup == pytest.approx(50.0 / res.best_kernel_ms)


def test_pruning_and_duplicates_are_not_remeasured(db):
    op = make_op(graph(), "spmm", 16)
    runner = FakeRunner()
    searched = []   # the search's measurements (the confirmation at the end measures again)
    cb = lambda ev: searched.append(len(runner.calls)) if ev["event"] == "confirm" else None  # noqa: E731
    res = Tuner(op, "cpu", storage=db, runner=runner, seed=1, callbacks=[cb]).run(trials=16)
    assert runner.prune_args[0] is None  # nothing to compare with yet
    assert any(p is not None for p in runner.prune_args[1:])
    digests = [json.dumps(c.to_dict(), sort_keys=True) for c in runner.calls[:searched[0]]]
    assert len(digests) == len(set(digests)), "a config was measured twice"
    trials = Tuner(op, "cpu", storage=db, runner=runner).study.get_trials()
    pruned = [t for t in trials if t.state == TV.PRUNED and "duplicate_of" not in t.user_attrs]
    assert res.n_pruned == len(pruned)
    for t in pruned:  # pruned trials carry the estimate that condemned them
        assert t.intermediate_values


def test_budget_by_wall_time(db):
    op = make_op(graph(), "spmm", 16)

    class Slow(FakeRunner):
        def measure(self, *a, **k):
            time.sleep(0.2)
            return super().measure(*a, **k)

    tuner = Tuner(op, "cpu", storage=db, runner=Slow())   # (its first imports are not the run's)
    t0 = time.perf_counter()
    res = tuner.run(timeout=1.0)
    assert time.perf_counter() - t0 < 4.0
    assert res.stop_reason == "timeout" and 1 <= res.n_trials <= 7


class Paced(FakeRunner):
    """Each measurement takes ``wall`` seconds (``slow_at``: the calls that would take ``slow``);
    a measurement past its ``timeout`` stops there with status "timeout", as the runners do."""

    def __init__(self, wall=0.1, slow_at=(), slow=30.0, **kw):
        super().__init__(**kw)
        self.wall, self.slow_at, self.slow = wall, set(slow_at), slow
        self.limits = []

    def measure(self, op, cfg, *, timeout=None, prune_above=None):
        self.limits.append(timeout)
        need = self.slow if len(self.calls) in self.slow_at else self.wall
        if timeout is not None and need > timeout:
            time.sleep(timeout)
            self.calls.append(cfg)
            return MeasureResult("timeout", error="past the limit", config=cfg)
        time.sleep(need)
        return super().measure(op, cfg, timeout=timeout, prune_above=prune_above)


def test_timeout_keeps_room_for_the_end_of_the_run(db):
    op = make_op(graph(), "spmm", 16)
    runner = Paced(wall=0.15)
    tuner = Tuner(op, "cpu", storage=db, runner=runner, confirm=2)
    t0 = time.perf_counter()
    res = tuner.run(timeout=2.0)
    wall = time.perf_counter() - t0
    # the confirmation (2 configs and the default: 3 x 0.15 s) fits in the timeout
    assert res.stop_reason == "timeout" and res.stored
    assert wall <= 2.0 + 0.15, wall
    assert set(res.seconds) == {"seeds", "baseline", "search", "finish"}
    assert sum(res.seconds.values()) == pytest.approx(wall, abs=0.1)
    assert res.seconds["finish"] >= 2 * 0.15
    assert len(runner.searched) >= 5


def test_a_trial_near_the_deadline_is_cut_to_it(db):
    op = make_op(graph(), "spmm", 16)
    runner = Paced(wall=0.1, slow_at={6}, slow=30.0)
    tuner = Tuner(op, "cpu", storage=db, runner=runner, confirm=1, callbacks=[runner.events])
    t0 = time.perf_counter()
    res = tuner.run(timeout=3.0)
    wall = time.perf_counter() - t0
    assert wall < 3.0 + 0.5, wall
    # the slow trial's limit was what was left of the run, not the runner's 30 s
    assert runner.limits[6] is not None and runner.limits[6] < 3.0
    trials = Tuner(op, "cpu", storage=db, runner=FakeRunner()).study.get_trials()
    cut = [t for t in trials if t.state == TV.FAIL]
    assert len(cut) == 1 and cut[0].user_attrs["fail_reason"] == "deadline"
    # a deadline cut is neither a failure of its config nor a verdict
    assert res.n_fail == 0 and "deadline" in res.fail_reasons
    assert res.n_trials == sum(1 for t in trials if t.state in (TV.COMPLETE, TV.PRUNED)
                               and "duplicate_of" not in t.user_attrs)
    assert res.stored


def test_no_cut_before_the_run_has_a_working_config(db):
    """A first trial slower than the whole timeout still finishes: without it the run would end
    with nothing to confirm."""
    op = make_op(graph(), "spmm", 16)
    runner = Paced(wall=0.05, slow_at={0}, slow=1.5)
    res = Tuner(op, "cpu", storage=db, runner=runner).run(timeout=1.0)
    assert runner.limits[0] is None
    assert res.stored and res.n_trials >= 1 and res.fail_reasons == {}


def test_a_runner_with_soft_stops_gets_the_deadline_as_stop_after(db):
    """A runner that can stop a measurement at its next step keeps its own time limit (its worker
    is not stopped) and gets the deadline as ``stop_after``."""
    class Soft(Paced):
        soft_stops = True

        def __init__(self, **kw):
            super().__init__(**kw)
            self.stops = []

        def measure(self, op, cfg, *, timeout=None, prune_above=None, stop_after=None):
            self.stops.append(stop_after)
            if stop_after is not None and len(self.calls) in self.slow_at:
                time.sleep(stop_after)
                self.limits.append(timeout)
                self.calls.append(cfg)
                return MeasureResult("timeout", error="stopped at its next step", config=cfg)
            return super().measure(op, cfg, timeout=timeout, prune_above=prune_above)

    op = make_op(graph(), "spmm", 16)
    runner = Soft(wall=0.1, slow_at={6}, slow=30.0)
    tuner = Tuner(op, "cpu", storage=db, runner=runner, confirm=1)
    t0 = time.perf_counter()
    res = tuner.run(timeout=3.0)
    assert time.perf_counter() - t0 < 3.5
    assert runner.limits[6] is None and runner.stops[6] is not None and runner.stops[6] < 3.0
    assert res.fail_reasons == {"deadline": 1} and res.stored


def test_the_trials_own_limit_stays_a_timeout(db):
    op = make_op(graph(), "spmm", 16)
    runner = Paced(wall=0.05, slow_at={2}, slow=5.0)
    res = Tuner(op, "cpu", storage=db, runner=runner, trial_timeout=0.3).run(timeout=20.0, trials=6)
    assert runner.limits[2] == pytest.approx(0.3)
    assert res.fail_reasons == {"timeout": 1} and res.n_fail == 1


def test_resume_after_interruption(db):
    op = make_op(graph(), "spmm", 16)
    r1 = FakeRunner(interrupt_at=4)
    res = Tuner(op, "cpu", storage=db, runner=r1, seed=0).run(trials=10)
    assert res.interrupted and res.n_trials == 3
    trials = Tuner(op, "cpu", storage=db, runner=r1).study.get_trials()
    assert [t.user_attrs.get("fail_reason") for t in trials if t.state == TV.FAIL] == ["interrupted"]
    assert not [t for t in trials if t.state == TV.RUNNING]
    assert res.stored is None and "nothing stored" in res.store_note   # never stored unconfirmed
    assert open_database(db).lookup(op.key(), "cpu") is None
    r2 = FakeRunner()
    res2 = Tuner(op, "cpu", storage=db, runner=r2, seed=0, callbacks=[r2.events]).run(trials=10)
    assert res2.n_trials == 10 and not res2.interrupted and res2.n_new == 7 and res2.stored
    measured_before = {json.dumps(c.to_dict(), sort_keys=True) for c in r1.calls[:3]}
    assert not measured_before & {json.dumps(c.to_dict(), sort_keys=True) for c in r2.searched}
    assert len(r2.searched) <= 7 + 1  # the rest of the budget (+ the interrupted config again)
    # a finished study is not tuned again
    r3 = FakeRunner()
    assert Tuner(op, "cpu", storage=db, runner=r3).run(trials=10).n_trials == 10 and not r3.calls


def test_similar_matrices_seed_the_study(db):
    A = graph(150, seed=3)
    other = make_op(graph(160, seed=4), "spmm", 16)
    tn_other = Tuner(other, "cpu", storage=db, runner=FakeRunner())
    tname, pipes = next(iter(tn_other.space.items()))
    label = [lab for lab in pipes if lab != "none"][0]
    tpl = spcompile.get_template(tname)
    mod = spcompile.SparseModule.from_op(other)
    params = dict(tpl.default_params(mod))
    space = tpl.space(mod)
    pname, dist = next(iter(space.items()))
    params[pname] = dist.choices[-1] if hasattr(dist, "choices") else dist.high
    cfg = Config(tname, params, tuple(pipes[label]), "cpu", tpl.format)
    rec = Record(other.key().digest(), target_digest("cpu"), "kernel_time", cfg, 1.0, 0.1, 1.0,
                 workload=other.key().to_dict(), target=target_key("cpu"), template_hash=template_hash(tname),
                 pass_hashes=pass_hashes(cfg.pipeline))
    assert open_database(db).save_if_better(rec)
    op = make_op(A, "spmm", 16)
    runner = FakeRunner()
    Tuner(op, "cpu", storage=db, runner=runner).run(trials=len(candidates(op, "cpu")) * 3 + 2)
    seeded = [c for c in runner.calls if c.template == tname and list(c.pipeline) == list(cfg.pipeline)
              and c.params.get(pname) == params[pname]]
    assert seeded, "the similar matrix's best config was not tried"


def test_amortized_objective_prefers_cheap_preprocessing(db):
    op = make_op(graph(), "spmm", 16)
    # pipelines halve the kernel time but cost 1 s of preprocessing
    pre = lambda cfg: 1.0 if cfg.pipeline else 0.0  # noqa: E731
    kern = lambda cfg: 1e-3 * (1 + (_h(cfg) % 7) / 100) * (0.5 if cfg.pipeline else 1.0)  # noqa: E731
    r = Tuner(op, "cpu", storage=db, runner=FakeRunner(preprocess=pre, kernel=kern), objective="amortized",
              expected_calls=10, seed=0).run(trials=12)
    assert r.best_config is not None and not r.best_config.pipeline
    r2 = Tuner(op, "cpu", storage=db, runner=FakeRunner(preprocess=pre, kernel=kern), seed=0).run(trials=12)
    assert r2.best_config.pipeline  # kernel time alone: the reordered configs win
    assert r.study_name != r2.study_name


# -- the real CPU templates and the real runner ----------------------------------------------
class _BrokenKernel(Kernel):
    def __init__(self, mode, **kw):
        super().__init__(**kw)
        self.mode = mode

    def __call__(self, *inputs, out):
        if self.mode == "wrong":
            out[...] = 0.0
        elif self.mode == "slow":
            time.sleep(30)
        elif self.mode == "raise":
            raise RuntimeError("launch failed")
        return out


class _Broken(Template):
    name = "cpu.test_broken"
    target = "cpu"
    ops = (("spmm", "sum"),)
    priority = -100

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution

        return {"mode": CategoricalDistribution(["wrong", "slow", "raise", "compile"])}

    def default_params(self, mod):
        return {"mode": "wrong"}

    def build(self, mod, params):
        if params["mode"] == "compile":
            raise RuntimeError("does not compile")
        return _BrokenKernel(params["mode"], template=self.name, params=params, arrays={})


@pytest.fixture
def broken_template():
    sched_base.register_template(_Broken)
    yield sched_base._TEMPLATES[_Broken.name]
    with sched_base._LOCK:
        sched_base._TEMPLATES.pop(_Broken.name, None)


def test_cpu_runner_failures_are_data(broken_template):
    op = make_op(graph(60), "spmm", 8)
    runner = CPURunner(repeats=3, warmup=1)
    for mode, status in (("wrong", "wrong_result"), ("raise", "run_error"), ("compile", "compile_error")):
        res = runner.measure(op, Config(_Broken.name, {"mode": mode}, (), "cpu"))
        assert res.status == status and not res.ok and res.error
    t0 = time.perf_counter()
    res = runner.measure(op, Config(_Broken.name, {"mode": "slow"}, (), "cpu"), timeout=0.5)
    assert res.status == "timeout" and time.perf_counter() - t0 < 5


def _sleep_pass(mod, ctx, seconds=1.0):
    """A pass that takes ``seconds`` (registered for the worker by reference: top level)."""
    time.sleep(seconds)
    return mod


@pytest.fixture
def sleep_pass():
    from spcompile.passes import base as pbase

    pbase.register_pass("test.sleep", options={"seconds": 1.0})(_sleep_pass)
    yield "test.sleep"
    with pbase._LOCK:
        pbase._REGISTRY.pop("test.sleep", None)


def test_stop_after_stops_at_the_next_step_and_keeps_the_worker(sleep_pass):
    """``stop_after`` (the tuner's deadline) ends a measurement after its pass pipeline with a
    timeout, in the same worker, which then measures the next config (its pipelines kept);
    ``timeout`` stops the worker itself."""
    op = make_op(graph(60), "spmm", 8)
    runner = CPURunner(repeats=3, warmup=1)
    tname = next(iter(candidates(op, "cpu")))
    tpl = spcompile.get_template(tname)
    params = dict(tpl.default_params(spcompile.SparseModule.from_op(op)))
    slow = Config(tname, params, ({"name": sleep_pass, "options": {"seconds": 1.5}},), "cpu", tpl.format)
    try:
        assert runner.measure(op, Config(tname, params, (), "cpu", tpl.format)).ok
        pid = runner._worker.proc.pid
        t0 = time.perf_counter()
        res = runner.measure(op, slow, stop_after=0.3)
        assert res.status == "timeout" and "pass pipeline" in res.error
        assert 1.5 <= time.perf_counter() - t0 < 5
        assert runner._worker.alive() and runner._worker.proc.pid == pid
        # the pipeline's output was kept: measured again, the config takes no second 1.5 s sleep
        t0 = time.perf_counter()
        again = runner.measure(op, slow)
        assert again.ok and again.preprocess_s >= 1.5 and time.perf_counter() - t0 < 1.5
        res = runner.measure(op, slow.__class__(tname, params, ({"name": sleep_pass, "options": {"seconds": 20}},),
                                                "cpu", tpl.format), timeout=0.5)
        assert res.status == "timeout" and "stopped" in res.error and runner._worker is None
    finally:
        runner.close()


def test_prestart_overlaps_the_workers_imports():
    runner = CPURunner(repeats=3, warmup=1)
    try:
        runner.prestart()
        w = runner._worker
        assert w is not None and not w._started    # started, not waited for
        runner.prestart()                            # idempotent while it lives
        assert runner._worker is w
        assert runner.measure(make_op(graph(60), "spmm", 8), runner_default(make_op(graph(60), "spmm", 8))).ok
        assert runner._worker is w and w._started
    finally:
        runner.close()


def runner_default(op):
    from spcompile.compile import default_config

    return default_config(op, "cpu")


def test_real_cpu_templates_tune_then_build_hits_the_database(db):
    A = graph(200, density=0.03, seed=5)
    runner = CPURunner(repeats=3, warmup=1, min_sample_s=5e-4)
    res = tune(A, "spmm", K=16, target="cpu", trials=4, storage=db, runner=runner, seed=0)
    assert res.best_config is not None and res.n_complete >= 1
    assert res.baseline_name == "scipy.csr_matmul" and res.baseline_ms > 0
    op = make_op(A, "spmm", 16)
    rec = open_database(db).lookup(op.key(), "cpu")
    if not res.stored:   # the search's best lost to the default or to scipy measured in this run
        assert rec is None and "slower than" in res.store_note
        # a miss: quick selection between the heuristic default and SciPy
        assert spcompile.build(A, "spmm", K=16, target="cpu", storage=db).tuning["source"] == "quick"
        return
    assert rec.config.template == res.best_config.template and rec.valid
    assert rec.kernel_ms <= res.baseline_ms and rec.kernel_ms <= res.default_ms
    cfg, info = choose_config(op, "cpu", storage=db)
    assert info["source"] == "database" and cfg == rec.config
    mod = spcompile.build(A, "spmm", K=16, target="cpu", storage=db)
    assert mod.tuning["source"] == "database" and mod.config.params == rec.config.params
    X = np.random.default_rng(0).standard_normal((200, 16), dtype=np.float32)
    assert reference.rel_error(mod(X), reference.spmm(spcompile.as_csr(A), X)) < 1e-5
    # a miss (another K) measures the heuristic default and SciPy unless tuning is asked for
    cfg2, info2 = choose_config(make_op(A, "spmm", 8), "cpu", storage=db)
    assert info2["source"] == "quick"
    assert choose_config(make_op(A, "spmm", 8), "cpu", storage=db, select_budget=0)[1]["source"] == "heuristic"
    cfg3, info3 = choose_config(make_op(A, "spmm", 8), "cpu", storage=db, trials=2, runner=Drifting(1e3))
    assert info3["source"] == "tuned"


def test_cli_tune_and_best(tmp_path, capsys, monkeypatch):
    import argparse

    from spcompile.autotune import tuner as tuner_mod
    from spcompile.cli import tune as cli_tune

    real = tuner_mod.Tuner   # a fake runner: the record is stored whatever this machine's load
    monkeypatch.setattr(tuner_mod, "Tuner", lambda *a, **k: real(*a, **{**k, "runner": FakeRunner()}))

    g = tmp_path / "g.npz"
    sp.save_npz(g, graph(150, seed=7))
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    cli_tune.add_commands(sub)
    dbp = str(tmp_path / "cli.db")
    args = p.parse_args(["tune", str(g), "--op", "spmm", "-K", "8", "--trials", "3", "--storage", dbp,
                         "--target", "cpu", "--no-progress"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "baseline ms" in out and "speed-up" in out and "g " in out
    args = p.parse_args(["best", "--storage", dbp])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "spmm/sum" in out and "g.npz" in out


class _Reduced(Template):
    """A CPU template whose configurations compute in reduced precision (like the tensor-core
    templates' ``precision`` parameter); it is the fastest for the fake runner."""

    name = "test.reduced_precision"
    target = "cpu"
    priority = -100
    ops = (("spmm", "sum"),)
    precision_param = "precision"

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution

        return {"precision": CategoricalDistribution(["tf32", "fp16", "bf16"]), "w": CategoricalDistribution([1, 2])}

    def default_params(self, mod):
        return {"precision": "tf32", "w": 1}

    def seed_params(self, mod):
        return [{"precision": p, "w": w} for p in ("tf32", "fp16", "bf16") for w in (1, 2)]

    def build(self, mod, params):
        raise AssertionError("the fake runner never builds")


@pytest.fixture
def reduced_template():
    sched_base.register_template(_Reduced)
    yield sched_base._TEMPLATES[_Reduced.name]
    with sched_base._LOCK:
        sched_base._TEMPLATES.pop(_Reduced.name, None)


def test_precision_policy(db, reduced_template):
    """The default policy (fp32) never measures, stores or returns a reduced-precision config;
    looser policies admit exactly the precisions at or above them, and their records are kept
    apart from the exact ones."""
    from spcompile.core.numerics import allowed_precisions

    class Fast(FakeRunner):
        def kernel_s(self, cfg):  # reduced precision is always faster here
            return {"tf32": 3e-4, "fp16": 2e-4, "bf16": 1e-4}.get(cfg.params.get("precision"), 1e-3)

    op = make_op(graph(), "spmm", 16)
    r32 = Fast()
    res = Tuner(op, "cpu", storage=db, runner=r32, seed=0).run(trials=10)
    assert r32.calls and all(c.template != _Reduced.name for c in r32.calls)
    assert res.best_config.template != _Reduced.name
    rt32 = Fast()
    res_t = Tuner(op, "cpu", storage=db, runner=rt32, seed=0, precision="tf32").run(trials=14)
    seen = {c.params.get("precision") for c in rt32.calls if c.template == _Reduced.name}
    assert seen == {"tf32"}
    assert res_t.best_config.template == _Reduced.name and res_t.objective == "kernel_time" and res_t.precision == "tf32"
    rany = Fast()
    Tuner(op, "cpu", storage=db, runner=rany, seed=0, precision="bf16").run(trials=14)
    assert {"fp16", "bf16"} <= {c.params.get("precision") for c in rany.calls if c.template == _Reduced.name}
    # the database keeps the policies apart; build() without a policy gets the exact record
    cfg, info = choose_config(op, "cpu", storage=db)
    assert info["source"] == "database" and cfg.template != _Reduced.name
    cfg_t, info_t = choose_config(op, "cpu", storage=db, precision="tf32")
    assert info_t["source"] == "database" and cfg_t.template == _Reduced.name
    assert cfg_t.params["precision"] == "tf32"
    assert allowed_precisions("fp16") == ("fp32", "3xtf32", "tf32", "fp16")   # split tf32 is fp32-level
    with pytest.raises(ValueError, match="precision must be one of"):
        spcompile.build(graph(), "spmm", K=16, target="cpu", precision="int8")


def test_float64_workload_policy_space_and_records(db):
    """A float64 workload computes in fp64, its own precision, under every policy (fp64 never joins
    another workload's policy, nor replaces fp32 in it); its space holds the templates that compute
    float64; the real runner checks its results at the fp64 tolerance; its records say fp64 and
    build() finds them."""
    from spcompile.compile import default_config

    op = make_op(graph(), "spmm", 16, dtype="float64")
    assert numerics.allowed_precisions("fp32") == ("fp32", "3xtf32")
    assert numerics.allowed_precisions("bf16", "float64")[0] == "fp64"
    tu = Tuner(op, "cpu", storage=db, runner=FakeRunner(), seed=0)
    assert tu.allowed == ("fp64", "fp32", "3xtf32") and tu.space
    assert all("float64" in spcompile.get_template(t).dtypes for t in tu.space)
    res = tu.run(trials=4)
    assert res.best_config.precision == "fp64"
    rec = open_database(db).lookup(op.key(), "cpu")
    assert rec is not None and rec.config.precision == "fp64"
    cfg, info = choose_config(op, "cpu", storage=db)
    assert info["source"] == "database" and cfg == rec.config
    real = CPURunner(repeats=2, warmup=0, min_sample_s=1e-4).measure(op, default_config(op, "cpu"))
    assert real.ok and real.rel_error < numerics.tolerance("float64") == 1e-12
    with pytest.raises(ValueError, match="precision='fp64'.*float64"):
        Tuner(make_op(graph(), "spmm", 16), "cpu", storage=db, runner=FakeRunner(), precision="fp64")
    with pytest.raises(ValueError, match="precision='fp64'.*float64"):
        spcompile.build(graph(), "spmm", K=16, target="cpu", precision="fp64")
    assert spcompile.build(graph(), "spmm", K=16, target="cpu", dtype="float64", precision="fp64",
                           storage=db).config.precision == "fp64"


@pytest.mark.skipif(not __import__("spcompile.runtime.cuda", fromlist=["x"]).nvcc_available(),
                    reason="CUDA templates need nvcc")
def test_16bit_workload_space(db):
    """A float16 workload on the CUDA target: under the default policy the space holds the
    templates that take fp16 X, the tensor-core ones restricted to their fp16 variants (the
    workload's own precision), and none of the fp32-only templates; bf16 likewise."""
    for dtype, prec in (("float16", "fp16"), ("bfloat16", "bf16")):
        op = make_op(graph(), "spmm", 64, dtype=dtype)
        tu = Tuner(op, "cuda", storage=db, runner=FakeRunner(), seed=0)
        assert tu.allowed == ("fp32", "3xtf32", prec)
        assert {"sptc.vnm", "tc.wmma_sgt", "csr.crc_cwm"} <= set(tu.space)
        assert "aspt.tiled" not in tu.space
        for t in ("sptc.vnm", "tc.wmma_sgt"):
            assert list(tu._dists[t]["precision"].choices) == [prec]
        assert any(p and p[0]["name"] == "reorder.rcm" and any(q["name"] == "cluster.lsh" for q in p)
                   for p in tu.space["sptc.vnm"].values())
    # an fp32 workload keeps the lower-precision tensor-core variants out by default: split tf32
    # (fp32-level) is the only one left
    tu32 = Tuner(make_op(graph(), "spmm", 64), "cuda", storage=db, runner=FakeRunner(), seed=0)
    assert "sptc.vnm" not in tu32.space
    assert list(tu32._dists["tc.wmma_sgt"]["precision"].choices) == ["3xtf32"]


class _Tiny(Template):
    """Two configurations: w=2 is 10x slower than w=1 (pruned once seen)."""

    name = "test.tiny"
    target = "cpu"
    priority = -100
    ops = (("spmm", "sum"),)

    def space(self, mod):
        from optuna.distributions import CategoricalDistribution

        return {"w": CategoricalDistribution([1, 2])}

    def default_params(self, mod):
        return {"w": 1}

    def build(self, mod, params):
        raise AssertionError("the fake runner never builds")


def test_pruned_config_is_not_measured_again(db, monkeypatch):
    sched_base.register_template(_Tiny)
    try:
        class Slow2(FakeRunner):
            def kernel_s(self, cfg):
                return 1e-2 if cfg.params.get("w") == 2 else 1e-3

        op = make_op(graph(), "spmm", 16)
        runner = Slow2()
        res = Tuner(op, "cpu", storage=db, runner=runner, seed=0, reorders=(), max_duplicates=12,
                    callbacks=[runner.events]).run(trials=40)
        tiny = [json.dumps(c.to_dict(), sort_keys=True) for c in runner.searched if c.template == _Tiny.name]
        assert len(tiny) == len(set(tiny)) == 2, tiny
        trials = Tuner(op, "cpu", storage=db, runner=runner, reorders=()).study.get_trials()
        dups = [t for t in trials if t.state == TV.PRUNED and "duplicate_of" in t.user_attrs]
        assert dups, "the slow config was sampled again but not told as a pruned duplicate"
        assert res.n_pruned == sum(1 for t in trials if t.state == TV.PRUNED and "duplicate_of" not in t.user_attrs)
    finally:
        with sched_base._LOCK:
            sched_base._TEMPLATES.pop(_Tiny.name, None)


def test_stop_rule():
    from spcompile.autotune.tuner import StopRule

    r = StopRule(trials=10, timeout=5.0, max_duplicates=3, wait_limit=2.0)
    go = dict(elapsed=0.0, done=0, running=0, duplicate_streak=0, waited=0.0)
    assert r.reason(**go) == ""
    assert r.reason(**{**go, "elapsed": 5.0}) == "timeout"
    assert r.reason(**{**go, "done": 10}) == "budget"
    assert r.reason(**{**go, "done": 8, "running": 2}) == "wait"          # the rest runs elsewhere
    assert r.reason(**{**go, "done": 8, "running": 2, "waited": 2.5}) == "waiting for other workers"
    assert r.reason(**{**go, "duplicate_streak": 3}) == "search space exhausted"
    assert StopRule().reason(**{**go, "done": 10 ** 6}) == ""             # no budget: only duplicates stop


def test_run_with_a_stop_rule(db):
    from spcompile.autotune.tuner import StopRule

    op = make_op(graph(), "spmm", 16)
    runner = FakeRunner()
    res = Tuner(op, "cpu", storage=db, runner=runner, seed=0, callbacks=[runner.events]).run(stop=StopRule(trials=5))
    assert res.n_trials == 5 and res.stop_reason == "budget" and len(runner.searched) <= 5
    res2 = Tuner(op, "cpu", storage=db, runner=FakeRunner(), seed=0).run(stop=StopRule(max_duplicates=0))
    assert res2.stop_reason == "search space exhausted" and res2.n_trials == 5


class ModeRunner(FakeRunner):
    """A fake runner that says which Timer mode it measures with."""

    def __init__(self, mode, **kw):
        super().__init__(**kw)
        self.mode = mode

    def measure(self, op, cfg, **kw):
        res = super().measure(op, cfg, **kw)
        res.mode = self.mode
        return res


def test_timing_mode_is_recorded_and_kept_apart(db):
    op = make_op(graph(), "spmm", 16)
    cold = Tuner(op, "cpu", storage=db, runner=ModeRunner("cold_l2"), seed=0)
    rc = cold.run(trials=4)
    assert rc.timing_mode == "cold_l2" and rc.objective == "kernel_time"
    assert cold.study.user_attrs["timing_mode"] == "cold_l2" and "cold_l2" in cold.study_name
    trials = [t for t in cold.study.get_trials() if t.state == TV.COMPLETE]
    assert trials and all(t.user_attrs["result"]["timing_mode"] == "cold_l2" for t in trials)
    recs = open_database(db).records()
    assert recs and all(r.objective == "kernel_time" and r.timing == "cold_l2" and r.extra["timing_mode"] == "cold_l2" for r in recs)
    # the default mode's study and records are others: a cold number is never compared with them
    assert open_database(db).lookup(op.key(), "cpu", "kernel_time", timing="autorange") is None
    assert spcompile.build(op.A, "spmm", K=16, target="cpu", storage=db, select_budget=0).tuning["source"] == "heuristic"
    warm = Tuner(op, "cpu", storage=db, runner=ModeRunner("autorange"), seed=0)
    rw = warm.run(trials=4)
    assert rw.timing_mode == "autorange" and rw.objective == "kernel_time" and warm.study_name != cold.study_name
    assert open_database(db).lookup(op.key(), "cpu", "kernel_time", timing="autorange").extra["timing_mode"] == "autorange"
    assert spcompile.build(op.A, "spmm", K=16, target="cpu", storage=db).tuning["timing"] == "autorange"
    # a study measured in one mode takes no trials measured in another
    with pytest.raises(ValueError, match="timing mode 'cold_l2'"):
        Tuner(op, "cpu", storage=db, runner=ModeRunner("autorange"), study_name=cold.study_name).run(trials=6)


def test_tuning_from_python_prints_no_optuna_info(db):
    """Optuna's INFO lines stay out of the caller's program; the caller's own verbosity wins."""
    import logging

    import optuna

    seen: list[str] = []

    class Rec(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Rec(level=logging.DEBUG)
    lib = logging.getLogger("optuna")
    lib.addHandler(handler)
    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.INFO)          # Optuna's default
    try:
        Tuner(make_op(graph(), "spmm", 16), "cpu", storage=db, runner=FakeRunner(), seed=0).run(trials=3)
        assert not [m for m in seen if "A new study created" in m or "finished with value" in m], seen
        assert optuna.logging.get_verbosity() == optuna.logging.INFO        # restored
        optuna.logging.set_verbosity(optuna.logging.DEBUG)                 # the caller asks for more
        Tuner(make_op(graph(), "spmm", 8), "cpu", storage=db, runner=FakeRunner(), seed=0).run(trials=2)
        assert any("A new study created" in m for m in seen)
    finally:
        optuna.logging.set_verbosity(before)
        lib.removeHandler(handler)


# -- the tuner's promises: model seeds, a baseline per run, confirmation, the stored-record policy --
def _default_cfg(op):
    from spcompile.compile import default_config

    return default_config(op, "cpu")


def test_model_seeds_are_measured_first(db, monkeypatch):
    """The shipped model's first choices (across the templates of the space) are the first trials."""
    from spcompile.autotune import knowledge

    op = make_op(graph(), "spmm", 16)
    tn = Tuner(op, "cpu", storage=db, runner=FakeRunner())
    tname, pipes = next(iter(tn.space.items()))
    tpl = spcompile.get_template(tname)
    mod = spcompile.SparseModule.from_op(op)
    pname, dist = next((k, d) for k, d in tpl.space(mod).items() if hasattr(d, "choices") and len(d.choices) > 1)
    base = dict(tpl.default_params(mod))
    label = [lab for lab in pipes if lab != "none"][0]
    ranked = []
    for i, c in enumerate(reversed(dist.choices)):
        if c == base[pname]:
            continue
        ranked.append((tpl.make_config({**base, pname: c}, pipes[label], "cpu"), 2.0 - 0.1 * i))
    ranked.append((Config("no.such_template", {}, (), "cpu"), 1.0))   # outside the space: ignored
    asked = []

    def fake_ranked(sop, target, precision="fp32", k=8):
        asked.append((target, precision, k))
        return ranked[:k]

    monkeypatch.setattr(knowledge, "ranked_configs", fake_ranked)
    runner = FakeRunner()
    tn = Tuner(op, "cpu", storage=db, runner=runner, seed=0, study_name="model-seeded")
    tn.run(trials=len(ranked) + 2)
    want = [c for c, _ in ranked[:-1]]
    assert runner.calls[:len(want)] == want, "the model's choices were not measured first, in order"
    assert asked and asked[0][:2] == ("cpu", "fp32")
    seeded = [t for t in tn.study.get_trials() if str(t.user_attrs.get("seed", "")).startswith("model:")]
    assert len(seeded) == len(want) and seeded[0].user_attrs["expected_speedup"] == pytest.approx(ranked[0][1])
    # a broken model never stops tuning
    monkeypatch.setattr(knowledge, "ranked_configs", lambda *a, **k: 1 / 0)
    assert Tuner(op, "cpu", storage=db, runner=FakeRunner(), study_name="broken-model").run(trials=3).n_trials == 3


class Drifting(FakeRunner):
    """The baseline gets faster with every run (another load on the machine, say)."""

    def __init__(self, baseline_ms, **kw):
        super().__init__(**kw)
        self.baseline_ms = baseline_ms
        self.baselines = 0

    def baseline(self, op):
        self.baselines += 1
        return MeasureResult("ok", kernel_s=self.baseline_ms * 1e-3, name="fake-baseline")


def test_baseline_is_measured_again_by_every_run(db):
    op = make_op(graph(), "spmm", 16)
    r1 = Drifting(50.0)
    res1 = Tuner(op, "cpu", storage=db, runner=r1, seed=0).run(trials=4)
    assert r1.baselines == 1 and res1.baseline_ms == pytest.approx(50.0)
    r2 = Drifting(20.0)
    res2 = Tuner(op, "cpu", storage=db, runner=r2, seed=0).run(more=2)
    assert r2.baselines == 1 and res2.baseline_ms == pytest.approx(20.0), "a baseline from an earlier run was kept"
    assert res2.speedup == pytest.approx(20.0 / res2.best_kernel_ms)
    rec = open_database(db).lookup(op.key(), "cpu")
    # the record and its baseline were measured in the same run
    assert rec.baseline_ms in (pytest.approx(50.0), pytest.approx(20.0))
    assert rec.speedup == pytest.approx(rec.baseline_ms / rec.kernel_ms)


class Confirming(FakeRunner):
    """The second measurement of a config is ``factor`` times its first (the first was lucky)."""

    def __init__(self, factor=1.0, only=None, **kw):
        super().__init__(**kw)
        self.factor = factor
        self.only = only
        self.seen = {}

    def measure(self, op, cfg, *, timeout=None, prune_above=None):
        res = super().measure(op, cfg, timeout=timeout, prune_above=prune_above)
        k = json.dumps(cfg.to_dict(), sort_keys=True)
        n = self.seen[k] = self.seen.get(k, 0) + 1
        if n >= 2 and res.ok and (self.only is None or self.only(cfg)):
            res.kernel_s *= self.factor
        return res


def test_configs_close_to_the_best_are_confirmed_too(db):
    """The search's best was lucky (its second measurement is 1.3x its first); another config
    measured within 10 % of it is confirmed too, and wins; one 20 % off is not measured again."""
    op = make_op(graph(), "spmm", 16)
    probe = FakeRunner()
    Tuner(op, "cpu", storage=db + ".probe", runner=probe, seed=0).run(trials=10)
    order = sorted({json.dumps(c.to_dict(), sort_keys=True): c for c in probe.calls}.values(), key=probe.kernel_s)
    best, close, far = order[0], order[1], order[2]
    t_best = probe.kernel_s(best)

    class Runner(Confirming):
        def kernel_s(self, cfg):
            if cfg == close:
                return t_best * 1.05
            if cfg == far:
                return t_best * 1.2
            return FakeRunner.kernel_s(self, cfg) if cfg == best else t_best * 3

    runner = Runner(1.3, only=lambda cfg: cfg == best)
    res = Tuner(op, "cpu", storage=db, runner=runner, seed=0, confirm=1, callbacks=[runner.events]).run(trials=10)
    confirmations = runner.calls[runner.confirm_at:]
    assert best in confirmations and close in confirmations and far not in confirmations
    assert res.best_config == close and res.stored


def test_winner_is_confirmed_before_it_is_stored(db):
    op = make_op(graph(), "spmm", 16)
    runner = Confirming(1.3)
    res = Tuner(op, "cpu", storage=db, runner=runner, seed=0, callbacks=[runner.events]).run(trials=10)
    confirmations = runner.calls[runner.confirm_at:]
    assert res.best_config in confirmations, "the winner was not measured a second time"
    rec = open_database(db).lookup(op.key(), "cpu")
    assert res.stored and rec is not None and rec.config == res.best_config
    # the stored time is the second measurement, the search's first one is kept beside it
    assert rec.kernel_ms == pytest.approx(res.best_kernel_ms)
    assert rec.extra["confirmed"] and rec.extra["search_kernel_ms"] == pytest.approx(res.search_kernel_ms)
    if res.best_config != _default_cfg(op):
        assert rec.kernel_ms == pytest.approx(runner.kernel_s(res.best_config) * 1.3e3)


def test_nothing_slower_than_the_default_is_stored(db):
    """The search's best measured fast once but slower than the default config the second time:
    nothing is stored, the result says why, and build() falls back."""
    op = make_op(graph(), "spmm", 16)
    dflt = _default_cfg(op)
    # the default is the slowest config of the search (so never among those confirmed), every
    # other is 50x slower the second time
    runner = Confirming(50.0, only=lambda cfg: cfg != dflt,
                        kernel=lambda cfg: 20e-3 if cfg == dflt else FakeRunner.kernel_s(runner, cfg))
    res = Tuner(op, "cpu", storage=db, runner=runner, seed=0).run(trials=10)
    assert res.best_config != dflt
    assert res.stored is False and "slower than the default config" in res.store_note
    assert res.default_ms == pytest.approx(runner.kernel_s(dflt) * 1e3)
    assert open_database(db).lookup(op.key(), "cpu") is None and not open_database(db).records()
    mod = spcompile.build(op.A, "spmm", K=16, target="cpu", storage=db, select_budget=0)
    assert mod.tuning["source"] == "heuristic" and mod.config == dflt
    # build(tune=True) falls back too, and says why
    op8 = make_op(graph(), "spmm", 8)
    dflt8 = _default_cfg(op8)
    cfg, info = choose_config(op8, "cpu", storage=db, trials=10, seed=0, select_budget=0,
                              runner=Confirming(50.0, only=lambda cfg: cfg != dflt8))
    assert info["source"] == "heuristic" and "slower than the default" in info["tune_note"]


def test_nothing_slower_than_the_baseline_is_stored(db):
    op = make_op(graph(), "spmm", 16)
    runner = Drifting(0.01)   # the vendor library beats every config
    res = Tuner(op, "cpu", storage=db, runner=runner, seed=0).run(trials=6)
    assert res.stored is False and "slower than the baseline fake-baseline" in res.store_note
    assert open_database(db).lookup(op.key(), "cpu") is None


def test_more_trials_and_nothing_to_do(db):
    op = make_op(graph(), "spmm", 16)
    Tuner(op, "cpu", storage=db, runner=FakeRunner(), seed=0).run(trials=5)
    again = Drifting(5.0)
    res = Tuner(op, "cpu", storage=db, runner=again, seed=0).run(trials=5)
    assert res.nothing_to_do and "nothing to do" in res.stop_reason and res.n_new == 0
    assert not again.calls and again.baselines == 0 and res.n_trials == 5
    more = FakeRunner()
    res = Tuner(op, "cpu", storage=db, runner=more, seed=0, callbacks=[more.events]).run(more=3)
    assert res.n_trials == 8 and res.n_new == 3 and not res.nothing_to_do and res.stored is not None
    assert 1 <= len(more.searched) <= 3
    with pytest.raises(ValueError):
        Tuner(op, "cpu", storage=db, runner=FakeRunner()).run(more=-1)


def _cli(tmp_path):
    import argparse

    from spcompile.cli import tune as cli_tune

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    cli_tune.add_commands(sub)
    return p


def test_cli_more_and_nothing_to_do(tmp_path, capsys, monkeypatch):
    from spcompile.autotune import tuner as tuner_mod
    from spcompile.cli.common import power_law_graph

    real = tuner_mod.Tuner
    monkeypatch.setattr(tuner_mod, "Tuner", lambda *a, **k: real(*a, **{**k, "runner": FakeRunner()}))
    g = tmp_path / "social.npz"
    sp.save_npz(g, power_law_graph(300, 6, seed=1))
    dbp = str(tmp_path / "cli.db")
    p = _cli(tmp_path)
    base = ["tune", str(g), "-K", "8", "--storage", dbp, "--target", "cpu", "--no-progress"]
    args = p.parse_args(base + ["--trials", "3"])
    assert args.func(args) == 0
    assert "nothing to do" not in capsys.readouterr().out
    args = p.parse_args(base + ["--trials", "3"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "social.npz K=8: nothing to do: the study already has 3 trials (--trials 3); add trials with --more N" in out
    args = p.parse_args(base + ["--more", "2"])
    assert args.func(args) == 0
    assert "social.npz K=8: added 2 trials (the study now has 5)" in capsys.readouterr().out
    args = p.parse_args(base + ["--more", "2", "--trials", "4"])
    assert args.func(args) == 2 and "--more" in capsys.readouterr().err
    # the graph's file name is kept with the study and the record
    rec = open_database(dbp).records()[0]
    assert rec.extra["graph"] == "social.npz"
    assert Tuner(make_op(power_law_graph(300, 6, seed=1), "spmm", 8), "cpu", storage=dbp,
                 runner=FakeRunner()).study.user_attrs["graph"] == "social.npz"


def test_provenance_of_every_decision(tmp_path, capsys, monkeypatch):
    """mod.tuning says where the decision came from; `spcompile info` and `spcompile best` show it."""
    from spcompile.autotune import knowledge
    from spcompile.autotune.policy import describe
    import importlib

    cli_main = importlib.import_module("spcompile.cli.main")

    dbp = str(tmp_path / "prov.db")
    A = graph(150, seed=11)
    op = make_op(A, "spmm", 16)
    res = Tuner(op, "cpu", storage=dbp, runner=FakeRunner(), seed=0, graph="cora.npz").run(trials=6)
    assert res.stored and res.graph == "cora.npz"
    mod = spcompile.build(A, "spmm", K=16, target="cpu", storage=dbp)
    t = mod.tuning
    assert t["source"] == "database" and t["graph"] == "cora.npz" and t["study"] == res.study_name
    assert t["trial"] == res.best_trial and t["baseline_name"] == "fake-baseline"
    assert t["measured_speedup"] == pytest.approx(res.baseline_ms / res.best_kernel_ms)
    line = describe(t)
    assert "decision: database" in line and "cora.npz" in line and f"trial {res.best_trial}" in line
    assert "over fake-baseline" in line
    art = str(tmp_path / "m.spc")
    mod.save(art)
    assert cli_main.main(["info", art]) == 0
    out = capsys.readouterr().out
    assert "decision: database (tuning record)" in out and "graph cora.npz" in out and "measured" in out
    assert cli_main.main(["best", "--storage", dbp]) == 0
    out = capsys.readouterr().out
    assert "cora.npz" in out and "fake-baseline" in out and f"#{res.best_trial}" in out
    # tuned by this build
    mod = spcompile.build(A, "spmm", K=8, target="cpu", storage=dbp, trials=5, runner=FakeRunner())
    assert mod.tuning["source"] == "tuned" and mod.tuning["trial"] is not None and mod.tuning["measured_speedup"] > 0
    # the default heuristics, the model's first choice (expected speed-up), the caller's choice
    assert spcompile.build(A, "spmm", K=4, target="cpu", storage=dbp, select_budget=0).tuning["source"] == "heuristic"
    assert spcompile.build(A, "spmm", K=4, target="cpu", storage=dbp).tuning["source"] == "quick"
    dflt = _default_cfg(make_op(A, "spmm", 4))
    monkeypatch.setattr(knowledge, "ranked_configs", lambda *a, **k: [(dflt, 1.7)])
    m = spcompile.build(A, "spmm", K=4, target="cpu", storage=dbp, select_budget=0)
    assert m.tuning["source"] == "model" and m.tuning["expected_speedup"] == pytest.approx(1.7)
    assert "expected 1.70x" in describe(m.tuning)
    m = spcompile.build(A, "spmm", K=4, target="cpu", template=dflt.template)
    assert m.tuning["source"] == "explicit"
    assert describe({}) .startswith("decision: unknown")


def test_cli_says_when_nothing_was_stored(tmp_path, capsys, monkeypatch):
    from spcompile.autotune import tuner as tuner_mod

    real = tuner_mod.Tuner
    monkeypatch.setattr(tuner_mod, "Tuner", lambda *a, **k: real(*a, **{**k, "runner": Drifting(1e-3)}))
    g = tmp_path / "tiny.npz"
    sp.save_npz(g, graph(100, seed=2))
    dbp = str(tmp_path / "cli.db")
    args = _cli(tmp_path).parse_args(["tune", str(g), "-K", "8", "--trials", "3", "--storage", dbp, "--target", "cpu",
                                      "--no-progress"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "tiny.npz K=8: nothing stored: the best config" in out and "slower than the baseline fake-baseline" in out
    assert not open_database(dbp).records()


def test_early_pruning_limits():
    """A trial stops after its first timing when it is clearly losing: over 2x the best so far on
    CUDA (a calibration pass over the input sets), 3x on the CPU (a single call, noisier)."""
    from spcompile.autotune.measure import CUDARunner

    for runner, factor in ((CUDARunner(isolate=False), 2.0), (CPURunner(isolate=False), 3.0)):
        seen = []

        class Stub:
            def time(self, fn, n, prune_above=None, deadline=None):
                seen.append(prune_above)

        runner.timer = Stub()
        runner._time(None, None, 1, 1e-3, None)
        runner._time(None, None, 1, None, None)
        assert seen == [pytest.approx(factor * 1e-3), None]


def test_best_seeds_are_measured_again_behind_the_other_pipelines(db):
    """Once the enqueued seeds are measured, each template's fastest few (``reorder_top``) are
    enqueued again behind every other pipeline of that template (same parameters), once per study."""
    op = make_op(graph(), "spmm", 16)
    tu = Tuner(op, "cpu", storage=db, runner=FakeRunner(), seed=0)
    tname = next(iter(tu.space))
    assert len(tu.space[tname]) > 1, tu.space[tname]     # the template has pipelines to try
    tu._enqueue_seeds()
    n_seeds = len(tu.study.get_trials(deepcopy=False))
    tu.run(trials=n_seeds + 12)
    trials = tu.study.get_trials(deepcopy=False)
    again = [t for t in trials if str(t.user_attrs.get("seed", "")).startswith("reorder:")]
    assert again, "no seed was tried behind another pipeline"
    assert min(t.number for t in again) >= n_seeds       # after every enqueued seed
    assert tu.study.user_attrs.get("reseeded") is True
    seeds = [t for t in trials[:n_seeds] if "config" in t.user_attrs]
    for t in again:
        c = t.user_attrs["config"]
        same = [s.user_attrs["config"] for s in seeds if s.user_attrs["config"]["params"] == c["params"]
                and s.user_attrs["config"]["template"] == c["template"]]
        assert same and all(x["pipeline"] != c["pipeline"] for x in same)
    per_template = {}
    for t in again:
        per_template.setdefault(t.user_attrs["config"]["template"], set()).add(
            json.dumps(t.user_attrs["config"]["params"], sort_keys=True))
    assert all(len(v) <= tu.reorder_top() for v in per_template.values())
    # a later run of the study does not enqueue them again
    Tuner(op, "cpu", storage=db, runner=FakeRunner(), seed=0).run(more=3)
    again2 = [t for t in tu.study.get_trials(deepcopy=False) if str(t.user_attrs.get("seed", "")).startswith("reorder:")]
    assert len(again2) == len(again)


def test_fastest_seed_neighbours_are_measured_after_the_seeds(db, monkeypatch):
    """Once the enqueued seeds are measured, the fastest config of each template gets its
    template's ``probe_variants`` enqueued on its pipeline (seed "probe"), as quick selection's
    second round measures them; once per study."""
    from spcompile.kernels import get_template

    op = make_op(graph(), "spmm", 16)
    tu = Tuner(op, "cpu", storage=db, runner=FakeRunner(), seed=0)
    tname = next(iter(tu.space))
    tpl = get_template(tname)
    asked = []

    def near(self, params, op=None):
        asked.append(dict(params))
        return [{**dict(params), "parallel": not params.get("parallel", False)}]

    monkeypatch.setattr(type(tpl), "probe_variants", near)
    tu._enqueue_seeds()
    n_seeds = len(tu.study.get_trials(deepcopy=False))
    tu.run(trials=n_seeds + 12)
    trials = tu.study.get_trials(deepcopy=False)
    probes = [t for t in trials if t.user_attrs.get("seed") == "probe"]
    assert asked and probes and min(t.number for t in probes) >= n_seeds
    done = [t for t in trials[:n_seeds] if t.value is not None and "config" in t.user_attrs
            and t.user_attrs["config"]["template"] == tname]
    lead = min(done, key=lambda t: t.value).user_attrs["config"]
    assert asked[0] == lead["params"]
    got = probes[0].user_attrs.get("config") or {}
    if got:   # measured (not a duplicate of a seed)
        assert got["pipeline"] == lead["pipeline"] and got["params"]["parallel"] != lead["params"]["parallel"]
    Tuner(op, "cpu", storage=db, runner=FakeRunner(), seed=0).run(more=3)
    assert len([t for t in tu.study.get_trials(deepcopy=False) if t.user_attrs.get("seed") == "probe"]) == len(probes)


def test_cli_tune_dtype(tmp_path, capsys, monkeypatch):
    """`spcompile tune --dtype`: the workloads' dtype reaches the study and the record; 'auto'
    tunes float64 on the CPU (no CUDA template computes it), even with a GPU; a dtype the target
    does not compute is one error line."""
    import spcompile.autotune.tuner as tuner_mod
    import spcompile.runtime.target as rtarget

    real = tuner_mod.Tuner
    seen = []

    def spy(op, target, **k):
        seen.append((op.dtype, target))
        return real(op, target, **{**k, "runner": FakeRunner()})

    monkeypatch.setattr(tuner_mod, "Tuner", spy)
    monkeypatch.setattr(rtarget, "cuda_available", lambda: True)   # a GPU machine
    g = tmp_path / "g.npz"
    sp.save_npz(g, graph(100, seed=4))
    dbp = str(tmp_path / "dt.db")
    p = _cli(tmp_path)
    args = p.parse_args(["tune", str(g), "-K", "8", "--trials", "3", "--storage", dbp, "--dtype", "float64",
                         "--no-progress"])
    assert args.func(args) == 0
    assert seen == [("float64", "cpu")]
    rec = open_database(dbp).records()[0]
    assert rec.workload["dtype"] == "float64" and rec.config.precision == "fp64"
    args = p.parse_args(["tune", str(g), "-K", "8", "--trials", "3", "--storage", dbp, "--dtype", "float16",
                         "--target", "cpu", "--no-progress"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unsupported dtype 'float16' on target 'cpu'") and err.count("\n") == 1


def test_cli_tune_starts_from_the_untuned_pick(tmp_path, monkeypatch):
    """`spcompile tune`: each job's study starts from what build() without tuning picks with the
    job's database (kernel-time objective); the amortized objective has no such seed."""
    import spcompile.autotune.tuner as tuner_mod
    from spcompile.autotune import policy

    real = tuner_mod.Tuner
    seen = []

    def spy(op, target, **k):
        seen.append(k.get("start_from"))
        return real(op, target, **{**k, "runner": FakeRunner()})

    monkeypatch.setattr(tuner_mod, "Tuner", spy)
    # what the job's own untuned pick returned (quick selection measures on the CPU, so a second
    # decide() of the same workload may pick another candidate of about the same time)
    picks = []
    real_untuned = policy.untuned_config

    def untuned(sop, target, **kw):
        picks.append(real_untuned(sop, target, **kw))
        return picks[-1]

    monkeypatch.setattr(policy, "untuned_config", untuned)
    g = tmp_path / "g.npz"
    A = graph(100, seed=4)
    sp.save_npz(g, A)
    dbp = str(tmp_path / "s.db")
    p = _cli(tmp_path)
    args = p.parse_args(["tune", str(g), "-K", "8", "--trials", "3", "--storage", dbp, "--target", "cpu",
                         "--no-progress"])
    assert args.func(args) == 0
    args = p.parse_args(["tune", str(g), "-K", "8", "--trials", "3", "--storage", str(tmp_path / "a.db"),
                         "--target", "cpu", "--objective", "amortized", "--expected-calls", "10", "--no-progress"])
    assert args.func(args) == 0
    assert picks and picks[0] is not None and picks[0].template in ("extern.scipy", "cpu.csr_spmm")
    assert seen == [picks[0], None]


def test_reorder_top_is_wider_on_small_matrices():
    """Small matrices (cheap trials) re-measure more seeds behind the other row orders than large
    ones, whose 30 s budget buys few trials."""
    import types

    small = Tuner(make_op(graph(), "spmm", 16), "cpu", storage="sqlite:///:memory:", runner=FakeRunner(), seed=0)
    assert small.op.A.nnz <= Tuner.SMALL_NNZ and small.reorder_top() == Tuner.REORDER_TOP_SMALL
    n = Tuner.SMALL_NNZ + 5_000                       # a diagonal-band matrix just over the line
    big = sp.diags([np.ones(n, dtype=np.float32)], [0], format="csr")
    stand_in = types.SimpleNamespace(op=make_op(big, "spmm", 16), REORDER_TOP=Tuner.REORDER_TOP,
                                     REORDER_TOP_SMALL=Tuner.REORDER_TOP_SMALL, SMALL_NNZ=Tuner.SMALL_NNZ)
    assert stand_in.op.A.nnz > Tuner.SMALL_NNZ
    assert Tuner.reorder_top(stand_in) == Tuner.REORDER_TOP < Tuner.REORDER_TOP_SMALL


def test_seeds_lacking_a_parameter_are_enqueued_complete(db, monkeypatch):
    """A seed whose parameter set lacks a parameter of the space (a config saved before the
    parameter existed, a heuristic that leaves it out) is enqueued with the template's
    ``absent_params`` value, else its default's: never with a value the sampler draws."""
    op = make_op(graph(), "spmm", 16)
    tn = Tuner(op, "cpu", storage=db, runner=FakeRunner())
    tname, pipes = next(iter(tn.space.items()))
    tpl = spcompile.get_template(tname)
    mod = spcompile.SparseModule.from_op(op)
    dists = tpl.space(mod)
    base = dict(tpl.default_params(mod))
    a, b = [k for k, d in dists.items() if hasattr(d, "choices") and len(d.choices) > 1 and k in base][:2]
    absent = next(c for c in dists[a].choices if c != base[a])
    monkeypatch.setattr(type(tpl), "absent_params", {a: absent})
    cfg = Config(tname, {k: v for k, v in base.items() if k not in (a, b)}, tuple(next(iter(pipes.values()))), "cpu")
    params = tn.params_from_config(cfg)
    assert params[f"{tname}:{a}"] == absent and params[f"{tname}:{b}"] == base[b]
    assert set(params) == {"template", f"{tname}:pipeline", *(f"{tname}:{k}" for k in dists)}


def test_model_variants_are_seeds(db, monkeypatch):
    """The variants quick selection measures beside the model's first choice of a template
    (``Template.unranked_variants``) are seeds of the study too, right behind its first choice."""
    from spcompile.autotune import knowledge

    op = make_op(graph(), "spmm", 16)
    tn = Tuner(op, "cpu", storage=db, runner=FakeRunner())
    tname, pipes = next(iter(tn.space.items()))
    tpl = spcompile.get_template(tname)
    mod = spcompile.SparseModule.from_op(op)
    base = dict(tpl.default_params(mod))
    pname, dist = next((k, d) for k, d in tpl.space(mod).items()
                       if hasattr(d, "choices") and len(d.choices) > 1 and k in base)
    other = next(c for c in dist.choices if c != base[pname])
    first = tpl.make_config(base, next(iter(pipes.values())), "cpu")
    second = tpl.make_config(base, list(pipes.values())[-1], "cpu")
    monkeypatch.setattr(knowledge, "ranked_configs", lambda *a, **k: [(first, 1.5), (second, 1.4)])
    monkeypatch.setattr(type(tpl), "unranked_variants", lambda self, p, op=None: [{**dict(p), pname: other}])
    seeds = Tuner(op, "cpu", storage=db, runner=FakeRunner(), study_name="variants").seed_configs()
    assert seeds[0] == ("model:0", first)       # the first choice, its variant, then the next choice
    assert seeds[1][0] == "model-variant:0" and dict(seeds[1][1].params) == {**base, pname: other}
    assert seeds[1][1].pipeline == first.pipeline and seeds[2] == ("model:1", second)


def test_locality_order_variants_are_seeds(db, monkeypatch):
    """The model's first choice on its template's ``locality_orders`` (what quick selection
    measures beside it) is a seed of the study too, behind the first choice and its variants."""
    from spcompile.autotune import knowledge

    op = make_op(graph(), "spmm", 16)
    tn = Tuner(op, "cpu", storage=db, runner=FakeRunner())
    tname, pipes = next((t, p) for t, p in tn.space.items() if len(p) > 1)
    tpl = spcompile.get_template(tname)
    base = dict(tpl.default_params(spcompile.SparseModule.from_op(op)))
    specs = list(pipes.values())
    first = tpl.make_config(base, specs[0], "cpu")
    monkeypatch.setattr(knowledge, "ranked_configs", lambda *a, **k: [(first, 1.5)])
    monkeypatch.setattr(type(tpl), "unranked_variants", lambda self, p, op=None: [])
    monkeypatch.setattr(type(tpl), "locality_orders", lambda self, op=None: [list(specs[-1]), list(specs[0])])
    seeds = Tuner(op, "cpu", storage=db, runner=FakeRunner(), study_name="locality").seed_configs()
    assert seeds[0] == ("model:0", first)
    # the first choice's own pipeline is not offered again
    assert seeds[1][0] == "model-locality:0" and not any(s[0] == "model-locality:1" for s in seeds)
    assert dict(seeds[1][1].params) == base and list(seeds[1][1].pipeline) == list(specs[-1]) != list(specs[0])


def test_reuse_configs_are_seeds(db):
    """On a batch of small dense graphs (32-row windows reusing their columns many times) the
    tensor-core template on condensed windows of the stored and the RCM order -- what quick
    selection measures beside the model -- are seeds of the study, and both are points of its
    space (the tuner can enqueue them)."""
    from spcompile.autotune import knowledge

    op = make_op(dense_blocks(), "spmm", 64)
    tn = Tuner(op, "cuda", storage=db, runner=FakeRunner())
    seeds = tn.seed_configs()
    reuse = [(s, c) for s, c in seeds if s.startswith("model-reuse:")]
    assert [s for s, _ in reuse] == ["model-reuse:0", "model-reuse:1"]
    assert [c for _, c in reuse] == knowledge.reuse_configs(op, "cuda", "fp32")
    assert all(tn.params_from_config(c) is not None for _, c in reuse)


def test_start_from_is_the_first_seed(db):
    """``start_from``: a config the study measures first (source "quick"), once; none without it."""
    op = make_op(graph(), "spmm", 16)
    tname, pipes = next(iter(Tuner(op, "cpu", storage=db, runner=FakeRunner()).space.items()))
    tpl = spcompile.get_template(tname)
    pick = tpl.make_config(tpl.default_params(spcompile.SparseModule.from_op(op)), list(pipes.values())[-1], "cpu")
    seeds = Tuner(op, "cpu", storage=db, runner=FakeRunner(), study_name="quick", start_from=pick).seed_configs()
    assert seeds[0] == ("quick", pick) and sum(src == "quick" for src, _ in seeds) == 1
    assert all(src != "quick" for src, _ in Tuner(op, "cpu", storage=db, runner=FakeRunner(),
                                                  study_name="plain").seed_configs())


def test_build_tune_starts_from_the_untuned_pick(monkeypatch, tmp_path):
    """decide(tune=True) (build(tune=True)) hands its Tuner what decide without tuning picks with
    the same database and options (kernel-time objective); nothing with the amortized objective;
    an explicit start_from wins; a failing untuned pick leaves it out."""
    from spcompile.autotune import policy

    seen = []

    class Stop(Exception):
        pass

    def fake_tuner(*a, **kw):
        seen.append(kw)
        raise Stop

    monkeypatch.setattr(policy, "Tuner", fake_tuner)
    op = make_op(graph(), "spmm", 16)
    url = str(tmp_path / "t.db")
    untuned = policy.decide(op, "cpu", storage=url)[0]
    for kw in ({}, {"objective": "amortized", "expected_calls": 10}, {"start_from": None}):
        with pytest.raises(Stop):
            policy.decide(op, "cpu", storage=url, tune=True, trials=1, **kw)
    assert seen[0]["start_from"] == untuned and "start_from" not in seen[1] and seen[2]["start_from"] is None
    real = policy.decide

    def failing_untuned(sop, target, **kw):
        if not kw.get("tune"):
            raise RuntimeError("no pick")
        return real(sop, target, **kw)

    monkeypatch.setattr(policy, "decide", failing_untuned)
    with pytest.raises(Stop):
        failing_untuned(op, "cpu", storage=url, tune=True, trials=1)
    assert "start_from" not in seen[3]


def test_trials_stand_for_their_search_params(db, monkeypatch):
    """A trial's config is the template's ``search_params`` of what the sampler drew (parameters
    without effect set to one value, so equivalent trials share one digest and one measurement);
    csr.crc_cwm: ``flat_nnz`` without ``flat`` is 0, ``rows_per_warp`` with ``flat_nnz`` is 1,
    ``combine_vals`` is 0 where ``unroll`` x ``vec`` fits it."""
    import optuna

    op = make_op(graph(), "spmm", 16)
    tn = Tuner(op, "cpu", storage=db, runner=FakeRunner())
    tname, pipes = next(iter(tn.space.items()))
    tpl = spcompile.get_template(tname)
    drawn = {"template": tname, f"{tname}:pipeline": next(iter(pipes))}
    drawn.update({f"{tname}:{k}": d.choices[-1] for k, d in tn._dists[tname].items()})
    monkeypatch.setattr(type(tpl), "search_params", lambda self, p: {**p, "marked": 1})
    cfg = tn.config_from_trial(optuna.trial.FixedTrial(drawn))
    assert cfg.params["marked"] == 1 and all(cfg.params[k] == d.choices[-1] for k, d in tn._dists[tname].items())

    crc = spcompile.get_template("csr.crc_cwm")
    p = {"flat": 0, "flat_nnz": 64, "rows_per_warp": 4}
    assert crc.search_params(p) == {"flat": 0, "flat_nnz": 0, "rows_per_warp": 4}
    assert crc.search_params({**p, "flat": 1}) == {"flat": 1, "flat_nnz": 64, "rows_per_warp": 1}
    assert crc.search_params({**p, "flat": 1, "flat_nnz": 0}) == {"flat": 1, "flat_nnz": 0, "rows_per_warp": 4}
    assert crc.search_params({"cf": 2}) == {"cf": 2}          # parameter sets without them untouched
    # the capped split-row combine: no effect where unroll x vec partial values fit the cap
    assert crc.search_params({"unroll": 2, "vec": 8, "combine_vals": 16})["combine_vals"] == 0
    assert crc.search_params({"unroll": 4, "vec": 8, "combine_vals": 16})["combine_vals"] == 16


def _seed_graphs():
    """Matrices that switch on each kind of seed: short even rows (flat streams), sparse rows
    around a hub (flat_nnz groups, full occupancy), a small dense-ish graph."""
    rng = np.random.default_rng(3)
    n = 3000
    short = sp.random(n, n, density=3.0 / n, format="csr", random_state=1, dtype=np.float32)
    hub = sp.random(n, n, density=5.0 / n, format="lil", random_state=2, dtype=np.float32)
    hub[5, rng.choice(n, 900, replace=False)] = 1.0
    dense = sp.random(400, 400, density=0.2, format="csr", random_state=3, dtype=np.float32)
    return [short, hub.tocsr(), dense]


@pytest.mark.parametrize("target, dtype, op, reduce", [("cuda", "float32", "spmm", "sum"), ("cuda", "float16", "spmm", "sum"),
                                                      ("cuda", "float32", "spmm", "max"), ("cuda", "bfloat16", "sddmm", None),
                                                      ("cpu", "float32", "spmm", "sum")])
def test_every_seed_is_measured_as_given(db, target, dtype, op, reduce):
    """Each seed a study enqueues (defaults, heuristics, the model's choices and the variants
    quick selection measures) lies inside its template's search space: enqueued, it is measured
    with exactly its own parameters.  A value outside the space (rows_per_warp=8 of the flat
    seeds was once) cannot be enqueued as it is, so such a seed is left out, never measured with
    a value the sampler draws instead."""
    checked = 0
    for A in _seed_graphs():
        for K in (16, 128):
            sop = make_op(A, op, K, reduce, dtype=dtype)
            tn = Tuner(sop, target, storage=db, runner=FakeRunner())
            seeds = tn.seed_configs()
            assert seeds
            for source, cfg in seeds:
                params = tn.params_from_config(cfg)
                if cfg.template not in tn.space or cfg.precision not in tn.allowed:
                    continue   # not enqueued (_enqueue_seeds)
                assert params is not None, (source, cfg)
                for k, v in cfg.params.items():
                    if k in tn._dists[cfg.template]:
                        assert params[f"{cfg.template}:{k}"] == v, (source, cfg.template, k, v)
                checked += 1
    assert checked >= 6


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_second_round_picks_are_in_the_space(db, dtype):
    """Every parameter set quick selection's second round measures next to a csr.crc_cwm lead
    (its ``probe_variants``: other row-slice lengths and block shapes, the capped combine, 16
    rows in flight, warp-reduced hub rows with longer slices) lies inside the tuner's space, so
    ``build()``'s pick can be a study's first trial (``start_from``) with its own parameters.
    (``warp_combine``'s longer slices were once ``2 * max_seg``: a pick of max_seg 128, outside
    the space, was left out of ``build(tune=True)``'s study, which then stored a slower config.)"""
    hub = _seed_graphs()[1]
    tpl = spcompile.get_template("csr.crc_cwm")
    checked = 0
    for K in (64, 128):
        sop = make_op(hub, "spmm", K, dtype=dtype)
        tn = Tuner(sop, "cuda", storage=db, runner=FakeRunner())
        spec = next(iter(tn.space["csr.crc_cwm"].values()))
        mod = spcompile.SparseModule.from_op(sop)
        base = dict(tpl.default_params(mod))
        for ms in tpl.MAX_SEG_SPACE:
            for shape in tpl.SHAPES:
                lead = {**base, "max_seg": ms, **tpl.shape_params(shape, int(base["cf"]))}
                for v in [lead] + tpl.probe_variants(lead, sop):
                    params = tn.params_from_config(tpl.make_config(v, list(spec), "cuda", dtype))
                    assert params is not None, v
                    assert all(params[f"csr.crc_cwm:{k}"] == x for k, x in v.items()), v
                    checked += int(bool(v.get("warp_combine")))
    assert checked > 20          # warp-reduced variants (max row 900 at every K) among them


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sddmm_second_round_picks_are_in_the_space(db, dtype):
    """Every parameter set quick selection's second round measures next to a csr.sddmm lead (the
    lead batched, the other lane-group widths with their entries in flight) lies inside the tuner's
    space, so ``build()``'s pick can start a study, and a study's probe seeds are those variants."""
    A = _seed_graphs()[1]
    tpl = spcompile.get_template("csr.sddmm")
    checked = 0
    for K in (1, 64, 100, 256):
        sop = make_op(A, "sddmm", K, dtype=dtype)
        tn = Tuner(sop, "cuda", storage=db, runner=FakeRunner())
        spec = next(iter(tn.space["csr.sddmm"].values()))
        mod = spcompile.SparseModule.from_op(sop)
        base = dict(tpl.default_params(mod))
        for lead in tpl.seed_params(mod):
            for v in tpl.probe_variants({**base, **lead}, sop):
                params = tn.params_from_config(tpl.make_config(v, list(spec), "cuda", dtype))
                assert params is not None, v
                assert all(params[f"csr.sddmm:{k}"] == x for k, x in v.items()), v
                checked += 1
    assert checked > 40
