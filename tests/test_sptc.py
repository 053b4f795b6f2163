"""sptc.vnm (SOGRE sparse-tensor-core SpMM): the .cu compiles with nvcc for sm_90 and sm_80; the
packed 2:4 tiles (block packing after reorder.vnm + CSR remainder, or window-condensed packing,
2:4 by construction) + metadata + work items reproduce A @ X in float64 (numpy emulation of what
the kernels compute, incl. violating segments, empty rows, a very long row, sizes that are not
multiples of 16/32, split windows); on a GPU the metadata layout is checked on a dense random 2:4
tile and the kernels match the float64 reference with NaN-poisoned outputs."""
import subprocess

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile.core import numerics, reference  # noqa: F401
from spcompile.compile import make_op
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt
from spcompile.runtime import cuda_available
from spcompile.kernels import get_template
from spcompile.kernels.sptc import packer as pk
from spcompile.kernels.sptc import template as sv

from conftest import find_cuobjdump, random_matrix, tool_env

VNM = [{"name": "reorder.vnm", "options": {"V": 1, "N": 2, "M": 4}}]
FMT = [{"name": "format.vnm"}]
RCM = [{"name": "reorder.rcm"}, {"name": "format.vnm"}]
PIPES = {"vnm": VNM, "none": FMT, "rcm": RCM}
TOL = {"fp16": 1e-2, "bf16": 2e-2}


def _mod(A, K, reduce="sum", pipeline=VNM, dtype="float32"):
    return Pipeline(list(pipeline))(SparseModule.from_op(make_op(A, "spmm", K, reduce, dtype=dtype)))


def _fp16_exact(A):
    A = sp.csr_matrix(A, dtype=np.float32, copy=True)
    A.data = A.data.astype(np.float16).astype(np.float32)
    return A


def _dense_24(m, n, seed, full=True):
    """Random matrix whose every 4-column chunk of every row holds exactly 2 (full) or <= 2 entries."""
    rng = np.random.default_rng(seed)
    D = np.zeros((m, n), np.float32)
    for i in range(m):
        for c in range(0, n, 4):
            w = min(4, n - c)
            k = 2 if full else int(rng.integers(0, 3))
            pos = rng.choice(w, size=min(k, w), replace=False)
            D[i, c + pos] = rng.uniform(-2, 2, size=pos.size).astype(np.float16)
    return D


def _violating(m, n, seed):
    """Random sparse matrix with dense rows (many 4-chunks with 3-4 entries) and empty rows."""
    A = random_matrix(m, n, density=0.04, seed=seed).tolil()
    rng = np.random.default_rng(seed)
    for i in rng.choice(m, size=4, replace=False):
        A[i, :] = 0
    for i in rng.choice(m, size=3, replace=False):
        cols = rng.choice(n, size=min(n, 40), replace=False)
        A[i, cols] = rng.standard_normal(cols.size)
    A[:, 0] = 0
    A[1, :min(n, 8)] = 1.5                          # two full 4-chunks in row 1
    return _fp16_exact(A.tocsr())


MATRICES = {
    "violating": lambda: _violating(301, 259, 3),
    "square_graph": lambda: _fp16_exact(sp.csr_matrix((lambda B: B + B.T)(sp.random(333, 333, density=0.02,
                                                                                    random_state=4)))),
    "dense24": lambda: sp.csr_matrix(_dense_24(48, 96, 5)),
    "tiny": lambda: sp.csr_matrix(np.array([[0, 2.0, 0], [0, 0, 0], [1.0, 0, -3.0]], dtype=np.float32)),
    "wide": lambda: _violating(17, 1000, 6),
    "longrow": lambda: _fp16_exact(random_matrix(150, 900, density=0.01, seed=8)),   # row 75 holds every column
}


# ------------------------------------------------------------------------------------------
# CPU
# ------------------------------------------------------------------------------------------
def test_registered_and_pipeline():
    t = get_template("sptc.vnm")
    A = MATRICES["violating"]()
    assert t.requires(_mod(A, 32, pipeline=())) == ("vnm",)
    assert not t.supports(_mod(A, 32, pipeline=()))
    for pipe in t.pipelines(_mod(A, 32, pipeline=())):
        assert t.supports(_mod(A, 32, pipeline=pipe))
    d = t.default_params(_mod(A, 128))
    assert d["precision"] == "fp16" and 8 * d["slabs_per_warp"] * d["warps_per_block"] >= 128
    assert {p["pack"] for p in t.seed_params(_mod(A, 128))} == set(sv.PACKS)


def test_fragment_index_is_a_permutation():
    R, C = sv.fragment_index()
    assert sorted((R * 16 + C).ravel().tolist()) == list(range(256))


@pytest.mark.parametrize("layout", ["split16", "rowwise"])
def test_meta_words_roundtrip(layout):
    rng = np.random.default_rng(0)
    rw = rng.integers(0, 2**32, size=(5, 16), dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(pk._row_words(pk._meta_words(rw, layout), layout), rw)


def test_metadata_nibbles_are_valid_24():
    """Every chunk's nibble is one of the six 2:4 patterns (idx0 < idx1), empty chunks included,
    and single entries at position 3 are moved to slot 1."""
    A = _fp16_exact(sp.csr_matrix(np.array([[0, 0, 0, 5.0, 1, 0, 0, 0] + [0] * 24,
                                            [1.0, 0, 0, 0, 0, 0, 2, 3] + [0] * 24], dtype=np.float32)))
    arr = sv.sptc_arrays(_mod(A, 8, pipeline=()), "fp16")
    rw = pk._row_words(arr["meta"], sv.META_LAYOUT)[0]
    nib = lambda r, j: (int(rw[r]) >> (4 * j)) & 0xF  # noqa: E731
    assert nib(0, 0) == (2 | 3 << 2) and nib(0, 1) == (0 | 3 << 2) and nib(0, 2) == (0 | 1 << 2)
    assert nib(1, 0) == (0 | 3 << 2) and nib(1, 1) == (2 | 3 << 2)
    dense = sv.decode_tiles(arr["frag"], arr["meta"], "fp16")[0]
    assert np.array_equal(dense[:2, :32] * arr["row_scale"][:2, None], A.toarray())


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("pipe", ["none", "vnm", "rcm"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_emulation_reproduces_spmm(name, pipe, reduce):
    A = MATRICES[name]()
    K = 13
    mod = _mod(A, K, reduce, PIPES[pipe])
    rng = np.random.default_rng(1)
    X = rng.standard_normal((A.shape[1], K))
    ref = reference.run("spmm", reduce, as_csr(A), X)
    for prec, pack, split in (("fp16", "block", 0), ("fp16", "condensed", 0), ("fp16", "condensed", 2),
                              ("bf16", "condensed", 8), ("fp16", "block", 1)):
        arr = sv.sptc_arrays(mod, prec, pack=pack, split=split)
        Y = sv.emulate_sptc_spmm(arr, {"m": A.shape[0], "precision": prec}, X)
        assert not np.isnan(Y).any()
        if reduce == "sum" and prec == "fp16":     # values exact in fp16: float64 result exact
            np.testing.assert_allclose(Y, ref, rtol=1e-12, atol=1e-12)
        else:
            assert reference.rel_error(Y, ref) < (1e-3 if prec == "fp16" else 1e-2)
        if pack == "block":  # remainder holds exactly the entries beyond the first two of each 4-chunk
            cur = mod.A
            rows = np.repeat(np.arange(cur.shape[0]), np.diff(cur.indptr))
            _, cnt = np.unique(rows * (cur.shape[1] + 4) + np.asarray(cur.indices) // 4, return_counts=True)
            assert arr["rem_vals"].size == int(np.maximum(cnt - 2, 0).sum())
        else:                # condensed: lossless without any remainder
            assert arr["rem_vals"].size == 0
        _check_items(arr, A.shape[0], split)


def _check_items(arr, m, split):
    """Every tile in exactly one work item, every window in at least one, items of a split window
    atomic and their rows (only those) zeroed first."""
    it = np.asarray(arr["items"], np.int64).reshape(-1, 4)
    wp = np.asarray(arr["win_ptr"], np.int64)
    ntiles = arr["ccol"].size // 32
    cover = np.zeros(ntiles, np.int64)
    for w, b, e, a in it:
        assert wp[w] <= b <= e <= wp[w + 1]
        assert split == 0 or e - b <= split
        cover[b:e] += 1
    assert np.all(cover == 1)
    nwin = wp.size - 1
    cnt = np.bincount(it[:, 0], minlength=nwin)
    assert np.all(cnt >= 1)
    assert np.array_equal(it[:, 3] != 0, cnt[it[:, 0]] > 1)
    zw = np.unique(it[it[:, 3] != 0, 0])
    # split windows numbered 1, 2, ... in window order; zero_rows lists their rows in that order
    # (the fp32 scratch row (number - 1) * 16 + r of a 16-bit build belongs to zero_rows[that])
    num = dict(zip(zw.tolist(), range(1, zw.size + 1)))
    assert all(num[w] == a for w, _, _, a in it if a)
    zr = (zw[:, None] * 16 + np.arange(16)).ravel()
    zr = zr[zr < m]
    assert np.array_equal(arr["zero_rows"], arr["row_ids"][zr])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_condensed_packing_is_24_and_dense(seed):
    """Condensed tiles: valid 2:4 metadata, decoded tiles hold exactly A's window entries at the
    columns ccol names, each X row at most once per window, far fewer tiles than block packing."""
    rng = np.random.default_rng(seed)
    m, n = 97, 3000
    A = sp.random(m, n, density=0.02, random_state=seed, format="csr", dtype=np.float32)
    A = A + sp.csr_matrix((np.ones(40, np.float32), (np.full(40, 5), rng.choice(n, 40, replace=False))),
                          shape=(m, n))                      # a long row
    A = _fp16_exact(A.tocsr())
    mod = _mod(A, 8, "sum", FMT)
    arr = sv.sptc_arrays(mod, "fp16", pack="condensed")
    tiles = sv.decode_tiles(arr["frag"], arr["meta"], "fp16") * 1.0
    ccol = arr["ccol"].reshape(-1, 32)
    wp = arr["win_ptr"]
    D = np.zeros((-(-m // 16) * 16, n))
    for w in range(wp.size - 1):
        for b in range(wp[w], wp[w + 1]):
            used = ccol[b] >= 0
            D[w * 16:(w + 1) * 16][:, ccol[b][used]] += tiles[b][:, used]
            assert not tiles[b][:, ~used].any()
        cw = ccol[wp[w]:wp[w + 1]].ravel()
        cw = cw[cw >= 0]
        assert np.unique(cw).size == cw.size
    D = D[:m] * arr["row_scale"][:, None]
    np.testing.assert_array_equal(D, A.toarray())
    blk = sv.sptc_arrays(mod, "fp16", pack="block")
    assert ccol.shape[0] * 3 < blk["ccol"].size // 32


def test_condense_windows_round_robin_fills_groups():
    """16 rows with one private column each: 4 groups of 4 (one tile of 16 used slots)."""
    rows = np.arange(16)
    slot, nslots = sv.condense_windows(rows, 100 + 7 * rows, 16)
    assert nslots.tolist() == [16] and sorted(slot.tolist()) == list(range(16))
    # one row with 8 columns: at most 2 per group -> 4 groups
    slot, nslots = sv.condense_windows(np.zeros(8, np.int64), np.arange(8), 3)
    assert nslots.tolist() == [16]
    assert np.bincount(slot // 4).max() == 2


def test_reorder_shrinks_remainder():
    A = MATRICES["square_graph"]()
    r0 = sv.sptc_arrays(_mod(A, 8, pipeline=()), "fp16")["rem_vals"].size
    mod = _mod(A, 8)
    r1 = sv.sptc_arrays(mod, "fp16")["rem_vals"].size
    assert r1 <= r0
    assert r1 == 0 or not mod.formats["vnm"]["conforms"]


def test_dense24_has_no_remainder():
    A = MATRICES["dense24"]()
    arr = sv.sptc_arrays(_mod(A, 8, pipeline=()), "fp16")
    assert arr["rem_vals"].size == 0 and arr["ccol"].size // 32 == 3 * 3


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("arch", [90, 80])
def test_cu_compiles(arch):
    """Every variant (precision x slabs per warp x X/Y dtype) and the helper kernels (defined by the
    source itself), in one nvcc call per arch."""
    t = get_template("sptc.vnm")
    inst = [i for dt in sv.ELEMS for prec in sv.precisions_for(dt) for nt in (1, 2, 4, 8)
            for i in t.instances(prec, nt, dt)]
    assert len(inst) == 16
    try:
        t.compile(inst, arch=arch, name="sptc_all")
    except rt.CompileError as e:  # pragma: no cover - the failure message is the point
        pytest.fail(str(e))


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
def test_sass_has_sparse_hmma():
    """The fp16 instance really uses the sparse tensor-core instruction (HMMA.SP in SASS)."""
    import shutil

    cuobjdump = find_cuobjdump()
    if cuobjdump is None:  # under CI=true a skip fails (conftest): .ci/run installs it
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    t = get_template("sptc.vnm")
    path = t.compile(t.instances("fp16", 4), arch=90, name="sptc_sass")
    # cuobjdump runs nvdisasm, found on PATH (the wheels put both in one folder)
    r = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, env=tool_env(cuobjdump))
    assert r.returncode == 0, r.stderr
    sass = r.stdout
    assert "HMMA.SP" in sass or "HMMA.16832.F32.SP" in sass or ".SP" in sass


def test_16bit_workloads_use_their_own_precision():
    """fp16 / bf16 X is used as loaded: the space, defaults and seeds offer only the input's own
    precision, a mismatch is refused with a clear error, the tuner's default policy admits it."""
    from spcompile.core.numerics import allowed_precisions

    t = get_template("sptc.vnm")
    A = MATRICES["violating"]()
    for dt, prec in (("float16", "fp16"), ("bfloat16", "bf16")):
        mod = _mod(A, 64, pipeline=RCM, dtype=dt)
        assert t.supports(mod)
        assert list(t.space(mod)["precision"].choices) == [prec]
        assert {p["precision"] for p in t.seed_params(mod)} == {prec}
        assert any(p["slabs_per_warp"] == 8 for p in t.seed_params(mod))
        other = "bf16" if prec == "fp16" else "fp16"
        with pytest.raises(ValueError, match="precision"):
            t.build(mod, {**t.default_params(mod), "precision": other})
        with pytest.raises(ValueError, match="need precision"):
            t.instances(other, 4, dt)
        assert prec in allowed_precisions("fp32", dt) and prec not in allowed_precisions("fp32")
    assert list(t.space(_mod(A, 64))["precision"].choices) == ["fp16", "bf16"]


def test_build_without_gpu():
    t = get_template("sptc.vnm")
    if not rt.nvcc_available():
        pytest.skip("nvcc not installed")
    mod = _mod(MATRICES["violating"](), 40)
    for p in t.seed_params(mod):
        k = t.build(mod, p)
        assert k.meta["remainder_nnz"] == k.arrays["rem_vals"].size and k.meta["tiles"] > 0
        assert (k.meta["remainder_nnz"] == 0) == (p["pack"] == "condensed" or mod.formats["vnm"]["conforms"])
    mod = _mod(MATRICES["violating"](), 40, dtype="float16")
    k = t.build(mod, t.default_params(mod))
    assert k.meta["dtype"] == "float16" and k.meta["instances"][0][1] == [1, t.default_params(mod)["slabs_per_warp"], 1]


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
def _run(kern, X, m, K):
    import cupy

    out = cupy.full((m, K), np.nan, dtype=cupy.float32)
    rt.call(kern, [cupy.asarray(X)], out)
    return cupy.asnumpy(out)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no CUDA device")
def test_gpu_metadata_layout_dense_tile():
    """One dense random 2:4 tile (16 x 32, every chunk 2 entries): the kernel matches numpy for the
    documented layout; the alternative reading is reported for diagnosis."""
    t = get_template("sptc.vnm")
    A = sp.csr_matrix(_dense_24(16, 32, 11))
    K = 8
    mod = _mod(A, K, pipeline=())
    mod = mod.with_format("vnm", {"V": 1, "N": 2, "M": 4})
    X = np.random.default_rng(2).uniform(-1, 1, (32, K)).astype(np.float16).astype(np.float32)
    ref = A.toarray().astype(np.float64) @ X
    errs = {}
    for layout in ("split16", "rowwise"):
        kern = t.build(mod, {"pack": "block", "warps_per_block": 1, "slabs_per_warp": 1, "split": 0,
                             "precision": "fp16"})
        kern.arrays = {**kern.arrays, **{k: v for k, v in sv.sptc_arrays(mod, "fp16", layout).items()
                                         if k == "meta"}}
        errs[layout] = reference.rel_error(_run(kern, X, 16, K), ref)
    assert errs[sv.META_LAYOUT] < 1e-6, errs


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("K", [1, 13, 64, 128, 256])
def test_gpu_matches_reference(name, K):
    t = get_template("sptc.vnm")
    A = MATRICES[name]()
    rng = np.random.default_rng(K)
    for reduce, pipe in (("sum", "vnm"), ("mean", "rcm"), ("sum", "none")):
        mod = _mod(A, K, reduce, PIPES[pipe])
        for p in t.seed_params(mod):
            kern = t.build(mod, p)
            X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
            out = _run(kern, X, A.shape[0], K)
            assert not np.isnan(out).any(), (name, K, p)
            err = reference.rel_error(out, reference.run("spmm", reduce, as_csr(A), X))
            assert err < TOL[p["precision"]], (name, K, reduce, pipe, p, err)


def _run16(kern, X, m, K, dtype, off=0):
    """Run on a torch tensor of ``dtype`` (optionally a view offset by ``off`` elements: the scalar
    path); NaN-poisoned output; returns float64 numpy."""
    import torch

    tdt = getattr(torch, dtype)
    xb = torch.zeros(X.size + 8, dtype=tdt, device="cuda")
    xb[off:off + X.size] = torch.from_numpy(X.ravel()).to("cuda", tdt)
    ob = torch.full((m * K + 8,), float("nan"), dtype=tdt, device="cuda")
    xv = xb[off:off + X.size].view(X.shape)
    ov = ob[off:off + m * K].view(m, K)
    rt.call(kern, [xv], ov, dtype=dtype)
    torch.cuda.synchronize()
    return ov.double().cpu().numpy()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("K", [1, 13, 64, 128, 256])
def test_gpu_16bit_inputs(dtype, name, K):
    """fp16 / bf16 X and Y: every seed configuration and pipeline, against float64 on the rounded X;
    split windows go through the fp32 scratch, block packing through the 16-bit remainder."""
    pytest.importorskip("torch")
    t = get_template("sptc.vnm")
    A = MATRICES[name]()
    rng = np.random.default_rng(K + 7)
    for reduce, pipe in (("sum", "vnm"), ("mean", "rcm"), ("sum", "none")):
        mod = _mod(A, K, reduce, PIPES[pipe], dtype=dtype)
        for p in t.seed_params(mod):
            kern = t.build(mod, p)
            X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
            out = _run16(kern, X, A.shape[0], K, dtype)
            assert not np.isnan(out).any(), (name, K, p)
            import torch
            Xr = torch.from_numpy(X).to(getattr(torch, dtype)).double().numpy()
            err = reference.rel_error(out, reference.run("spmm", reduce, as_csr(A), Xr))
            assert err < TOL[p["precision"]], (name, K, reduce, pipe, p, err)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no CUDA device")
@pytest.mark.parametrize("K", [5, 64, 130])
def test_gpu_every_variant_16bit(K):
    """fp16 X / Y: every (slabs per warp, warps per block, split) with aligned and misaligned views."""
    pytest.importorskip("torch")
    t = get_template("sptc.vnm")
    A = MATRICES["longrow"]()
    rng = np.random.default_rng(K + 3)
    mod = _mod(A, K, "sum", RCM, dtype="float16")
    for nt in (1, 2, 4, 8):
        for W in (1, 4):
            for split in (0, 1, 3):
                kern = t.build(mod, {"pack": "condensed", "warps_per_block": W, "slabs_per_warp": nt,
                                     "split": split, "precision": "fp16"})
                for off in (0, 1):
                    X = rng.standard_normal((A.shape[1], K)).astype(np.float16).astype(np.float32)
                    out = _run16(kern, X, A.shape[0], K, "float16", off)
                    assert not np.isnan(out).any(), (K, nt, W, split, off)
                    err = reference.rel_error(out, reference.run("spmm", "sum", as_csr(A), X))
                    assert err < TOL["fp16"], (K, nt, W, split, off, err)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="no CUDA device")
@pytest.mark.parametrize("K", [5, 64, 130])
def test_gpu_every_variant(K):
    """Every (slabs per warp, warps per block, split) on one matrix with a long row, unaligned X / Y
    views (offset by one float: the scalar path) and aligned ones."""
    import cupy

    t = get_template("sptc.vnm")
    A = MATRICES["longrow"]()
    rng = np.random.default_rng(K + 1)
    mod = _mod(A, K, "sum", RCM)
    ref = None
    for nt in (1, 2, 4, 8):
        for W in (1, 4):
            for split in (0, 1, 3):
                kern = t.build(mod, {"pack": "condensed", "warps_per_block": W, "slabs_per_warp": nt,
                                     "split": split, "precision": "fp16"})
                for off in (0, 1):
                    X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
                    ref = reference.run("spmm", "sum", as_csr(A), X)
                    xb = cupy.zeros(X.size + 4, cupy.float32)
                    xb[off:off + X.size] = cupy.asarray(X.ravel())
                    ob = cupy.full(A.shape[0] * K + 4, np.nan, cupy.float32)
                    xv = xb[off:off + X.size].reshape(X.shape)
                    ov = ob[off:off + A.shape[0] * K].reshape(A.shape[0], K)
                    rt.call(kern, [xv], ov)
                    out = cupy.asnumpy(ov)
                    assert not np.isnan(out).any(), (K, nt, W, split, off)
                    err = reference.rel_error(out, ref)
                    assert err < TOL["fp16"], (K, nt, W, split, off, err)
