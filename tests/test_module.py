"""CompiledModule artifacts: save/load round trips (directory and single file), the manifest's
contents, and clean refusals: tampered files, wrong versions, another matrix, pickled arrays."""
from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import zipfile

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile import ArtifactError
from spcompile.artifact import _manifest_digest

from conftest import check_result, inputs_for, random_matrix

pytestmark = pytest.mark.usefixtures("no_tuning_db")


@pytest.fixture(scope="module")
def matrix():
    return random_matrix(80, 60, density=0.05, seed=21)


@pytest.fixture(scope="module")
def spmm_mod(matrix):
    # a reordering pipeline, so that the permutations must survive the round trip too
    return spcompile.build(matrix, "spmm", K=5, reduce="max", target="cpu",
                           pipeline=["reorder.rcm", "reorder.degree"])


@pytest.fixture(scope="module")
def sddmm_mod(matrix):
    return spcompile.build(matrix, "sddmm", K=6, target="cpu", pipeline=["reorder.degree"])


@pytest.fixture(scope="module")
def saved(spmm_mod, tmp_path_factory):
    """The spmm module saved once as a directory and once as a single file (read-only originals)."""
    d = tmp_path_factory.mktemp("saved")
    return {"dir": spmm_mod.save(str(d / "mod_dir"), as_dir=True), "file": spmm_mod.save(str(d / "mod.spc"))}


def copy_artifact(src: str, dst) -> str:
    dst = str(dst)
    if os.path.isdir(src):
        os.makedirs(dst)
        for n in os.listdir(src):
            with open(os.path.join(src, n), "rb") as f, open(os.path.join(dst, n), "wb") as g:
                g.write(f.read())
    else:
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())
    return dst


def read_members(path: str) -> dict[str, bytes]:
    if os.path.isdir(path):
        out = {}
        for n in os.listdir(path):
            with open(os.path.join(path, n), "rb") as f:
                out[n] = f.read()
        return out
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def write_members(path: str, members: dict[str, bytes]):
    if os.path.isdir(path):
        for n in os.listdir(path):
            os.remove(os.path.join(path, n))
        for n, b in members.items():
            with open(os.path.join(path, n), "wb") as f:
                f.write(b)
    else:
        with zipfile.ZipFile(path, "w") as z:
            for n, b in members.items():
                z.writestr(n, b)


def edit_manifest(path: str, change, *, reseal: bool):
    """Apply ``change(manifest_dict)``; ``reseal`` recomputes every checksum (a consistent forgery)."""
    members = read_members(path)
    man = json.loads(members["manifest.json"])
    change(man)
    if reseal:
        man["files"] = {n: hashlib.sha256(members[n]).hexdigest() for n in man["files"] if n in members}
        man["sizes"] = {n: len(members[n]) for n in man["files"]}
        man["manifest_sha256"] = _manifest_digest(man)
    members["manifest.json"] = json.dumps(man).encode()
    write_members(path, members)


# -- round trips -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dir", "file"])
def test_round_trip(spmm_mod, saved, matrix, kind):
    path = saved[kind]
    assert os.path.isdir(path) == (kind == "dir")
    if kind == "file":
        assert zipfile.is_zipfile(path)
    loaded = spcompile.load(path)
    X = inputs_for("spmm", matrix.shape, 5)[0]
    np.testing.assert_array_equal(loaded(X), spmm_mod(X))
    check_result(loaded(X), matrix, "spmm", "max", (X,))
    assert loaded.key == spmm_mod.key
    assert loaded.config == spmm_mod.config
    assert [r["name"] for r in loaded.pass_log] == ["reorder.rcm", "reorder.degree"]
    assert loaded.values_hash == spmm_mod.values_hash
    # the same matrix in another input form is accepted
    again = spcompile.load(path, A=matrix.tocoo())
    np.testing.assert_array_equal(again(X), spmm_mod(X))
    assert isinstance(spcompile.CompiledModule.load(path), spcompile.CompiledModule)


def test_sddmm_round_trip_and_artifact_outlives_source(sddmm_mod, matrix, tmp_path):
    path = sddmm_mod.save(str(tmp_path / "s.spc"))
    loaded = spcompile.load(path, A=matrix)
    os.remove(path)  # the loaded module keeps its own copy of the kernel library
    X, Y = inputs_for("sddmm", matrix.shape, 6)
    np.testing.assert_array_equal(loaded(X, Y), sddmm_mod(X, Y))
    check_result(loaded(X, Y), matrix, "sddmm", None, (X, Y))


def test_extracted_files_removed_with_module(spmm_mod, saved):
    loaded = spcompile.load(saved["file"])
    workdir = loaded._tmpdir
    assert os.path.isdir(workdir)
    del loaded
    gc.collect()
    assert not os.path.exists(workdir)


def test_save_to_directory_with_trailing_separator_and_overwrite(spmm_mod, matrix, tmp_path):
    p = str(tmp_path / "d") + os.sep
    spmm_mod.save(p)
    assert os.path.isfile(os.path.join(p, "manifest.json"))
    f = str(tmp_path / "m.spc")
    spmm_mod.save(f)
    spmm_mod.save(f)  # overwriting an artifact is atomic and leaves no temporary files behind
    assert sorted(os.listdir(tmp_path)) == ["d", "m.spc"]
    spcompile.load(f, A=matrix)


def test_empty_matrix_round_trip(tmp_path):
    mod = spcompile.build(sp.csr_matrix((4, 3), dtype=np.float32), "spmm", K=2, reduce="min", target="cpu")
    loaded = spcompile.load(mod.save(str(tmp_path / "e.spc")))
    out = loaded(np.ones((3, 2), np.float32))
    assert out.shape == (4, 2) and np.all(out == 0)


def test_manifest_contents(spmm_mod, saved):
    members = read_members(saved["dir"])
    assert set(members) == {"manifest.json", "arrays.npz", "kernel.so"}
    man = json.loads(members["manifest.json"])
    import tvm

    assert man["format"] == "spcompile-artifact" and man["format_version"] == 1
    assert man["spcompile_version"] == spcompile.__version__
    assert man["tvm_version"] == tvm.__version__
    assert (man["op"], man["reduce"], man["shape"], man["K"], man["dtype"]) == ("spmm", "max", [80, 60], 5, "float32")
    assert man["workload_key"]["pattern"] == spmm_mod.key.pattern
    assert man["config"]["template"] == "cpu.csr_spmm"
    assert [p["name"] for p in man["config"]["pipeline"]] == ["reorder.rcm", "reorder.degree"]
    for name in ("arrays.npz", "kernel.so"):
        assert man["files"][name] == hashlib.sha256(members[name]).hexdigest()
    assert man["manifest_sha256"] == _manifest_digest(man)
    # arrays are plain numeric arrays, readable without pickle
    with np.load(io.BytesIO(members["arrays.npz"]), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    assert {"indptr", "indices", "data", "row_ids"} <= set(arrays)
    assert all(a.dtype != object for a in arrays.values())
    assert sorted(arrays["row_ids"].tolist()) == list(range(80))  # the row permutation, as an array


# -- refusals ---------------------------------------------------------------------------------------

def _flip_byte(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos % len(b)] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("kind", ["dir", "file"])
@pytest.mark.parametrize("member", ["kernel.so", "arrays.npz"])
def test_tampered_file_is_refused(saved, tmp_path, kind, member):
    path = copy_artifact(saved[kind], tmp_path / "a")
    members = read_members(path)
    members[member] = _flip_byte(members[member], len(members[member]) // 2)
    write_members(path, members)
    with pytest.raises(ArtifactError, match=f"checksum mismatch for '{member}'"):
        spcompile.load(path)


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_tampered_manifest_is_refused(saved, tmp_path, kind):
    path = copy_artifact(saved[kind], tmp_path / "a")

    def bigger_K(man):
        man["workload_key"]["K"] = 8
        man["K"] = 8

    edit_manifest(path, bigger_K, reseal=False)
    with pytest.raises(ArtifactError, match="manifest.json"):
        spcompile.load(path)


def test_missing_and_foreign_files(saved, tmp_path):
    path = copy_artifact(saved["dir"], tmp_path / "a")
    os.remove(os.path.join(path, "kernel.so"))
    with pytest.raises(ArtifactError, match="missing 'kernel.so'"):
        spcompile.load(path)
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(ArtifactError, match="missing 'manifest.json'"):
        spcompile.load(path)
    junk = tmp_path / "junk.spc"
    junk.write_bytes(b"not an artifact at all")
    with pytest.raises(ArtifactError, match="not a spcompile artifact"):
        spcompile.load(str(junk))
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("manifest.json", json.dumps({"format": "something-else"}))
    with pytest.raises(ArtifactError, match="not a spcompile artifact"):
        spcompile.load(str(other))
    bad_json = copy_artifact(saved["file"], tmp_path / "badjson.spc")
    members = read_members(bad_json)
    members["manifest.json"] = b"{not json"
    write_members(bad_json, members)
    with pytest.raises(ArtifactError, match="not valid JSON"):
        spcompile.load(bad_json)
    with pytest.raises(FileNotFoundError):
        spcompile.load(str(tmp_path / "does-not-exist.spc"))


VERSION_EDITS = [
    ("spcompile major", lambda m: m.update(spcompile_version="9.0.0"), "spcompile 9.0.0, incompatible"),
    ("spcompile minor", lambda m: m.update(spcompile_version="0.99.0"), "incompatible"),
    ("format version", lambda m: m.update(format_version=2), "format version 2 is not supported"),
    ("tvm version", lambda m: m.update(tvm_version="0.1.0"), "TVM 0.1.0"),
    ("template version", lambda m: m["template"].update(version="999"), "another version of template"),
    ("template source", lambda m: m["template"].update(source_hash="0" * 16), "another version of template"),
    ("unknown template", lambda m: m["config"].update(template="gone.template"), "unknown to this spcompile"),
]


@pytest.mark.parametrize("change,match", [e[1:] for e in VERSION_EDITS], ids=[e[0] for e in VERSION_EDITS])
def test_incompatible_artifact_is_refused(saved, tmp_path, change, match):
    # resealed: the artifact is intact, it is just from another version
    path = copy_artifact(saved["file"], tmp_path / "v.spc")
    edit_manifest(path, change, reseal=True)
    with pytest.raises(ArtifactError, match=match):
        spcompile.load(path)


def test_patch_version_difference_is_accepted(spmm_mod, saved, matrix, tmp_path):
    path = copy_artifact(saved["file"], tmp_path / "v.spc")
    major, minor = spcompile.__version__.split(".")[:2]
    edit_manifest(path, lambda m: m.update(spcompile_version=f"{major}.{minor}.999"), reseal=True)
    loaded = spcompile.load(path, A=matrix)
    X = inputs_for("spmm", matrix.shape, 5)[0]
    np.testing.assert_array_equal(loaded(X), spmm_mod(X))
    assert loaded.key == spmm_mod.key and loaded.config == spmm_mod.config


def test_malformed_manifest_is_refused(saved, tmp_path):
    path = copy_artifact(saved["file"], tmp_path / "m.spc")
    edit_manifest(path, lambda m: m.pop("workload_key"), reseal=True)
    with pytest.raises(ArtifactError, match="incomplete or malformed"):
        spcompile.load(path)


def test_unsafe_file_name_is_refused(saved, tmp_path):
    path = copy_artifact(saved["dir"], tmp_path / "u")
    edit_manifest(path, lambda m: m["files"].update({"../../evil.so": "0" * 64}), reseal=False)
    with pytest.raises(ArtifactError, match="unsafe name"):
        spcompile.load(path)


class _Trap:
    """Unpickling this would create the marker file: proves nothing in arrays.npz is unpickled."""

    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_arrays_are_never_unpickled(saved, tmp_path):
    path = copy_artifact(saved["dir"], tmp_path / "p")
    marker = tmp_path / "unpickled.txt"
    trap = _Trap()
    trap.marker = str(marker)
    with np.load(os.path.join(path, "arrays.npz"), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["data"] = np.array([trap], dtype=object)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    with open(os.path.join(path, "arrays.npz"), "wb") as f:
        f.write(buf.getvalue())
    edit_manifest(path, lambda m: None, reseal=True)  # checksums consistent: only the content is bad
    with pytest.raises(ArtifactError, match="unpickling"):
        spcompile.load(path)
    assert not marker.exists()


def test_different_matrix_is_refused(saved, matrix):
    path = saved["file"]
    other_values = matrix.copy()
    other_values.data = other_values.data * 2
    with pytest.raises(ArtifactError, match="values differ"):
        spcompile.load(path, A=other_values)
    other_pattern = random_matrix(80, 60, density=0.05, seed=22)
    with pytest.raises(ArtifactError, match="sparsity pattern differs"):
        spcompile.load(path, A=other_pattern)
    with pytest.raises(ArtifactError, match="different matrix"):
        spcompile.load(path, A=matrix[:79])
    with pytest.raises(ArtifactError, match="different matrix"):
        spcompile.load(path, A=matrix.T)
    with pytest.raises(ValueError, match="out of range"):  # a bad A is reported as a bad input
        spcompile.load(path, A=(matrix.indptr, matrix.indices + 100, matrix.data, matrix.shape))
