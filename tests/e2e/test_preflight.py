"""A job's inputs (the prompt, the task's settings) are checked before the weights load: the CLI rejects them in
one line before Hydra starts, and LLM.generate rejects a batch with a bad prompt before any prefill."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparsekv.sampling_params import SamplingParams
from tests.e2e.test_cli import run_main_in_process


@pytest.fixture
def no_weights(monkeypatch):
    """Building an engine or loading weights fails the test: the user error must come first."""
    import sparsekv.factory
    import sparsekv.llm

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built before the input was checked")

    monkeypatch.setattr(sparsekv.factory, "build_engine", refuse)
    monkeypatch.setattr(sparsekv.llm, "build_engine", refuse)


def run_main(args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[object, str]:
    code, _, err = run_main_in_process(args, tmp_path, monkeypatch, capsys)
    return code, err


@pytest.mark.parametrize("args, message", [
    (["prompt="], "prompt is empty"),
    (["model=tiny", "scheduler.max_model_len=8"], "prompt has 71 tokens but max_model_len is 8"),
    (["task=quality", "offload.block_size=32", "task.prefill_chunk=48"], "task.prefill_chunk=48 must be a positive "
                                                                         "multiple of the block size 32"),
    (["task=quality", "task.depths=[]"], "task.depths is empty"),
])
def test_cli_rejects_bad_inputs_before_the_weights_load(args, message, tmp_path, monkeypatch, capsys, no_weights):
    code, err = run_main(["device=cpu", *args], tmp_path, monkeypatch, capsys)
    assert code == 2
    assert message in err and "Traceback" not in err and "AssertionError" not in err


def test_prompt_length_is_counted_with_the_checkpoint_tokenizer(tmp_path):
    from sparsekv.llm import compose_config
    from sparsekv.preflight import check_task_inputs

    text = "abc " * 20  # the byte tokenizer: BOS + 80 bytes
    check_task_inputs(compose_config(["device=cpu", "scheduler.max_model_len=82", f"prompt='{text}'"]))
    with pytest.raises(ValueError, match="prompt has 81 tokens but max_model_len is 81"):
        check_task_inputs(compose_config(["device=cpu", "scheduler.max_model_len=81", f"prompt='{text}'"]))


def test_a_bad_prompt_rejects_the_whole_batch_before_any_work():
    from sparsekv.llm import LLM

    llm = LLM("tiny", overrides=["device=cpu", "scheduler.max_model_len=64"])
    engine = llm.engine
    steps = []
    real_step = engine.step
    engine.step = lambda: steps.append(1) or real_step()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for bad in ("", "x" * 200, [1, 2, 10 ** 9]):
        with pytest.raises(ValueError):
            llm.generate(["a fine prompt", bad], params)
        assert steps == [] and not engine.scheduler.has_unfinished() and engine.stats.prompt_tokens == 0
    out = llm.generate(["a fine prompt", "another"], params)  # nothing was lost: the engine still serves
    assert [len(o.token_ids) for o in out] == [2, 2] and steps
