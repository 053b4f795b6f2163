"""State outside the artifact: built CPU modules survive the loss of their library files (the
bytes are kept in memory and written again on demand), TVM CUDA builds leave no temporary
folders, and CPU artifacts record the build host's CPU features, which loading checks."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
import zipfile

import numpy as np
import pytest

import spcompile
from spcompile import ArtifactError
from spcompile.artifact import _manifest_digest
from spcompile.core.config import Config
from spcompile.core.formats import as_csr
from spcompile.core.ir import SparseModule, SparseOp, values_hash
from spcompile.kernels import get_template
from spcompile.module import CompiledModule
from spcompile.runtime import cpu as rt_cpu

from conftest import inputs_for, random_matrix


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cpu-cache"
    monkeypatch.setenv("SPCOMPILE_CPU_CACHE", str(d))
    return d


def test_module_survives_a_cleaned_library_folder(cache, tmp_path):
    A = random_matrix(50, 40, density=0.1, seed=3)
    X = inputs_for("spmm", A.shape, 6)[0]
    mod = spcompile.build(A, "spmm", K=6, reduce="min", target="cpu")
    want = mod(X)
    lib = mod.kernel.files["kernel.so"]
    assert lib.startswith(str(cache)) and os.path.isfile(lib)
    shutil.rmtree(cache)                                   # something cleans the folder
    np.testing.assert_array_equal(mod(X), want)           # the loaded library keeps running
    path = mod.save(str(tmp_path / "m.spc"))              # and saving writes the library again
    np.testing.assert_array_equal(spcompile.load(path, A)(X), want)
    shutil.rmtree(cache)
    again = spcompile.build(A, "spmm", K=6, reduce="min", target="cpu")  # same configuration: cached bytes
    np.testing.assert_array_equal(again(X), want)
    assert os.path.isfile(again.kernel.files["kernel.so"])


def test_loaded_module_saves_after_its_folder_is_gone(cache, tmp_path):
    A = random_matrix(30, 30, density=0.1, seed=4)
    X = inputs_for("spmm", A.shape, 4)[0]
    loaded = spcompile.load(spcompile.build(A, "spmm", K=4, target="cpu", template="cpu.csr_spmm").save(
        str(tmp_path / "a.spc")))
    shutil.rmtree(loaded._tmpdir)
    np.testing.assert_array_equal(spcompile.load(loaded.save(str(tmp_path / "b.spc")))(X), loaded(X))


def test_altered_cached_library_is_rewritten(cache):
    data = b"\x7fELF" + os.urandom(64)
    p = rt_cpu.materialize(data)
    with open(p, "r+b") as f:
        f.write(b"XXXX")
    assert rt_cpu.materialize(data) == p
    with open(p, "rb") as f:
        assert f.read() == data
    assert not [n for n in os.listdir(cache) if n.startswith(".part-")]


def test_library_cache_falls_back_when_home_is_not_writable(monkeypatch, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setenv("SPCOMPILE_CPU_CACHE", str(ro / "sub"))
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    d = rt_cpu.library_cache_dir()
    assert d.startswith(str(tmp_path / "tmp")) and os.path.isdir(d)


def _tvm_cuda_buildable() -> bool:
    return get_template("tvm.cuda_csr_spmm").available()


@pytest.mark.skipif(not _tvm_cuda_buildable(), reason="TVM CUDA codegen or nvcc not available")
def test_tvm_cuda_builds_leave_no_temporary_folders(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("SPCOMPILE_KERNEL_CACHE", str(tmp_path / "kcache"))
    A = random_matrix(40, 30, density=0.1, seed=5)
    for op, reduce, K in (("spmm", "sum", 8), ("spmm", "max", 8), ("sddmm", None, 4)):
        sop = SparseOp(op, reduce, as_csr(A), K, "float32")
        tpl = get_template("tvm.cuda_csr_spmm" if op == "spmm" else "tvm.cuda_csr_sddmm")
        smod = SparseModule.from_op(sop)
        params = tpl.check_params(smod, {})
        kernel = tpl.build(smod, params)
        assert all(os.path.isfile(p) for p in kernel.files.values())
        mod = CompiledModule(sop.key(), Config(tpl.name, params, (), "cuda", tpl.format), kernel, [],
                             values_hash(sop.A))
        mod.save(str(tmp_path / f"{op}{reduce}.spc"))
    assert os.listdir(tmp) == [], os.listdir(tmp)
    assert not glob.glob(str(tmp_path / "kcache" / ".part-*"))


def _reseal_manifest(path, change):
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    man = json.loads(members["manifest.json"])
    change(man)
    man["manifest_sha256"] = _manifest_digest(man)
    members["manifest.json"] = json.dumps(man).encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)


def test_cpu_features_recorded_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("SPCOMPILE_ARTIFACT_KEY", raising=False)
    A = random_matrix(30, 20, density=0.1, seed=6)
    mod = spcompile.build(A, "spmm", K=4, target="cpu", template="cpu.csr_spmm")  # a compiled CPU kernel
    path = mod.save(str(tmp_path / "c.spc"))
    with zipfile.ZipFile(path) as z:
        meta = json.loads(z.read("manifest.json"))["kernel_meta"]
    assert meta["cpu_features"] == rt_cpu.host_cpu_features() and meta["cpu_features"]
    spcompile.load(path)
    _reseal_manifest(path, lambda m: m["kernel_meta"]["cpu_features"].append("avx9000-imaginary"))
    with pytest.raises(ArtifactError, match="features this host lacks.*avx9000-imaginary"):
        spcompile.load(path)
    # a host with fewer features than the build host: refused, not an illegal instruction later
    path2 = mod.save(str(tmp_path / "d.spc"))
    monkeypatch.setattr(rt_cpu, "host_cpu_features", lambda: ["64bit"])
    with pytest.raises(ArtifactError, match="rebuild it on this host"):
        spcompile.load(path2)


def test_artifact_without_feature_record_warns_on_another_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("SPCOMPILE_ARTIFACT_KEY", raising=False)
    A = random_matrix(30, 20, density=0.1, seed=6)
    path = spcompile.build(A, "spmm", K=4, target="cpu", template="cpu.csr_spmm").save(str(tmp_path / "w.spc"))

    def older(m):
        m["kernel_meta"].pop("cpu_features")
        m["kernel_meta"]["llvm_target"]["mcpu"] = "some-other-cpu"

    _reseal_manifest(path, older)
    with pytest.warns(RuntimeWarning, match="some-other-cpu"):
        loaded = spcompile.load(path)
    X = inputs_for("spmm", A.shape, 4)[0]
    np.testing.assert_allclose(loaded(X), np.asarray(A @ X), rtol=1e-5, atol=1e-5)


def test_write_atomically_leaves_the_file_whole_or_untouched(tmp_path, monkeypatch):
    import stat

    from spcompile.runtime import files

    p = tmp_path / "k.bin"
    assert files.write_atomically(str(p), b"old") == str(p)
    assert p.read_bytes() == b"old" and stat.S_IMODE(p.stat().st_mode) == 0o644

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        files.write_atomically(str(p), b"new")
    assert p.read_bytes() == b"old" and sorted(x.name for x in tmp_path.iterdir()) == ["k.bin"]
