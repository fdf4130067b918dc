"""tools/probe_cpu_trial.py at toy size: it trains, then scores held-out niah prompts and their needle choice."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_toy_trial_trains_and_reports_each_task_and_length(capsys):
    spec = importlib.util.spec_from_file_location("probe_cpu_trial", TOOLS / "probe_cpu_trial.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("probe_cpu_trial", module)
    spec.loader.exec_module(module)
    module.main(["--length", "160", "--steps", "2", "--batch", "2", "--hidden", "32", "--head-dim", "16",
                 "--restate-key", "--few-needles-until", "0.5", "--needles", "8", "--eval-lens", "160", "--eval-n", "1",
                 "--log-every", "1"])
    log = capsys.readouterr().out
    assert [line.split()[1] for line in log.splitlines() if line.startswith("step ")] == ["1", "2"]
    assert "eval niah_single 160: " in log and "eval niah_multikey 160: " in log and "distractor" in log
    from sparsekv.tasks.ruler import generators

    assert generators.NUM_NEEDLES == 4  # the few-needle phase changes samples, not the generators
