"""The top-level README's Python: each ```python block (the example on its
first screen), run as written (in a fresh interpreter, in an empty folder),
must succeed; the example's printed line is checked against what it says.
The readme suite (tests/readme) compares it with the README's ```text."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str):
    blocks = re.findall(r"^```python[ \t]*\n(.*?)^```", text, re.M | re.S)
    assert blocks, "README.md: no ```python block"
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
    text = "# x\nprose\n```python\nprint(1)\n```\n```sh\nls\n```\n## Next\n```python\nx = 2\n```\n"
    assert python_blocks(text) == ["print(1)\n", "x = 2\n"]
    with pytest.raises(AssertionError):
        python_blocks("## Other\n```sh\nx\n```\n")
