"""RULER generators: seeded, sized in the given tokenizer's tokens, answers present only with the needles."""
from __future__ import annotations

import collections
import importlib.util
import re
from pathlib import Path

import pytest

from sparsekv.tasks.ruler import generators, words
from sparsekv.tasks.ruler.generators import TASKS, answer_text, make_sample, score_output

TOOLS = Path(__file__).resolve().parents[2] / "tools"
CHAT = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _probe_module():
    spec = importlib.util.spec_from_file_location("probe_tokenizer", TOOLS / "probe_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The probe tokenizer (the committed checkpoint's): one token per word, digit and variable-name letter."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("probe_tok")
    _probe_module().build_probe_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A GPT-2-like byte-level BPE with a chat template, trained on the generators' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    corpus = [" ".join(group) for group in (words.NOUNS, words.ADJECTIVES, words.VERBS, words.KEYS,
                                            words.VAR_NAMES)] + list(generators.TEMPLATES) + ["0123456789"]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>", "<|user|>", "<|end|>",
                                                                  "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    inner.train_from_iterator(corpus * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>",
                                        additional_special_tokens=["<|user|>", "<|end|>", "<|assistant|>"])
    tokenizer.chat_template = CHAT
    path = tmp_path_factory.mktemp("bpe_tok")
    tokenizer.save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def _items(tokenizer, ids: list[int]) -> collections.Counter:
    """Words and whole numbers of a prompt (the probe tokenizer decodes digits and a name's letters spaced:
    "1 2 3", "R J S U Q")."""
    text = re.sub(r"(?<=\d) (?=\d)|(?<=\b[A-Z]) (?=[A-Z]\b)", "", tokenizer.decode(ids, skip_special_tokens=True))
    return collections.Counter(re.findall(r"[A-Za-z]+|\d+", text))


@pytest.mark.parametrize("task", TASKS)
def test_same_seed_same_sample_other_seed_other_sample(task, probe):
    first = make_sample(task, probe, 1024, seed=5)
    assert make_sample(task, probe, 1024, seed=5) == first
    other = make_sample(task, probe, 1024, seed=6)
    assert (other.prompt_ids, other.answers) != (first.prompt_ids, first.answers)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("tokenizer_name", ["probe", "bpe"])
@pytest.mark.parametrize("context_len", [1024, 6000])
def test_prompt_fills_context_len_of_that_tokenizer(task, tokenizer_name, context_len, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    for with_needles in (True, False):
        sample = make_sample(task, tokenizer, context_len, seed=1, with_needles=with_needles)
        assert sample.context_tokens == len(sample.prompt_ids)
        assert len(tokenizer(tokenizer.decode(sample.prompt_ids, skip_special_tokens=True))["input_ids"]) > 0
        assert 0.97 * context_len <= sample.context_tokens <= context_len


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("tokenizer_name", ["probe", "bpe"])
def test_answers_in_prompt_only_with_needles(task, tokenizer_name, request):
    tokenizer = request.getfixturevalue(tokenizer_name)
    for seed in range(3):
        with_ = make_sample(task, tokenizer, 2048, seed=seed)
        without = make_sample(task, tokenizer, 2048, seed=seed, with_needles=False)
        assert with_.answers == without.answers or task == "common_words"
        assert set(without.answers) == set(with_.answers)
        present, absent = _items(tokenizer, with_.prompt_ids), _items(tokenizer, without.prompt_ids)
        assert all(present[answer] for answer in with_.answers), with_.answers
        assert not any(absent[answer] for answer in without.answers), without.answers


def test_probe_tokenizer_knows_every_word_and_round_trips_answers(probe):
    for task in TASKS:
        sample = make_sample(task, probe, 2048, seed=0)
        assert probe.unk_token_id not in sample.prompt_ids
        assert sample.prompt_ids[0] == probe.bos_token_id
        answer_ids = probe.encode(answer_text(sample), add_special_tokens=False)
        assert probe.unk_token_id not in answer_ids
        assert sample.max_new_tokens >= len(answer_ids)
        assert score_output(sample, probe.decode(answer_ids)) == 1.0


def test_default_probe_tokenizer_is_the_committed_checkpoints(probe, tmp_path):
    committed = TOOLS.parent / "sparsekv" / "checkpoints" / "probe"
    _probe_module().build_probe_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name


def test_probe_tokenizer_spells_variable_names(probe):
    name = make_sample("variable_tracking", probe, 1024, seed=0).answers[0]
    assert probe.tokenize(f"of VAR {name} is assigned to VAR {name}.") == ["of", "VAR", *name, "is", "assigned",
                                                                           "to", "VAR", *name, "."]
    assert probe.tokenize("The A I What Question Answer") == ["The", "A", "I", "What", "Question", "Answer"]
    vocab = probe.get_vocab()
    assert not any(name in vocab for name in words.VAR_NAMES) and all(key in vocab for key in words.KEYS)


def test_score_counts_the_fraction_of_answers_found(probe):
    sample = make_sample("niah_multivalue", probe, 1024, seed=0)
    assert len(sample.answers) == generators.NUM_NEEDLES
    spaced = " ".join(sample.answers[0]) + " and " + sample.answers[1].upper()
    assert score_output(sample, spaced) == pytest.approx(2 / len(sample.answers))
    assert score_output(sample, "") == 0.0
    assert score_output(sample, answer_text(sample)) == 1.0


def test_multikey_answers_the_asked_key_not_a_distractor(bpe):
    sample = make_sample("niah_multikey", bpe, 2048, seed=3)
    text = bpe.decode(sample.prompt_ids)
    facts = dict(re.findall(r"magic numbers for (\w+) is: (\d+)\.", text))
    asked = re.search(r"The special magic number for (\w+) mentioned", text).group(1)
    assert len(facts) == generators.NUM_NEEDLES and sample.answers == (facts[asked],)


def test_variable_tracking_answers_follow_the_chain(bpe):
    sample = make_sample("variable_tracking", bpe, 2048, seed=4)
    text = bpe.decode(sample.prompt_ids)
    value = re.search(r"assigned the value (\d+) in the text", text).group(1)
    holds = {name for v, name in re.findall(r"value (\d+) is assigned to VAR ([A-Z]+)\.", text) if v == value}
    for _ in range(generators.VT_HOPS + 1):
        holds |= {name for prev, name in re.findall(r"of VAR ([A-Z]+) is assigned to VAR ([A-Z]+)\.", text)
                  if prev in holds}
    assert list(sample.answers) == [n for n in re.findall(r"assigned to VAR ([A-Z]+)\.", text) if n in holds]
    assert len(sample.answers) == generators.VT_HOPS + 1


def test_common_words_answers_are_the_most_frequent(probe):
    sample = make_sample("common_words", probe, 4096, seed=2)
    counts = _items(probe, sample.prompt_ids)
    least_common = min(counts[w] for w in sample.answers)
    listed = [w for w in words.LIST_WORDS if counts[w] and w not in sample.answers]
    assert len(listed) > 20 and least_common >= 5 * max(counts[w] for w in listed)


def test_chat_template_wraps_the_prompt_and_needs_one(bpe, probe):
    plain = make_sample("niah_single", bpe, 1024, seed=0)
    chat = make_sample("niah_single", bpe, 1024, seed=0, chat_template=True)
    text = bpe.decode(chat.prompt_ids)
    assert text.startswith("<|user|>") and "<|end|><|assistant|>The special magic number" in text
    assert chat.answers == plain.answers and 0.97 * 1024 <= chat.context_tokens <= 1024
    with pytest.raises(ValueError, match="no chat template"):
        make_sample("niah_single", probe, 1024, seed=0, chat_template=True)


@pytest.mark.parametrize("task", TASKS)
def test_too_small_context_is_refused(task, probe):
    with pytest.raises(ValueError, match=rf"context_len=40 is too small for task {task}.*use context_len >= \d+"):
        make_sample(task, probe, 40, seed=0)
    with pytest.raises(ValueError, match="context_len=40 is too small"):
        make_sample(task, probe, 40, seed=0, with_needles=False)


def test_unknown_task_is_refused(probe):
    with pytest.raises(ValueError, match="task='niah' is not a RULER task"):
        make_sample("niah", probe, 1024, seed=0)


def test_needles_set_the_facts_of_the_counted_tasks(bpe):
    sample = make_sample("niah_multikey", bpe, 2048, seed=3, needles=12)
    text = bpe.decode(sample.prompt_ids)
    facts = dict(re.findall(r"magic numbers for (\w+) is: (\d+)\.", text))
    asked = re.search(r"The special magic number for (\w+) mentioned", text).group(1)
    assert len(facts) == 12 and sample.answers == (facts[asked],)
    assert len(make_sample("niah_multiquery", bpe, 2048, seed=3, needles=6).answers) == 6
    chains = make_sample("variable_tracking", bpe, 2048, seed=4, needles=5)
    assert len(re.findall(r"value \d+ is assigned to VAR [A-Z]+\.", bpe.decode(chains.prompt_ids))) == 5
    assert make_sample("niah_multikey", bpe, 2048, seed=3, needles=None) == make_sample("niah_multikey", bpe, 2048, 3)


@pytest.mark.parametrize("task, needles, fix", [
    ("niah_multikey", 1, "give 2 to 32"), ("niah_multikey", 33, "give 2 to 32"),
    ("niah_single", 4, "only niah_multikey, niah_multivalue, niah_multiquery, variable_tracking take a count"),
    ("common_words", 4, "only niah_multikey")])
def test_bad_needle_counts_are_refused(bpe, task, needles, fix):
    with pytest.raises(ValueError, match=rf"needles={needles} for task {task}: {fix}"):
        make_sample(task, bpe, 2048, seed=0, needles=needles)
