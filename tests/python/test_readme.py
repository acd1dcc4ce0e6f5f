"""The top-level README's Python section: each ```python block of
"## Python", run as written (in a fresh interpreter, in an empty folder),
must succeed; the example's printed line is checked against what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str):
    m = re.search(r"^## Python[ \t]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, 'README.md has no section "## Python"'
    blocks = re.findall(r"^```python[ \t]*\n(.*?)^```", m.group(1), re.M | re.S)
    assert blocks, 'README.md: no ```python block in "## Python"'
    return blocks


def test_blocks_run(tmp_path):
    for i, code in enumerate(python_blocks(README.read_text())):
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, "README ```python block %d failed:\n%s\n%s" % (i, code, r.stderr)
        # The quick example prints ids' shape and dtype and each row's weight sum.
        m = re.search(r"^\((\d+), (\d+)\) int32 \[([^\]]*)\]$", r.stdout, re.M)
        if "weights.sum(axis=1)" in code:
            assert m, "unexpected output:\n" + r.stdout
            sums = [float(v) for v in m.group(3).split()]
            assert len(sums) == int(m.group(1)) and all(abs(s - 1) < 1e-5 for s in sums), r.stdout


def test_extraction():
    text = "# x\n## Python\nprose\n```python\nprint(1)\n```\n```sh\nls\n```\n## Next\n```python\nno\n```\n"
    assert python_blocks(text) == ["print(1)\n"]
    with pytest.raises(AssertionError):
        python_blocks("## Other\n```python\nx\n```\n")
