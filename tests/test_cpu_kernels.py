"""Correctness of the TVM CPU templates (cpu.csr_spmm, cpu.csr_sddmm) against the float64 reference;
float64 workloads (those templates and extern.scipy) at the float64 tolerance."""
import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.core import numerics, reference
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


def make_matrix64(m=157, n=93, seed=0):
    """:func:`make_matrix` with float64 values that float32 cannot hold (a rounding to float32
    anywhere is 1e-7 off, far above the float64 tolerance)."""
    A = make_matrix(m, n, seed)
    return as_csr((A.indptr, A.indices, A.data.astype(np.float64) * (1 + 2.0 ** -40), A.shape), np.float64)


def permuted(A, K, op="spmm", reduce="sum", seed=1, dtype="float32"):
    rng = np.random.default_rng(seed)
    mod = SparseModule.from_op(SparseOp(op, reduce, A, K, dtype))
    return mod.permute(rng.permutation(A.shape[0]), rng.permutation(A.shape[1]))


def check_spmm(mod, params, A, K, reduce, seed=0):
    """The kernel of ``mod`` (its dtype: inputs, output and values) against the float64
    reference at the dtype's tolerance."""
    kern = SPMM.build(mod, params)
    dt = mod.op.dtype
    assert kern.arrays["data"].dtype == numerics.dtype(dt).compute
    X = np.random.default_rng(seed).standard_normal((A.shape[1], K)).astype(dt)
    out = np.full((A.shape[0], K), np.nan, dtype=dt)
    kern(X, out=out)
    ref = reference.spmm(A, X, reduce)
    err = reference.rel_error(out, ref)
    assert err < numerics.tolerance(dt), (reduce, K, params, err)
    lens = A.row_lengths
    assert np.all(out[lens == 0] == 0), "empty rows must give 0"


def check_sddmm(mod, params, A, K, seed=0):
    kern = SDDMM.build(mod, params)
    dt = mod.op.dtype
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((A.shape[0], K)).astype(dt)
    Y = rng.standard_normal((A.shape[1], K)).astype(dt)
    out = np.full(A.nnz, np.nan, dtype=dt)
    kern(X, Y, out=out)
    err = reference.rel_error(out, reference.sddmm(A, X, Y))
    assert err < numerics.tolerance(dt), (K, params, err)


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
    A = make_matrix(seed=9)
    X = np.random.default_rng(0).standard_normal((A.shape[1], 64)).astype(np.float32)
    m1 = spcompile.build(A.to_scipy(), op="spmm", K=64, target="cpu", template="cpu.csr_spmm")
    m2 = spcompile.build(make_matrix(seed=10).to_scipy(), op="spmm", K=64, target="cpu",
                          template="cpu.csr_spmm")
    assert m1.config.template == "cpu.csr_spmm"
    assert m1.kernel.files["kernel.so"] == m2.kernel.files["kernel.so"]
    assert reference.rel_error(m1(X), reference.spmm(A, X)) < 1e-5


# -- float64 workloads ----------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 33])
@pytest.mark.parametrize("reduce", ["sum", "max", "min", "mean"])
def test_spmm_float64(K, reduce):
    """X, the values and the accumulators in float64: the float64 reference at 1e-12 on a
    non-square matrix (empty rows, a full row, explicit zeros), on a wide one whose full row holds
    3000 entries, and with the passes' permutations folded in (parallel, slice by slice)."""
    for A in (make_matrix64(), make_matrix64(40, 3000, seed=1)):
        mod = SparseModule.from_op(SparseOp("spmm", reduce, A, K, "float64"))
        check_spmm(mod, SPMM.default_params(mod), A, K, reduce)
    A = make_matrix64(seed=2)
    pmod = permuted(A, K, "spmm", reduce, seed=3, dtype="float64")
    params = {**SPMM.default_params(pmod), "parallel": True, "tasks_per_thread": 8, "tile_order": "task"}
    check_spmm(pmod, params, A, K, reduce)


@pytest.mark.parametrize("K", [1, 33])
def test_sddmm_float64(K):
    for A in (make_matrix64(seed=4), make_matrix64(40, 3000, seed=5)):
        mod = SparseModule.from_op(SparseOp("sddmm", None, A, K, "float64"))
        check_sddmm(mod, SDDMM.default_params(mod), A, K)
    A = make_matrix64(seed=6)
    pmod = permuted(A, K, "sddmm", None, seed=7, dtype="float64")
    check_sddmm(pmod, {**SDDMM.default_params(pmod), "parallel": True, "tasks_per_thread": 8}, A, K)


def test_float64_code_differs_from_float32():
    """The dtype is compiled into the code: a float64 kernel has a symbol (and library) of its own."""
    A = make_matrix()
    k32, k64 = (SPMM.build(m, SPMM.default_params(m)) for m in
                (SparseModule.from_op(SparseOp("spmm", "sum", A, 8, d)) for d in ("float32", "float64")))
    assert k32.meta["entry"] != k64.meta["entry"] and k32.files["kernel.so"] != k64.files["kernel.so"]


F64_BUILDS = [("spmm", "mean", "cpu.csr_spmm"), ("spmm", "max", "cpu.csr_spmm"), ("sddmm", None, "cpu.csr_sddmm"),
              ("spmm", "sum", "extern.scipy"), ("spmm", "mean", "extern.scipy"), ("spmm", "sum", None)]


@pytest.mark.parametrize("op,reduce,template", F64_BUILDS)
def test_float64_build_call_save_load(op, reduce, template, tmp_path, no_tuning_db):
    """build(dtype="float64") end to end (template None: quick selection among the float64
    candidates): float64 results at 1e-12, precision fp64, out= float64, float32 inputs and
    outputs refused, and the artifact's round trip (the matrix compared in float64)."""
    A = make_matrix64(seed=12)
    S = A.to_scipy()
    mod = spcompile.build(S, op, K=5, reduce=reduce, target="cpu", dtype="float64", template=template)
    assert mod.config.precision == "fp64" and mod.key.dtype == "float64"
    rng = np.random.default_rng(0)
    shapes = [(A.shape[1], 5)] if op == "spmm" else [(A.shape[0], 5), (A.shape[1], 5)]
    ins = [rng.standard_normal(s) for s in shapes]
    out = mod(*ins)
    assert out.dtype == np.float64
    assert reference.rel_error(out, reference.run(op, reduce, A, *ins)) < 1e-12
    buf = np.full(out.shape, np.nan)
    assert mod(*ins, out=buf) is buf and np.array_equal(buf, out)
    with pytest.raises(TypeError, match="dtype float32, expected float64"):
        mod(*[x.astype(np.float32) for x in ins])
    with pytest.raises(ValueError, match="out must be a C-contiguous, writable float64"):
        mod(*ins, out=np.empty(out.shape, np.float32))
    loaded = spcompile.load(mod.save(str(tmp_path / "m.spc")), S)
    assert loaded.key == mod.key and loaded.matrix.data.dtype == np.float64
    assert loaded.kernel.arrays["data"].dtype == np.float64
    np.testing.assert_array_equal(loaded(*ins), out)
    with pytest.raises(spcompile.ArtifactError, match="values differ"):
        spcompile.load(str(tmp_path / "m.spc"), S.astype(np.float32))   # the rounded matrix is another one


def test_float64_call_values_are_not_rounded():
    torch = pytest.importorskip("torch")
    A = make_matrix64(seed=13)
    mod = spcompile.build(A.to_scipy(), "spmm", K=4, target="cpu", dtype="float64", template="cpu.csr_spmm",
                          pipeline=["reorder.degree"])
    X = np.random.default_rng(1).standard_normal((A.shape[1], 4))
    v = np.random.default_rng(2).standard_normal(A.nnz)
    Av = as_csr((A.indptr, A.indices, v, A.shape), np.float64)
    for vals in (v, torch.from_numpy(v)):
        assert reference.rel_error(mod(X, values=vals), reference.spmm(Av, X)) < 1e-12
    v32 = v.astype(np.float32)       # float32 values are widened exactly
    A32 = as_csr((A.indptr, A.indices, v32.astype(np.float64), A.shape), np.float64)
    assert reference.rel_error(mod(X, values=v32), reference.spmm(A32, X)) < 1e-12
    assert reference.rel_error(mod(X), reference.spmm(A, X)) < 1e-12     # the built values again


def test_host_cpu_name_without_llvm(monkeypatch):
    """A TVM installed without LLVM (the runtime that runs saved CUDA modules) has no
    llvm_get_system_cpu: the CPU's name is then unknown (None; the database's CPU target key falls
    back to the platform's name) instead of an AttributeError out of build()."""
    from tvm.target import codegen

    from spcompile.autotune import database
    from spcompile.runtime import cpu as rt

    assert rt.host_cpu_name()                              # this machine's TVM has LLVM
    monkeypatch.delattr(codegen, "llvm_get_system_cpu")
    assert rt.host_cpu_name() is None
    # the CPU target key is cached per process: computed here without the cache, and the cache
    # left as it was (a key of the fallback name would name other studies than every other process's)
    assert database._cpu_target.__wrapped__()["device"]
