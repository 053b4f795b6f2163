#!/usr/bin/env python
"""Trust probe: bad input, hostile artifacts and faults, tried as a demanding user and an attacker
would, on the CPU target.  Writes a table per class of cases tried, handled cleanly, silently
wrong, crash / unclear error, hang and loss.

    python benchmarks/trust_probe.py [--out DIR] [--quick] [--only CLASS] [--list] [--case NAME ...]

Every case runs in a fresh worker *interpreter* (never a fork: TVM's thread pool does not survive
fork), batched: the parent starts ``trust_probe.py --worker``, sends case names one per line on
its stdin and reads one JSON line per case, with a per-case timeout.  A worker that dies (a
signal, an abort, the address-space limit) gives "crash"; a case past its timeout gives "hang";
either way the worker is killed and a fresh one runs the remaining cases.

Outcomes (one per case):

* ``clean``  -- the case's assertion held: a clear refusal (the expected exception type AND a
  meaningful message), or a correct result (compared with the float64 reference),
* ``wrong``  -- bad input silently accepted, or a wrong result,
* ``crash``  -- crash or unclear error: the worker died, or an unexpected exception type
  (KeyError, IndexError, RecursionError, AttributeError, a TypeError from deep inside ...),
  or the right type with a message that does not say what is wrong,
* ``hang``   -- past the case's timeout,
* ``loss``   -- a tuning record or an older artifact lost.

Classes: artifacts, inputs, passes, database, state.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CLASSES = ("artifacts", "inputs", "passes", "database", "state")
OUTCOMES = ("clean", "wrong", "crash", "hang", "loss")
OUTCOME_TITLES = {"clean": "handled cleanly", "wrong": "silently wrong", "crash": "crash / unclear error",
                  "hang": "hang", "loss": "loss"}
#: address-space limit of every worker: an out-of-memory case is a crash, not a dead machine
WORKER_AS_LIMIT = 8 << 30
KEY = b"trust-probe-key-" * 2     # 32 bytes
OTHER_KEY = b"another-key-0123" * 2


# =================================================================================================
# outcomes and checks (used inside the worker)
# =================================================================================================

class Outcome(Exception):
    status = "crash"


class Wrong(Outcome):
    """Bad input silently accepted, or a result that differs from the reference."""
    status = "wrong"


class Unclear(Outcome):
    """An unexpected exception type, or an error that does not say what is wrong."""
    status = "crash"


class Lost(Outcome):
    """A record or an older artifact lost."""
    status = "loss"


def _msg(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:240]}"


def expect_error(call: Callable, types, match: str | None = None, *, accept: Callable | None = None,
                 one_line: bool = True) -> str:
    """``call()`` must raise one of ``types`` whose message matches ``match`` (a regex, case
    insensitive) -- a clear refusal.  Any other exception is unclear; no exception is silently
    wrong, unless ``accept(result)`` (which raises :class:`Wrong` if the result is not right)
    shows the input was handled correctly after all."""
    types = types if isinstance(types, tuple) else (types,)
    try:
        result = call()
    except Outcome:
        raise
    except types as e:
        text = str(e)
        if not text.strip():
            raise Unclear(f"{type(e).__name__} with an empty message") from None
        if match is not None and not re.search(match, text, re.I | re.S):
            raise Unclear(f"{type(e).__name__} whose message does not say /{match}/: {text[:240]}") from None
        if one_line and "\n" in text.strip():
            raise Unclear(f"{type(e).__name__} message spans lines: {text[:240]!r}") from None
        return f"refused: {_msg(e)}"
    except BaseException as e:  # noqa: BLE001 -- classified, not hidden
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise Unclear(f"unexpected {_msg(e)}") from None
    if accept is not None:
        return "accepted, correct: " + (accept(result) or "")
    raise Wrong(f"accepted silently (returned {type(result).__name__})")


def check_close(out, ref, what: str = "result", rtol: float = 1e-4, atol: float = 1e-4) -> str:
    """``out`` equals the float64 reference: same shape, NaN exactly where the reference has NaN,
    the same infinities, finite values close."""
    import numpy as np

    if out is None:
        raise Wrong(f"{what}: no result")
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise Wrong(f"{what}: shape {out.shape}, reference {ref.shape}")
    nan_o, nan_r = np.isnan(out), np.isnan(ref)
    if not np.array_equal(nan_o, nan_r):
        bad = np.argwhere(nan_o != nan_r)[:3].tolist()
        raise Wrong(f"{what}: NaN differs from the reference at {bad} ({int((nan_o != nan_r).sum())} entries)")
    fin = ~nan_r
    if not np.array_equal(out[fin], ref[fin]):
        inf_r = np.isinf(ref) & fin
        if not np.array_equal(np.isinf(out) & fin, inf_r) or not np.array_equal(out[inf_r], ref[inf_r]):
            raise Wrong(f"{what}: infinities differ from the reference")
        ok = fin & ~inf_r
        if not np.allclose(out[ok], ref[ok], rtol=rtol, atol=atol):
            err = float(np.max(np.abs(out[ok] - ref[ok])))
            raise Wrong(f"{what}: differs from the reference (max abs error {err:.3g})")
    return f"{what} matches the float64 reference"


# =================================================================================================
# the registry
# =================================================================================================

@dataclass
class Case:
    name: str
    cls: str
    fn: Callable
    timeout: float = 60.0
    quick: bool = False
    fresh: bool = False        # a worker of its own (peak-memory measurements)
    test_only: bool = False
    as_limit: int | None = None   # this case's worker address-space limit (fresh cases only)


CASES: dict[str, Case] = {}


def register(cls: str, name: str, fn: Callable, *, timeout: float = 60.0, quick: bool = False,
             fresh: bool = False, test_only: bool = False, as_limit: int | None = None) -> None:
    full = f"{cls}.{name}"
    if full in CASES:
        raise ValueError(f"duplicate case {full}")
    if not re.match(r"^[A-Za-z0-9_.:=+^-]+$", full):
        raise ValueError(f"bad case name {full!r}")
    if as_limit is not None and not fresh:
        raise ValueError("as_limit needs fresh=True")
    CASES[full] = Case(full, cls, fn, timeout, quick, fresh, test_only, as_limit)


def case(cls: str, name: str | None = None, **kw):
    def deco(fn):
        register(cls, name or fn.__name__, fn, **kw)
        return fn
    return deco


# =================================================================================================
# the worker's context: small built modules and pristine artifacts, made once per worker
# =================================================================================================

class Ctx:
    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="trust-probe-")
        self.tmp = None
        self._mods: dict = {}
        self._arts: dict = {}

    def new_tmp(self) -> str:
        self.tmp = tempfile.mkdtemp(dir=self.root, prefix="case-")
        return self.tmp

    def drop_tmp(self) -> None:
        if self.tmp:
            _chmod_back(self.tmp)
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp = None

    # -- matrices and modules ------------------------------------------------------------------
    @staticmethod
    def matrix(kind: str = "A"):
        import numpy as np
        import scipy.sparse as sp

        if kind == "A":      # non-square, an empty row, one long row, explicit values
            A = sp.random(70, 50, density=0.06, format="csr", random_state=3, dtype=np.float32)
            A = A.tolil()
            A[5, :] = 0
            A[9, ::2] = 1.5
            A = A.tocsr()
        elif kind == "B":    # same shape, another pattern
            A = sp.random(70, 50, density=0.06, format="csr", random_state=99, dtype=np.float32)
        elif kind == "S":    # square (for outputs that could alias inputs)
            A = sp.random(60, 60, density=0.08, format="csr", random_state=5, dtype=np.float32)
        else:
            raise KeyError(kind)
        A.sort_indices()
        A.eliminate_zeros()
        return A

    def mod(self, which: str = "sum"):
        """Cached CPU modules: spmm sum/max/min/mean of A at K=4 (sum after reorder.degree),
        sddmm of A at K=3, spmm sum of the square S at K=8."""
        if which not in self._mods:
            import spcompile

            if which == "sddmm":
                m = spcompile.build(self.matrix("A"), "sddmm", K=3, target="cpu", pipeline=["reorder.degree"])
            elif which == "square":
                m = spcompile.build(self.matrix("S"), "spmm", K=8, reduce="sum", target="cpu", pipeline=[])
            elif which == "B":
                m = spcompile.build(self.matrix("B"), "spmm", K=4, reduce="sum", target="cpu",
                                    pipeline=["reorder.degree"])
            else:
                m = spcompile.build(self.matrix("A"), "spmm", K=4, reduce=which, target="cpu",
                                    pipeline=["reorder.degree"] if which == "sum" else [])
            self._mods[which] = m
        return self._mods[which]

    def artifact(self, layout: str = "zip", which: str = "sum", signed: bool = False) -> str:
        """A pristine saved artifact (never modified by cases: they copy its members)."""
        k = (layout, which, signed)
        if k not in self._arts:
            d = os.path.join(self.root, "pristine")
            os.makedirs(d, exist_ok=True)
            p = os.path.join(d, f"{which}-{'s' if signed else 'u'}" + (".spc" if layout == "zip" else ".d"))
            self._arts[k] = self.mod(which).save(p, as_dir=(layout == "dir"), sign_key=KEY if signed else False)
        return self._arts[k]

    def inputs(self, which: str = "sum", seed: int = 0):
        import numpy as np

        m = self.mod(which)
        rng = np.random.default_rng(seed)
        if m.op == "sddmm":
            return (rng.standard_normal((m.shape[0], m.K)).astype(np.float32),
                    rng.standard_normal((m.shape[1], m.K)).astype(np.float32))
        return (rng.standard_normal((m.shape[1], m.K)).astype(np.float32),)

    def reference(self, which: str, *inputs):
        from spcompile.core import reference
        from spcompile.core.formats import as_csr

        m = self.mod(which)
        A = self.matrix("S" if which == "square" else "B" if which == "B" else "A")
        return reference.run(m.op, m.reduce, as_csr(A), *inputs)


def _chmod_back(path: str) -> None:
    """Make a tree removable again after a case made parts of it read-only."""
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            try:
                os.chmod(os.path.join(dirpath, d), 0o755)
            except OSError:
                pass
    try:
        os.chmod(path, 0o755)
    except OSError:
        pass


# =================================================================================================
# the worker
# =================================================================================================

def _set_limits() -> None:
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = int(os.environ.get("TRUST_PROBE_AS_LIMIT") or WORKER_AS_LIMIT)
        lim = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_AS, (lim, hard))
    except (ValueError, OSError):
        pass


def worker_main(test_cases: bool) -> int:
    """Read case names on stdin, answer one JSON line per case on the original stdout (anything
    the cases print goes to stderr)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _set_limits()
    if test_cases:
        register_test_cases()
    import warnings

    warnings.simplefilter("ignore")
    import numpy  # noqa: F401
    import spcompile  # noqa: F401

    ctx = Ctx()
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    try:
        for line in sys.stdin:
            name = line.strip()
            if not name:
                continue
            c = CASES.get(name)
            t0 = time.perf_counter()
            extra: dict = {}
            if c is None:
                status, detail = "crash", f"unknown case {name!r}"
            else:
                ctx.new_tmp()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        r = c.fn(ctx)
                    if isinstance(r, tuple):
                        r, extra = r
                    status, detail = "clean", str(r or "ok")
                except Outcome as o:
                    status, detail = o.status, str(o)
                except MemoryError as e:
                    status, detail = "crash", f"MemoryError (out of memory): {e}"
                except BaseException as e:  # noqa: BLE001
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    tb = traceback.extract_tb(e.__traceback__)
                    where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else "?"
                    status, detail = "crash", f"unexpected {_msg(e)} at {where}"
                finally:
                    ctx.drop_tmp()
            res = {"name": name, "status": status, "detail": detail[:600],
                   "secs": round(time.perf_counter() - t0, 3)}
            if extra:
                res["extra"] = extra
            proto.write(json.dumps(res, default=str) + "\n")
    finally:
        _chmod_back(ctx.root)
        shutil.rmtree(ctx.root, ignore_errors=True)
    return 0


def worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("SPCOMPILE_ARTIFACT_KEY", "SPCOMPILE_ARTIFACT_REQUIRE_SIGNATURE", "SPCOMPILE_ARTIFACT_MAX_BYTES"):
        env.pop(k, None)
    env.setdefault("TVM_NUM_THREADS", "2")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


class Worker:
    """One worker interpreter; ``run(name, timeout)`` returns the case's result dict."""

    def __init__(self, test_cases: bool = False, startup_timeout: float = 120.0, as_limit: int | None = None):
        self.tmpdir = tempfile.mkdtemp(prefix="trust-probe-parent-")
        env = worker_env()
        env["TRUST_PROBE_AS_LIMIT"] = str(as_limit or WORKER_AS_LIMIT)
        # every temporary file of the worker (and of what it starts) lives here: removed with it,
        # even when the worker is killed
        env["TMPDIR"] = self.tmpdir
        # the worker's tuning database: never the project's embedded one
        env["SPCOMPILE_TUNING_DB"] = os.path.join(self.tmpdir, "tuning.db")
        self.errpath = os.path.join(self.tmpdir, "stderr.txt")
        self.err = open(self.errpath, "wb")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + (["--test-cases"] if test_cases else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     env=env, cwd=self.tmpdir, start_new_session=True)
        self.buf = b""
        line = self._readline(startup_timeout)
        if line is None or b"ready" not in line:
            tail = self.stderr_tail()
            self.kill()
            raise RuntimeError(f"worker did not start: {tail}")

    def _readline(self, timeout: float) -> bytes | None:
        """A line from the worker, None on EOF; raises TimeoutError past ``timeout``."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def stderr_tail(self, n: int = 400) -> str:
        try:
            self.err.flush()
            with open(self.errpath, "rb") as f:
                data = f.read()
        except OSError:
            return ""
        lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
        return " | ".join(lines[-3:])[-n:]

    def run(self, name: str, timeout: float) -> tuple[dict, bool]:
        """(result, worker still usable)."""
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write((name + "\n").encode())
            self.proc.stdin.flush()
            line = self._readline(timeout)
        except TimeoutError:
            self.kill()
            return {"name": name, "status": "hang", "detail": f"no answer within {timeout:g} s (worker killed)",
                    "secs": round(time.perf_counter() - t0, 3)}, False
        except (BrokenPipeError, OSError):
            line = None
        if line is None:
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
                rc = self.proc.returncode
            how = (f"killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exited with {rc}")
            tail = self.stderr_tail()
            self.kill()   # its children too, and its temporary files
            return {"name": name, "status": "crash", "detail": f"worker died ({how}); stderr: {tail}",
                    "secs": round(time.perf_counter() - t0, 3)}, False
        try:
            res = json.loads(line)
        except ValueError:
            self.kill()
            return {"name": name, "status": "crash", "detail": f"garbled worker answer {line[:200]!r}",
                    "secs": round(time.perf_counter() - t0, 3)}, False
        return res, True

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self._cleanup()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)   # the worker's own session: it and its children
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._cleanup()

    def _cleanup(self) -> None:
        try:
            self.err.close()
        except OSError:
            pass
        for s in (self.proc.stdin, self.proc.stdout):
            try:
                s.close()
            except OSError:
                pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def run_cases(names, *, test_cases: bool = False, timeout_scale: float = 1.0, progress=None) -> list[dict]:
    """Run ``names`` in batched fresh worker interpreters; one result dict per case."""
    results = []
    w = None
    try:
        for name in names:
            c = CASES[name]
            if c.fresh and w is not None:
                w.close()
                w = None
            if w is None:
                try:
                    w = Worker(test_cases, as_limit=c.as_limit)
                except RuntimeError as e:
                    results.append({"name": name, "status": "crash", "detail": str(e)[:600], "secs": 0.0})
                    continue
            res, alive = w.run(name, c.timeout * timeout_scale)
            res["class"] = c.cls
            results.append(res)
            if progress:
                progress(res)
            if not alive or c.fresh:
                if alive:
                    w.close()
                w = None
    finally:
        if w is not None:
            w.close()
    return results


# =================================================================================================
# helpers for artifact forgeries
# =================================================================================================

def members_of(path: str) -> dict[str, bytes]:
    if os.path.isdir(path):
        out = {}
        for n in sorted(os.listdir(path)):
            with open(os.path.join(path, n), "rb") as f:
                out[n] = f.read()
        return out
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def write_members(path: str, members: dict, layout: str = "zip", compress=zipfile.ZIP_STORED) -> str:
    if layout == "dir":
        os.makedirs(path, exist_ok=True)
        for n, b in members.items():
            with open(os.path.join(path, n), "wb") as f:
                f.write(b)
    else:
        with zipfile.ZipFile(path, "w", compress) as z:
            for n, b in members.items():
                z.writestr(n, b)
    return path


def manifest_digest(man: dict) -> str:
    """What an attacker recomputes: SHA-256 of the canonical JSON of every key but the checksum
    and the signature (as spcompile/artifact.py documents it)."""
    body = {k: v for k, v in man.items() if k not in ("manifest_sha256", "signature")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def inflated_library(members: dict, size: int) -> dict:
    """``members`` with ``kernel.so`` replaced by ``size`` zero bytes (deflated, almost nothing), its
    hash in the manifest and the manifest resealed: the manifest's sizes still declare the real
    library's size."""
    man = json.loads(members["manifest.json"])
    bomb = b"\0" * size
    man["files"]["kernel.so"] = hashlib.sha256(bomb).hexdigest()
    man["manifest_sha256"] = manifest_digest(man)
    return {**members, "kernel.so": bomb, "manifest.json": json.dumps(man).encode()}


def huge_npy_npz(npz: bytes) -> bytes:
    """``arrays.npz`` bytes with ``data.npy`` replaced by a header declaring 2**40 float32 elements
    (and 64 bytes of them)."""
    import numpy as np

    with zipfile.ZipFile(io.BytesIO(npz)) as z:
        inner = {n: z.read(n) for n in z.namelist()}
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)})
    inner["data.npy"] = hdr.getvalue() + b"\0" * 64
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, b in inner.items():
            z.writestr(n, b)
    return buf.getvalue()


def npz_bytes(arrays: dict) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def arrays_of(members: dict) -> dict:
    import numpy as np

    with np.load(io.BytesIO(members["arrays.npz"]), allow_pickle=False) as z:
        return {k: np.array(z[k]) for k in z.files}


def reseal(members: dict, change: Callable | None = None, arrays: dict | None = None,
           keep_specs: bool = False, pre: Callable | None = None, raw: dict | None = None) -> dict:
    """Recompute every checksum and size (and the array specs, unless ``keep_specs``) after an
    optional manifest change (``pre`` before the checksums are recomputed, ``change`` after) and
    new ``arrays`` -- a consistent forgery without the key.  ``raw``: sentinel string -> JSON
    text put in its place (for values ``json.dumps`` cannot write: 100000-deep nesting, ints of
    5000 digits); the checksum is computed over the substituted canonical text."""
    members = dict(members)
    man = json.loads(members["manifest.json"])
    if pre is not None:
        pre(man)
    if arrays is not None:
        members["arrays.npz"] = npz_bytes(arrays)
        if not keep_specs:
            man["arrays"] = {k: {"dtype": v.dtype.str, "shape": list(v.shape)} for k, v in arrays.items()}
    if isinstance(man.get("files"), dict):
        man["files"] = {n: hashlib.sha256(members[n]).hexdigest() for n in man["files"] if n in members}
        man["sizes"] = {n: len(members[n]) for n in man["files"]}
    if change is not None:
        change(man)
    man.pop("manifest_sha256", None)

    def subst(text: str) -> str:
        for k, v in (raw or {}).items():
            text = text.replace(json.dumps(k), v)
        return text

    body = {k: v for k, v in man.items() if k != "signature"}
    canon = subst(json.dumps(body, sort_keys=True, separators=(",", ":")))
    man["manifest_sha256"] = hashlib.sha256(canon.encode()).hexdigest()
    members["manifest.json"] = subst(json.dumps(man, indent=1)).encode()
    return members


def loads_correctly(ctx: Ctx, which: str, path: str, **kw) -> str:
    """The artifact loads and computes exactly what the original module computes, for the same
    workload.  A module declaring another workload is a forgery: silently wrong when calls
    return a result, unclear when they fail."""
    import numpy as np

    import spcompile

    m = spcompile.load(path, **kw)
    orig = ctx.mod(which)
    k, o = m.key, orig.key
    if (k.op, k.reduce, k.rows, k.cols, k.nnz, k.K, k.dtype) == (o.op, o.reduce, o.rows, o.cols, o.nnz, o.K, o.dtype):
        ins = ctx.inputs(which, seed=7)
        check_close(m(*ins), ctx.reference(which, *ins), "loaded module")
        return "loads and computes the original's result"
    # a forgery was loaded: what do calls with inputs of its declared interface do?
    rng = np.random.default_rng(1)
    dt = k.dtype if isinstance(k.dtype, str) else "float32"
    shapes = [(k.cols, k.K)] if k.op == "spmm" else [(k.rows, k.K), (k.cols, k.K)]
    try:
        ins = [rng.standard_normal(s).astype(dt) for s in shapes]
        out = m(*ins)
    except Exception as e:  # noqa: BLE001
        raise Unclear(f"a forgery loaded ({_short_key(k)}); calling it raises {_msg(e)}") from None
    raise Wrong(f"a forgery loaded ({_short_key(k)}) and computes a {type(out).__name__} "
                f"{getattr(out, 'shape', '')} for a workload it was not built for")


def _short_key(k) -> str:
    return f"op={k.op} reduce={k.reduce} shape=({k.rows},{k.cols}) nnz={k.nnz} K={k.K} dtype={k.dtype}"


def run_cli(args: list[str], timeout: float = 120.0, env_extra: dict | None = None) -> tuple[int, str, str]:
    env = worker_env()
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "spcompile", *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=tempfile.gettempdir())
    return p.returncode, p.stdout, p.stderr


def expect_cli_error(args: list[str], match: str | None = None, **kw) -> str:
    """The CLI fails with a non-zero exit and one line on stderr, no traceback."""
    return judge_cli_error(*run_cli(args, **kw), match)


def best_lists_one_record(path: str, what: str) -> None:
    """``spcompile best`` on the storage at ``path`` exits 0, without a traceback, listing 1 record."""
    rc, out, err = run_cli(["best", "--storage", path])
    if rc != 0 or "Traceback" in err or "1 record" not in out:
        raise Unclear(f"best {what}: rc={rc}, {err.strip()[-200:]!r} {out.strip()[-100:]!r}")


def judge_cli_error(rc: int, out: str, err: str, match: str | None = None) -> str:
    """:func:`expect_cli_error`'s verdict on a run already made (rc, stdout, stderr)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if "Traceback" in err:
        raise Unclear(f"traceback on stderr (rc={rc}): {err.strip().splitlines()[-1][:200]}")
    if rc == 0:
        raise Wrong(f"exit 0 (stdout {out.strip()[:160]!r})")
    if rc < 0:
        raise Unclear(f"killed by signal {-rc}")
    if len(lines) != 1:
        raise Unclear(f"{len(lines)} lines on stderr: {err.strip()[:240]!r}")
    if match and not re.search(match, lines[0], re.I):
        raise Unclear(f"stderr does not say /{match}/: {lines[0][:200]}")
    return f"rc={rc}: {lines[0][:200]}"


# =================================================================================================
# cases are defined below (one section per class)
# =================================================================================================

# -- artifacts ------------------------------------------------------------------------------------

def _flip(b: bytes, pos: int, bit: int = 0) -> bytes:
    b = bytearray(b)
    b[pos] ^= 1 << bit
    return bytes(b)


def _reseal_manifest_only(members: dict) -> dict:
    """The manifest's own checksum recomputed over a changed manifest (when it still parses)."""
    try:
        man = json.loads(members["manifest.json"])
        if not isinstance(man, dict):
            return members
        man["manifest_sha256"] = manifest_digest(man)
        return {**members, "manifest.json": json.dumps(man, indent=1).encode()}
    except (ValueError, UnicodeDecodeError, TypeError):
        return members


def _load_refused(ctx, path: str, which: str = "sum", match: str | None = None, types=None, **kw) -> str:
    import spcompile
    from spcompile import ArtifactError

    return expect_error(lambda: spcompile.load(path, **kw), types or ArtifactError, match,
                        accept=lambda _m: loads_correctly(ctx, which, path, **kw))


def _artifact_cases() -> None:
    import_np = lambda: __import__("numpy")  # noqa: E731

    # 1. byte flips and truncation of each member, zip and directory, without and with resealing
    mutations = {"flip-head": lambda b: _flip(b, 0, 1), "flip-mid": lambda b: _flip(b, len(b) // 2, 3),
                 "flip-rand": lambda b: _flip(b, (len(b) * 7919 // 10007) % len(b), 6),
                 "trunc-empty": lambda b: b"", "trunc-half": lambda b: b[: len(b) // 2]}
    for layout in ("zip", "dir"):
        for member in ("manifest.json", "arrays.npz", "kernel.so"):
            for mname, mut in mutations.items():
                for resealed in (False, True):
                    def fn(ctx, layout=layout, member=member, mut=mut, resealed=resealed):
                        # a resealed library is code: only a signature can catch it (the trust model)
                        signed = resealed and member == "kernel.so"
                        members = members_of(ctx.artifact(layout, "sum", signed=signed))
                        members[member] = mut(members[member])
                        if resealed:
                            members = (_reseal_manifest_only(members) if member == "manifest.json"
                                       else reseal(members))
                        path = write_members(os.path.join(ctx.tmp, "f.spc" if layout == "zip" else "f"), members,
                                             layout)
                        kw = {"key": KEY, "require_signature": True} if signed else {}
                        return _load_refused(ctx, path, **kw)
                    register("artifacts", f"{mname}:{member}:{layout}{':resealed' if resealed else ''}", fn,
                             quick=(mname == "flip-mid" and layout == "zip"))

    # the zip container itself: central directory, local header, end record, truncation
    def container(edit):
        def fn(ctx):
            with open(ctx.artifact("zip"), "rb") as f:
                data = f.read()
            path = os.path.join(ctx.tmp, "c.spc")
            with open(path, "wb") as f:
                f.write(edit(data))
            return _load_refused(ctx, path)
        return fn

    register("artifacts", "zip-container:flip-local-header", container(lambda d: _flip(d, 8, 2)))
    register("artifacts", "zip-container:flip-central-dir",
             container(lambda d: _flip(d, d.rfind(b"PK\x01\x02") + 20, 4)))
    register("artifacts", "zip-container:flip-end-record", container(lambda d: _flip(d, len(d) - 10, 1)))
    register("artifacts", "zip-container:truncated-tail", container(lambda d: d[:-30]))
    register("artifacts", "zip-container:truncated-half", container(lambda d: d[: len(d) // 2]))
    register("artifacts", "zip-container:appended-junk", container(lambda d: d + os.urandom(4096)))

    # 2. resealed arrays that do not fit the manifest / the matrix
    def arr_forgery(edit, match=None, which="sum", keep_specs=False):
        def fn(ctx):
            members = members_of(ctx.artifact("zip", which))
            a = arrays_of(members)
            edit(a)
            path = write_members(os.path.join(ctx.tmp, "a.spc"), reseal(members, arrays=a, keep_specs=keep_specs))
            return _load_refused(ctx, path, which, match)
        return fn

    def setter(name, f):
        def edit(a):
            a[name] = f(a[name])
        return edit

    np = import_np()
    arr_cases = {
        "index-out-of-range": (setter("indices", lambda x: x + 10_000), "outside|range"),
        "index-just-past-cols": (setter("indices", lambda x: np.where(x == x.max(), 50, x).astype(x.dtype)),
                                 "outside|range"),
        "negative-index": (setter("indices", lambda x: np.where(np.arange(x.size) == 3, -1, x).astype(x.dtype)),
                           "outside|negative|range"),
        "indptr-not-monotone": (setter("indptr", lambda x: x[::-1].copy()), "indptr"),
        "indptr-past-nnz": (setter("indptr", lambda x: (x * 2).astype(x.dtype)), "indptr"),
        "indptr-short": (setter("indptr", lambda x: x[:-1].copy()), "indptr"),
        "indptr-first-not-zero": (setter("indptr", lambda x: (x + 1).astype(x.dtype)), "indptr"),
        "row-ids-out-of-range": (setter("row_ids", lambda x: (x + 1000).astype(x.dtype)), "row_ids"),
        "row-ids-repeated": (setter("row_ids", lambda x: np.zeros_like(x)), "row_ids|permutation"),
        "task-bounds-past-rows": (setter("task_bounds", lambda x: (x * 3).astype(x.dtype)), "task_bounds"),
        "task-bounds-decreasing": (setter("task_bounds", lambda x: x[::-1].copy()), "task_bounds"),
        "data-short": (setter("data", lambda x: x[:-1].copy()), "data"),
        "data-float64": (setter("data", lambda x: x.astype(np.float64)), "data|dtype|float32"),
        "data-2d": (setter("data", lambda x: x.reshape(-1, 1)), "data|shape"),
        "data-nan-resealed": (setter("data", lambda x: np.full_like(x, np.nan)), "values"),
        "data-doubled": (setter("data", lambda x: x * 2), "values"),
        "indices-float": (setter("indices", lambda x: x.astype(np.float32)), "integer|mix|dtype"),
        "indices-int64": (setter("indices", lambda x: x.astype(np.int64)), "mix|dtype|int"),
        "indices-uint8": (setter("indices", lambda x: x.astype(np.uint8)), "mix|dtype|int"),
        "indices-bool": (setter("indices", lambda x: x.astype(bool)), "dtype|integer|bool|only plain|mix"),
        "indices-shuffled": (setter("indices", lambda x: x[::-1].copy()), "matrix|pattern|sorted|canonical"),
        "missing-array": (lambda a: a.pop("row_ids"), "arrays"),
        "extra-array": (lambda a: a.update(extra=np.zeros(3)), "arrays"),
        "all-empty": (lambda a: [a.update({k: v[:0]}) for k, v in list(a.items())], None),
        "values-src-not-permutation": (setter("_module_values_src", lambda x: np.zeros_like(x)), "permutation"),
        "values-src-out-of-range": (setter("_module_values_src", lambda x: x + 10 ** 6), "permutation|range"),
        "values-src-negative": (setter("_module_values_src", lambda x: -1 - x), "permutation|negative|range"),
        "values-src-float": (setter("_module_values_src", lambda x: x.astype(np.float64)), "permutation|integer"),
        "object-array": (setter("data", lambda x: x.astype(object)), "object|pickle|only plain|numeric"),
    }
    for name, (edit, match) in arr_cases.items():
        register("artifacts", f"arrays:{name}", arr_forgery(edit, match),
                 quick=name in ("index-out-of-range", "indptr-not-monotone"))
    register("artifacts", "arrays:specs-not-updated",
             arr_forgery(setter("data", lambda x: np.concatenate([x, x])), "declares", keep_specs=True))
    register("artifacts", "arrays:sddmm-nnz-ids-shifted",
             arr_forgery(setter("nnz_ids", lambda x: (x + 5).astype(x.dtype)), "nnz_ids", which="sddmm"))
    register("artifacts", "arrays:sddmm-nnz-ids-rolled",
             arr_forgery(setter("nnz_ids", lambda x: np.roll(x, 1)), "nnz_ids|canonical|pattern", which="sddmm"))
    register("artifacts", "arrays:sddmm-nnz-ids-negative",
             arr_forgery(setter("nnz_ids", lambda x: (x - 10 ** 6).astype(x.dtype)), "nnz_ids", which="sddmm"))

    # 3. resealed manifest edits
    def man_forgery(change, match=None, which="sum", raw=None):
        def fn(ctx):
            members = members_of(ctx.artifact("zip", which))
            path = write_members(os.path.join(ctx.tmp, "m.spc"), reseal(members, change, raw=raw))
            return _load_refused(ctx, path, which, match)
        return fn

    def wk(**kv):
        return lambda m: m["workload_key"].update(kv)

    def nest(m):
        m["pass_log"] = [{"name": "deep", "metrics": {"x": "@NEST@"}}]

    def rename_lib(m):
        for k in ("files", "sizes"):
            m[k]["other.so"] = m[k].pop("kernel.so")

    def wk_and_entry(**kv):
        # the forger also names the symbol the template would compile for the forged workload
        def f(m):
            from spcompile.core.ir import WorkloadKey
            from spcompile.kernels import get_template

            m["workload_key"].update(kv)
            t = get_template(m["config"]["template"])
            m["kernel_meta"]["entry"] = t.entry_name(WorkloadKey.from_dict(m["workload_key"]), m["config"]["params"],
                                                     str(m["arrays"]["indptr"]["dtype"]).lstrip("<|=>").replace(
                                                         "i4", "int32").replace("i8", "int64"))
        return f

    man_cases = {
        "other-K-and-entry": (wk_and_entry(K=8), None), "other-reduce-and-entry": (wk_and_entry(reduce="max"), None),
        "other-K": (wk(K=8), None), "other-K-top-level-only": (lambda m: m.update(K=8), None),
        "other-rows": (wk(rows=71), None), "other-cols": (wk(cols=49), None), "other-nnz": (wk(nnz=211), None),
        "other-shape-top-level-only": (lambda m: m.update(shape=[700, 500]), None),
        "other-op": (wk(op="sddmm", reduce=None), None), "other-reduce": (wk(reduce="max"), None),
        "reduce-removed": (wk(reduce=None), None), "other-dtype": (wk(dtype="float16"), None),
        "other-dtype-float64": (wk(dtype="float64"), None),
        "other-dtype-float64-and-entry": (wk_and_entry(dtype="float64"), None),
        "other-pattern": (wk(pattern="0" * 32), None),
        "other-values-hash": (lambda m: m.update(values_hash="0" * 32), "values"),
        "library-renamed": (rename_lib, None),
        "entry-renamed": (lambda m: m["kernel_meta"].update(entry="system"), "entry"),
        "array-order-reversed": (lambda m: m["kernel_meta"].update(array_order=m["kernel_meta"]["array_order"][::-1]),
                                 "array"),
        "array-order-extra": (lambda m: m["kernel_meta"]["array_order"].append("data"), "array"),
        "template-of-another-op": (lambda m: m["config"].update(template="cpu.csr_sddmm"), "template"),
        "template-unknown": (lambda m: m["config"].update(template="evil.template"), "template"),
        "template-version": (lambda m: m["template"].update(version="999"), "template"),
        "target-cuda": (lambda m: m["config"].update(target="cuda"), None),
        "params-k-tile-other": (lambda m: m["config"]["params"].update(k_tile=2), None),
        "params-k-tile-negative": (lambda m: m["config"]["params"].update(k_tile=-1), None),
        "params-not-a-dict": (lambda m: m["config"].update(params="x"), None),
        "params-unknown-key": (lambda m: m["config"]["params"].update(evil=1), None),
        "pipeline-edited": (lambda m: m["config"].update(pipeline=[{"name": "reorder.rcm", "options": {}}]), None),
        "tvm-version": (lambda m: m.update(tvm_version="0.1.0"), "TVM"),
        "spcompile-version": (lambda m: m.update(spcompile_version="9.9.0"), "spcompile|incompatible"),
        "format-version-2": (lambda m: m.update(format_version=2), "version"),
        "format-name": (lambda m: m.update(format="zip"), "not a spcompile artifact"),
        "cpu-features-unknown": (lambda m: m["kernel_meta"]["cpu_features"].append("avx9000"), "feature"),
        "nesting-40": (nest, "nested|deep"),
        "nesting-100000": (nest, "nested|deep"),
        "huge-K": (wk(K=2 ** 60), None), "huge-rows": (wk(rows=10 ** 30), None),
        "huge-int-5000-digits": (wk(nnz="@HUGE@"), None),
        "huge-float": (wk(K=1e308), None), "inf-K": (wk(K="@INF@"), None),
        "float-K": (wk(K=4.0), None), "string-K": (wk(K="4"), None), "bool-K": (wk(K=True), None),
        "null-rows": (wk(rows=None), None), "negative-cols": (wk(cols=-50), None),
        "nan-value": (lambda m: m.update(values_hash=float("nan")), None),
        "workload-key-string": (lambda m: m.update(workload_key="spmm"), None),
        "workload-key-missing": (lambda m: m.pop("workload_key"), None),
        "config-int": (lambda m: m.update(config=3), None),
        "config-missing": (lambda m: m.pop("config"), None),
        "kernel-meta-list": (lambda m: m.update(kernel_meta=[]), None),
        "kernel-meta-missing": (lambda m: m.pop("kernel_meta"), None),
        "files-list": (lambda m: m.update(files=[1, 2]), "files"),
        "files-empty": (lambda m: m.update(files={}), "files"),
        "sizes-string": (lambda m: m.update(sizes="big"), "size"),
        "sizes-negative": (lambda m: m["sizes"].update({"kernel.so": -1}), "size"),
        "sizes-huge": (lambda m: m["sizes"].update({"kernel.so": 2 ** 62}), "limit|size"),
        "arrays-spec-null": (lambda m: m.update(arrays=None), None),
        "arrays-spec-shape-lies": (lambda m: m["arrays"]["data"].update(shape=[1 << 40]), None),
        "tuning-not-a-dict": (lambda m: m.update(tuning=5), None),
        "tuning-list": (lambda m: m.update(tuning=["x"]), None),
        "pass-log-int": (lambda m: m.update(pass_log=5), None),
        "pass-log-dict": (lambda m: m.update(pass_log={"a": 1}), None),
        "signature-garbage-unsigned": (lambda m: m.update(signature="x"), None),
        "manifest-is-list": (None, "not a spcompile artifact"),
    }
    for name, (change, match) in man_cases.items():
        if name == "manifest-is-list":
            def fn(ctx):
                members = members_of(ctx.artifact("zip"))
                members["manifest.json"] = b"[1, 2, 3]"
                return _load_refused(ctx, write_members(os.path.join(ctx.tmp, "l.spc"), members), "sum",
                                     "not a spcompile artifact")
            register("artifacts", f"manifest:{name}", fn)
            continue
        raw = {"@NEST@": "[" * 40 + "1" + "]" * 40} if name == "nesting-40" else \
            {"@NEST@": "[" * 100_000 + "1" + "]" * 100_000, "@HUGE@": "1" + "0" * 5000, "@INF@": "Infinity"}
        register("artifacts", f"manifest:{name}", man_forgery(change, match, raw=raw),
                 quick=name in ("other-reduce", "nesting-100000", "tuning-not-a-dict"))
    def renamed_with_member(ctx):
        members = members_of(ctx.artifact("zip"))
        members["other.so"] = members.pop("kernel.so")
        path = write_members(os.path.join(ctx.tmp, "m.spc"), reseal(members, pre=rename_lib))
        return _load_refused(ctx, path, "sum", "kernel.so|librar")

    register("artifacts", "manifest:library-renamed-with-member", renamed_with_member)
    register("artifacts", "manifest:sddmm-as-spmm",
             man_forgery(wk(op="spmm", reduce="sum"), None, which="sddmm"))

    # 4. relabelled for another matrix
    def relabel(with_a: str | None, relabelled: bool = True):
        def fn(ctx):
            import spcompile

            b = ctx.mod("B")
            src = ctx.artifact("zip")
            if relabelled:
                def change(m):
                    m["workload_key"]["pattern"] = b.key.pattern
                    m["values_hash"] = b.values_hash
                src = write_members(os.path.join(ctx.tmp, "r.spc"), reseal(members_of(src), change))
            A = None if with_a in (None, "A-other-values") else ctx.matrix(with_a)
            if with_a == "A-other-values":
                A = ctx.matrix("A")
                A.data[0] += 1.0
            return expect_error(lambda: spcompile.load(src, A=A), spcompile.ArtifactError, "matrix",
                                accept=lambda m: loads_correctly(ctx, "sum", src))
        return fn

    register("artifacts", "relabelled:for-B:load", relabel(None), quick=True)
    register("artifacts", "relabelled:for-B:load-with-B", relabel("B"))
    register("artifacts", "relabelled:genuine-for-A:load-with-B", relabel("B", relabelled=False))
    register("artifacts", "relabelled:genuine-for-A:load-with-other-values", relabel("A-other-values", False))

    # 5. bombs: a deflated member far larger than declared; an .npy header declaring a huge array;
    #    an inner deflated .npy that inflates to gigabytes with a manifest resealed to match
    def zip_bomb(ctx):
        import tracemalloc

        import spcompile

        members = inflated_library(members_of(ctx.artifact("zip")), 256 << 20)
        path = write_members(os.path.join(ctx.tmp, "bomb.spc"), members, compress=zipfile.ZIP_DEFLATED)
        del members
        if os.path.getsize(path) > (2 << 20):
            raise RuntimeError("bomb not compact")
        tracemalloc.start()
        try:
            r = expect_error(lambda: spcompile.load(path), spcompile.ArtifactError, "larger than declared|limit")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        if peak > (32 << 20):
            raise Unclear(f"refused, but only after allocating {peak >> 20} MiB")
        return f"{r}; peak {peak >> 20} MiB"

    register("artifacts", "bomb:deflated-member", zip_bomb, quick=True)

    def npy_header_bomb(ctx):
        members = members_of(ctx.artifact("zip"))
        members["arrays.npz"] = huge_npy_npz(members["arrays.npz"])

        def change(m):
            m["arrays"]["data"]["shape"] = [1 << 40]
        path = write_members(os.path.join(ctx.tmp, "h.spc"), reseal(members, change))
        return _load_refused(ctx, path, "sum", "declares|large|limit")

    register("artifacts", "bomb:npy-header-huge", npy_header_bomb)

    def inner_deflate_bomb(gib):
        def fn(ctx):
            import tracemalloc

            members = members_of(ctx.artifact("zip"))
            with zipfile.ZipFile(io.BytesIO(members["arrays.npz"])) as z:
                inner = {n: z.read(n) for n in z.namelist()}
            n = (gib << 30) // 4
            hdr = io.BytesIO()
            np.lib.format.write_array_header_1_0(hdr, {"descr": "<f4", "fortran_order": False, "shape": (n,)})
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
                for name, b in inner.items():
                    if name != "data.npy":
                        z.writestr(name, b)
                with z.open("data.npy", "w", force_zip64=True) as f:
                    f.write(hdr.getvalue())
                    chunk = bytes(64 << 20)
                    for _ in range((n * 4) // len(chunk)):
                        f.write(chunk)
            members["arrays.npz"] = buf.getvalue()
            if len(members["arrays.npz"]) > (64 << 20):
                raise RuntimeError("inner bomb not compact")

            def change(m):
                m["arrays"]["data"]["shape"] = [n]
            path = write_members(os.path.join(ctx.tmp, "ib.spc"), reseal(members, change))
            del members, buf
            tracemalloc.start()
            t0 = time.perf_counter()
            try:
                r = _load_refused(ctx, path, "sum", None)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            secs = time.perf_counter() - t0
            if peak > (256 << 20):
                raise Unclear(f"{os.path.getsize(path) >> 10} KiB artifact refused only after allocating "
                              f"{peak >> 20} MiB in {secs:.1f} s ({r[:120]})")
            return f"{r}; peak {peak >> 20} MiB, {secs:.1f} s"
        return fn

    register("artifacts", "bomb:inner-npy-deflates-to-1GiB", inner_deflate_bomb(1), timeout=120)

    # 6. zip-slip and other hostile names
    def slip(name, where="files"):
        def fn(ctx):
            import spcompile

            members = members_of(ctx.artifact("zip"))
            if where == "files":
                if name:   # (an empty name cannot be a zip member: only the manifest names it)
                    members[name] = members.pop("kernel.so")

                def pre(m):
                    for k in ("files", "sizes"):
                        m[k][name] = m[k].pop("kernel.so")
                members = reseal(members, pre=pre)
            else:   # a hostile member name inside arrays.npz
                with zipfile.ZipFile(io.BytesIO(members["arrays.npz"])) as z:
                    inner = {n: z.read(n) for n in z.namelist()}
                inner[name] = inner.pop("row_ids.npy")
                buf = io.BytesIO()
                with zipfile.ZipFile(buf, "w") as z:
                    for n, b in inner.items():
                        z.writestr(n, b)
                members["arrays.npz"] = buf.getvalue()
                members = reseal(members)
            sub = os.path.join(ctx.tmp, "a", "b")
            os.makedirs(sub)
            path = write_members(os.path.join(sub, "slip.spc"), members)
            absolute = os.path.isabs(name) and not os.path.exists(name)
            before = set(_walk(ctx.tmp)) | set(_walk(tempfile.gettempdir(), depth=1))
            r = expect_error(lambda: spcompile.load(path), spcompile.ArtifactError, "unsafe|unexpected|name|member")
            after = set(_walk(ctx.tmp)) | set(_walk(tempfile.gettempdir(), depth=1))
            new = sorted(p for p in after - before if not os.path.basename(p).startswith("spcompile-"))
            if absolute and os.path.exists(name):
                new.append(name)
            if new:
                raise Wrong(f"refused, but wrote {new[:3]}")
            return r
        return fn

    slip_names = {"parent": "../evil.so", "deep-parent": "../../../tmp/evil.so", "absolute": "/tmp/evil-abs.so",
                  "subdir": "sub/dir.so", "dotdot": "..", "dot": ".", "backslash": "kernel.so\\..\\x",
                  "long-name": "k" * 300 + ".so", "empty-name": ""}
    for tag, name in slip_names.items():
        register("artifacts", f"zip-slip:{tag}", slip(name), quick=(tag == "parent"))
    register("artifacts", "zip-slip:npz-member", slip("../x.npy", "npz"))
    register("artifacts", "zip-slip:npz-member-abs", slip("/tmp/x.npy", "npz"))

    def dir_special(kind):
        def fn(ctx):
            d = os.path.join(ctx.tmp, "d")
            shutil.copytree(ctx.artifact("dir"), d)
            victim = os.path.join(d, "kernel.so" if kind != "manifest-dev-zero" else "manifest.json")
            os.remove(victim)
            if kind == "fifo":
                os.mkfifo(victim)
            elif kind == "symlink-dev-zero" or kind == "manifest-dev-zero":
                os.symlink("/dev/zero", victim)
            elif kind == "symlink-outside":
                os.symlink("/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd", victim)
            elif kind == "directory":
                os.mkdir(victim)
            return _load_refused(ctx, d, "sum", None)
        return fn

    for kind in ("fifo", "symlink-dev-zero", "manifest-dev-zero", "symlink-outside", "directory"):
        register("artifacts", f"dir-member:{kind}", dir_special(kind), timeout=30)

    # 7. paths that are not artifacts
    def bad_path(kind):
        def fn(ctx):
            import spcompile

            p = os.path.join(ctx.tmp, "x.spc")
            if kind == "not-a-zip":
                with open(p, "wb") as f:
                    f.write(os.urandom(3000))
            elif kind == "empty-file":
                open(p, "wb").close()
            elif kind == "empty-dir":
                os.mkdir(p)
            elif kind == "zip-without-manifest":
                write_members(p, {"arrays.npz": b"x"})
            elif kind == "empty-zip":
                write_members(p, {})
            elif kind == "fifo":
                os.mkfifo(p)
            elif kind == "dev-null":
                p = "/dev/null"
            elif kind == "pdf-header":
                with open(p, "wb") as f:
                    f.write(b"%PDF-1.4\n" + b"x" * 100)
            elif kind == "npz-not-artifact":
                with open(p, "wb") as f:
                    f.write(npz_bytes({"a": np.zeros(3)}))
            elif kind == "path-with-nul":
                p = p + "\0x"
            return expect_error(lambda: spcompile.load(p), (spcompile.ArtifactError, FileNotFoundError),
                                "artifact|no such|not")
        return fn

    for kind in ("not-a-zip", "empty-file", "empty-dir", "missing", "zip-without-manifest", "empty-zip", "fifo",
                 "dev-null", "pdf-header", "npz-not-artifact", "path-with-nul"):
        register("artifacts", f"path:{kind}", bad_path(kind), timeout=30, quick=kind == "not-a-zip")

    # 8. signatures
    def sig_case(kind):
        def fn(ctx):
            import spcompile

            members = members_of(ctx.artifact("zip", signed=kind != "unsigned-required"))
            kw = {"key": KEY, "require_signature": True}
            match = "signature"
            if kind == "library-replaced":
                other = members_of(ctx.artifact("zip", "max"))
                members["kernel.so"] = other["kernel.so"]
                members = reseal(members)
            elif kind == "arrays-replaced":
                a = arrays_of(members)
                a["data"] = a["data"] * 2
                members = reseal(members, arrays=a)
            elif kind == "manifest-edited":
                members = reseal(members, lambda m: m["pass_log"].append({"name": "evil"}))
            elif kind == "stripped":
                members = reseal(members, lambda m: m.pop("signature"))
                match = "not signed"
            elif kind == "alg-none":
                members = reseal(members, lambda m: m.update(signature={"alg": "none", "mac": ""}))
            elif kind == "signature-of-another-artifact":
                sig = json.loads(members_of(ctx.artifact("zip", "max", signed=True))["manifest.json"])["signature"]
                members = reseal(members, lambda m: m.update(signature=sig))
            elif kind == "other-key":
                kw = {"key": OTHER_KEY, "require_signature": True}
            elif kind == "unsigned-required":
                match = "not signed"
            elif kind == "no-key-required":
                kw = {"require_signature": True}
                match = "key"
            elif kind == "key-too-short":
                kw = {"key": b"short", "require_signature": True}
                match = "short"
            elif kind == "library-replaced-no-requirement-but-key":
                other = members_of(ctx.artifact("zip", "max"))
                members["kernel.so"] = other["kernel.so"]
                members = reseal(members)
                kw = {"key": KEY}
            path = write_members(os.path.join(ctx.tmp, "s.spc"), members)
            types = ValueError if kind in ("no-key-required", "key-too-short") else spcompile.ArtifactError
            return expect_error(lambda: spcompile.load(path, **kw), types, match)
        return fn

    for kind in ("library-replaced", "arrays-replaced", "manifest-edited", "stripped", "alg-none",
                 "signature-of-another-artifact", "other-key", "unsigned-required", "no-key-required",
                 "key-too-short", "library-replaced-no-requirement-but-key"):
        register("artifacts", f"signature:{kind}", sig_case(kind), quick=kind == "library-replaced")

    def sig_env(ctx):
        import spcompile

        members = members_of(ctx.artifact("zip", signed=True))
        members["kernel.so"] = members_of(ctx.artifact("zip", "max"))["kernel.so"]
        path = write_members(os.path.join(ctx.tmp, "e.spc"), reseal(members))
        os.environ["SPCOMPILE_ARTIFACT_KEY"] = KEY.decode()
        os.environ["SPCOMPILE_ARTIFACT_REQUIRE_SIGNATURE"] = "1"
        try:
            return expect_error(lambda: spcompile.load(path), spcompile.ArtifactError, "signature")
        finally:
            os.environ.pop("SPCOMPILE_ARTIFACT_KEY", None)
            os.environ.pop("SPCOMPILE_ARTIFACT_REQUIRE_SIGNATURE", None)

    register("artifacts", "signature:required-by-environment", sig_env)

    # 9. `spcompile info` on bad artifacts: one line, non-zero exit, no traceback
    def info_case(kind):
        def fn(ctx):
            p = os.path.join(ctx.tmp, "i.spc")
            args, env = ["info", p], None
            match = None
            if kind == "junk":
                with open(p, "wb") as f:
                    f.write(b"junk" * 10)
            elif kind == "missing":
                pass
            elif kind == "deep-manifest":
                write_members(p, {"manifest.json": b"[" * 50_000 + b"]" * 50_000})
            elif kind == "bad-arrays":
                members = members_of(ctx.artifact("zip"))
                a = arrays_of(members)
                a["indices"] = a["indices"] + 10_000
                write_members(p, reseal(members, arrays=a))
            elif kind == "flipped-library":
                members = members_of(ctx.artifact("zip"))
                members["kernel.so"] = _flip(members["kernel.so"], 100)
                write_members(p, members)
            elif kind == "unsigned-required":
                shutil.copy(ctx.artifact("zip"), p)
                args = ["info", "--require-signature", p]
                env = {"SPCOMPILE_ARTIFACT_KEY": KEY.decode()}
                match = "not signed"
            elif kind == "resealed-library-required":
                members = members_of(ctx.artifact("zip", signed=True))
                members["kernel.so"] = members_of(ctx.artifact("zip", "max"))["kernel.so"]
                write_members(p, reseal(members))
                args = ["info", "--require-signature", p]
                env = {"SPCOMPILE_ARTIFACT_KEY": KEY.decode()}
                match = "signature"
            elif kind == "tuning-not-a-dict":
                write_members(p, reseal(members_of(ctx.artifact("zip")), lambda m: m.update(tuning=5)))
                # info prints what the artifact holds: accepted with exit 0 is fine when load() accepts it too
            elif kind == "pass-log-int":
                write_members(p, reseal(members_of(ctx.artifact("zip")), lambda m: m.update(pass_log=5)))
            elif kind == "directory":
                os.mkdir(p)
            elif kind == "huge-int":
                write_members(p, reseal(members_of(ctx.artifact("zip")), wk(nnz="@HUGE@"),
                                        raw={"@HUGE@": "1" + "0" * 5000}))
            if kind in ("tuning-not-a-dict", "pass-log-int"):
                rc, out, err = run_cli(args, env_extra=env)
                if "Traceback" in err or rc < 0:
                    raise Unclear(f"rc={rc}, traceback: {err.strip().splitlines()[-1][:200] if err.strip() else ''}")
                if rc == 0:
                    import spcompile

                    return expect_error(lambda: spcompile.load(p), spcompile.ArtifactError, None,
                                        accept=lambda m: loads_correctly(ctx, "sum", p)) + " (info: rc=0)"
                lines = [ln for ln in err.splitlines() if ln.strip()]
                if len(lines) != 1:
                    raise Unclear(f"{len(lines)} lines on stderr")
                return f"rc={rc}: {lines[0][:200]}"
            return expect_cli_error(args, match, env_extra=env)
        return fn

    for kind in ("junk", "missing", "deep-manifest", "bad-arrays", "flipped-library", "unsigned-required",
                 "resealed-library-required", "tuning-not-a-dict", "pass-log-int", "directory", "huge-int"):
        register("artifacts", f"cli-info:{kind}", info_case(kind), timeout=90, quick=kind == "bad-arrays")


def _walk(root: str, depth: int = 10):
    root = os.path.abspath(root)
    base = root.count(os.sep)
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath.count(os.sep) - base >= depth:
            dirnames[:] = []
        for n in filenames + dirnames:
            yield os.path.join(dirpath, n)


# -- inputs ---------------------------------------------------------------------------------------

def _build(A, op="spmm", K=4, reduce=None, **kw):
    import spcompile

    kw.setdefault("target", "cpu")
    if "template" not in kw and "params" not in kw:
        kw.setdefault("pipeline", [])
    return spcompile.build(A, op, K=K, reduce=reduce, **kw)


def _ref_for(A, op, reduce, *ins):
    """float64 reference on scipy's own canonical form of ``A`` (duplicates summed, sorted)."""
    import numpy as np
    import scipy.sparse as sp

    from spcompile.core import reference
    from spcompile.core.formats import CSR

    S = A if sp.issparse(A) else sp.csr_matrix((A[2], A[1], A[0]), shape=A[3])
    S = sp.csr_matrix(S, dtype=np.float32, copy=True)
    S.sum_duplicates()
    S.sort_indices()
    C = CSR(S.indptr.astype(np.int64), S.indices.astype(np.int64), S.data.astype(np.float32), S.shape)
    return reference.run(op, reduce, C, *ins)


def _input_cases() -> None:
    import numpy as np

    # 1. read-only inputs: correct, and not written
    def read_only(kind, which):
        def fn(ctx):
            m = ctx.mod(which)
            ins = ctx.inputs(which, seed=3)
            ro = []
            for i, x in enumerate(ins):
                if kind == "frombuffer":
                    y = np.frombuffer(x.tobytes(), dtype=x.dtype).reshape(x.shape)
                elif kind == "setflags":
                    y = x.copy()
                    y.setflags(write=False)
                elif kind == "memmap-r":
                    p = os.path.join(ctx.tmp, f"x{i}.bin")
                    x.tofile(p)
                    y = np.memmap(p, dtype=x.dtype, mode="r", shape=x.shape)
                else:   # strided, read-only
                    y = np.repeat(x, 2, axis=1)[:, ::2]
                    y.setflags(write=False)
                ro.append(y)
            want = ctx.reference(which, *ins)
            r = check_close(m(*ro), want, "first call")
            check_close(m(*ro), want, "repeated call")
            for a, b in zip(ro, ins):
                if not np.array_equal(np.asarray(a), b):
                    raise Wrong("a read-only input was modified")
            return r
        return fn

    for which in ("sum", "max", "sddmm"):
        for kind in ("frombuffer", "setflags", "memmap-r", "strided-read-only"):
            register("inputs", f"read-only:{kind}:{which}", read_only(kind, which),
                     quick=(kind == "memmap-r" and which == "sum"))

    def ro_out(ctx):
        m = ctx.mod("sum")
        out = np.empty((m.shape[0], m.K), np.float32)
        out.setflags(write=False)
        return expect_error(lambda: m(*ctx.inputs("sum"), out=out), ValueError, "writable")

    register("inputs", "out:read-only", ro_out)

    # 2. out aliasing an input
    def alias(kind):
        def fn(ctx):
            if kind.startswith("sddmm"):
                m = ctx.mod("sddmm")
                X, Y = ctx.inputs("sddmm")
                nnz = m.key.nnz
                flat = np.zeros(X.size + Y.size + nnz, np.float32)
                flat[:X.size] = X.ravel()
                flat[X.size:X.size + Y.size] = Y.ravel()
                x = flat[:X.size].reshape(X.shape)
                y = flat[X.size:X.size + Y.size].reshape(Y.shape)
                out = flat[X.size - 5:X.size - 5 + nnz] if kind == "sddmm-X" else flat[X.size + 3:X.size + 3 + nnz]
                return expect_error(lambda: m(x, y, out=out), ValueError, "shares memory")
            m = ctx.mod("square")
            X = ctx.inputs("square")[0]
            want = ctx.reference("square", X)
            if kind == "same":
                return expect_error(lambda: m(X, out=X), ValueError, "shares memory")
            if kind == "partial":
                buf = np.zeros((90, 8), np.float32)
                buf[:60] = X
                return expect_error(lambda: m(buf[:60], out=buf[30:90]), ValueError, "shares memory")
            if kind == "after-good-call":
                m(X, out=np.empty((60, 8), np.float32))
                return expect_error(lambda: m(X, out=X), ValueError, "shares memory")
            if kind == "torch":
                import torch

                t = torch.from_numpy(X.copy())
                return expect_error(lambda: m(t, out=t), ValueError, "shares memory")
            if kind == "view-of-transposed":
                buf = np.ascontiguousarray(X)
                out = buf.view()
                return expect_error(lambda: m(buf, out=out), ValueError, "shares memory")
            if kind == "adjacent-no-overlap":
                buf = np.zeros((120, 8), np.float32)
                buf[:60] = X
                return check_close(m(buf[:60], out=buf[60:]), want, "adjacent out")
            raise KeyError(kind)
        return fn

    for kind in ("same", "partial", "after-good-call", "torch", "view-of-transposed", "adjacent-no-overlap",
                 "sddmm-X", "sddmm-Y"):
        register("inputs", f"out-alias:{kind}", alias(kind), quick=kind == "same")

    # 3. NaN / Inf in X or in A's values, every reduction and SDDMM
    def special(which, where, value, params=None):
        def fn(ctx):
            A = ctx.matrix("A")
            A.data[::9] = 0.0   # explicit zeros: inf * 0 = NaN in the reference too
            rng = np.random.default_rng(11)
            K = 4
            if where == "A":
                A.data[[1, 17, 40]] = value
                A.data[41] = -value if value == value else value
            if which == "sddmm":
                X = rng.standard_normal((A.shape[0], K)).astype(np.float32)
                Y = rng.standard_normal((A.shape[1], K)).astype(np.float32)
                if where == "X":
                    X[2, 1] = value
                    Y[7, :] = value
                ins = (X, Y)
                m = _build(A, "sddmm", K, **({"params": params} if params else {}))
            else:
                X = rng.standard_normal((A.shape[1], K)).astype(np.float32)
                if where == "X":
                    X[3, 1] = value
                    X[7, :] = value
                    X[11, 2] = -value
                ins = (X,)
                m = _build(A, "spmm", K, which, **({"params": params} if params else {}))
            ref = _ref_for(A, "sddmm" if which == "sddmm" else "spmm", None if which == "sddmm" else which, *ins)
            if not (np.isnan(ref).any() or np.isinf(ref).any()):
                raise RuntimeError("probe: the reference has no NaN / Inf")
            return check_close(m(*ins), ref, f"{which} with {value} in {where}")
        return fn

    for which in ("sum", "mean", "max", "min", "sddmm"):
        for where in ("X", "A"):
            for vname, value in (("nan", float("nan")), ("inf", float("inf"))):
                register("inputs", f"special:{vname}-in-{where}:{which}", special(which, where, value),
                         quick=(which == "max" and vname == "nan"))
    for which in ("max", "min"):
        register("inputs", f"special:nan-in-X:{which}:parallel",
                 special(which, "X", float("nan"), {"parallel": True, "k_tile": 4}))

    # 4. wrong dtype / shape / ndim / layout / kind of X
    def call_case(make, which="sum", exc=None, match=None):
        def fn(ctx):
            m = ctx.mod(which)
            ins = ctx.inputs(which, seed=5)
            bad = make(ins, m)
            if exc is None:   # must compute the right result
                return check_close(m(*bad), ctx.reference(which, *[np.asarray(b, dtype=np.float32) for b in bad]))
            return expect_error(lambda: m(*bad), exc, match)
        return fn

    calls = {
        "dtype-float64": (lambda i, m: (i[0].astype(np.float64),), TypeError, "dtype"),
        "dtype-int32": (lambda i, m: (i[0].astype(np.int32),), TypeError, "dtype"),
        "dtype-float16": (lambda i, m: (i[0].astype(np.float16),), TypeError, "dtype"),
        "dtype-bool": (lambda i, m: (i[0] > 0,), TypeError, "dtype"),
        "dtype-complex": (lambda i, m: (i[0].astype(np.complex64),), TypeError, "dtype"),
        "dtype-object": (lambda i, m: (i[0].astype(object),), TypeError, "dtype"),
        "shape-rows+1": (lambda i, m: (np.zeros((m.shape[1] + 1, m.K), np.float32),), ValueError, "shape"),
        "shape-K+1": (lambda i, m: (np.zeros((m.shape[1], m.K + 1), np.float32),), ValueError, "shape|K"),
        "shape-transposed": (lambda i, m: (np.ascontiguousarray(i[0].T),), ValueError, "shape"),
        "ndim-1": (lambda i, m: (i[0].ravel(),), ValueError, "shape"),
        "ndim-3": (lambda i, m: (i[0][None],), ValueError, "shape"),
        "ndim-0": (lambda i, m: (np.float32(1.0),), (ValueError, TypeError), "shape|array"),
        "empty-rows": (lambda i, m: (np.zeros((0, m.K), np.float32),), ValueError, "shape"),
        "fortran-order": (lambda i, m: (np.asfortranarray(i[0]),), None, None),
        "strided-columns": (lambda i, m: (np.repeat(i[0], 2, axis=1)[:, ::2],), None, None),
        "negative-strides": (lambda i, m: (np.ascontiguousarray(i[0][::-1])[::-1],), None, None),
        "broadcast-zero-strides": (lambda i, m: (np.broadcast_to(i[0][:1], i[0].shape),), None, None),
        "unaligned": (lambda i, m: (np.frombuffer(b"\0" + i[0].tobytes(), dtype=np.float32, offset=1)
                                    .reshape(i[0].shape),), None, None),
        "list": (lambda i, m: (i[0].tolist(),), TypeError, "numpy|array|tensor"),
        "none": (lambda i, m: (None,), TypeError, "numpy|array|tensor"),
        "string": (lambda i, m: ("X",), TypeError, "numpy|array|tensor"),
        "two-inputs-for-spmm": (lambda i, m: (i[0], i[0]), TypeError, "input"),
        "no-input": (lambda i, m: (), TypeError, "input"),
        "torch-float32": (lambda i, m: (__import__("torch").from_numpy(i[0].copy()),), None, None),
        "torch-float64": (lambda i, m: (__import__("torch").from_numpy(i[0].astype(np.float64)),), TypeError,
                          "dtype"),
        "torch-requires-grad": (lambda i, m: (__import__("torch").from_numpy(i[0].copy()).requires_grad_(),),
                                RuntimeError, "grad"),
        "matrix-subclass": (lambda i, m: (np.asmatrix(i[0]),), None, None),
        "masked-array": (lambda i, m: (np.ma.masked_array(i[0], mask=i[0] > 1),), None, None),
    }
    for name, (make, exc, match) in calls.items():
        register("inputs", f"X:{name}", call_case(make, "sum", exc, match),
                 quick=name in ("dtype-float64", "fortran-order", "list"))
    register("inputs", "X:sddmm-one-input", call_case(lambda i, m: (i[0],), "sddmm", TypeError, "input"))
    register("inputs", "X:sddmm-Y-wrong-shape",
             call_case(lambda i, m: (i[0], i[1][:-1]), "sddmm", ValueError, "shape"))
    register("inputs", "X:sddmm-mixed-kinds",
             call_case(lambda i, m: (i[0], __import__("torch").from_numpy(i[1])), "sddmm", TypeError, "mix"))

    def out_case(make, match):
        def fn(ctx):
            m = ctx.mod("sum")
            X = ctx.inputs("sum")[0]
            return expect_error(lambda: m(X, out=make(m)), ValueError, match)
        return fn

    register("inputs", "out:wrong-dtype", out_case(lambda m: np.empty((m.shape[0], m.K), np.float64), "out"))
    register("inputs", "out:wrong-shape", out_case(lambda m: np.empty((m.shape[0], m.K + 1), np.float32), "out"))
    register("inputs", "out:fortran", out_case(lambda m: np.empty((m.shape[0], m.K), np.float32, order="F"), "out"))
    register("inputs", "out:list", out_case(lambda m: [[0.0] * m.K] * m.shape[0], "out"))

    # 5. template parameters, K, op / reduce / dtype / target names
    def build_refused(kw, exc, match, A="A"):
        def fn(ctx):
            mat = ctx.matrix(A)
            kw2 = dict(kw)
            op = kw2.pop("op", "spmm")
            K = kw2.pop("K", 4)
            reduce = kw2.pop("reduce", None)
            kw2.setdefault("target", "cpu")

            def accept(m):
                import spcompile

                if not isinstance(m, spcompile.CompiledModule):
                    raise Wrong(f"build returned {type(m).__name__}")
                ins = [np.random.default_rng(0).standard_normal(s).astype(m.key.dtype) for s in m._in_shapes]
                tol = {"rtol": 1e-12, "atol": 1e-12} if m.key.dtype == "float64" else {}   # computed in float64
                return check_close(m(*ins), _ref_for(mat, m.op, m.reduce, *ins), f"{m.key.dtype} {m.op}/{m.reduce} "
                                   f"K={m.K}", **tol)
            return expect_error(lambda: _build(mat, op, K, reduce, **kw2), exc, match, accept=accept)
        return fn

    params = {
        "k_tile=-5": {"k_tile": -5}, "k_tile=0": {"k_tile": 0}, "k_tile=2**40": {"k_tile": 2 ** 40},
        "k_tile=2.5": {"k_tile": 2.5}, "k_tile='8'": {"k_tile": "8"}, "k_tile=None": {"k_tile": None},
        "k_tile=nan": {"k_tile": float("nan")}, "k_tile=True": {"k_tile": True},
        "tasks_per_thread=0": {"tasks_per_thread": 0}, "tasks_per_thread=-1": {"tasks_per_thread": -1},
        "balance=fast": {"balance": "fast"}, "parallel=1": {"parallel": 1}, "parallel=yes": {"parallel": "yes"},
        "tile_order=None": {"tile_order": None}, "prefetch=-4": {"prefetch": -4}, "prefetch=10**9": {"prefetch": 10 ** 9},
        "unknown-name": {"warp_size": 32}, "params-list": [("k_tile", 4)], "params-string": "k_tile=4",
    }
    for name, p in params.items():
        match = None if not isinstance(p, dict) else re.escape(next(iter(p)))
        register("inputs", f"params:{name.replace('**', '^').replace(chr(39), '')}",
                 build_refused({"params": p, "template": "cpu.csr_spmm"}, (ValueError, TypeError),
                               match or "param"), quick=name == "k_tile=-5")
    register("inputs", "params:sddmm-k_tile=0",
             build_refused({"op": "sddmm", "K": 3, "params": {"k_tile": 0}}, ValueError, "k_tile"))
    register("inputs", "template:unknown", build_refused({"template": "cpu.nonexistent"}, ValueError, "template"))
    register("inputs", "template:other-op", build_refused({"template": "cpu.csr_sddmm"}, ValueError,
                                                          "template|op|sddmm|support"))
    register("inputs", "template:cuda-on-cpu", build_refused({"template": "csr.crc_cwm"}, (ValueError, RuntimeError),
                                                             "target|cuda|cpu"))
    register("inputs", "pipeline:unknown-pass", build_refused({"pipeline": ["reorder.nonexistent"]}, ValueError,
                                                              "pass"))
    register("inputs", "pipeline:bad-option", build_refused({"pipeline": [{"name": "reorder.degree",
                                                                           "options": {"evil": 1}}]},
                                                            (ValueError, TypeError), "evil|option"))
    register("inputs", "pipeline:not-a-list", build_refused({"pipeline": 42}, (ValueError, TypeError), "pipeline|pass"))

    Ks = {"0": 0, "-1": -1, "2^40": 2 ** 40, "2^20+1": (1 << 20) + 1, "2.5": 2.5, "2.0": 2.0, "'4'": "4",
          "None": None, "True": True, "nan": float("nan"), "numpy-int64-4": np.int64(4), "numpy-float-4": np.float32(4)}
    for name, K in Ks.items():
        register("inputs", f"K:{name.replace(chr(39), '')}",
                 build_refused({"K": K}, (ValueError, TypeError), "K"), quick=name == "2^40")
    names = {"op=spmv": {"op": "spmv"}, "op=SPMM": {"op": "SPMM"}, "op=empty": {"op": ""}, "op=None": {"op": None},
             "reduce=avg": {"reduce": "avg"}, "reduce=prod": {"reduce": "prod"}, "reduce=SUM": {"reduce": "SUM"},
             "reduce-on-sddmm": {"op": "sddmm", "reduce": "max"}, "reduce=1": {"reduce": 1},
             "dtype=float128": {"dtype": "float128"}, "dtype=int8": {"dtype": "int8"},
             "dtype=float64": {"dtype": "float64"}, "dtype=float64-on-cuda": {"dtype": "float64", "target": "cuda"},
             "dtype=float16-on-cpu": {"dtype": "float16"},
             "dtype=np.float32": {"dtype": np.float32}, "target=gpu": {"target": "gpu"},
             "target=tpu": {"target": "tpu"}, "target=empty": {"target": ""}, "target=None": {"target": None},
             "target=CPU": {"target": "CPU"}, "precision=fp8": {"precision": "fp8"}}
    for name, kw in names.items():
        what = next(iter(kw)) if name != "reduce-on-sddmm" else "reduce"
        register("inputs", f"name:{name}", build_refused(kw, (ValueError, TypeError), what),
                 quick=name == "op=spmv")

    # 6. bad matrices
    def tup(indptr, indices, data, shape):
        return (np.asarray(indptr), np.asarray(indices), np.asarray(data, dtype=np.float32), shape)

    bad_A = {
        "indptr-not-monotone": (lambda: tup([0, 2, 1, 3], [0, 1, 0], [1, 2, 3], (3, 3)), "monoton|decreas"),
        "indptr-not-from-0": (lambda: tup([1, 2, 3, 3], [0, 1, 0], [1, 2, 3], (3, 3)), "start|0"),
        "indptr-wrong-length": (lambda: tup([0, 1, 3], [0, 1, 0], [1, 2, 3], (3, 3)), "indptr|rows"),
        "negative-index": (lambda: tup([0, 1, 2, 3], [0, -1, 0], [1, 2, 3], (3, 3)), "negative"),
        "index-out-of-range": (lambda: tup([0, 1, 2, 3], [0, 3, 0], [1, 2, 3], (3, 3)), "range"),
        "index-int64-huge": (lambda: tup([0, 1, 2, 3], np.array([0, 2 ** 40, 0], np.int64), [1, 2, 3], (3, 3)),
                             "range"),
        "index-uint64-huge": (lambda: tup([0, 1, 2, 3], np.array([0, 2 ** 63, 0], np.uint64), [1, 2, 3], (3, 3)),
                              "range|negative"),
        "data-short": (lambda: tup([0, 1, 2, 3], [0, 1, 0], [1, 2], (3, 3)), "data|entries"),
        "indices-float": (lambda: tup([0, 1, 2, 3], np.array([0.0, 1.0, 0.0]), [1, 2, 3], (3, 3)), "integer"),
        "indices-2d": (lambda: tup([0, 1, 2, 3], np.array([[0, 1, 0]]), [1, 2, 3], (3, 3)), "1-D|dim"),
        "data-strings": (lambda: (np.array([0, 1, 2, 3]), np.array([0, 1, 0]), np.array(["a", "b", "c"]), (3, 3)),
                         "dtype|float|value|numeric"),
        "data-complex": (lambda: (np.array([0, 1, 2, 3]), np.array([0, 1, 0]), np.array([1j, 2, 3]), (3, 3)),
                         "complex|dtype|float|value"),
        "shape-negative": (lambda: tup([0], [], [], (-1, 3)), "shape|negative"),
        "shape-float": (lambda: tup([0, 1, 2, 3], [0, 1, 0], [1, 2, 3], (3.0, 3)), "shape|integer"),
        "shape-3d": (lambda: tup([0, 1, 2, 3], [0, 1, 0], [1, 2, 3], (3, 3, 1)), "shape|2"),
        "shape-too-few-cols": (lambda: tup([0, 1, 2, 3], [0, 1, 2], [1, 2, 3], (3, 2)), "range"),
        "dense-numpy": (lambda: np.eye(3, dtype=np.float32), "dense|sparse"),
        "none": (lambda: None, "sparse|unsupported|type"),
        "list": (lambda: [[1, 0], [0, 1]], "sparse|unsupported|type"),
        "tuple-of-3": (lambda: (np.array([0, 1]), np.array([0]), np.array([1.0])), "sparse|unsupported|tuple"),
        "coo-out-of-range": (lambda: __import__("scipy.sparse").sparse.coo_matrix(
            (np.ones(2, np.float32), (np.array([0, 5]), np.array([0, 1]))), shape=(3, 3), ) if False else
            _bad_coo(), "range"),
        "csc-corrupt": (lambda: _bad_csc(), "csc|invalid|range|indices"),
    }
    for name, (make, match) in bad_A.items():
        def fn(ctx, make=make, match=match):
            import spcompile

            A = make()
            return expect_error(lambda: spcompile.build(A, "spmm", K=4, target="cpu", pipeline=[]),
                                (ValueError, TypeError), match)
        register("inputs", f"A:{name}", fn, quick=name == "indptr-not-monotone")

    def good_A(make, op="spmm", reduce="sum", K=4):
        def fn(ctx):
            A = make()
            m = _build(A, op, K, reduce if op == "spmm" else None)
            shape = A[3] if isinstance(A, tuple) else A.shape
            rng = np.random.default_rng(2)
            ins = ([rng.standard_normal((shape[1], K)).astype(np.float32)] if op == "spmm" else
                   [rng.standard_normal((shape[0], K)).astype(np.float32),
                    rng.standard_normal((shape[1], K)).astype(np.float32)])
            return check_close(m(*ins), _ref_for(A, op, reduce if op == "spmm" else None, *ins), "result")
        return fn

    def dup():
        return tup([0, 3, 3, 5], [1, 1, 0, 2, 2], [1, 2, 3, 4, -4], (3, 4))

    def unsorted():
        return tup([0, 3, 4, 6], [2, 0, 1, 3, 1, 0], [1, 2, 3, 4, 5, 6], (3, 4))

    def int64():
        A = Ctx.matrix("A")
        return (A.indptr.astype(np.int64), A.indices.astype(np.int64), A.data, A.shape)

    def uint32():
        A = Ctx.matrix("A")
        return (A.indptr.astype(np.uint32), A.indices.astype(np.uint32), A.data, A.shape)

    import scipy.sparse as sp

    goods = {
        "0x0": lambda: tup([0], [], [], (0, 0)),
        "5x5-no-nonzeros": lambda: tup(np.zeros(6, int), [], [], (5, 5)),
        "1x1": lambda: tup([0, 1], [0], [2.5], (1, 1)),
        "duplicates": dup, "unsorted-indices": unsorted, "int64-indices": int64, "uint32-indices": uint32,
        "explicit-zeros": lambda: tup([0, 2, 2, 3], [0, 1, 2], [0.0, 0.0, 1.0], (3, 3)),
        "one-column": lambda: sp.random(40, 1, density=0.5, format="csr", random_state=1, dtype=np.float32),
        "one-row": lambda: sp.random(1, 40, density=0.5, format="csr", random_state=1, dtype=np.float32),
        "float64-values": lambda: sp.random(30, 20, density=0.2, format="csr", random_state=2, dtype=np.float64),
        "csc-input": lambda: sp.random(30, 20, density=0.2, format="csc", random_state=2, dtype=np.float32),
        "coo-with-duplicates": lambda: sp.coo_matrix((np.ones(4, np.float32), ([0, 0, 1, 2], [1, 1, 0, 2])),
                                                     shape=(3, 3)),
        "empty-rows-and-cols": lambda: tup([0, 0, 0, 2, 2], [0, 7], [1, 2], (4, 9)),
    }
    for name, make in goods.items():
        register("inputs", f"A-valid:{name}:spmm-max", good_A(make, "spmm", "max"), quick=name == "duplicates")
    for name in ("0x0", "5x5-no-nonzeros", "duplicates", "unsorted-indices"):
        register("inputs", f"A-valid:{name}:sddmm", good_A(goods[name], "sddmm"))
        register("inputs", f"A-valid:{name}:spmm-mean", good_A(goods[name], "spmm", "mean"))

    def huge_rows(ctx):
        """2**28 rows, 3 nonzeros: built in bounded time and memory, the right rows."""
        m = 1 << 28
        indptr = np.zeros(m + 1, np.int32)
        rows = [0, 5, m - 1]
        for r in rows:
            indptr[r + 1:] += 1
        A = (indptr, np.array([1, 2, 3], np.int32), np.array([1, 2, 3], np.float32), (m, 4))
        _build(Ctx.matrix("A"), "spmm", 1, "max")   # TVM's compiler loaded before measuring
        r0 = _rss()
        t0 = time.perf_counter()
        mod = _build(A, "spmm", 1, "max")
        secs = time.perf_counter() - t0
        peak = _peak_rss() - r0
        X = np.arange(4, dtype=np.float32).reshape(4, 1)
        Y = mod(X)
        if not np.array_equal(Y[rows, 0], np.array([1, 4, 9], np.float32)) or Y[1:5].any() or Y[6:1000].any():
            raise Wrong("wrong rows")
        per_row = peak / m
        detail = f"built in {secs:.1f} s, peak RSS growth {peak >> 20} MiB ({per_row:.1f} bytes/row)"
        if secs > 120:
            raise Unclear("too slow: " + detail)
        if per_row > 32:   # the README documents about 24 bytes per row at peak
            raise Unclear("memory over 32 bytes/row: " + detail)
        return detail, {"secs": secs, "peak_bytes": peak, "bytes_per_row": per_row}

    # the README documents ~24 bytes per row at peak (6.5 GB for 2**28 rows) on top of the
    # caller's own arrays and TVM's ~1 GB of mappings: this one worker gets a 16 GiB limit
    register("inputs", "A-valid:2^28-rows-3-nonzeros", huge_rows, timeout=300, fresh=True, as_limit=16 << 30)


def _bad_coo():
    import numpy as np
    import scipy.sparse as sp

    A = sp.coo_matrix((np.ones(2, np.float32), (np.array([0, 1]), np.array([0, 1]))), shape=(3, 3))
    A.row = np.array([0, 5], dtype=A.row.dtype)    # corrupted after construction
    return A


def _bad_csc():
    import numpy as np
    import scipy.sparse as sp

    A = sp.random(5, 5, density=0.4, format="csc", random_state=0, dtype=np.float32)
    A.indices = A.indices.copy()
    A.indices[0] = 99
    return A


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- passes ---------------------------------------------------------------------------------------

PASS_SIZES = (250_000, 500_000, 1_000_000)
PASS_SHAPES = ("dense-column", "hub-row", "diagonal", "tall-skinny")
PASS_CHILD_TIMEOUT = 120.0


class Hang(Outcome):
    status = "hang"


def adversarial_matrix(shape: str, nnz: int, seed: int = 0):
    """About ``nnz`` stored entries: one dense column (every row holds column 0), one hub row
    (row 0 holds every column), a long diagonal (many rows of one entry), or a tall-skinny
    non-square matrix (rows >> cols)."""
    import numpy as np
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    if shape == "diagonal":
        n = nnz
        return sp.csr_matrix((np.ones(n, np.float32), np.arange(n, dtype=np.int32), np.arange(n + 1, dtype=np.int32)),
                             shape=(n, n))
    if shape == "dense-column":
        m = nnz // 2
        rows = np.concatenate([np.arange(m), rng.integers(0, m, nnz - m)])
        cols = np.concatenate([np.zeros(m, np.int64), rng.integers(1, m, nnz - m)])
        shp = (m, m)
    elif shape == "hub-row":
        n = nnz // 2
        rows = np.concatenate([np.zeros(n, np.int64), rng.integers(1, n, nnz - n)])
        cols = np.concatenate([np.arange(n), rng.integers(0, n, nnz - n)])
        shp = (n, n)
    elif shape == "tall-skinny":
        m = nnz // 8
        rows = np.repeat(np.arange(m), 8)
        cols = rng.integers(0, 1000, m * 8)
        shp = (m, 1000)
    else:
        raise ValueError(shape)
    A = sp.csr_matrix((np.ones(rows.size, np.float32), (rows, cols)), shape=shp)
    A.sum_duplicates()
    return A


PASS_SPECS = {   # case label -> (registered pass, options)
    "reorder.degree": ("reorder.degree", {}), "reorder.rcm": ("reorder.rcm", {}),
    "cluster.lsh": ("cluster.lsh", {}), "cluster.lsh:skip=False": ("cluster.lsh", {"skip": False}),
    "format.vnm": ("format.vnm", {}), "reorder.vnm": ("reorder.vnm", {}), "tile.aspt": ("tile.aspt", {}),
    "tile.sgt": ("tile.sgt", {}),
}


def measure_pass_main(label: str, shape: str, nnz: str, out: str) -> int:
    """Child interpreter: one pass on one matrix; wall time and peak RSS growth, as JSON."""
    _set_limits()
    import warnings

    warnings.simplefilter("ignore")
    import numpy as np

    from spcompile.compile import make_op
    from spcompile.core.ir import SparseModule
    from spcompile.passes import Pipeline, get_pass

    name, options = PASS_SPECS[label]
    res: dict = {"pass": label, "shape": shape}
    try:
        A = adversarial_matrix(shape, int(nnz))
        res.update(rows=A.shape[0], cols=A.shape[1], nnz=int(A.nnz))
        mod = SparseModule.from_op(make_op(A, "spmm", 32, "sum"))
        del A
        p = get_pass(name, **options)
        r0 = _rss()
        t0 = time.perf_counter()
        outm = Pipeline([p])(mod)
        res["secs"] = time.perf_counter() - t0
        res["peak_growth"] = max(0, _peak_rss() - r0)
        met = dict(outm.metrics.get(name, {}))
        res["skipped"] = bool(met.get("skipped"))
        res["skip_reason"] = met.get("skip_reason")
        for what, perm, n in (("row_perm", outm.row_perm, outm.A.shape[0]), ("col_perm", outm.col_perm, outm.A.shape[1])):
            if perm is not None:
                perm = np.asarray(perm)
                if perm.shape != (n,) or not np.array_equal(np.bincount(perm, minlength=n), np.ones(n, np.int64)):
                    res["error"] = f"{what} is not a permutation"
        if outm.A.nnz != res["nnz"]:
            res["error"] = f"the pass changed nnz {res['nnz']} -> {outm.A.nnz}"
    except MemoryError as e:
        res["error"] = f"MemoryError: {e}"
    except Exception as e:  # noqa: BLE001
        res["error"] = _msg(e)
        res["exc_type"] = type(e).__name__
    with open(out, "w") as f:
        json.dump(res, f, default=str)
    return 0


def _pass_cases() -> None:
    def fn_for(label, shape):
        def fn(ctx):
            runs = []
            for nnz in PASS_SIZES:
                out = os.path.join(ctx.tmp, f"m{nnz}.json")
                env = worker_env()
                cmd = [sys.executable, os.path.abspath(__file__), "--measure-pass", label, shape, str(nnz), out]
                try:
                    p = subprocess.run(cmd, env=env, cwd=ctx.tmp, timeout=PASS_CHILD_TIMEOUT, capture_output=True,
                                       text=True)
                except subprocess.TimeoutExpired:
                    raise Hang(f"nnz={nnz}: no result within {PASS_CHILD_TIMEOUT:g} s "
                               f"(earlier sizes: {_fmt_runs(runs)})") from None
                if p.returncode != 0 or not os.path.exists(out):
                    how = (f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0
                           else f"exit {p.returncode}")
                    tail = " | ".join(p.stderr.strip().splitlines()[-2:])[-300:]
                    raise Unclear(f"nnz={nnz}: the measuring interpreter died ({how}): {tail}")
                with open(out) as f:
                    r = json.load(f)
                if r.get("error"):
                    raise Unclear(f"nnz={r.get('nnz', nnz)}: {r['error']}")
                runs.append(r)
            extra = {"runs": runs}
            # grows no worse than ~2x the nnz growth plus a constant (1 s, 64 MiB)
            for a, b in zip(runs, runs[1:]):
                f = b["nnz"] / max(a["nnz"], 1)
                if b["secs"] > 2 * f * a["secs"] + 1.0:
                    raise Unclear(f"time grows super-linearly: {_fmt_runs(runs)}")
                if b["peak_growth"] > 2 * f * a["peak_growth"] + (64 << 20):
                    raise Unclear(f"memory grows super-linearly: {_fmt_runs(runs)}")
            skipped = [r for r in runs if r["skipped"]]
            for r in skipped:
                if not r.get("skip_reason"):
                    raise Unclear(f"skipped without a reason at nnz={r['nnz']}")
            note = f"; skipped: {skipped[0]['skip_reason']}" if skipped else ""
            return f"{_fmt_runs(runs)}{note}", extra
        return fn

    for label in PASS_SPECS:
        for shape in PASS_SHAPES:
            register("passes", f"{label}:{shape}", fn_for(label, shape), timeout=3 * PASS_CHILD_TIMEOUT + 60,
                     quick=(label == "reorder.rcm" and shape == "dense-column"))


def _fmt_runs(runs) -> str:
    return ", ".join(f"nnz={r['nnz']}: {r['secs']:.2f}s/{r['peak_growth'] >> 20}MiB" for r in runs) or "none"


# -- database -------------------------------------------------------------------------------------

#: the record the probe stores: parameters no heuristic would choose, so that a build that used
#: it shows them (k_tile=2, prefetch=4)
RECORD_PARAMS = {"k_tile": 2, "prefetch": 4}


def _db_reset() -> None:
    from spcompile.autotune import database as dbm
    from spcompile.autotune import policy

    dbm._DBS.clear()
    dbm._WARNED.clear()
    policy._WARNED_DEFAULT.clear()


def _graph(n=90, seed=0):
    import numpy as np
    import scipy.sparse as sp

    A = sp.random(n, n, density=0.05, format="csr", random_state=seed, dtype=np.float32)
    A.data[:] = np.random.default_rng(seed).uniform(0.5, 1.5, A.nnz).astype(np.float32)
    return A


def _record(A, K=8, value=1.0, params=None, timing="", template="cpu.csr_spmm"):
    import spcompile
    from spcompile.autotune.database import Record, pass_hashes, target_digest, target_key, template_hash
    from spcompile.compile import make_op
    from spcompile.core.config import Config
    from spcompile.core.ir import SparseModule

    op = make_op(A, "spmm", K, "sum")
    tpl = spcompile.get_template("cpu.csr_spmm")
    p = dict(tpl.default_params(SparseModule.from_op(op)))
    p.update(RECORD_PARAMS if params is None else params)
    cfg = Config(template, p, (), "cpu", tpl.format)
    return op, Record(op.key().digest(), target_digest("cpu"), "kernel_time", cfg, kernel_ms=value, preprocess_ms=0.1,
                      value_ms=value, baseline_ms=2.0, baseline_name="probe", workload=op.key().to_dict(),
                      target=target_key("cpu"), template_hash=template_hash("cpu.csr_spmm") or "",
                      pass_hashes=pass_hashes(()), timing=timing)


def _rows(path: str, table: str | None = None) -> list[dict]:
    import sqlite3

    from spcompile.autotune.database import TABLE

    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        cur = con.execute(f"SELECT * FROM {table or TABLE}")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]
    finally:
        con.close()


def _insert(path: str, row: dict, table: str | None = None) -> None:
    import sqlite3

    from spcompile.autotune.database import TABLE

    con = sqlite3.connect(path)
    con.execute(f"INSERT INTO {table or TABLE} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                list(row.values()))
    con.commit()
    con.close()


def _good_db(ctx, name="good.db", A=None, K=8):
    """A database holding one record for (A, K) with RECORD_PARAMS."""
    from spcompile.autotune.database import Database

    A = _graph() if A is None else A
    path = os.path.join(ctx.tmp, name)
    db = Database(path)
    op, rec = _record(A, K)
    if not db.save_if_better(rec):
        raise RuntimeError("probe: record not stored")
    db.close()
    _db_reset()
    return path, A, op


def _build_uses_record(A, path, K=8, expect_source="database", **kw) -> str:
    """build(storage=path) works, computes A @ X, and (for 'database') used the stored record."""
    import numpy as np

    import spcompile

    mod = spcompile.build(A, "spmm", K=K, target="cpu", storage=path, **kw)
    X = np.random.default_rng(0).standard_normal((A.shape[1], K)).astype(np.float32)
    check_close(mod(X), _ref_for(A, "spmm", "sum", X), "built module")
    src = mod.tuning.get("source")
    if expect_source == "database":
        if src != "database" or any(mod.config.params.get(k) != v for k, v in RECORD_PARAMS.items()):
            raise Lost(f"the stored record was not used (source={src}, params={dict(mod.config.params)})")
    elif expect_source is not None and src != expect_source:
        raise Wrong(f"decision source {src}, expected {expect_source}")
    return f"build ok (source={src})"


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _columns_sql(extra: str = "") -> str:
    from spcompile.autotune.database import Database

    db = Database("sqlite://")
    cols = []
    for c in db.table.columns:
        t = "INTEGER PRIMARY KEY AUTOINCREMENT" if c.name == "id" else "TEXT"
        if c.name in ("kernel_ms", "preprocess_ms", "value_ms", "baseline_ms", "created"):
            t = "REAL"
        if c.name in ("K", "rows", "cols", "nnz", "trial_number"):
            t = "INTEGER"
        cols.append(f'"{c.name}" {t}')
    return ", ".join(cols) + (", " + extra if extra else "")


def _database_cases() -> None:
    def db_case(fn):
        def wrapped(ctx):
            _db_reset()
            try:
                return fn(ctx)
            finally:
                _db_reset()
        return wrapped

    def reg(name, fn, **kw):
        register("database", name, db_case(fn), **kw)

    from_err = lambda: __import__("spcompile.autotune.database", fromlist=["DatabaseError"]).DatabaseError  # noqa: E731

    def refused(path, via, match):
        """A storage at ``path`` opened through the API ("api"), ``build()`` ("build") or
        ``spcompile best`` (else): a clear error matching ``match``."""
        from spcompile.autotune.database import Database

        if via == "api":
            return expect_error(lambda: Database(path), from_err(), match)
        if via == "build":
            return expect_error(lambda: _build(_graph(), "spmm", 8, "sum", storage=path, pipeline=None), from_err(),
                                match)
        return expect_cli_error(["best", "--storage", path], match)

    # newer schema: an extra required column -- reads work, writes are a clear error, nothing lost
    def newer(ctx, via="api"):
        import sqlite3

        from spcompile.autotune.database import TABLE, Database

        good, A, op = _good_db(ctx)
        row = _rows(good)[0]
        path = os.path.join(ctx.tmp, "newer.db")
        con = sqlite3.connect(path)
        con.execute(f"CREATE TABLE {TABLE} ({_columns_sql('schema_v3_field TEXT NOT NULL')})")
        con.commit()
        con.close()
        _insert(path, {**row, "schema_v3_field": "v3"})
        if via == "cli-tune":
            g = os.path.join(ctx.tmp, "g.npz")
            import scipy.sparse as sp

            sp.save_npz(g, _graph(40, seed=1))
            args = ["tune", g, "-K", "4", "--trials", "2", "--storage", path, "--target", "cpu", "--no-progress"]
            rc, out, err = run_cli(args, timeout=240)
            if len(_rows(path)) != 1:
                raise Lost("the newer table lost a row")
            if rc == 0:
                # the measured best may not beat the baseline: then nothing is written (and it must say so)
                if "nothing stored" not in out:
                    raise Wrong(f"exit 0 and no 'nothing stored' with an unwritable table: {out.strip()[-200:]!r}")
                return "rc=0: the search found nothing worth storing and says so (no write attempted)"
            # judged on this run: running it again would find the study's trials done (nothing to do)
            return judge_cli_error(rc, out, err, "store|newer|cannot")
        if via == "cli-best":
            best_lists_one_record(path, "on a newer table")
            return "best lists the record (rc=0)"
        db = Database(path)
        if db.lookup(op.key(), "cpu") is None:
            raise Lost("the record in a newer table is not read")
        _, rec = _record(A, 8, value=0.5)
        r = expect_error(lambda: db.save_if_better(rec), from_err(), "newer")
        _build_uses_record(A, path)
        rows = _rows(path)
        if len(rows) != 1 or rows[0]["value_ms"] != row["value_ms"]:
            raise Lost(f"rows changed: {len(rows)}")
        return r + "; build uses its record"

    reg("newer-schema:api", newer, quick=True)
    reg("newer-schema:cli-best", lambda ctx: newer(ctx, "cli-best"), timeout=90)
    reg("newer-schema:cli-tune", lambda ctx: newer(ctx, "cli-tune"), timeout=300)

    def older(ctx, via="api"):
        import sqlite3

        from spcompile.autotune.database import TABLE

        path = os.path.join(ctx.tmp, "older.db")
        con = sqlite3.connect(path)
        con.execute(f"CREATE TABLE {TABLE} (id INTEGER PRIMARY KEY, workload_digest TEXT, config TEXT)")
        con.execute(f"INSERT INTO {TABLE} (workload_digest, config) VALUES ('w', '{{}}')")
        con.commit()
        con.close()
        before = _rows(path)
        r = refused(path, via, "another|version|layout")
        if _rows(path) != before:
            raise Lost("the older database's rows changed")
        return r

    reg("older-layout:api", older)
    reg("older-layout:build", lambda ctx: older(ctx, "build"))
    reg("older-layout:cli-best", lambda ctx: older(ctx, "cli"), timeout=90)

    def read_only(ctx, how):
        import stat

        from spcompile.autotune import database as dbm
        from spcompile.autotune.database import Database

        path, A, op = _good_db(ctx, "ro/t.db")
        n0 = len(_rows(path))
        d = os.path.dirname(path)
        emulated = ""
        real = dbm._writable
        if how == "flag":
            db = Database(path, read_only=True)
        else:
            for n in os.listdir(d):
                os.chmod(os.path.join(d, n), stat.S_IRUSR | stat.S_IRGRP)
            os.chmod(d, stat.S_IRUSR | stat.S_IXUSR)
            if os.geteuid() == 0:   # root writes whatever the mode says: emulate what a user sees
                dbm._writable = lambda p: False
                emulated = " (root: unwritable emulated)"
        try:
            if how != "flag":
                db = Database(path)
            if not db.read_only:
                raise Wrong("an unwritable database was not opened read-only")
            if db.lookup(op.key(), "cpu") is None:
                raise Lost("read-only: the record is not read")
            _, rec = _record(A, 8, value=0.1)
            r = expect_error(lambda: db.save_if_better(rec), from_err(), "read-only")
            if how != "flag":
                _build_uses_record(A, path)
                # a miss (another K) with tune=True: tuning could not store its result
                r2 = expect_error(lambda: _build(A, "spmm", 16, "sum", storage=path, pipeline=None, tune=True,
                                                 trials=1), from_err(), "read-only")
                r += "; tune: " + r2
        finally:
            dbm._writable = real
            os.chmod(d, 0o755)
        if len(_rows(path)) != n0:
            raise Lost("rows changed")
        return r + emulated

    reg("read-only:flag", lambda ctx: read_only(ctx, "flag"))
    reg("read-only:file-and-folder", lambda ctx: read_only(ctx, "chmod"), timeout=120, quick=True)

    def not_sqlite(ctx, content, via):
        path = os.path.join(ctx.tmp, "junk.db")
        with open(path, "wb") as f:
            f.write(content)
        before = _file_digest(path)
        r = refused(path, via, "SQLite|database")
        if _file_digest(path) != before:
            raise Lost("the file was modified")
        return r

    reg("not-sqlite:text:api", lambda ctx: not_sqlite(ctx, b"not a database\n" * 20, "api"))
    reg("not-sqlite:text:build", lambda ctx: not_sqlite(ctx, b"not a database\n" * 20, "build"))
    reg("not-sqlite:text:cli-best", lambda ctx: not_sqlite(ctx, b"not a database\n" * 20, "cli"), timeout=90)
    reg("not-sqlite:zip:api", lambda ctx: not_sqlite(ctx, b"PK\x03\x04" + os.urandom(500), "api"))

    def truncated(ctx, via):
        path, A, op = _good_db(ctx)
        with open(path, "rb") as f:
            data = f.read()
        bad = os.path.join(ctx.tmp, "trunc.db")
        with open(bad, "wb") as f:
            f.write(data[: max(100, len(data) // 2)] if via != "header-only" else data[:100])
        from spcompile.autotune.database import Database

        def use():
            db = Database(bad)
            return db.lookup(op.key(), "cpu")

        if via == "cli":
            rc, out, err = run_cli(["best", "--storage", bad])
            if "Traceback" in err or rc < 0:
                raise Unclear(f"rc={rc}: traceback")
            lines = [ln for ln in err.splitlines() if ln.strip()]
            if rc == 0:
                return f"best rc=0: {out.strip().splitlines()[-1][:120] if out.strip() else ''}"
            if len(lines) != 1:
                raise Unclear(f"{len(lines)} lines on stderr")
            return f"rc={rc}: {lines[0][:200]}"
        return expect_error(use, from_err(), "database|malformed|corrupt|disk image",
                            accept=lambda rec: f"read what survives ({'a record' if rec else 'no record'})")

    reg("truncated-sqlite:api", lambda ctx: truncated(ctx, "api"))
    reg("truncated-sqlite:header-only", lambda ctx: truncated(ctx, "header-only"))
    reg("truncated-sqlite:cli-best", lambda ctx: truncated(ctx, "cli"), timeout=90)

    def folder(ctx, via):
        d = os.path.join(ctx.tmp, "dbdir")
        os.mkdir(d)
        return refused(d, via, "folder|directory")

    reg("folder-as-storage:api", lambda ctx: folder(ctx, "api"))
    reg("folder-as-storage:build", lambda ctx: folder(ctx, "build"))
    reg("folder-as-storage:cli-best", lambda ctx: folder(ctx, "cli"), timeout=90)

    def empty_file(ctx):
        path = os.path.join(ctx.tmp, "empty.db")
        open(path, "wb").close()
        from spcompile.autotune.database import Database

        db = Database(path)
        A = _graph()
        op, rec = _record(A, 8)
        if not db.save_if_better(rec) or db.lookup(op.key(), "cpu") is None:
            raise Lost("record not stored in an empty file")
        return "an empty file is used as a new database"

    reg("empty-file", empty_file)

    def foreign_table(ctx):
        import sqlite3

        path = os.path.join(ctx.tmp, "app.db")
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        con.executemany("INSERT INTO users (name) VALUES (?)", [("a",), ("b",)])
        con.commit()
        con.close()
        from spcompile.autotune.database import Database

        db = Database(path)
        A = _graph()
        op, rec = _record(A, 8)
        db.save_if_better(rec)
        if len(_rows(path, "users")) != 2:
            raise Lost("another application's rows were lost")
        return "records stored beside another application's table, which is intact"

    reg("foreign-table", foreign_table)

    # malformed / unusable URLs: one line, no password, DatabaseError
    def url_case(url_fn, via="api"):
        def fn(ctx):
            from spcompile.autotune.database import Database

            url = url_fn(ctx)
            if via == "cli":
                r = expect_cli_error(["best", "--storage", url], None)
                if "s3cret" in r:
                    raise Wrong("the password is shown")
                return r

            def check(e_text):
                if "s3cret" in e_text:
                    raise Wrong("the password is shown")
            try:
                r = expect_error(lambda: Database(url), from_err(), None)
            except Outcome:
                raise
            check(r)
            if len(r) > 500:
                raise Unclear("message over 500 characters")
            return r
        return fn

    urls = {
        "unknown-dialect": "foo://bar", "http": "http://example.com/db", "unknown-driver": "postgresql+nodriver://u@h/db",
        "mysql-no-driver": "mysql://u@127.0.0.1:1/db", "postgres-refused": "postgresql+psycopg2://u:s3cret@127.0.0.1:1/db",
        "postgres-default-driver": "postgresql://u:s3cret@127.0.0.1:1/db", "no-scheme": "://nothing",
        "sqlite-with-host": "sqlite://x.db", "spaces": "   ", "empty": "", "bad-ipv6": "postgresql://u@[::1/db",
        "nul-byte": "sqlite:///tmp/a\0b.db", "proc": "/proc/no-such-dir/t.db",
        "dev-null": "/dev/null",
    }
    for name, url in urls.items():
        reg(f"url:{name}", url_case(lambda ctx, url=url: url), quick=name == "unknown-dialect")
    reg("url:file-where-folder-expected", url_case(lambda ctx: _file_then_sub(ctx)))
    for name in ("unknown-dialect", "postgres-refused", "bad-ipv6", "spaces"):
        reg(f"url:{name}:cli-best", url_case(lambda ctx, url=urls[name]: url, "cli"), timeout=90)

    def cli_build_bad_storage(ctx):
        import scipy.sparse as sp

        g = os.path.join(ctx.tmp, "g.npz")
        sp.save_npz(g, _graph(40))
        return expect_cli_error(["build", g, "-K", "4", "--target", "cpu", "--storage", "foo://bar", "-o",
                                 os.path.join(ctx.tmp, "m.spc")], None)

    reg("url:cli-build", cli_build_bad_storage, timeout=90)

    # a writer holding the lock while build() looks up
    def locked(ctx):
        import threading

        from spcompile.autotune.database import TABLE, Database

        path, A, op = _good_db(ctx)
        code = ("import sqlite3, sys, time\n"
                f"c = sqlite3.connect({path!r}, isolation_level=None)\n"
                "c.execute('BEGIN IMMEDIATE')\n"
                f"c.execute(\"UPDATE {TABLE} SET baseline_name = 'held'\")\n"
                "print('locked', flush=True)\n"
                "time.sleep(60)\n")
        holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            if holder.stdout.readline().strip() != "locked":
                raise RuntimeError("probe: lock holder did not start")
            t0 = time.perf_counter()
            r = _build_uses_record(A, path)
            secs = time.perf_counter() - t0
            if secs > 10:
                raise Hang(f"build waited {secs:.1f} s behind the writer")
            db = Database(path)
            _, better = _record(A, 8, value=0.5)
            done: list = []
            th = threading.Thread(target=lambda: done.append(_safe_call(db.save_if_better, better)), daemon=True)
            th.start()
            time.sleep(0.5)
            early = list(done)
        finally:
            holder.kill()      # the writer dies without committing: its transaction rolls back
            holder.wait()
        th.join(timeout=60)
        if th.is_alive():
            raise Hang("a store still waits after the writer died")
        if early:
            raise Wrong(f"a store went through while another writer held the lock: {early}")
        if done != [True]:
            raise Lost(f"store after the writer died: {done}")
        rows = _rows(path)
        if len(rows) != 1 or rows[0]["value_ms"] != 0.5 or rows[0]["baseline_name"] == "held":
            raise Lost(f"rows after the lock: {[(x['value_ms'], x['baseline_name']) for x in rows]}")
        return f"{r} in {secs:.2f} s while locked; the store waited and went through after"

    reg("writer-holds-lock", locked, timeout=120, quick=True)

    def concurrent_writers(ctx):
        path = os.path.join(ctx.tmp, "conc.db")
        code = ("import sys, time\n"
                f"sys.path.insert(0, {HERE!r})\n"
                "import trust_probe as tp\n"
                "from spcompile.autotune.database import Database\n"
                f"db = Database({path!r})\n"
                "w = int(sys.argv[1]); ok = 0\n"
                "for i in range(15):\n"
                "    op, rec = tp._record(tp._graph(30 + i, seed=100 * w + i), 8, value=1.0 + w)\n"
                "    ok += db.save_if_better(rec)\n"
                "    op, rec = tp._record(tp._graph(80, seed=7), 8, value=1.0 + w + i / 100)\n"
                "    db.save_if_better(rec)\n"
                "print(ok)\n")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(w)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=worker_env()) for w in range(3)]
        outs = []
        for p in procs:
            try:
                o, e = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise Hang("concurrent writers did not finish in 120 s") from None
            if p.returncode != 0:
                raise Unclear(f"a writer failed: {e.strip().splitlines()[-1][:200] if e.strip() else p.returncode}")
            outs.append(int(o.strip()))
        rows = _rows(path)
        shared = [r for r in rows if r["rows"] == 80]
        if len(rows) != 46 or len(shared) != 1 or shared[0]["value_ms"] != 1.0:
            raise Lost(f"{len(rows)} rows (want 46), shared key best {[r['value_ms'] for r in shared]} (want [1.0])")
        return "3 writers x 30 stores: 45 distinct records + the best of the shared key, none lost"

    reg("concurrent-writers", concurrent_writers, timeout=180)

    # damaged records
    def damaged(ctx, via="api"):
        from spcompile.autotune.database import Database

        path, A, op = _good_db(ctx)
        row = _rows(path)[0]
        bad = [dict(row, id=None, timing="autorange", config="{not json", value_ms=0.1),
               dict(row, id=None, template="extern.scipy", workload="[1, 2", value_ms=0.2),
               dict(row, id=None, template="extern.scipy", timing="autorange", value_ms="fast"),
               dict(row, id=None, precision="fp32", objective="kernel_time", template="cpu.csr_spmm",
                    template_hash="x", config=json.dumps({"template": 5}), value_ms=0.05)]
        for r in bad:
            _insert(path, r)
        if via == "cli":
            best_lists_one_record(path, "with damaged rows")
            return "best: rc=0, lists the intact record"
        db = Database(path)
        hit = db.lookup(op.key(), "cpu")
        if hit is None or hit.value_ms != 1.0:
            raise Lost(f"the intact record is not found ({hit})")
        best = db.best_records()
        if len(best) != 1:
            raise Wrong(f"best_records: {len(best)}")
        r = _build_uses_record(A, path)
        if len(_rows(path)) != 5:
            raise Lost("rows were dropped from the table")
        return "damaged rows skipped; " + r

    reg("damaged-records:api", damaged, quick=True)
    reg("damaged-records:cli-best", lambda ctx: damaged(ctx, "cli"), timeout=90)

    def nobuild(ctx, params, pipeline=None, template="cpu.csr_spmm"):
        import warnings as w

        path, A, op = _good_db(ctx)
        row = _rows(path)[0]
        cfg = json.loads(row["config"])
        cfg["params"].update(params)
        cfg["template"] = template
        if pipeline is not None:
            cfg["pipeline"] = pipeline
        _insert(path, dict(row, id=None, timing="autorange", value_ms=0.5, kernel_ms=0.5, config=json.dumps(cfg)))
        with w.catch_warnings(record=True) as caught:
            w.simplefilter("always")
            r = _build_uses_record(A, path)
        msgs = [str(x.message) for x in caught if "does not build" in str(x.message) or "tuning record" in str(x.message)]
        if not msgs:
            raise Wrong("the broken record was skipped without a warning")
        if len(_rows(path)) != 2:
            raise Lost("rows dropped")
        return r + f"; warned: {msgs[0][:120]}"

    reg("record-does-not-build:k_tile-string", lambda ctx: nobuild(ctx, {"k_tile": "not-a-number"}))
    reg("record-does-not-build:k_tile-0", lambda ctx: nobuild(ctx, {"k_tile": 0}))
    reg("record-does-not-build:unknown-param", lambda ctx: nobuild(ctx, {"evil": 1}))
    reg("record-does-not-build:unknown-pass", lambda ctx: nobuild(ctx, {}, [{"name": "reorder.evil", "options": {}}]))
    reg("record-does-not-build:bad-pass-option",
        lambda ctx: nobuild(ctx, {}, [{"name": "reorder.degree", "options": {"evil": True}}]))

    def nonfinite(ctx, value):
        """A row whose time is impossible (save_if_better never stores it) and whose config
        differs: it must be skipped, the intact record used."""
        path, A, op = _good_db(ctx)
        row = _rows(path)[0]
        cfg = json.loads(row["config"])
        cfg["params"]["k_tile"] = 1
        _insert(path, dict(row, id=None, timing="autorange", value_ms=value, kernel_ms=value, config=json.dumps(cfg)))
        try:
            return _build_uses_record(A, path) + "; the impossible row was skipped"
        except Lost:
            raise Wrong(f"a row with an impossible time ({value!r} ms) was trusted over the intact record") from None

    reg("record-value:inf", lambda ctx: nonfinite(ctx, float("inf")))
    reg("record-value:nan-text", lambda ctx: nonfinite(ctx, "NaN"))
    reg("record-value:negative", lambda ctx: nonfinite(ctx, -1.0))
    reg("record-value:zero", lambda ctx: nonfinite(ctx, 0.0))

    def bad_default(ctx, kind):
        import warnings as w

        if kind == "junk":
            p = os.path.join(ctx.tmp, "default.db")
            with open(p, "w") as f:
                f.write("not sqlite\n" * 20)
        elif kind == "folder":
            p = os.path.join(ctx.tmp, "dfolder")
            os.mkdir(p)
        else:
            p = "foo://bar"
        old = os.environ.get("SPCOMPILE_TUNING_DB")
        os.environ["SPCOMPILE_TUNING_DB"] = p
        try:
            A = _graph(seed=4)
            with w.catch_warnings(record=True) as caught:
                w.simplefilter("always")
                r1 = _build_uses_record(A, None, expect_source=None)
                _build_uses_record(A, None, expect_source=None)
            msgs = [str(x.message) for x in caught if "cannot be used" in str(x.message) or "tuning" in str(x.message)]
            if len(msgs) != 1:
                raise Unclear(f"{len(msgs)} warnings about the default database (want 1): {msgs[:2]}")
            return r1 + f"; warned once: {msgs[0][:100]}"
        finally:
            if old is None:
                os.environ.pop("SPCOMPILE_TUNING_DB", None)
            else:
                os.environ["SPCOMPILE_TUNING_DB"] = old

    for kind in ("junk", "folder", "bad-url"):
        reg(f"default-db-broken:{kind}", lambda ctx, kind=kind: bad_default(ctx, kind), timeout=120)


def _safe_call(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001
        return _msg(e)


def _file_then_sub(ctx) -> str:
    f = os.path.join(ctx.tmp, "afile")
    with open(f, "w") as fh:
        fh.write("x")
    return os.path.join(f, "sub", "t.db")


# -- state ----------------------------------------------------------------------------------------

def _state_cases() -> None:
    import numpy as np

    def with_cache(fn):
        """A private library cache (SPCOMPILE_CPU_CACHE) for the case."""
        def wrapped(ctx):
            old = os.environ.get("SPCOMPILE_CPU_CACHE")
            cache = os.path.join(ctx.tmp, "cpu-cache")
            os.environ["SPCOMPILE_CPU_CACHE"] = cache
            try:
                return fn(ctx, cache)
            finally:
                if old is None:
                    os.environ.pop("SPCOMPILE_CPU_CACHE", None)
                else:
                    os.environ["SPCOMPILE_CPU_CACHE"] = old
        return wrapped

    def fresh_module(ctx, reduce="min", K=6, seed=3):
        A = ctx.matrix("A")
        m = _build(A, "spmm", K, reduce, params={"k_tile": K, "prefetch": 4})
        X = np.random.default_rng(seed).standard_normal((A.shape[1], K)).astype(np.float32)
        return A, m, X, _ref_for(A, "spmm", reduce, X)

    def cache_removed_before_save(ctx, cache):
        import spcompile

        A, m, X, ref = fresh_module(ctx)
        lib = m.kernel.files["kernel.so"]
        if not lib.startswith(cache):
            raise RuntimeError(f"probe: library outside the private cache: {lib}")
        shutil.rmtree(cache)
        check_close(m(X), ref, "call after the cache was removed")
        path = m.save(os.path.join(ctx.tmp, "m.spc"))
        return check_close(spcompile.load(path, A)(X), ref, "saved after the cache was removed, loaded")

    def cache_removed_between_builds(ctx, cache):
        A, m, X, ref = fresh_module(ctx)
        shutil.rmtree(cache)
        _, m2, _, _ = fresh_module(ctx)
        r = check_close(m2(X), ref, "second build")
        if not os.path.isfile(m2.kernel.files["kernel.so"]):
            raise Wrong("the second module's library file is missing")
        return r

    def cache_replaced_by_file(ctx, cache):
        A, m, X, ref = fresh_module(ctx)
        shutil.rmtree(cache)
        with open(cache, "w") as f:
            f.write("not a folder")
        try:
            _, m2, _, _ = fresh_module(ctx, reduce="max")
        except Exception as e:  # noqa: BLE001 -- a clear OSError is a clean refusal, anything else is not
            err = e

            def again():
                raise err
            return expect_error(again, OSError, "cache|spcompile|director|folder")
        ref2 = _ref_for(A, "spmm", "max", X)
        r = check_close(m2(X), ref2, "build with the cache path taken by a file")
        return r + "; save: " + ("ok" if m2.save(os.path.join(ctx.tmp, "x.spc")) else "")

    def cached_library_corrupted(ctx, cache):
        A, m, X, ref = fresh_module(ctx)
        lib = m.kernel.files["kernel.so"]
        with open(lib, "r+b") as f:
            f.seek(200)
            f.write(b"\xcc" * 64)
        _, m2, _, _ = fresh_module(ctx)     # same configuration: the cached library's bytes
        r = check_close(m2(X), ref, "build after the cached library was corrupted")
        with open(m2.kernel.files["kernel.so"], "rb") as f:
            if f.read()[200:264] == b"\xcc" * 64:
                raise Wrong("the corrupted cached library is still on disk under the module")
        return r

    def cached_library_truncated_then_saved(ctx, cache):
        import spcompile

        A, m, X, ref = fresh_module(ctx)
        with open(m.kernel.files["kernel.so"], "r+b") as f:
            f.truncate(100)
        path = m.save(os.path.join(ctx.tmp, "t.spc"))
        try:
            loaded = spcompile.load(path, A)
        except spcompile.ArtifactError as e:
            raise Wrong(f"save() succeeded but wrote an artifact that cannot be loaded ({str(e)[:160]})") from None
        return check_close(loaded(X), ref, "saved after its library file was truncated")

    for name, fn in (("cache-removed-between-build-and-save", cache_removed_before_save),
                     ("cache-removed-between-builds", cache_removed_between_builds),
                     ("cache-path-is-a-file", cache_replaced_by_file),
                     ("cached-library-corrupted", cached_library_corrupted),
                     ("cached-library-truncated-then-saved", cached_library_truncated_then_saved)):
        register("state", name, with_cache(fn), timeout=120, quick=name.startswith("cache-removed-between-build"))

    def tempdir_removed(ctx, when):
        import spcompile

        tmp = os.path.join(ctx.tmp, "tmp")
        os.mkdir(tmp)
        old = tempfile.tempdir
        tempfile.tempdir = tmp
        try:
            A, m, X, ref = fresh_module(ctx, reduce="sum")
            path = m.save(os.path.join(ctx.tmp, "a.spc"))
            shutil.rmtree(tmp)
            if when == "before-save":
                def act():
                    p = m.save(os.path.join(ctx.tmp, "b.spc"))
                    return spcompile.load(p, A)
            else:
                def act():
                    return spcompile.load(path, A)
            return expect_error(act, OSError, re.escape(tmp) + "|temporary|tmp",
                                accept=lambda mod: check_close(mod(X), ref, "loaded"))
        finally:
            tempfile.tempdir = old

    register("state", "temp-folder-removed-before-save", lambda ctx: tempdir_removed(ctx, "before-save"))
    register("state", "temp-folder-removed-before-load", lambda ctx: tempdir_removed(ctx, "before-load"))

    def loaded_folder_removed(ctx, layout):
        import spcompile

        A, m, X, ref = fresh_module(ctx, reduce="max")
        src = m.save(os.path.join(ctx.tmp, "src" + (".spc" if layout == "zip" else "")), as_dir=layout == "dir")
        loaded = spcompile.load(src)
        if loaded._tmpdir and os.path.isdir(loaded._tmpdir):
            shutil.rmtree(loaded._tmpdir)
        if layout == "dir":
            shutil.rmtree(src)
        else:
            os.remove(src)
        check_close(loaded(X), ref, "call after its folder and artifact were removed")
        again = loaded.save(os.path.join(ctx.tmp, "again.spc"))
        return check_close(spcompile.load(again, A)(X), ref, "saved again, loaded")

    register("state", "loaded-module-folder-removed-then-saved:zip", lambda ctx: loaded_folder_removed(ctx, "zip"),
             quick=True)
    register("state", "loaded-module-folder-removed-then-saved:dir", lambda ctx: loaded_folder_removed(ctx, "dir"))

    def overwritten_while_loaded(ctx):
        import spcompile

        A, m, X, ref = fresh_module(ctx, reduce="max")
        d = m.save(os.path.join(ctx.tmp, "art"), as_dir=True)
        loaded = spcompile.load(d)
        _, m2, _, _ = fresh_module(ctx, reduce="min")
        m2.save(d, as_dir=True)              # another module saved over the artifact in use
        r = check_close(loaded(X), ref, "the loaded module after its artifact was replaced")
        check_close(spcompile.load(d)(X), _ref_for(A, "spmm", "min", X), "the new artifact")
        return r

    register("state", "artifact-overwritten-while-loaded", overwritten_while_loaded)

    def failed_save_keeps_old(ctx, layout, how):
        """A save that fails part-way (file size limit, or the folder made unwritable) keeps the
        old artifact, loadable, and leaves no half-written sibling."""
        import spcompile

        A, m, X, ref = fresh_module(ctx, reduce="max")
        d = os.path.join(ctx.tmp, "keep")
        os.mkdir(d)
        target = os.path.join(d, "art" + (".spc" if layout == "zip" else ""))
        m.save(target, as_dir=layout == "dir")
        before = members_of(target)
        _, big, _, _ = fresh_module(ctx, reduce="min")
        old_lim = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            if how == "fsize":
                resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_lim[1]))   # writes past 4 KiB fail (EFBIG)
            r = expect_error(lambda: big.save(target, as_dir=layout == "dir"), OSError, "artifact|large|space|write")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_lim)
            signal.signal(signal.SIGXFSZ, old_sig)
        if not os.path.exists(target) or members_of(target) != before:
            raise Lost("the old artifact was damaged or removed by a failed save")
        left = sorted(set(os.listdir(d)) - {os.path.basename(target)})
        if left:
            raise Wrong(f"a failed save left {left}")
        check_close(spcompile.load(target, A)(X), ref, "the old artifact")
        return r + "; the old artifact is intact"

    register("state", "failed-save-keeps-old:zip", lambda ctx: failed_save_keeps_old(ctx, "zip", "fsize"))
    register("state", "failed-save-keeps-old:dir", lambda ctx: failed_save_keeps_old(ctx, "dir", "fsize"))

    def save_into_missing_folder(ctx):
        A, m, X, ref = fresh_module(ctx, reduce="max")
        d = os.path.join(ctx.tmp, "gone")
        os.mkdir(d)
        os.rmdir(d)
        return expect_error(lambda: m.save(os.path.join(d, "a.spc")), OSError, "artifact|no such|gone")

    register("state", "save-into-removed-folder", save_into_missing_folder)

    def save_over_non_artifact_dir(ctx):
        A, m, X, ref = fresh_module(ctx, reduce="max")
        d = os.path.join(ctx.tmp, "home")
        os.mkdir(d)
        with open(os.path.join(d, "precious.txt"), "w") as f:
            f.write("keep me")
        r = expect_error(lambda: m.save(d, as_dir=True), ValueError, "not a spcompile artifact|refus")
        with open(os.path.join(d, "precious.txt")) as f:
            if f.read() != "keep me":
                raise Lost("a folder that is not an artifact was replaced")
        return r

    register("state", "save-over-a-folder-that-is-not-an-artifact", save_over_non_artifact_dir)

    def save_zip_over_dir_artifact(ctx):
        import spcompile

        A, m, X, ref = fresh_module(ctx, reduce="max")
        d = m.save(os.path.join(ctx.tmp, "a.spc"), as_dir=True)
        before = members_of(d)
        r = expect_error(lambda: m.save(d, as_dir=False), (ValueError, OSError), "director|folder")
        if members_of(d) != before:
            raise Lost("the directory artifact was changed by a refused save")
        check_close(spcompile.load(d)(X), ref, "the old artifact")
        return r

    register("state", "save-file-over-a-directory-artifact", save_zip_over_dir_artifact)

    def module_after_call_values(ctx):
        """A module called with other values, then saved: the artifact holds the built values."""
        import spcompile

        A, m, X, ref = fresh_module(ctx, reduce="sum")
        v = np.asarray(m.matrix.data if m.matrix is not None else A.data, dtype=np.float32) * 3
        m(X, values=v)
        path = m.save(os.path.join(ctx.tmp, "v.spc"))
        r = check_close(spcompile.load(path, A)(X), ref, "saved after a call with other values")
        return r + "; " + check_close(m(X), ref, "the next plain call")

    register("state", "saved-after-call-with-other-values", module_after_call_values)

    def pickled_after_folder_removed(ctx):
        import pickle

        import spcompile

        A, m, X, ref = fresh_module(ctx, reduce="sum")
        loaded = spcompile.load(m.save(os.path.join(ctx.tmp, "p.spc")))
        shutil.rmtree(loaded._tmpdir, ignore_errors=True)
        back = pickle.loads(pickle.dumps(loaded))
        return check_close(back(X), ref, "unpickled after its folder was removed")

    register("state", "pickled-after-folder-removed", pickled_after_folder_removed)


# =================================================================================================
# test-only cases: each bad outcome, to show that the classifier detects it
# =================================================================================================

def register_test_cases() -> None:
    if "selftest.clean" in CASES:
        return

    def clean(ctx):
        ins = ctx.inputs("max")
        return check_close(ctx.mod("max")(*ins), ctx.reference("max", *ins))

    def abort(ctx):
        os.abort()

    def sleep(ctx):
        time.sleep(60)

    def wrong(ctx):
        ins = ctx.inputs("sum")
        out = ctx.mod("sum")(*ins)
        out[3, 1] += 1.0          # a wrong result
        return check_close(out, ctx.reference("sum", *ins))

    def keyerror(ctx):
        return {}["missing"]

    def unclear_refusal(ctx):
        return expect_error(lambda: {}["x"], ValueError, "K")

    def silent(ctx):
        return expect_error(lambda: 42, ValueError, "K")

    def lost(ctx):
        raise Lost("record 3 gone")

    for name, fn, kw in [("clean", clean, {}), ("abort", abort, {}), ("sleep", sleep, {"timeout": 2.0}),
                         ("wrong", wrong, {}), ("keyerror", keyerror, {}), ("unclear_refusal", unclear_refusal, {}),
                         ("silent", silent, {}), ("lost", lost, {})]:
        register("selftest", name, fn, test_only=True, **kw)


# =================================================================================================
# the default run: a core subset of about 250 cases; --exhaustive runs every registered case
# =================================================================================================

def _alt(*names) -> str:
    return "(" + "|".join(re.escape(n) for n in names) + ")"


CORE = [re.compile(p) for p in (
    r"artifacts\.(flip-mid|trunc-half):",
    r"artifacts\.zip-container:" + _alt("flip-central-dir", "flip-local-header", "truncated-half", "appended-junk") + "$",
    r"artifacts\.arrays:" + _alt("index-out-of-range", "negative-index", "indptr-not-monotone", "row-ids-repeated",
                                 "data-short", "data-float64", "indices-float", "indices-int64", "missing-array",
                                 "data-doubled", "indices-shuffled", "values-src-not-permutation", "specs-not-updated",
                                 "sddmm-nnz-ids-shifted") + "$",
    r"artifacts\.manifest:" + _alt("other-K", "other-K-and-entry", "other-reduce-and-entry", "other-op", "other-reduce", "other-dtype", "other-dtype-float64-and-entry", "library-renamed-with-member",
                                   "entry-renamed", "template-of-another-op", "template-unknown",
                                   "tvm-version", "cpu-features-unknown", "nesting-100000", "huge-int-5000-digits",
                                   "workload-key-string", "sizes-huge",
                                   "tuning-not-a-dict", "pass-log-int", "sddmm-as-spmm") + "$",
    r"artifacts\.(relabelled|bomb):",
    r"artifacts\.zip-slip:" + _alt("parent", "absolute", "dotdot", "dot", "npz-member") + "$",
    r"artifacts\.dir-member:" + _alt("fifo", "symlink-dev-zero") + "$",
    r"artifacts\.path:" + _alt("not-a-zip", "empty-file", "missing", "fifo") + "$",
    r"artifacts\.signature:" + _alt("library-replaced", "arrays-replaced", "stripped",
                                    "signature-of-another-artifact", "required-by-environment") + "$",
    r"artifacts\.cli-info:" + _alt("junk", "missing", "deep-manifest", "bad-arrays", "resealed-library-required",
                                   "tuning-not-a-dict", "huge-int") + "$",
    r"inputs\.read-only:" + _alt("frombuffer:sum", "setflags:sum", "memmap-r:sum", "setflags:sddmm") + "$",
    r"inputs\.out:" + _alt("read-only", "wrong-dtype", "fortran") + "$",
    r"inputs\.out-alias:" + _alt("same", "partial", "after-good-call", "torch", "sddmm-X", "adjacent-no-overlap") + "$",
    r"inputs\.special:nan-in-[XA]:[a-z]+$", r"inputs\.special:inf-in-X:max$", r"inputs\.special:inf-in-A:sum$",
    r"inputs\.X:" + _alt("dtype-float64", "shape-rows+1", "shape-K+1", "fortran-order", "strided-columns", "list",
                         "none", "torch-requires-grad", "sddmm-one-input") + "$",
    r"inputs\.params:" + _alt("k_tile=-5", "k_tile=0", "k_tile=2^40", "k_tile=8", "tasks_per_thread=0", "balance=fast",
                              "unknown-name", "params-string") + "$",
    r"inputs\.(template|pipeline):" + _alt("unknown", "other-op", "cuda-on-cpu", "unknown-pass", "not-a-list") + "$",
    r"inputs\.K:" + _alt("0", "-1", "2^40", "None") + "$",
    r"inputs\.name:" + _alt("op=spmv", "reduce=avg", "reduce-on-sddmm", "dtype=float128", "dtype=float16-on-cpu",
                            "dtype=float64", "dtype=float64-on-cuda", "target=gpu") + "$",
    r"inputs\.A:" + _alt("indptr-not-monotone", "indptr-wrong-length", "negative-index", "index-out-of-range",
                         "data-short", "indices-float", "shape-negative", "dense-numpy", "coo-out-of-range") + "$",
    r"inputs\.A-valid:" + _alt("0x0:spmm-max", "5x5-no-nonzeros:spmm-max", "duplicates:spmm-max",
                               "unsorted-indices:spmm-max", "int64-indices:spmm-max", "explicit-zeros:spmm-max",
                               "0x0:sddmm", "5x5-no-nonzeros:sddmm", "duplicates:spmm-mean",
                               "2^28-rows-3-nonzeros") + "$",
    r"passes\.",
    r"database\.(newer-schema|older-layout|read-only|writer-holds-lock|concurrent-writers|damaged-records|"
    r"empty-file|foreign-table|default-db-broken):",
    r"database\.(empty-file|foreign-table|writer-holds-lock|concurrent-writers)$",
    r"database\.not-sqlite:text:", r"database\.truncated-sqlite:(api|cli-best)$",
    r"database\.folder-as-storage:(api|build)$",
    r"database\.url:" + _alt("unknown-dialect", "unknown-driver", "postgres-refused", "bad-ipv6",
                             "file-where-folder-expected", "unknown-dialect:cli-best", "postgres-refused:cli-best",
                             "cli-build") + "$",
    r"database\.record-does-not-build:(k_tile-string|unknown-pass|bad-pass-option)$",
    r"database\.record-value:(inf|negative|zero)$",
    r"state\.",
)]


def is_core(name: str) -> bool:
    return any(p.match(name) for p in CORE)

# =================================================================================================
# the table
# =================================================================================================

def summarize(results: list[dict], classes=CLASSES) -> dict:
    table = {}
    for cls in list(classes) + sorted({r["class"] for r in results} - set(classes)):
        rs = [r for r in results if r["class"] == cls]
        if not rs:
            continue
        row = {"cases": len(rs)}
        for o in OUTCOMES:
            row[o] = sum(r["status"] == o for r in rs)
        table[cls] = row
    total = {"cases": sum(r["cases"] for r in table.values())}
    for o in OUTCOMES:
        total[o] = sum(r[o] for r in table.values())
    table["total"] = total
    return table


def _cell(text: str, n: int) -> str:
    return " ".join(str(text).split())[:n].replace("|", "/")


def write_report(results: list[dict], out_dir: str, wall_s: float, argv: list[str]) -> tuple[str, str]:
    import platform

    os.makedirs(out_dir, exist_ok=True)
    table = summarize(results)
    meta = {"wall_s": round(wall_s, 1), "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "argv": argv, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "worker_address_space_limit_bytes": WORKER_AS_LIMIT}
    try:
        import spcompile

        meta["spcompile"] = spcompile.__version__
    except Exception:  # noqa: BLE001
        pass
    jpath = os.path.join(out_dir, "probe.json")
    with open(jpath, "w") as f:
        json.dump({"meta": meta, "table": table, "results": results}, f, indent=1, default=str)
    lines = ["# Trust probe", "",
             f"`{' '.join(['python benchmarks/trust_probe.py'] + argv)}` -- {meta['date']}, "
             f"{len(results)} cases in {wall_s:.0f} s on {os.cpu_count()} CPUs (CPU target; each case in a "
             f"fresh worker interpreter with an address-space limit of {WORKER_AS_LIMIT >> 30} GiB, 16 GiB for the "
             f"2**28-row build).", "",
             "| class | cases tried | " + " | ".join(OUTCOME_TITLES[o] for o in OUTCOMES) + " |",
             "|---|---:|" + "---:|" * len(OUTCOMES)]
    for cls, row in table.items():
        name = f"**{cls}**" if cls == "total" else cls
        lines.append(f"| {name} | {row['cases']} | " + " | ".join(str(row[o]) for o in OUTCOMES) + " |")
    bad = [r for r in results if r["status"] != "clean"]
    lines += ["", "Outcomes: *handled cleanly* -- a clear refusal (expected exception type and a message that "
              "says what is wrong; CLI: non-zero exit, one line on stderr, no traceback) or a result equal to the "
              "float64 reference; *silently wrong* -- bad input accepted or a wrong result; *crash / unclear "
              "error* -- the worker died, or an unexpected exception type / unhelpful message; *hang* -- past "
              "the case's timeout; *loss* -- a tuning record or an older artifact lost.", ""]
    if bad:
        lines += ["## Cases not handled cleanly", "", "| case | outcome | detail |", "|---|---|---|"]
        for r in bad:
            lines.append(f"| `{r['name']}` | {r['status']} | {_cell(r['detail'], 400)} |")
    else:
        lines += ["No case ended silently wrong, in a crash / unclear error, a hang or a loss."]
    lines += ["", "## All cases", "", "| case | outcome | s | detail |", "|---|---|---:|---|"]
    for r in results:
        lines.append(f"| `{r['name']}` | {r['status']} | {r.get('secs', 0):.2f} | {_cell(r['detail'], 160)} |")
    mpath = os.path.join(out_dir, "probe.md")
    with open(mpath, "w") as f:
        f.write("\n".join(lines) + "\n")
    return mpath, jpath


def define_all() -> None:
    if CASES and any(not c.test_only for c in CASES.values()):
        return
    _artifact_cases()
    _input_cases()
    _pass_cases()
    _database_cases()
    _state_cases()


def select_cases(only=None, quick=False, names=None, exhaustive=False) -> list[str]:
    define_all()
    if names:
        missing = [n for n in names if n not in CASES]
        if missing:
            raise SystemExit(f"unknown cases: {missing}")
        return list(names)
    out = []
    for n, c in CASES.items():
        if c.test_only:
            continue
        if only and c.cls not in only:
            continue
        if quick and not c.quick:
            continue
        if not quick and not exhaustive and not is_core(n):
            continue
        out.append(n)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for probe.md and probe.json")
    ap.add_argument("--quick", action="store_true", help="a small subset (a few cases per class)")
    ap.add_argument("--exhaustive", action="store_true",
                    help="every registered case (about twice the default core set of ~250)")
    ap.add_argument("--only", action="append", choices=CLASSES, help="only this class (repeatable)")
    ap.add_argument("--case", action="append", help="only this case (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every case's timeout")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--test-cases", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--measure-pass", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure_pass:
        return measure_pass_main(*args.measure_pass)
    define_all()
    if args.worker:
        return worker_main(args.test_cases)
    names = select_cases(args.only, args.quick, args.case, args.exhaustive)
    if args.list:
        for n in names:
            c = CASES[n]
            print(f"{n}{'  [quick]' if c.quick else ''}")
        print(f"{len(names)} cases")
        return 0
    t0 = time.perf_counter()

    def progress(r):
        mark = "." if r["status"] == "clean" else r["status"].upper()
        print(f"{r['name']:60s} {mark:6s} {r.get('secs', 0):6.2f}s"
              + ("" if r["status"] == "clean" else f"  {r['detail'][:160]}"), flush=True)

    results = run_cases(names, timeout_scale=args.timeout_scale, progress=progress)
    wall = time.perf_counter() - t0
    mpath, jpath = write_report(results, args.out, wall, argv)
    table = summarize(results)
    print()
    print(f"{'class':10s} {'cases':>6s} " + " ".join(f"{o:>6s}" for o in OUTCOMES))
    for cls, row in table.items():
        print(f"{cls:10s} {row['cases']:6d} " + " ".join(f"{row[o]:6d}" for o in OUTCOMES))
    print(f"\n{len(results)} cases in {wall:.0f} s; wrote {mpath} and {jpath}")
    return 0 if table["total"]["clean"] == table["total"]["cases"] else 1


if __name__ == "__main__":
    sys.exit(main())
