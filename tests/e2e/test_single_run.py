"""A single run (no -m) composes its config once and leaves what @hydra.main's run leaves: the run directory with
.hydra/config.yaml, hydra.yaml and overrides.yaml, the job's log file, HydraConfig inside the task; a bad input still
exits 2 before any work, and Hydra's flags still go to @hydra.main."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from sparsekv.single_run import single_run_overrides
from tests.e2e.test_cli import cli_env, run_main_in_process

RUN = ["device=cpu", "sampling.max_tokens=2", "task.progress=false"]

# the CLI's entry point, then @hydra.main's own path, on one command line in one interpreter: each run's number of
# config compositions (Hydra composes through ConfigLoaderImpl.load_configuration), printed as JSON
RUN_BOTH_WAYS = """
import json, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from sparsekv import __main__ as cli

counts = []
load = ConfigLoaderImpl.load_configuration
ConfigLoaderImpl.load_configuration = lambda *args, **kwargs: counts.append(1) or load(*args, **kwargs)
compositions = {}
for name, entry in (("main", cli.main), ("hydra_main", cli.hydra_main)):
    counts.clear()
    sys.argv = ["sparsekv", *sys.argv[1:3], f"hydra.run.dir={name}"]
    entry()
    compositions[name] = len(counts)
print("compositions:", json.dumps(compositions))
"""


@pytest.fixture
def compositions(monkeypatch) -> list[list[str]]:
    """The overrides of each config composition in this process."""
    calls: list[list[str]] = []
    load = ConfigLoaderImpl.load_configuration

    def counting(self, config_name, overrides, *args, **kwargs):
        calls.append(list(overrides))
        return load(self, config_name, overrides, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counting)
    return calls


def test_a_run_composes_once_and_leaves_what_hydra_main_leaves(tmp_path):
    """The same command line through the CLI and through @hydra.main alone: one composition instead of two (three
    with the CLI's check before), and the same .hydra files and job log in the run directory."""
    result = subprocess.run([sys.executable, "-c", RUN_BOTH_WAYS, "device=cpu", "sampling.max_tokens=2"],
                            cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("compositions: "))
    assert json.loads(line.removeprefix("compositions: ")) == {"main": 1, "hydra_main": 2}
    fast, reference = tmp_path / "main", tmp_path / "hydra_main"
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        want = (reference / ".hydra" / name).read_text().replace("hydra_main", "main")
        assert (fast / ".hydra" / name).read_text() == want, name
    assert (fast / ".hydra" / "overrides.yaml").read_text() == "- device=cpu\n- sampling.max_tokens=2\n"
    hydra_yaml = (fast / ".hydra" / "hydra.yaml").read_text()
    assert "  mode: RUN\n" in hydra_yaml and "    - hydra.mode=RUN\n" in hydra_yaml
    assert "    name: __main__\n" in hydra_yaml and f"    output_dir: {fast}\n" in hydra_yaml
    assert sorted(p.name for p in fast.iterdir()) == sorted(p.name for p in reference.iterdir())
    log = (fast / "__main__.log").read_text()
    assert "[sparsekv.factory][INFO] - built Qwen3ForCausalLM on cpu" in log, log
    assert json.loads((fast / "generate.json").read_text())["config"]["sampling"]["max_tokens"] == 2


def test_the_task_sees_hydra_config_of_its_run(tmp_path, monkeypatch, capsys, compositions):
    import sparsekv.__main__ as cli
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    seen = {}

    def task(cfg):
        hydra_cfg = HydraConfig.get()
        seen.update(mode=hydra_cfg.mode, output_dir=hydra_cfg.runtime.output_dir, job=hydra_cfg.job.name,
                    multirun=cli.in_multirun(), device=cfg.device, has_hydra="hydra" in cfg)

    monkeypatch.setattr(cli, "get_task", lambda name: task)
    code, _, err = run_main_in_process(RUN, tmp_path, monkeypatch, capsys)
    assert code in (0, None), err
    assert seen == {"mode": RunMode.RUN, "output_dir": str(tmp_path / "run"), "job": "__main__", "multirun": False,
                    "device": "cpu", "has_hydra": False}
    assert len(compositions) == 1 and compositions[0][:len(RUN)] == RUN
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


def test_a_bad_input_exits_2_before_the_run_directory_exists(tmp_path, monkeypatch, capsys, compositions):
    code, _, err = run_main_in_process(["device=cpu", "prompt="], tmp_path, monkeypatch, capsys)
    assert code == 2 and err == "error: prompt is empty: pass a non-empty prompt=\"...\"\n", err
    assert len(compositions) == 1  # the checked composition is the run's; nothing composed it again
    assert not (tmp_path / "run").exists()


def test_a_command_line_that_does_not_compose_is_reported_as_before(tmp_path, monkeypatch, capsys):
    code, _, err = run_main_in_process(["device=cpu", "model=nope"], tmp_path, monkeypatch, capsys)
    assert code == 2 and err.startswith("error: ") and "tiny" in err, err
    code, _, err = run_main_in_process(["device=cpu", "hydra.nope=1"], tmp_path, monkeypatch, capsys)
    assert code == 1 and "hydra.nope" in err and "Traceback" not in err, err  # Hydra's own words, as @hydra.main
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, overrides", [
    (["device=cpu", "+foo=1", "hydra.run.dir=out"], ["device=cpu", "+foo=1", "hydra.run.dir=out"]),
    ([], []),
    (["-m", "device=cpu"], None),
    (["device=cpu", "--multirun"], None),
    (["--cfg", "job", "device=cpu"], None),
    (["--help"], None),
    (["--info", "defaults"], None),
    (["-p", "model", "--cfg", "job"], None),
    (["device=cpu", "hydra.mode=MULTIRUN"], None),
    (["++hydra.mode=RUN"], None),
])
def test_only_a_plain_command_line_is_a_single_run(argv, overrides):
    assert single_run_overrides(argv) == overrides


def test_another_hydra_release_keeps_hydra_mains_path(monkeypatch):
    import hydra

    assert single_run_overrides(["device=cpu"]) == ["device=cpu"]
    monkeypatch.setattr(hydra, "__version__", "1.4.0")
    assert single_run_overrides(["device=cpu"]) is None
