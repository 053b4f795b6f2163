"""The fused GAT aggregation (spcompile.nn.gat) on the CPU: gradcheck of the op in float64, the
op and GATConv against dense float64 references written from the definition, fake tensors /
torch.compile(fullgraph=True) / opcheck, the segment partition and the kernel configurations the
CUDA path uses (the kernels themselves: tests/test_gat_gpu.py, their compilation:
tests/test_cuda_compile.py)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import scipy.sparse as sp

# torch is a test dependency (the [test] extra, .ci/run): in CI a missing torch fails, never skips
torch = __import__("torch") if os.environ.get("CI") else pytest.importorskip("torch")

from spcompile import nn as snn  # noqa: E402
from spcompile.nn import gat  # noqa: E402


def random_graph(n, m, seed, long_row=None, empty_row=None, density=0.2, loops=True):
    """A random n x m pattern (rows: targets), with self loops on the diagonal, one row holding
    every column (``long_row``) and one row without entries (``empty_row``)."""
    rng = np.random.default_rng(seed)
    M = rng.random((n, m)) < density
    if loops:
        k = min(n, m)
        M[np.arange(k), np.arange(k)] = True
    if long_row is not None:
        M[long_row, :] = True
    if empty_row is not None:
        M[empty_row, :] = False
    A = sp.csr_matrix(M.astype(np.float32))
    A.sort_indices()
    return snn.SparseGraph(A), torch.from_numpy(M)


def dense_ref(M, h, a_src, a_dst, slope=0.2):
    """out[i, k] = sum_j softmax_j(leaky_relu(a_src[j, k] + a_dst[i, k])) h[j, k] over the j with
    M[i, j], written densely (empty rows: 0)."""
    e = torch.nn.functional.leaky_relu(a_dst[:, None, :] + a_src[None, :, :], slope)   # i, j, H
    Mk = M[:, :, None]
    mx = e.masked_fill(~Mk, float("-inf")).amax(1, keepdim=True).detach()
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    ex = torch.exp(e - mx) * Mk
    den = ex.sum(1, keepdim=True)
    alpha = ex / torch.where(den > 0, den, torch.ones_like(den))
    return torch.einsum("ijh,jhc->ihc", alpha, h)


def _inputs(n, m, H, C, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, H, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    s = torch.randn(m, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    d = torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    return h, s, d


@pytest.mark.parametrize("H,C", [(1, 1), (1, 5), (3, 1), (3, 5)])
def test_gradcheck_float64(H, C):
    g, _ = random_graph(9, 9, seed=H * 10 + C, long_row=2, empty_row=5)
    h, s, d = _inputs(9, 9, H, C, seed=C)
    assert torch.autograd.gradcheck(lambda h, s, d: snn.gat_aggregate(g, h, s, d, 0.2), (h, s, d))
    # the custom op itself (what torch.compile traces), with its registered autograd formula
    assert torch.autograd.gradcheck(lambda h, s, d: torch.ops.spcompile.gat_aggregate(h, s, d, g.id, 0.2)[0],
                                    (h, s, d))


def test_gradcheck_rectangular_and_slope():
    g, _ = random_graph(7, 11, seed=3, long_row=0, empty_row=6)
    h, s, d = _inputs(7, 11, 2, 3, seed=1)
    assert torch.autograd.gradcheck(lambda h, s, d: snn.gat_aggregate(g, h, s, d, 0.05), (h, s, d))


@pytest.mark.parametrize("H,C", [(1, 1), (3, 5), (4, 8)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_dense_reference(H, C, dtype):
    n = 23
    g, M = random_graph(n, n, seed=7, long_row=4, empty_row=11, density=0.15)
    h, s, d = _inputs(n, n, H, C, dtype=dtype, seed=2)
    out = snn.gat_aggregate(g, h, s, d, 0.2)
    assert out.dtype == dtype and out.shape == (n, H, C)
    hd, sd, dd = (t.detach().double().requires_grad_(True) for t in (h, s, d))
    ref = dense_ref(M, hd, sd, dd)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol)
    assert torch.all(out[11] == 0)                       # the empty row
    G = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out.backward(G.to(dtype))
    ref.backward(G)
    for a, b in ((h, hd), (s, sd), (d, dd)):
        assert a.grad.dtype == dtype
        assert torch.allclose(a.grad.double(), b.grad, rtol=tol * 10, atol=tol * 10)


def test_lse_and_its_gradient_is_not_taken():
    g, M = random_graph(10, 10, seed=1, empty_row=3)
    h, s, d = _inputs(10, 10, 2, 3)
    out, lse = torch.ops.spcompile.gat_aggregate(h, s, d, g.id, 0.2)
    assert not lse.requires_grad and lse.dtype == torch.float64
    e = torch.nn.functional.leaky_relu(d.detach()[:, None, :] + s.detach()[None, :, :], 0.2)
    ref = torch.logsumexp(e.masked_fill(~M[:, :, None], float("-inf")), dim=1)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)) and lse[3].eq(float("-inf")).all()
    fin = torch.isfinite(ref)
    assert torch.allclose(lse[fin], ref[fin], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_inputs_on_the_cpu(dtype):
    """16-bit h (GATConv under autocast) with float32 a_src / a_dst: out in h's dtype, computed in
    float32, each gradient in its input's dtype."""
    g, M = random_graph(12, 12, seed=4, long_row=1, empty_row=7)
    h, _, _ = _inputs(12, 12, 2, 4, dtype=dtype)
    _, s, d = _inputs(12, 12, 2, 4, dtype=torch.float32, seed=5)
    out = snn.gat_aggregate(g, h, s, d)
    assert out.dtype == dtype
    ref = dense_ref(M, h.detach().double(), s.detach().double(), d.detach().double())
    assert torch.allclose(out.double(), ref, rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    assert h.grad.dtype == dtype and s.grad.dtype == torch.float32 and d.grad.dtype == torch.float32


def test_shape_and_device_errors():
    g, _ = random_graph(6, 6, seed=0)
    h, s, d = _inputs(6, 6, 2, 3)
    with pytest.raises(ValueError, match="h has shape"):
        snn.gat_aggregate(g, h[:5], s, d)
    with pytest.raises(ValueError, match="a_src, a_dst"):
        snn.gat_aggregate(g, h, s[:, :1], d)
    with pytest.raises(TypeError, match="SparseGraph"):
        snn.gat_aggregate(None, h, s, d)


# -- GATConv ----------------------------------------------------------------------------------
def _gat_dense(x, M, W, att_s, att_d, bias, heads, C, concat, slope=0.2):
    N = x.shape[0]
    h = (x @ W.T).view(N, heads, C)
    out = dense_ref(M, h, (h * att_s).sum(-1), (h * att_d).sum(-1), slope)
    out = out.reshape(N, heads * C) if concat else out.mean(1)
    return out + bias


@pytest.mark.parametrize("heads,concat", [(1, True), (4, True), (3, False)])
def test_gatconv_matches_dense_reference(heads, concat):
    torch.manual_seed(11)
    N, F, C = 40, 7, 5
    ei = torch.randint(0, N, (2, 300))
    ei = ei[:, ei[0] != 17]                          # node 17 sends nothing (a column with one entry)
    g = snn.gat_graph(ei, N)
    M = torch.from_numpy(g.csr.to_scipy().toarray() != 0)
    conv = snn.GATConv(F, C, heads=heads, concat=concat, negative_slope=0.1)
    with torch.no_grad():
        conv.bias.uniform_(-1, 1)
    x = torch.randn(N, F, requires_grad=True)
    out = conv(x, g)
    P = {k: p.detach().double().clone().requires_grad_(True) for k, p in conv.named_parameters()}
    xd = x.detach().double().requires_grad_(True)
    ref = _gat_dense(xd, M, P["lin.weight"], P["att_src"], P["att_dst"], P["bias"], heads, C, concat, 0.1)
    assert out.shape == ref.shape and torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    G = torch.randn(out.shape)
    out.backward(G)
    ref.backward(G.double())
    assert torch.allclose(x.grad.double(), xd.grad, atol=1e-5, rtol=1e-4)
    for k, p in conv.named_parameters():
        assert torch.allclose(p.grad.double(), P[k].grad, atol=1e-5, rtol=1e-4), k


def test_edge_softmax_matches_dense():
    g, M = random_graph(15, 15, seed=2, long_row=3, empty_row=8)
    logits = torch.randn(g.nnz, 3, dtype=torch.float64, requires_grad=True)
    alpha = snn.edge_softmax(logits, g)
    dense = torch.full((15, 15, 3), float("-inf"), dtype=torch.float64)
    rows, cols = g.rows, g.cols
    dense = dense.index_put((rows, cols), logits)
    ref = torch.softmax(dense, dim=1)[rows, cols]
    assert torch.allclose(alpha, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: snn.edge_softmax(t, g), (logits,))
    a1 = snn.edge_softmax(logits[:, 0].detach().float(), g)        # one dimension, float32
    assert a1.dtype == torch.float32 and torch.allclose(a1.double(), ref[:, 0], atol=1e-6)


# -- torch.compile / fake tensors / opcheck ------------------------------------------------------
class GAT(torch.nn.Module):
    def __init__(self, f, hidden, heads, classes):
        super().__init__()
        self.c1 = snn.GATConv(f, hidden, heads=heads)
        self.c2 = snn.GATConv(hidden * heads, classes, heads=1, concat=False)

    def forward(self, x, g):
        return self.c2(torch.nn.functional.elu(self.c1(x, g)), g)


def test_torch_compile_fullgraph_gat_training():
    torch.manual_seed(13)
    N, F = 30, 6
    g = snn.gat_graph(torch.randint(0, N, (2, 150)), N)
    x, y = torch.randn(N, F), torch.randint(0, 3, (N,))
    model, ref = GAT(F, 4, 3, 3), GAT(F, 4, 3, 3)
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for m in (compiled, ref):
        torch.nn.functional.cross_entropy(m(x, g), y).backward()
    assert torch.allclose(compiled(x, g), ref(x, g), atol=1e-6)
    for (k, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), k


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    g, _ = random_graph(8, 5, seed=0, loops=False)
    with FakeTensorMode():
        h, s, d = torch.empty(5, 2, 3), torch.empty(5, 2), torch.empty(8, 2)
        out, lse = torch.ops.spcompile.gat_aggregate(h, s, d, g.id, 0.2)
        assert out.shape == (8, 2, 3) and lse.shape == (8, 2) and lse.dtype == torch.float32
        dh, ds, dd = torch.ops.spcompile.gat_aggregate_backward(out, h, s, d, out, lse, g.id, 0.2, True, False, True)
        assert dh.shape == (5, 2, 3) and ds.shape == (0,) and dd.shape == (8, 2)


def test_opcheck():
    g, _ = random_graph(9, 9, seed=6, long_row=1, empty_row=4)
    h, s, d = _inputs(9, 9, 2, 3)
    torch.library.opcheck(torch.ops.spcompile.gat_aggregate.default, (h, s, d, g.id, 0.2))
    h32, s32, d32 = (t.detach().float() for t in (h, s, d))
    torch.library.opcheck(torch.ops.spcompile.gat_aggregate.default, (h32, s32, d32, g.id, 0.2))
    out, lse = torch.ops.spcompile.gat_aggregate(h.detach(), s.detach(), d.detach(), g.id, 0.2)
    torch.library.opcheck(torch.ops.spcompile.gat_aggregate_backward.default,
                          (torch.randn_like(out), h.detach(), s.detach(), d.detach(), out, lse, g.id, 0.2,
                           True, True, True))


# -- what the CUDA path is built from ------------------------------------------------------------
@pytest.mark.parametrize("itemsize", [4, 2])
def test_kernel_configurations(itemsize):
    for C in range(1, 700):
        for vec_max in (16, 1):
            vec, G, CH = gat.config(C, itemsize, vec_max)
            assert vec * itemsize <= 16 and vec <= vec_max and C % vec == 0
            assert G in (1, 2, 4, 8, 16, 32) and 1 <= CH <= 16 // vec
            lanes = C // vec
            assert G >= min(lanes, 32) and (G == 1 or G // 2 < lanes)    # no idle half group
            assert G * vec * CH <= 512 and (G * vec * CH >= C or G * vec * CH == 512)
    assert gat.config(32, 4) == (4, 8, 1) and gat.config(1, 4) == (1, 1, 1) and gat.config(33, 4) == (1, 32, 2)


def test_partition_covers_rows_in_balanced_segments():
    rng = np.random.default_rng(0)
    lens = np.concatenate([rng.integers(0, 20, 50), [0, 3000, 129, 128, 64, 65, 0]])
    rng.shuffle(lens)
    indptr = np.concatenate([[0], np.cumsum(lens)])
    for S in (64, 128, 256):
        p = gat.partition(indptr, S)
        seg_ptr, seg_row, slot = p["seg_ptr"], p["seg_row"], p["seg_slot"]
        assert seg_ptr[0] == 0 and seg_ptr[-1] == indptr[-1] and np.all(np.diff(seg_ptr) >= 0)
        seg_len = np.diff(seg_ptr)
        assert seg_len.max() <= S
        # every row: its segments in order, covering exactly its entries; empty rows one segment
        assert np.array_equal(np.bincount(seg_row, weights=seg_len, minlength=lens.size), lens)
        assert np.all(np.diff(seg_row) >= 0) and set(seg_row) == set(range(lens.size))
        assert np.array_equal(seg_ptr[:-1][np.r_[True, np.diff(seg_row) > 0]], indptr[:-1])
        split = np.bincount(seg_row, minlength=lens.size) > 1
        assert np.array_equal(p["split_row"], np.flatnonzero(split)) and np.array_equal(split, lens > S)
        # slots: the split rows' segments, consecutive per row, in order
        assert np.array_equal(slot[slot >= 0], np.arange((slot >= 0).sum()))
        assert np.array_equal(np.diff(p["split_ptr"]), np.bincount(seg_row, minlength=lens.size)[split])
        assert np.all(seg_len[slot >= 0] >= S // 2)          # balanced slices
        assert np.array_equal(seg_row[slot >= 0], np.repeat(p["split_row"], np.diff(p["split_ptr"])))


def test_graph_caches_follow_the_device():
    g, _ = random_graph(6, 6, seed=0)
    made = []
    a = g.cached(("k", 1), lambda: made.append(1) or object())
    assert g.cached(("k", 1), lambda: made.append(1) or object()) is a and made == [1]
    g.to("cpu")                      # same device: kept
    assert g.cached(("k", 1), lambda: None) is a


def test_composite_when_forced_or_on_cpu(monkeypatch):
    g, _ = random_graph(6, 6, seed=0)
    h, _, _ = _inputs(6, 6, 1, 2, dtype=torch.float32)
    assert not gat.uses_cuda(g, h.detach())
    monkeypatch.setattr(gat, "FORCE_COMPOSITE", True)
    assert not gat.uses_cuda(g, h.detach())


# -- the CUDA path's host side, with the kernels emulated ------------------------------------------
# The launch plans are built from the real source's signatures and called with the real pointers;
# LaunchPlan.__call__ is replaced by a Python emulation of each kernel that reads and writes the
# buffers through those pointers (CPU tensors here).  This checks the host side the GPU runs --
# partitions, slots, merges, tperm, the per-call pointer order, the bound scalars, that every
# output element is written (buffers are NaN-poisoned) -- and the algorithm (batches of G entries
# with a rescaled running sum, lse, dz through the transpose); the kernels' own code runs in
# tests/test_gat_gpu.py.
def _view(ptr, n, dtype):
    import ctypes

    if n == 0:
        return torch.empty(0, dtype=dtype)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_byte * nbytes).from_address(ptr), dtype=dtype)


class _Emulator:
    def __init__(self, n, m, H, C, dtype):
        self.n, self.m, self.H, self.C, self.T = n, m, H, C, dtype
        self.calls = []

    def __call__(self, plan, ptrs, stream):
        import re

        a = {name: v for name, _, v in plan.arguments(ptrs)}
        name = plan.signature.name
        self.calls.append(name)
        mt = re.search(r"_g(\d+)_", name)
        G = int(mt.group(1)) if mt else 32
        kind = re.match(r"gat_(fwd_merge|sum_merge|row_sum|fwd|dot|bwd_col)", name).group(1)
        getattr(self, kind)(a, G)

    def _seg(self, a, pre):
        nseg = a["nseg"]
        sp = _view(a[pre + "seg_ptr"], nseg + 1, torch.int32).tolist()
        return nseg, sp, _view(a[pre + "seg_row"], nseg, torch.int32).tolist(), \
            _view(a[pre + "seg_slot"], nseg, torch.int32).tolist()

    def _common(self, a):
        n, m, H, C, T = self.n, self.m, self.H, self.C, self.T
        assert (a["H"], a["C"]) == (H, C)
        return (_view(a["h"], m * H * C, T).view(m, H, C).double(), _view(a["a_src"], m * H, torch.float32).view(m, H),
                _view(a["a_dst"], n * H, torch.float32).view(n, H))

    def fwd(self, a, G):
        n, H, C, T = self.n, self.H, self.C, self.T
        nseg, sp, srow, sslot = self._seg(a, "")
        ind = _view(a["indices"], sp[-1], torch.int32).tolist()
        h, s, d = self._common(a)
        out = _view(a["out"], n * H * C, T).view(n, H, C)
        lse = _view(a["lse"], n * H, torch.float32).view(n, H)
        ns = max(sslot) + 1
        pa = _view(a["part_acc"], ns * H * C, torch.float32).view(-1, H, C) if ns else None
        pml = _view(a["part_ml"], ns * H * 2, torch.float32).view(-1, H, 2) if ns else None
        for q in range(nseg):
            row, lo, hi = srow[q], sp[q], sp[q + 1]
            for k in range(H):
                mx, lane_l, acc = float("-inf"), torch.zeros(G, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
                for base in range(lo, hi, G):
                    j = ind[base:min(base + G, hi)]
                    z = s[j, k].double() + float(d[row, k])
                    e = torch.where(z > 0, z, z * a["slope"])
                    mn = max(mx, float(e.max()))
                    scale = np.exp(mx - mn)
                    w = torch.exp(e - mn)
                    lane_l = lane_l * scale
                    lane_l[:len(j)] += w
                    acc = acc * scale + (w[:, None] * h[j, k]).sum(0)
                    mx = mn
                ls = float(lane_l.sum())
                if sslot[q] < 0:
                    out[row, k] = (acc / ls if ls > 0 else acc * 0).to(T)
                    lse[row, k] = mx + np.log(ls) if ls > 0 else float("-inf")
                else:
                    pa[sslot[q], k] = acc.float()
                    pml[sslot[q], k] = torch.tensor([mx, ls])

    def _split(self, a):
        ns = a["nsplit"]
        return ns, _view(a["split_ptr"], ns + 1, torch.int32).tolist(), _view(a["split_row"], ns, torch.int32).tolist()

    def fwd_merge(self, a, _):
        n, H, C, T = self.n, self.H, self.C, self.T
        ns, sp, rows = self._split(a)
        pa = _view(a["part_acc"], sp[-1] * H * C, torch.float32).view(-1, H, C).double()
        pml = _view(a["part_ml"], sp[-1] * H * 2, torch.float32).view(-1, H, 2).double()
        out = _view(a["out"], n * H * C, T).view(n, H, C)
        lse = _view(a["lse"], n * H, torch.float32).view(n, H)
        for r in range(ns):
            sl = slice(sp[r], sp[r + 1])
            M = pml[sl, :, 0].amax(0)                                   # H
            wts = torch.exp(pml[sl, :, 0] - M)                          # S x H
            L = (pml[sl, :, 1] * wts).sum(0)
            out[rows[r]] = ((pa[sl] * wts[:, :, None]).sum(0) / L[:, None]).to(T)
            lse[rows[r]] = (M + L.log()).float()

    def dot(self, a, _):
        R, C, T = a["nrows"], a["C"], self.T
        assert R == self.n * self.H and C == self.C
        dout, out = (_view(a[k], R * C, T).view(R, C).double() for k in ("dout", "out"))
        _view(a["D"], R, torch.float32)[:] = (dout * out).sum(1).float()

    def bwd_col(self, a, G):
        n, m, H, C, T = self.n, self.m, self.H, self.C, self.T
        nseg, sp, scol, sslot = self._seg(a, "t")
        nnz = sp[-1]
        t_idx = _view(a["t_idx"], nnz, torch.int32).tolist()
        t_perm = _view(a["t_perm"], nnz, torch.int32).tolist()
        h, s, d = self._common(a)
        lse = _view(a["lse"], n * H, torch.float32).view(n, H).double()
        D = _view(a["D"], n * H, torch.float32).view(n, H).double()
        dout = _view(a["dout"], n * H * C, T).view(n, H, C).double()
        dh = _view(a["dh"], m * H * C, T).view(m, H, C)
        das = _view(a["da_src"], m * H, torch.float32).view(m, H)
        dz = _view(a["dz"], nnz * H, torch.float32).view(nnz, H)
        ns = max(sslot) + 1
        pa = _view(a["part_acc"], ns * H * C, torch.float32).view(-1, H, C) if ns else None
        ps = _view(a["part_s"], ns * H, torch.float32).view(-1, H) if ns else None
        for q in range(nseg):
            j, lo, hi = scol[q], sp[q], sp[q + 1]
            for k in range(H):
                acc, tot = torch.zeros(C, dtype=torch.float64), 0.0
                for p in range(lo, hi):
                    i = t_idx[p]
                    z = float(s[j, k]) + float(d[i, k])
                    zf = 1.0 if z > 0 else a["slope"]
                    alpha = np.exp(z * zf - float(lse[i, k]))
                    acc += alpha * dout[i, k]
                    g = alpha * (float((dout[i, k] * h[j, k]).sum()) - float(D[i, k])) * zf
                    tot += g
                    dz[t_perm[p], k] = g
                if sslot[q] < 0:
                    dh[j, k], das[j, k] = acc.to(T), tot
                else:
                    pa[sslot[q], k], ps[sslot[q], k] = acc.float(), tot

    def sum_merge(self, a, _):
        m, H, C, T = self.m, self.H, self.C, self.T
        ns, sp, cols = self._split(a)
        pa = _view(a["part_acc"], sp[-1] * H * C, torch.float32).view(-1, H, C).double()
        ps = _view(a["part_s"], sp[-1] * H, torch.float32).view(-1, H).double()
        dh = _view(a["dh"], m * H * C, T).view(m, H, C)
        das = _view(a["da_src"], m * H, torch.float32).view(m, H)
        for r in range(ns):
            dh[cols[r]] = pa[sp[r]:sp[r + 1]].sum(0).to(T)
            das[cols[r]] = ps[sp[r]:sp[r + 1]].sum(0).float()

    def row_sum(self, a, _):
        n, H = a["nrows"], a["H"]
        ip = _view(a["indptr"], n + 1, torch.int32).tolist()
        dz = _view(a["dz"], ip[-1] * H, torch.float32).view(-1, H).double()
        out = _view(a["da_dst"], n * H, torch.float32).view(n, H)
        for i in range(n):
            out[i] = dz[ip[i]:ip[i + 1]].sum(0).float()


@pytest.mark.parametrize("H,C,unaligned", [(3, 5, False), (2, 32, False), (2, 32, True), (1, 1, False)])
def test_cuda_host_side_with_emulated_kernels(monkeypatch, H, C, unaligned):
    from spcompile.runtime import cuda as rt

    n, m = 300, 400                # segments hold at most 256 entries (G = 32): both splits happen
    rng = np.random.default_rng(H * 7 + C)
    M = rng.random((n, m)) < 0.01
    M[3, :] = True                 # a row of 400 entries: split into segments (forward merge)
    M[:, 5] = True                 # a column in every row: split in the transposed pass (sum merge)
    M[40, :] = False               # an empty row
    M[:, 77] = False               # a source with no entries
    g = snn.SparseGraph(sp.csr_matrix(M.astype(np.float32)))
    src = gat.render([(0, 1, 1, 1)])
    emu = _Emulator(n, m, H, C, torch.float32)

    def kernels(tn, vec, G, CH, index):
        sfx = gat.instance_suffix(tn, vec, G, CH)
        names = {"fwd": f"gat_fwd_{sfx}", "dot": f"gat_dot_{sfx}", "bwd_col": f"gat_bwd_col_{sfx}",
                 "fwd_merge": "gat_fwd_merge_f32", "sum_merge": "gat_sum_merge_f32", "row_sum": "gat_row_sum"}
        inst = gat.render([(tn, vec, G, CH)])
        assert (vec == 1) == (unaligned or C % 2 == 1)
        return {k: (None, rt.kernel_signature(inst if k != "row_sum" else src, nm)) for k, nm in names.items()}

    monkeypatch.setattr(gat, "_kernels", kernels)
    monkeypatch.setattr(rt.LaunchPlan, "__call__", lambda self, ptrs, stream: emu(self, ptrs, stream))
    monkeypatch.setattr(gat, "_alloc", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype))
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(m * H * C + 1, generator=gen)
    h = (h[1:] if unaligned else h[:-1]).view(m, H, C)
    s, d = torch.randn(m, H, generator=gen), torch.randn(n, H, generator=gen)
    out, lse = gat._launch_forward(g, h, s, d, 0.2, 0)
    ref, ref_lse = gat._composite_forward(g, h, s, d, 0.2)
    assert emu.calls[0].startswith("gat_fwd_") and emu.calls[1] == "gat_fwd_merge_f32"
    assert not torch.isnan(out).any() and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and torch.all(out[40] == 0)
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], rtol=1e-5, atol=1e-6)
    dout = torch.randn(n, H, C, generator=gen)
    emu.calls.clear()
    dh, ds, dd = gat._launch_backward(g, dout, h, s, d, out, lse, 0.2, 0)
    assert [c.split("_")[1] for c in emu.calls] == ["dot", "bwd", "sum", "row"]
    rh, rs, rd = gat._composite_backward(g, dout, h, s, d, out, lse, 0.2, True, True, True)
    for got, want in ((dh, rh), (ds, rs), (dd, rd)):
        assert not torch.isnan(got).any() and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.all(dh[77] == 0) and torch.all(ds[77] == 0)
    # the plans and arrays are built once per graph
    P = gat._plans(g, h.device, torch.float32, H, C, 0.2, gat._vec_max(C, torch.float32, h))
    assert P is gat._plans(g, h.device, torch.float32, H, C, 0.2, gat._vec_max(C, torch.float32, h))
    assert P.arrays.nsplit == 1 and P.arrays.tsplit == 1
