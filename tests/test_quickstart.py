"""The README's quick start runs as written: examples/quickstart.py, and the snippet in README.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_quickstart_example_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 30: test accuracy" in out.stdout and "saved and loaded back: ε =" in out.stdout
    assert list(tmp_path.iterdir()) == []  # it leaves nothing behind


def test_the_readme_snippet_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") :]
    snippet = re.search(r"```python\n(.*?)```", quick, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 7.0 < float(out.stdout.strip().splitlines()[-1]) <= 8.0  # ε spent, at most the target
    assert (tmp_path / "runs" / "quickstart").is_dir()
