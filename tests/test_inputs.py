"""Input handling: every accepted sparse input form canonicalises to the same CSR; every bad input
(matrix, K, op/reduce/target/dtype, X/Y) raises a TypeError/ValueError that says what was wrong."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spcompile
from spcompile.core.formats import CSR, INT32_MAX, as_csr, index_dtype_for, permute_csr
from spcompile.core.ir import SparseModule, SparseOp

from conftest import random_matrix

pytestmark = pytest.mark.usefixtures("no_tuning_db")

IP = np.array([0, 1, 3])
IX = np.array([0, 1, 2])
DATA = np.array([1.0, 2.0, 3.0])


def dense(C: CSR) -> np.ndarray:
    return C.to_scipy().toarray()


def assert_canonical(C: CSR):
    assert C.indptr.dtype == C.indices.dtype
    assert C.indptr[0] == 0 and C.indptr[-1] == C.nnz and np.all(np.diff(C.indptr) >= 0)
    for i in range(C.shape[0]):
        row = C.indices[C.indptr[i]:C.indptr[i + 1]]
        assert np.all(np.diff(row) > 0), f"row {i} not strictly sorted: {row}"
    assert not C.indptr.flags.writeable and not C.indices.flags.writeable and not C.data.flags.writeable


# -- accepted forms ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "bsr", "lil", "dok", "dia"])
@pytest.mark.parametrize("kind", ["matrix", "array"])
def test_every_scipy_format(fmt, kind):
    A = random_matrix(20, 13, density=0.2, seed=2)
    S = (sp.csr_matrix(A) if kind == "matrix" else sp.csr_array(A)).asformat(fmt)
    C = as_csr(S)
    assert_canonical(C)
    assert C.shape == (20, 13) and C.data.dtype == np.float32 and C.indices.dtype == np.int32
    np.testing.assert_array_equal(dense(C), A.toarray())


def test_raw_arrays_and_csr_passthrough():
    C = as_csr((IP, IX, DATA, (2, 3)))
    np.testing.assert_array_equal(dense(C), [[1, 0, 0], [0, 2, 3]])
    assert as_csr(C) is C  # already canonical with the right dtype: no copy
    C64 = as_csr(C, np.float64)
    assert C64.data.dtype == np.float64 and C64.indices is C.indices


def test_duplicates_summed_indices_sorted_explicit_zeros_kept():
    indptr = np.array([0, 4, 4, 6])
    indices = np.array([3, 1, 3, 0, 2, 2])
    data = np.array([1.0, 2.0, 4.0, 0.0, 5.0, -5.0])
    C = as_csr((indptr, indices, data, (3, 4)))
    assert_canonical(C)
    np.testing.assert_array_equal(C.indptr, [0, 3, 3, 4])
    np.testing.assert_array_equal(C.indices, [0, 1, 3, 2])
    np.testing.assert_array_equal(C.data, [0.0, 2.0, 5.0, 0.0])  # stored 0 and 5 + -5 stay entries
    # the same through scipy's own unsorted, duplicated CSR
    S = sp.csr_matrix((data, indices, indptr), shape=(3, 4))
    assert not S.has_canonical_format
    C2 = as_csr(S)
    np.testing.assert_array_equal(C2.indices, C.indices)
    np.testing.assert_array_equal(C2.data, C.data)
    # and through COO with repeated coordinates
    coo = sp.coo_matrix(([1.0, 1.0, 1.0], ([0, 0, 1], [2, 2, 0])), shape=(2, 3))
    C3 = as_csr(coo)
    assert C3.nnz == 2 and list(C3.data) == [2.0, 1.0]


def test_caller_arrays_are_not_modified():
    indptr = np.array([0, 2, 3])
    indices = np.array([2, 0, 1])
    data = np.array([1.0, 2.0, 3.0])
    copies = [a.copy() for a in (indptr, indices, data)]
    S = sp.csr_matrix((data, indices, indptr), shape=(2, 3))
    as_csr(S)
    as_csr((indptr, indices, data, (2, 3)))
    csc = sp.csc_matrix(S)
    csc_arrays = [a.copy() for a in (csc.indptr, csc.indices, csc.data)]
    as_csr(csc)
    for a, b in zip(copies, (indptr, indices, data)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(csc_arrays, (csc.indptr, csc.indices, csc.data)):
        np.testing.assert_array_equal(a, b)
    # float32 values and int32 indices (nothing to cast: the arrays reach scipy as they are), column
    # indices unsorted inside the rows: the caller's matrix must keep its own order and values
    rng = np.random.default_rng(0)
    P = sp.random(50, 50, density=0.2, random_state=1, format="csr", dtype=np.float32)
    P = P[:, rng.permutation(50)]
    P.has_sorted_indices = False
    assert not np.all(np.diff(P.indices[P.indptr[0]:P.indptr[1]]) > 0) or P.indptr[1] < 2
    before = [P.indptr.copy(), P.indices.copy(), P.data.copy(), P.toarray()]
    for inp in (P, (P.indptr, P.indices, P.data, P.shape)):
        C = as_csr(inp)
        np.testing.assert_array_equal(C.to_scipy().toarray(), before[3])
        for a, b in zip(before[:3], (P.indptr, P.indices, P.data)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(P.toarray(), before[3])


def test_empty_matrices_and_rows_are_valid():
    for shape in [(0, 0), (0, 5), (5, 0), (3, 4)]:
        C = as_csr(sp.csr_matrix(shape))
        assert C.shape == shape and C.nnz == 0 and C.indptr.shape == (shape[0] + 1,)
    C = as_csr((np.array([0, 0, 2, 2]), np.array([0, 1]), np.ones(2), (3, 2)))
    np.testing.assert_array_equal(C.row_lengths, [0, 2, 0])


@pytest.mark.parametrize("value_dtype", [np.float16, np.float64, np.int64, np.uint8, np.bool_])
def test_value_dtypes_cast_to_float32(value_dtype):
    C = as_csr((IP, IX, np.array([1, 0, 1]).astype(value_dtype), (2, 3)))
    assert C.data.dtype == np.float32
    np.testing.assert_array_equal(C.data, [1, 0, 1])


# -- index dtypes ------------------------------------------------------------------------------

def test_index_dtype_for_boundaries():
    assert index_dtype_for(0, (0, 0)) == np.int32
    assert index_dtype_for(INT32_MAX, (10, 10)) == np.int32
    assert index_dtype_for(INT32_MAX + 1, (10, 10)) == np.int64  # nnz does not fit an indptr entry
    assert index_dtype_for(10, (INT32_MAX, 5)) == np.int32
    assert index_dtype_for(10, (INT32_MAX + 1, 5)) == np.int64
    assert index_dtype_for(10, (5, INT32_MAX + 1)) == np.int64
    assert index_dtype_for(2 ** 40, (2 ** 35, 2 ** 35)) == np.int64


@pytest.mark.parametrize("idx_dtype", [np.int64, np.uint64, np.int16, np.uint32])
def test_small_wide_index_arrays_become_int32(idx_dtype):
    C = as_csr((IP.astype(idx_dtype), IX.astype(idx_dtype), DATA, (2, 3)))
    assert C.indptr.dtype == np.int32 and C.indices.dtype == np.int32
    np.testing.assert_array_equal(dense(C), [[1, 0, 0], [0, 2, 3]])
    S = sp.csr_matrix((DATA, IX, IP), shape=(2, 3))
    S.indices, S.indptr = IX.astype(np.int64), IP.astype(np.int64)  # scipy itself would downcast
    assert S.indices.dtype == np.int64
    assert as_csr(S).indices.dtype == np.int32


def test_large_shape_with_few_entries_uses_int64():
    # a (2^31 + 5) x 3 matrix cannot be held as CSR here (its indptr alone is 16 GiB), but its
    # transpose can: 3 rows, 2^31 + 5 columns -> column ids beyond int32
    n = INT32_MAX + 6
    C = as_csr((np.array([0, 1, 1, 2]), np.array([0, n - 1], np.int64), np.ones(2), (3, n)))
    assert C.indices.dtype == np.int64 and C.indptr.dtype == np.int64
    assert int(C.indices[-1]) == n - 1


# -- hypothesis: canonicalisation is exactly scipy's dense matrix, whatever the input form ----

@st.composite
def coo_inputs(draw):
    m = draw(st.integers(0, 12))
    n = draw(st.integers(0, 12))
    k = draw(st.integers(0, 30)) if m and n else 0
    rows = draw(st.lists(st.integers(0, m - 1), min_size=k, max_size=k)) if k else []
    cols = draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k)) if k else []
    vals = draw(st.lists(st.integers(-3, 3), min_size=k, max_size=k)) if k else []
    return m, n, np.array(rows, int), np.array(cols, int), np.array(vals, float)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(coo_inputs(), st.sampled_from(["coo", "csr", "csc", "tuple"]))
def test_canonical_form_property(inp, form):
    m, n, rows, cols, vals = inp
    coo = sp.coo_matrix((vals, (rows, cols)), shape=(m, n))
    want = coo.toarray()
    if form == "tuple":
        # unsorted, duplicated raw CSR arrays
        order = np.argsort(rows, kind="stable")
        indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=m))]) if m else np.zeros(1, int)
        src = (indptr, cols[order], vals[order], (m, n))
    else:
        src = coo.asformat(form) if form != "coo" else coo
    C = as_csr(src)
    assert_canonical(C)
    np.testing.assert_array_equal(dense(C), want)
    # every distinct coordinate is one stored entry (zeros from cancelling duplicates included)
    assert C.nnz == len(set(zip(rows.tolist(), cols.tolist())))


# -- bad matrices ------------------------------------------------------------------------------

BAD_MATRICES = [
    ("3-D shape", (IP, IX, DATA, (2, 3, 1)), ValueError, "2-D"),
    ("1-D shape", (IP, IX, DATA, (2,)), ValueError, "2-D"),
    ("negative shape", (np.array([0]), np.zeros(0, int), np.zeros(0), (0, -1)), ValueError, "non-negative"),
    ("shape not ints", (IP, IX, DATA, "ab"), TypeError, "shape"),
    ("shape floats", (IP, IX, DATA, (2.0, 3)), TypeError, "shape"),
    ("shape None", (IP, IX, DATA, None), TypeError, "shape"),
    ("negative index", (IP, np.array([0, -1, 2]), DATA, (2, 3)), ValueError, "negative"),
    ("index out of range", (IP, np.array([0, 1, 3]), DATA, (2, 3)), ValueError, "out of range"),
    ("indptr not monotone", (np.array([0, 3, 1, 3]), IX, DATA, (3, 3)), ValueError, "monotone"),
    ("indptr not from 0", (np.array([1, 2, 3]), IX, DATA, (2, 3)), ValueError, "start at 0"),
    ("indptr wrong length", (np.array([0, 3]), IX, DATA, (2, 3)), ValueError, "rows\\+1"),
    ("indptr end != nnz", (np.array([0, 1, 2]), IX, DATA, (2, 3)), ValueError, "indptr\\[-1\\]"),
    ("data shorter", (IP, IX, DATA[:2], (2, 3)), ValueError, "data"),
    ("2-D indptr", (IP[None], IX, DATA, (2, 3)), ValueError, "1-D"),
    ("float indices", (IP, IX.astype(float), DATA, (2, 3)), TypeError, "integers"),
    ("string values", (IP, IX, np.array(["a", "b", "c"]), (2, 3)), TypeError, "numeric"),
    ("complex values", (IP, IX, DATA + 1j, (2, 3)), TypeError, "complex"),
    ("dense numpy", np.eye(3), TypeError, "dense"),
    ("list", [[1, 0], [0, 1]], TypeError, "unsupported"),
    ("3-tuple", (IP, IX, DATA), TypeError, "unsupported"),
    ("1-D sparse array", sp.coo_array(np.array([1.0, 0.0, 2.0])), ValueError, "2-D"),
]


@pytest.mark.parametrize("A,exc,match", [c[1:] for c in BAD_MATRICES], ids=[c[0] for c in BAD_MATRICES])
def test_bad_matrix(A, exc, match):
    with pytest.raises(exc, match=match):
        as_csr(A)
    with pytest.raises(exc, match=match):  # build() reports the same, before any compiling
        spcompile.build(A, "spmm", K=2, target="cpu")


def _csc():
    return sp.csc_matrix((np.ones(3), np.array([0, 1, 1]), np.array([0, 1, 3])), shape=(2, 2))


def _coo():
    return sp.coo_matrix((np.ones(3), (np.array([0, 1, 1]), np.array([0, 0, 1]))), shape=(2, 2))


def _corrupt(make, attr, pos, value):
    def f():
        M = make()
        getattr(M, attr)[pos] = value  # scipy does not re-check arrays mutated after construction
        return M
    return f


CORRUPT = [
    # without validation scipy's conversions silently drop these entries or crash the process
    ("csc row index too large", _corrupt(_csc, "indices", 1, 7), "invalid csc"),
    ("csc negative row index", _corrupt(_csc, "indices", 1, -3), "invalid csc"),
    ("csc indptr not monotone", _corrupt(_csc, "indptr", 1, 5), "invalid csc"),
    ("coo row too large", _corrupt(_coo, "row", 1, 50), "row index 50 out of range"),
    ("coo negative row", _corrupt(_coo, "row", 1, -5), "negative row index"),
    ("coo column too large", _corrupt(_coo, "col", 2, 9), "column index 9 out of range"),
    ("bsr block column too large", lambda: _corrupt(lambda: sp.bsr_matrix(np.eye(4), blocksize=(2, 2)),
                                                    "indices", 0, 9)(), "invalid bsr"),
    ("csr index too large", _corrupt(lambda: sp.csr_matrix(np.eye(3)), "indices", 0, 3), "out of range"),
    ("csr indptr not monotone", _corrupt(lambda: sp.csr_matrix(np.eye(3)), "indptr", 1, 3), "monotone"),
]


@pytest.mark.parametrize("make,match", [c[1:] for c in CORRUPT], ids=[c[0] for c in CORRUPT])
def test_corrupted_scipy_matrices(make, match):
    M = make()
    with pytest.raises(ValueError, match=match):
        as_csr(M)


# -- bad op / reduce / K / target / dtype -------------------------------------------------------

A_SMALL = sp.csr_matrix(np.array([[1.0, 0, 2], [0, 0, 3]], np.float32))

BAD_ARGS = [
    ("K=0", dict(op="spmm", K=0), ValueError, "K must be >= 1"),
    ("K<0", dict(op="spmm", K=-4), ValueError, "K must be >= 1"),
    ("K float", dict(op="spmm", K=2.0), TypeError, "K must be an int"),
    ("K bool", dict(op="spmm", K=True), TypeError, "K must be an int"),
    ("K str", dict(op="spmm", K="8"), TypeError, "K must be an int"),
    ("K missing", dict(op="spmm"), TypeError, "K .*required"),
    ("unknown op", dict(op="gemm", K=2), ValueError, "unknown op 'gemm'"),
    ("op not str", dict(op=3, K=2), ValueError, "unknown op"),
    ("unknown reduce", dict(op="spmm", K=2, reduce="prod"), ValueError, "unknown reduce 'prod'"),
    ("sddmm with max", dict(op="sddmm", K=2, reduce="max"), ValueError, "sddmm.*takes no reduce"),
    ("sddmm with mean", dict(op="sddmm", K=2, reduce="mean"), ValueError, "sddmm.*takes no reduce"),
    ("unknown target", dict(op="spmm", K=2, target="tpu"), ValueError, "unknown target 'tpu'"),
    ("target not str", dict(op="spmm", K=2, target=None), ValueError, "unknown target"),
    ("unsupported dtype", dict(op="spmm", K=2, dtype="float16"), ValueError, "unsupported dtype"),
    ("unknown template", dict(op="spmm", K=2, target="cpu", template="nope"), ValueError, "unknown template"),
    ("template for another op", dict(op="spmm", K=2, target="cpu", template="cpu.csr_sddmm"), ValueError,
     "does not support"),
    ("unknown param", dict(op="spmm", K=2, target="cpu", params={"foo": 1}), ValueError, "unknown parameter"),
    ("unknown pass", dict(op="spmm", K=2, target="cpu", pipeline=["no.such.pass"]), ValueError, "unknown pass"),
    ("unknown pass option", dict(op="spmm", K=2, target="cpu", pipeline=[("reorder.degree", {"x": 1})]),
     TypeError, "unknown option"),
]


@pytest.mark.parametrize("kw,exc,match", [c[1:] for c in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_bad_build_arguments(kw, exc, match):
    kw = {"target": "cpu", **kw}
    with pytest.raises(exc, match=match):
        spcompile.build(A_SMALL, **kw)


def test_sddmm_reduce_sum_or_none_is_accepted():
    for r in (None, "sum"):
        op = SparseOp("sddmm", r, as_csr(A_SMALL), 4)
        assert op.reduce is None and op.output_shape == (3,)
    assert SparseOp("spmm", None, as_csr(A_SMALL), 4).reduce == "sum"


def test_sparse_op_needs_canonical_csr():
    with pytest.raises(TypeError, match="canonical CSR"):
        SparseOp("spmm", "sum", A_SMALL, 4)


def test_target_cuda_unavailable(no_cuda):
    from spcompile.runtime import resolve_target

    with pytest.raises(spcompile.TargetUnavailableError, match="no usable CUDA GPU"):
        resolve_target("cuda")
    assert resolve_target("auto") == "cpu"


# -- bad X / Y at call time -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_mods(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # module scope: no_tuning_db is not set up yet
        mp.setenv("SPCOMPILE_TUNING_DB", str(tmp_path_factory.getbasetemp() / "absent" / "none.db"))
        spmm = spcompile.build(A_SMALL, "spmm", K=4, reduce="max", target="cpu")
        sddmm = spcompile.build(A_SMALL, "sddmm", K=4, target="cpu")
    return spmm, sddmm


class _FakeDeviceArray:
    """Looks like a CuPy array (module 'cupy'): a GPU array handed to a CPU module."""

    __module__ = "cupy._core.core"

    class device:  # noqa: N801 -- cupy.ndarray.device.id
        id = 0

    def __init__(self, shape):
        self.shape = shape
        self.dtype = np.dtype(np.float32)


def test_bad_call_inputs(small_mods):
    spmm, sddmm = small_mods
    f32 = np.float32
    good = np.ones((3, 4), f32)
    assert spmm(good).shape == (2, 4)
    with pytest.raises(ValueError, match=r"shape \(3, 5\), expected \(3, 4\).*K=4"):
        spmm(np.ones((3, 5), f32))
    with pytest.raises(ValueError, match=r"shape \(2, 4\), expected \(3, 4\)"):
        spmm(np.ones((2, 4), f32))
    with pytest.raises(ValueError, match="expected"):
        spmm(np.ones(12, f32))
    with pytest.raises(ValueError, match="expected"):
        spmm(np.ones((3, 4, 1), f32))
    with pytest.raises(TypeError, match="dtype float64, expected float32"):
        spmm(np.ones((3, 4)))
    with pytest.raises(TypeError, match="dtype int32"):
        spmm(np.ones((3, 4), np.int32))
    with pytest.raises(TypeError, match="numpy array, torch tensor or cupy array"):
        spmm(good.tolist())
    with pytest.raises(TypeError, match="takes 1 input"):
        spmm(good, good)
    with pytest.raises(TypeError, match="takes 1 input"):
        spmm()
    with pytest.raises(ValueError, match="target='cpu' but got GPU arrays"):
        spmm(_FakeDeviceArray((3, 4)))
    X, Y = np.ones((2, 4), f32), np.ones((3, 4), f32)
    np.testing.assert_allclose(sddmm(X, Y), 4.0 * A_SMALL.data)
    with pytest.raises(TypeError, match="takes 2 input"):
        sddmm(X)
    with pytest.raises(ValueError, match=r"Y has shape \(2, 4\), expected \(3, 4\)"):
        sddmm(X, X)
    with pytest.raises(TypeError, match="Y has dtype float64"):
        sddmm(X, Y.astype(np.float64))


def test_torch_inputs_and_bad_torch_inputs(small_mods):
    torch = pytest.importorskip("torch")
    spmm, _ = small_mods
    with pytest.raises(TypeError, match="dtype float64"):
        spmm(torch.ones((3, 4), dtype=torch.float64))
    with pytest.raises(TypeError, match="mix array types"):
        small_mods[1](torch.ones((2, 4)), np.ones((3, 4), np.float32))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="GPU arrays"):
            spmm(torch.ones((3, 4), device="cuda"))
    # torch sparse inputs
    dense = torch.tensor([[1.0, 0, 2], [0, 0, 3]])
    for T in (dense.to_sparse(), dense.to_sparse_csr()):
        np.testing.assert_array_equal(dense.numpy(), as_csr(T).to_scipy().toarray())
    with pytest.raises(TypeError, match="dense torch tensor"):
        as_csr(dense)
    with pytest.raises(ValueError, match="2-D"):
        as_csr(torch.ones((2, 2, 2)).to_sparse())
    big = torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.ones(2), (2, 2))
    assert as_csr(big).nnz == 2


# -- permutations --------------------------------------------------------------------------------

def test_permute_csr_matches_fancy_indexing():
    A = random_matrix(25, 17, density=0.2, seed=5)
    C = as_csr(A)
    rng = np.random.default_rng(0)
    rp, cp = rng.permutation(25), rng.permutation(17)
    for r, c in [(rp, None), (None, cp), (rp, cp), (None, None)]:
        P, src = permute_csr(C, r, c)
        assert_canonical(P)
        want = A.toarray()
        if r is not None:
            want = want[r]
        if c is not None:
            want = want[:, c]
        np.testing.assert_array_equal(dense(P), want)
        np.testing.assert_array_equal(P.data, C.data[src])  # src maps entries back


def test_sparse_module_permute_validates():
    mod = SparseModule.from_op(SparseOp("spmm", "sum", as_csr(random_matrix(6, 4, seed=1)), 2))
    with pytest.raises(ValueError, match="row_perm must be a permutation of range\\(6\\)"):
        mod.permute(np.array([0, 1, 2, 3, 4, 4]))
    with pytest.raises(ValueError, match="col_perm"):
        mod.permute(None, np.arange(5))
    assert mod.permute() is mod
