"""Correctness of the TVM CPU templates (cpu.csr_spmm, cpu.csr_sddmm) against the float64 reference."""
import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.core import numerics, reference  # noqa: F401
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule, SparseOp
from spcompile.kernels import get_template
from spcompile.kernels.tvm import cpu_csr

SPMM = get_template("cpu.csr_spmm")
SDDMM = get_template("cpu.csr_sddmm")


def test_templates_available():
    # TVM with its llvm backend is a dependency: these templates build everywhere the tests run
    assert SPMM.available() and SDDMM.available()


def make_matrix(m=157, n=93, seed=0):
    """Random non-square matrix with empty rows, a very long row, negative values, explicit zeros."""
    rng = np.random.default_rng(seed)
    A = sp.random(m, n, density=0.06, format="lil", random_state=seed, dtype=np.float64)
    A[3, :] = 0
    A[10, :] = 0
    A[m - 1, :] = 0  # last row empty
    A[7, :] = rng.standard_normal(n)  # a full (long) row
    A = A.tocsr()
    A.data = (A.data - 0.5).astype(np.float32)
    A.data[::17] = 0.0  # explicit zeros stay stored entries
    return as_csr(A)


def permuted(A, K, op="spmm", reduce="sum", seed=1):
    rng = np.random.default_rng(seed)
    mod = SparseModule.from_op(SparseOp(op, reduce, A, K))
    return mod.permute(rng.permutation(A.shape[0]), rng.permutation(A.shape[1]))


def check_spmm(mod, params, A, K, reduce, seed=0):
    kern = SPMM.build(mod, params)
    X = np.random.default_rng(seed).standard_normal((A.shape[1], K)).astype(np.float32)
    out = np.full((A.shape[0], K), np.nan, dtype=np.float32)
    kern(X, out=out)
    ref = reference.spmm(A, X, reduce)
    err = reference.rel_error(out, ref)
    assert err < 1e-5, (reduce, K, params, err)
    lens = A.row_lengths
    assert np.all(out[lens == 0] == 0), "empty rows must give 0"


def check_sddmm(mod, params, A, K, seed=0):
    kern = SDDMM.build(mod, params)
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((A.shape[0], K)).astype(np.float32)
    Y = rng.standard_normal((A.shape[1], K)).astype(np.float32)
    out = np.full(A.nnz, np.nan, dtype=np.float32)
    kern(X, Y, out=out)
    err = reference.rel_error(out, reference.sddmm(A, X, Y))
    assert err < 1e-5, (K, params, err)


@pytest.mark.parametrize("K", [1, 3, 64, 100])
@pytest.mark.parametrize("reduce", ["sum", "max", "min", "mean"])
def test_spmm_default_params(K, reduce):
    A = make_matrix()
    mod = SparseModule.from_op(SparseOp("spmm", reduce, A, K))
    check_spmm(mod, SPMM.default_params(mod), A, K, reduce)
    pmod = permuted(A, K, "spmm", reduce)
    check_spmm(pmod, SPMM.default_params(pmod), A, K, reduce)


COMBOS = [
    {"parallel": True, "tasks_per_thread": 32, "balance": "rows", "k_tile": 16, "tile_order": "task", "prefetch": 4},
    {"parallel": False, "tasks_per_thread": 1, "balance": "nnz", "k_tile": 32, "tile_order": "row", "prefetch": 0},
    {"parallel": True, "tasks_per_thread": 2, "balance": "nnz", "k_tile": 64, "tile_order": "task"},
    {"parallel": True, "tasks_per_thread": 8, "balance": "nnz", "k_tile": 100, "tile_order": "row"},
]


@pytest.mark.parametrize("params", COMBOS, ids=lambda p: f"kt{p['k_tile']}-{p['tile_order']}-{p['parallel']}")
@pytest.mark.parametrize("reduce", ["sum", "max", "min", "mean"])
def test_spmm_param_combos(params, reduce):
    A = make_matrix(seed=2)
    K = 100  # not a multiple of any tile: every combo has a remainder slice
    mod = permuted(A, K, "spmm", reduce, seed=3)
    space = SPMM.space(mod)
    for k, v in params.items():
        assert v in space[k].choices, (k, v)
    check_spmm(mod, params, A, K, reduce)


@pytest.mark.parametrize("K", [1, 3, 64, 100])
def test_sddmm(K):
    A = make_matrix(seed=4)
    mod = SparseModule.from_op(SparseOp("sddmm", None, A, K))
    check_sddmm(mod, SDDMM.default_params(mod), A, K)
    pmod = permuted(A, K, "sddmm", None, seed=5)
    params = {**SDDMM.default_params(pmod), "parallel": True, "tasks_per_thread": 32, "balance": "rows",
              "k_tile": max(SDDMM.space(pmod)["k_tile"].choices)}
    check_sddmm(pmod, params, A, K)


def test_int64_indices(monkeypatch):
    """The int64 index path (used when indices do not fit int32), forced on a small matrix."""
    real = cpu_csr.csr_kernel_arrays
    monkeypatch.setattr(cpu_csr, "csr_kernel_arrays", lambda mod: real(mod, index_dtype=np.int64))
    A = make_matrix(m=61, n=47, seed=6)
    for reduce in ("sum", "min"):
        mod = permuted(A, 3, "spmm", reduce, seed=7)
        kern = SPMM.build(mod, SPMM.default_params(mod))
        assert kern.arrays["indices"].dtype == np.int64 and kern.arrays["task_bounds"].dtype == np.int64
        check_spmm(mod, SPMM.default_params(mod), A, 3, reduce)
    mod = permuted(A, 3, "sddmm", None, seed=8)
    check_sddmm(mod, SDDMM.default_params(mod), A, 3)


def test_space_and_defaults_are_consistent():
    A = make_matrix()
    for K in (1, 3, 64, 100, 256, 300):
        for tpl, op, reduce in ((SPMM, "spmm", "sum"), (SDDMM, "sddmm", None)):
            mod = SparseModule.from_op(SparseOp(op, reduce, A, K))
            space, default = tpl.space(mod), tpl.default_params(mod)
            assert set(default) == set(space)
            for k, v in default.items():
                assert v in space[k].choices, (tpl.name, K, k, v)


def test_task_bounds_balance_nnz():
    lens = np.array([1] * 1000 + [5000] + [1] * 1000)
    indptr = np.concatenate([[0], np.cumsum(lens)])
    b = cpu_csr.task_bounds(indptr, 4, "nnz")
    assert b[0] == 0 and b[-1] == len(lens) and np.all(np.diff(b) >= 0) and len(b) == 5
    work = indptr[b[1:]] - indptr[b[:-1]] + np.diff(b)
    assert work.max() <= 5001 + 1001  # the long row sits in one task, the rest is spread
    r = cpu_csr.task_bounds(indptr, 4, "rows")
    assert np.array_equal(r, [0, 500, 1000, 1500, 2001]) or np.all(np.abs(np.diff(r) - 500) <= 1)
    assert np.array_equal(cpu_csr.task_bounds(np.array([0]), 8), [0, 0])  # no rows
    assert len(cpu_csr.task_bounds(np.array([0, 2, 3]), 8)) == 3  # never more tasks than rows


def test_build_api_and_shared_library():
    """Same-config builds of the CPU template share one compiled library (the template is named:
    build() alone may pick SciPy by quick selection on a tiny matrix)."""
    import spcompile

    A = make_matrix(seed=9)
    X = np.random.default_rng(0).standard_normal((A.shape[1], 64)).astype(np.float32)
    m1 = spcompile.build(A.to_scipy(), op="spmm", K=64, target="cpu", template="cpu.csr_spmm")
    m2 = spcompile.build(make_matrix(seed=10).to_scipy(), op="spmm", K=64, target="cpu",
                          template="cpu.csr_spmm")
    assert m1.config.template == "cpu.csr_spmm"
    assert m1.kernel.files["kernel.so"] == m2.kernel.files["kernel.so"]
    assert reference.rel_error(m1(X), reference.spmm(A, X)) < 1e-5
