"""Cold start: ``import spcompile`` imports none of TVM, torch, Optuna, scipy; loading and calling a
saved CPU module loads TVM's runtime library only (not ``tvm``, its compiler, or torch), and the
process can still import torch and compile afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("tvm", "torch", "optuna", "scipy", "cupy", "sqlalchemy", "spcompile.autotune")


def _run(code: str, tmp_path) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO, "SPCOMPILE_TUNING_DB": str(tmp_path / "t.db")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _loaded():
    return f"[m for m in {HEAVY!r} if m in sys.modules]"


def test_import_spcompile_is_light(tmp_path):
    out = _run(f"import sys, json, spcompile; print(json.dumps({_loaded()}))", tmp_path)
    assert out == []


def test_the_tuner_is_imported_when_used(tmp_path):
    out = _run("import sys, json, spcompile; from spcompile import tune; import spcompile.api as api; "
               "print(json.dumps([tune.__module__, spcompile.tune is tune, api.tune is tune, "
               "'spcompile.autotune.tuner' in sys.modules]))", tmp_path)
    assert out == ["spcompile.autotune.tuner", True, True, True]
    with pytest.raises(AttributeError, match="no attribute 'tunes'"):
        spcompile.tunes


@pytest.fixture
def cpu_artifact(tmp_path, no_tuning_db):
    A = sp.random(500, 400, density=0.02, format="csr", dtype=np.float32, random_state=3)
    mod = spcompile.build(A, "spmm", K=40, target="cpu", template="cpu.csr_spmm", params={"parallel": True})
    p = str(mod.save(str(tmp_path / "m.spc")))
    X = np.random.default_rng(0).standard_normal((400, 40)).astype(np.float32)
    np.save(tmp_path / "x.npy", X)
    return p, A, X


def test_loading_a_cpu_module_needs_no_compiler(cpu_artifact, tmp_path):
    p, A, X = cpu_artifact
    code = (f"import sys, json, numpy as np, spcompile; m = spcompile.load({p!r}); "
            f"np.save('y.npy', m(np.load('x.npy'))); print(json.dumps({_loaded()}))")
    assert _run(code, tmp_path) == []
    ref = A.astype(np.float64) @ X.astype(np.float64)
    assert np.allclose(np.load(tmp_path / "y.npy"), ref, rtol=1e-5, atol=1e-4)


def test_after_a_light_load_torch_and_the_compiler_still_work(cpu_artifact, tmp_path):
    p, A, X = cpu_artifact
    code = f"""
import sys, json, numpy as np, spcompile
m = spcompile.load({p!r}); X = np.load('x.npy'); y = m(X)
light = [k for k in ('tvm', 'torch') if k in sys.modules]
import torch
yt = m(torch.from_numpy(X))
import scipy.sparse as sp
B = sp.random(200, 200, density=0.03, format='csr', dtype=np.float32, random_state=1)
m2 = spcompile.build(B, 'spmm', K=16, target='cpu', template='cpu.csr_spmm', params={{'parallel': True}})
Z = np.ones((200, 16), np.float32)
print(json.dumps({{"light": light, "torch_same": bool(np.array_equal(yt.numpy(), y)),
                  "built_err": float(np.abs(m2(Z) - B @ Z).max()), "tvm": 'tvm' in sys.modules}}))
"""
    out = _run(code, tmp_path)
    assert out["light"] == [] and out["torch_same"] and out["tvm"] and out["built_err"] < 1e-4


def test_tvm_version_is_read_without_importing_tvm(tmp_path):
    import tvm

    out = _run("import sys, json; from spcompile._version import tvm_version; "
               "print(json.dumps([tvm_version(), 'tvm' in sys.modules]))", tmp_path)
    assert out == [tvm.__version__, False]


def test_cold_start_benchmark_splits_the_fresh_process(tmp_path):
    """``bench.py --cold-start`` on the CPU: a correct result, the wall time and the process's own
    split into import / load / first call (each part of the wall time)."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench.py"), "--cold-start", "--target",
                        "cpu", "--cold-runs", "2", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": REPO}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "cold_start_cpu.json").read_text())
    rec = doc["result"]["targets"]["cpu"]
    assert rec["status"] == "ok" and len(rec["samples_s"]) == 2
    parts = [rec[k] for k in ("import_s", "load_s", "first_call_s")]
    assert all(p >= 0 for p in parts) and sum(parts) < rec["median_s"] * 1.5
    assert "| import + load + call, target cpu |" in (tmp_path / "cold_start_cpu.md").read_text()
