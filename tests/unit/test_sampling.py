"""Sampling parameters through the whole engine, on the built-in tiny model (random weights, CPU).

The dummy init is widened (model.dummy_init_std) so that greedy decoding does not collapse onto one token
and the next-token distribution is far from one-hot: then greedy and sampled outputs really differ."""
from __future__ import annotations

import pytest

from sparsekv import LLM, SamplingParams

PROMPT = [5, 9, 77, 300, 12, 44]
OTHER = [256, 72, 101, 108, 108, 111]  # BOS + "Hello"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", overrides=["device=cpu", "dtype=float32", "model.dummy_init_std=0.2"])


def tokens(llm, prompt, **kwargs) -> list[int]:
    return llm.generate([prompt], SamplingParams(**kwargs))[0].token_ids


@pytest.fixture(scope="module")
def greedy16(llm) -> list[int]:
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16
    assert len(set(out.token_ids)) > 4, "greedy output collapsed; the stop-token checks below need variety"
    return out.token_ids


def test_greedy_is_deterministic(llm, greedy16):
    assert tokens(llm, PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True) == greedy16


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm, greedy16):
    run = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = tokens(llm, PROMPT, seed=1, **run)
    assert len(a) == 16
    assert tokens(llm, PROMPT, seed=1, **run) == a
    b = tokens(llm, PROMPT, seed=2, **run)
    assert b != a
    assert a != greedy16  # it really samples


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    alone = llm.generate([PROMPT], params)[0].token_ids
    batched = llm.generate([OTHER, PROMPT, PROMPT], params)
    assert batched[1].token_ids == alone
    assert batched[2].token_ids == alone  # same seed, same prompt: same tokens, own generator each


def test_unseeded_sampling_varies(llm):
    run = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    assert tokens(llm, PROMPT, **run) != tokens(llm, PROMPT, **run)


def test_top_k_1_is_greedy(llm, greedy16):
    assert tokens(llm, PROMPT, temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True, seed=3) == greedy16
    assert tokens(llm, PROMPT, temperature=5.0, top_k=1, max_tokens=16, ignore_eos=True) == greedy16


def test_tiny_top_p_is_greedy(llm, greedy16):
    assert tokens(llm, PROMPT, temperature=1.0, top_p=1e-6, max_tokens=16, ignore_eos=True, seed=3) == greedy16


def test_top_k_restricts_the_choice(llm, greedy16):
    """top_k=2 samples only among the two most likely tokens at each step: the first token is one of them."""
    import torch

    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    top2 = torch.topk(llm.engine.runner.last_logits[0], 2).indices.tolist()
    firsts = {tokens(llm, PROMPT, temperature=5.0, top_k=2, max_tokens=1, seed=s)[0] for s in range(12)}
    assert firsts <= set(top2)
    assert len(firsts) == 2  # with a flat temperature both are picked over 12 seeds


def test_stop_token_ids_stop_generation(llm, greedy16):
    stop = greedy16[2]
    first = greedy16.index(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                stop_token_ids=[stop]))[0]
    assert out.token_ids == greedy16[:first + 1]
    assert out.token_ids[-1] == stop
    assert out.finish_reason == "stop"


def test_max_tokens_is_respected(llm, greedy16):
    for n in (1, 5):
        out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        assert out.token_ids == greedy16[:n]
        assert out.finish_reason == "length"
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True, seed=0))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(greedy16):
    """A model whose EOS (model.eos_token_id) is the 3rd greedy token stops there; ignore_eos runs on."""
    eos = greedy16[2]
    first = greedy16.index(eos)
    llm = LLM("tiny", overrides=["device=cpu", "dtype=float32", "model.dummy_init_std=0.2",
                                 f"model.eos_token_id=[{eos}]"])
    assert eos in llm.engine.eos_ids
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert out.token_ids == greedy16[:first + 1]
    assert out.finish_reason == "stop"
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == greedy16
    assert out.finish_reason == "length"


def test_per_prompt_sampling_params(llm, greedy16):
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                           SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)])
    assert [o.token_ids for o in outs] == [greedy16[:4], greedy16[:9]]


def test_generate_accepts_every_prompt_shape(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = llm.tokenizer.encode("Hello")
    assert ids == OTHER
    expected = llm.generate([ids], params)[0].token_ids

    single_str = llm.generate("Hello", params)
    single_ids = llm.generate(ids, params)
    many_str = llm.generate(["Hello", "Hello"], params)
    many_ids = llm.generate([ids, PROMPT], params)

    assert len(single_str) == 1 and len(single_ids) == 1 and len(many_str) == 2 and len(many_ids) == 2
    assert single_str[0].prompt_token_ids == ids and single_str[0].token_ids == expected
    assert single_ids[0].prompt_token_ids == ids and single_ids[0].token_ids == expected
    assert [o.token_ids for o in many_str] == [expected, expected]
    assert many_ids[0].token_ids == expected and many_ids[1].prompt_token_ids == PROMPT
    assert single_str[0].text == llm.tokenizer.decode(expected)
    assert [o.request_id for o in many_ids] == [0, 1]


def test_default_sampling_params_are_used_when_none_given(llm):
    out = llm.generate([PROMPT])[0]
    assert len(out.token_ids) <= SamplingParams().max_tokens
    assert out.finish_reason in ("length", "stop")
