"""The artifact file format: a directory, or the same files in one uncompressed zip file.

* ``manifest.json`` -- format version, spcompile / TVM versions, op, shapes, workload key,
  config (pipeline, template, params), target, kernel metadata, pass log, the SHA-256 of
  every other file and (``manifest_sha256``) of its own content,
* ``arrays.npz`` -- the kernel's matrix data (loaded with ``allow_pickle=False``),
* the kernel binaries the manifest names (a TVM ``export_library`` .so, cubin / PTX).

This module writes and reads those files and checks their integrity; what the manifest *means*
(templates, versions, the matrix) is checked by :func:`spcompile.module.load`.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import zipfile
from typing import Any, Mapping

import numpy as np

FORMAT = "spcompile-artifact"
FORMAT_VERSION = 1
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
RESERVED = ("manifest.json", "arrays.npz")

__all__ = ["ArtifactError", "FORMAT", "FORMAT_VERSION", "write_artifact", "read_artifact", "read_arrays"]


class ArtifactError(ValueError):
    """A saved module cannot be loaded: corrupt, tampered, incompatible or for another matrix."""


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_MANIFEST_SUM = "manifest_sha256"


def _manifest_digest(manifest: Mapping) -> str:
    """SHA-256 of the manifest's content (all keys but the checksum itself), canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != _MANIFEST_SUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def read_artifact(path: str, workdir: str) -> tuple[dict, dict[str, str]]:
    """Copy the artifact's files into ``workdir`` (safe names only), return (manifest, paths)."""
    if os.path.isdir(path):
        def read(n):
            p = os.path.join(path, n)
            if not os.path.isfile(p):
                raise ArtifactError(f"artifact {path!r} is missing {n!r}")
            with open(p, "rb") as f:
                return f.read()

        return _read_files(read, path, workdir)
    if os.path.isfile(path):
        try:
            z = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            raise ArtifactError(f"{path!r} is not a spcompile artifact (not a directory or zip file)") from None

        def read(n):
            try:
                return z.read(n)
            except KeyError:
                raise ArtifactError(f"artifact {path!r} is missing {n!r}") from None
            except (zipfile.BadZipFile, OSError, EOFError) as e:  # corrupt member (bad CRC, truncated)
                raise ArtifactError(f"artifact {path!r}: cannot read {n!r}: {e}") from None

        with z:
            return _read_files(read, path, workdir)
    raise FileNotFoundError(f"no artifact at {path!r}")


def _read_files(read, path: str, workdir: str) -> tuple[dict, dict[str, str]]:
    try:
        manifest = json.loads(read("manifest.json").decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"artifact manifest is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path!r} is not a spcompile artifact")
    files = manifest.get("files")
    if not isinstance(files, dict) or "arrays.npz" not in files:
        raise ArtifactError("artifact manifest lists no files")
    paths = {}
    for name, digest in files.items():
        if not isinstance(name, str) or not _SAFE_NAME.match(name) or name == "manifest.json":
            raise ArtifactError(f"artifact names a file with an unsafe name: {name!r}")
        data = read(name)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ArtifactError(f"checksum mismatch for {name!r}: the artifact was modified or corrupted")
        p = os.path.join(workdir, name)
        with open(p, "wb") as f:
            f.write(data)
        paths[name] = p
    return manifest, paths


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """The arrays of an ``arrays.npz`` (never unpickled)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: np.array(z[k]) for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:  # object arrays refused here
        raise ArtifactError(f"artifact arrays.npz cannot be read without unpickling or is corrupt: {e}") from None


def write_artifact(path: str, manifest: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                   files: Mapping[str, str], *, as_dir: bool | None = None) -> str:
    """Write an artifact: ``manifest`` (its ``files`` and checksum are filled in here), ``arrays``
    (to ``arrays.npz``) and ``files`` (artifact name -> local path of a binary).  A path that is an
    existing directory, ends with a separator, or ``as_dir=True`` gives a directory; otherwise one
    zip file (e.g. ``model.spc``), replaced atomically."""
    path = os.fspath(path)
    if as_dir is None:
        as_dir = os.path.isdir(path) or path.endswith(os.sep)
    with tempfile.TemporaryDirectory(prefix="spcompile-save-") as tmp:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        with open(os.path.join(tmp, "arrays.npz"), "wb") as f:
            f.write(buf.getvalue())
        for name, src in files.items():
            if not _SAFE_NAME.match(name) or name in RESERVED:
                raise ValueError(f"bad kernel file name {name!r}")
            shutil.copyfile(src, os.path.join(tmp, name))
        sums = {n: _sha256_file(os.path.join(tmp, n)) for n in ["arrays.npz", *files]}
        # normalise through JSON first so that the checksum is over exactly what load() reads
        body = json.loads(json.dumps({**manifest, "format": FORMAT, "format_version": FORMAT_VERSION,
                                      "files": sums}, default=_json_default))
        body[_MANIFEST_SUM] = _manifest_digest(body)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            f.write(json.dumps(body, indent=1, sort_keys=True))
        names = ["manifest.json", *sums]
        if as_dir:
            os.makedirs(path, exist_ok=True)
            for n in names:
                shutil.copyfile(os.path.join(tmp, n), os.path.join(path, n))
        else:
            d = os.path.dirname(os.path.abspath(path))
            fd, part = tempfile.mkstemp(dir=d, prefix=".spc-")
            os.close(fd)
            with zipfile.ZipFile(part, "w", zipfile.ZIP_STORED) as z:
                for n in names:
                    z.write(os.path.join(tmp, n), n)
            os.replace(part, path)  # atomic: a reader never sees half an artifact
    return path


def check_manifest_digest(manifest: Mapping) -> None:
    if manifest.get(_MANIFEST_SUM) != _manifest_digest(manifest):
        raise ArtifactError("checksum mismatch for 'manifest.json': the artifact was modified or corrupted")
