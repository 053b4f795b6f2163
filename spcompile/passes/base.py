"""The pass framework: :class:`Pass`, :class:`PassInfo`, the registry, :class:`Pipeline` and
:class:`PassContext` with per-pass options and instruments.

A pass is a class deriving from :class:`Pass` (or a plain function) registered under a dotted
lowercase name with :func:`register_pass`; third-party packages register theirs through the
entry-point group ``spcompile.passes`` (the entry point's name is the pass name, its object a
``Pass`` subclass or a function taking ``(mod, ctx, **options)``).  Passes are lossless: they
only reorder (recording permutations in the module) or add format data.
"""
from __future__ import annotations

import inspect
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..core.ir import PassRecord, SparseModule

ENTRY_POINT_GROUP = "spcompile.passes"

__all__ = ["PassInfo", "Pass", "FunctionPass", "register_pass", "get_pass", "list_passes",
           "Pipeline", "PassContext", "PassInstrument", "TimingInstrument", "ENTRY_POINT_GROUP", "pipeline_key",
           "run_prefixed"]


@dataclass(frozen=True)
class PassInfo:
    """Name, default options and what a pass requires / produces (format names)."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()
    description: str = ""


class Pass:
    """Base class of passes.  Subclasses set ``name``, ``default_options`` (the papers' defaults),
    optionally ``requires``/``produces``, and implement :meth:`transform`."""

    name: str = ""
    default_options: Mapping[str, Any] = {}
    requires: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()

    def __init__(self, **options):
        unknown = set(options) - set(self.default_options)
        if unknown:
            raise TypeError(f"pass {self.name!r} got unknown option(s) {sorted(unknown)}; "
                            f"known: {sorted(self.default_options)}")
        self.options = {**self.default_options, **options}

    @property
    def info(self) -> PassInfo:
        doc = (inspect.getdoc(type(self)) or "").split("\n")[0]
        return PassInfo(self.name, dict(self.options), tuple(self.requires), tuple(self.produces), doc)

    def transform(self, mod: SparseModule, ctx: "PassContext") -> SparseModule:
        raise NotImplementedError

    def __call__(self, mod: SparseModule, ctx: "PassContext | None" = None) -> SparseModule:
        ctx = ctx or PassContext.current()
        missing = [r for r in self.requires if r not in mod.formats]
        if missing:
            raise ValueError(f"pass {self.name!r} requires format(s) {missing}; run the pass producing them first")
        return self.transform(mod, ctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.options})"


class FunctionPass(Pass):
    """A pass made from a function ``f(mod, ctx, **options) -> SparseModule``."""

    func: Callable = None  # set by the factory

    def transform(self, mod, ctx):
        return type(self).func(mod, ctx, **self.options)


_REGISTRY: dict[str, type[Pass]] = {}
_LOCK = threading.Lock()
_ENTRY_POINTS_LOADED = False


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or name != name.lower() or " " in name:
        raise ValueError(f"pass names are dotted lowercase strings, got {name!r}")
    return name


def _as_pass_class(name: str, obj, options=None, requires=(), produces=()) -> type[Pass]:
    if inspect.isclass(obj) and issubclass(obj, Pass):
        # a class's own name must be the registered one: the name recorded in pipeline specs
        # (configs, artifacts) is what replays it.  An inherited name is the parent's, not ours.
        own = obj.__dict__.get("name")
        if own and own != name:
            raise ValueError(f"pass class {obj.__name__} is named {own!r} but registered as {name!r}")
        obj.name = name
        if options:
            obj.default_options = {**obj.default_options, **dict(options)}
        if requires:
            obj.requires = tuple(requires)
        if produces:
            obj.produces = tuple(produces)
        return obj
    if callable(obj):
        sig = inspect.signature(obj)
        defaults = dict(options or {})
        for p in list(sig.parameters.values())[2:]:
            if p.default is not inspect.Parameter.empty:
                defaults.setdefault(p.name, p.default)
        return type(f"FunctionPass[{name}]", (FunctionPass,),
                    {"name": name, "default_options": defaults, "requires": tuple(requires),
                     "produces": tuple(produces), "func": staticmethod(obj), "__doc__": obj.__doc__})
    raise TypeError(f"cannot register {obj!r} as pass {name!r}: expected a Pass subclass or a function")


def register_pass(name: str, *, options: Mapping[str, Any] | None = None, requires=(), produces=(),
                  override: bool = False):
    """Decorator registering a :class:`Pass` subclass or a function ``f(mod, ctx, **opts)`` under
    ``name``.  Registering a name twice is an error unless ``override=True``."""
    _check_name(name)

    def deco(obj):
        cls = _as_pass_class(name, obj, options, requires, produces)
        with _LOCK:
            if name in _REGISTRY and not override and _REGISTRY[name] is not cls:
                raise ValueError(f"a pass named {name!r} is already registered")
            _REGISTRY[name] = cls
        return obj

    return deco


def _load_entry_points():
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    _ENTRY_POINTS_LOADED = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            continue
        try:
            cls = _as_pass_class(_check_name(ep.name), ep.load())
        except Exception as e:  # a broken plug-in must not break spcompile
            import warnings

            warnings.warn(f"could not load spcompile pass entry point {ep.name!r}: {e}")
            continue
        with _LOCK:
            _REGISTRY.setdefault(ep.name, cls)


def _load_builtin():
    from . import builtin  # noqa: F401  (registers the shipped passes)


def get_pass(name: str, **options) -> Pass:
    """An instance of the registered pass ``name`` with ``options`` over its defaults."""
    _load_builtin()
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown pass {name!r}; registered: {sorted(_REGISTRY)}") from None
    return cls(**options)


def list_passes() -> dict[str, PassInfo]:
    _load_builtin()
    _load_entry_points()
    return {n: c().info for n, c in sorted(_REGISTRY.items())}


class PassInstrument:
    """Hooks around each pass run by a :class:`Pipeline`."""

    def enter_pass(self, info: PassInfo, mod: SparseModule) -> None:
        pass

    def exit_pass(self, info: PassInfo, mod: SparseModule, seconds: float) -> None:
        pass


class TimingInstrument(PassInstrument):
    """Collects wall time per pass: ``timings`` is a list of (name, seconds)."""

    def __init__(self):
        self.timings: list[tuple[str, float]] = []

    def exit_pass(self, info, mod, seconds):
        self.timings.append((info.name, seconds))

    def summary(self) -> str:
        return "\n".join(f"{n:24s} {s * 1e3:10.2f} ms" for n, s in self.timings)


class PassContext:
    """Options and instruments for a pipeline run.  ``options`` maps a pass name to overrides of
    its options; ``seed`` makes randomised passes reproducible.  Usable as a context manager."""

    _local = threading.local()

    def __init__(self, options: Mapping[str, Mapping[str, Any]] | None = None,
                 instruments: Sequence[PassInstrument] = (), seed: int = 0):
        self.options = {k: dict(v) for k, v in (options or {}).items()}
        self.instruments = list(instruments)
        self.seed = int(seed)

    @classmethod
    def current(cls) -> "PassContext":
        stack = getattr(cls._local, "stack", None)
        return stack[-1] if stack else PassContext()

    def __enter__(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        self._local.stack.append(self)
        return self

    def __exit__(self, *exc):
        self._local.stack.pop()


def _spec_item(item) -> tuple[str, dict]:
    if isinstance(item, Pass):
        return item.name, dict(item.options)
    if isinstance(item, str):
        return item, {}
    if isinstance(item, Mapping):
        return item["name"], dict(item.get("options", {}))
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], dict(item[1])
    raise TypeError(f"cannot read pipeline item {item!r}: expected a name, (name, options), "
                    "{'name':..., 'options':...} or a Pass")


class Pipeline:
    """An ordered list of passes.  ``Pipeline(["reorder.rcm", ("tile.sgt", {"BLK_H": 16})])``."""

    def __init__(self, passes: Iterable = ()):
        self.passes: list[Pass] = []
        for item in passes:
            if isinstance(item, Pass):
                self.passes.append(item)
            else:
                name, opts = _spec_item(item)
                self.passes.append(get_pass(name, **opts))

    def spec(self) -> list[dict]:
        """JSON-able description; ``Pipeline(p.spec())`` rebuilds it."""
        return [{"name": p.name, "options": dict(p.options)} for p in self.passes]

    def __call__(self, mod: SparseModule, ctx: PassContext | None = None) -> SparseModule:
        ctx = ctx or PassContext.current()
        for p in self.passes:
            over = ctx.options.get(p.name)
            if over:
                p = type(p)(**{**p.options, **over})
            info = p.info
            for ins in ctx.instruments:
                ins.enter_pass(info, mod)
            t0 = time.perf_counter()
            out = p(mod, ctx)
            dt = time.perf_counter() - t0
            if not isinstance(out, SparseModule):
                raise TypeError(f"pass {p.name!r} returned {type(out).__name__}, not a SparseModule")
            metrics = dict(out.metrics.get(p.name, {}))
            metrics.setdefault("seconds", dt)
            out = out.with_metrics(p.name, metrics)
            out = out.replace(log=out.log + (PassRecord(p.name, dict(p.options), dt, metrics),))
            for ins in ctx.instruments:
                ins.exit_pass(info, out, dt)
            mod = out
        return mod

    def __len__(self):
        return len(self.passes)

    def __repr__(self):
        return f"Pipeline({[p.name for p in self.passes]})"


def pipeline_key(spec: Sequence) -> str:
    """The cache key of a pipeline spec (``Pipeline.spec()``-style items): JSON, keys sorted."""
    return json.dumps(list(spec), sort_keys=True, default=str)


def run_prefixed(spec: Sequence, start: SparseModule, cache, ctx: PassContext | None = None
                 ) -> tuple[SparseModule, float]:
    """``(module, seconds)`` of the pipeline ``spec`` run on ``start``, through ``cache`` (a
    dict-like ``{pipeline_key(prefix): (module, or the exception its last pass raised, seconds)}``
    of one op): a cached pipeline comes back as it ran; else the run continues from its longest
    cached prefix one pass at a time, caching every prefix, so that pipelines with a common start
    (RCM alone, then RCM + LSH + SGT) run it once.  The seconds are the whole pipeline's (the
    prefix's as it ran, plus the rest).  A pass that raises is cached as its exception (the
    pipelines that start with that prefix raise it too, and are cached as it) and raised: every
    spec run through it has its own entry afterwards."""
    spec = list(spec)
    keys = [pipeline_key(spec[:n]) for n in range(len(spec) + 1)]
    done = next((n for n in range(len(spec), 0, -1) if keys[n] in cache), 0)
    mod, secs = cache[keys[done]] if done else (start, 0.0)
    if isinstance(mod, BaseException):
        cache[keys[-1]] = (mod, secs)
        raise mod
    if not spec:
        cache[keys[0]] = (mod, secs)       # the empty pipeline: no pass, the start as it is
    for n in range(done, len(spec)):
        t0 = time.perf_counter()
        try:
            mod = Pipeline(spec[n:n + 1])(mod, ctx)
        except Exception as e:
            cache[keys[n + 1]] = (e, secs + time.perf_counter() - t0)
            raise
        secs += time.perf_counter() - t0
        cache[keys[n + 1]] = (mod, secs)
    return mod, secs
