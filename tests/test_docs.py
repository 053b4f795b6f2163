"""Every ```python block of the README and of docs/ runs as it is written (in a fresh process, in
a temporary folder, with a temporary tuning database): documentation that does not run is a bug."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for doc in DOCS:
        text = doc.read_text()
        for i, m in enumerate(BLOCK.finditer(text)):
            line = text.count("\n", 0, m.start()) + 1
            yield pytest.param(m.group(1), id=f"{doc.relative_to(REPO)}:{line}")


BLOCKS = list(_blocks())


def test_the_readme_has_python_blocks():
    assert any("README.md" in p.id for p in BLOCKS)


@pytest.mark.parametrize("code", BLOCKS)
def test_doc_block_runs(code, tmp_path):
    env = {**os.environ, "SPCOMPILE_TUNING_DB": str(tmp_path / "tuning.db"),
           "PYTHONPATH": os.pathsep.join([str(REPO), *[p for p in sys.path if p]])}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"the block failed:\n{r.stderr[-4000:]}"
