"""Shared fixtures: random test matrices with the awkward cases (empty rows, one very long row,
non-square), the shared graph data set, a cache of built modules and result checking."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.core import numerics, reference  # noqa: F401
from spcompile.core.formats import as_csr

REPO = pathlib.Path(__file__).resolve().parents[1]

#: in CI (CI=true) a test may skip only for want of a GPU (CI machines have none); a skip for a
#: missing data set, tool or package is a failure there (the CI must provide them)
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
_CI_SKIP_OK = re.compile(r"CUDA GPU|CUDA device|usable GPU|no GPU", re.I)


def ci_skip_allowed(item, reason: str) -> bool:
    return item.get_closest_marker("gpu") is not None or bool(_CI_SKIP_OK.search(reason or ""))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if IN_CI and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if not ci_skip_allowed(item, reason):
            rep.outcome = "failed"
            rep.longrepr = (f"skipped under CI=true, where only tests needing a GPU may skip: {reason} "
                            "(install the missing data, tool or package in .ci/run)")


def graphs_dir() -> pathlib.Path:
    """The shared graph set: $SPCOMPILE_GRAPHS, else ../shared/data/graphs beside the repo."""
    env = os.environ.get("SPCOMPILE_GRAPHS")
    return pathlib.Path(env) if env else REPO.parent / "shared" / "data" / "graphs"


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, beside nvcc, or from the nvidia-cuda-cuobjdump wheel (which .ci/run
    installs with nvidia-cuda-nvdisasm, the disassembler cuobjdump runs for -sass)."""
    import shutil

    from spcompile.runtime import cuda as rt

    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = rt.nvcc_path()
    cands = [os.path.join(os.path.dirname(os.path.realpath(nvcc)), "cuobjdump")] if nvcc else []
    try:
        import nvidia

        cands += [os.path.join(p, sub, "bin", "cuobjdump") for p in nvidia.__path__ for sub in ("cu13", "cu12", "")]
    except ImportError:
        pass
    return next((c for c in cands if os.access(c, os.X_OK)), None)


#: a test that runs nvcc (under CI=true its skip fails: CI machines have nvcc)
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def nvcc_cubin(tmp_path, source: str, defines: dict, arch: str = "sm_90", flags=()) -> None:
    """Compile the CUDA ``source`` to a cubin with ``nvcc -O3`` for ``arch`` (``flags`` added), each
    of ``defines`` passed as ``-DNAME=VALUE``; CalledProcessError when it does not compile."""
    src = tmp_path / "kernel.cu"
    src.write_text(source)
    subprocess.run(["nvcc", "-cubin", "-O3", f"-arch={arch}", *flags, *(f"-D{k}={v}" for k, v in defines.items()),
                    str(src), "-o", str(tmp_path / "kernel.cubin")], check=True)


def tool_env(tool: str) -> dict:
    """The environment with ``tool``'s folder first on PATH (cuobjdump finds nvdisasm there)."""
    return {**os.environ, "PATH": os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", "")}


def load_graph(name: str) -> sp.csr_matrix:
    d = graphs_dir()
    if not d.is_dir():  # only where the data set is absent; under CI=true this skip fails
        pytest.skip(f"shared graph folder {d} not present")
    path = d / f"{name}.npz"
    assert path.is_file(), f"graph {name!r} missing from {d}"
    return sp.load_npz(path).tocsr()


def hub_matrix(seed: int = 3) -> sp.csr_matrix:
    """A power-law-like 700 x 500 matrix: a few hub columns shared by many rows, a hub row, empty
    rows (dense tiles and tails for the ASpT formats)."""
    rng = np.random.default_rng(seed)
    m, n = 700, 500
    rows = rng.integers(0, m, 6000)
    cols = np.minimum((rng.pareto(1.2, 6000) * 8).astype(np.int64), n - 1)
    A = sp.coo_matrix((rng.standard_normal(6000), (rows, cols)), shape=(m, n)).tocsr()
    A = A + sp.csr_matrix((rng.standard_normal(n), (np.full(n, 5), np.arange(n))), shape=(m, n))
    keep = np.ones(m)
    keep[[0, 17, m - 1]] = 0.0
    A = (sp.diags(keep) @ A).tocsr()
    A.sum_duplicates()
    A.eliminate_zeros()
    return A.astype(np.float32)


def count_pass_runs(monkeypatch, *classes) -> list:
    """The list to which each pass class of ``classes`` appends its name whenever it transforms
    a module (it still does its work)."""
    calls = []
    for cls in classes:
        real = cls.transform
        monkeypatch.setattr(cls, "transform", lambda self, mod, ctx, real=real, n=cls.__name__:
                            calls.append(n) or real(self, mod, ctx))
    return calls


def dense_blocks(nblocks: int = 24, seed: int = 3, lo: int = 20, hi: int = 60, density: float = 0.7) -> sp.csr_matrix:
    """A batch of small dense graphs: block-diagonal, blocks of ``lo``..``hi`` rows at
    ``density`` (the shape of tu_collab's dense ego networks: 32-row windows that reuse their
    columns many times)."""
    rng = np.random.default_rng(seed)
    blocks = [sp.random(s, s, density=density, random_state=rng, format="csr", dtype=np.float32)
              for s in rng.integers(lo, hi, nblocks)]
    return sp.block_diag(blocks, format="csr")


def random_matrix(m: int, n: int, *, density: float = 0.05, seed: int = 0, empty_rows: int = 3,
                  long_row: bool = True, dtype=np.float32) -> sp.csr_matrix:
    """Random m x n CSR with ``empty_rows`` rows that hold nothing and (when ``long_row``) one row
    holding every column.  Values are signed so that max/min/sum differ."""
    rng = np.random.default_rng(seed)
    nnz = max(1, int(density * m * n))
    rows = rng.integers(0, m, nnz)
    cols = rng.integers(0, n, nnz)
    vals = rng.standard_normal(nnz)
    long = m // 2 if long_row and m > 0 else -1
    if long_row and m > 0:
        rows = np.concatenate([rows, np.full(n, long)])
        cols = np.concatenate([cols, np.arange(n)])
        vals = np.concatenate([vals, rng.standard_normal(n)])
    A = sp.coo_matrix((vals, (rows, cols)), shape=(m, n)).tocsr()
    A.sum_duplicates()
    if empty_rows and m > 2:
        cand = np.setdiff1d(np.arange(m), [long])
        empty = rng.choice(cand, size=min(empty_rows, cand.size), replace=False)
        # always include the first and the last row: the edges of the row loop
        empty = np.unique(np.concatenate([empty, [cand[0], cand[-1]]]))
        keep = np.ones(m, bool)
        keep[empty] = False
        A = sp.diags(keep.astype(np.float64)) @ A
        A = A.tocsr()
        A.eliminate_zeros()
    return A.astype(dtype)


def bounded_rows(m: int, n: int, width: int, seed: int, shared_col: int | None = None) -> sp.csr_matrix:
    """m x n with rows of 0 .. ``width`` nonzeros (distinct columns, unsorted): the first and last
    rows empty, every 7th row exactly ``width`` long, and with ``shared_col`` that column in every
    5th non-empty row (the matrices ELL rows fit)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, width + 1, m)
    lens[0] = lens[-1] = 0
    lens[1::7] = width
    cols = [rng.choice(n, int(k), replace=False) for k in lens]
    if shared_col is not None:
        for i in range(0, m, 5):
            if lens[i] and shared_col not in cols[i]:
                cols[i][0] = shared_col
    indptr = np.concatenate([[0], np.cumsum(lens)])
    return sp.csr_matrix((rng.standard_normal(int(indptr[-1])).astype(np.float32),
                          np.concatenate(cols).astype(np.int32), indptr), shape=(m, n))


def close_scaled(got, ref, tol=1e-5) -> None:
    """``got`` has ``ref``'s shape, no unwritten (NaN) output, and a max error within ``tol`` of
    ``max(1, max |ref|)`` (the packers' emulations against the float64 reference)."""
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    scale = max(1.0, float(np.abs(ref).max(initial=0.0)))
    err = float(np.abs(got - ref).max(initial=0.0)) / scale
    assert err <= tol, err


def empty_row_ids(A) -> np.ndarray:
    return np.flatnonzero(np.diff(sp.csr_matrix(A).indptr) == 0)


def inputs_for(op: str, shape, K: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    m, n = shape
    if op == "spmm":
        return (rng.standard_normal((n, K)).astype(np.float32),)
    return (rng.standard_normal((m, K)).astype(np.float32), rng.standard_normal((n, K)).astype(np.float32))


def check_result(out, A, op: str, reduce, inputs, *, dtype: str = "float32"):
    """``out`` (float32, caller's order) against the float64 scipy reference."""
    out = np.asarray(out)
    # the reference sees the float32 values the kernel sees, computed in float64
    ref = reference.run(op, reduce, as_csr(A), *inputs)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == np.float32
    assert np.all(np.isfinite(out))
    err = reference.rel_error(out, ref)
    assert err <= numerics.tolerance(dtype), f"relative error {err:.3g} for {op}/{reduce}"
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    return ref


class ModuleCache:
    """Builds each (matrix, op, reduce, K, pipeline) once per test session: CPU kernels take
    0.1-0.5 s to compile, and many tests only need *a* module of a given kind."""

    def __init__(self):
        self._mods = {}

    def get(self, name: str, A, op: str, K: int, reduce=None, pipeline=(), **kw):
        key = (name, op, reduce, K, tuple(map(str, pipeline)), tuple(sorted(kw.items())))
        if key not in self._mods:
            self._mods[key] = spcompile.build(A, op, K=K, reduce=reduce, target="cpu",
                                              pipeline=list(pipeline) or None, **kw)
        return self._mods[key]


@pytest.fixture(scope="session")
def module_cache():
    return ModuleCache()


@pytest.fixture(scope="session")
def rect_matrix():
    """Non-square 120 x 90, empty rows (first and last included), one row holding all 90 columns."""
    return random_matrix(120, 90, density=0.04, seed=7)


@pytest.fixture(scope="session")
def square_matrix():
    A = random_matrix(150, 150, density=0.03, seed=11)
    return A


@pytest.fixture(scope="session")
def cora():
    return load_graph("cora")


@pytest.fixture(scope="session")
def pubmed():
    return load_graph("pubmed")


@pytest.fixture
def no_cuda(monkeypatch):
    """Make CUDA unavailable whatever the machine has (deterministic target='cuda' errors)."""
    from spcompile.runtime import target

    monkeypatch.setenv("SPCOMPILE_DISABLE_CUDA", "1")
    target.cuda_available.cache_clear()
    yield
    target.cuda_available.cache_clear()


@pytest.fixture
def no_tuning_db(monkeypatch, tmp_path_factory):
    """build() without a tuning database: decisions come from the default heuristics, never from
    records that happen to be in tuning_logs/ (and nothing is written there)."""
    monkeypatch.setenv("SPCOMPILE_TUNING_DB", str(tmp_path_factory.getbasetemp() / "absent" / "none.db"))


@pytest.fixture
def timed_sets(monkeypatch):
    """The ``n_sets`` of every timing quick selection makes (its ``Timer.time`` calls), in order."""
    from spcompile.autotune import select

    seen: list[int] = []

    class Counting(select.Timer):
        def time(self, fn, n_sets=1, **k):
            seen.append(n_sets)
            return super().time(fn, n_sets, **k)

    monkeypatch.setattr(select, "Timer", Counting)
    return seen


def captured_steps_match_eager(eager, graphed, x, y) -> None:
    """PyTorch's whole-network CUDA-graph recipe on two copies of a model: ``graphed``'s training
    step (forward, cross-entropy loss, backward, capturable Adam) captured once -- after one eager
    step (kernels compiled, launch plans built) and two on a side stream -- and replayed five
    times gives the losses of the same eight steps run eagerly on ``eager``, and every replay
    trains (the loss moves)."""
    import torch

    opts = [torch.optim.Adam(m.parameters(), lr=0.01, capturable=True) for m in (eager, graphed)]

    def step(m, opt):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    ref = [step(eager, opts[0]).item() for _ in range(8)]
    got = [step(graphed, opts[1]).item()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got += [step(graphed, opts[1]).item() for _ in range(2)]
    torch.cuda.current_stream().wait_stream(side)
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        static = step(graphed, opts[1])
    for _ in range(5):
        cg.replay()
        got.append(static.item())
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-5), (got, ref)
    assert len(set(got[3:])) == 5
