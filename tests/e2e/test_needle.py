"""task=needle: haystack construction, exact-match scoring, end to end on the tiny model and a tiny checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsekv.llm import compose_config
from sparsekv.tasks import get_task
from sparsekv.tasks.needle import NEEDLE, QUESTION, build_haystack, sample_key_value, score
from sparsekv.tokenizer import ByteTokenizer, HFTokenizer

from tests.conftest import save_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("wordlevel")
    save_tokenizer(path, 128)
    return HFTokenizer(path)


@pytest.mark.parametrize("context", [1000, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_haystack_bytes(context, depth):
    tok = ByteTokenizer()
    hay = build_haystack(tok.encode, context, depth, "violin", "4815162")
    assert context - 25 <= hay.num_tokens <= context  # whole sentences: within one filler sentence
    assert hay.token_ids == tok.encode(hay.prompt)
    needle = NEEDLE.format(key="violin", value="4815162")
    assert tok.decode(hay.token_ids[hay.needle_start:hay.needle_end]) == needle
    assert hay.prompt.count(needle) == 1
    assert hay.prompt.endswith("\n" + QUESTION.format(key="violin"))
    assert abs(hay.needle_depth - depth) <= 0.03


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.7, 1.0])
def test_haystack_word_tokenizer(word_tokenizer, depth):
    hay = build_haystack(word_tokenizer.encode, 600, depth, "apple", "1234567")
    assert 600 - 8 <= hay.num_tokens <= 600
    assert abs(hay.needle_depth - depth) <= 0.03
    assert hay.needle_end - hay.needle_start == len(word_tokenizer.encode(NEEDLE.format(key="apple", value="1234567")))


def test_haystack_too_short_and_bad_depth():
    tok = ByteTokenizer()
    hay = build_haystack(tok.encode, 50, 0.5, "apple", "1234567")  # shorter than needle + question
    assert hay.filler_sentences == 0 and hay.num_tokens > 50
    with pytest.raises(ValueError, match="outside"):
        build_haystack(tok.encode, 500, 1.5, "apple", "1234567")


def test_score_is_exact_match_of_the_digits():
    assert score("The special magic number is 4815162.", "4815162")
    assert score(" 4 8 1 5 1 6 2", "4815162")  # word-level tokenizers decode with spaces
    assert not score("481516", "4815162")
    assert not score("4815163", "4815162")
    assert not score("", "4815162") and not score(None, "4815162")
    assert sample_key_value(0, 100, 0.5, 1) == sample_key_value(0, 100, 0.5, 1)
    assert sample_key_value(0, 100, 0.5, 1) != sample_key_value(0, 100, 0.5, 2)


def run_needle(tmp_path: Path, *overrides: str) -> dict:
    cfg = compose_config(["task=needle", "device=cpu", f"output_dir={tmp_path}", *overrides])
    figures = get_task(cfg.task.name)(cfg)
    record = json.loads((tmp_path / "needle.json").read_text())
    assert record["status"] == "ok" and record["accuracy"] == figures["accuracy"]
    return record


def test_task_needle_tiny_model(tmp_path, capsys):
    record = run_needle(tmp_path, "task.contexts=[200,300]", "task.depths=[0,1]", "task.num_samples=2",
                        "task.max_tokens=4", "task.batch_size=3")
    assert record["model"] == "tiny" and record["contexts"] == [200, 300] and record["depths"] == [0.0, 1.0]
    assert len(record["samples"]) == 2 * 2 * 2 and len(record["cells"]) == 4
    assert all(len(s["output"]) > 0 for s in record["samples"])
    assert 0.0 <= record["accuracy"] <= 1.0
    assert set(record["accuracy_by_context"]) == {"200", "300"}
    assert max(s["prompt_tokens"] for s in record["samples"] if s["context"] == 300) <= 300
    out = capsys.readouterr().out
    assert "context \\ depth" in out and "record:" in out


def test_task_needle_offloaded_policy(tmp_path, monkeypatch):
    from sparsekv.kvcache.offload_store import OffloadKVStore

    reserved = []
    original = OffloadKVStore.reserve
    monkeypatch.setattr(OffloadKVStore, "reserve", lambda self, tokens: (reserved.append(tokens),
                                                                          original(self, tokens))[1])
    record = run_needle(tmp_path, "offload=cpu", "offload.block_size=64", "task.contexts=[400]",
                        "task.depths=[0.5]", "task.num_samples=1", "task.max_tokens=3")
    assert record["offload"] == "cpu" and len(record["samples"]) == 1
    # the one prompt and its output, in whole host blocks, pinned before the timed run
    assert reserved == [-(-(record["samples"][0]["prompt_tokens"] + 4) // 64) * 64]
    assert record["host_pool_reserve_seconds"] >= 0.0


def test_task_needle_checkpoint_with_word_tokenizer(tmp_path, qwen3_ckpt):
    record = run_needle(tmp_path, "model=hf", f"model.path={qwen3_ckpt}", "task.contexts=[200]",
                        "task.depths=[0.5]", "task.num_samples=2", "task.max_tokens=4")
    assert record["model"] == "hf" and len(record["samples"]) == 2
    for sample in record["samples"]:
        assert 190 <= sample["prompt_tokens"] <= 200
        assert abs(sample["needle_depth"] - 0.5) < 0.05
        assert sample["correct"] is False or sample["correct"] is True


def test_task_needle_bad_settings(tmp_path):
    for override, message in [("task.depths=[1.5]", "depths"), ("task.contexts=[]", "contexts"),
                              ("task.num_samples=0", "num_samples")]:
        with pytest.raises(ValueError, match=message):  # at compose time (ranges) or when the task starts
            cfg = compose_config(["task=needle", "device=cpu", f"output_dir={tmp_path}", override])
            get_task(cfg.task.name)(cfg)


def test_task_needle_needs_a_tokenizer(tmp_path):
    from conftest import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "notok", tokenizer=False)
    cfg = compose_config(["task=needle", "device=cpu", f"output_dir={tmp_path}", "model=hf", f"model.path={ckpt}"])
    with pytest.raises(ValueError, match="tokenizer"):
        get_task(cfg.task.name)(cfg)
