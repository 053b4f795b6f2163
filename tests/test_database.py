"""Tuning database: locations, keyed hit/miss, upsert-if-better, invalidation, similarity,
concurrent writers."""
from __future__ import annotations

import multiprocessing as mp
import os
import random

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.autotune import database as dbm
from spcompile.compile import make_op
from spcompile.autotune.database import Database, Record, normalize_url, pass_hashes, target_digest, target_key, template_hash
from spcompile.core.config import Config
from spcompile.autotune.policy import choose_config


def graph(n=100, seed=0, density=0.05):
    return sp.random(n, n, density=density, format="csr", random_state=seed, dtype=np.float32)


def make_record(op, value=1.0, template=None, pipeline=(), target="cpu", objective="kernel_time", **kw):
    if template is None:
        template = spcompile.list_templates("cpu", op=op.op, reduce=op.reduce, available_only=True)[0].name
    tpl = spcompile.get_template(template)
    cfg = Config(template, tpl.default_params(spcompile.SparseModule.from_op(op)), tuple(pipeline), "cpu", tpl.format)
    return Record(op.key().digest(), target_digest(target), objective, cfg, kernel_ms=value, preprocess_ms=0.5,
                  value_ms=value, baseline_ms=2.0, baseline_name="fake", workload=op.key().to_dict(),
                  target=target_key(target), template_hash=template_hash(template),
                  pass_hashes=pass_hashes(pipeline), **kw)


def test_storage_locations(monkeypatch, tmp_path):
    monkeypatch.delenv(dbm.ENV_VAR, raising=False)
    url = normalize_url(None)
    assert url.startswith("sqlite:///") and url.endswith("spcompile.db")
    if dbm._checkout_dir():
        assert os.path.join("tuning_logs", "spcompile.db") in url
    monkeypatch.setenv(dbm.ENV_VAR, str(tmp_path / "x.db"))
    assert normalize_url(None) == "sqlite:///" + str(tmp_path / "x.db")
    monkeypatch.setenv(dbm.ENV_VAR, "postgresql+psycopg2://u@h/db")
    assert normalize_url(None) == "postgresql+psycopg2://u@h/db"
    assert normalize_url("sqlite:///a.db") == "sqlite:///a.db"


def test_keyed_hit_and_miss(tmp_path):
    db = Database(tmp_path / "r.db")
    op = make_op(graph(), "spmm", 32)
    assert db.lookup(op.key(), "cpu") is None
    assert db.save_if_better(make_record(op, 1.0))
    hit = db.lookup(op.key(), "cpu")
    assert hit is not None and hit.value_ms == 1.0 and hit.valid and hit.speedup == 2.0
    assert db.lookup(make_op(graph(), "spmm", 64).key(), "cpu") is None            # other K
    assert db.lookup(make_op(graph(), "spmm", 32, "max").key(), "cpu") is None      # other reduce
    assert db.lookup(make_op(graph(seed=1), "spmm", 32).key(), "cpu") is None       # other pattern
    assert db.lookup(op.key(), "cpu", objective="amortized@10") is None              # other objective
    other_target = dict(target_key("cpu"), device="another-cpu")
    assert db.lookup(op.key(), other_target) is None


def test_upsert_only_if_better(tmp_path):
    db = Database(tmp_path / "r.db")
    op = make_op(graph(), "spmm", 32)
    assert db.save_if_better(make_record(op, 2.0))
    assert not db.save_if_better(make_record(op, 3.0))
    assert db.lookup(op.key(), "cpu").value_ms == 2.0
    assert db.save_if_better(make_record(op, 1.5, trial_number=7))
    rec = db.lookup(op.key(), "cpu")
    assert rec.value_ms == 1.5 and rec.trial_number == 7
    assert len(db.records(op.key().digest())) == 1
    with pytest.raises(ValueError):
        db.save_if_better(make_record(op, float("inf")))


def test_invalidation_on_template_pass_or_version_change(tmp_path, monkeypatch):
    db = Database(tmp_path / "r.db")
    op = make_op(graph(), "spmm", 32)
    # a record measured with an older version of the template's source
    stale = make_record(op, 0.5)
    stale.template_hash = "0:deadbeef"
    db.save_if_better(stale)
    assert db.lookup(op.key(), "cpu") is None  # ignored, not a crash
    assert "changed" in db.records(op.key().digest())[0].invalid_reason()
    good = make_record(op, 0.9)
    assert db.save_if_better(good)  # stored beside the stale one (other template version)
    assert db.lookup(op.key(), "cpu").value_ms == 0.9
    # an unknown template
    ghost = make_record(op, 0.1)
    ghost.config = Config("cpu.no_such_template", {}, (), "cpu")
    db.save_if_better(ghost)
    assert db.lookup(op.key(), "cpu").value_ms == 0.9
    # a pass whose source changed
    rec = make_record(op, 0.2, pipeline=({"name": "reorder.rcm", "options": {"symmetric_mode": True}},))
    rec.pass_hashes = {"reorder.rcm": "changed"}
    rec.template_hash = template_hash(rec.config.template)
    db.delete(op.key().digest())
    db.save_if_better(rec)
    assert db.lookup(op.key(), "cpu") is None
    # a library version change changes the target digest: every record misses
    db.save_if_better(make_record(op, 0.7))
    assert db.lookup(op.key(), "cpu") is not None
    newer = dict(target_key("cpu"), tvm="9.9.9")
    monkeypatch.setattr(dbm, "_cpu_target", lambda: newer)
    assert db.lookup(op.key(), "cpu") is None
    cfg, info = choose_config(op, "cpu", storage=str(tmp_path / "r.db"), select_budget=0)
    assert info["source"] == "heuristic"


def test_best_records_and_similar(tmp_path):
    db = Database(tmp_path / "r.db")
    small = make_op(graph(100, seed=1), "spmm", 32)
    near = make_op(graph(110, seed=2), "spmm", 32)
    far = make_op(graph(3000, seed=3, density=0.002), "spmm", 256)
    for op, v in ((small, 1.0), (near, 1.1), (far, 9.0)):
        db.save_if_better(make_record(op, v))
    best = db.best_records()
    assert len(best) == 3
    query = make_op(graph(105, seed=4), "spmm", 32)
    sims = db.similar(query.key(), "cpu", k=2)
    assert {r.workload_digest for _, r in sims} == {small.key().digest(), near.key().digest()}
    assert sims[0][0] <= sims[1][0]
    assert db.similar(query.key(), "cpu", k=3)[-1][1].workload_digest == far.key().digest()
    assert all(r.workload_digest != query.key().digest() for _, r in db.similar(small.key(), "cpu"))


def test_build_uses_the_database(tmp_path):
    A = graph(80, seed=9)
    op = make_op(A, "spmm", 8)
    db = Database(tmp_path / "b.db")
    tpl = spcompile.list_templates("cpu", op="spmm", reduce="sum", available_only=True)[0]
    params = dict(tpl.default_params(spcompile.SparseModule.from_op(op)))
    space = tpl.space(spcompile.SparseModule.from_op(op))
    name, dist = next(iter(space.items()))
    params[name] = dist.choices[0]
    rec = make_record(op, 0.3, pipeline=({"name": "reorder.degree", "options": {"descending": True}},))
    rec.config = Config(tpl.name, params, rec.config.pipeline, "cpu", tpl.format)
    db.save_if_better(rec)
    mod = spcompile.build(A, "spmm", K=8, target="cpu", storage=str(tmp_path / "b.db"))
    assert mod.tuning["source"] == "database" and mod.config.params[name] == dist.choices[0]
    assert [p["name"] for p in mod.config.pipeline] == ["reorder.degree"]
    X = np.random.default_rng(1).standard_normal((80, 8)).astype(np.float32)
    np.testing.assert_allclose(mod(X), A @ X, rtol=1e-4, atol=1e-5)


def _writer(url, seed, n, out_q):
    try:
        A = graph(100)
        op = make_op(A, "spmm", 32)
        db = Database(url)
        rng = random.Random(seed)
        vals = []
        for _ in range(n):
            v = round(rng.uniform(1.0, 100.0), 6)
            vals.append(v)
            db.save_if_better(make_record(op, v, trial_number=seed))
        out_q.put(("ok", min(vals)))
    except BaseException as e:  # noqa: BLE001
        out_q.put(("error", repr(e)))


def concurrent_writers(url, n_proc=3, n=10):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(url, s, n, q)) for s in range(n_proc)]
    for p in procs:
        p.start()
    results = [q.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(r[0] == "ok" for r in results), results
    db = Database(url)
    op = make_op(graph(100), "spmm", 32)
    recs = db.records(op.key().digest())
    assert len(recs) == 1  # one row per key: no lost update, no duplicate
    assert recs[0].value_ms == pytest.approx(min(r[1] for r in results))


def test_concurrent_writers_sqlite(tmp_path):
    concurrent_writers(normalize_url(tmp_path / "c.db"))
