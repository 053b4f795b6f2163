"""The trust probe's machinery (benchmarks/trust_probe.py): real cases of every class run clean
through the parent / worker-interpreter protocol, and the classifier detects each bad outcome
(fake cases registered in test mode only: an abort, a hang, a wrong result, a KeyError, ...)."""
from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import trust_probe as tp  # noqa: E402

REAL = [
    "artifacts.arrays:index-out-of-range",
    "artifacts.signature:library-replaced",
    "artifacts.zip-slip:parent",
    "inputs.special:nan-in-X:max",
    "inputs.X:dtype-float64",
    "inputs.out-alias:same",
    "passes.reorder.degree:diagonal",
    "database.damaged-records:api",
    "database.url:unknown-dialect",
    "state.loaded-module-folder-removed-then-saved:zip",
]

FAKE = {   # test-only case -> the outcome the classifier must give it
    "selftest.clean": "clean",
    "selftest.abort": "crash",            # os.abort(): the worker dies of SIGABRT
    "selftest.sleep": "hang",             # sleeps past its 2 s timeout
    "selftest.wrong": "wrong",            # a result that differs from the float64 reference
    "selftest.keyerror": "crash",         # an unexpected exception type
    "selftest.unclear_refusal": "crash",  # expected ValueError, got KeyError
    "selftest.silent": "wrong",           # bad input accepted silently
    "selftest.lost": "loss",
}


@pytest.fixture(scope="module")
def results():
    tp.define_all()
    tp.register_test_cases()
    # fakes interleaved with real cases: after each crash / hang a fresh worker runs the rest
    order = ["selftest.clean", REAL[0], "selftest.abort", REAL[1], REAL[2], "selftest.sleep", REAL[3], REAL[4],
             "selftest.wrong", "selftest.keyerror", REAL[5], "selftest.unclear_refusal", REAL[6],
             "selftest.silent", "selftest.lost", *REAL[7:]]
    res = tp.run_cases(order, test_cases=True)
    return {r["name"]: r for r in res}


def test_real_cases_of_every_class_are_clean(results):
    assert {tp.CASES[n].cls for n in REAL} == set(tp.CLASSES)
    bad = {n: (results[n]["status"], results[n]["detail"]) for n in REAL if results[n]["status"] != "clean"}
    assert not bad, bad


@pytest.mark.parametrize("name,want", sorted(FAKE.items()))
def test_classifier_detects_each_outcome(results, name, want):
    r = results[name]
    assert r["status"] == want, r
    if name == "selftest.abort":
        assert "SIGABRT" in r["detail"]
    if name == "selftest.sleep":
        assert r["secs"] < 30


def test_report_table(results, tmp_path):
    rs = list(results.values())
    table = tp.summarize(rs)
    assert table["selftest"] == {"cases": 8, "clean": 1, "wrong": 2, "crash": 3, "hang": 1, "loss": 1}
    assert table["total"]["cases"] == len(rs)
    md, js = tp.write_report(rs, str(tmp_path), 1.0, ["--test"])
    text = open(md).read()
    assert "| class | cases tried | handled cleanly | silently wrong | crash / unclear error | hang | loss |" in text
    assert "`selftest.abort` | crash" in text
    data = json.load(open(js))
    assert data["table"]["selftest"]["hang"] == 1 and len(data["results"]) == len(rs)


def test_case_selection():
    tp.define_all()
    quick = tp.select_cases(quick=True)
    core = tp.select_cases()
    assert set(quick) <= set(core) <= set(tp.select_cases(exhaustive=True))
    assert {tp.CASES[n].cls for n in quick} == set(tp.CLASSES)
    assert 150 <= len(core) <= 300
    assert all(tp.CASES[n].cls == "state" for n in tp.select_cases(only=["state"]))
    assert not any(n.startswith("selftest.") for n in tp.select_cases(exhaustive=True))
    assert os.path.isfile(tp.__file__)


def test_core_probe_is_all_clean():
    """The probe's core set (about 250 cases over every class: hostile artifacts, bad inputs, pass
    scaling at three sizes, database faults, state outside the artifact) runs in CI: any case that
    is silently wrong, crashes, hangs or loses data fails here, with its detail."""
    tp.define_all()
    res = tp.run_cases(tp.select_cases())
    bad = {r["name"]: (r["status"], r["detail"][:300]) for r in res if r["status"] != "clean"}
    assert not bad, bad
    assert {tp.CASES[r["name"]].cls for r in res} == set(tp.CLASSES) and len(res) >= 150
