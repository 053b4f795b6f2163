"""Quick selection on a GPU (``build()`` on a database miss): the candidates and cuSPARSE are
built, checked on the first input set and timed over three input sets with one output each; the
kept module is the fastest timed one and computes the float64 result.  Skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.autotune import select
from spcompile.core import reference
from spcompile.runtime import cuda_available

from conftest import dense_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")]


def _matrix(seed, m=700, n=500):
    rng = np.random.default_rng(seed)
    A = sp.random(m, n, density=0.02, format="lil", random_state=seed, dtype=np.float32)
    A[3, :] = 0                                            # an empty row
    A[9, :] = rng.standard_normal(n).astype(np.float32)    # a full row
    return A.tocsr()


@pytest.mark.parametrize("op, K, dtype", [("spmm", 37, "float32"), ("spmm", 1, "float32"),
                                          ("spmm", 64, "float16"), ("sddmm", 40, "float32")])
def test_quick_selection_on_the_gpu(no_tuning_db, timed_sets, op, K, dtype):
    import torch

    A = _matrix(K)
    mod = spcompile.build(A, op, K, target="cuda", dtype=dtype)
    t = mod.tuning
    assert t["source"] == "quick" and set(timed_sets) == {select.N_INPUT_SETS}
    timed = [r for r in t["candidates"] if "kernel_ms" in r]
    assert len(timed) >= 2 and any(r["source"] == "vendor" for r in timed)
    assert t["kernel_ms"] == pytest.approx(min(r["kernel_ms"] for r in timed))
    rng = np.random.default_rng(5)
    tdt = getattr(torch, dtype)
    m, n = A.shape
    if op == "spmm":
        X = torch.from_numpy(rng.standard_normal((n, K)).astype(np.float32)).to(tdt).cuda()
        Y = torch.full((m, K), float("nan"), dtype=tdt, device="cuda")
        mod(X, out=Y)
        ref = A.astype(np.float64) @ X.double().cpu().numpy()
    else:
        X = torch.from_numpy(rng.standard_normal((m, K)).astype(np.float32)).to(tdt).cuda()
        W = torch.from_numpy(rng.standard_normal((n, K)).astype(np.float32)).to(tdt).cuda()
        Y = torch.full((A.nnz,), float("nan"), dtype=tdt, device="cuda")
        mod(X, W, out=Y)
        ref = reference.run("sddmm", None, A, X.double().cpu().numpy(), W.double().cpu().numpy())
    err = reference.rel_error(Y.double().cpu().numpy(), np.asarray(ref, dtype=np.float64))
    assert err < (2e-3 if dtype == "float16" else 1e-5)


def test_quick_selection_inputs_on_the_gpu():
    """Three sets on the GPU, the first one the host set results are checked on; the other two
    drawn on the GPU (timed only), finite and different from it; an output per set."""
    import torch

    from spcompile.compile import make_op

    for dtype in ("float32", "float16", "bfloat16"):
        sop = make_op(_matrix(2), "spmm", 24, "sum", dtype)
        host, ins, outs, to64, upload, rel_err = select._framework_inputs(sop, "cuda")
        assert len(ins) == len(outs) == 3
        assert all(isinstance(x, torch.Tensor) and x.is_cuda and x.dtype == getattr(torch, dtype)
                   and x.shape == (500, 24) for s in ins for x in s)
        assert len({o.data_ptr() for o in outs}) == 3 and all(o.shape == (700, 24) for o in outs)
        assert np.array_equal(ins[0][0].double().cpu().numpy(), host[0].astype(np.float64))
        for s in ins[1:]:
            assert bool(torch.isfinite(s[0]).all()) and not torch.equal(s[0], ins[0][0])
        assert not torch.equal(ins[1][0], ins[2][0])


def test_second_round_on_the_gpu(no_tuning_db):
    """The second round next to the fastest csr.crc_cwm candidate: max_seg one step shorter and
    longer, the two other block shapes and (a 32-lane lead whose full row is cut into slices) the
    block-level combine of the hub row's slices, with and without the next longer max_seg, on its
    pipeline, each built, checked against the reference and timed within the budget; the kept
    module is the fastest timed one and its NaN-poisoned output matches float64."""
    import torch

    from spcompile.compile import make_op
    from spcompile.kernels import get_template

    A = _matrix(11, m=2000, n=1500)
    K = 128
    sop = make_op(A, "spmm", K, "sum", "float32")
    tpl = get_template("csr.crc_cwm")
    from spcompile.core.ir import SparseModule

    p = {**tpl.default_params(SparseModule.from_op(sop)), "max_seg": 64, **tpl.shape_params("u2", 1)}
    deg = [{"name": "reorder.degree", "options": {"descending": True}}]
    lead = tpl.make_config(p, deg, "cuda", "float32")
    mod, info = select.quick_select(sop, "cuda", [(lead, None)], budget_s=30.0, vendor=False)
    rows = info["candidates"]
    probes = [r for r in rows if r["source"] == "probe"]
    assert [r["params"]["max_seg"] for r in probes[:2]] == [32, 256]
    shapes = [r for r in probes[2:] if not r["params"].get("warp_combine")]
    assert {(r["params"]["warps_per_block"], r["params"]["rows_per_warp"], r["params"]["unroll"]) for r in shapes} \
        == {(4, 1, 8), (8, 2, 2)}
    combined = [r["params"] for r in probes if r["params"].get("warp_combine")]
    assert [(q["max_seg"], q["warps_per_block"], q["unroll"]) for q in combined] == [(64, 4, 2), (128, 4, 2)]
    assert len(probes) == 2 + len(shapes) + len(combined)
    assert all(r["pipeline"] == ["reorder.degree"] and "kernel_ms" in r for r in probes)
    assert info["kernel_ms"] == pytest.approx(min(r["kernel_ms"] for r in rows if "kernel_ms" in r))
    X = torch.randn(A.shape[1], K, device="cuda")
    Y = torch.full((A.shape[0], K), float("nan"), device="cuda")
    mod(X, out=Y)
    ref = A.astype(np.float64) @ X.double().cpu().numpy()
    assert reference.rel_error(Y.double().cpu().numpy(), ref) < 1e-5


@pytest.mark.parametrize("K", [1, 40, 96])
def test_build_measures_reuse_candidates_on_the_gpu(no_tuning_db, K):
    """A batch of small dense graphs (32-row windows reusing their columns many times): build()
    builds, checks and times the tensor-core template on condensed windows (split tf32, the
    stored and the RCM order) beside the model's choices, and whatever it keeps computes the
    float64 result at fp32 level (NaN-poisoned output, K=1 and K not a multiple of 32)."""
    import torch
    from spcompile.autotune import knowledge as kn

    A = dense_blocks(seed=K)
    rng = np.random.default_rng(K + 1)
    mod = spcompile.build(A, "spmm", K, target="cuda")
    reuse = [r for r in mod.tuning["candidates"] if r["source"] == "model (row-window reuse)"]
    assert [r["template"] for r in reuse] == [kn.REUSE_TEMPLATE] * 2
    assert all("kernel_ms" in r for r in reuse), reuse            # built, checked and timed
    m, n = A.shape
    X = torch.from_numpy(rng.standard_normal((n, K)).astype(np.float32)).cuda()
    Y = torch.full((m, K), float("nan"), device="cuda")
    mod(X, out=Y)
    ref = A.astype(np.float64) @ X.double().cpu().numpy()
    assert reference.rel_error(Y.double().cpu().numpy(), ref) < 1e-5
