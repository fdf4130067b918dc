"""The code passes the project's lint rules ([tool.ruff] in pyproject.toml: at most 120 characters a line, no unused
imports, no syntax errors)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "sparsekv", "tests", "tools",
                           "plugins"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_shell_scripts_keep_lines_short():
    scripts = sorted((ROOT / "tools").glob("*.sh")) + [ROOT / ".ci" / "run"]
    assert len(scripts) > 1
    long_lines = [f"{path.relative_to(ROOT)}:{number}" for path in scripts
                  for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
    assert not long_lines, f"lines over 120 characters: {long_lines}"
