"""spcompile.nn: the differentiable ops (float64 gradcheck at its defaults, float32 gradients
against float64 references), call-time values, the PyG-style layers against their definitions,
torch.compile(fullgraph=True)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import scipy.sparse as sp

# torch is a test dependency (the [test] extra, .ci/run): in CI a missing torch fails, never skips
torch = __import__("torch") if os.environ.get("CI") else pytest.importorskip("torch")

import spcompile  # noqa: E402
from spcompile import nn as snn  # noqa: E402
from spcompile.core.formats import as_csr  # noqa: E402
from spcompile.nn import ops  # noqa: E402

from conftest import random_matrix  # noqa: E402

K = 4
pytestmark = pytest.mark.filterwarnings("ignore:Input #.* requires gradient and is not a double")


@pytest.fixture(scope="module")
def A():
    return random_matrix(13, 11, density=0.3, seed=11)     # empty rows and one full row


@pytest.fixture(scope="module")
def graph(A):
    return snn.SparseGraph(A)


def _dense(A, v):
    """Dense float64 A with stored entries v (a differentiable function of v)."""
    C = as_csr(A)
    rows = torch.from_numpy(C.row_ids.astype(np.int64))
    cols = torch.from_numpy(C.indices.astype(np.int64))
    return torch.zeros(C.shape, dtype=torch.float64).index_put((rows, cols), v)


def _ref_spmm(A, X, v, reduce):
    """float64 reference of the SpMM reductions (empty rows 0)."""
    C = as_csr(A)
    if reduce in ("sum", "mean"):
        Y = _dense(A, v) @ X
        if reduce == "mean":
            Y = Y / torch.from_numpy(np.maximum(np.diff(C.indptr), 1).astype(np.float64))[:, None]
        return Y
    mask = _dense(A, torch.ones_like(v)) > 0
    P = _dense(A, v)[:, :, None] * X[None, :, :]
    fill = float("-inf") if reduce == "max" else float("inf")
    P = torch.where(mask[:, :, None], P, torch.full_like(P, fill))
    Y = P.max(dim=1).values if reduce == "max" else P.min(dim=1).values
    return torch.where(mask.any(1)[:, None], Y, torch.zeros_like(Y))


def _inputs(A, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(A.shape[1], K, generator=g, dtype=dtype)
    v = torch.randn(as_csr(A).nnz, generator=g, dtype=dtype)
    return X, v


def _smallest_gap(A, X, v) -> float:
    """The smallest difference between two products ``v[e] * X[col e, k]`` of one row and one
    column k: a max / min gradcheck needs it far above its step (no winner changes)."""
    C = as_csr(A)
    rows = C.row_ids.astype(np.int64)
    P = v.detach().double().numpy()[:, None] * X.detach().double().numpy()[C.indices]
    gaps = [np.inf]
    for k in range(P.shape[1]):
        order = np.lexsort((P[:, k], rows))
        same_row = rows[order][1:] == rows[order][:-1]
        gaps.extend(np.diff(P[order, k])[same_row])
    return float(np.min(gaps))


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min"])
def test_spmm_grads_match_float64_reference(A, graph, reduce):
    X, v = _inputs(A, 1)
    X.requires_grad_(True)
    v.requires_grad_(True)
    Y = snn.spmm(graph, X, values=v, reduce=reduce)
    Xd, vd = X.detach().double().requires_grad_(True), v.detach().double().requires_grad_(True)
    Yd = _ref_spmm(A, Xd, vd, reduce)
    assert torch.allclose(Y.double(), Yd, atol=1e-5, rtol=1e-5)
    G = torch.randn(Y.shape, generator=torch.Generator().manual_seed(2))
    Y.backward(G)
    Yd.backward(G.double())
    assert torch.allclose(X.grad.double(), Xd.grad, atol=1e-5, rtol=1e-5)
    assert torch.allclose(v.grad.double(), vd.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min"])
def test_spmm_gradcheck_float64(A, graph, reduce):
    # float64 CPU inputs are computed in float64 end to end (kernels, values, backward):
    # gradcheck at its float64 defaults (eps 1e-6, atol 1e-5, rtol 1e-3), in X and the values,
    # and in X with the graph's own values
    X, v = _inputs(A, 3, torch.float64)
    if reduce in ("max", "min"):
        assert _smallest_gap(A, X, v) > 1e-3     # no ties: the 1e-6 steps never change a winner
    X.requires_grad_(True)
    v.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda X, v: snn.spmm(graph, X, values=v, reduce=reduce), (X, v))
    assert torch.autograd.gradcheck(lambda X: snn.spmm(graph, X, reduce=reduce), (X,))
    Y = snn.spmm(graph, X, values=v, reduce=reduce)
    assert Y.dtype == torch.float64
    ref = _ref_spmm(A, X.detach(), v.detach(), reduce)
    assert torch.allclose(Y, ref, rtol=1e-12, atol=1e-12)


def test_sddmm_gradcheck_float64(A, graph):
    C = as_csr(A)
    g = torch.Generator().manual_seed(14)
    X = torch.randn(C.shape[0], K, generator=g, dtype=torch.float64, requires_grad=True)
    Y = torch.randn(C.shape[1], K, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(C.nnz, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda X, Y, v: snn.sddmm(graph, X, Y, values=v), (X, Y, v))
    assert torch.autograd.gradcheck(lambda X, Y: snn.sddmm(graph, X, Y), (X, Y))
    rows = torch.from_numpy(C.row_ids.astype(np.int64))
    cols = torch.from_numpy(C.indices.astype(np.int64))
    out = snn.sddmm(graph, X, Y, values=v)
    assert out.dtype == torch.float64
    assert torch.allclose(out, v * (X[rows] * Y[cols]).sum(1), rtol=1e-12, atol=1e-12)


def test_float64_graph_values_are_not_rounded():
    # a graph of a float64 matrix: float64 calls use its values unrounded (float32 calls rounded),
    # through the transposed graph of the backward too; values given as float32 are widened
    A64 = random_matrix(13, 11, density=0.3, seed=12, dtype=np.float64)
    A64.data = A64.data + 1e-9                        # not representable in float32
    g = snn.SparseGraph(A64)
    X = torch.randn(11, K, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    vd = torch.from_numpy(np.array(as_csr(A64, np.float64).data))
    Y = snn.spmm(g, X)
    assert torch.allclose(Y, _dense(A64, vd) @ X.detach(), rtol=1e-13, atol=1e-13)
    G = torch.randn(Y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    Y.backward(G)
    assert torch.allclose(X.grad, _dense(A64, vd).T @ G, rtol=1e-13, atol=1e-13)
    assert g.typed("values", torch.float64) is g.typed("values", torch.float64)   # converted once
    assert g.values.dtype == torch.float32 and snn.spmm(g, X.detach().float()).dtype == torch.float32
    v32 = torch.randn(g.nnz, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(snn.spmm(g, X.detach(), values=v32), _dense(A64, v32.double()) @ X.detach(),
                          rtol=1e-13, atol=1e-13)
    # pickled and transposed graphs keep the float64 values
    import pickle

    g2 = pickle.loads(pickle.dumps(g))
    assert torch.equal(g2.typed("values", torch.float64), vd)
    assert torch.equal(g.transpose().typed("values", torch.float64), vd[g.tperm])


def test_float64_module_forward_and_backward(A):
    # a float64 module built by the user: forward with its own (float64) values, the gradient
    # through its graph at float64 accuracy
    mod = spcompile.build(A, "spmm", K=K, reduce="mean", target="cpu", dtype="float64")
    X, _ = _inputs(A, 15, torch.float64)
    X.requires_grad_(True)
    Y = snn.spmm(mod, X)
    vd = torch.from_numpy(np.array(as_csr(A, np.float64).data))
    assert Y.dtype == torch.float64
    assert torch.allclose(Y, _ref_spmm(A, X.detach(), vd, "mean"), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda X: snn.spmm(mod, X), (X,))
    with pytest.raises(TypeError, match="dtype float32, expected float64"):
        mod(X.detach().float())


def test_sddmm_float32_grads_match_float64_reference(A, graph):
    C = as_csr(A)
    g = torch.Generator().manual_seed(4)
    X = torch.randn(C.shape[0], K, generator=g, requires_grad=True)
    Y = torch.randn(C.shape[1], K, generator=g, requires_grad=True)
    v = torch.randn(C.nnz, generator=g, requires_grad=True)
    out = snn.sddmm(graph, X, Y, values=v)
    Xd, Yd, vd = (t.detach().double().requires_grad_(True) for t in (X, Y, v))
    rows = torch.from_numpy(C.row_ids.astype(np.int64))
    cols = torch.from_numpy(C.indices.astype(np.int64))
    ref = vd * (Xd[rows] * Yd[cols]).sum(1)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    G = torch.randn(C.nnz, generator=g)
    out.backward(G)
    ref.backward(G.double())
    for a, b in ((X, Xd), (Y, Yd), (v, vd)):
        assert torch.allclose(a.grad.double(), b.grad, atol=1e-5, rtol=1e-5)


def test_spmm_of_a_built_module_with_reordering(A):
    # a module built by the user (passes reorder rows and columns): forward through the module,
    # its own values; the backward builds the transpose once
    mod = spcompile.build(A, "spmm", K=K, target="cpu", template="cpu.csr_spmm",
                          pipeline=[{"name": "reorder.rcm"}])
    X, _ = _inputs(A, 5)
    X.requires_grad_(True)
    Y = snn.spmm(mod, X)
    C = as_csr(A)
    vd = torch.from_numpy(C.data.astype(np.float64))
    Xd = X.detach().double().requires_grad_(True)
    Yd = _dense(A, vd) @ Xd
    assert torch.allclose(Y.double(), Yd, atol=1e-5)
    Y.sum().backward()
    Yd.sum().backward()
    assert torch.allclose(X.grad.double(), Xd.grad, atol=1e-5)
    g = mod._nn_graph
    assert g._user and g.transpose() is g.transpose()
    # a second call reuses the graph, the forward module is the user's
    snn.spmm(mod, X).sum().backward()
    assert mod._nn_graph is g


def test_errors_where_gradients_cannot_flow(A, tmp_path):
    mod = spcompile.build(A, "spmm", K=K, target="cpu", template="cpu.csr_spmm")
    X, _ = _inputs(A, 6)
    # calling the module directly with a tensor that requires grad: an error, not a detached result
    with pytest.raises(RuntimeError, match="spcompile.nn.spmm"):
        mod(X.clone().requires_grad_(True))
    # a module loaded without its matrix: forward only; with a grad-requiring X it says how to fix it
    loaded = spcompile.load(mod.save(str(tmp_path / "m.spc")))
    assert torch.allclose(snn.spmm(loaded, X), snn.spmm(mod, X))
    with pytest.raises(RuntimeError, match=r"spcompile.load\(path, A\)"):
        snn.spmm(loaded, X.clone().requires_grad_(True))
    with_matrix = spcompile.load(str(tmp_path / "m.spc"), A)
    Xg = X.clone().requires_grad_(True)
    snn.spmm(with_matrix, Xg).sum().backward()
    assert Xg.grad is not None and torch.isfinite(Xg.grad).all()


def test_bad_dtypes_devices_and_shapes(graph):
    # float64 CUDA tensors: a clear error before anything is built (a stand-in with a CUDA device:
    # only the dtype and the device are looked at)
    from types import SimpleNamespace

    with pytest.raises(TypeError, match="float64 CUDA tensors are not supported.*CUDA kernels compute in float32"):
        ops._plan(SimpleNamespace(dtype=torch.float64, device=torch.device("cuda", 0)), "spmm")
    with pytest.raises(TypeError, match="must be float32, float64, float16 or bfloat16"):
        snn.spmm(graph, torch.zeros(graph.shape[1], K, dtype=torch.int32))
    with pytest.raises(TypeError, match="one dtype"):
        snn.sddmm(graph, torch.zeros(graph.shape[0], K, dtype=torch.float64), torch.zeros(graph.shape[1], K))
    with pytest.raises(ValueError, match="expected \\(11, K\\)"):
        snn.spmm(graph, torch.zeros(5, K))
    with pytest.raises(ValueError, match="values has shape"):
        snn.spmm(graph, torch.zeros(graph.shape[1], K), values=torch.zeros(3))


def test_backward_failure_is_an_error(A, monkeypatch):
    g = snn.SparseGraph(A)
    X = torch.randn(A.shape[1], K, requires_grad=True)
    Y = snn.spmm(g, X)

    def fail(*a, **k):
        raise RuntimeError("no template (test)")

    monkeypatch.setattr(snn.SparseGraph, "_build", fail)
    with pytest.raises(RuntimeError, match="gradient of spmm .* cannot be computed: no template"):
        Y.sum().backward()


def test_bf16_inputs_on_cpu_compute_in_float32(A, graph):
    X, v = _inputs(A, 7)
    Y = snn.spmm(graph, X.bfloat16(), values=v)
    assert Y.dtype == torch.bfloat16
    ref = _ref_spmm(A, X.bfloat16().double(), v.double(), "sum")
    assert torch.allclose(Y.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_opcheck(A, graph, reduce, dtype):
    # schema, fake (meta) shape function (gradient dtypes too) and autograd registration of the custom ops
    X, v = _inputs(A, 8, dtype)
    torch.library.opcheck(torch.ops.spcompile.spmm.default, (X.requires_grad_(True), v.requires_grad_(True),
                                                              graph.id, reduce))
    C = as_csr(A)
    Xs = torch.randn(C.shape[0], K, requires_grad=True, dtype=dtype)
    torch.library.opcheck(torch.ops.spcompile.sddmm.default, (Xs, X, None, graph.id))


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_eager_functions_equal_the_registered_ops(A, graph, reduce):
    # outside torch.compile spmm()/sddmm() run autograd Functions; the custom ops (what compiled
    # graphs call) give the same values and gradients
    grads = []
    for path in ("function", "op"):
        X, v = _inputs(A, 9)
        X.requires_grad_(True)
        v.requires_grad_(True)
        Y = snn.spmm(graph, X, values=v, reduce=reduce) if path == "function" else \
            torch.ops.spcompile.spmm(X, v, graph.id, reduce)
        Y.square().sum().backward()
        grads.append((Y.detach(), X.grad, v.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    C = as_csr(A)
    outs = []
    for path in ("function", "op"):
        g = torch.Generator().manual_seed(3)
        X = torch.randn(C.shape[0], K, generator=g, requires_grad=True)
        Y = torch.randn(C.shape[1], K, generator=g, requires_grad=True)
        o = snn.sddmm(graph, X, Y) if path == "function" else torch.ops.spcompile.sddmm(X, Y, None, graph.id)
        o.square().sum().backward()
        outs.append((o.detach(), X.grad, Y.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
