"""Distributed tuning on a real PostgreSQL server: two workers share one study, one is killed
mid-trial; the survivor fails the stale trial and finishes the budget; the records are complete
and consistent.  The server comes from SPCOMPILE_TEST_PG_URL (.ci/postgres.sh in CI) or is
started here; the test skips only when none can be started outside CI (in CI it fails)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
N_TRIALS = 14
SLEEP = 0.4

pytestmark = pytest.mark.postgres


# -- worker (this file run as a script) -------------------------------------------------------
def _graph():
    import numpy as np
    import scipy.sparse as sp

    return sp.random(150, 150, density=0.04, format="csr", random_state=11, dtype=np.float32)


class SleepRunner:
    """Fake measurements that take ``sleep`` seconds; some configs fail."""

    target = "cpu"

    def __init__(self, sleep):
        self.sleep = sleep

    def measure(self, op, cfg, *, timeout=None, prune_above=None):
        from spcompile.autotune.measure import MeasureResult

        time.sleep(self.sleep)
        h = int(hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:8], 16)
        if h % 7 == 0:
            return MeasureResult("wrong_result", error="fake wrong result", config=cfg)
        return MeasureResult("ok", kernel_s=1e-3 * (1 + h % 89 / 10), preprocess_s=1e-4, config=cfg)

    def baseline(self, op):
        from spcompile.autotune.measure import MeasureResult

        return MeasureResult("ok", kernel_s=9e-3, name="fake-baseline")


def make_tuner(url, runner):
    from spcompile.compile import make_op
    from spcompile.autotune.tuner import Tuner

    return Tuner(make_op(_graph(), "spmm", 16), "cpu", storage=url, runner=runner, heartbeat_interval=1,
                 grace_period=3)


def worker_main(url, trials, sleep):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    res = make_tuner(url, SleepRunner(sleep)).run(trials=trials)
    print(json.dumps({"n_trials": res.n_trials, "stop": res.stop_reason}))
    return 0


# -- server fixtures ---------------------------------------------------------------------------
def _start_server() -> dict:
    env = dict(os.environ)
    if not os.environ.get("CI"):
        env["SPCOMPILE_PG_NO_INSTALL"] = "1"  # outside CI never install system packages from a test
    p = subprocess.run(["bash", os.path.join(ROOT, ".ci", "postgres.sh")], capture_output=True, text=True,
                       timeout=900, env=env)
    vals = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
    if p.returncode != 0 or not vals.get("SPCOMPILE_TEST_PG_URL"):
        raise RuntimeError(f"could not start PostgreSQL: {p.stderr[-2000:]}")
    return vals


@pytest.fixture(scope="module")
def pg_server():
    url = os.environ.get("SPCOMPILE_TEST_PG_URL")
    started = None
    err = "SPCOMPILE_TEST_PG_URL is not set"
    if not url:
        try:
            started = _start_server()
            url = started["SPCOMPILE_TEST_PG_URL"]
        except Exception as e:  # noqa: BLE001
            err = str(e)
    if not url:
        if os.environ.get("CI"):
            pytest.fail(f"no PostgreSQL server in CI: {err}")
        pytest.skip(f"no PostgreSQL server could be started: {err}")
    yield url
    if started and started.get("SPCOMPILE_TEST_PG_CTL") and started.get("SPCOMPILE_TEST_PG_DATA"):
        cmd = [started["SPCOMPILE_TEST_PG_CTL"], "-D", started["SPCOMPILE_TEST_PG_DATA"], "stop", "-m", "fast"]
        owner = started.get("SPCOMPILE_TEST_PG_OWNER")
        if os.geteuid() == 0 and owner and owner != "root":
            cmd = ["runuser", "-u", owner, "--"] + cmd
        subprocess.run(cmd, capture_output=True, timeout=60)
        import shutil

        shutil.rmtree(os.path.dirname(started["SPCOMPILE_TEST_PG_DATA"]), ignore_errors=True)


@pytest.fixture
def pg_url(pg_server):
    """A fresh database on the server for one test."""
    import sqlalchemy as sa

    name = "spc_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(pg_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    url = pg_server.rsplit("/", 1)[0] + "/" + name
    yield url
    from spcompile.autotune import database as dbm

    for k, db in list(dbm._DBS.items()):
        if k[0] == url:
            db.close()
            dbm._DBS.pop(k, None)
    for k, st in list(dbm._STORAGES.items()):
        if k[0] == url:
            st.engine.dispose()
            dbm._STORAGES.pop(k, None)
    with admin.connect() as c:
        c.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    admin.dispose()


# -- tests ---------------------------------------------------------------------------------------
def test_two_workers_one_killed(pg_url):
    import optuna
    from optuna.trial import TrialState

    from spcompile.autotune.database import open_database

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    watcher = make_tuner(pg_url, object())  # creates the study; reads it below
    study = watcher.study
    cmd = [sys.executable, os.path.abspath(__file__), "worker", pg_url, str(N_TRIALS), str(SLEEP)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    a = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    me_a = f"{socket.gethostname()}:{a.pid}"
    try:
        deadline = time.time() + 180
        killed_trial = None
        while time.time() < deadline and a.poll() is None:
            trials = study.get_trials(deepcopy=False)
            mine = [t for t in trials if t.user_attrs.get("worker") == me_a]
            finished = [t for t in mine if t.state.is_finished()]
            running = [t for t in mine if t.state == TrialState.RUNNING]
            if len(finished) >= 2 and running:
                a.send_signal(signal.SIGKILL)  # mid-trial: inside the (sleeping) measurement
                killed_trial = running[0].number
                break
            time.sleep(0.05)
        a.wait(timeout=30)
        assert killed_trial is not None, f"worker A never ran a trial: {a.stderr.read()[-3000:]}"
        out_b, err_b = b.communicate(timeout=240)
        assert b.returncode == 0, err_b[-3000:]
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()

    trials = study.get_trials(deepcopy=False)
    numbers = [t.number for t in trials]
    assert sorted(numbers) == list(range(len(trials)))           # no duplicated trial numbers
    assert not [t for t in trials if t.state == TrialState.RUNNING]  # nothing left hanging
    killed = next(t for t in trials if t.number == killed_trial)
    assert killed.state == TrialState.FAIL and "fail_reason" not in killed.user_attrs  # stale, failed by B
    counted = [t for t in trials if watcher._counted(t)]
    assert len(counted) == N_TRIALS                              # the budget was completed by B
    workers = {t.user_attrs.get("worker") for t in counted}
    assert me_a in workers and len(workers) == 2
    for t in counted:  # every verdict is complete
        assert "config" in t.user_attrs and "config_digest" in t.user_attrs
        if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs:
            assert t.user_attrs["result"]["status"] == "ok" and t.value > 0
        if t.state == TrialState.FAIL:
            assert t.user_attrs["fail_reason"] == "wrong_result"
    res = watcher.result()
    assert res.n_trials == N_TRIALS and res.n_stale >= 1
    # the database holds the best successful trial, and nothing that failed
    ok = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
    db = open_database(pg_url)
    rec = db.lookup(watcher.key, "cpu")
    assert rec is not None and rec.value_ms == pytest.approx(min(t.value for t in ok))
    assert rec.trial_number in {t.number for t in ok if t.value == pytest.approx(rec.value_ms)}
    # (the killed worker's stale trial is no verdict on its config: B may measure it and store it)
    failed = {json.dumps(t.user_attrs["config"], sort_keys=True) for t in trials
              if t.state == TrialState.FAIL and "config" in t.user_attrs and "fail_reason" in t.user_attrs}
    for r in db.records():
        assert json.dumps(r.config.to_dict(), sort_keys=True) not in failed


def test_concurrent_record_writers_postgres(pg_url):
    sys.path.insert(0, HERE)
    from test_database import concurrent_writers

    concurrent_writers(pg_url)


def test_build_lookup_through_postgres(pg_url):
    import numpy as np

    import spcompile

    res = make_tuner(pg_url, SleepRunner(0.0)).run(trials=4)
    assert res.best_config is not None
    mod = spcompile.build(_graph(), "spmm", K=16, target="cpu", storage=pg_url)
    assert mod.tuning["source"] == "database"
    assert mod.config.template == res.best_config.template
    X = np.ones((150, 16), np.float32)
    np.testing.assert_allclose(mod(X), _graph() @ X, rtol=1e-4, atol=1e-5)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(worker_main(sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
