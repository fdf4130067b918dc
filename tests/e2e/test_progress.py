"""Long work shows tqdm bars on stderr (generate: prefill and decode; needle: its samples); task.progress=false
turns them off. The bars' delay is set to 0 here so that a short run shows them."""
from __future__ import annotations

import pytest

import sparsekv.progress
from tests.e2e.test_cli import run_main_in_process

GENERATE = ["device=cpu", "task=generate", "sampling.max_tokens=4", "sampling.ignore_eos=true"]
NEEDLE = ["device=cpu", "task=needle", "task.contexts=[48]", "task.depths=[0.5]", "task.num_samples=2",
          "task.batch_size=1", "task.max_tokens=2"]


@pytest.mark.parametrize("args,bars", [(GENERATE, ["prefill", "decode"]), (NEEDLE, ["needle"])],
                         ids=["generate", "needle"])
def test_bars_on_stderr_unless_disabled(args, bars, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sparsekv.progress, "DELAY_S", 0.0)
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    code, _, err = run_main_in_process(args, tmp_path / "on", monkeypatch, capsys)
    assert code == 0, err
    for name in bars:
        assert f"{name}:" in err, err
    assert "it/s" in err or "/s]" in err
    code, _, err = run_main_in_process([*args, "task.progress=false"], tmp_path / "off", monkeypatch, capsys)
    assert code == 0, err
    for name in bars:
        assert f"{name}:" not in err, err


def test_short_runs_stay_quiet(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sparsekv.progress, "DELAY_S", 3600.0)
    code, _, err = run_main_in_process(GENERATE, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "prefill:" not in err and "decode:" not in err
