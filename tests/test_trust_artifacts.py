"""Hostile and broken artifacts: keyed signatures, resealed forgeries, structural validation of
arrays, bounded reads, manifest limits, atomic saves, permissions, one-line CLI errors, fuzzing.
Every malformed artifact must raise ArtifactError (never a crash, a RecursionError, a KeyError,
or a module that computes something else)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import tracemalloc
import zipfile

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile import ArtifactError
from spcompile import artifact as art
from spcompile.artifact import _manifest_digest
from spcompile.cli.main import main as cli_main

from conftest import REPO, inputs_for, random_matrix

sys.path.insert(0, str(REPO / "benchmarks"))
from trust_probe import huge_npy_npz, inflated_library  # noqa: E402  (the probe's bombs)

KEY = b"k" * 32


@pytest.fixture(scope="module")
def matrix():
    return random_matrix(70, 50, density=0.06, seed=3)


@pytest.fixture(scope="module")
def mod(matrix):
    return spcompile.build(matrix, "spmm", K=4, reduce="sum", target="cpu", pipeline=["reorder.degree"])


@pytest.fixture(scope="module")
def mod64(matrix):
    """``mod``'s workload in float64 (same matrix, K, pipeline and parameters)."""
    return spcompile.build(matrix, "spmm", K=4, reduce="sum", target="cpu", pipeline=["reorder.degree"],
                           dtype="float64")


@pytest.fixture(scope="module")
def sddmm_mod(matrix):
    return spcompile.build(matrix, "sddmm", K=3, target="cpu", pipeline=["reorder.degree"])


@pytest.fixture
def no_env_key(monkeypatch):
    monkeypatch.delenv(art.KEY_ENV, raising=False)
    monkeypatch.delenv(art.REQUIRE_ENV, raising=False)


def members_of(path):
    if os.path.isdir(path):
        return {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def write_zip(path, members, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compress) as z:
        for n, b in members.items():
            z.writestr(n, b)


def reseal(members, change=None, *, arrays=None):
    """A consistent forgery: optional manifest change, new arrays, every checksum and size
    recomputed (the signature, if any, is left as it was)."""
    man = json.loads(members["manifest.json"])
    if arrays is not None:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        members["arrays.npz"] = buf.getvalue()
        man["arrays"] = art.array_specs(arrays)
    if isinstance(man.get("files"), dict):
        man["files"] = {n: hashlib.sha256(members[n]).hexdigest() for n in man["files"] if n in members}
        man["sizes"] = {n: len(members[n]) for n in man["files"]}
    if change is not None:
        change(man)
    man["manifest_sha256"] = _manifest_digest(man)
    members["manifest.json"] = json.dumps(man).encode()
    return members


def arrays_of(members):
    with np.load(io.BytesIO(members["arrays.npz"]), allow_pickle=False) as z:
        return {k: np.array(z[k]) for k in z.files}


def forged(tmp_path, mod, name="f.spc", change=None, edit_arrays=None, **save):
    path = mod.save(str(tmp_path / ("orig-" + name)), **save)
    members = members_of(path)
    arrays = None
    if edit_arrays is not None:
        arrays = arrays_of(members)
        edit_arrays(arrays)
    out = str(tmp_path / name)
    write_zip(out, reseal(members, change, arrays=arrays))
    return out


# -- signatures -----------------------------------------------------------------------------

def test_signed_round_trip_and_refusals(mod, matrix, tmp_path, no_env_key):
    X = inputs_for("spmm", matrix.shape, 4)[0]
    signed = mod.save(str(tmp_path / "s.spc"), sign_key=KEY)
    loaded = spcompile.load(signed, require_signature=True, key=KEY)
    np.testing.assert_array_equal(loaded(X), mod(X))
    assert json.loads(members_of(signed)["manifest.json"])["signature"]["alg"] == "hmac-sha256"
    with pytest.raises(ArtifactError, match="signature does not match"):
        spcompile.load(signed, key=b"x" * 32)
    unsigned = mod.save(str(tmp_path / "u.spc"))
    with pytest.raises(ArtifactError, match="not signed"):
        spcompile.load(unsigned, require_signature=True, key=KEY)
    with pytest.raises(ValueError, match="needs a key"):
        spcompile.load(signed, require_signature=True)
    with pytest.raises(ValueError, match="too short"):
        mod.save(str(tmp_path / "short.spc"), sign_key="abc")
    # directory artifacts are signed the same way
    d = mod.save(str(tmp_path / "sd"), as_dir=True, sign_key=KEY.decode())
    spcompile.load(d, require_signature=True, key=KEY)


@pytest.mark.parametrize("what", ["kernel.so", "arrays.npz", "manifest"])
def test_resealed_signed_artifact_is_refused(mod, tmp_path, no_env_key, what):
    """Whoever can write the artifact can recompute every checksum, not the signature."""
    path = mod.save(str(tmp_path / "s.spc"), sign_key=KEY)
    members = members_of(path)
    change = None
    if what == "kernel.so":
        members["kernel.so"] = members["kernel.so"] + b"\0"
    elif what == "arrays.npz":
        a = arrays_of(members)
        a["data"] = a["data"] * 2
        members = reseal(members, arrays=a)
    else:
        change = lambda m: m["pass_log"].append({"name": "evil"})  # noqa: E731
    bad = str(tmp_path / "bad.spc")
    write_zip(bad, reseal(members, change))
    with pytest.raises(ArtifactError, match="signature does not match"):
        spcompile.load(bad, key=KEY)
    stripped = str(tmp_path / "stripped.spc")
    write_zip(stripped, reseal(members_of(path), lambda m: m.pop("signature")))
    with pytest.raises(ArtifactError, match="not signed"):
        spcompile.load(stripped, require_signature=True, key=KEY)


def test_environment_key_and_requirement(mod, matrix, tmp_path, monkeypatch):
    monkeypatch.setenv(art.KEY_ENV, KEY.decode())
    path = mod.save(str(tmp_path / "e.spc"))  # signed with the environment's key
    assert "signature" in json.loads(members_of(path)["manifest.json"])
    monkeypatch.setenv(art.REQUIRE_ENV, "1")
    spcompile.load(path)
    unsigned = mod.save(str(tmp_path / "u.spc"), sign_key=False)
    with pytest.raises(ArtifactError, match="not signed"):
        spcompile.load(unsigned)
    monkeypatch.setenv(art.KEY_ENV, "y" * 32)
    with pytest.raises(ArtifactError, match="signature does not match"):
        spcompile.load(path)


# -- resealed forgeries: structural validation ----------------------------------------------------

def _set(name, fn):
    def edit(a):
        a[name] = fn(a[name])
    return edit


ARRAY_FORGERIES = [
    ("index out of range", _set("indices", lambda x: x + 10_000), "outside"),
    ("negative index", _set("indices", lambda x: np.where(np.arange(x.size) == 3, -1, x).astype(x.dtype)), "outside"),
    ("indptr not monotone", _set("indptr", lambda x: x[::-1].copy()), "indptr"),
    ("indptr past nnz", _set("indptr", lambda x: (x * 2).astype(x.dtype)), "indptr"),
    ("row ids out of range", _set("row_ids", lambda x: (x + 1000).astype(x.dtype)), "row_ids"),
    ("row ids repeated", _set("row_ids", lambda x: np.zeros_like(x)), "permutation"),
    ("task bounds past rows", _set("task_bounds", lambda x: (x * 3).astype(x.dtype)), "task_bounds"),
    ("short data", _set("data", lambda x: x[:-1].copy()), "data"),
    ("float64 data", _set("data", lambda x: x.astype(np.float64)), "data.*float32"),
    ("float indices", _set("indices", lambda x: x.astype(np.float32)), "integer|mix"),
    ("mixed index dtypes", _set("indices", lambda x: x.astype(np.int64)), "mix"),
    ("missing array", lambda a: a.pop("row_ids"), "takes arrays"),
    ("extra array", lambda a: a.update(extra=np.zeros(3)), "takes arrays"),
    ("other values", _set("data", lambda x: x * 2), "values hash"),
    ("columns shuffled", _set("indices", lambda x: x[::-1].copy()), "matrix"),
]


@pytest.mark.parametrize("edit,match", [f[1:] for f in ARRAY_FORGERIES], ids=[f[0] for f in ARRAY_FORGERIES])
def test_resealed_bad_arrays_are_refused(mod, tmp_path, no_env_key, edit, match):
    path = forged(tmp_path, mod, edit_arrays=edit)
    with pytest.raises(ArtifactError, match=match):
        spcompile.load(path)


def test_array_not_matching_manifest_spec(mod, tmp_path, no_env_key):
    path = mod.save(str(tmp_path / "o.spc"))
    members = members_of(path)
    a = arrays_of(members)
    a["data"] = np.concatenate([a["data"], a["data"]])
    buf = io.BytesIO()
    np.savez(buf, **a)
    members["arrays.npz"] = buf.getvalue()  # arrays replaced, the manifest's array specs kept
    bad = str(tmp_path / "b.spc")
    write_zip(bad, reseal(members))
    with pytest.raises(ArtifactError, match="manifest declares"):
        spcompile.load(bad)


def test_sddmm_forgeries(sddmm_mod, matrix, tmp_path, no_env_key):
    good = forged(tmp_path, sddmm_mod, "g.spc")
    X, Y = inputs_for("sddmm", matrix.shape, 3)
    np.testing.assert_array_equal(spcompile.load(good)(X, Y), sddmm_mod(X, Y))
    for edit, match in [(_set("nnz_ids", lambda x: (x + 5).astype(x.dtype)), "nnz_ids"),
                        (_set("nnz_ids", lambda x: np.roll(x, 1)), "canonical|pattern")]:
        with pytest.raises(ArtifactError, match=match):
            spcompile.load(forged(tmp_path, sddmm_mod, "b.spc", edit_arrays=edit))


def test_relabelled_for_another_matrix(mod, matrix, tmp_path, no_env_key):
    """The manifest says matrix B, the arrays hold A: refused, with or without B given."""
    B = random_matrix(70, 50, density=0.06, seed=99)
    b = spcompile.build(B, "spmm", K=4, reduce="sum", target="cpu", pipeline=["reorder.degree"])

    def relabel(m):
        m["workload_key"]["pattern"] = b.key.pattern
        m["values_hash"] = b.values_hash

    path = forged(tmp_path, mod, change=relabel)
    for A in (None, B):
        with pytest.raises(ArtifactError, match="another matrix"):
            spcompile.load(path, A=A)


def test_float64_artifact_forgeries(mod64, matrix, tmp_path, no_env_key):
    """A float64 artifact loads and computes as built; its values in float32, or another byte
    order, are refused."""
    X = inputs_for("spmm", matrix.shape, 4)[0].astype(np.float64)
    np.testing.assert_array_equal(spcompile.load(forged(tmp_path, mod64, "g.spc"))(X), mod64(X))
    for edit in (_set("data", lambda x: x.astype(np.float32)), _set("data", lambda x: x.astype(">f8"))):
        with pytest.raises(ArtifactError, match="data.*float64"):
            spcompile.load(forged(tmp_path, mod64, "b.spc", edit_arrays=edit))


def test_relabelled_dtype_is_refused(mod, mod64, tmp_path, no_env_key):
    """A float32 artifact relabelled float64 and the reverse: the workload's dtype alone, or with
    the values converted, their hash and the kernel's entry made to match the other dtype's:
    refused (the library holds no kernel compiled for the other dtype)."""
    for src, other in ((mod, mod64), (mod64, mod)):
        vt = other.kernel.arrays["data"].dtype

        def dtype(m):
            m["workload_key"]["dtype"] = m["dtype"] = other.key.dtype

        def everything(m):
            dtype(m)
            m["values_hash"] = other.values_hash
            m["kernel_meta"]["entry"] = other.kernel.meta["entry"]

        with pytest.raises(ArtifactError, match="entry"):
            spcompile.load(forged(tmp_path, src, "d.spc", change=dtype))
        path = forged(tmp_path, src, "e.spc", change=everything, edit_arrays=_set("data", lambda x: x.astype(vt)))
        with pytest.raises(ArtifactError, match="cannot be loaded"):
            spcompile.load(path)


MANIFEST_FORGERIES = [
    ("library renamed", lambda m: [m[k].update({"other.so": m[k].pop("kernel.so")}) for k in ("files", "sizes")],
     "kernel.so"),
    ("entry renamed", lambda m: m["kernel_meta"].update(entry="evil"), "entry"),
    ("array order swapped", lambda m: m["kernel_meta"].update(array_order=m["kernel_meta"]["array_order"][::-1]),
     "arrays"),
    ("template of another op", lambda m: m["config"].update(template="cpu.csr_sddmm"), "another version|does not compute"),
    ("negative rows", lambda m: m["workload_key"].update(rows=-1), "malformed"),
    ("absurd K", lambda m: m["workload_key"].update(K=2 ** 60), "malformed"),
    ("string nnz", lambda m: m["workload_key"].update(nnz="12"), "malformed"),
    ("unknown op", lambda m: m["workload_key"].update(op="evil"), "malformed"),
    ("files not a dict", lambda m: m.update(files=[1, 2]), "lists no files"),
    ("sizes missing a member", lambda m: m.update(sizes={}), "no valid size"),
    ("template not a dict", lambda m: m.update(template=[]), "another version"),
    ("kernel_meta not a dict", lambda m: m.update(kernel_meta=[]), "malformed"),
    ("config not a dict", lambda m: m.update(config=3), "malformed"),
]


@pytest.mark.parametrize("change,match", [f[1:] for f in MANIFEST_FORGERIES], ids=[f[0] for f in MANIFEST_FORGERIES])
def test_resealed_bad_manifest_is_refused(mod, tmp_path, no_env_key, change, match):
    path = mod.save(str(tmp_path / "o.spc"))
    members = members_of(path)
    if change is MANIFEST_FORGERIES[0][1]:
        members["other.so"] = members["kernel.so"]
    bad = str(tmp_path / "b.spc")
    write_zip(bad, reseal(members, change))
    with pytest.raises(ArtifactError, match=match):
        spcompile.load(bad)


# -- bounded reads and manifest limits ---------------------------------------------------------

def test_inflating_member_is_not_expanded(mod, tmp_path, no_env_key):
    """A deflated member whose content is far larger than the manifest declares: refused after
    reading at most the declared size (+1 byte)."""
    path = mod.save(str(tmp_path / "o.spc"))
    members = inflated_library(members_of(path), 64 << 20)
    bad = str(tmp_path / "bomb.spc")
    write_zip(bad, members, zipfile.ZIP_DEFLATED)
    assert os.path.getsize(bad) < (1 << 20)
    tracemalloc.start()
    with pytest.raises(ArtifactError, match="larger than declared"):
        spcompile.load(bad)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < (16 << 20), peak


def test_global_size_cap(mod, tmp_path, monkeypatch, no_env_key):
    path = mod.save(str(tmp_path / "o.spc"))
    monkeypatch.setenv("SPCOMPILE_ARTIFACT_MAX_BYTES", "1000")
    with pytest.raises(ArtifactError, match="over the limit"):
        spcompile.load(path)
    monkeypatch.setenv("SPCOMPILE_ARTIFACT_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="positive integer"):
        spcompile.load(path)


def test_npy_header_declaring_huge_array(mod, tmp_path, no_env_key):
    """An .npy header declaring 2**40 elements: refused from the header, nothing allocated."""
    path = mod.save(str(tmp_path / "o.spc"))
    members = members_of(path)
    members["arrays.npz"] = huge_npy_npz(members["arrays.npz"])
    man = json.loads(members["manifest.json"])
    man["arrays"]["data"]["shape"] = [1 << 40]
    bad = str(tmp_path / "h.spc")
    write_zip(bad, reseal(members, lambda m: m.update(arrays=man["arrays"])))
    with pytest.raises(ArtifactError, match="header declares"):
        spcompile.load(bad)


@pytest.mark.parametrize("manifest,match", [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    (b'{"a": ' * 50 + b"1" + b"}" * 50, "nested deeper"),
    (b" " * (art.MAX_MANIFEST_BYTES + 10), "over the limit"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b'{"format": "spcompile-artifact", "files": {"arrays.npz": 5}}', "malformed checksum"),
    (b"[]", "not a spcompile artifact"),
])
def test_manifest_limits(tmp_path, no_env_key, manifest, match):
    bad = str(tmp_path / "m.spc")
    write_zip(bad, {"manifest.json": manifest, "arrays.npz": b""})
    with pytest.raises(ArtifactError, match=match):
        spcompile.load(bad)


def test_strings_do_not_count_as_nesting(mod, tmp_path, no_env_key):
    path = forged(tmp_path, mod, change=lambda m: m["pass_log"].append({"name": "[[[[" * 100 + '\\"{{{' * 50}))
    spcompile.load(path)


# -- atomic saves and permissions ----------------------------------------------------------------

def test_failed_directory_save_keeps_the_old_artifact(mod, matrix, tmp_path, monkeypatch, no_env_key):
    d = str(tmp_path / "art")
    mod.save(d, as_dir=True)
    before = members_of(d)
    calls = {"n": 0}
    real = art._write_file

    def enospc(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(art, "_write_file", enospc)
    with pytest.raises(OSError, match="No space"):
        mod.save(d, as_dir=True)
    monkeypatch.undo()
    assert members_of(d) == before
    assert sorted(os.listdir(tmp_path)) == ["art"]  # no half-written sibling left behind
    spcompile.load(d, A=matrix)
    mod.save(d, as_dir=True)  # a working overwrite swaps the new artifact in
    assert sorted(os.listdir(tmp_path)) == ["art"]
    spcompile.load(d, A=matrix)


def test_failed_file_save_keeps_the_old_artifact(mod, matrix, tmp_path, monkeypatch, no_env_key):
    f = str(tmp_path / "m.spc")
    mod.save(f)
    before = open(f, "rb").read()
    monkeypatch.setattr(art.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        mod.save(f)
    monkeypatch.undo()
    assert open(f, "rb").read() == before and sorted(os.listdir(tmp_path)) == ["m.spc"]


def test_directory_that_is_not_an_artifact_is_never_replaced(mod, tmp_path, no_env_key):
    d = tmp_path / "home"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a spcompile artifact"):
        mod.save(str(d), as_dir=True)
    assert (d / "precious.txt").read_text() == "keep me"


def test_permissions_follow_the_umask(mod, tmp_path, no_env_key):
    old = os.umask(0o022)
    try:
        f = mod.save(str(tmp_path / "m.spc"))
        d = mod.save(str(tmp_path / "d"), as_dir=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    for n in os.listdir(d):
        assert stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode) == 0o644


# -- the CLI: one-line errors -------------------------------------------------------------------

def test_info_of_bad_artifacts_prints_one_line(mod, tmp_path, capsys, no_env_key):
    good = mod.save(str(tmp_path / "g.spc"), sign_key=KEY)
    assert cli_main(["info", good]) == 0
    out = capsys.readouterr().out
    assert "spmm" in out and "signed: yes" in out
    deep = str(tmp_path / "deep.spc")
    write_zip(deep, {"manifest.json": b"[" * 50_000 + b"]" * 50_000})
    junk = tmp_path / "junk.spc"
    junk.write_bytes(b"junk")
    notdir = tmp_path / "emptydir"
    notdir.mkdir()
    bad_arrays = forged(tmp_path, mod, "ba.spc", edit_arrays=_set("indices", lambda x: x + 10_000))
    for p in (deep, str(junk), str(notdir), str(tmp_path / "absent.spc"), bad_arrays):
        assert cli_main(["info", p]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def test_info_never_loads_the_library(mod, tmp_path, monkeypatch, no_env_key):
    from spcompile.runtime import cpu

    path = mod.save(str(tmp_path / "g.spc"))
    monkeypatch.setattr(cpu, "load", lambda p: pytest.fail("info loaded the kernel library"))
    assert cli_main(["info", path]) == 0


# -- fuzzing ----------------------------------------------------------------------------------

def _outcome(path, X, want):
    try:
        loaded = spcompile.load(path)
    except ArtifactError:
        return "refused"
    np.testing.assert_array_equal(loaded(X), want)  # accepted only if it computes the same
    return "same"


@pytest.mark.parametrize("member", ["manifest.json", "arrays.npz", "kernel.so"])
def test_fuzz_flip_truncate_reseal(mod, matrix, tmp_path, no_env_key, member):
    X = inputs_for("spmm", matrix.shape, 4)[0]
    want = mod(X)
    orig = members_of(mod.save(str(tmp_path / "o.spc")))
    rng = np.random.default_rng(0)
    n = len(orig[member])
    cases = [("flip", int(p)) for p in rng.integers(0, n, 24)] + [("trunc", int(p)) for p in rng.integers(0, n, 6)]
    outcomes = []
    for i, (how, pos) in enumerate(cases):
        for do_reseal in (False, True):
            if do_reseal and member == "kernel.so":
                continue  # a resealed library is code: only a signature catches it (tested above)
            m = dict(orig)
            b = bytearray(m[member])
            if how == "flip":
                b[pos] ^= 1 << int(rng.integers(0, 8))
            else:
                del b[pos:]
            m[member] = bytes(b)
            if do_reseal and member != "manifest.json":
                m = reseal(m)
            elif do_reseal:  # the manifest's own checksum recomputed over the flipped content
                try:
                    man = json.loads(m[member])
                    man["manifest_sha256"] = _manifest_digest(man)
                    m[member] = json.dumps(man).encode()
                except (ValueError, TypeError, AttributeError):
                    pass
            p = str(tmp_path / f"f{i}{int(do_reseal)}.spc")
            write_zip(p, m)
            outcomes.append(_outcome(p, X, want))
    assert "refused" in outcomes
    if member != "manifest.json":
        assert set(outcomes) == {"refused"} or member == "arrays.npz"
