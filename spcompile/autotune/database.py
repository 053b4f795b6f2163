"""The tuning database: Optuna storage URL handling and the best-config records.

One database URL (any SQLAlchemy / Optuna RDB URL: SQLite, PostgreSQL, MySQL) holds both

* Optuna's tables (the studies: every trial the tuner ran, shared by concurrent workers), and
* the table ``spcompile_records``: per workload, target, objective and template version, the
  best configuration measured (decisions only: pipeline + options, template + params), with
  its kernel / preprocessing times and the baseline's time.

Default location (:func:`default_storage_url`): the environment variable
``SPCOMPILE_TUNING_DB`` (an URL, or a file path for SQLite); else ``tuning_logs/spcompile.db``
beside the package when running from a source checkout; else ``~/.cache/spcompile/spcompile.db``.

Records are keyed by the workload digest (op, reduce, shape, nnz, dtype, K, sparsity-pattern
hash), the target digest (device name / arch, library versions, spcompile version), the objective
("kernel_time" or "amortized@N"), the precision policy it was found under and the Timer mode that
measured it (records of different policies or timing rules are never compared).  A
record whose template or pass sources changed since it was measured is *invalid*: lookups skip
it (they never crash on it) and the tuner may store a new one beside it.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .._version import __version__, tvm_version
from ..core.ir import WorkloadKey
from ..core.config import Config

__all__ = ["default_storage_url", "normalize_url", "target_key", "target_digest", "Record", "Database",
           "DatabaseError", "open_database", "optuna_storage", "config_digest", "pass_hashes", "ENV_VAR"]

ENV_VAR = "SPCOMPILE_TUNING_DB"
#: v2: a record's key names its precision policy and timing mode in columns of their own (v1 put
#: them in the objective label; v1 tables are left alone and unread: their template hashes predate
#: the current layout, so none of their records would be valid)
TABLE = "spcompile_records_v2"


class DatabaseError(RuntimeError):
    """The tuning database cannot be used as asked: a bad or unreachable storage URL, a table
    written by another spcompile version, a write to a read-only database.  Its message is one
    line, without the URL's password."""


def _hide_password(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not even an URL: show its scheme and host part only
        return url.split("@")[-1] if "@" in url else url


def _one_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an exception (or of the driver error it wraps)."""
    orig = getattr(e, "orig", None) or e
    text = " ".join(str(orig).split())   # newlines and runs of spaces: one line
    for marker in (" (Background on this error", "[SQL:"):
        text = text.split(marker)[0].strip()
    return f"{type(orig).__name__}: {text}"[:300] if text else type(orig).__name__


# -- locations ------------------------------------------------------------------------------
def _checkout_dir() -> str | None:
    """The source checkout containing the package (where pyproject.toml sits), if any."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(pkg)
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def default_storage_path() -> str:
    """Where the embedded SQLite database lives when ``SPCOMPILE_TUNING_DB`` is unset."""
    root = _checkout_dir()
    if root is not None:
        return os.path.join(root, "tuning_logs", "spcompile.db")
    return os.path.join(os.path.expanduser("~"), ".cache", "spcompile", "spcompile.db")


def normalize_url(storage: str | os.PathLike | None) -> str:
    """An SQLAlchemy URL from an URL, a file path (SQLite) or None (the default)."""
    if storage is None:
        storage = os.environ.get(ENV_VAR) or default_storage_path()
    try:
        storage = os.fspath(storage)
    except TypeError:
        raise DatabaseError(f"a storage must be an URL or a file path, got {type(storage).__name__}") from None
    if not isinstance(storage, str):
        storage = os.fsdecode(storage)
    if not storage.strip():
        raise DatabaseError("empty storage: give an SQLAlchemy URL (sqlite:///file.db, postgresql://...) "
                            "or a file path")
    if "\0" in storage:
        raise DatabaseError("the storage URL or path contains a NUL character")
    if "://" in storage:
        return _postgres_driver(storage)
    return "sqlite:///" + os.path.abspath(os.path.expanduser(storage))


def _postgres_driver(url: str) -> str:
    """A PostgreSQL URL without a driver (``postgresql://`` or the common ``postgres://``) names
    the driver that is installed: SQLAlchemy 2.1 takes psycopg 3 for a bare ``postgresql://``,
    while the ``[postgres]`` extra installs psycopg2."""
    scheme, rest = url.split("://", 1)
    if scheme not in ("postgresql", "postgres"):
        return url
    import importlib.util

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    if not found("psycopg") and found("psycopg2"):
        return "postgresql+psycopg2://" + rest
    return "postgresql://" + rest


def default_storage_url() -> str:
    return normalize_url(None)


def sqlite_path(url: str) -> str | None:
    """The file of an SQLite URL (None for other backends or in-memory SQLite)."""
    if not url.startswith("sqlite:///"):
        return None
    p = url[len("sqlite:///"):]
    return None if p in ("", ":memory:") else p


def _sqlite_ro_uri(path: str, immutable: bool) -> str:
    from urllib.parse import quote

    return f"file:{quote(os.path.abspath(path))}?" + ("immutable=1" if immutable else "mode=ro")


def _engine_kwargs(url: str, read_only: str | None = None) -> dict:
    """Engine options; ``read_only``: open an SQLite file read-only ("ro", or "immutable" where
    even the WAL index cannot be written)."""
    path = sqlite_path(url)
    if path is not None and read_only:
        def connect_ro():
            import sqlite3

            return sqlite3.connect(_sqlite_ro_uri(path, read_only == "immutable"), uri=True, timeout=30,
                                   check_same_thread=False)

        return {"creator": connect_ro}
    if path is not None:
        def connect():
            import sqlite3

            # concurrent workers on one file wait for the lock instead of failing at once;
            # WAL + synchronous=NORMAL: no fsync per commit (the studies commit a lot), still
            # crash-safe for the database file
            c = sqlite3.connect(path, timeout=120, check_same_thread=False)
            try:
                c.execute("PRAGMA journal_mode=WAL")
                c.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.OperationalError:  # e.g. a file system without shared memory: keep defaults
                pass
            return c

        return {"creator": connect}
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 120}}
    return {"pool_pre_ping": True}


# -- target keys ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cpu_target() -> dict:
    from ..runtime import cpu as rt

    import platform

    return {"target": "cpu", "device": rt.host_cpu_name() or platform.processor() or platform.machine(),
            "machine": platform.machine(), "threads": int(os.environ.get("TVM_NUM_THREADS") or os.cpu_count() or 1),
            "tvm": tvm_version(), "spcompile": __version__}


@functools.lru_cache(maxsize=None)
def _cuda_target() -> dict:
    d = {"target": "cuda", "spcompile": __version__}
    try:
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"]
        d.update(device=name.decode() if isinstance(name, bytes) else str(name),
                 arch=f"sm_{props['major']}{props['minor']}",
                 cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(), cupy=cupy.__version__)
    except Exception as e:  # no GPU: the key still differs from every real device's
        d.update(device="unavailable", error=type(e).__name__)
    try:
    
        d["tvm"] = tvm_version()
    except Exception:
        pass
    return d


def target_key(target: str) -> dict:
    """What a measurement depends on besides the workload: device, arch and library versions.
    Template and pass source hashes are checked per record (see :class:`Record`)."""
    if target == "cpu":
        return dict(_cpu_target())
    if target == "cuda":
        return dict(_cuda_target())
    raise ValueError(f"unknown target {target!r}")


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def target_digest(target: str | Mapping) -> str:
    return _digest(target_key(target) if isinstance(target, str) else dict(target))


def config_digest(config: Config) -> str:
    return _digest(config.to_dict())


def pass_hashes(pipeline: Iterable[Mapping]) -> dict[str, str]:
    """Source hash of every pass a pipeline names (a changed pass invalidates its records)."""
    from ..passes.base import get_pass

    out = {}
    for p in pipeline:
        name = p["name"]
        try:
            cls = type(get_pass(name))
            try:
                src = inspect.getsource(inspect.getmodule(cls))
            except (OSError, TypeError):
                src = repr(cls)
            src += inspect.getsource(cls.func) if getattr(cls, "func", None) is not None and \
                hasattr(cls.func, "__code__") else ""
            out[name] = hashlib.sha256(src.encode()).hexdigest()[:16]
        except Exception:
            out[name] = "unknown"
    return out


def template_hash(name: str) -> str | None:
    from ..kernels import get_template

    try:
        tpl = get_template(name)
    except ValueError:
        return None
    return f"{tpl.version}:{tpl.source_hash()}"


# -- records --------------------------------------------------------------------------------
@dataclass
class Record:
    """The best measured configuration of one template version for a workload on a target."""

    workload_digest: str
    target_digest: str
    objective: str
    config: Config
    kernel_ms: float
    preprocess_ms: float
    value_ms: float
    baseline_ms: float | None = None
    baseline_name: str | None = None
    workload: Mapping[str, Any] = field(default_factory=dict)
    target: Mapping[str, Any] = field(default_factory=dict)
    template_hash: str = ""
    pass_hashes: Mapping[str, str] = field(default_factory=dict)
    study_name: str | None = None
    trial_number: int | None = None
    created: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    id: int | None = None
    #: the precision policy the record was found under (:mod:`spcompile.core.numerics`)
    precision: str = "fp32"
    #: the Timer mode that measured it ("graph", "autorange", "cold_l2", ...)
    timing: str = ""

    @property
    def speedup(self) -> float | None:
        try:
            if self.baseline_ms and self.kernel_ms and self.kernel_ms > 0:
                return float(self.baseline_ms) / float(self.kernel_ms)
        except (TypeError, ValueError):   # a damaged field: no speed-up to show
            pass
        return None

    def invalid_reason(self) -> str | None:
        """Why this record no longer applies (changed template/pass source), or None if valid."""
        from ..kernels import get_template

        cur = template_hash(self.config.template)
        if cur is None:
            return f"template {self.config.template!r} is not registered"
        if cur != self.template_hash:
            return f"template {self.config.template!r} changed since it was measured"
        if not get_template(self.config.template).available():
            return f"template {self.config.template!r} cannot be built on this machine"
        now = pass_hashes(self.config.pipeline)
        for name, h in self.pass_hashes.items():
            if now.get(name) != h:
                return f"pass {name!r} changed since it was measured"
        return None

    @property
    def valid(self) -> bool:
        return self.invalid_reason() is None

    def to_dict(self) -> dict:
        return {"workload_digest": self.workload_digest, "target_digest": self.target_digest,
                "objective": self.objective, "precision": self.precision, "timing": self.timing,
                "config": self.config.to_dict(), "kernel_ms": self.kernel_ms,
                "preprocess_ms": self.preprocess_ms, "value_ms": self.value_ms, "baseline_ms": self.baseline_ms,
                "baseline_name": self.baseline_name, "workload": dict(self.workload), "target": dict(self.target),
                "template_hash": self.template_hash, "pass_hashes": dict(self.pass_hashes),
                "study_name": self.study_name, "trial_number": self.trial_number, "created": self.created,
                "extra": dict(self.extra)}


_WARNED: set = set()
_WARN_LOCK = threading.Lock()


def _warn_once(key, message: str) -> None:
    """One warning per ``key`` per process (a damaged database must not flood the caller)."""
    with _WARN_LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _valid(rec: "Record") -> bool:
    """``rec.valid``, with a record whose validity cannot even be checked (damaged fields)
    counted as invalid, with a warning."""
    try:
        return rec.valid
    except Exception as e:  # noqa: BLE001
        _warn_once(("invalid", rec.id, rec.workload_digest), f"skipping tuning record {rec.id}: it cannot be "
                   f"checked ({type(e).__name__}: {str(e)[:200]})")
        return False


def _feature_vector(workload: Mapping) -> dict[str, float]:
    f = dict(workload.get("features") or {})
    f["K"] = float(workload.get("K", 0))
    return f


def feature_distance(a: Mapping, b: Mapping) -> float:
    """Distance of two workloads (``WorkloadKey.to_dict()``): log-scaled sizes, raw fractions."""
    fa, fb = _feature_vector(a), _feature_vector(b)
    d = 0.0
    for k in sorted(set(fa) & set(fb)):
        x, y = float(fa[k]), float(fb[k])
        if k in ("density", "empty_rows", "bandwidth"):
            # fractions in [0, 1]: compare on a log scale of their own, clipped
            x, y = math.log10(max(x, 1e-9)), math.log10(max(y, 1e-9))
            w = 0.25
        else:
            x, y = math.log2(1.0 + max(x, 0.0)), math.log2(1.0 + max(y, 0.0))
            w = 2.0 if k == "K" else 1.0
        d += w * (x - y) ** 2
    return math.sqrt(d)


def _writable(path: str) -> bool:
    """Can this process write the SQLite file and its folder (the journal / WAL files live there)?"""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    return os.access(path, os.W_OK) and os.access(folder, os.W_OK | os.X_OK)


def _ro_mode(path: str) -> str:
    """"ro" when a read-only connection can read the file, else "immutable" (a WAL database whose
    index cannot be created in a read-only folder)."""
    import sqlite3

    try:
        c = sqlite3.connect(_sqlite_ro_uri(path, False), uri=True, timeout=5)
        try:
            c.execute("SELECT count(*) FROM sqlite_master").fetchone()
        finally:
            c.close()
        return "ro"
    except sqlite3.Error:
        wal = path + "-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > 0:
            _warn_once(("wal", path), f"the read-only tuning database {path} has a write-ahead log that cannot be "
                       "read here: records stored since its last checkpoint are not seen")
        return "immutable"


class Database:
    """The best-config records (and the Optuna storage) behind one SQLAlchemy URL.

    Writes (:meth:`save_if_better`) take SQLite's write lock at ``BEGIN IMMEDIATE`` so that
    read-compare-write is atomic across processes; reads begin a plain (deferred) transaction,
    so a lookup never waits behind a writer.  A database file this process cannot write is
    opened read-only (with one warning): its records are read, storing raises
    :class:`DatabaseError`; so does any storage that cannot be used (one line, no traceback).
    A damaged record is skipped with a warning; the next one is used."""

    def __init__(self, storage: str | os.PathLike | None = None, *, read_only: bool | None = None):
        import sqlite3

        import sqlalchemy as sa

        self.url = normalize_url(storage)
        shown = _hide_password(self.url)
        #: opened read-only (lookups work; storing raises :class:`DatabaseError`)
        self.read_only = False
        self._write_problem: str | None = None
        self._table_missing = False
        ro_mode = None
        path = sqlite_path(self.url)
        if path is not None:
            if os.path.isdir(path):
                raise DatabaseError(f"tuning database {path} is a folder, not an SQLite file")
            if os.path.exists(path):
                try:
                    with open(path, "rb") as fh:
                        head = fh.read(16)
                except OSError as e:
                    raise DatabaseError(f"cannot read the tuning database {path}: {e.strerror or e}") from None
                if head and head != b"SQLite format 3\x00":
                    raise DatabaseError(f"{path} is not an SQLite database (use another file or URL)")
                if read_only or not _writable(path):
                    ro_mode = _ro_mode(path)
            elif read_only:
                raise DatabaseError(f"no tuning database at {path}")
            else:
                folder = os.path.dirname(path) or "."
                try:
                    os.makedirs(folder, exist_ok=True)
                except OSError as e:
                    raise DatabaseError(f"cannot create the tuning database {path}: "
                                        f"{e.strerror or type(e).__name__} ({e.filename or folder})") from None
                if not os.access(folder, os.W_OK | os.X_OK):
                    raise DatabaseError(f"cannot create the tuning database {path}: its folder is not writable")
        elif read_only:
            raise DatabaseError("read_only=True is for SQLite files; give the server a read-only user instead")
        self.read_only = ro_mode is not None
        try:
            self.engine = sa.create_engine(self.url, **_engine_kwargs(self.url, ro_mode))
        except (sa.exc.SQLAlchemyError, ImportError, ValueError, TypeError, KeyError) as e:
            hint = (f" (install the database driver: pip install {e.name})"
                    if isinstance(e, ImportError) and getattr(e, "name", None) else "")
            raise DatabaseError(f"cannot use the tuning database {shown}: {_one_line(e)}{hint}") from None
        if self.url.startswith("sqlite"):
            @sa.event.listens_for(self.engine, "connect")
            def _connect(dbapi_conn, _rec):
                dbapi_conn.isolation_level = None

            @sa.event.listens_for(self.engine, "begin")
            def _begin(conn):
                # writes take the write lock at BEGIN (read-compare-write is atomic across
                # processes); reads begin a deferred transaction and never wait behind a writer
                if self.read_only or conn.get_execution_options().get("spcompile_read"):
                    conn.exec_driver_sql("BEGIN")
                else:
                    conn.exec_driver_sql("BEGIN IMMEDIATE")

        md = sa.MetaData()
        self.table = sa.Table(
            TABLE, md,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("workload_digest", sa.String(64), nullable=False),
            sa.Column("target_digest", sa.String(64), nullable=False),
            sa.Column("objective", sa.String(64), nullable=False),
            sa.Column("precision", sa.String(16), nullable=False),
            sa.Column("timing", sa.String(32), nullable=False),
            sa.Column("template", sa.String(128), nullable=False),
            sa.Column("template_hash", sa.String(128), nullable=False),
            sa.Column("op", sa.String(16)), sa.Column("reduce", sa.String(16)), sa.Column("K", sa.Integer),
            sa.Column("rows", sa.BigInteger), sa.Column("cols", sa.BigInteger), sa.Column("nnz", sa.BigInteger),
            sa.Column("workload", sa.Text), sa.Column("target", sa.Text), sa.Column("config", sa.Text),
            sa.Column("pass_hashes", sa.Text),
            sa.Column("kernel_ms", sa.Float), sa.Column("preprocess_ms", sa.Float),
            sa.Column("value_ms", sa.Float, nullable=False),
            sa.Column("baseline_ms", sa.Float), sa.Column("baseline_name", sa.String(256)),
            sa.Column("study_name", sa.String(256)), sa.Column("trial_number", sa.Integer),
            sa.Column("spcompile_version", sa.String(32)), sa.Column("created", sa.Float),
            sa.Column("extra", sa.Text),
            sa.UniqueConstraint("workload_digest", "target_digest", "objective", "precision", "timing", "template",
                                "template_hash", name="uq_spcompile_record_v2"),
            sa.Index("ix_spcompile_records_v2_lookup", "workload_digest", "target_digest"),
        )
        self._sa = sa
        try:
            with self._reader() as conn:
                insp = sa.inspect(conn)
                cols = {c["name"]: c for c in insp.get_columns(TABLE)} if insp.has_table(TABLE) else None
        except (sa.exc.SQLAlchemyError, sqlite3.Error, ImportError, OSError) as e:
            raise DatabaseError(f"cannot open the tuning database {shown}: {_one_line(e)}") from None
        if cols is None and self.read_only:
            self._table_missing = True   # a read-only database without records: every lookup misses
        elif cols is None:
            for attempt in range(10):  # concurrent first-time creation races (PostgreSQL: pg_type clash)
                try:
                    md.create_all(self.engine, checkfirst=True)
                    break
                except (sa.exc.OperationalError, sa.exc.ProgrammingError, sa.exc.IntegrityError) as e:
                    if attempt == 9:
                        raise DatabaseError(f"cannot create the records table in {shown}: {_one_line(e)}") from None
                    time.sleep(0.1 * (attempt + 1))
        else:
            self._check_schema(cols, shown)
        if self.read_only:
            _warn_once(("read-only", path), f"the tuning database {path} is read-only here: its records are used, "
                       "nothing new can be stored in it")

    def _check_schema(self, cols: dict, shown: str) -> None:
        """A table written by another spcompile version: missing columns make it unreadable (an
        error now); unknown required columns make it unwritable (an error at the first write)."""
        ours = {c.name for c in self.table.columns}
        missing = sorted(ours - set(cols))
        if missing:
            raise DatabaseError(f"the table {TABLE} in {shown} has another layout (no column "
                                f"{', '.join(missing)}): it was written by another spcompile version; "
                                "use another storage")
        extra = sorted(n for n, c in cols.items() if n not in ours and not c.get("nullable", True)
                       and c.get("default") is None and not c.get("autoincrement"))
        if extra:
            self._write_problem = (f"cannot store records in {shown}: its table {TABLE} requires columns this "
                                   f"spcompile does not know ({', '.join(extra)}), it was created by a newer "
                                   "spcompile; upgrade, or use another storage")

    def _reader(self):
        """A connection whose transactions are reads (a deferred BEGIN on SQLite)."""
        conn = self.engine.connect()
        conn.execution_options(spcompile_read=True)
        return conn

    def close(self):
        self.engine.dispose()

    # -- rows <-> records ----------------------------------------------------------------------
    def _to_record(self, row) -> Record:
        m = row._mapping
        return Record(workload_digest=m["workload_digest"], target_digest=m["target_digest"],
                      objective=m["objective"], config=Config.from_dict(json.loads(m["config"])),
                      kernel_ms=m["kernel_ms"], preprocess_ms=m["preprocess_ms"], value_ms=m["value_ms"],
                      baseline_ms=m["baseline_ms"], baseline_name=m["baseline_name"],
                      workload=json.loads(m["workload"] or "{}"), target=json.loads(m["target"] or "{}"),
                      template_hash=m["template_hash"], pass_hashes=json.loads(m["pass_hashes"] or "{}"),
                      study_name=m["study_name"], trial_number=m["trial_number"], created=m["created"] or 0.0,
                      extra=json.loads(m["extra"] or "{}"), id=m["id"], precision=m["precision"], timing=m["timing"])

    def _values(self, rec: Record) -> dict:
        w = rec.workload
        return {"workload_digest": rec.workload_digest, "target_digest": rec.target_digest,
                "objective": rec.objective, "precision": rec.precision, "timing": rec.timing,
                "template": rec.config.template, "template_hash": rec.template_hash,
                "op": w.get("op"), "reduce": w.get("reduce"), "K": w.get("K"), "rows": w.get("rows"),
                "cols": w.get("cols"), "nnz": w.get("nnz"),
                "workload": json.dumps(dict(w), sort_keys=True), "target": json.dumps(dict(rec.target), sort_keys=True),
                "config": json.dumps(rec.config.to_dict(), sort_keys=True),
                "pass_hashes": json.dumps(dict(rec.pass_hashes), sort_keys=True),
                "kernel_ms": float(rec.kernel_ms), "preprocess_ms": float(rec.preprocess_ms),
                "value_ms": float(rec.value_ms),
                "baseline_ms": None if rec.baseline_ms is None else float(rec.baseline_ms),
                "baseline_name": rec.baseline_name, "study_name": rec.study_name,
                "trial_number": rec.trial_number, "spcompile_version": __version__,
                "created": rec.created or time.time(), "extra": json.dumps(dict(rec.extra), sort_keys=True, default=str)}

    # -- writing -------------------------------------------------------------------------------
    def save_if_better(self, rec: Record) -> bool:
        """Store ``rec`` unless a record of the same template version measured at least as good
        exists.  Atomic under concurrent writers (row lock / SQLite write lock + unique key).
        Returns whether ``rec`` was stored."""
        sa = self._sa
        t = self.table
        if not (rec.value_ms > 0 and math.isfinite(rec.value_ms)):
            raise ValueError(f"a record needs a positive finite time, got {rec.value_ms}")
        if self.read_only:
            raise DatabaseError(f"cannot store a record in the read-only tuning database {_hide_password(self.url)}")
        if self._write_problem:
            raise DatabaseError(self._write_problem)
        vals = self._values(rec)
        key = [t.c.workload_digest == rec.workload_digest, t.c.target_digest == rec.target_digest,
               t.c.objective == rec.objective, t.c.precision == rec.precision, t.c.timing == rec.timing,
               t.c.template == rec.config.template,
               t.c.template_hash == rec.template_hash]
        for attempt in range(20):
            try:
                with self.engine.begin() as conn:
                    row = conn.execute(sa.select(t).where(*key).with_for_update()).first()
                    if row is None:
                        conn.execute(t.insert().values(**vals))
                        return True
                    # a better record wins unless it was invalidated (e.g. a pass it used changed)
                    if row.value_ms <= rec.value_ms and self._to_record(row).valid:
                        return False
                    conn.execute(t.update().where(t.c.id == row.id).values(**vals))
                    return True
            except sa.exc.IntegrityError as e:
                # a concurrent writer inserted the key first (compare again) -- or a constraint
                # this version does not know: then the record would be lost, so say so
                if self._key_exists(key):
                    continue
                raise DatabaseError(f"cannot store a record in {_hide_password(self.url)}: {_one_line(e)} "
                                    "(is the table from another spcompile version?)") from None
            except sa.exc.OperationalError as e:  # SQLite busy beyond its timeout, PG serialization
                text = str(getattr(e, "orig", e)).lower()
                if attempt == 19 or "readonly" in text or "read-only" in text or "no such" in text:
                    raise DatabaseError(f"cannot store a record in {_hide_password(self.url)}: "
                                        f"{_one_line(e)}") from None
                time.sleep(0.05 * (attempt + 1))
        raise DatabaseError(f"cannot store a record in {_hide_password(self.url)}: the key kept changing under "
                            "20 attempts (concurrent writers?)")

    def _key_exists(self, key) -> bool:
        try:
            with self._reader() as conn:
                return conn.execute(self._sa.select(self.table.c.id).where(*key)).first() is not None
        except self._sa.exc.SQLAlchemyError:
            return False

    def delete(self, workload_digest: str | None = None) -> int:
        if self.read_only:
            raise DatabaseError(f"cannot delete records in the read-only tuning database {_hide_password(self.url)}")
        t = self.table
        with self.engine.begin() as conn:
            q = t.delete()
            if workload_digest is not None:
                q = q.where(t.c.workload_digest == workload_digest)
            return conn.execute(q).rowcount

    # -- reading -------------------------------------------------------------------------------
    def records(self, workload_digest: str | None = None, target_digest: str | None = None,
                objective: str | None = None, op: str | None = None, precision: str | None = None,
                timing: str | tuple | None = None) -> list[Record]:
        sa = self._sa
        t = self.table
        q = sa.select(t)
        if workload_digest is not None:
            q = q.where(t.c.workload_digest == workload_digest)
        if target_digest is not None:
            q = q.where(t.c.target_digest == target_digest)
        if objective is not None:
            q = q.where(t.c.objective == objective)
        if op is not None:
            q = q.where(t.c.op == op)
        if precision is not None:
            q = q.where(t.c.precision == precision)
        if timing is not None:
            q = q.where(t.c.timing.in_([timing] if isinstance(timing, str) else list(timing)))
        if self._table_missing:
            return []
        try:
            with self._reader() as conn:
                rows = conn.execute(q.order_by(t.c.value_ms)).fetchall()
        except sa.exc.SQLAlchemyError as e:   # a server gone, a file replaced under us: one line
            raise DatabaseError(f"cannot read the tuning records in {_hide_password(self.url)}: {_one_line(e)}") from None
        out = []
        for r in rows:   # a damaged row is skipped (with one warning), never a reason to fail
            try:
                rec = self._to_record(r)
                if not (isinstance(rec.value_ms, (int, float)) and math.isfinite(rec.value_ms) and rec.value_ms > 0):
                    raise ValueError(f"bad time {rec.value_ms!r}")   # never stored by save_if_better
            except Exception as e:  # noqa: BLE001
                rid = getattr(r, "id", None)
                _warn_once(("bad-row", self.url, rid), f"skipping damaged tuning record {rid} in "
                           f"{_hide_password(self.url)}: {_one_line(e)}")
                continue
            out.append(rec)
        return out

    def lookup(self, key: WorkloadKey, target: str | Mapping, objective: str = "kernel_time",
               precision: str = "fp32", timing: str | tuple | None = None, skip: Iterable[int] = ()) -> Record | None:
        """The best *valid* record for this workload and target found under ``precision`` and
        measured with Timer mode ``timing`` (a mode, a tuple of modes, or None: any) -- None on a miss.
        ``skip``: record ids not to return (e.g. records that failed to build)."""
        skip = set(skip or ())
        for rec in self.records(key.digest(), target_digest(target), objective, precision=precision,
                                timing=timing):
            if rec.id in skip:
                continue
            if _valid(rec):
                return rec
        return None

    def best_records(self, *, include_invalid: bool = False, target: str | Mapping | None = None) -> list[Record]:
        """Per (workload, target, objective, precision, timing) the best record (valid ones first)."""
        recs = self.records(target_digest=None if target is None else target_digest(target))
        best: dict[tuple, Record] = {}
        for r in recs:  # sorted by value
            k = (r.workload_digest, r.target_digest, r.objective, r.precision, r.timing)
            if k in best:
                continue
            if include_invalid or _valid(r):
                best[k] = r
        return sorted(best.values(), key=lambda r: (r.workload.get("op") or "", r.workload.get("rows") or 0,
                                                    r.workload.get("K") or 0))

    def similar(self, key: WorkloadKey, target: str | Mapping, objective: str = "kernel_time",
                k: int = 3, precision: str | None = None,
                timing: str | tuple | None = None) -> list[tuple[float, Record]]:
        """Best valid records of the ``k`` most similar *other* workloads (same op and reduce)."""
        tdig = target_digest(target)
        mine = key.to_dict()
        own = key.digest()
        per_workload: dict[str, Record] = {}
        for r in self.records(target_digest=tdig, objective=objective, op=key.op, precision=precision,
                              timing=timing):
            if r.workload_digest == own or r.workload.get("reduce") != key.reduce or r.workload_digest in per_workload:
                continue
            if _valid(r):
                per_workload[r.workload_digest] = r
        scored = sorted(((feature_distance(mine, r.workload), r) for r in per_workload.values()),
                        key=lambda x: x[0])
        return scored[:k]


# -- shared handles -------------------------------------------------------------------------
_DBS: dict[str, Database] = {}
_STORAGES: dict[tuple, Any] = {}
_HANDLE_LOCK = threading.Lock()


def open_database(storage: str | os.PathLike | None = None) -> Database:
    """A (per-process cached) :class:`Database` for ``storage``."""
    url = normalize_url(storage)
    with _HANDLE_LOCK:
        db = _DBS.get((url, os.getpid()))
        if db is None:
            db = _DBS[(url, os.getpid())] = Database(url)
        return db


def optuna_storage(storage: str | os.PathLike | None = None, heartbeat_interval: int | None = 10,
                   grace_period: int | None = 30):
    """The Optuna RDB storage for ``storage`` with heartbeats (killed workers' trials go stale and
    are failed by the surviving workers)."""
    import optuna

    url = normalize_url(storage)
    k = (url, heartbeat_interval, grace_period, os.getpid())
    with _HANDLE_LOCK:
        st = _STORAGES.get(k)
        if st is None:
            path = sqlite_path(url)
            if path is not None:
                try:
                    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                except OSError as e:
                    raise DatabaseError(f"cannot create the tuning database {path}: {e.strerror or e}") from None
            last = None
            for _ in range(10):  # concurrent first-time schema creation may race
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                        st = optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url),
                                                        heartbeat_interval=heartbeat_interval,
                                                        grace_period=grace_period)
                    break
                except Exception as e:  # noqa: BLE001
                    last = e
                    time.sleep(0.3)
            if st is None:
                raise DatabaseError(f"cannot open the Optuna storage {_hide_password(url)}: {_one_line(last)}")
            _STORAGES[k] = st
        return st
