"""spcompile.nn and call-time values on a GPU: the CUDA templates that take values per call
(values written into the kernel's device copy on the caller's stream), the differentiable ops in
fp32 / fp16 / bf16 against float64 references, the layers, torch.compile with inductor.
Skipped without a usable GPU."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.runtime import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")]

torch = pytest.importorskip("torch")

import spcompile  # noqa: E402
from spcompile import nn as snn  # noqa: E402
from spcompile.core import reference  # noqa: E402
from spcompile.core.formats import as_csr  # noqa: E402
from spcompile.kernels import base as kbase  # noqa: E402

from conftest import captured_steps_match_eager, random_matrix  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _with_values(A, v):
    C = as_csr(A)
    return sp.csr_matrix((np.asarray(v, np.float64), C.indices, C.indptr), shape=C.shape)


@pytest.mark.parametrize("template", sorted(t for t in kbase.CALL_VALUE_ARRAYS
                                      if spcompile.get_template(t).target == "cuda"))
def test_cuda_call_values(template):
    tpl = spcompile.get_template(template)
    if not tpl.available():
        # a GPU machine may carry TVM's runtime without its compiler: the TVM templates' modules
        # then run (when built elsewhere) but cannot be built here; the nvcc templates must build
        assert template.startswith("tvm."), f"{template} is not available on this GPU machine"
        return
    A = random_matrix(300, 200, density=0.05, seed=1)
    op = "sddmm" if "sddmm" in template else "spmm"
    mod = spcompile.build(A, op, K=16, reduce=None if op == "sddmm" else "sum", target="cuda", template=template,
                          pipeline=[{"name": "reorder.rcm"}])
    assert mod.supports_call_values and mod.values_src is not None
    rng = np.random.default_rng(0)
    X = torch.from_numpy(rng.standard_normal((300 if op == "sddmm" else 200, 16)).astype(np.float32)).cuda()
    Y = torch.from_numpy(rng.standard_normal((200, 16)).astype(np.float32)).cuda()
    ins = (X, Y) if op == "sddmm" else (X,)
    built = mod(*ins).cpu().numpy()
    for seed in range(3):
        v = np.random.default_rng(seed + 5).standard_normal(A.nnz)
        ref = reference.run(op, None if op == "sddmm" else "sum", as_csr(_with_values(A, v)),
                            *(t.cpu().numpy() for t in ins))
        got = mod(*ins, values=torch.from_numpy(v).cuda()).cpu().numpy()
        assert reference.rel_error(got, ref) < 1e-5
        got_np = mod(*(t.cpu().numpy() for t in ins), values=v.astype(np.float32))
        assert reference.rel_error(got_np, ref) < 1e-5
    assert np.array_equal(mod(*ins).cpu().numpy(), built)   # back to the built values


@pytest.mark.parametrize("warp_combine", [1, 2])
def test_cuda_call_values_with_warp_reduced_rows(warp_combine, tmp_path):
    """Call-time values reach their entries where the kernel's layout moves hub rows' entries
    first (csr.crc_cwm ``warp_combine``), through torch, numpy and a saved and loaded module."""
    A = random_matrix(400, 300, density=0.03, seed=7)          # one 300-long row: tens of slices
    params = {"cf": 1, "vec": 4, "group": 8, "warps_per_block": 4, "rows_per_warp": 1, "max_seg": 8, "unroll": 2,
              "warp_combine": warp_combine}
    mod = spcompile.build(A, "spmm", K=33, reduce="sum", target="cuda", template="csr.crc_cwm", params=params,
                          pipeline=[{"name": "reorder.rcm"}])
    assert mod.config.params["warp_combine"] == warp_combine and mod.supports_call_values
    assert mod.kernel.entry_src is not None     # RCM leaves the hub row inside: the packer moves it first
    rng = np.random.default_rng(3)
    X = rng.standard_normal((300, 33)).astype(np.float32)
    path = mod.save(str(tmp_path / "m.spc"))
    for m in (mod, spcompile.load(path, A)):
        for seed in range(2):
            v = np.random.default_rng(seed + 9).standard_normal(A.nnz)
            ref = reference.run("spmm", "sum", as_csr(_with_values(A, v)), X)
            got = m(torch.from_numpy(X).cuda(), values=torch.from_numpy(v).cuda()).cpu().numpy()
            assert reference.rel_error(got, ref) < 1e-5
            assert reference.rel_error(m(X, values=v.astype(np.float32)), ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min"])
def test_spmm_grads_on_gpu(dtype, reduce):
    A = random_matrix(257, 190, density=0.04, seed=2)
    g = snn.SparseGraph(A).to("cuda")
    C = as_csr(A)
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(190, 32, generator=gen).to(dtype).cuda().requires_grad_(True)
    v = torch.randn(C.nnz, generator=gen).cuda().requires_grad_(True)
    Y = snn.spmm(g, X, values=v, reduce=reduce)
    assert Y.dtype == dtype
    # float64 reference on the CPU from the same (rounded) inputs
    rows = torch.from_numpy(C.row_ids.astype(np.int64))
    cols = torch.from_numpy(C.indices.astype(np.int64))
    Xd = X.detach().double().cpu().requires_grad_(True)
    vd = v.detach().double().cpu().requires_grad_(True)
    P = vd[:, None] * Xd[cols]
    if reduce in ("sum", "mean"):
        Yd = torch.zeros(257, 32, dtype=torch.float64).index_add(0, rows, P)
        if reduce == "mean":
            Yd = Yd / torch.from_numpy(np.maximum(np.diff(C.indptr), 1).astype(np.float64))[:, None]
    else:
        fill = float("-inf") if reduce == "max" else float("inf")
        Yd = torch.full((257, 32), fill, dtype=torch.float64).scatter_reduce(
            0, rows[:, None].expand(-1, 32), P, "amax" if reduce == "max" else "amin", include_self=True)
        Yd = torch.where(torch.isinf(Yd), torch.zeros_like(Yd), Yd)
    tol = TOL[dtype]
    assert torch.allclose(Y.double().cpu(), Yd, atol=tol, rtol=tol)
    G = torch.randn(257, 32, generator=gen)
    Y.backward(G.to(dtype).cuda())
    Yd.backward(G.to(dtype).double())
    assert torch.allclose(X.grad.double().cpu(), Xd.grad, atol=tol * 10, rtol=tol * 10)
    assert torch.allclose(v.grad.double().cpu(), vd.grad, atol=tol * 30, rtol=tol * 10)


def _gcn_gat(N, E, F, hidden, classes):
    """Two twin GCN -> GAT models (same parameters) on a random graph of N nodes and E edges, with
    CUDA inputs x (N x F) and labels y."""
    torch.manual_seed(0)
    ei = torch.randint(0, N, (2, E))
    x, y = torch.randn(N, F).cuda(), torch.randint(0, classes, (N,)).cuda()
    g1, g2 = snn.gcn_norm(ei, N).to("cuda"), snn.gat_graph(ei, N).to("cuda")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = snn.GCNConv(F, hidden), snn.GATConv(hidden, classes, heads=2, concat=False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x, g1)), g2)

    one, two = Net().cuda(), Net().cuda()
    two.load_state_dict(one.state_dict())
    return one, two, x, y


def test_layers_and_inductor_on_gpu():
    eager, comp, x, y = _gcn_gat(500, 4000, 32, 64, 5)
    compiled = torch.compile(comp, fullgraph=True)
    for m in (eager, compiled):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    for (k, p), (_, q) in zip(eager.named_parameters(), comp.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-4, rtol=1e-3), k
    with torch.autocast("cuda", dtype=torch.float16):
        out = eager(x)
    torch.nn.functional.cross_entropy(out.float(), y).backward()
    assert all(torch.isfinite(p.grad).all() for p in eager.parameters())


def test_whole_training_step_in_a_cuda_graph():
    """The ops under CUDA-graph capture (PyTorch's whole-network recipe): a GCN + GAT training step
    (forward, loss, backward, capturable Adam) captured once and replayed computes what the same
    steps compute eagerly, with new values written into the same buffers each replay."""
    eager, graphed, x, y = _gcn_gat(400, 3000, 16, 32, 4)
    captured_steps_match_eager(eager, graphed, x, y)


def test_spmm_of_a_built_cuda_module():
    A = random_matrix(300, 280, density=0.03, seed=4)
    mod = spcompile.build(A, "spmm", K=64, target="cuda")
    X = torch.randn(280, 64, device="cuda", requires_grad=True)
    Y = snn.spmm(mod, X)
    C = as_csr(A)
    Ad = torch.from_numpy(C.to_scipy().toarray().astype(np.float64))
    Xd = X.detach().double().cpu().requires_grad_(True)
    Yd = Ad @ Xd
    assert torch.allclose(Y.double().cpu(), Yd, atol=1e-4, rtol=1e-4)
    Y.square().sum().backward()
    Yd.square().sum().backward()
    assert torch.allclose(X.grad.double().cpu(), Xd.grad, atol=1e-3, rtol=1e-4)
