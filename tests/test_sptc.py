"""sptc.vnm (SOGRE sparse-tensor-core SpMM): the .cu compiles with nvcc for sm_90 and sm_80; the
packed 2:4 tiles + metadata + CSR remainder reproduce A @ X in float64 (numpy emulation of what
the kernels compute, incl. violating segments, empty rows, sizes that are not multiples of 16/32,
after reorder.vnm); on a GPU the metadata layout is checked on a dense random 2:4 tile and the
kernels match the float64 reference with NaN-poisoned outputs."""
import subprocess

import numpy as np
import pytest
import scipy.sparse as sp

from spcompile import reference
from spcompile.compiler import make_op
from spcompile.formats import as_csr
from spcompile.ir import SparseModule
from spcompile.passes import Pipeline
from spcompile.runtime import cuda as rt
from spcompile.runtime import cuda_available
from spcompile.schedules import get_template
from spcompile.cuda_templates import sptc_vnm as sv

from conftest import random_matrix

VNM = [{"name": "reorder.vnm", "options": {"V": 1, "N": 2, "M": 4}}]
TOL = {"fp16": 1e-2, "bf16": 2e-2}


def _mod(A, K, reduce="sum", pipeline=VNM):
    return Pipeline(list(pipeline))(SparseModule.from_op(make_op(A, "spmm", K, reduce)))


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


def test_fragment_index_is_a_permutation():
    R, C = sv.fragment_index()
    assert sorted((R * 16 + C).ravel().tolist()) == list(range(256))


@pytest.mark.parametrize("layout", ["split16", "rowwise"])
def test_meta_words_roundtrip(layout):
    rng = np.random.default_rng(0)
    rw = rng.integers(0, 2**32, size=(5, 16), dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(sv._row_words(sv._meta_words(rw, layout), layout), rw)


def test_metadata_nibbles_are_valid_24():
    """Every chunk's nibble is one of the six 2:4 patterns (idx0 < idx1), empty chunks included,
    and single entries at position 3 are moved to slot 1."""
    A = _fp16_exact(sp.csr_matrix(np.array([[0, 0, 0, 5.0, 1, 0, 0, 0] + [0] * 24,
                                            [1.0, 0, 0, 0, 0, 0, 2, 3] + [0] * 24], dtype=np.float32)))
    arr = sv.sptc_arrays(_mod(A, 8, pipeline=()), "fp16")
    rw = sv._row_words(arr["meta"], sv.META_LAYOUT)[0]
    nib = lambda r, j: (int(rw[r]) >> (4 * j)) & 0xF  # noqa: E731
    assert nib(0, 0) == (2 | 3 << 2) and nib(0, 1) == (0 | 3 << 2) and nib(0, 2) == (0 | 1 << 2)
    assert nib(1, 0) == (0 | 3 << 2) and nib(1, 1) == (2 | 3 << 2)
    dense = sv.decode_tiles(arr["frag"], arr["meta"], "fp16")[0]
    assert np.array_equal(dense[:2, :32] * arr["row_scale"][:2, None], A.toarray())
    dense2 = sv.decode_tiles(None, arr["meta"], "fp16", nz_ptr=arr["nz_ptr"], nz=arr["nz"])[0]
    assert np.array_equal(dense, dense2)


@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("pipe", ["none", "vnm"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_emulation_reproduces_spmm(name, pipe, reduce):
    A = MATRICES[name]()
    K = 13
    mod = _mod(A, K, reduce, VNM if pipe == "vnm" else ())
    rng = np.random.default_rng(1)
    X = rng.standard_normal((A.shape[1], K))
    for prec, dense in (("fp16", 1), ("fp16", 0), ("bf16", 1)):
        arr = sv.sptc_arrays(mod, prec)
        for k in (("nz_ptr", "nz") if dense else ("frag",)):
            del arr[k]
        Y = sv.emulate_sptc_spmm(arr, {"m": A.shape[0], "precision": prec}, X)
        ref = reference.run("spmm", reduce, as_csr(A), X)
        if reduce == "sum" and prec == "fp16":     # values exact in fp16: float64 result exact
            np.testing.assert_allclose(Y, ref, rtol=1e-12, atol=1e-12)
        else:
            assert reference.rel_error(Y, ref) < (1e-3 if prec == "fp16" else 1e-2)
        # remainder holds exactly the entries beyond the first two of each 4-chunk
        cur = mod.A
        rows = np.repeat(np.arange(cur.shape[0]), np.diff(cur.indptr))
        _, cnt = np.unique(rows * (cur.shape[1] + 4) + np.asarray(cur.indices) // 4, return_counts=True)
        assert arr["rem_vals"].size == int(np.maximum(cnt - 2, 0).sum())


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
    assert arr["rem_vals"].size == 0 and arr["tinfo"].size // 2 == 3 * 3


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("arch", [90, 80])
def test_cu_compiles(arch):
    t = get_template("sptc.vnm")
    for prec in sv.PRECISIONS:
        for nt, d in ((1, 0), (2, 1), (4, 0), (4, 1), (8, 0)):
            inst = t.instances(prec, nt, d)
            try:
                t.compile(inst + [("sptc_remainder_kernel", ())], arch=arch, name=inst[0][0])
            except rt.CompileError as e:  # pragma: no cover - the failure message is the point
                pytest.fail(str(e))


@pytest.mark.skipif(not rt.nvcc_available(), reason="nvcc not installed")
def test_sass_has_sparse_hmma():
    """The fp16 instance really uses the sparse tensor-core instruction (HMMA.SP in SASS)."""
    import shutil

    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not installed")
    t = get_template("sptc.vnm")
    path = t.compile(t.instances("fp16", 4, 0), arch=90, name="sptc_sass")
    sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
    assert "HMMA.SP" in sass or "HMMA.16832.F32.SP" in sass or ".SP" in sass


def test_build_without_gpu():
    t = get_template("sptc.vnm")
    if not rt.nvcc_available():
        pytest.skip("nvcc not installed")
    mod = _mod(MATRICES["violating"](), 40)
    k = t.build(mod, t.default_params(mod))
    assert k.meta["remainder_nnz"] == k.arrays["rem_vals"].size and k.meta["tiles"] > 0


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
def _run(kern, X, m, K):
    import cupy

    out = cupy.full((m, K), np.nan, dtype=cupy.float32)
    rt.call(kern, "cupy", [cupy.asarray(X)], out, out.shape)
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
        kern = t.build(mod, {"warps_per_block": 1, "slabs_per_warp": 1, "dense_a": 1, "precision": "fp16"})
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
    for reduce in ("sum", "mean"):
        mod = _mod(A, K, reduce)
        for p in t.seed_params(mod):
            kern = t.build(mod, p)
            X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
            out = _run(kern, X, A.shape[0], K)
            assert not np.isnan(out).any(), (name, K, p)
            err = reference.rel_error(out, reference.run("spmm", reduce, as_csr(A), X))
            assert err < TOL[p["precision"]], (name, K, reduce, p, err)
