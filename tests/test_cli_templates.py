"""``spcompile templates``: quick (no toolchain imported), honest about this machine, and
``--params`` lists the names ``build(params=...)`` accepts."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp

import spcompile
from spcompile.cli import main
from spcompile.cli import templates as cli_templates

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lines(out):
    return {ln.split()[0]: ln for ln in out.splitlines() if "target=" in ln}


def test_listing_imports_no_toolchain():
    code = ("import sys; from spcompile.cli import main; main(['templates']); "
            "print('LOADED', sorted(m for m in ('tvm', 'torch', 'optuna', 'cupy') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": REPO, "SPCOMPILE_DISABLE_CUDA": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "LOADED []" in r.stdout
    assert "build only: no GPU" in _lines(r.stdout)["csr.crc_cwm"]


def test_listing_reflects_missing_nvcc_and_no_gpu(capsys, no_cuda, monkeypatch):
    import spcompile.runtime.cuda as rt

    monkeypatch.setattr(rt, "nvcc_path", lambda: None)
    assert main(["templates"]) == 0
    lines = _lines(capsys.readouterr().out)
    assert "build=no" in lines["csr.crc_cwm"] and "unavailable: no nvcc" in lines["csr.crc_cwm"]
    assert "unavailable: no nvcc" in lines["tvm.cuda_csr_spmm"]
    assert "run=yes" in lines["cpu.csr_spmm"] and "available" in lines["cpu.csr_spmm"]


def test_quick_listing_agrees_with_each_templates_own_check(no_cuda):
    for t in spcompile.list_templates():
        assert cli_templates.buildable(t, check=False)[0] == bool(t.available()), t.name


def test_params_lists_what_build_accepts(capsys):
    assert main(["templates", "--params", "--target", "cpu"]) == 0
    out = capsys.readouterr().out
    names = []
    for ln in out.split("cpu.csr_spmm", 1)[1].splitlines()[1:]:
        if not ln.startswith("    "):
            break   # the next template's line
        names.append(ln.split()[0])
    assert {"tasks_per_thread", "k_tile"} <= set(names) and "rows_per_task" not in names
    A = sp.random(40, 40, density=0.1, format="csr", random_state=0, dtype=np.float32)
    mod = spcompile.build(A, "spmm", K=16, target="cpu", template="cpu.csr_spmm",
                          params={n: cli_templates.template_params(spcompile.get_template("cpu.csr_spmm"), 16)[n]["default"]
                                  for n in names})
    X = np.ones((40, 16), np.float32)
    assert np.allclose(mod(X), A @ X, atol=1e-5)


def test_params_of_every_template_are_its_space_and_defaults():
    for t in spcompile.list_templates():
        params = cli_templates.template_params(t)
        mod = cli_templates.example_module(t)
        assert set(params) == set(t.default_params(mod)) | set(t.space(mod)), t.name


def test_listing_on_a_runtime_only_tvm(capsys, no_cuda, monkeypatch):
    """A serving machine's TVM without its compiler: CPU modules still run there (saved ones load
    with TVM's runtime), nothing TVM-generated can be built."""
    monkeypatch.setattr(cli_templates, "_tvm_compiler_library", lambda: None)
    assert main(["templates"]) == 0
    lines = _lines(capsys.readouterr().out)
    assert "build=no" in lines["cpu.csr_spmm"] and "run=yes" in lines["cpu.csr_spmm"]
    assert "run only: no TVM compiler" in lines["cpu.csr_spmm"]
    assert "unavailable: no TVM compiler" in lines["tvm.cuda_csr_spmm"] and "no GPU" in lines["tvm.cuda_csr_spmm"]
    assert "build only: no GPU" in lines["csr.crc_cwm"]


def test_a_cpu_template_without_tvm_runs_where_it_builds(monkeypatch):
    """A CPU template that is not a TVM kernel (e.g. a library call) needs no TVM to run."""

    class LibraryCall(spcompile.Template):
        name, target, ops = "test.library_call", "cpu", (("spmm", "sum"),)

        def __init__(self, ok):
            self.ok = ok

        def available(self):
            return self.ok

    real = cli_templates.importlib.util.find_spec
    monkeypatch.setattr(cli_templates.importlib.util, "find_spec", lambda name, *a: None if name == "tvm" else real(name, *a))
    assert cli_templates.runnable(LibraryCall(True), gpu=False)[0]
    assert not cli_templates.runnable(LibraryCall(False), gpu=False)[0]
    assert not cli_templates.runnable(spcompile.get_template("cpu.csr_spmm"), gpu=False)[0]   # TVM kernel, no TVM
