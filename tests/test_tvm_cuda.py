"""TVM TensorIR CUDA templates (``tvm.cuda_csr_spmm`` / ``tvm.cuda_csr_sddmm``).

Without a GPU (CI): TVM lowers every case to CUDA source, nvcc compiles it to a fatbin for
sm_90 and the saved artifact carries that binary (plus the CUDA source), loadable without TVM.
With a GPU: results against the float64 reference for every reduce and K in {1, 3, 64, 100}.
Where the GPU machine has no TVM compiler, the GPU tests use artifacts prebuilt elsewhere::

    python tests/test_tvm_cuda.py prebuild DIR          # here (TVM + nvcc)
    SPCOMPILE_TVM_CUDA_ARTIFACTS=DIR pytest tests/test_tvm_cuda.py -m gpu   # on the GPU machine

``python tests/test_tvm_cuda.py bench DIR`` (GPU machine) times the prebuilt kernels against
``torch.sparse.mm`` / ``torch.sparse.sampled_addmm`` on a few graphs of $SPCOMPILE_GRAPHS.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zipfile

import numpy as np
import pytest

from conftest import check_result, find_cuobjdump, inputs_for, random_matrix, tool_env  # noqa: E402

import spcompile  # noqa: E402
from spcompile.core.formats import as_csr  # noqa: E402
from spcompile.core.ir import SparseModule, SparseOp, values_hash  # noqa: E402
from spcompile.core.config import Config  # noqa: E402
from spcompile.module import CompiledModule  # noqa: E402
from spcompile.runtime import cuda as rt  # noqa: E402
from spcompile.runtime.target import cuda_available  # noqa: E402
from spcompile.kernels import get_template  # noqa: E402

SPMM, SDDMM = "tvm.cuda_csr_spmm", "tvm.cuda_csr_sddmm"
KS = (1, 3, 64, 100)
REDUCES = ("sum", "max", "min", "mean")
CASES = [("spmm", r, K) for K in KS for r in REDUCES] + [("sddmm", None, K) for K in KS]
ART_ENV = "SPCOMPILE_TVM_CUDA_ARTIFACTS"


def _can_build() -> bool:
    return get_template(SPMM).available()


needs_build = pytest.mark.skipif(not _can_build(), reason="TVM CUDA codegen or nvcc not available")


def _matrix():
    return random_matrix(120, 90, density=0.04, seed=7)  # empty rows (first, last) and a full row


def _module(A, op, reduce, K, params=None) -> CompiledModule:
    """Build a module for target 'cuda' without needing a GPU (the kernel loads lazily)."""
    sop = SparseOp(op, reduce, as_csr(A), K, "float32")
    tpl = get_template(SPMM if op == "spmm" else SDDMM)
    mod = SparseModule.from_op(sop)
    params = tpl.check_params(mod, params or {})
    kernel = tpl.build(mod, params)
    return CompiledModule(sop.key(), Config(tpl.name, params, (), "cuda", tpl.format), kernel, [],
                          values_hash(sop.A))


def _case_name(op, reduce, K) -> str:
    return f"{op}_{reduce or 'dot'}_K{K}"


# -- CPU / CI: TVM -> CUDA source -> cubin, artifact payload ---------------------------------------

@needs_build
@pytest.mark.parametrize("op,reduce,K", CASES, ids=[_case_name(*c) for c in CASES])
def test_compiles_to_cubin_and_artifact(tmp_path, op, reduce, K):
    A = _matrix()
    m = _module(A, op, reduce, K)
    kern = m.kernel
    assert set(kern.files) == {"kernel.fatbin", "kernel.cu"}
    blob = open(kern.files["kernel.fatbin"], "rb").read()
    assert blob[:4] == b"\x50\xed\x55\xba", "not a CUDA fatbin"  # fatbin magic
    assert kern.meta["arch"] == rt.device_arch()
    src = open(kern.files["kernel.cu"]).read()
    assert 'extern "C" __global__' in src and kern.meta["kernels"][0]["name"] in src
    if kern.meta["vec"] > 1:  # the tuned variant loads vectors; the fallback does not
        assert "float%d" % kern.meta["vec"] in src and len(kern.meta["kernels"]) == 2
    # every kernel parameter is bound by the launcher
    binds = set(kern.meta["scalars"]) | {f"{a}_ptr" for a in (*kern.meta["array_order"], *kern.meta["inputs"],
                                                              kern.meta["output"])}
    for k in kern.meta["kernels"]:
        assert set(k["params"]) <= binds, k["params"]
    # the artifact holds the device binary; loading it compiles nothing and needs no TVM
    path = m.save(str(tmp_path / "mod.spc"))
    names = set(zipfile.ZipFile(path).namelist())
    assert {"manifest.json", "arrays.npz", "kernel.fatbin", "kernel.cu"} <= names
    man = json.loads(zipfile.ZipFile(path).read("manifest.json"))
    assert man["config"]["template"] == kern.template and man["config"]["target"] == "cuda"
    loaded = spcompile.load(path, A)
    assert loaded.kernel.meta["kernels"] == kern.meta["kernels"]
    assert open(loaded.kernel.files["kernel.fatbin"], "rb").read() == blob
    assert not loaded.kernel._ready  # nothing touched a GPU yet


@needs_build
def test_cubin_sass_for_sm90(tmp_path):
    """The binary holds sm_90 machine code (not only PTX): it loads without any JIT/compiler."""
    import subprocess

    tool = find_cuobjdump()
    if tool is None:  # under CI=true a skip fails (conftest): .ci/run installs it
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    m = _module(_matrix(), "spmm", "sum", 64)
    out = subprocess.run([tool, "--list-elf", m.kernel.files["kernel.fatbin"]], capture_output=True, text=True,
                         env=tool_env(tool))
    assert "sm_90" in out.stdout, out.stdout + out.stderr


@needs_build
def test_space_and_params():
    from optuna.distributions import CategoricalDistribution

    A = _matrix()
    for K in KS:
        mod = SparseModule.from_op(SparseOp("spmm", "sum", as_csr(A), K, "float32"))
        tpl = get_template(SPMM)
        space = tpl.space(mod)
        assert all(isinstance(d, CategoricalDistribution) for d in space.values())
        assert all(K % v == 0 for v in space["vec"].choices)
        p = tpl.default_params(mod)
        assert set(p) == set(space) and tpl.check_params(mod, p) == p
    mod = SparseModule.from_op(SparseOp("spmm", "sum", as_csr(A), 3, "float32"))
    with pytest.raises(ValueError):
        get_template(SPMM).check_params(mod, {"vec": 2})
    with pytest.raises(ValueError):
        get_template(SPMM).check_params(mod, {"threads_k": 3})
    with pytest.raises(ValueError):
        get_template(SPMM).check_params(mod, {"bogus": 1})


@needs_build
def test_other_params_compile():
    A = _matrix()
    for params in ({"rows_per_block": 1, "threads_k": 32, "vec": 1, "nnz_unroll": 1},
                   {"rows_per_block": 16, "threads_k": 8, "vec": 2, "nnz_unroll": 4}):
        _module(A, "spmm", "max", 100, params)
    _module(A, "sddmm", None, 64, {"rows_per_block": 2, "threads_k": 8, "vec": 2})


# -- GPU: correctness ----------------------------------------------------------------------------

def _gpu_module(tmp_dir, op, reduce, K, params=None):
    """Built here when TVM + nvcc are present, else loaded from the prebuilt artifact folder."""
    A = _matrix()
    if _can_build():
        return A, _module(A, op, reduce, K, params)
    d = os.environ.get(ART_ENV)
    if not d:
        pytest.skip(f"no TVM compiler here and ${ART_ENV} not set")
    return A, spcompile.load(os.path.join(d, _case_name(op, reduce, K) + ".spc"), A)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op,reduce,K", CASES, ids=[_case_name(*c) for c in CASES])
def test_gpu_correct(tmp_path, op, reduce, K):
    import cupy

    A, m = _gpu_module(tmp_path, op, reduce, K)
    inputs = inputs_for(op, A.shape, K)
    out = m(*inputs)                                       # numpy in, numpy out
    check_result(out, A, op, reduce, inputs)
    dev = [cupy.asarray(x) for x in inputs]                # cupy in place, no host copy
    check_result(cupy.asnumpy(m(*dev)), A, op, reduce, inputs)
    if K % 2 == 0:                                         # misaligned views use the vec=1 kernel
        shifted = []
        for x in inputs:
            buf = cupy.empty(x.size + 1, dtype=cupy.float32)
            v = buf[1:].reshape(x.shape)
            v[...] = cupy.asarray(x)
            shifted.append(v)
        check_result(cupy.asnumpy(m(*shifted)), A, op, reduce, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_gpu_torch_inputs():
    torch = pytest.importorskip("torch")
    A, m = _gpu_module(None, "spmm", "mean", 64)
    (X,) = inputs_for("spmm", A.shape, 64)
    out = m(torch.from_numpy(X).cuda())
    assert out.is_cuda
    check_result(out.cpu().numpy(), A, "spmm", "mean", (X,))


# -- helpers run as a script: prebuild artifacts here, benchmark on the GPU machine ---------------

BENCH_GRAPHS = ("cora", "pubmed", "amazon_computers", "snap_sx_askubuntu", "fb100_cornell5")
BENCH_KS = (32, 64, 128)
BENCH_SPMM_PARAMS = [
    {"rows_per_block": 4, "threads_k": 32, "vec": 1, "nnz_unroll": 2},
    {"rows_per_block": 8, "threads_k": 16, "vec": 2, "nnz_unroll": 2},
    {"rows_per_block": 16, "threads_k": 8, "vec": 4, "nnz_unroll": 2},
    {"rows_per_block": 16, "threads_k": 8, "vec": 4, "nnz_unroll": 4},
    {"rows_per_block": 8, "threads_k": 16, "vec": 4, "nnz_unroll": 1},
]
BENCH_SDDMM_PARAMS = [
    {"rows_per_block": 4, "threads_k": 32, "vec": 1},
    {"rows_per_block": 8, "threads_k": 16, "vec": 4},
    {"rows_per_block": 16, "threads_k": 8, "vec": 4},
]


def _prebuild(out_dir: str) -> None:
    """Correctness artifacts (one per test case, small matrix) plus the bench kernels (binaries and
    launch metadata only: the matrix arrays are rebuilt on the GPU machine from the graph files)."""
    os.makedirs(out_dir, exist_ok=True)
    A = _matrix()
    for op, reduce, K in CASES:
        _module(A, op, reduce, K).save(os.path.join(out_dir, _case_name(op, reduce, K) + ".spc"))
    bench = []
    tiny = random_matrix(40, 40, density=0.1, seed=3)
    for K in BENCH_KS:
        for op, plist in (("spmm", BENCH_SPMM_PARAMS), ("sddmm", BENCH_SDDMM_PARAMS)):
            for i, p in enumerate(plist):
                if K % p["vec"]:
                    continue
                kern = _module(tiny, op, "sum" if op == "spmm" else None, K, p).kernel
                name = f"bench_{op}_K{K}_{i}.fatbin"
                with open(kern.files["kernel.fatbin"], "rb") as f, open(os.path.join(out_dir, name), "wb") as g:
                    g.write(f.read())
                bench.append({"op": op, "K": K, "params": kern.params, "meta": kern.meta, "fatbin": name,
                              "template": kern.template})
    # a graph-sized artifact to time spcompile.load() + first call on the GPU machine
    import conftest

    try:
        cora = conftest.load_graph("cora")
        _module(cora, "spmm", "sum", 64).save(os.path.join(out_dir, "cora_spmm_sum_K64.spc"))
    except BaseException:  # graph set absent here: skip that artifact
        pass
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(bench, f, indent=1)


def _bench(art_dir: str) -> None:
    import cupy
    import torch

    import conftest
    from spcompile.kernels.base import csr_kernel_arrays

    def timeit(fn, reps=50):
        for _ in range(5):
            fn()
        cupy.cuda.runtime.deviceSynchronize()
        flush = cupy.empty(64 << 20, dtype=cupy.uint8)  # 64 MiB > L2: evict between repeats
        ts = []
        for _ in range(reps):
            flush.fill(0)
            s, e = cupy.cuda.Event(), cupy.cuda.Event()
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(s, e) * 1e3)
        return float(np.median(ts))

    p = os.path.join(art_dir, "cora_spmm_sum_K64.spc")
    if os.path.exists(p):
        A = conftest.load_graph("cora")
        t0 = time.perf_counter()
        mod = spcompile.load(p, A)
        t1 = time.perf_counter()
        X = cupy.asarray(np.random.default_rng(0).standard_normal((A.shape[1], 64), dtype=np.float32))
        Y = mod(X)
        cupy.cuda.runtime.deviceSynchronize()
        t2 = time.perf_counter()
        check_result(cupy.asnumpy(Y), A, "spmm", "sum", (cupy.asnumpy(X),))
        print(f"LOAD cora artifact: spcompile.load {1e3 * (t1 - t0):.1f} ms, first call (module load + "
              f"upload + launch) {1e3 * (t2 - t1):.1f} ms, size {os.path.getsize(p) / 1e6:.2f} MB")

    bench = json.load(open(os.path.join(art_dir, "bench.json")))
    rng = np.random.default_rng(0)
    for g in BENCH_GRAPHS:
        try:
            A = conftest.load_graph(g)
        except BaseException:
            continue
        C = as_csr(A)
        tA = torch.sparse_csr_tensor(torch.from_numpy(C.indptr.astype(np.int64)),
                                     torch.from_numpy(C.indices.astype(np.int64)),
                                     torch.from_numpy(C.data.astype(np.float32)), size=C.shape, device="cuda")
        for K in BENCH_KS:
            X = torch.from_numpy(rng.standard_normal((C.shape[1], K), dtype=np.float32)).cuda()
            Xm = torch.from_numpy(rng.standard_normal((C.shape[0], K), dtype=np.float32)).cuda()
            t_mm = timeit(lambda: torch.sparse.mm(tA, X))
            try:
                t_sa = timeit(lambda: torch.sparse.sampled_addmm(tA, Xm, X.T, beta=0.0))
            except Exception:
                t_sa = float("nan")
            for rec in bench:
                if rec["K"] != K:
                    continue
                op = rec["op"]
                sop = SparseOp(op, "sum" if op == "spmm" else None, C, K, "float32")
                smod = SparseModule.from_op(sop)
                arrays = {k: v for k, v in csr_kernel_arrays(smod).items() if k in rec["meta"]["array_order"]}
                meta = dict(rec["meta"])
                meta["m"] = int(C.shape[0])
                meta["scalars"] = {k: int(v) for k, v in {"m": C.shape[0], "n": C.shape[1], "nnz": C.nnz,
                                                           "mx": C.shape[0]}.items() if k in meta["scalars"]}
                tpl = get_template(rec["template"])
                kern = tpl.load(rec["params"], arrays, {"kernel.fatbin": os.path.join(art_dir, rec["fatbin"])}, meta)
                from spcompile.runtime import cuda as rt

                inputs = (X,) if op == "spmm" else (Xm, X)
                out = torch.empty((C.shape[0], K) if op == "spmm" else (C.nnz,), device="cuda")
                rt.call(kern, inputs, out)
                got = out.cpu().numpy()
                ins = tuple(x.cpu().numpy() for x in inputs)
                if op == "spmm":
                    ref = (tA @ X).cpu().numpy()
                else:
                    ref = C.data * np.einsum("ij,ij->i", ins[0][C.row_ids], ins[1][C.indices])
                err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
                t = timeit(lambda: rt.call(kern, inputs, out))
                base = t_mm if op == "spmm" else t_sa
                print(f"BENCH {g} m={C.shape[0]} nnz={C.nnz} K={K} {op} params={rec['params']} "
                      f"tvm={t:.1f}us torch={base:.1f}us speedup={base / t:.2f} relerr={err:.1e}")


if __name__ == "__main__":
    cmd, d = sys.argv[1], sys.argv[2]
    if cmd == "prebuild":
        _prebuild(d)
    elif cmd == "bench":
        _bench(d)
    else:
        raise SystemExit(f"unknown command {cmd!r}: prebuild DIR | bench DIR")
