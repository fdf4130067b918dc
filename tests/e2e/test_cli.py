"""The Hydra CLI, run the way users run it: a subprocess in a scratch directory (outputs land there)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def cli_env(extra_path: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO)] + ([str(extra_path)] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("HYDRA_FULL_ERROR", None)
    env["SPARSEKV_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only the built-ins: other installed plugins cannot interfere
    return env


def run_cli(args: list[str], cwd: Path, *, python_args: list[str] | None = None,
            extra_path: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, *(python_args or ["-m", "sparsekv"]), *args]
    return subprocess.run(command, cwd=cwd, env=cli_env(extra_path), capture_output=True, text=True, timeout=300)


def test_generate_prints_text_and_figures_and_writes_the_record(tmp_path):
    result = run_cli(["device=cpu"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Traceback" not in result.stderr

    records = list(tmp_path.glob("outputs/*/*/generate.json"))
    assert len(records) == 1, list(tmp_path.rglob("*"))
    record = json.loads(records[0].read_text())
    run_dir = records[0].parent
    assert (run_dir / ".hydra" / "config.yaml").is_file()  # the Hydra run dir, under the cwd
    assert f"record: {records[0]}" in out or f"record: {records[0].relative_to(tmp_path)}" in out

    # the generated text, and the figures, printed and recorded alike
    assert f"output: {record['text']!r}" in out
    assert record["config"]["device"] == "cpu" and record["config"]["model"]["name"] == "tiny"
    prompt = record["config"]["prompt"]
    assert record["prompt_tokens"] == len(prompt.encode()) + 1  # byte tokenizer: BOS + bytes
    assert record["generated_tokens"] == len(record["token_ids"]) > 0
    assert record["finish_reason"] in ("length", "stop")
    assert f"prompt tokens {record['prompt_tokens']}" in out
    assert record["prefill_tok_s"] > 0 and record["decode_tok_s"] > 0
    prefill = re.search(r"prefill ([0-9.]+) tok/s", out)
    decode = re.search(r"decode ([0-9.]+) tok/s", out)
    assert prefill and decode, out
    assert float(prefill.group(1)) == pytest.approx(record["prefill_tok_s"], abs=0.06)
    assert float(decode.group(1)) == pytest.approx(record["decode_tok_s"], abs=0.06)
    memory = re.search(r"peak memory: host_peak_rss_gib ([0-9.]+)", out)
    assert memory, out
    assert 0 < record["host_peak_rss_gib"] < 64
    assert float(memory.group(1)) == pytest.approx(record["host_peak_rss_gib"], abs=0.001)


def test_model_without_weights_is_a_short_error_without_traceback(tmp_path):
    result = run_cli(["model=qwen3_4b", "device=cpu"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "model.path=" in result.stderr and "model.load_format=dummy" in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert lines[0].startswith("error: ")
    assert len(lines) <= 3, result.stderr


def run_main_in_process(args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[object, str, str]:
    """The CLI's entry point in this process (cheaper than a subprocess): returns (exit code, stdout, stderr)."""
    import hydra._internal.utils as hydra_utils

    from sparsekv.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(hydra_utils, "is_under_debugger", lambda: False)  # e.g. under coverage
    monkeypatch.setattr(sys, "argv", ["sparsekv", *args, "hydra/job_logging=none", "hydra/hydra_logging=none",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bad_sampling_value_is_a_user_error(tmp_path, monkeypatch, capsys):
    code, _, err = run_main_in_process(["device=cpu", "sampling.top_p=1.5"], tmp_path, monkeypatch, capsys)
    assert code == 2, err
    assert err.startswith("error: ") and "top_p" in err and "1.5" in err
    assert "Traceback" not in err


def test_bad_config_value_names_key_and_allowed_values(tmp_path, monkeypatch, capsys):
    code, _, err = run_main_in_process(["device=gpu"], tmp_path, monkeypatch, capsys)
    assert code not in (0, None)
    assert "device" in err and "auto, cpu, cuda" in err
    assert "Traceback" not in err


def test_unexpected_exceptions_keep_their_traceback(tmp_path, monkeypatch, capsys):
    """Only sparsekv's own validation errors are shortened; a bug keeps its traceback."""
    import sparsekv.__main__ as cli

    def boom_task(cfg):
        raise RuntimeError("boom: an unexpected bug")

    monkeypatch.setattr(cli, "get_task", lambda name: boom_task)
    code, _, err = run_main_in_process(["device=cpu"], tmp_path, monkeypatch, capsys)
    assert code == 1, err
    assert "Traceback" in err and "boom_task" in err
    assert "RuntimeError: boom: an unexpected bug" in err
    assert not err.startswith("error: ")


def test_user_error_classification():
    import json as json_module

    from sparsekv.__main__ import is_user_error
    from sparsekv.sampling_params import SamplingParams

    def caught(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            return exc
        raise AssertionError("no exception")

    assert is_user_error(caught(lambda: SamplingParams(top_p=0)))  # sparsekv validation
    assert not is_user_error(caught(lambda: json_module.loads("{")))  # a ValueError from elsewhere
    assert not is_user_error(caught(lambda: [][1]))
    assert not is_user_error(ValueError("never raised, no traceback"))


def test_console_script_is_installed():
    from importlib.metadata import entry_points

    script = shutil.which("sparsekv")
    if script is None:
        pytest.skip("the `sparsekv` console script is not on PATH (pip install -e . not run)")
    assert os.access(script, os.X_OK)
    (entry,) = entry_points(group="console_scripts", name="sparsekv")
    assert entry.value == "sparsekv.__main__:main"
    from sparsekv.__main__ import main

    assert entry.load() is main
