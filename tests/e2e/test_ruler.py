"""task=ruler end to end on a tiny random Qwen3 checkpoint with a tokenizer: the CLI run (offload none and cpu,
batched, a selecting policy), its record, the scoring with a fake responder, and task=report over a sweep."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsekv.engine.llm_engine import LLMEngine, RequestOutput
from sparsekv.llm import compose_config
from sparsekv.tasks import get_task
from sparsekv.tasks.report import build_report
from tests.e2e.test_cli import run_main_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

TASKS = ["niah_single", "common_words"]
LENGTHS = [256, 384]
# a selecting policy that selects on these short prompts: blocks of 16 tokens, 2 of its 3 layers sparse
QUEST = ["policy=quest", "policy.token_budget=64", "policy.dense_layers=1", "offload.block_size=16"]


def ruler_args(ckpt: Path, *extra: str) -> list[str]:
    return ["task=ruler", "device=cpu", "model=hf", f"model.path={ckpt}", f"task.tasks=[{','.join(TASKS)}]",
            f"task.lengths=[{','.join(map(str, LENGTHS))}]", "task.samples=2", "task.batch_size=2",
            "task.progress=false", *extra]


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_ruler_cli_record(qwen3_ckpt, offload, tmp_path, monkeypatch, capsys):
    args = ruler_args(qwen3_ckpt, f"offload={offload}", *QUEST, "task.with_needles=false",
                      f"output_dir={tmp_path / 'out'}")
    code, out, err = run_main_in_process(args, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    record = json.loads((tmp_path / "out" / "ruler.json").read_text())
    assert record["status"] == "ok" and record["config"]["task"]["name"] == "ruler"
    assert (record["offload"], record["policy"], record["batch_size"]) == (offload, "quest", 2)
    assert record["policy_args"]["token_budget"] == 64 and record["block_size"] == 16
    assert record["tasks"] == TASKS and record["lengths"] == LENGTHS and record["with_needles"] is False
    assert record["model"] == "hf" and record["dtype"] == "float32" and record["seed"] == 0
    dims = record["config"]["model"]  # the checkpoint's, not the config schema's defaults
    assert (dims["vocab_size"], dims["intermediate_size"], dims["num_hidden_layers"]) == (128, 96, 3)

    cells = {(c["task"], c["length"]): c for c in record["cells"]}
    assert set(cells) == {(t, n) for t in TASKS for n in LENGTHS}
    for (task, length), cell in cells.items():
        assert cell["samples"] == 2 and 0.0 <= cell["accuracy"] <= 1.0
        assert 0.9 * length <= cell["prompt_tokens"] <= length  # the generators fill the length
        assert 0.0 < cell["density"] < 1.0 and cell["density_source"] in ("measured", "budget")
        assert cell["prefill_seconds"] > 0 and cell["prefill_tok_s"] > 0
    assert any(c["decode_ms_per_token"] for c in record["cells"])
    assert [s["length"] for s in record["by_length"]] == LENGTHS
    assert all(s["task"] == "all" and s["samples"] == 2 * len(TASKS) for s in record["by_length"])
    # the longer prompt leaves a smaller share of its blocks to a fixed budget
    assert record["by_length"][1]["density"] < record["by_length"][0]["density"]
    assert len(record["outputs"]) == 2 * len(TASKS) * len(LENGTHS)
    assert all(0.0 <= s["score"] <= 1.0 and s["answers"] for s in record["outputs"])
    assert set(record["accuracy_by_task"]) == set(TASKS) and set(record["accuracy_by_length"]) == {"256", "384"}
    assert record["device"] == "cpu" and record["gpu_name"] is None  # a CUDA run names its GPU
    assert "task \\ length" in out and "without needles" in out and "density" in out


def test_dense_policy_reports_density_one(qwen3_ckpt, tmp_path):
    cfg = compose_config(ruler_args(qwen3_ckpt, "task.samples=1", "task.lengths=[256]", "task.warmup=false",
                                    f"output_dir={tmp_path}"))
    figures = get_task("ruler")(cfg)
    assert figures["policy"] == "full" and figures["density"] == 1.0
    assert {c["density_source"] for c in figures["cells"]} == {"dense"}


def test_prompt_and_answer_beyond_max_model_len_fail_before_the_weights(qwen3_ckpt, tmp_path, monkeypatch):
    import sparsekv.factory

    monkeypatch.setattr(sparsekv.factory, "build_model", lambda *a, **k: pytest.fail("the weights were built"))
    # a 500-token common_words prompt fits 501 positions, its 5-word answer does not
    cfg = compose_config(ruler_args(qwen3_ckpt, "task.tasks=common_words", "task.lengths=[500]",
                                    "scheduler.max_model_len=501", f"output_dir={tmp_path}"))
    with pytest.raises(ValueError, match=r"common_words prompt of length .* more than scheduler.max_model_len=501: "
                                         r"set scheduler.max_model_len to \d+"):
        get_task("ruler")(cfg)


def test_task_names_accept_all_lists_and_comma_strings():
    from sparsekv.tasks.ruler.generators import TASKS
    from sparsekv.tasks.ruler.settings import task_names

    assert task_names("all") == TASKS
    assert task_names("common_words, niah_single") == ("common_words", "niah_single")
    assert task_names(["niah_single", "niah_single"]) == ("niah_single",)
    with pytest.raises(ValueError, match="valid tasks: niah_single"):
        task_names("niah_single,nope")


@pytest.mark.parametrize("value, message", [(1, "task.needles=1: give 2 to 32"), (33, "task.needles=33: give 2 to 32"),
                                            ("many", "task.needles=many.*could not be converted to Integer")])
def test_bad_needle_count_is_refused_when_the_config_composes(qwen3_ckpt, value, message):
    with pytest.raises(ValueError, match=message):
        compose_config(ruler_args(qwen3_ckpt, f"task.needles={value}"))


def test_chat_template_auto_follows_the_tokenizer(qwen3_ckpt, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from sparsekv.tasks.ruler.settings import ruler_settings

    chat = shutil.copytree(qwen3_ckpt, tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(str(chat))
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(str(chat))
    settings = (lambda ckpt, *extra: ruler_settings(compose_config(ruler_args(ckpt, "task.lengths=[256]", *extra))))
    assert settings(chat).chat_template is True
    assert settings(chat, "task.chat_template=false").chat_template is False
    assert settings(qwen3_ckpt).chat_template is False


def test_cell_density_sources():
    from sparsekv.policies.full import FullAttentionPolicy
    from sparsekv.policies.quest.policy import QuestPolicy
    from sparsekv.tasks.ruler.density import cell_density

    # 3 layers, the first dense; a 64-token prompt and 3 generated tokens: 2 decode steps over 4 full blocks of 16,
    # the sparse layers keep the budget's 2 blocks -> (1 * 4 + 2 * 2) / (3 * 4) per step
    quest = QuestPolicy(token_budget=32, dense_layers=1)
    assert cell_density(quest, 16, 3, [(64, 3)]) == (pytest.approx(8 / 12), "budget")
    assert cell_density(quest, 16, 3, [(64, 1)]) == (None, None)  # no decode step: nothing selected
    assert cell_density(QuestPolicy(token_budget=32, threshold_blocks=4), 16, 3, [(64, 3)])[0] == 1.0
    assert cell_density(FullAttentionPolicy(), 16, 3, [(64, 3)]) == (1.0, "dense")
    quest.record_density(3, 4)  # a policy's own counts win
    assert cell_density(quest, 16, 3, [(64, 3)]) == (0.75, "measured")


@pytest.mark.parametrize("responder,expected", [("perfect", 1.0), ("wrong", 0.0)])
def test_scores_of_a_fake_responder(qwen3_ckpt, tmp_path, monkeypatch, responder, expected):
    """Generation replaced by a responder that states every answer (or none): the suite's sampling, scoring and
    aggregation give exactly 1 and 0, every task, before any trained checkpoint exists."""
    import sparsekv.tasks.ruler.task as ruler_task
    from sparsekv.tasks.ruler.generators import answer_text

    queue: list = []  # the samples in the order the suite generates them (prompts may repeat across samples)
    build = ruler_task.build_samples

    def recording_build(cfg, settings):
        cells = build(cfg, settings)
        queue.extend(s for group in cells.values() for s in group)
        return cells

    def respond(self, prompts, sampling_params=None, progress=None):
        outputs = []
        for i, prompt in enumerate(prompts):
            sample = queue.pop(0)
            assert list(sample.prompt_ids) == list(prompt)
            text = answer_text(sample) if responder == "perfect" else " none of them, 0."
            outputs.append(RequestOutput(i, list(prompt), [5, 6], text, "stop"))
        return outputs

    monkeypatch.setattr(ruler_task, "build_samples", recording_build)
    monkeypatch.setattr(LLMEngine, "generate", respond)
    cfg = compose_config(ruler_args(qwen3_ckpt, "task.tasks=all", "task.lengths=[320]", "task.warmup=false",
                                    f"output_dir={tmp_path}"))
    figures = get_task("ruler")(cfg)
    assert len(figures["cells"]) == 6 and not queue  # every sample answered once
    assert all(c["accuracy"] == expected for c in figures["cells"])
    assert figures["accuracy"] == expected and figures["accuracy_by_length"] == {"320": expected}


def test_report_over_a_sweep(qwen3_ckpt, tmp_path, monkeypatch, capsys):
    """A sweep over two policies and two quest budgets: the RULER table, and accuracy vs density with one line per
    policy (quest's two budgets joined)."""
    from matplotlib.figure import Figure

    sweep = tmp_path / "sweep"
    args = ["-m", *ruler_args(qwen3_ckpt, "task.tasks=niah_single", "task.lengths=[256]", "task.samples=1",
                              "task.warmup=false", "offload.block_size=16", "policy=full,quest",
                              "per_policy.quest.token_budget=32,64", "per_policy.quest.dense_layers=1",
                              f"hydra.sweep.dir={sweep}")]
    code, _, err = run_main_in_process(args, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert len(list(sweep.glob("*/ruler.json"))) == 4

    figures: dict[str, Figure] = {}
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: (figures.__setitem__(Path(path).name, fig),
                                                                     save(fig, path, **kw))[1])
    result = build_report(sweep, tmp_path / "report")
    names = {p.name for p in result["plots"]}
    assert {"ruler_accuracy_vs_density.png", "ruler_accuracy_vs_length.png"} <= names
    (panel,) = figures["ruler_accuracy_vs_density.png"].axes
    lines = {line.get_label(): line for line in panel.get_lines()}
    assert set(lines) == {"full", "quest"}  # one line per policy, not per budget
    densities = list(lines["quest"].get_xdata())
    assert len(densities) == 2 and densities == sorted(densities) and all(0 < d < 1 for d in densities)
    assert list(lines["full"].get_xdata()) == [1.0]
    by_length = figures["ruler_accuracy_vs_length.png"].axes[0]
    assert len(by_length.get_lines()) == 3  # full and each quest budget

    md = (tmp_path / "report" / "report.md").read_text()
    section = md[md.index("## RULER"):md.index("## Plots")]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert "accuracy %" in table[0] and "density" in table[0] and "decode ms/token" in table[0]
    assert len(table) == 1 + 4 * 2  # header + per job: niah_single and the length's mean
    assert sum("| all |" in line for line in table) == 4
    assert "token_budget" in section


def test_budget_sweeps_split_by_the_other_settings():
    """Quest swept over budgets with and without dense layers: two lines (one per dense_layers value), each
    through its budgets; a policy with one differing setting stays one line, and so do settings that move together."""
    import json

    from sparsekv.tasks.report_ruler import sweep_lines, sweep_points

    def row(policy, density, **args):
        return {"policy": policy, "policy_args": json.dumps(args, sort_keys=True), "density": density,
                "accuracy": 0.5, "context": 4096, "subtask": "all"}

    quest = [row("quest", budget / 8192 + dense / 10, token_budget=budget, dense_layers=dense, threshold_blocks=0)
             for budget in (1024, 2048, 4096) for dense in (0, 2)]
    lines = sweep_lines(quest)
    assert [(fixed, swept, len(group)) for fixed, swept, group in lines] == [
        ("dense_layers=0", "token_budget", 3), ("dense_layers=2", "token_budget", 3)]
    points = sweep_points(lines[1][2], "token_budget")
    assert [p[2] for p in points] == ["token_budget=1024", "token_budget=2048", "token_budget=4096"]
    assert [p[0] for p in points] == sorted(p[0] for p in points)
    xattn = [row("xattn_bsa", d, threshold=t, stride=8) for d, t in ((0.9, 0.9), (0.95, 0.95))]
    assert [(fixed, swept) for fixed, swept, _ in sweep_lines(xattn)] == [("", "threshold")]
    assert sweep_lines([row("full", 1.0)]) == [("", None, [row("full", 1.0)])]
    # MInference's two budgets move together: one line through them; single diagonals at one budget, a line apart
    minference = [row("minference", v / 5000, vertical_size=v, slash_size=6 * v, slash_granularity=64)
                  for v in (250, 500, 1000, 2000)]
    minference.append(row("minference", 0.1, vertical_size=500, slash_size=3000, slash_granularity=1))
    assert [(fixed, swept, len(group)) for fixed, swept, group in sweep_lines(minference)] == [
        ("slash_granularity=1", "slash_size", 1), ("slash_granularity=64", "slash_size", 4)]
    # two budgets and the single-diagonal variant at one of them: every setting has two values; the budgets sweep
    two = [minference[0], minference[1], minference[-1]]
    assert [(fixed, swept, len(group)) for fixed, swept, group in sweep_lines(two)] == [
        ("slash_granularity=1", "slash_size", 1), ("slash_granularity=64", "slash_size", 2)]
