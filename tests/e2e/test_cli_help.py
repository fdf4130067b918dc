"""`--help` opens with sparsekv's own usage, and a prompt with commas and apostrophes passes through Hydra intact in
the form that usage (and the README) shows."""
from __future__ import annotations

import json
import shlex

from tests.e2e.test_cli import run_main_in_process


def test_help_starts_with_sparsekv_usage(tmp_path, monkeypatch, capsys):
    code, out, err = run_main_in_process(["--help"], tmp_path, monkeypatch, capsys)
    assert code in (0, None), err
    assert out.startswith("sparsekv: ") and "powered by Hydra" not in out
    assert "Usage: python -m sparsekv" in out
    assert "task: bench, generate, needle, plugins, quality, report" in out  # Hydra's group listing follows


def test_quoted_prompt_with_comma_and_apostrophe(tmp_path, monkeypatch, capsys):
    documented = "prompt=\"'It\\'s a test, ok'\""  # as typed in a shell
    [arg] = shlex.split(documented)
    code, out, err = run_main_in_process(["device=cpu", "sampling.max_tokens=2", arg, f"output_dir={tmp_path}"],
                                         tmp_path, monkeypatch, capsys)
    assert code in (0, None), err
    assert """prompt: "It's a test, ok\"""" in out
    [record] = tmp_path.glob("generate*.json")
    assert json.loads(record.read_text())["config"]["prompt"] == "It's a test, ok"
