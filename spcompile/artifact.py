"""The artifact file format: a directory, or the same files in one uncompressed zip file.

* ``manifest.json`` -- format version, spcompile / TVM versions, op, shapes, workload key,
  config (pipeline, template, params), target, kernel metadata, pass log, the SHA-256
  (``files``) and size (``sizes``) of every other file, the dtype and shape of every array
  (``arrays``), (``manifest_sha256``) the SHA-256 of its own content and, when the artifact was
  saved with a key, ``signature``: an HMAC-SHA256 over all of that,
* ``arrays.npz`` -- the kernel's matrix data (plain numeric arrays; never unpickled),
* the kernel binaries the manifest names (a TVM ``export_library`` .so, cubin / PTX).

Trust model: an artifact is code (its kernel library is loaded into the process), so load only
artifacts from trusted sources.  The checksums detect corruption, not forgery: whoever can
write an artifact can recompute them.  A *keyed signature* detects forgery: ``save(path,
sign_key=KEY)`` signs, ``load(path, require_signature=True, key=KEY)`` refuses anything not
signed with that key (``SPCOMPILE_ARTIFACT_KEY`` is the default key of both).  Independently of
signatures, reading is bounded (the manifest's declared sizes and a global cap,
``SPCOMPILE_ARTIFACT_MAX_BYTES``), manifests are parsed with size and depth limits, and every
array is checked against the manifest before a kernel sees it (:func:`spcompile.module.load`).

This module writes and reads those files and checks their integrity; what the manifest *means*
(templates, versions, the matrix) is checked by :func:`spcompile.module.load`.
"""
from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import re
import shutil
import tempfile
import zipfile
from typing import Any, Callable, Mapping

import numpy as np

FORMAT = "spcompile-artifact"
FORMAT_VERSION = 1
_SAFE_NAME = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.-]{1,64}$")   # never "." or ".."
_SAFE_ARRAY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
RESERVED = ("manifest.json", "arrays.npz")
#: the manifest is small (kilobytes); anything larger or deeper is refused before parsing
MAX_MANIFEST_BYTES = 16 << 20
MAX_MANIFEST_DEPTH = 32
#: default cap on one artifact's members together (override: SPCOMPILE_ARTIFACT_MAX_BYTES)
DEFAULT_MAX_BYTES = 8 << 30
KEY_ENV = "SPCOMPILE_ARTIFACT_KEY"
REQUIRE_ENV = "SPCOMPILE_ARTIFACT_REQUIRE_SIGNATURE"
SIGNATURE_ALG = "hmac-sha256"
#: dtypes an array of an artifact may have (never object, structured or byte-string arrays)
_ARRAY_KINDS = "biuf"

__all__ = ["ArtifactError", "FORMAT", "FORMAT_VERSION", "write_artifact", "read_artifact", "read_arrays",
           "parse_manifest", "sign_manifest", "verify_signature", "max_artifact_bytes"]


class ArtifactError(ValueError):
    """A saved module cannot be loaded: corrupt, tampered, unsigned where a signature is required,
    over the size limits, incompatible or for another matrix."""


def max_artifact_bytes() -> int:
    """The cap on the bytes read from one artifact (all members together)."""
    env = os.environ.get("SPCOMPILE_ARTIFACT_MAX_BYTES", "").strip()
    if env:
        if not env.isdigit() or int(env) <= 0:
            raise ValueError(f"SPCOMPILE_ARTIFACT_MAX_BYTES must be a positive integer, got {env!r}")
        return int(env)
    return DEFAULT_MAX_BYTES


_MANIFEST_SUM = "manifest_sha256"
_SIGNATURE = "signature"


def _canonical(body: Mapping) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _manifest_digest(manifest: Mapping) -> str:
    """SHA-256 of the manifest's content (all keys but the checksum and signature), canonical JSON."""
    body = {k: v for k, v in manifest.items() if k not in (_MANIFEST_SUM, _SIGNATURE)}
    return hashlib.sha256(_canonical(body)).hexdigest()


# -- keys and signatures ------------------------------------------------------------------------

def _key_bytes(key, what: str = "key") -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes or str, got {type(key).__name__}")
    key = bytes(key)
    if len(key) < 16:
        raise ValueError(f"{what} is too short ({len(key)} bytes): use at least 16 random bytes, "
                         "e.g. python3 -c 'import secrets; print(secrets.token_hex(32))'")
    return key


def default_key() -> bytes | None:
    """The key of ``SPCOMPILE_ARTIFACT_KEY`` (None when unset or empty)."""
    env = os.environ.get(KEY_ENV)
    return _key_bytes(env, KEY_ENV) if env else None


def sign_manifest(manifest: Mapping, key) -> dict:
    """HMAC-SHA256 of the manifest's content (which holds every member's SHA-256 and size)."""
    body = {k: v for k, v in manifest.items() if k not in (_MANIFEST_SUM, _SIGNATURE)}
    mac = hmac.new(_key_bytes(key), _canonical(body), hashlib.sha256).hexdigest()
    return {"alg": SIGNATURE_ALG, "mac": mac}


def verify_signature(manifest: Mapping, key, *, required: bool) -> bool:
    """Check the manifest's signature with ``key``; returns whether it was verified.  Without a
    key nothing can be verified (an error when ``required``); a present signature that does not
    match, or a missing one when ``required``, is an :class:`ArtifactError`."""
    sig = manifest.get(_SIGNATURE)
    if key is None:
        if required:
            raise ValueError(f"require_signature=True needs a key (key=... or ${KEY_ENV})")
        return False
    if sig is None:
        if required:
            raise ArtifactError("artifact is not signed, and a signature is required: re-save it with "
                                "sign_key=... (or $SPCOMPILE_ARTIFACT_KEY) from a trusted build")
        return False
    if not isinstance(sig, dict) or sig.get("alg") != SIGNATURE_ALG or not isinstance(sig.get("mac"), str):
        raise ArtifactError(f"artifact signature is malformed (expected {SIGNATURE_ALG})")
    want = sign_manifest(manifest, key)["mac"]
    if not hmac.compare_digest(want, sig["mac"]):
        raise ArtifactError("artifact signature does not match the key: it was modified after signing, "
                            "or signed with another key")
    return True


# -- manifest parsing -----------------------------------------------------------------------------

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def parse_manifest(data: bytes) -> dict:
    """The manifest's JSON, with size and nesting limits checked before parsing."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"artifact manifest is {len(data)} bytes, over the limit of {MAX_MANIFEST_BYTES}")
    # nesting depth without recursion: brackets outside strings, running sum
    code = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    step = (np.isin(code, (ord("["), ord("{"))).astype(np.int32)
            - np.isin(code, (ord("]"), ord("}"))).astype(np.int32))
    if step.size and int(np.cumsum(step).max()) > MAX_MANIFEST_DEPTH:
        raise ArtifactError(f"artifact manifest is nested deeper than {MAX_MANIFEST_DEPTH} levels")
    try:
        manifest = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ArtifactError(f"artifact manifest is not valid JSON: {e}") from None
    return manifest


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


# -- reading ----------------------------------------------------------------------------------

def _declared_size(manifest: Mapping, name: str, remaining: int) -> int:
    sizes = manifest.get("sizes")
    if sizes is None:  # artifacts written before sizes were recorded: the global cap only
        return remaining
    size = sizes.get(name) if isinstance(sizes, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ArtifactError(f"artifact manifest declares no valid size for {name!r}")
    if size > remaining:
        raise ArtifactError(f"artifact member {name!r} declares {size} bytes, over the limit of "
                            f"{max_artifact_bytes()} bytes per artifact (SPCOMPILE_ARTIFACT_MAX_BYTES)")
    return size


def read_artifact(path: str, workdir: str, *, key=None, require_signature: bool | None = None
                  ) -> tuple[dict, dict[str, str]]:
    """Copy the artifact's files into ``workdir`` (safe names only, bounded sizes, checksums and,
    with a key, the signature verified), return (manifest, paths)."""
    if os.path.isdir(path):
        def open_member(n, cap):
            p = os.path.join(path, n)
            if not os.path.isfile(p):
                raise ArtifactError(f"artifact {path!r} is missing {n!r}")
            if os.path.getsize(p) > cap:
                raise ArtifactError(f"artifact member {n!r} is larger than declared ({cap} bytes)")
            with open(p, "rb") as f:
                return f.read(cap + 1)

        return _read_files(open_member, path, workdir, key, require_signature)
    if os.path.isfile(path):
        try:
            z = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise ArtifactError(f"{path!r} is not a spcompile artifact (not a directory or zip file: {e})") from None

        def open_member(n, cap):
            try:
                with z.open(n) as f:   # never inflates more than cap + 1 bytes
                    return f.read(cap + 1)
            except KeyError:
                raise ArtifactError(f"artifact {path!r} is missing {n!r}") from None
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as e:
                raise ArtifactError(f"artifact {path!r}: cannot read {n!r}: {e}") from None

        with z:
            return _read_files(open_member, path, workdir, key, require_signature)
    raise FileNotFoundError(f"no artifact at {path!r}")


def _read_files(open_member: Callable[[str, int], bytes], path: str, workdir: str, key,
                require_signature) -> tuple[dict, dict[str, str]]:
    raw = open_member("manifest.json", MAX_MANIFEST_BYTES)
    manifest = parse_manifest(raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path!r} is not a spcompile artifact")
    files = manifest.get("files")
    if not isinstance(files, dict) or "arrays.npz" not in files:
        raise ArtifactError("artifact manifest lists no files")
    if require_signature is None:
        require_signature = os.environ.get(REQUIRE_ENV, "") not in ("", "0")
    key = _key_bytes(key) if key is not None else default_key()
    # the signature covers every member's digest and size: check it before reading them
    verify_signature(manifest, key, required=bool(require_signature))
    remaining = max_artifact_bytes()
    paths = {}
    for name, digest in files.items():
        if not isinstance(name, str) or not _SAFE_NAME.match(name) or name == "manifest.json":
            raise ArtifactError(f"artifact names a file with an unsafe name: {name!r}")
        if not isinstance(digest, str):
            raise ArtifactError(f"artifact manifest has a malformed checksum for {name!r}")
        cap = _declared_size(manifest, name, remaining)
        data = open_member(name, cap)
        if len(data) > cap:
            raise ArtifactError(f"artifact member {name!r} is larger than declared ({cap} bytes)")
        remaining -= len(data)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ArtifactError(f"checksum mismatch for {name!r}: the artifact was modified or corrupted")
        if isinstance(manifest.get("sizes"), dict) and len(data) != manifest["sizes"][name]:
            raise ArtifactError(f"artifact member {name!r} has {len(data)} bytes, the manifest declares "
                                f"{manifest['sizes'][name]}")
        p = os.path.join(workdir, name)
        with open(p, "wb") as f:
            f.write(data)
        paths[name] = p
    return manifest, paths


def _npy_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, spec) -> np.ndarray:
    """One .npy member, its header checked (dtype, shape, size) before any data is read."""
    name = info.filename[:-4]
    if info.file_size > (1 << 62):
        raise ArtifactError(f"artifact array {name!r} is too large")
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=4096)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, max_header_size=4096)
        else:
            raise ArtifactError(f"artifact array {name!r} has an unknown .npy version {version}")
        if dtype.hasobject or dtype.kind not in _ARRAY_KINDS or dtype.fields is not None or dtype.subdtype:
            raise ArtifactError(f"artifact array {name!r} has dtype {dtype}: only plain numeric arrays are "
                                "accepted (never unpickling)")
        count = int(np.prod(shape, dtype=object)) if shape else 1
        nbytes = count * dtype.itemsize
        if spec is not None and (list(shape) != list(spec.get("shape", [])) or dtype.str != spec.get("dtype")):
            raise ArtifactError(f"artifact array {name!r} is {dtype.str}{list(shape)}, the manifest declares "
                                f"{spec.get('dtype')}{spec.get('shape')}")
        body = f.read(nbytes + 1)
    if len(body) != nbytes:
        raise ArtifactError(f"artifact array {name!r} holds {len(body)} bytes, its header declares {nbytes}")
    a = np.frombuffer(body, dtype=dtype, count=count).reshape(shape, order="F" if fortran else "C")
    return np.ascontiguousarray(a).copy() if not a.flags.c_contiguous else a.copy()


def read_arrays(path: str, specs: Mapping | None = None) -> dict[str, np.ndarray]:
    """The arrays of an ``arrays.npz`` (never unpickled, headers checked before any data is read;
    with ``specs`` -- name -> {"dtype", "shape"} from the manifest -- exactly those arrays)."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            names = [i.filename for i in infos]
            if len(set(names)) != len(names) or not all(n.endswith(".npy") and _SAFE_ARRAY.match(n[:-4])
                                                         for n in names):
                raise ArtifactError(f"artifact arrays.npz holds unexpected members {names[:8]}")
            packed = [i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED]
            if packed:   # np.savez stores its members: a compressed one could inflate far past the declared sizes
                raise ArtifactError(f"artifact arrays.npz holds compressed members {packed[:4]}: spcompile writes "
                                    "them uncompressed, and their reads are bounded by the artifact's size")
            if specs is not None:
                if not isinstance(specs, dict) or sorted(specs) != sorted(n[:-4] for n in names):
                    got = sorted(n[:-4] for n in names)
                    raise ArtifactError(f"artifact arrays.npz holds {got}, the manifest declares "
                                        f"{sorted(specs) if isinstance(specs, dict) else specs!r}")
            return {i.filename[:-4]: _npy_member(z, i, None if specs is None else specs[i.filename[:-4]])
                    for i in infos}
    except ArtifactError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, NotImplementedError, RuntimeError,
            SyntaxError, TypeError, OverflowError) as e:
        raise ArtifactError(f"artifact arrays.npz cannot be read without unpickling or is corrupt: {e}") from None


def array_specs(arrays: Mapping[str, np.ndarray]) -> dict:
    return {k: {"dtype": np.asarray(v).dtype.str, "shape": list(np.shape(v))} for k, v in arrays.items()}


# -- writing ----------------------------------------------------------------------------------

def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def _write_file(path: str, data: bytes, mode: int) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, mode)


def write_artifact(path: str, manifest: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                   files: Mapping[str, str], *, as_dir: bool | None = None, sign_key=None) -> str:
    """Write an artifact: ``manifest`` (its ``files``, ``sizes``, ``arrays`` and checksum are
    filled in here), ``arrays`` (to ``arrays.npz``) and ``files`` (artifact name -> local path of
    a binary); signed with ``sign_key`` (default: ``$SPCOMPILE_ARTIFACT_KEY``; ``False``: never).
    A path that is an existing directory, ends with a separator, or ``as_dir=True`` gives a
    directory; otherwise one zip file (e.g. ``model.spc``).  Both replace an older artifact
    atomically: a reader sees the old or the new one, and a failed save leaves the old one."""
    path = os.fspath(path)
    if as_dir is None:
        as_dir = os.path.isdir(path) or path.endswith(os.sep)
    key = None if sign_key is False else (_key_bytes(sign_key, "sign_key") if sign_key is not None
                                          else default_key())
    for name in files:
        if not _SAFE_NAME.match(name) or name in RESERVED:
            raise ValueError(f"bad kernel file name {name!r}")
    for name in arrays:
        if not _SAFE_ARRAY.match(name):
            raise ValueError(f"bad array name {name!r}")
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    members = {"arrays.npz": buf.getvalue()}
    for name, src in files.items():
        with open(src, "rb") as f:
            members[name] = f.read()
    sums = {n: hashlib.sha256(b).hexdigest() for n, b in members.items()}
    sizes = {n: len(b) for n, b in members.items()}
    # normalise through JSON first so that the checksum is over exactly what load() reads
    body = json.loads(json.dumps({**manifest, "format": FORMAT, "format_version": FORMAT_VERSION,
                                  "files": sums, "sizes": sizes, "arrays": array_specs(arrays)},
                                 default=_json_default))
    body.pop(_SIGNATURE, None)
    body[_MANIFEST_SUM] = _manifest_digest(body)
    if key is not None:
        body[_SIGNATURE] = sign_manifest(body, key)
    members = {"manifest.json": json.dumps(body, indent=1, sort_keys=True).encode(), **members}
    try:
        _write(path, as_dir, members)
    except OSError as e:  # one clear line: which artifact could not be written, and why
        raise OSError(e.errno, f"cannot write artifact {path!r}: {e.strerror or e}") from None
    return path


def _write(path: str, as_dir: bool, members: Mapping[str, bytes]) -> None:
    umask = _umask()
    fmode, dmode = 0o666 & ~umask, 0o777 & ~umask
    target = os.path.abspath(path.rstrip(os.sep) or path)
    parent, base = os.path.split(target)
    if as_dir:
        _write_dir(target, parent, base, members, fmode, dmode)
    else:
        if os.path.isdir(target):
            raise ValueError(f"{path!r} is a directory; save with as_dir=True or choose a file name")
        fd, part = tempfile.mkstemp(dir=parent, prefix=f".{base}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
                    for n, b in members.items():
                        z.writestr(n, b)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(part, fmode)
            os.replace(part, target)  # atomic: a reader never sees half an artifact
        except BaseException:
            _remove(part)
            raise


def _remove(p: str) -> None:
    try:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.remove(p)
    except OSError:
        pass


def _write_dir(target: str, parent: str, base: str, members: Mapping[str, bytes], fmode: int, dmode: int):
    """A directory artifact written beside ``target`` and swapped in by renames: the old
    artifact stays until the new one is complete, and comes back if the swap fails."""
    if os.path.lexists(target):
        if not os.path.isdir(target) or os.path.islink(target):
            raise ValueError(f"{target!r} exists and is not a directory; remove it or save as a file")
        content = os.listdir(target)
        if content and "manifest.json" not in content:
            raise ValueError(f"{target!r} is a non-empty directory that is not a spcompile artifact; "
                             "refusing to replace it")
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{base}.", suffix=".part")
    try:
        for n, b in members.items():
            _write_file(os.path.join(tmp, n), b, fmode)
        os.chmod(tmp, dmode)
        if os.path.lexists(target):
            old = tempfile.mkdtemp(dir=parent, prefix=f".{base}.", suffix=".old")
            os.rmdir(old)
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def check_manifest_digest(manifest: Mapping) -> None:
    if manifest.get(_MANIFEST_SUM) != _manifest_digest(manifest):
        raise ArtifactError("checksum mismatch for 'manifest.json': the artifact was modified or corrupted")
