"""The fused GAT aggregation's CUDA kernels (spcompile/nn/gat.cu) on a GPU: the op's forward and
its three gradients against the float64 CPU implementation (itself checked against dense
definitions in tests/test_gat.py) for float32 / float16 / bfloat16, on graphs with an empty row,
a row of 3000 entries, a source feeding 2000 rows, C = 1, 5, 32, 33 and 600 (column tiles), one
and four heads, an unaligned h; every output element written (NaN-poisoned buffers); results
deterministic; GATConv under autocast, torch.compile with inductor, and a 2-layer GAT training
step captured in a CUDA graph whose replays match eager steps.  Skipped without a usable GPU."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.runtime import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")]

torch = pytest.importorskip("torch")

from spcompile import nn as snn  # noqa: E402
from spcompile.nn import gat  # noqa: E402
from conftest import captured_steps_match_eager  # noqa: E402

#: relative error (in norm) allowed for the output and the gradients per dtype of h
TOL_OUT = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
TOL_GRAD = {torch.float32: 3e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _matrix(n, long_row=7, long_len=3000, empty_row=11, hub_col=13, hub_rows=2000, per_row=5, seed=0):
    """An n x n pattern: self loops, ~per_row random entries a row, row ``long_row`` with
    ``long_len`` entries, row ``empty_row`` empty (no self loop either), column ``hub_col`` in
    ``hub_rows`` rows, column ``n - 1`` in no row."""
    rng = np.random.default_rng(seed)
    rows = [np.repeat(np.arange(n), per_row), np.arange(n), np.full(long_len, long_row),
            rng.choice(n, min(hub_rows, n), replace=False)]
    cols = [rng.integers(0, n, n * per_row), np.arange(n), rng.choice(n, long_len, replace=False),
            np.full(min(hub_rows, n), hub_col)]
    r, c = np.concatenate(rows), np.concatenate(cols)
    keep = (r != empty_row) & (c != n - 1)
    A = sp.csr_matrix((np.ones(keep.sum(), np.float32), (r[keep], c[keep])), shape=(n, n))
    A.sum_duplicates()
    A.data[:] = 1.0
    A.sort_indices()
    assert np.diff(A.indptr)[long_row] >= long_len - 1 and A.indptr[empty_row + 1] == A.indptr[empty_row]
    return A


def _rel(got, ref):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def _inputs(n, H, C, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, C, generator=g).to(dtype)
    s = torch.randn(n, H, generator=g)
    d = torch.randn(n, H, generator=g)
    return h, s, d


def _check_against_cpu(A, H, C, dtype, s_dtype=torch.float32, slope=0.2):
    n = A.shape[0]
    g = snn.SparseGraph(A).to("cuda")
    ref_g = snn.SparseGraph(A)
    h, s, d = _inputs(n, H, C, dtype)
    s, d = s.to(s_dtype), d.to(s_dtype)
    hc = h.cuda().requires_grad_(True)
    sc, dc = s.cuda().requires_grad_(True), d.cuda().requires_grad_(True)
    assert gat.uses_cuda(g, hc), "the CUDA kernels must run here (a GPU, and nvcc or a cached binary)"
    out = snn.gat_aggregate(g, hc, sc, dc, slope)
    assert out.dtype == dtype and out.shape == (n, H, C) and out.is_cuda
    hd, sd, dd = (t.detach().double().cpu().requires_grad_(True) for t in (hc, sc, dc))
    ref = snn.gat_aggregate(ref_g, hd, sd, dd, slope)
    assert _rel(out, ref) < TOL_OUT[dtype], _rel(out, ref)
    assert torch.all(out[11] == 0)                                   # the empty row
    G = torch.randn(n, H, C, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(G.cuda())
    ref.backward(G.double())
    for name, a, b in (("h", hc, hd), ("a_src", sc, sd), ("a_dst", dc, dd)):
        assert a.grad.dtype == a.dtype, name
        assert torch.isfinite(a.grad).all(), name
        assert _rel(a.grad, b.grad) < TOL_GRAD[dtype], (name, _rel(a.grad, b.grad))
    assert torch.all(hc.grad[n - 1] == 0) and torch.all(sc.grad[n - 1] == 0)   # a source of no entry
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("H,C", [(1, 1), (4, 1), (1, 5), (4, 5), (4, 32), (1, 33), (4, 33)])
def test_op_against_float64(dtype, H, C):
    _check_against_cpu(_matrix(3200), H, C, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_wide_rows_run_in_column_tiles(dtype):
    """C = 600 > 512: the forward walks column tiles in blockIdx.y, the transposed pass takes the
    dot products over every tile."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    vec, G, CH = gat.config(600, itemsize)
    assert G * vec * CH < 600
    _check_against_cpu(_matrix(400, long_len=350, hub_rows=300, per_row=3), 2, 600, dtype)


def test_unaligned_h_takes_the_scalar_fallback():
    n, H, C = 3200, 4, 32
    base = torch.randn(n * H * C + 1).cuda()
    h = base[1:].view(n, H, C)                 # 4 bytes past an aligned address: no float4 loads
    assert h.data_ptr() % 16 != 0 and gat._vec_max(C, torch.float32, h) == 1
    A = _matrix(n)
    g = snn.SparseGraph(A).to("cuda")
    _, s, d = _inputs(n, H, C, torch.float32)
    out = snn.gat_aggregate(g, h, s.cuda(), d.cuda())
    ref = snn.gat_aggregate(snn.SparseGraph(A), h.double().cpu(), s.double(), d.double())
    assert _rel(out, ref) < 1e-5


def test_16bit_attention_inputs():
    """a_src / a_dst in 16 bits too (converted to float32 for the kernels; gradients back in 16)."""
    _check_against_cpu(_matrix(3200), 4, 32, torch.bfloat16, s_dtype=torch.bfloat16)


def test_every_output_element_is_written(monkeypatch):
    """Buffers allocated full of NaN: the kernels write every element (empty rows 0, sources of
    no entry 0), the partial-result slots before the merges read them."""
    monkeypatch.setattr(gat, "_alloc", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                               device=device))
    for H, C in ((4, 32), (1, 5), (2, 600)):
        A = _matrix(400, long_len=350, hub_rows=300, per_row=3) if C == 600 else _matrix(3200)
        g = snn.SparseGraph(A).to("cuda")
        h, s, d = (t.cuda().requires_grad_(True) for t in _inputs(A.shape[0], H, C, torch.float32))
        out = snn.gat_aggregate(g, h, s, d)
        assert not torch.isnan(out).any() and torch.all(out[11] == 0)
        out.backward(torch.randn_like(out))
        for t in (h, s, d):
            assert not torch.isnan(t.grad).any()
        assert torch.all(h.grad[-1] == 0) and torch.all(s.grad[-1] == 0)


def test_deterministic():
    A = _matrix(3200)
    g = snn.SparseGraph(A).to("cuda")
    h, s, d = (t.cuda().requires_grad_(True) for t in _inputs(3200, 4, 32, torch.float32))
    G = torch.randn(3200, 4, 32, device="cuda")
    runs = []
    for _ in range(2):
        for t in (h, s, d):
            t.grad = None
        out = snn.gat_aggregate(g, h, s, d)
        out.backward(G)
        runs.append([out.detach().clone()] + [t.grad.clone() for t in (h, s, d)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# -- layers ------------------------------------------------------------------------------------
def _gat2(N, E, F, hidden, heads, classes, seed=0):
    """Two twin 2-layer GATs (heads x hidden, then one head) with the same parameters, a graph,
    CUDA inputs and labels."""
    torch.manual_seed(seed)
    ei = torch.randint(0, N, (2, E))
    x, y = torch.randn(N, F).cuda(), torch.randint(0, classes, (N,)).cuda()
    g = snn.gat_graph(ei, N).to("cuda")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = snn.GATConv(F, hidden, heads=heads)
            self.b = snn.GATConv(hidden * heads, classes, heads=1)

        def forward(self, x):
            return self.b(torch.nn.functional.elu(self.a(x, g)), g)

    one, two = Net().cuda(), Net().cuda()
    two.load_state_dict(one.state_dict())
    return one, two, x, y, g


def test_gatconv_on_gpu_matches_the_cpu():
    one, _, x, y, g = _gat2(2000, 30000, 64, 32, 4, 7)
    loss = torch.nn.functional.cross_entropy(one(x), y)
    loss.backward()
    # the same model in float64 on the CPU (its own graph on the CPU)
    import copy

    ref = copy.deepcopy(one).double().cpu()
    g_cpu = snn.SparseGraph(g.csr)
    ref_out = ref.b(torch.nn.functional.elu(ref.a(x.double().cpu(), g_cpu)), g_cpu)
    ref.zero_grad()
    torch.nn.functional.cross_entropy(ref_out, y.cpu()).backward()
    assert _rel(one(x), ref_out) < 1e-5
    for (k, p), (_, q) in zip(one.named_parameters(), ref.named_parameters()):
        assert _rel(p.grad, q.grad) < 1e-4, k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_gatconv_under_autocast(dtype):
    one, _, x, y, _ = _gat2(2000, 30000, 64, 32, 4, 7)
    with torch.no_grad():
        ref = one(x)
    seen = []
    hook = one.a.lin.register_forward_hook(lambda mod, args, res: seen.append(res.dtype))
    with torch.autocast("cuda", dtype=dtype):
        out = one(x)                  # 16-bit features into the op (the bias adds in float32)
    hook.remove()
    assert seen == [dtype] and torch.isfinite(out).all()
    assert _rel(out, ref) < (2e-2 if dtype == torch.float16 else 8e-2)
    torch.nn.functional.cross_entropy(out.float(), y).backward()
    assert all(torch.isfinite(p.grad).all() for p in one.parameters())


def test_inductor_fullgraph():
    eager, comp, x, y, _ = _gat2(1500, 20000, 32, 16, 4, 5)
    compiled = torch.compile(comp, fullgraph=True)
    for m in (eager, compiled):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    for (k, p), (_, q) in zip(eager.named_parameters(), comp.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), k


def test_gat_training_step_in_a_cuda_graph():
    """A 2-layer GAT (4 heads x 32, then 1 head) training step -- forward, loss, backward,
    capturable Adam -- captured once and replayed gives the losses of the same steps run eagerly
    (conftest.captured_steps_match_eager)."""
    eager, graphed, x, y, _ = _gat2(3000, 40000, 64, 32, 4, 8, seed=3)
    captured_steps_match_eager(eager, graphed, x, y)
