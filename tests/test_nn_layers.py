"""spcompile.nn layers against their definitions (dense float64 references written from the
papers' formulas), and torch.compile(fullgraph=True) of a model using them."""
from __future__ import annotations

import os

import numpy as np
import pytest

# torch is a test dependency (the [test] extra, .ci/run): in CI a missing torch fails, never skips
torch = __import__("torch") if os.environ.get("CI") else pytest.importorskip("torch")

from spcompile import nn as snn  # noqa: E402

N, F = 17, 6


def _edges(seed=0, E=60):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, N, (2, E), generator=g)
    ei = torch.cat([ei, torch.tensor([[3, 3, 5], [3, 3, 9]])], 1)   # a repeated self loop, a repeated edge
    return ei


def _gcn_ref(x, ei, W, b):
    A = torch.zeros(N, N, dtype=torch.float64)
    A.index_put_((ei[1], ei[0]), torch.ones(ei.shape[1], dtype=torch.float64), accumulate=True)
    A = A + torch.diag((torch.diagonal(A) == 0).double())
    d = A.sum(1).pow(-0.5)
    return (d[:, None] * A * d[None, :]) @ (x @ W.T) + b


def _gat_ref(x, ei, W, a_s, a_d, b, heads, C, slope=0.2, concat=True):
    M = torch.zeros(N, N, dtype=torch.bool)
    M[ei[1], ei[0]] = True
    M.fill_diagonal_(True)
    h = (x @ W.T).view(N, heads, C)
    s = (h * a_s).sum(-1)                     # N x H (sources)
    t = (h * a_d).sum(-1)                     # N x H (targets)
    e = torch.nn.functional.leaky_relu(t[:, None, :] + s[None, :, :], slope)   # i, j, H
    e = e.masked_fill(~M[:, :, None], float("-inf"))
    alpha = torch.softmax(e, dim=1)
    out = torch.einsum("ijh,jhc->ihc", alpha, h)
    out = out.reshape(N, heads * C) if concat else out.mean(1)
    return out + b


def _double_params(layer):
    return {k: p.detach().double().clone().requires_grad_(True) for k, p in layer.named_parameters()}


@pytest.mark.parametrize("as_sparse", [False, True])
def test_gcnconv_matches_definition(as_sparse):
    torch.manual_seed(0)
    conv = snn.GCNConv(F, 5)
    with torch.no_grad():
        conv.bias.uniform_(-1, 1)
    x = torch.randn(N, F, requires_grad=True)
    ei = _edges()
    arg = ei
    if as_sparse:   # a sparse adjacency: rows are targets
        arg = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), torch.ones(ei.shape[1]), (N, N))
    out = conv(x, arg)
    P = _double_params(conv)
    xd = x.detach().double().requires_grad_(True)
    ref = _gcn_ref(xd, ei, P["lin.weight"], P["bias"])
    assert torch.allclose(out.double(), ref, atol=1e-5)
    G = torch.randn(out.shape)
    out.backward(G)
    ref.backward(G.double())
    assert torch.allclose(x.grad.double(), xd.grad, atol=1e-5)
    for k, p in conv.named_parameters():
        assert p.grad is not None and torch.allclose(p.grad.double(), P[k].grad, atol=1e-5), k
    # the graph is prepared once per edge_index object
    assert conv.graph(arg) is conv.graph(arg)


@pytest.mark.parametrize("heads,concat", [(1, True), (3, True), (2, False)])
def test_gatconv_matches_definition(heads, concat):
    torch.manual_seed(1)
    C = 4
    conv = snn.GATConv(F, C, heads=heads, concat=concat)
    with torch.no_grad():
        conv.bias.uniform_(-1, 1)
    x = torch.randn(N, F, requires_grad=True)
    ei = _edges(2)
    out = conv(x, ei)
    P = _double_params(conv)
    xd = x.detach().double().requires_grad_(True)
    ref = _gat_ref(xd, ei, P["lin.weight"], P["att_src"], P["att_dst"], P["bias"], heads, C, concat=concat)
    assert out.shape == ref.shape
    assert torch.allclose(out.double(), ref, atol=1e-5)
    G = torch.randn(out.shape)
    out.backward(G)
    ref.backward(G.double())
    assert torch.allclose(x.grad.double(), xd.grad, atol=1e-5)
    for k, p in conv.named_parameters():
        assert p.grad is not None and torch.allclose(p.grad.double(), P[k].grad, atol=1e-5), k


def test_float64_gatconv_matches_definition_and_gradcheck():
    # a float64 layer computes in float64 end to end (the edge softmax too): the definition at
    # float64 accuracy, gradcheck in x at its defaults
    torch.manual_seed(3)
    conv = snn.GATConv(F, 3, heads=2).double()
    x = torch.randn(N, F, dtype=torch.float64, requires_grad=True)
    ei = _edges(4)
    out = conv(x, ei)
    P = {k: p.detach() for k, p in conv.named_parameters()}
    ref = _gat_ref(x.detach(), ei, P["lin.weight"], P["att_src"], P["att_dst"], P["bias"], 2, 3)
    assert out.dtype == torch.float64 and torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: conv(x, ei), (x,))


class GCN(torch.nn.Module):
    def __init__(self, f, hidden, classes):
        super().__init__()
        self.c1, self.c2 = snn.GCNConv(f, hidden), snn.GCNConv(hidden, classes)

    def forward(self, x, g):
        return self.c2(torch.relu(self.c1(x, g)), g)


def test_torch_compile_fullgraph_gcn_training():
    # backend="aot_eager": traces the forward and the backward (AOT autograd) like inductor does,
    # without compiling C++ in CI
    torch.manual_seed(3)
    ei = _edges(4)
    g = snn.gcn_norm(ei, N)
    x, y = torch.randn(N, F), torch.randint(0, 3, (N,))
    model = GCN(F, 8, 3)
    ref = GCN(F, 8, 3)
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for m in (compiled, ref):
        loss = torch.nn.functional.cross_entropy(m(x, g), y)
        loss.backward()
    assert torch.allclose(compiled(x, g), ref(x, g), atol=1e-6)
    for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), k


def test_torch_compile_fullgraph_gat():
    torch.manual_seed(5)
    ei = _edges(6)
    g = snn.gat_graph(ei, N)
    conv = snn.GATConv(F, 4, heads=2)
    x = torch.randn(N, F)
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
    out = compiled(x, g)
    out.square().sum().backward()
    gw = conv.lin.weight.grad.clone()
    conv.zero_grad()
    ref = conv(x, g)
    ref.square().sum().backward()
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(gw, conv.lin.weight.grad, atol=1e-5)


def test_training_reduces_loss():
    torch.manual_seed(7)
    ei = _edges(8, E=120)
    g = snn.gcn_norm(ei, N)
    x, y = torch.randn(N, F), torch.randint(0, 3, (N,))
    model = GCN(F, 16, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x, g), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_layers_and_graphs_pickle_and_copy():
    import copy
    import pickle

    torch.manual_seed(9)
    ei = _edges(10)
    conv = snn.GCNConv(F, 3)
    x = torch.randn(N, F)
    out = conv(x, ei)                       # the layer has prepared and cached a graph
    for twin in (pickle.loads(pickle.dumps(conv)), copy.deepcopy(conv)):
        assert torch.allclose(twin(x, ei), out)
    g = snn.gcn_norm(ei, N)
    g2 = pickle.loads(pickle.dumps(g))
    assert g2.id != g.id and g2.shape == g.shape and torch.equal(g2.values, g.values)
    assert torch.allclose(conv(x, g2), out)


def test_graph_from_edge_index_and_errors():
    ei = _edges(11)
    w = torch.rand(ei.shape[1])
    g = snn.graph_from_edge_index(ei, N, edge_weight=w)
    dense = torch.zeros(N, N, dtype=torch.float64).index_put_((ei[1], ei[0]), w.double(), accumulate=True)
    got = torch.zeros(N, N, dtype=torch.float64).index_put_((g.rows, g.cols), g.values.double())
    assert torch.allclose(got, dense, atol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        snn.graph_from_edge_index(ei, 3)
    with pytest.raises(ValueError, match="shape \\(2, E\\)"):
        snn.gcn_norm(torch.zeros(3, 4, dtype=torch.long), N)
    with pytest.raises(TypeError, match="integers"):
        snn.gat_graph(torch.zeros(2, 4), N)
