"""The autotuner: an Optuna ask/tell search over pipelines, templates and template parameters.

The space is conditional: ``template`` (categorical, only templates that support the op and can
be built on this machine), then ``<template>:pipeline`` (categorical over that template's pass
pipelines, optionally behind a generic reordering), then ``<template>:<param>`` for each entry of
the template's ``space()``.  The study is seeded (``enqueue_trial``) with every template's
default, the papers' heuristics (``Template.seed_params``) and the best configs of the most
similar matrices already in the database; once those are measured, each template's fastest few
(:meth:`Tuner.reorder_top`: 2, or 8 on small matrices) are enqueued again behind every other
pipeline of that template (the seeds run on its first).

Each trial is measured by a :mod:`~spcompile.autotune.measure` (correctness first, then timing).  Failures
(compile error, launch error, timeout, wrong result) are told as ``FAIL`` with their reason and
the search goes on; configs that are clearly slower than the best so far are ``PRUNED`` after a
first timing; a config already measured is not measured again.  The study is seeded first with
the shipped model's first choices (:mod:`~spcompile.autotune.knowledge`) when it has any.

At the end of a run the best configs are measured a second time, together with the default
config, in the same run as the baseline (which every run measures again: never a baseline kept
from another run).  The fastest confirmed config is written to the tuning database with
upsert-if-better semantics -- unless it is slower than the default config or the baseline, in
which case nothing is stored and the result says why.  A failed config is never stored.

Timing: every trial is timed by the runner's :class:`~spcompile.autotune.measure.Timer` mode
(on CUDA by default CUDA-graph replay of ``mod(X, out=Y)``).  The study, each trial's result and
each database record say which mode measured them; a mode other than the target's default
(e.g. ``CUDARunner(mode="cold_l2")``) gets its own study and its own record label
(``kernel_time~cold_l2``), so its numbers are never compared with default-mode ones.

The loop (:meth:`Tuner.run`): while the :class:`StopRule` lets it go on, ask the sampler for a
config, evaluate it (measure it, unless the same config was measured or pruned before), record
the verdict.

Budgets: ``trials`` counts the trials of the *study* that got a verdict (so a resumed or shared
study continues where it stopped, and several workers on one storage share one budget) and
``timeout`` bounds this call's wall time.  Workers send heartbeats; a killed worker's trial goes
stale and is failed by the survivors, which then run the missing trials.

The ``timeout`` keeps room for the end of the run: once this run has measured something, no new
trial starts when a typical trial (the median of this run's) would not end before the time the
confirmation, the default's measurement and the winner's build are expected to need; and a trial
may not run past that point once the run has a working config (its limit is cut to it, never
below a typical trial; the spcompile runners then stop it at its next step -- after its pass
pipeline, after its build, between timing repeats -- and keep their worker, whose restart would
cost more than the wait).  A trial so cut is failed with the reason ``"deadline"`` (not counted as
a verdict: a later run may measure it again).  Each result says how long its phases took
(``TuneResult.seconds``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import socket
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from .space import DEFAULT_REORDERS, candidates, contains, suggest
from .database import (Database, Record, config_digest, open_database, optuna_storage, pass_hashes,
                       target_digest, target_key, template_hash)
from ..core.ir import SparseModule, SparseOp
from ..core.config import Config
from .measure import MODES, MeasureResult, make_runner
from ..core.numerics import allowed_precisions, precision as _precision


def precision_name(p) -> str:
    return _precision(p).name

__all__ = ["Tuner", "TuneResult", "StopRule", "tune", "objective_name"]

DEFAULT_TRIALS = 24
FAIL_REASON = "fail_reason"
#: the fail reason of a trial stopped by the run's ``timeout`` (not by its own time limit)
DEADLINE = "deadline"
INTERRUPTED = "interrupted"


def objective_name(objective: str = "kernel_time", expected_calls: float | None = None) -> str:
    """The objective's name in studies and records: ``kernel_time`` or ``amortized@N``.  The
    precision policy and the Timer mode are record fields of their own (see
    :class:`~spcompile.autotune.database.Record`), never parts of this name."""
    base = objective or "kernel_time"
    if base == "kernel_time":
        return base
    if base.startswith("amortized@"):
        try:
            if float(base.split("@", 1)[1]) > 0:
                return base
        except ValueError:
            pass
    if base in ("amortized", "amortised"):
        if not expected_calls or expected_calls <= 0:
            raise ValueError("the amortized objective needs expected_calls > 0")
        return f"amortized@{expected_calls:g}"
    raise ValueError(f"unknown objective {objective!r}; expected 'kernel_time' or 'amortized'")


def objective_value(res: MeasureResult, objective: str, expected_calls: float | None) -> float:
    """Milliseconds: kernel time, or preprocessing / expected_calls + kernel time."""
    v = res.kernel_s
    name = objective_name(objective, expected_calls)
    if name != "kernel_time":
        v += res.preprocess_s / float(expected_calls or name.split("@", 1)[1])
    return v * 1e3


_WAIT = "wait"


@contextlib.contextmanager
def quiet_optuna():
    """Optuna's INFO lines (a study created, each trial finished) are the tuner's business, not the
    caller's output: while spcompile tunes, Optuna logs warnings and errors only -- unless the caller
    has set Optuna's verbosity to something other than its default."""
    import optuna

    level = optuna.logging.get_verbosity()
    if level != optuna.logging.INFO:
        yield
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)


@dataclass(frozen=True)
class StopRule:
    """When :meth:`Tuner.run` stops.  ``trials``: the study has this many trials with a verdict
    (shared by every worker on the storage; a resumed study counts what it has).  ``timeout``:
    seconds of this call.  ``max_duplicates``: this many configs in a row were measured (or pruned)
    before -- the space is exhausted.  ``wait_limit``: seconds to wait for the last trials in
    flight on other workers (None: three heartbeat grace periods)."""

    trials: int | None = None
    timeout: float | None = None
    max_duplicates: int = 30
    wait_limit: float | None = None

    def reason(self, *, elapsed: float, done: int, running: int, duplicate_streak: int, waited: float) -> str:
        """Why to stop now ("" to go on, ``"wait"`` to wait for other workers' trials)."""
        if self.timeout is not None and elapsed >= self.timeout:
            return "timeout"
        if self.trials is not None and done >= self.trials:
            return "budget"
        if self.trials is not None and done + running >= self.trials:
            # the rest is in flight on other workers: wait for them (or for them to go stale)
            if self.wait_limit is not None and waited > self.wait_limit:
                return "waiting for other workers"
            return _WAIT
        if duplicate_streak >= self.max_duplicates:
            return "search space exhausted"
        return ""


@dataclass
class _Scan:
    """What the study holds now: counted and running trials, the verdicts by config digest, the bests."""

    done: int = 0
    running: int = 0
    waiting: int = 0                               # enqueued, not yet asked for
    measured: dict = field(default_factory=dict)   # config digest -> (trial number, value)
    pruned: dict = field(default_factory=dict)     # config digest -> trial number
    best_kernel: float = math.inf                  # ms
    best_value: float = math.inf                   # ms


@dataclass
class _Loop:
    """One run's own state."""

    started: float
    duplicate_streak: int = 0
    wait_since: float | None = None
    scan: _Scan = field(default_factory=_Scan)
    walls: list = field(default_factory=list)      # seconds of each measurement of this run
    repeats: list = field(default_factory=list)    # ... less its first-run preprocessing and build
    builds: list = field(default_factory=list)     # (kernel s, preprocessing + build s) of good trials

    def waited(self) -> float:
        return 0.0 if self.wait_since is None else time.perf_counter() - self.wait_since

    def note(self, wall: float, res: MeasureResult) -> None:
        """Record what one measurement of this run cost (the deadline's estimates)."""
        self.walls.append(wall)
        first = res.preprocess_s + res.compile_s
        self.repeats.append(max(wall - first, 0.0))
        if res.ok:
            self.builds.append((res.kernel_s, first))

    def trial_estimate(self) -> float:
        """Seconds a next trial is expected to take (median of this run's; 1 s before any)."""
        return statistics.median(self.walls) if self.walls else 1.0

    def finish_estimate(self, confirm: int) -> float:
        """Seconds the end of the run is expected to take: ``confirm`` configs and the default
        measured again (their pipelines and kernels are usually still there), plus the build of the
        fastest config found so far (its pass pipeline and kernel, as ``build()`` redoes them)."""
        again = statistics.median(self.repeats) if self.repeats else 1.0
        build = min(self.builds)[1] if self.builds else 0.0
        return (confirm + 1) * again + build


@dataclass
class TuneResult:
    """Outcome of tuning one workload (also what ``spcompile tune`` tabulates)."""

    key: Any
    target: str
    study_name: str
    storage: str
    objective: str
    best_config: Config | None
    best_value_ms: float | None
    best_kernel_ms: float | None
    best_preprocess_ms: float | None
    baseline_ms: float | None
    baseline_name: str | None
    n_trials: int = 0
    n_complete: int = 0
    n_fail: int = 0
    n_pruned: int = 0
    n_stale: int = 0
    interrupted: bool = False
    stop_reason: str = ""
    fail_reasons: dict = field(default_factory=dict)
    timing_mode: str | None = None   # the Timer mode that measured the study
    precision: str = "fp32"          # the precision policy the study searched under
    #: whether this run stored a record (None: no confirmation ran, e.g. interrupted)
    stored: bool | None = None
    #: why nothing was stored, or what was stored (one line for people)
    store_note: str = ""
    #: the default config's time measured in the same run as the baseline (ms)
    default_ms: float | None = None
    #: the best trial's first measurement (the confirmed one is ``best_kernel_ms``)
    search_kernel_ms: float | None = None
    #: the trial the chosen config came from
    best_trial: int | None = None
    #: trials with a verdict added by this call
    n_new: int = 0
    #: the study already had its budget: nothing was measured
    nothing_to_do: bool = False
    #: the input's file name when known (``spcompile tune FILE``)
    graph: str | None = None
    #: wall seconds of this call's phases: "seeds" (choosing them; the measuring worker starts
    #: meanwhile), "baseline" (measured in the worker: its first measurement), "search", "finish"
    #: (confirmation, default, store)
    seconds: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        if self.baseline_ms and self.best_kernel_ms:
            return self.baseline_ms / self.best_kernel_ms
        return None

    def to_dict(self) -> dict:
        return {"workload": self.key.to_dict(), "target": self.target, "study": self.study_name,
                "objective": self.objective, "precision": self.precision,
                "best_config": self.best_config.to_dict() if self.best_config else None,
                "best_value_ms": self.best_value_ms, "best_kernel_ms": self.best_kernel_ms,
                "best_preprocess_ms": self.best_preprocess_ms, "baseline_ms": self.baseline_ms,
                "baseline_name": self.baseline_name, "speedup": self.speedup, "n_trials": self.n_trials,
                "n_complete": self.n_complete, "n_fail": self.n_fail, "n_pruned": self.n_pruned,
                "n_stale": self.n_stale, "interrupted": self.interrupted, "stop_reason": self.stop_reason,
                "timing_mode": self.timing_mode, "stored": self.stored, "store_note": self.store_note,
                "default_ms": self.default_ms, "search_kernel_ms": self.search_kernel_ms,
                "best_trial": self.best_trial, "n_new": self.n_new, "nothing_to_do": self.nothing_to_do,
                "graph": self.graph, "fail_reasons": dict(self.fail_reasons), "seconds": dict(self.seconds)}


class _Heartbeat:
    """Records a trial's heartbeat every ``interval`` seconds while it runs."""

    def __init__(self, storage, trial_id: int, interval: int | None):
        self._stop = threading.Event()
        self._th = None
        if interval and hasattr(storage, "record_heartbeat"):
            storage.record_heartbeat(trial_id)

            def beat():
                while not self._stop.wait(interval):
                    try:
                        storage.record_heartbeat(trial_id)
                    except Exception:  # a transient DB error must not kill the measurement
                        pass

            self._th = threading.Thread(target=beat, name="spcompile-heartbeat", daemon=True)
            self._th.start()

    def stop(self):
        self._stop.set()
        if self._th is not None:
            self._th.join(timeout=5)


class Tuner:
    """Tunes one :class:`~spcompile.core.ir.SparseOp` on one target with an Optuna study.

    ``runner``: measures configs (default: :func:`spcompile.autotune.measure.make_runner`, measuring
    in a worker process that :meth:`run` stops when it returns; a runner passed in is left to its
    owner to ``close()``); tests inject fakes.  ``storage``: the tuning database (Optuna URL or SQLite path; default the embedded
    file).  ``objective``: "kernel_time" or "amortized" (with ``expected_calls``).
    ``similar``: how many similar matrices' best records seed the study.
    ``callbacks``: functions called with a dict per event ("start", "trial", "end").
    ``precision``: the lowest precision a configuration may compute in (see :data:`PRECISIONS`);
    templates whose ``precision`` choices all fall below it are left out of the space.
    ``model_seeds``: how many of the shipped model's first choices are the study's first trials
    (plus the model's best of every other template in the space; 0: none).  ``confirm``: how many
    of the best configs are measured a second time at the end of a run before one is stored; the
    others measured within ``CONFIRM_MARGIN`` of the best are measured again too (at most
    ``CONFIRM_MAX`` in all): a first measurement can be a few percent off either way.
    ``graph``: the input's file name, kept with the study and the stored record (provenance).
    ``start_from``: a config the study measures first (source "quick"): ``build(tune=True)`` passes
    what ``build()`` without tuning picks on this machine (the database's record, else quick
    selection's measured pick), so that a short study starts from it and a tuned module is not
    slower than an untuned one."""

    def __init__(self, op: SparseOp, target: str = "cpu", *, storage: str | None = None, runner=None,
                 objective: str = "kernel_time", expected_calls: float | None = None, seed: int | None = None,
                 similar: int = 3, reorders: Iterable[str] = DEFAULT_REORDERS, trial_timeout: float | None = None,
                 heartbeat_interval: int = 10, grace_period: int = 30, prune: bool = True,
                 callbacks: Sequence[Callable[[dict], None]] = (), study_name: str | None = None,
                 max_duplicates: int = 30, precision: str = "fp32", model_seeds: int = 8, confirm: int = 2,
                 graph: str | None = None, start_from: Config | None = None):
        self.op = op
        self.start_from = start_from
        self.target = target
        self.db: Database = open_database(storage)
        if self.db.read_only:
            from .database import DatabaseError

            raise DatabaseError(f"cannot tune into the read-only tuning database {self.db.url}: "
                                "pass a writable storage")
        self.model_seeds = max(0, int(model_seeds))
        self.confirm = max(1, int(confirm))
        self.graph = graph
        self.storage_url = self.db.url
        self._owns_runner = runner is None
        self.runner = runner if runner is not None else make_runner(target)
        mode = getattr(self.runner, "mode", None)
        #: the Timer mode that measures this study (None for a runner that does not say)
        self.timing_mode = mode if isinstance(mode, str) else None
        self.precision = precision = precision_name(precision)
        self.allowed = allowed_precisions(precision, op.dtype)
        self._reseeded = False   # the best seeds were enqueued behind the other pipelines (_reseed_reorders)
        self.objective = objective_name(objective, expected_calls)
        # the study's records carry the precision policy and the timing mode as fields of their own:
        # a record is only ever compared with records of the same policy and timing rule
        self.record_timing = self.timing_mode or ""
        self.expected_calls = expected_calls
        self.seed = seed
        self.similar = similar
        self.trial_timeout = trial_timeout
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period
        self.prune = prune
        self.callbacks = list(callbacks)
        self.max_duplicates = max_duplicates
        self.key = op.key()
        self.target_info = target_key(target)
        self.target_digest = target_digest(self.target_info)
        self.space = candidates(op, target, reorders)
        if not self.space:
            raise RuntimeError(f"no template on target {target!r} can run op={op.op!r} reduce={op.reduce!r} "
                               "on this machine")
        self._mod0 = SparseModule.from_op(op)
        self._dists = {}
        from ..kernels import get_template

        from optuna.distributions import CategoricalDistribution

        for t in list(self.space):
            tpl = get_template(t)
            dists = dict(tpl.space(self._mod0))
            pp = tpl.precision_param
            if pp is not None and pp in dists:
                keep = [c for c in dists[pp].choices if c in self.allowed]
                if not keep:
                    del self.space[t]   # every variant computes below the allowed precision
                    continue
                dists[pp] = CategoricalDistribution(keep)
            self._dists[t] = dists
        if not self.space:
            raise RuntimeError(f"no template on target {target!r} can run op={op.op!r} reduce={op.reduce!r} "
                               f"at precision {precision!r} on this machine")
        space_sig = json.dumps({t: {"pipes": p, "hash": template_hash(t),
                                    "dists": {k: repr(d) for k, d in self._dists[t].items()}}
                                for t, p in self.space.items()}, sort_keys=True, default=str)
        self.space_digest = hashlib.sha256(space_sig.encode()).hexdigest()[:8]
        red = f"-{op.reduce}" if op.reduce else ""
        self.study_name = study_name or (f"spcompile-{op.op}{red}-K{op.K}-{self.key.digest()[:16]}-"
                                         f"{self.target_digest[:12]}-{self._label()}-{self.space_digest}")
        self._storage = optuna_storage(self.storage_url, heartbeat_interval, grace_period)
        with quiet_optuna():
            self.study = self._create_study()

    def _label(self) -> str:
        """The objective, the precision policy and a non-default timing mode, for the study name."""
        default_mode = MODES.get(self.target, (None,))[0]
        parts = [self.objective]
        if self.precision != "fp32":
            parts.append(self.precision)
        if self.record_timing and self.record_timing != default_mode:
            parts.append(self.record_timing)
        return "-".join(parts)

    # -- study ---------------------------------------------------------------------------------
    def _create_study(self):
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(seed=self.seed, multivariate=True, group=True,
                                                 n_startup_trials=8, constant_liar=True)
        for _ in range(10):  # concurrent workers may race on the creation
            try:
                return optuna.create_study(study_name=self.study_name, storage=self._storage, sampler=sampler,
                                           direction="minimize", load_if_exists=True)
            except optuna.exceptions.DuplicatedStudyError:
                time.sleep(0.2)
        return optuna.load_study(study_name=self.study_name, storage=self._storage, sampler=sampler)

    def _emit(self, **event):
        for cb in self.callbacks:
            cb(event)

    # -- configs <-> trial params ----------------------------------------------------------------
    def config_from_trial(self, trial) -> Config:
        from ..kernels import get_template

        tname = trial.suggest_categorical("template", sorted(self.space))
        tpl = get_template(tname)
        pipes = self.space[tname]
        label = trial.suggest_categorical(f"{tname}:pipeline", list(pipes))
        params = dict(tpl.default_params(self._mod0))
        for pname, dist in self._dists[tname].items():
            params[pname] = suggest(trial, f"{tname}:{pname}", dist)
        return tpl.make_config(tpl.search_params(params), pipes[label], self.target, self.op.dtype)

    def params_from_config(self, cfg: Config) -> dict | None:
        """Optuna params (for ``enqueue_trial``) reproducing ``cfg``; None if outside the space (a
        template, pipeline or parameter value the space does not hold).  A
        parameter of the space that ``cfg`` lacks takes the template's ``absent_params`` value
        (what the kernel does without it), else its default's: a seed is measured as given, never
        with a value the sampler draws at random."""
        from ..kernels import get_template
        from ..passes import Pipeline

        if cfg.template not in self.space or cfg.target != self.target:
            return None
        try:
            spec = Pipeline(cfg.pipeline).spec()
        except Exception:
            return None
        label = next((lab for lab, p in self.space[cfg.template].items() if p == spec), None)
        if label is None:
            return None
        out = {"template": cfg.template, f"{cfg.template}:pipeline": label}
        tpl = get_template(cfg.template)
        fill = None
        for pname, dist in self._dists[cfg.template].items():
            if pname in cfg.params:
                v = cfg.params[pname]
            elif pname in tpl.absent_params:
                v = tpl.absent_params[pname]
            else:
                if fill is None:
                    try:
                        fill = dict(tpl.default_params(self._mod0))
                    except Exception:  # noqa: BLE001 - a default that needs a pipeline's formats
                        fill = {}
                v = fill.get(pname)
            if v is None:
                continue
            if not contains(dist, v):
                return None   # not in the space: it could only be measured with a drawn value
            out[f"{cfg.template}:{pname}"] = v
        return out

    def seed_configs(self) -> list[tuple[str, Config]]:
        """Known-good starting points: defaults, the papers' heuristics, similar matrices' bests."""
        from ..passes import Pipeline
        from ..kernels import get_template

        model = self.model_seed_configs()
        seeds: list[tuple[str, Config]] = [(src, cfg) for src, cfg, _ in model]
        try:   # the variants quick selection measures beside the model's choices (what build()
            # tries), right behind the first choice: a short study measures them before the
            # model's lower-ranked choices
            from .knowledge import beside_ranking

            ranked = [(cfg, sp) for src, cfg, sp in model if src.startswith("model:")]
            beside = beside_ranking(ranked, self.op, self.target, self.precision)
            count: dict = {}
            variants = []
            for kind, c in beside:         # numbered within each kind: model-variant:0, :1, model-reuse:0
                variants.append((f"model-{kind}:{count.setdefault(kind, 0)}", c))
                count[kind] += 1
            seeds[1:1] = variants
        except Exception:  # noqa: BLE001 - knowledge is an optimisation, never a reason to fail
            pass
        for tname, pipes in self.space.items():
            tpl = get_template(tname)
            own = next(iter(pipes.values()))
            seeds.append(("default", tpl.make_config(tpl.default_params(self._mod0), own, self.target, self.op.dtype)))
            mod = self._mod0
            if own:  # heuristics may need the format data the template's pipeline produces
                try:
                    mod = Pipeline(own)(self._mod0)
                except Exception:
                    mod = self._mod0
            try:
                heur = tpl.seed_params(mod)
            except Exception:
                heur = []
            for p in heur:
                seeds.append(("heuristic", tpl.make_config({**tpl.default_params(self._mod0), **dict(p)},
                                                           own, self.target, self.op.dtype)))
        if self.start_from is not None:
            seeds.insert(0, ("quick", self.start_from))
        if self.similar:
            try:
                for dist, rec in self.db.similar(self.key, self.target_info, self.objective, self.similar,
                                                 precision=self.precision, timing=self.record_timing):
                    seeds.append((f"similar:{rec.workload_digest[:12]}", rec.config))
            except Exception:
                pass
        return seeds

    def model_seed_configs(self) -> list[tuple[str, Config, float | None]]:
        """The shipped model's first choices for this workload (:func:`~spcompile.autotune.knowledge.ranked_configs`):
        its ``model_seeds`` best configs overall plus the best one of every other template of the
        space it ranks (the space holds only the templates the precision policy admits), as
        ``("model:<rank>", config, expected speed-up)``, best first.  Empty without knowledge."""
        if not self.model_seeds:
            return []
        if getattr(self, "_model_seed_cache", None) is not None:
            return list(self._model_seed_cache)
        self._model_seed_cache = []
        try:
            from .knowledge import ranked_configs

            ranked = ranked_configs(self.op, self.target, self.precision, k=max(8 * self.model_seeds, 64))
        except Exception:  # noqa: BLE001 - knowledge is an optimisation, never a reason to fail
            return []
        out, templates = [], set()
        for i, (cfg, sp) in enumerate(ranked):
            if cfg.template not in self.space or cfg.precision not in self.allowed:
                continue
            if len(out) < self.model_seeds or cfg.template not in templates:
                out.append((f"model:{i}", cfg, sp))
                templates.add(cfg.template)
        try:   # 16-bit inputs: the float32 class's first choice when this dtype never measured it
            from .knowledge import cross_dtype_configs

            for j, (cfg, sp) in enumerate(cross_dtype_configs(self.op, self.target, self.precision)):
                if cfg.template in self.space and cfg.precision in self.allowed:
                    out.append((f"model-fp32:{j}", cfg, sp))
        except Exception:  # noqa: BLE001
            pass
        self._model_seed_cache = out
        return list(out)

    def _enqueue_seeds(self):
        """Enqueue the seeds once per study: the model's first choices first (they are measured
        first), then every template's default, the papers' heuristics and similar matrices' bests."""
        if self.study.user_attrs.get("seeded"):
            return
        seen = []
        expected = {config_digest(c): sp for _, c, sp in self.model_seed_configs()}
        for source, cfg in self.seed_configs():
            params = self.params_from_config(cfg)
            if params is None or params in seen or cfg.precision not in self.allowed:
                continue
            seen.append(params)
            attrs = {"seed": source}
            sp = expected.get(config_digest(cfg)) if source.startswith("model:") else None
            if sp is not None:
                attrs["expected_speedup"] = float(sp)
            self.study.enqueue_trial(params, user_attrs=attrs, skip_if_exists=True)
        self.study.set_user_attr("seeded", True)

    #: the end of a run also confirms the configs measured within this factor of the best ...
    CONFIRM_MARGIN = 1.10
    #: ... up to this many confirmed configs in all
    CONFIRM_MAX = 6

    #: seeds measured again behind each other pipeline of their template: the fastest N per template
    REORDER_TOP = 2
    #: the same on matrices of at most ``SMALL_NNZ`` entries, whose trials take milliseconds: a
    #: 30 s study measures 100-200 configs there, and a seed that ranked 5th on the first pipeline
    #: can be the best one behind RCM (measured on the H100: ss_nnc1374, K=128, 0.81 of the sweep
    #: oracle with the top 2)
    REORDER_TOP_SMALL = 8
    SMALL_NNZ = 200_000

    def reorder_top(self) -> int:
        """How many of each template's fastest seeds are measured again behind its other pipelines."""
        return self.REORDER_TOP_SMALL if self.op.A.nnz <= self.SMALL_NNZ else self.REORDER_TOP

    def _reseed_reorders(self, scan: "_Scan") -> None:
        """Once the enqueued seeds are all measured: the ``probe_variants`` of each template's
        fastest measured configs (:func:`~spcompile.autotune.select.probe_leads`) on their pipelines
        (what quick selection's second round measures), then the
        :meth:`reorder_top` fastest measured configs of each template again behind each of its other
        pipelines (the same parameters on another row order: a kernel's best shape is often the
        same, its input order decides; the seeds themselves run on each template's first
        pipeline).  Once per study; ``scan``: the loop's view of the study now (nothing is read
        while seeds still wait)."""
        from optuna.trial import TrialState

        from ..core.config import Config
        from ..passes import Pipeline

        if self._reseeded or scan.waiting:
            return
        if self.study.user_attrs.get("reseeded"):
            self._reseeded = True
            return
        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        best: dict = {}
        for t in trials:
            if t.value is None or not math.isfinite(t.value) or "config" not in t.user_attrs:
                continue
            cfg = Config.from_dict(t.user_attrs["config"])
            if cfg.template in self.space:
                best.setdefault(cfg.template, []).append((t.value, cfg))
        from ..kernels import get_template
        from .select import probe_leads

        seen = []
        top = self.reorder_top()
        for tname, found in best.items():
            found.sort(key=lambda x: x[0])
            # the neighbours of the template's fastest configs on their pipelines (quick
            # selection's second round, so that a study measures what build() would)
            for k in probe_leads({k: v for k, (v, _) in enumerate(found)}):
                lead = found[k][1]
                try:
                    near = get_template(tname).probe_variants(dict(lead.params), self.op)
                except Exception:  # noqa: BLE001 - an optimisation, never a reason to fail
                    near = []
                for p in near:
                    params = self.params_from_config(dataclasses.replace(lead, params=dict(p)))
                    if params is None or params in seen:
                        continue
                    seen.append(params)
                    self.study.enqueue_trial(params, user_attrs={"seed": "probe"}, skip_if_exists=True)
            tops, digests = [], set()
            for _, cfg in found:
                if config_digest(cfg) not in digests:
                    digests.add(config_digest(cfg))
                    tops.append(cfg)
                if len(tops) == top:
                    break
            for cfg in tops:
                spec = Pipeline(cfg.pipeline).spec()
                for label, other in self.space[tname].items():
                    if other == spec:
                        continue
                    params = self.params_from_config(dataclasses.replace(cfg, pipeline=tuple(other)))
                    if params is None or params in seen:
                        continue
                    seen.append(params)
                    self.study.enqueue_trial(params, user_attrs={"seed": f"reorder:{label}"}, skip_if_exists=True)
        self.study.set_user_attr("reseeded", True)
        self._reseeded = True

    # -- the loop ------------------------------------------------------------------------------
    def _baseline(self) -> tuple[float | None, str | None]:
        """The baseline (vendor library, or the default config where there is none), measured
        again by every run: a record is only ever compared with a baseline measured in the same
        run, under the same conditions (the study keeps the last run's for its summary)."""
        res = self.runner.baseline(self.op)
        self._baseline_res = res
        b = {"ms": res.kernel_s * 1e3 if res.ok else None, "name": res.name or "baseline",
             "status": res.status, "error": res.error[-500:], "timing_mode": res.mode or self.timing_mode,
             "measured": time.time()}
        self.study.set_user_attr("baseline", b)
        return b.get("ms"), b.get("name")

    @staticmethod
    def _counted(t) -> bool:
        from optuna.trial import TrialState

        if t.state == TrialState.COMPLETE:
            return "duplicate_of" not in t.user_attrs
        if t.state == TrialState.PRUNED:
            return "duplicate_of" not in t.user_attrs
        if t.state == TrialState.FAIL:  # stale trials, interruptions and deadline cuts don't count
            r = t.user_attrs.get(FAIL_REASON)
            return r is not None and r not in (INTERRUPTED, DEADLINE)
        return False

    def _scan(self) -> "_Scan":
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        scan = _Scan(done=sum(1 for t in trials if self._counted(t)),
                     running=sum(1 for t in trials if t.state == TrialState.RUNNING),
                     waiting=sum(1 for t in trials if t.state == TrialState.WAITING))
        for t in trials:
            if t.state == TrialState.COMPLETE and "config_digest" in t.user_attrs:
                scan.measured.setdefault(t.user_attrs["config_digest"], (t.number, t.value))
                if "duplicate_of" not in t.user_attrs:
                    kernel = (t.user_attrs.get("result") or {}).get("kernel_ms") or math.inf
                    scan.best_kernel = min(scan.best_kernel, kernel)
                    scan.best_value = min(scan.best_value, t.value)
            elif t.state == TrialState.PRUNED and "config_digest" in t.user_attrs:
                scan.pruned.setdefault(t.user_attrs["config_digest"], t.number)
        return scan

    def _wait_limit(self) -> float:
        """How long to wait for trials in flight on other workers before giving up on them."""
        return 3 * (self.grace_period or 2 * (self.heartbeat_interval or 10)) + 10

    def run(self, trials: int | None = None, timeout: float | None = None, *,
            stop: StopRule | None = None, more: int | None = None) -> TuneResult:
        """Tune (see :meth:`_run`).  ``more``: add this many trials with a verdict to what the
        study already has (instead of a total ``trials`` budget)."""
        with quiet_optuna():
            return self._run(trials, timeout, stop, more)

    def _run(self, trials, timeout, stop, more=None) -> TuneResult:
        """Tune until the study has ``trials`` trials with a verdict or ``timeout`` seconds pass
        (or until ``stop``, a :class:`StopRule`, says so), then confirm the winner and store it.
        The loop: ask the sampler for a config, evaluate it (measure, unless it was measured or
        condemned before), record the verdict.  At the end (:meth:`_finish`) the best configs are
        measured a second time, with the default config, in this run (as the baseline was): the
        fastest confirmed one is stored unless it is slower than the default or the baseline.
        A study that already has its ``trials`` is not tuned again (``nothing_to_do``).  Ctrl-C
        stops cleanly: the trial in flight is marked failed ('interrupted'), what was measured
        stays in the study (a later run goes on from it) and nothing is stored unconfirmed."""
        rule = stop if stop is not None else StopRule(trials, timeout, self.max_duplicates)
        if more is not None:
            if more < 0:
                raise ValueError(f"more must be >= 0, got {more}")
            rule = dataclasses.replace(rule, trials=self._scan().done + int(more))
        if rule.trials is None and rule.timeout is None:
            rule = dataclasses.replace(rule, trials=DEFAULT_TRIALS)
        if rule.wait_limit is None:
            rule = dataclasses.replace(rule, wait_limit=self._wait_limit())
        loop = _Loop(time.perf_counter())
        interrupted, reason = False, ""
        done0 = self._scan().done
        last = self.study.user_attrs.get("last_run") or {}
        if (rule.trials is not None and done0 >= rule.trials and last.get("n_trials") == done0
                and "stored" in last):
            # the study already has its trials and its winner was confirmed after the last of them
            result = self.result(f"nothing to do: the study already has {done0} trials", False)
            result.nothing_to_do = True
            self._emit(event="end", result=result)
            return result
        stored_now = False
        phases: dict = {}
        try:
            self._begin(rule, phases)
            started = time.perf_counter()
            while True:
                reason = self._stop_reason(rule, loop)
                if reason == _WAIT:
                    time.sleep(min(1.0, self.heartbeat_interval or 1.0))
                    continue
                if reason:
                    break
                self._reseed_reorders(loop.scan)
                asked = self._ask()
                if asked is not None:
                    self._evaluate(*asked, rule, loop)
            t_finish = time.perf_counter()
            phases["search"] = t_finish - started
            self._finish()
            phases["finish"] = time.perf_counter() - t_finish
            stored_now = True
        except KeyboardInterrupt:
            interrupted, reason = True, "interrupted"
        finally:
            if self._owns_runner and hasattr(self.runner, "close"):
                self.runner.close()   # the measuring worker of this study
        result = self.result(reason, interrupted)
        result.n_new = max(0, result.n_trials - done0)
        result.seconds = phases
        if not stored_now:
            result.stored, result.store_note = None, "interrupted before the winner was confirmed: nothing stored"
        self._emit(event="end", result=result)
        return result

    def _begin(self, rule: StopRule, phases: dict):
        t0 = time.perf_counter()
        prestart = getattr(self.runner, "prestart", None)
        if prestart is not None:
            prestart()   # the measuring worker imports while the seeds are chosen
        self._check_timing_mode()
        if self.graph:
            self.study.set_user_attr("graph", self.graph)
        self._enqueue_seeds()
        t1 = time.perf_counter()
        phases["seeds"] = t1 - t0
        self._baseline_ms, self._baseline_name = self._baseline()
        phases["baseline"] = time.perf_counter() - t1
        self._emit(event="start", total=rule.trials, study=self.study_name, baseline_ms=self._baseline_ms,
                   baseline_name=self._baseline_name, key=self.key, timing_mode=self.timing_mode)

    def _check_timing_mode(self):
        """The study records the timing mode that measured it; another mode may not add to it."""
        if self.timing_mode is None:
            return
        had = self.study.user_attrs.get("timing_mode")
        if had is None:
            self.study.set_user_attr("timing_mode", self.timing_mode)
        elif had != self.timing_mode:
            raise ValueError(f"study {self.study_name!r} was measured with timing mode {had!r}; this runner times "
                             f"with {self.timing_mode!r} (their numbers do not compare): use another study")

    def _stop_reason(self, rule: StopRule, loop: "_Loop") -> str:
        import optuna

        elapsed = time.perf_counter() - loop.started
        if rule.timeout is not None and elapsed >= rule.timeout:
            return "timeout"
        if rule.timeout is not None and loop.walls and self._time_left(rule, loop) <= loop.trial_estimate():
            return "timeout"   # a typical trial would end past what the end of the run needs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental API notice
            optuna.storages.fail_stale_trials(self.study)
        loop.scan = self._scan()
        reason = rule.reason(elapsed=elapsed, done=loop.scan.done, running=loop.scan.running,
                             duplicate_streak=loop.duplicate_streak, waited=loop.waited())
        if reason == _WAIT:
            loop.wait_since = loop.wait_since or time.perf_counter()
        else:
            loop.wait_since = None
        return reason

    def _time_left(self, rule: StopRule, loop: "_Loop") -> float:
        """Seconds left for trials before ``rule.timeout``, keeping what the end of the run is
        expected to take (:meth:`_Loop.finish_estimate`)."""
        elapsed = time.perf_counter() - loop.started
        n_confirm = self._confirm_count(sorted(k for k, _ in loop.builds),
                                        max(len(loop.builds), len(loop.scan.measured)))
        return rule.timeout - elapsed - loop.finish_estimate(n_confirm)

    def _confirm_count(self, values: list, available: int) -> int:
        """How many configs the end of a run measures again: the ``confirm`` best, and the others
        within ``CONFIRM_MARGIN`` of the best (``values``: one per config, ascending), at most
        ``CONFIRM_MAX`` (or ``confirm``) and the ``available`` configs."""
        close = sum(1 for v in values if v <= values[0] * self.CONFIRM_MARGIN) if values else 0
        return min(available, max(self.confirm, min(close, max(self.confirm, self.CONFIRM_MAX))))

    def _trial_timeout(self, rule: StopRule, loop: "_Loop") -> tuple[float | None, bool]:
        """The measurement's time limit: ``trial_timeout``, or less near the run's ``timeout``
        (never below this run's typical trial; not before this run has a working config, which
        the end of the run needs); and whether the deadline set it."""
        if rule.timeout is None or not loop.builds:
            return self.trial_timeout, False
        cap = max(self._time_left(rule, loop), loop.trial_estimate(), 1.0)
        if self.trial_timeout is not None and self.trial_timeout <= cap:
            return self.trial_timeout, False
        default = getattr(self.runner, "default_timeout", None)
        if self.trial_timeout is None and default is not None and default <= cap:
            return default, False
        return cap, True

    def _ask(self):
        """A new trial and its config; None when the sampler's choice is not a config (told FAIL)."""
        from optuna.trial import TrialState

        with warnings.catch_warnings():
            # heartbeats are recorded by _Heartbeat (Optuna only does so in optimize())
            warnings.simplefilter("ignore", UserWarning)
            trial = self.study.ask()
        try:
            cfg = self.config_from_trial(trial)
        except KeyboardInterrupt:
            self._tell_interrupted(trial)
            raise
        except Exception as e:  # noqa: BLE001 - a broken template space is a failed trial
            trial.set_user_attr(FAIL_REASON, "space_error")
            trial.set_user_attr("error", str(e)[-1000:])
            self.study.tell(trial, state=TrialState.FAIL)
            return None
        return trial, cfg

    def _tell_interrupted(self, trial):
        from optuna.trial import TrialState

        try:
            trial.set_user_attr(FAIL_REASON, INTERRUPTED)
            self.study.tell(trial, state=TrialState.FAIL)
        except Exception:  # noqa: BLE001 - the storage may be what was interrupted
            pass

    def _evaluate(self, trial, cfg: Config, rule: StopRule, loop: "_Loop"):
        """Measure ``cfg`` (or reuse the verdict of an identical config) and record the verdict."""
        from optuna.trial import TrialState

        scan = loop.scan
        hb = _Heartbeat(self._storage, trial._trial_id, self.heartbeat_interval)
        try:
            dig = config_digest(cfg)
            trial.set_user_attr("config_digest", dig)
            trial.set_user_attr("config", cfg.to_dict())
            trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
            if dig in scan.measured or dig in scan.pruned:   # measured or condemned before
                if dig in scan.measured:
                    num, val = scan.measured[dig]
                    trial.set_user_attr("duplicate_of", num)
                    self.study.tell(trial, val)
                else:
                    val = None
                    trial.set_user_attr("duplicate_of", scan.pruned[dig])
                    self.study.tell(trial, state=TrialState.PRUNED)
                loop.duplicate_streak += 1
                self._emit(event="trial", number=trial.number, status="duplicate", value_ms=val,
                           best_ms=scan.best_value, best_kernel_ms=scan.best_kernel, baseline_ms=self._baseline_ms,
                           done=scan.done, total=rule.trials, counted=False)
                return
            loop.duplicate_streak = 0
            prune_above = (scan.best_kernel * 1e-3 if self.prune and self.objective.startswith("kernel_time")
                           and math.isfinite(scan.best_kernel) else None)
            limit, by_deadline = self._trial_timeout(rule, loop)
            t0 = time.perf_counter()
            if by_deadline and getattr(self.runner, "soft_stops", False):
                # the deadline stops the measurement at its next step; the worker (its pipelines,
                # its kernels) stays for the confirmation
                res = self.runner.measure(self.op, cfg, timeout=self.trial_timeout, prune_above=prune_above,
                                          stop_after=limit)
            else:
                res = self.runner.measure(self.op, cfg, timeout=limit, prune_above=prune_above)
            loop.note(time.perf_counter() - t0, res)
            if by_deadline and res.status == "timeout":
                res.status = DEADLINE   # cut short by the run's timeout: not a config that hangs
            self._tell(trial, cfg, res, self._baseline_ms, self._baseline_name)
            val = objective_value(res, self.objective, self.expected_calls) if res.ok else None
            if val is not None:
                scan.best_value = min(scan.best_value, val)
                scan.best_kernel = min(scan.best_kernel, res.kernel_s * 1e3)
            self._emit(event="trial", number=trial.number, status=res.status, value_ms=val, error=res.error,
                       best_ms=scan.best_value, best_kernel_ms=scan.best_kernel, baseline_ms=self._baseline_ms,
                       done=scan.done + 1, total=rule.trials, counted=True)
        except KeyboardInterrupt:
            self._tell_interrupted(trial)
            raise
        finally:
            hb.stop()

    def _tell(self, trial, cfg: Config, res: MeasureResult, baseline_ms, baseline_name):
        from optuna.trial import TrialState

        final_cfg = res.config or cfg
        d = res.to_dict()
        d.pop("name", None)
        trial.set_user_attr("result", d)  # one attribute: every attribute write is a commit
        if final_cfg != cfg:
            trial.set_user_attr("config", final_cfg.to_dict())
        if res.ok:
            value = objective_value(res, self.objective, self.expected_calls)
            if not (math.isfinite(value) and value > 0):
                trial.set_user_attr(FAIL_REASON, "bad_time")
                self.study.tell(trial, state=TrialState.FAIL)
                return
            self.study.tell(trial, value)   # stored (after a second measurement) by _finish
        elif res.status == "pruned":
            if math.isfinite(res.kernel_s):
                trial.report(res.kernel_s * 1e3, 0)
            self.study.tell(trial, state=TrialState.PRUNED)
        else:
            trial.set_user_attr(FAIL_REASON, res.status)
            self.study.tell(trial, state=TrialState.FAIL)

    # -- the end of a run: confirm, compare, store ---------------------------------------------
    def _finish(self) -> dict:
        """Measure the study's ``confirm`` best configs a second time and the default config, in
        this run (as the baseline was), and store the fastest confirmed config -- unless it is
        slower than the default or than the baseline: then nothing is stored (``build()`` falls
        back to its other paths) and the study's ``last_run`` says why."""
        from optuna.trial import TrialState

        from ..compile import default_config

        trials = [t for t in self.study.get_trials(deepcopy=False)
                  if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs and "config" in t.user_attrs]
        trials.sort(key=lambda t: t.value)
        cands, seen = [], set()
        for t in trials:   # the fastest trial of each config
            dig = t.user_attrs.get("config_digest") or config_digest(Config.from_dict(t.user_attrs["config"]))
            if dig not in seen:
                seen.add(dig)
                cands.append(t)
        cands = cands[:self._confirm_count([t.value for t in cands], len(cands))]
        self._emit(event="confirm", candidates=len(cands))
        last: dict = {"n_trials": self._scan().done, "time": time.time(), "baseline_ms": self._baseline_ms,
                      "baseline_name": self._baseline_name}
        confirmed = []   # (value ms, MeasureResult, Config, trial)
        for t in cands:
            cfg = Config.from_dict(t.user_attrs["config"])
            res = self.runner.measure(self.op, cfg, timeout=self.trial_timeout)
            if res.ok:
                val = objective_value(res, self.objective, self.expected_calls)
                if math.isfinite(val) and val > 0:
                    confirmed.append((val, res, res.config or cfg, t))
        default_ms = None
        try:
            dcfg = default_config(self.op, self.target)
        except Exception:  # noqa: BLE001 - no default on this machine: nothing to compare with
            dcfg = None
        same = [c for c in confirmed if dcfg is not None and config_digest(c[2]) == config_digest(dcfg)]
        if same:   # the default config is one of the confirmed: its confirmation is its time
            default_ms = same[0][0]
        elif dcfg is not None:
            bres = getattr(self, "_baseline_res", None)
            if (bres is not None and bres.ok and (bres.name or "").startswith("default:")
                    and self.objective == "kernel_time"):
                default_ms = bres.kernel_s * 1e3   # the baseline is the default config, measured now
            else:
                dres = self.runner.measure(self.op, dcfg, timeout=self.trial_timeout)
                if dres.ok:
                    default_ms = objective_value(dres, self.objective, self.expected_calls)
        last["default_ms"] = default_ms
        if not confirmed:
            last.update(stored=False, note="no working config was confirmed: nothing stored"
                        if cands else "no working config: nothing stored")
            self.study.set_user_attr("last_run", last)
            return last
        val, res, cfg, t = min(confirmed, key=lambda x: x[0])
        kernel_ms = res.kernel_s * 1e3
        last.update(config=cfg.to_dict(), trial=t.number, value_ms=val, kernel_ms=kernel_ms,
                    preprocess_ms=res.preprocess_s * 1e3,
                    search_kernel_ms=(t.user_attrs.get("result") or {}).get("kernel_ms"))
        compare = val if self.objective != "kernel_time" else kernel_ms
        note = ""
        is_default = dcfg is not None and config_digest(cfg) == config_digest(dcfg)
        if default_ms is not None and compare > default_ms and not is_default:
            note = (f"nothing stored: the best config ({compare:.4g} ms) is slower than the default config "
                    f"({default_ms:.4g} ms) measured in this run")
        elif self._baseline_ms is not None and compare > self._baseline_ms:
            note = (f"nothing stored: the best config ({compare:.4g} ms) is slower than the baseline "
                    f"{self._baseline_name} ({self._baseline_ms:.4g} ms) measured in this run")
        if note:
            last.update(stored=False, note=note)
            self.study.set_user_attr("last_run", last)
            return last
        rec = Record(self.key.digest(), self.target_digest, self.objective, cfg,
                     kernel_ms=kernel_ms, preprocess_ms=res.preprocess_s * 1e3, value_ms=val,
                     baseline_ms=self._baseline_ms, baseline_name=self._baseline_name, workload=self.key.to_dict(),
                     target=self.target_info, template_hash=template_hash(cfg.template) or "",
                     pass_hashes=pass_hashes(cfg.pipeline), study_name=self.study_name,
                     trial_number=t.number, created=time.time(),
                     extra={"compile_ms": res.compile_s * 1e3, "rel_error": res.rel_error,
                            "timing_mode": res.mode or self.timing_mode, "confirmed": True,
                            "search_kernel_ms": last["search_kernel_ms"], "default_ms": default_ms,
                            **({"graph": self.graph} if self.graph else {}),
                            **({"seed": t.user_attrs["seed"]} if t.user_attrs.get("seed") else {}),
                            **({"timing_note": res.note} if res.note else {})},
                     precision=self.precision, timing=self.record_timing)
        better = self.db.save_if_better(rec)
        last.update(stored=bool(better),
                    note=("stored" if better else "kept the database's record: it measured faster than this run's best"))
        self.study.set_user_attr("last_run", last)
        return last

    def result(self, stop: str = "", interrupted: bool = False) -> TuneResult:
        """Summary of the study as it stands (best COMPLETE trial; failures never count)."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        best = None
        fails: dict[str, int] = {}
        n_stale = 0
        for t in trials:
            if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs and "config" in t.user_attrs:
                if best is None or t.value < best.value:
                    best = t
            elif t.state == TrialState.FAIL:
                r = t.user_attrs.get(FAIL_REASON)
                if r is None:
                    n_stale += 1
                else:
                    fails[r] = fails.get(r, 0) + 1
        b = self.study.user_attrs.get("baseline") or {}
        last = self.study.user_attrs.get("last_run") or {}
        out = TuneResult(
            key=self.key, target=self.target, study_name=self.study_name, storage=self.storage_url,
            objective=self.objective, precision=self.precision, timing_mode=self.study.user_attrs.get("timing_mode"),
            best_config=Config.from_dict(best.user_attrs["config"]) if best else None,
            best_value_ms=best.value if best else None,
            best_kernel_ms=best.user_attrs.get("result", {}).get("kernel_ms") if best else None,
            best_preprocess_ms=best.user_attrs.get("result", {}).get("preprocess_ms") if best else None,
            baseline_ms=b.get("ms"), baseline_name=b.get("name"),
            n_trials=sum(1 for t in trials if self._counted(t)),
            n_complete=sum(1 for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs),
            n_fail=sum(v for k, v in fails.items() if k not in (INTERRUPTED, DEADLINE)), n_pruned=sum(1 for t in trials if t.state == TrialState.PRUNED
                                                                         and "duplicate_of" not in t.user_attrs),
            n_stale=n_stale, interrupted=interrupted, stop_reason=stop, fail_reasons=fails,
            best_trial=best.number if best else None, graph=self.study.user_attrs.get("graph") or self.graph)
        if best is not None:
            out.search_kernel_ms = out.best_kernel_ms
        if last.get("config"):
            # the last run's confirmed winner, timed in the same run as its baseline and the default
            out.best_config = Config.from_dict(last["config"])
            out.best_value_ms, out.best_kernel_ms = last.get("value_ms"), last.get("kernel_ms")
            out.best_preprocess_ms, out.best_trial = last.get("preprocess_ms"), last.get("trial")
            out.search_kernel_ms = last.get("search_kernel_ms")
            out.baseline_ms, out.baseline_name = last.get("baseline_ms"), last.get("baseline_name")
        if last:
            out.stored, out.store_note, out.default_ms = last.get("stored"), last.get("note", ""), last.get("default_ms")
        return out


def tune(A, op: str = "spmm", K: int | Sequence[int] | None = None, reduce: str | None = None, *,
         target: str = "auto", dtype: str = "float32", trials: int | None = None, timeout: float | None = None,
         storage: str | None = None, more: int | None = None, **options) -> TuneResult | list[TuneResult]:
    """Tune ``A`` for ``op`` at width ``K`` (or each width of a list) and store the best configs
    in the tuning database.  ``options`` go to :class:`Tuner` (runner, objective, expected_calls,
    seed, similar, trial_timeout, callbacks, ...).  Returns a :class:`TuneResult` (a list for
    several K); a KeyboardInterrupt stops after the current workload with ``interrupted=True``.
    ``more``: add this many trials to each study instead of a total ``trials`` budget."""
    from ..compile import make_op, workload_target

    Ks = list(K) if isinstance(K, (list, tuple)) else [K]
    results = []
    for k in Ks:
        sop = make_op(A, op, k, reduce, dtype)
        res = Tuner(sop, workload_target(sop, target), storage=storage, **options).run(trials, timeout, more=more)
        results.append(res)
        if res.interrupted:
            break
    return results if isinstance(K, (list, tuple)) else results[0]
