"""Quick selection: on a database miss, :func:`spcompile.build` measures a handful of
model-ranked candidates (or the heuristic default) and the vendor library on this machine
(cuSPARSE on a GPU, SciPy on the CPU), within a small time budget, and keeps the fastest (Triton's and cuBLASLt's heuristics-plus-measurement, for sparse kernels).

The candidates are built first (in parallel threads: nvcc runs outside the GIL; kernels already
in the kernel cache cost no compilation), each result is checked against the vendor library's
(or, without one, the first candidate's) on the same random inputs, then each is timed with the
one timing rule (``Timer``, a short setting, rotating over ``N_INPUT_SETS`` input sets as the
tuner's runner and the benchmarks do, so a graph whose X fits in L2 once is not timed hot) until
the budget is spent; the model's first choice and the vendor library are always timed.  A
second round (``PROBE``), within the same budget (its builds and checks do not count, as the first
round's do not), measures the fastest candidates' neighbours on their pipelines (their template's
``probe_variants``).  Candidates within ``FINALIST_MARGIN`` of the
fastest are timed again, in turn, and the one with the fastest median timing is kept.
"""
from __future__ import annotations

import concurrent.futures as cf
import time

import numpy as np

from ..compile import build_from_config
from ..core.config import Config
from ..core.ir import SparseModule, SparseOp
from ..core.numerics import DTYPES, result_tolerance
from ..kernels import get_template
from ..passes import pipeline_key, run_prefixed
from .measure import Timer, device_rel_error, make_inputs

__all__ = ["quick_select", "vendor_config", "pick_candidates", "config_pipeline", "VENDOR", "DEFAULT_BUDGET_S", "DEFAULT_CANDIDATES",
           "MORE_CANDIDATES", "CHEAP_PASSES", "N_INPUT_SETS", "RANKED", "PROBE", "PROBE_LEADS", "PROBE_MARGIN", "probe_leads"]

#: seconds of measurement ``build()`` may spend choosing on a database miss (``select_budget``)
DEFAULT_BUDGET_S = 1.0
#: how many of the model's first choices are measured (plus the vendor library and the variants) ...
DEFAULT_CANDIDATES = 3
#: ... and how many of its next choices, among those that need no pipeline beyond the first ones'
#: or only cheap passes (``CHEAP_PASSES``).  Leave-one-graph-out over the shipped measurements
#: (767 graph x class rows) the fastest measured reaches 0.977 of the fastest portfolio member
#: (geomean; below 0.9 on 63 rows) with the first 3, 0.986 (33) with these 2 more, 0.986 (32)
#: with the first 5, which adds a new RCM run on 215 rows (3.3 s more build() on tu_collab)
MORE_CANDIDATES = 2
#: a second round measures the neighbours of the first round's fastest candidates on their
#: pipelines (their template's ``probe_variants``: for csr.crc_cwm the next shorter and longer
#: ``max_seg`` and the other block shapes) ...
PROBE = True
#: ... of up to ``PROBE_LEADS`` of them, those within ``PROBE_MARGIN`` of the fastest: one short
#: timing can order two near-equal candidates either way (H100, fb100_cornell5 at K=128: two
#: leaders 0.1% apart, and only the neighbours of one of them reach 96.5 us against 114 us).
#: Leave-one-graph-out over the shipped measurements (767 graph x class rows) the fastest measured
#: reaches 0.986 -> 0.994 of the fastest portfolio member (geomean; below 0.9 on 33 -> 14 rows), for
#: 2.0 more builds per row on average (one lead: 0.993, 16 rows, 1.2 builds)
PROBE_LEADS = 2
PROBE_MARGIN = 1.05
#: how many of the model's ranked configs ``build()`` draws its candidates from (the first
#: ``DEFAULT_CANDIDATES`` and up to ``MORE_CANDIDATES`` of the rest)
RANKED = 8
#: passes cheap next to a build (a sort of the rows by length): a candidate behind them alone
#: may be one of the ``MORE_CANDIDATES``
CHEAP_PASSES = frozenset({"reorder.degree"})


def config_pipeline(item) -> tuple[str, list[str]]:
    """``(identity, pass names)`` of the pipeline of a ``(config, ...)`` item of a ranking."""
    pipeline = item[0].pipeline
    return repr(pipeline), [p["name"] for p in pipeline]


def pick_candidates(ranked: list, n: int, more: int, pipeline_of=config_pipeline) -> list:
    """The first ``n`` of ``ranked``, then up to ``more`` of the rest whose pipeline is one of
    theirs or runs only ``CHEAP_PASSES``.  ``pipeline_of(item)``: ``(identity, pass names)`` of an
    item's pipeline (``pass names`` None when unknown: not cheap); by default the items are
    ``(config, ...)`` tuples."""
    first = list(ranked[:max(1, n)])
    known = {pipeline_of(x)[0] for x in first}

    def cheap(x):
        ident, names = pipeline_of(x)
        return ident in known or (names is not None and set(names) <= CHEAP_PASSES)

    return first + [x for x in ranked[max(1, n):] if cheap(x)][:max(0, more)]


#: the library a user would otherwise call, per target
VENDOR = {"cuda": "extern.cusparse", "cpu": "extern.scipy"}


def vendor_config(op: SparseOp, target: str) -> Config | None:
    """The vendor library's config for ``op`` (cuSPARSE through ``extern.cusparse`` on a GPU,
    SciPy through ``extern.scipy`` on the CPU), if it supports the op and dtype and can run here."""
    if target not in VENDOR:
        return None
    try:
        tpl = get_template(VENDOR[target])
    except Exception:
        return None
    if (op.op, op.reduce) not in tpl.ops or op.dtype not in tpl.dtypes or not tpl.available():
        return None
    return tpl.make_config({}, (), target, op.dtype)


#: up to this many multiply-adds (nnz x K) the results are checked against the float64
#: reference on the host (a fraction of a second); above it against the vendor library's result
HOST_REFERENCE_MAX_WORK = 1 << 26
#: candidates timed within this factor of the fastest are finalists: each is timed
#: ``FINALIST_ROUNDS`` more times, in turn, and the fastest median of its timings wins (one short
#: timing per candidate can miss by 15-20% on a GPU: measured on twitch_de, where build() once
#: kept cuSPARSE at 32.7 us over a 27.9 us kernel)
FINALIST_MARGIN = 1.25
FINALIST_ROUNDS = 2


#: input sets the candidates' timings rotate over (one output buffer per set), as the tuner's
#: runner does: with one set X and Y stay in L2 between calls on a graph whose X fits there once,
#: and quick selection ranked candidates under another rule than the tuner and the benchmarks
#: (measured on wing at K=64, X 16 MB: one set timed the chosen module at 15.1 us, the
#: benchmark's three sets at 19.1 us)
N_INPUT_SETS = 3


#: the input sets and their outputs take at most this fraction of the free GPU memory (fewer
#: sets, at least one, on a graph too large for three)
SETS_MEMORY_FRACTION = 0.25


def _sets_that_fit(first, op: SparseOp, free_bytes: int, n_sets: int) -> int:
    """How many of ``n_sets`` input sets shaped like ``first`` (with one output each, in
    ``op.dtype``) fit in ``SETS_MEMORY_FRACTION`` of ``free_bytes``; at least one."""
    item = DTYPES[op.dtype].bytes
    per_set = (sum(x.size for x in first) + int(np.prod(op.output_shape))) * item
    return int(max(1, min(n_sets, SETS_MEMORY_FRACTION * free_bytes // max(1, per_set))))


def _framework_inputs(op: SparseOp, target: str = "cuda", n_sets: int | None = None):
    """``(host, ins, outs, to64, upload, rel_err)``: ``host``, the first input set on the host
    (the one results are checked on); ``ins``, ``n_sets`` (default ``N_INPUT_SETS``) input sets
    on the target, the first one ``host``'s values (on a GPU the others are drawn there: they are
    only timed, and need no host work or copy); ``outs``, an output buffer per set; ``to64(a)``: a
    float64 copy of an array where it lives; ``upload(ref)``: a host float64 array moved there;
    ``rel_err(out, ref64)``: the relative error of an output computed where it lives (a large
    graph's outputs are never copied to the host)."""
    n = max(1, int(N_INPUT_SETS if n_sets is None else n_sets))
    if target == "cpu":
        from ..core.reference import rel_error

        hosts = make_inputs(op, n, seed=12345)
        ins = [tuple(np.ascontiguousarray(x.astype(op.dtype)) for x in h) for h in hosts]
        outs = [np.empty(op.output_shape, dtype=op.dtype) for _ in hosts]
        return hosts[0], ins, outs, (lambda a: a.astype(np.float64)), (lambda r: r), rel_error
    host = make_inputs(op, 1, seed=12345)[0]
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        tdt = getattr(torch, op.dtype)
        n = _sets_that_fit(host, op, torch.cuda.mem_get_info()[0], n)
        first = tuple(torch.from_numpy(x).cuda().to(tdt) for x in host)
        gen = torch.Generator(device="cuda")
        gen.manual_seed(12345)
        ins = [first] + [tuple(torch.randn(x.shape, generator=gen, device="cuda").to(tdt) for x in first)
                         for _ in range(n - 1)]
        outs = [torch.empty(op.output_shape, dtype=tdt, device="cuda") for _ in ins]
        return host, ins, outs, (lambda a: a.double()), (lambda r: torch.from_numpy(r).cuda()), device_rel_error
    import cupy

    n = _sets_that_fit(host, op, cupy.cuda.runtime.memGetInfo()[0], n)
    first = tuple(cupy.asarray(x.astype(op.dtype)) for x in host)
    rs = cupy.random.RandomState(12345)
    ins = [first] + [tuple(rs.standard_normal(x.shape, dtype=cupy.float32).astype(op.dtype) for x in first)
                     for _ in range(n - 1)]
    outs = [cupy.empty(op.output_shape, dtype=op.dtype) for _ in ins]
    return host, ins, outs, (lambda a: a.astype(cupy.float64)), cupy.asarray, device_rel_error


def _host_reference(op: SparseOp, host):
    from ..core import reference

    return np.asarray(reference.run(op.op, op.reduce, op.A, *host), dtype=np.float64)


def probe_leads(times: dict, leads: int | None = None, margin: float | None = None, probed=None) -> list:
    """The keys of ``times`` (``{key: seconds}``) whose neighbours the second round measures: up to
    ``leads`` (``PROBE_LEADS``) of those within ``margin`` (``PROBE_MARGIN``) of the fastest,
    fastest first.  ``probed(key)``: whether the key has neighbours to measure (default: every
    key has).  Keys without (a template with no ``probe_variants``, a staged kernel) take no
    lead's place, and the margin counts from the fastest key that has neighbours: a candidate
    without any that wins the first round neither halves the neighbours measured of a near-tie
    nor, by winning by more than the margin, stops the second round, whose neighbours may beat
    it (H200, 16-bit X / Y at K=64: on fb100_mit8 staged segments led the first round by 17%,
    and a neighbour of the first choice they kept from being measured was 19% faster than them)."""
    leads = PROBE_LEADS if leads is None else leads
    margin = PROBE_MARGIN if margin is None else margin
    order = sorted(times, key=lambda k: times[k])
    if probed is not None:
        order = [k for k in order if probed(k)]
    if not order:
        return []
    near = [k for k in order if times[k] <= margin * times[order[0]]]
    return near[:max(1, int(leads))]


def quick_select(op: SparseOp, target: str, ranked: list[tuple[Config, float | None]], *,
                 budget_s: float = DEFAULT_BUDGET_S, n: int | None = None, more: int | None = None, ctx=None,
                 label: str = "model", vendor: bool = True, extra: list[tuple[str, Config, float | None]] = (),
                 probe: bool | None = None):
    """Build and time the first ``n`` (default ``DEFAULT_CANDIDATES``) of ``ranked`` and up to
    ``more`` (``MORE_CANDIDATES``) of the rest (:func:`pick_candidates`), the ``extra`` candidates
    (``(label, config, expected speed-up)``) and the vendor library; then, with ``probe`` (default
    ``PROBE``), a second round: the ``probe_variants`` of the fastest candidates (:func:`probe_leads`)
    on their pipelines (source ``"probe"``).  Returns ``(module, info)`` of the fastest correct one, or
    ``(None, info)`` when none worked."""
    t0 = time.perf_counter()
    n = DEFAULT_CANDIDATES if n is None else n
    more = MORE_CANDIDATES if more is None else more
    probe = PROBE if probe is None else probe
    cands: list[tuple[str, Config, float | None]] = [(label, c, sp) for c, sp in pick_candidates(ranked, n, more)]
    cands += [(str(src), c, sp) for src, c, sp in extra]
    vcfg = vendor_config(op, target) if vendor else None
    if vcfg is not None:
        cands.append(("vendor", vcfg, 1.0))
    seen: set = set()

    def unique(items):
        out = []
        for src, c, sp in items:
            k = (c.template, repr(c.pipeline), repr(sorted(c.params.items())))
            if k not in seen:
                seen.add(k)
                out.append((src, c, sp))
        return out

    # one pipeline run per distinct pipeline, shared by the candidates behind it (run here, before
    # the kernels are built in threads)
    pipes: dict = {}
    base = SparseModule.from_op(op)

    def run_pipelines(items):
        # pass by pass, each prefix's module kept: a pipeline that starts with one already run
        # (RCM alone, RCM + LSH + SGT) continues from it instead of running its passes again; a
        # pass failing on this matrix drops the candidates behind it (make raises its error)
        for _, c, _ in items:
            try:
                run_prefixed(c.pipeline, base, pipes, ctx)
            except Exception:  # noqa: BLE001
                pass

    def make(item):
        src, c, sp = item
        mod = pipes[pipeline_key(c.pipeline)][0]
        if isinstance(mod, Exception):
            raise mod
        return build_from_config(op, c, ctx, module=mod)

    built: list = []

    def build_all(items):
        """Build ``items`` (their pipelines first, then the kernels in parallel threads: nvcc runs
        outside the GIL); returns the indices of ``built`` they took."""
        run_pipelines(items)
        first = len(built)
        if items:
            with cf.ThreadPoolExecutor(max_workers=min(4, len(items))) as ex:
                for item, fut in [(it, ex.submit(make, it)) for it in items]:
                    try:
                        built.append((item, fut.result(), None))
                    except Exception as e:  # noqa: BLE001
                        built.append((item, None, f"{type(e).__name__}: {e}"[:200]))
        return list(range(first, len(built)))

    first_round = unique(cands)
    round1 = build_all(first_round)
    t_built = time.perf_counter()
    host, sets, outs, to64, upload, rel_err = _framework_inputs(op, target)
    # results are checked on the first set: against float64 on the host when that is cheap, else
    # against the vendor library's (else the first candidate that runs) result when it is finite;
    # each result is compared with it as soon as it is computed (one float64 copy where the outputs
    # live)
    ins, out = sets[0], outs[0]
    ref = upload(_host_reference(op, host)) if op.A.nnz * op.K <= HOST_REFERENCE_MAX_WORK else None
    checked: dict = {}

    def check(indices):
        nonlocal ref
        order = sorted(indices, key=lambda i: built[i][0][0] != "vendor")
        for i in order:
            (src, c, _), mod, err = built[i]
            if mod is None:
                continue
            try:
                out.fill_(float("nan")) if hasattr(out, "fill_") else out.fill(np.nan)
                mod(*ins, out=out)
                if ref is None:
                    r = to64(out)
                    if bool((abs(r) < float("inf")).all()):  # NaN compares False too
                        ref, checked[i] = r, 0.0
                        continue
                    ref = upload(_host_reference(op, host))  # the library's own result is not finite
                checked[i] = rel_err(out, ref)
            except Exception as e:  # noqa: BLE001
                built[i] = (built[i][0], None, f"{type(e).__name__}: {e}"[:200])

    check(round1)
    t_checked = time.perf_counter()
    timer = (Timer("cuda", repeats=3, min_sample_s=2e-4, max_calls=200) if target == "cuda"
             else Timer(target, repeats=3, min_sample_s=2e-3, max_calls=200))
    report, timed, rows = [], {}, {}
    deadline = t_checked + max(0.0, budget_s)

    def time_all(indices):
        for i in indices:
            (src, c, sp), mod, err = built[i]
            row = {"template": c.template, "pipeline": [p["name"] for p in c.pipeline], "source": src,
                   "params": dict(c.params)}
            if mod is None or i not in checked:
                row["error"] = err or "failed"
                report.append(row)
                continue
            rel = checked[i]
            tol = result_tolerance(c.precision, op.dtype)
            if not np.isfinite(rel) or rel > 4 * tol:
                row["error"] = f"result differs from the reference by {rel:.3g}"
                report.append(row)
                continue
            must = i == 0 or src == "vendor"
            if not must and time.perf_counter() > deadline:
                row["skipped"] = "budget spent"
                report.append(row)
                continue
            try:
                sec = timer.time(lambda j: mod(*sets[j], out=outs[j]), len(sets)).seconds
            except Exception as e:  # noqa: BLE001
                row["error"] = f"timing: {type(e).__name__}: {e}"[:200]
                report.append(row)
                continue
            row["kernel_ms"] = sec * 1e3
            report.append(row)
            timed[i], rows[i] = [sec], row

    time_all(round1)
    # second round: the neighbours of the fastest candidates (not the vendor library) on their pipelines
    near: dict = {}

    def neighbours(i):
        if i not in near:
            (_, lc, _), _, _ = built[i]
            tpl = get_template(lc.template)
            near[i] = [("probe", tpl.make_config(p, lc.pipeline, lc.target, op.dtype), None)
                       for p in tpl.probe_variants(dict(lc.params), op)]
        return near[i]

    leads = probe_leads({i: timed[i][0] for i in timed if built[i][0][0] != "vendor"},
                        probed=lambda i: bool(neighbours(i)))
    second_s = 0.0
    if probe and leads and time.perf_counter() <= deadline:
        t2 = time.perf_counter()
        probes = [c for lead in leads for c in neighbours(lead)]
        round2 = build_all(unique(probes))
        check(round2)
        # building (nvcc on a cold kernel cache) and checking the second round is not
        # measurement, as for the first: without this a cold cache compiled the neighbours and
        # then skipped every one of them ("budget spent"), so build() picked worse on a first
        # call than with the same kernels cached
        deadline += time.perf_counter() - t2
        time_all(round2)
        second_s = time.perf_counter() - t2
    del ref
    if len(timed) > 1:
        fastest = min(v[0] for v in timed.values())
        finalists = [i for i, v in timed.items() if v[0] <= FINALIST_MARGIN * fastest]
        for _ in range(FINALIST_ROUNDS if len(finalists) > 1 else 0):
            for i in finalists:
                try:
                    timed[i].append(timer.time(lambda j, m=built[i][1]: m(*sets[j], out=outs[j]),
                                               len(sets)).seconds)
                except Exception:  # noqa: BLE001 - it was timed once already; that timing stands
                    pass
        for i in finalists if len(finalists) > 1 else ():
            rows[i]["kernel_ms"] = float(np.median(timed[i])) * 1e3
            rows[i]["timings_ms"] = [t * 1e3 for t in timed[i]]
    best = min(((rows[i]["kernel_ms"] / 1e3, i) for i in timed), default=None)
    info = {"build_s": round(t_built - t0, 4), "check_s": round(t_checked - t_built, 4),
            "measure_s": round(time.perf_counter() - t_checked, 4), "second_round_s": round(second_s, 4),
            "budget_s": budget_s, "candidates": report}
    if best is None:
        return None, info
    sec, i = best
    (src, c, sp), mod, _ = built[i]
    vend = next((r.get("kernel_ms") for r in report if r["source"] == "vendor"), None)
    info.update(kernel_ms=sec * 1e3, chosen=src)
    if vend:
        info.update(baseline_ms=vend, baseline_name=VENDOR[target], expected_speedup=vend / (sec * 1e3))
    return mod, info
