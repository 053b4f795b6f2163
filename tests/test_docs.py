"""The README's and docs/' code blocks run as they are written (each in a fresh process; the
blocks of one document in order, in one temporary folder of their own, so a later block may use
what an earlier one wrote, as a reader running them would; a temporary tuning database):
documentation that does not run is a bug.

* every ```python block runs as a script;
* in every ```bash block, each command that starts with ``spcompile`` runs (the CLI, through
  ``python -m spcompile``); other commands (installs, benchmarks over the whole data set) are not
  run here;
* a block whose first line is the comment ``# needs: gpu`` runs only under the ``gpu`` marker,
  on a machine with a usable GPU.
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from spcompile.runtime import cuda_available

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)
GPU_MARK = "# needs: gpu"


def doc_blocks():
    """(language, code, id, needs_gpu) of every python / bash block of the docs."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            code = m.group(2)
            out.append((m.group(1), code, f"{doc.relative_to(REPO)}:{line}", code.lstrip().startswith(GPU_MARK)))
    return out


def spcompile_commands(code: str) -> list[list[str]]:
    """The ``spcompile ...`` commands of a bash block, as argument lists (comments dropped; a
    line's commands split at ``&&`` and ``;``)."""
    cmds = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line.startswith("#"):
            continue
        for part in re.split(r"&&|;", line):
            words = shlex.split(part)
            if words and words[0] == "spcompile":
                cmds.append(words[1:])
    return cmds


def _params():
    out = []
    for lang, code, ident, gpu in doc_blocks():
        if lang == "bash" and not spcompile_commands(code):
            continue
        marks = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no usable CUDA GPU")] if gpu else []
        out.append(pytest.param(lang, code, ident.split(":")[0], id=ident, marks=marks))
    return out


PARAMS = _params()


def _env(tmp_path):
    return {**os.environ, "SPCOMPILE_TUNING_DB": str(tmp_path / "tuning.db"),
            "PYTHONPATH": os.pathsep.join([str(REPO), *[p for p in sys.path if p]])}


def test_the_readme_has_python_and_cli_blocks():
    ids = [p.id for p in PARAMS if "README.md" in p.id]
    langs = {p.values[0] for p in PARAMS if "README.md" in p.id}
    assert ids and langs == {"python", "bash"}


def test_spcompile_commands_are_found_in_bash_blocks():
    code = "python3 -m pip install -e . && spcompile demo --rows 10  # a comment\n# spcompile no\n" \
           "spcompile info 'a b.spc'; echo x\n"
    assert spcompile_commands(code) == [["demo", "--rows", "10"], ["info", "a b.spc"]]


_DIRS: dict = {}


@pytest.fixture
def doc_dir(request, tmp_path_factory):
    doc = request.node.callspec.params["doc"]
    if doc not in _DIRS:
        _DIRS[doc] = tmp_path_factory.mktemp("doc")
    return _DIRS[doc]


@pytest.mark.parametrize("lang,code,doc", PARAMS)
def test_doc_block_runs(lang, code, doc, doc_dir):
    tmp_path = doc_dir
    env = _env(tmp_path)
    if lang == "python":
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"the block failed:\n{r.stderr[-4000:]}"
        return
    for args in spcompile_commands(code):
        r = subprocess.run([sys.executable, "-m", "spcompile", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"`spcompile {' '.join(args)}` failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def test_datasets_page_describes_the_benchmark_graphs():
    """docs/datasets.md: one table row per graph of the set, its summary counts agree with the
    table, and (where the graphs are beside the checkout) with their manifest."""
    import collections
    import json

    text = (REPO / "docs" / "datasets.md").read_text()
    table = text.split("## The 58 graphs", 1)[1]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table.splitlines()
            if ln.startswith("| ") and not ln.startswith("| graph")]
    assert len(rows) == 58 and len({r[0] for r in rows}) == 58
    kinds = collections.Counter(r[1] for r in rows)
    sizes = collections.Counter(r[5] for r in rows)
    assert kinds == {"gnn": 26, "suitesparse": 32} and sizes == {"small": 18, "medium": 29, "large": 11}
    nnz = [int(r[4].replace(",", "")) for r in rows]
    assert nnz == sorted(nnz) and sum(n > 200_000 for n in nnz) == 18 and sum(n > 2_000_000 for n in nnz) == 1
    manifest = pathlib.Path(os.environ.get("SPCOMPILE_GRAPHS") or REPO.parent / "shared" / "data" / "graphs") / "manifest.json"
    if manifest.exists():
        m = json.loads(manifest.read_text())
        assert {(e["name"], e["nnz"]) for e in m["matrices"]} == {(r[0], n) for r, n in zip(rows, nnz)}
        terms = text.split("| source | terms |", 1)[1].split("\n\n", 1)[0]
        assert len([ln for ln in terms.splitlines() if ln.startswith("| ") and "---" not in ln]) == len(m["licenses"])
