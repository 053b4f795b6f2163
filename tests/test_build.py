"""End to end: build() + call against the float64 scipy reference, for every op/reduce, awkward
matrices (empty rows, one very long row, non-square, no entries at all), K in {1, 3, 64, 100},
pass pipelines, and the shared Cora / Pubmed graphs."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.core import numerics, reference  # noqa: F401
from spcompile.core.formats import as_csr

from conftest import check_result, empty_row_ids, inputs_for, random_matrix

pytestmark = pytest.mark.usefixtures("no_tuning_db")

OP_REDUCE = [("spmm", "sum"), ("spmm", "mean"), ("spmm", "max"), ("spmm", "min"), ("sddmm", None)]
KS = [1, 3, 64, 100]


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("op,reduce", OP_REDUCE)
def test_random_nonsquare_matches_reference(module_cache, rect_matrix, op, reduce, K):
    A = rect_matrix
    assert A.shape == (120, 90)
    mod = module_cache.get("rect", A, op, K, reduce)
    assert (mod.op, mod.reduce, mod.K, mod.shape) == (op, reduce, K, A.shape)
    inputs = inputs_for(op, A.shape, K, seed=K)
    out = mod(*inputs)
    check_result(out, A, op, reduce, inputs)
    if op == "spmm":
        empty = empty_row_ids(A)
        assert empty.size >= 3 and 0 in empty and A.shape[0] - 1 in empty
        # the documented convention: an empty row gives exactly 0 for every reduction
        assert np.all(out[empty] == 0.0)
        long = int(np.argmax(np.diff(A.indptr)))
        assert np.diff(A.indptr)[long] == A.shape[1]
    else:
        assert out.shape == (A.nnz,)


def _dense_semantics(A, X, reduce):
    """The IR's documented semantics by brute force, independent of reference.py."""
    A = sp.csr_matrix(A)
    m, K = A.shape[0], X.shape[1]
    Y = np.zeros((m, K))
    for i in range(m):
        lo, hi = A.indptr[i], A.indptr[i + 1]
        if hi == lo:
            continue
        prods = np.array([A.data[p] * X[A.indices[p]].astype(np.float64) for p in range(lo, hi)])
        Y[i] = {"sum": prods.sum(0), "mean": prods.mean(0), "max": prods.max(0), "min": prods.min(0)}[reduce]
    return Y


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min"])
def test_explicit_zeros_are_neighbours_and_reference_semantics(module_cache, reduce):
    # row 0: a stored zero among positive products -> counts for mean and wins max/min sometimes
    indptr = np.array([0, 3, 3, 5])
    indices = np.array([0, 1, 2, 0, 2])
    data = np.array([2.0, 0.0, 1.0, -1.0, 3.0], np.float32)
    A = (indptr, indices, data, (3, 3))
    X = np.array([[1.0, -2.0], [5.0, 5.0], [3.0, -4.0]], np.float32)
    S = sp.csr_matrix((data, indices, indptr), shape=(3, 3))
    assert S.nnz == 5  # the explicit zero is stored
    want = _dense_semantics(S, X, reduce)
    np.testing.assert_allclose(reference.spmm(as_csr(A), X, reduce), want, rtol=1e-12)
    mod = module_cache.get("zeros", A, "spmm", 2, reduce)
    out = mod(X)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    if reduce == "mean":
        assert out[0, 0] == pytest.approx((2.0 + 0.0 + 3.0) / 3)  # divided by 3 stored entries, not 2
    if reduce == "max":
        assert out[0, 1] == 0.0  # max(-4, 0, -4): the stored zero's product


def test_sddmm_reference_semantics(module_cache):
    A = random_matrix(30, 20, density=0.2, seed=3)
    X, Y = inputs_for("sddmm", A.shape, 5, seed=4)
    C = as_csr(A)
    rows = np.repeat(np.arange(30), np.diff(C.indptr))
    want = np.array([float(C.data[p]) * float(np.dot(X[rows[p]].astype(np.float64), Y[C.indices[p]]))
                     for p in range(C.nnz)])
    np.testing.assert_allclose(reference.sddmm(C, X, Y), want, rtol=1e-12)
    out = module_cache.get("sddmm-small", A, "sddmm", 5)(X, Y)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


PIPELINE_CASES = [(["reorder.rcm"], op, r) for op, r in OP_REDUCE] + [
    (["reorder.degree"], "spmm", "max"), (["reorder.degree"], "sddmm", None),
    (["reorder.rcm", "reorder.degree"], "spmm", "mean"), (["reorder.rcm", "reorder.degree"], "sddmm", None)]


@pytest.mark.parametrize("pipeline,op,reduce", PIPELINE_CASES,
                         ids=[f"{'+'.join(p)}-{o}-{r}" for p, o, r in PIPELINE_CASES])
def test_pipelines_return_callers_order(module_cache, square_matrix, pipeline, op, reduce):
    A = square_matrix
    K = 7
    mod = module_cache.get("square", A, op, K, reduce, pipeline)
    assert [p["name"] for p in mod.config.pipeline] == pipeline
    assert [r["name"] for r in mod.pass_log] == pipeline
    inputs = inputs_for(op, A.shape, K, seed=5)
    check_result(mod(*inputs), A, op, reduce, inputs)


@pytest.mark.parametrize("op,reduce", [("spmm", "sum"), ("spmm", "max"), ("sddmm", None)])
def test_pipelines_nonsquare(module_cache, rect_matrix, op, reduce):
    A = rect_matrix
    mod = module_cache.get("rect", A, op, 3, reduce, ["reorder.rcm", "reorder.degree"])
    inputs = inputs_for(op, A.shape, 3, seed=9)
    check_result(mod(*inputs), A, op, reduce, inputs)


EMPTY_CASES = [((5, 4), "spmm", "sum"), ((5, 4), "spmm", "max"), ((5, 4), "spmm", "mean"), ((5, 4), "sddmm", None),
               ((0, 3), "spmm", "sum"), ((4, 0), "sddmm", None), ((4, 0), "spmm", "min"), ((0, 0), "spmm", "max")]


@pytest.mark.parametrize("shape,op,reduce", EMPTY_CASES)
def test_matrix_without_entries(shape, op, reduce):
    A = sp.csr_matrix(shape, dtype=np.float32)
    mod = spcompile.build(A, op, K=3, reduce=reduce, target="cpu")
    inputs = inputs_for(op, shape, 3)
    out = mod(*inputs)
    if op == "spmm":
        assert out.shape == (shape[0], 3) and out.dtype == np.float32
        assert np.all(out == 0.0)
    else:
        assert out.shape == (0,)
    # a stale output buffer is overwritten, not accumulated into
    if op == "spmm" and shape[0]:
        buf = np.full((shape[0], 3), 7.0, np.float32)
        assert mod(*inputs, out=buf) is buf and np.all(buf == 0.0)


def test_out_argument_and_noncontiguous_inputs(module_cache, rect_matrix):
    A = rect_matrix
    mod = module_cache.get("rect", A, "spmm", 3, "sum")
    rng = np.random.default_rng(0)
    wide = rng.standard_normal((90, 6)).astype(np.float32)
    X = wide[:, ::2]  # strided view
    assert not X.flags.c_contiguous
    out = np.full((120, 3), np.nan, np.float32)
    res = mod(X, out=out)
    assert res is out
    check_result(out, A, "spmm", "sum", (X,))
    check_result(mod(np.asfortranarray(X)), A, "spmm", "sum", (X,))
    with pytest.raises(ValueError, match="out must be"):
        mod(X, out=np.empty((120, 3), np.float64))
    with pytest.raises(ValueError, match="out must be"):
        mod(X, out=np.empty((121, 3), np.float32))


def test_repeated_calls_and_inputs_untouched(module_cache, rect_matrix):
    A = rect_matrix
    before = (A.indptr.copy(), A.indices.copy(), A.data.copy())
    mod = module_cache.get("rect", A, "spmm", 64, "max")
    X = inputs_for("spmm", A.shape, 64)[0]
    Xc = X.copy()
    a, b = mod(X), mod(X)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(X, Xc)
    for x, y in zip(before, (A.indptr, A.indices, A.data)):
        np.testing.assert_array_equal(x, y)


def test_input_forms_give_the_same_result(rect_matrix):
    A = rect_matrix
    X = inputs_for("spmm", A.shape, 3)[0]
    ref = reference.spmm(as_csr(A), X)
    C = as_csr(A)
    for form in (A.tocoo(), A.tocsc(), sp.csr_array(A), (A.indptr.astype(np.int64), A.indices, A.data, A.shape)):
        D = as_csr(form)
        for a, b in ((C.indptr, D.indptr), (C.indices, D.indices), (C.data, D.data)):
            np.testing.assert_array_equal(a, b)
    mod = spcompile.build(A.tocoo(), "spmm", K=3, target="cpu")  # one build from a non-CSR form
    assert reference.rel_error(mod(X), ref) <= 1e-5


def test_workload_key_identity(rect_matrix):
    from spcompile.compile import make_op

    k1 = make_op(rect_matrix, "spmm", K=8).key()
    assert k1 == make_op(rect_matrix.tocoo(), "spmm", K=8).key()  # same pattern, any input form
    assert k1 != make_op(rect_matrix, "spmm", K=9).key()
    assert k1 != make_op(rect_matrix, "spmm", K=8, reduce="max").key()
    B = rect_matrix.copy().tolil()
    B[0, 0] = 1.0  # row 0 was empty: the pattern changes
    assert k1 != make_op(B.tocsr(), "spmm", K=8).key()
    assert (k1.rows, k1.cols, k1.nnz, k1.K) == (120, 90, rect_matrix.nnz, 8)
    assert k1.features["empty_rows"] > 0


def test_torch_inputs(module_cache, rect_matrix):
    torch = pytest.importorskip("torch")
    A = rect_matrix
    mod = module_cache.get("rect", A, "spmm", 3, "sum")
    X = inputs_for("spmm", A.shape, 3)[0]
    out = mod(torch.from_numpy(X))
    assert isinstance(out, torch.Tensor)
    check_result(out.numpy(), A, "spmm", "sum", (X,))
    coo = A.tocoo()
    At = torch.sparse_coo_tensor(np.vstack([coo.row, coo.col]), coo.data, A.shape)
    for T in (At, At.to_sparse_csr()):
        m2 = spcompile.build(T, "spmm", K=3, target="cpu")
        check_result(m2(X), A, "spmm", "sum", (X,))


def test_target_cuda_without_gpu_is_a_clear_error(no_cuda, rect_matrix):
    with pytest.raises(spcompile.TargetUnavailableError, match="cuda"):
        spcompile.build(rect_matrix, "spmm", K=4, target="cuda")
    assert issubclass(spcompile.TargetUnavailableError, RuntimeError)
    mod = spcompile.build(rect_matrix, "spmm", K=4, target="auto")
    assert mod.target == "cpu"


def test_explicit_template_and_params(rect_matrix):
    from spcompile.compile import make_op
    from spcompile.core.ir import SparseModule

    tpl = spcompile.get_template("cpu.csr_spmm")
    smod = SparseModule.from_op(make_op(rect_matrix, "spmm", K=10, reduce="min"))
    params = dict(tpl.default_params(smod))
    # a non-default value for every categorical parameter of the template's search space
    for name, dist in tpl.space(smod).items():
        choices = [c for c in getattr(dist, "choices", ()) if c != params.get(name)]
        if choices:
            params[name] = choices[0]
    mod = spcompile.build(rect_matrix, "spmm", K=10, reduce="min", target="cpu", template="cpu.csr_spmm",
                          params=params)
    assert mod.config.template == "cpu.csr_spmm"
    assert {k: mod.config.params[k] for k in params} == params
    X = inputs_for("spmm", rect_matrix.shape, 10)[0]
    check_result(mod(X), rect_matrix, "spmm", "min", (X,))


# -- the shared graph data set ---------------------------------------------------------------

@pytest.mark.parametrize("op,reduce", OP_REDUCE)
@pytest.mark.parametrize("graph", ["cora", "pubmed"])
def test_shared_graphs(request, module_cache, graph, op, reduce):
    A = request.getfixturevalue(graph)
    expected_rows = {"cora": 2708, "pubmed": 19717}[graph]
    assert A.shape == (expected_rows, expected_rows)
    K = 32
    mod = module_cache.get(graph, A, op, K, reduce)
    inputs = inputs_for(op, A.shape, K, seed=2)
    check_result(mod(*inputs), A, op, reduce, inputs)


def test_cora_with_reordering(module_cache, cora):
    mod = module_cache.get("cora", cora, "spmm", 16, "mean", ["reorder.rcm"])
    X = inputs_for("spmm", cora.shape, 16)[0]
    check_result(mod(X), cora, "spmm", "mean", (X,))
    m = mod.pass_log[0]["metrics"]
    assert m["bandwidth_after"] < m["bandwidth_before"]  # RCM does narrow Cora's band


def test_unknown_parameter_error_lists_the_template_parameters():
    A = sp.random(30, 30, density=0.1, format="csr", random_state=0, dtype=np.float32)
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['rows_per_task'\].*parameters are \[.*'k_tile'"):
        spcompile.build(A, "spmm", K=8, target="cpu", template="cpu.csr_spmm", params={"rows_per_task": 64})


def test_cli_version_and_template_availability(capsys, no_cuda):
    from spcompile.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"spcompile {spcompile.__version__}"
    assert main(["templates"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if "target=" in ln}
    assert "run=no" in lines["csr.crc_cwm"] and "run=yes" in lines["cpu.csr_spmm"]   # no GPU: CUDA can't run
    assert "no usable CUDA GPU" in out


@pytest.mark.parametrize("block", [1, 7, 50, 1 << 24])
def test_sddmm_reference_in_row_blocks_equals_the_direct_formula(block):
    """The float64 SDDMM reference walks blocks of whole rows (bounded memory on large graphs);
    every block size gives exactly the one-shot formula, empty rows and an empty matrix included."""
    A = as_csr(random_matrix(300, 200, density=0.05, seed=3))
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((300, 7)), rng.standard_normal((200, 7))
    direct = A.data.astype(np.float64) * np.einsum("ij,ij->i", X[A.row_ids], Y[A.indices])
    assert np.array_equal(reference.sddmm(A, X, Y, block=block), direct)
    E = as_csr(sp.csr_matrix((4, 3), dtype=np.float32))
    assert reference.sddmm(E, np.ones((4, 2)), np.ones((3, 2)), block=block).shape == (0,)


@pytest.mark.parametrize("make, args, message", [
    (lambda d: (d / "bad.mtx").write_text("%%MatrixMarket matrix coordinate real general\n3 3 1\n5 5 1.0\n"),
     ["bad.mtx", "-K", "8"], "cannot read 'bad.mtx' as a Matrix Market file"),
    (lambda d: None, ["missing.mtx", "-K", "8"], "cannot read 'missing.mtx' as a Matrix Market file"),
    (lambda d: (d / "junk.npz").write_bytes(b"junk"), ["junk.npz", "-K", "8"], "cannot read 'junk.npz'"),
    (lambda d: sp.save_npz(d / "g.npz", random_matrix(20, 20, density=0.1, seed=1)),
     ["g.npz", "-K", "8", "--params", "{bad"], "--params is not valid JSON"),
    (lambda d: sp.save_npz(d / "g.npz", random_matrix(20, 20, density=0.1, seed=1)),
     ["g.npz", "-K", "8", "--params", "[1]"], "--params must be a JSON object"),
])
def test_cli_build_input_mistakes_are_one_line_errors(tmp_path, monkeypatch, capsys, make, args, message):
    from spcompile.cli import main

    monkeypatch.chdir(tmp_path)
    make(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["build", *args, "-o", str(tmp_path / "x.spc"), "--target", "cpu"])
    assert e.value.code not in (0, None)
    text = str(e.value.code) + capsys.readouterr().err
    assert message in text and "Traceback" not in text and len(text.strip().splitlines()) == 1
    assert not (tmp_path / "x.spc").exists()
