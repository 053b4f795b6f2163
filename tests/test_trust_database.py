"""The tuning database under faults: a table from a newer spcompile, a read-only file, damaged
records, a writer holding the lock, bad storage URLs.  Each case asserts the clear error or the
correct result -- never a record silently lost, never a traceback in the CLI."""
from __future__ import annotations

import importlib
import json
import os
import sqlite3
import stat
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.autotune import database as dbm
from spcompile.autotune.database import TABLE, Database, DatabaseError, open_database
from spcompile.compile import make_op
from spcompile.core.config import Config

from conftest import REPO
from test_database import make_record
from test_tuner import Drifting, FakeRunner

sys.path.insert(0, str(REPO / "benchmarks"))
from trust_probe import _columns_sql  # noqa: E402  (the current table layout as SQL, plus extras)

cli_main = importlib.import_module("spcompile.cli.main")


def graph(n=90, seed=0):
    A = sp.random(n, n, density=0.05, format="csr", random_state=seed, dtype=np.float32)
    A.data[:] = 1.0
    return A


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees its own 'once' warnings."""
    dbm._WARNED.clear()
    yield
    dbm._WARNED.clear()




# -- a table from another version ----------------------------------------------------------------
def test_newer_schema_is_a_clear_error_not_a_lost_record(tmp_path, capsys):
    path = tmp_path / "newer.db"
    con = sqlite3.connect(path)
    con.execute(f'CREATE TABLE {TABLE} ({_columns_sql("schema_v3_field TEXT NOT NULL")})')
    con.commit()
    con.close()
    db = Database(path)
    op = make_op(graph(), "spmm", 16)
    assert db.lookup(op.key(), "cpu") is None                   # reading still works
    with pytest.raises(DatabaseError, match="newer spcompile") as ei:
        db.save_if_better(make_record(op, 1.0))
    assert "\n" not in str(ei.value)
    # `spcompile tune` into it: a non-zero exit with one line, no best time claimed as stored
    g = tmp_path / "g.npz"
    sp.save_npz(g, graph())
    from spcompile.autotune import tuner as tuner_mod

    real = tuner_mod.Tuner
    from spcompile.compile import default_config

    class Worth(Drifting):   # a slow baseline and a slow default: the search's best is worth storing
        def kernel_s(self, cfg):
            return 0.5 if cfg == default_config(make_op(graph(), "spmm", 8), "cpu") else super().kernel_s(cfg)

    tuner_mod.Tuner = lambda *a, **k: real(*a, **{**k, "runner": Worth(1e3)})
    try:
        rc = cli_main.main(["tune", str(g), "-K", "8", "--trials", "3", "--storage", str(path), "--target", "cpu",
                            "--no-progress"])
    finally:
        tuner_mod.Tuner = real
    err = capsys.readouterr().err
    assert rc != 0 and "error: cannot store records" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_unknown_constraint_is_not_taken_for_a_race(tmp_path):
    """An IntegrityError that is not a concurrent insert of the same key (here a CHECK this version
    does not know) raises instead of dropping the record."""
    path = tmp_path / "check.db"
    con = sqlite3.connect(path)
    con.execute(f'CREATE TABLE {TABLE} ({_columns_sql("CHECK (kernel_ms > 100)")})')
    con.commit()
    con.close()
    db = Database(path)
    op = make_op(graph(), "spmm", 16)
    with pytest.raises(DatabaseError, match="cannot store a record") as ei:
        db.save_if_better(make_record(op, 1.0))
    assert "IntegrityError" in str(ei.value) and "\n" not in str(ei.value)
    assert db.save_if_better(make_record(op, 150.0))   # what the table does accept is stored


def test_older_layout_is_a_clear_error(tmp_path):
    path = tmp_path / "older.db"
    con = sqlite3.connect(path)
    con.execute(f'CREATE TABLE {TABLE} (id INTEGER PRIMARY KEY, workload_digest TEXT, config TEXT)')
    con.commit()
    con.close()
    with pytest.raises(DatabaseError, match="another spcompile version"):
        Database(path)
    assert cli_main.main(["best", "--storage", str(path)]) == 2


# -- read-only ------------------------------------------------------------------------------------
def _tuned_db(tmp_path, A, K=16):
    from spcompile.autotune.tuner import Tuner

    path = str(tmp_path / "ro" / "t.db")
    res = Tuner(make_op(A, "spmm", K), "cpu", storage=path, runner=FakeRunner(), seed=0).run(trials=5)
    assert res.stored
    return path, res


def test_read_only_database_is_still_read(tmp_path, monkeypatch):
    A = graph(seed=3)
    path, res = _tuned_db(tmp_path, A)
    for name in ("t.db", "t.db-wal", "t.db-shm"):
        f = os.path.join(os.path.dirname(path), name)
        if os.path.exists(f):
            os.chmod(f, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    os.chmod(os.path.dirname(path), stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    if os.geteuid() == 0:   # root writes whatever the mode says: the permission check sees it as a user would
        monkeypatch.setattr(dbm, "_writable", lambda p: False)
    try:
        dbm._DBS.clear()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            mod = spcompile.build(A, "spmm", K=16, target="cpu", storage=path)
            mod2 = spcompile.build(A, "spmm", K=16, target="cpu", storage=path)
            db = Database(path)
        ro = [x for x in w if "read-only" in str(x.message)]
        assert len(ro) == 1, [str(x.message) for x in w]         # warned once
        assert mod.tuning["source"] == "database" and mod.config == res.best_config and mod2.config == mod.config
        assert db.read_only and db.lookup(make_op(A, "spmm", 16).key(), "cpu") is not None
        with pytest.raises(DatabaseError, match="read-only"):
            db.save_if_better(make_record(make_op(A, "spmm", 16), 0.1))
        with pytest.raises(DatabaseError, match="read-only"):
            spcompile.build(A, "spmm", K=8, target="cpu", storage=path, trials=2, runner=FakeRunner())
        assert cli_main.main(["best", "--storage", path]) == 0
    finally:
        os.chmod(os.path.dirname(path), stat.S_IRWXU)
        dbm._DBS.clear()


def test_read_only_flag_and_missing_table(tmp_path):
    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()   # an empty SQLite file: no table yet
    db = Database(path, read_only=True)
    assert db.read_only and db.records() == [] and db.lookup(make_op(graph(), "spmm", 8).key(), "cpu") is None
    with pytest.raises(DatabaseError, match="no tuning database"):
        Database(tmp_path / "absent.db", read_only=True)


def test_ro_mode_falls_back_to_immutable(tmp_path, monkeypatch):
    """A WAL database whose index cannot be opened read-only is read as immutable."""
    A = graph(seed=4)
    path, res = _tuned_db(tmp_path, A)
    con = sqlite3.connect(path)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # as a writer that closed cleanly leaves it
    con.close()
    monkeypatch.setattr(dbm, "_ro_mode", lambda p: "immutable")
    db = Database(path, read_only=True)
    assert db.lookup(make_op(A, "spmm", 16).key(), "cpu").config == res.best_config


# -- damaged records ------------------------------------------------------------------------------
def test_damaged_record_is_skipped_with_a_warning(tmp_path):
    A = graph(seed=5)
    op = make_op(A, "spmm", 8)
    path = str(tmp_path / "bad.db")
    db = Database(path)
    good = make_record(op, 1.0)
    assert db.save_if_better(good)
    con = sqlite3.connect(path)
    row = con.execute(f"SELECT * FROM {TABLE}").fetchone()
    names = [d[0] for d in con.execute(f"SELECT * FROM {TABLE}").description]
    vals = dict(zip(names, row))
    bad_rows = [dict(vals, id=None, template="bad.json", config="{not json", value_ms=0.1),
                dict(vals, id=None, template="bad.types", workload="[1, 2", value_ms=0.2),
                dict(vals, id=None, template="bad.time", value_ms="fast")]
    for r in bad_rows:
        con.execute(f"INSERT INTO {TABLE} ({', '.join(r)}) VALUES ({', '.join('?' * len(r))})", list(r.values()))
    con.commit()
    con.close()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        hit = db.lookup(op.key(), "cpu")
        db.lookup(op.key(), "cpu")
        best = db.best_records()
    assert hit is not None and hit.value_ms == 1.0 and hit.config == good.config
    assert len(best) == 1
    msgs = [str(x.message) for x in w if "damaged tuning record" in str(x.message)]
    assert len(msgs) == 3, msgs                          # one warning per damaged record, not per lookup
    mod = spcompile.build(A, "spmm", K=8, target="cpu", storage=path)
    assert mod.tuning["source"] == "database" and mod.config == good.config


def test_record_that_does_not_build_falls_back_to_the_next(tmp_path):
    A = graph(seed=6)
    op = make_op(A, "spmm", 8)
    path = str(tmp_path / "nobuild.db")
    db = Database(path)
    good = make_record(op, 1.0)
    assert db.save_if_better(good)
    broken = make_record(op, 0.5)
    broken.config = Config(good.config.template, {**good.config.params, "k_tile": "not-a-number"}, (), "cpu",
                           good.config.format)
    # the same key as `good` would replace it: the broken one is a row of another timing label
    con = sqlite3.connect(path)
    row = dict(zip([d[0] for d in con.execute(f"SELECT * FROM {TABLE}").description],
                   con.execute(f"SELECT * FROM {TABLE}").fetchone()))
    row.update(id=None, value_ms=0.5, kernel_ms=0.5, timing="autorange",
               config=json.dumps(broken.config.to_dict(), sort_keys=True))
    con.execute(f"INSERT INTO {TABLE} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    con.commit()
    con.close()
    assert db.lookup(op.key(), "cpu", timing=("autorange", "")).value_ms == 0.5   # the broken one comes first
    with pytest.warns(RuntimeWarning, match="does not build here"):
        mod = spcompile.build(A, "spmm", K=8, target="cpu", storage=path)
    assert mod.tuning["source"] == "database" and mod.config == good.config
    X = np.random.default_rng(0).standard_normal((90, 8)).astype(np.float32)
    np.testing.assert_allclose(mod(X), A @ X, rtol=1e-4, atol=1e-5)


# -- locks ----------------------------------------------------------------------------------------
def test_lookups_do_not_wait_behind_a_writer(tmp_path):
    A = graph(seed=7)
    op = make_op(A, "spmm", 8)
    path = str(tmp_path / "locked.db")
    db = Database(path)
    assert db.save_if_better(make_record(op, 1.0))
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")   # another process is storing (holds the write lock)
    writer.execute(f"UPDATE {TABLE} SET baseline_name = 'w'")
    try:
        dbm._DBS.clear()
        t0 = time.perf_counter()
        fresh = Database(path)                       # opening reads the layout: no write lock
        assert fresh.lookup(op.key(), "cpu").value_ms == 1.0
        mod = spcompile.build(A, "spmm", K=8, target="cpu", storage=path)
        assert mod.tuning["source"] == "database"
        assert time.perf_counter() - t0 < 10.0, "a lookup waited for the writer"
        # a write does wait for the lock (it is atomic), and goes through once it is released
        done = []
        th = threading.Thread(target=lambda: done.append(fresh.save_if_better(make_record(op, 0.5))))
        th.start()
        time.sleep(0.5)
        assert not done
    finally:
        writer.execute("COMMIT")
        writer.close()
    th.join(timeout=60)
    assert done == [True] and fresh.lookup(op.key(), "cpu").value_ms == 0.5


# -- bad storage URLs -----------------------------------------------------------------------------
def _bad_urls(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_text("this is not a database\n" * 10)
    afile = tmp_path / "afile"
    afile.write_text("x")
    return [
        "foo://bar",                                        # unknown dialect
        "http://example.com/db",
        "postgresql+nodriver://u@localhost/db",             # unknown driver
        "mysql://u@127.0.0.1:1/db",                         # driver not installed
        "oracle://u@127.0.0.1:1/db",
        "postgresql://u:s3cret@127.0.0.1:1/db",             # a driver that may be missing (password not shown)
        "postgresql+psycopg2://u:s3cret@127.0.0.1:1/db",    # connection refused
        "://nothing",
        "sqlite://x.db",                                    # sqlite URL with a host
        str(tmp_path),                                      # a folder
        "sqlite:///" + str(tmp_path),
        str(junk),                                          # not an SQLite file
        str(afile / "sub" / "t.db"),                        # a file where a folder should be
        "/proc/no-such-dir/t.db",                           # cannot create the folder
        "   ",
        "postgresql://u@[::1/db",                           # malformed host
        "sqlite:///" + str(tmp_path / "a\0b.db"),
    ]


def test_bad_storage_urls_are_one_line_errors(tmp_path):
    for url in _bad_urls(tmp_path):
        with pytest.raises(DatabaseError) as ei:
            Database(url)
        msg = str(ei.value)
        assert msg and "\n" not in msg and "s3cret" not in msg and len(msg) < 500, (url, msg)
    with pytest.raises(DatabaseError):
        Database("")


def test_bad_storage_urls_in_the_cli(tmp_path, capsys):
    g = tmp_path / "g.npz"
    sp.save_npz(g, graph())
    for url in _bad_urls(tmp_path):
        if "\0" in url:
            continue   # an argument cannot carry NUL
        for argv in (["best", "--storage", url],
                     ["tune", str(g), "-K", "4", "--trials", "1", "--storage", url, "--target", "cpu", "--no-progress"]):
            rc = cli_main.main(argv)
            out, err = capsys.readouterr()
            lines = [line for line in err.splitlines() if line.strip()]
            if argv[0] == "best" and rc == 1 and "no tuning database" in err:
                continue   # a path that does not exist: nothing to list
            assert rc == 2, (argv, rc, out, err)
            assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, (argv, err)
            assert "s3cret" not in err
    # build() with an explicit bad storage: the same one-line error
    rc = cli_main.main(["build", str(g), "-K", "4", "--target", "cpu", "--storage", "foo://bar",
                        "-o", str(tmp_path / "m.spc")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "Traceback" not in err


def test_only_writes_take_the_write_lock(tmp_path):
    """Lookups begin a plain (deferred) transaction; only a write begins with BEGIN IMMEDIATE."""
    import sqlalchemy as sa

    op = make_op(graph(seed=8), "spmm", 8)
    db = Database(tmp_path / "stmts.db")
    seen: list[str] = []
    sa.event.listen(db.engine, "before_cursor_execute",
                    lambda conn, cur, stmt, *a: seen.append(stmt.strip().split("\n")[0]))
    assert db.save_if_better(make_record(op, 1.0))
    assert "BEGIN IMMEDIATE" in seen
    seen.clear()
    assert db.lookup(op.key(), "cpu") is not None
    db.best_records()
    db.similar(op.key(), "cpu")
    begins = [s for s in seen if s.startswith("BEGIN")]
    assert begins and all(s == "BEGIN" for s in begins), begins


def test_broken_default_database_warns_once_and_builds(tmp_path, monkeypatch):
    from spcompile.autotune import policy

    junk = tmp_path / "default.db"
    junk.write_text("not sqlite at all\n" * 20)
    monkeypatch.setenv(dbm.ENV_VAR, str(junk))
    monkeypatch.setattr(policy, "_WARNED_DEFAULT", set())
    A = graph(seed=9)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m1 = spcompile.build(A, "spmm", K=8, target="cpu")
        m2 = spcompile.build(A, "spmm", K=8, target="cpu")
    msgs = [str(x.message) for x in w if "cannot be used" in str(x.message)]
    assert len(msgs) == 1 and "not an SQLite database" in msgs[0], msgs
    assert m1.tuning["source"] == m2.tuning["source"] == "quick" and "db_error" in m1.tuning
    # with the storage named explicitly it is an error, not a silent fallback
    with pytest.raises(DatabaseError, match="not an SQLite database"):
        spcompile.build(A, "spmm", K=8, target="cpu", storage=str(junk))


@pytest.mark.parametrize("url, have, want", [
    ("postgresql://u@h/db", {"psycopg2"}, "postgresql+psycopg2://u@h/db"),
    ("postgres://u@h:5/db", {"psycopg2"}, "postgresql+psycopg2://u@h:5/db"),
    ("postgresql://u@h/db", {"psycopg", "psycopg2"}, "postgresql://u@h/db"),
    ("postgres://u@h/db", set(), "postgresql://u@h/db"),
    ("postgresql+psycopg://u@h/db", {"psycopg2"}, "postgresql+psycopg://u@h/db"),
    ("mysql://u@h/db", {"psycopg2"}, "mysql://u@h/db"),
])
def test_postgres_url_names_the_installed_driver(monkeypatch, url, have, want):
    import importlib.util

    from spcompile.autotune import database

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if name in have else None) if name.startswith("psycopg")
                        else real(name, *a))
    assert database.normalize_url(url) == want
