"""sparsekv's greedy tokens and logits equal HF transformers' on the same checkpoint (float32, CPU)."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompt

CPU = ["device=cpu", "dtype=float32"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def sparsekv_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return llm.engine.runner.last_logits[0]


@pytest.mark.parametrize("ckpt", ["qwen3_ckpt", "llama_ckpt", "qwen3_bf16_sharded_ckpt"])
def test_greedy_tokens_and_logits_match_hf(ckpt, request):
    path = request.getfixturevalue(ckpt)
    prompt = random_prompt(37, seed=3)
    expected_tokens, expected_logits = hf_greedy(path, prompt, 32)
    llm = LLM(str(path), overrides=CPU + ["offload.block_size=16"])
    out = llm.generate([prompt], GREEDY)[0]
    assert out.token_ids == expected_tokens
    logits = sparsekv_logits(llm, prompt)
    assert torch.allclose(logits, expected_logits, atol=1e-4, rtol=0), (logits - expected_logits).abs().max()


def test_batch_equals_each_prompt_alone(qwen3_ckpt):
    llm = LLM(str(qwen3_ckpt), overrides=CPU + ["offload.block_size=16"])
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 17, 64)]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert batched == alone


def test_chunked_prefill_equals_one_shot(llama_ckpt):
    prompts = [random_prompt(n, seed=n) for n in (70, 33)]
    one_shot = LLM(str(llama_ckpt), overrides=CPU + ["offload.block_size=16"]).generate(prompts, GREEDY)
    chunked = LLM(str(llama_ckpt), overrides=CPU + ["offload.block_size=16", "scheduler.max_num_batched_tokens=12"]
                  ).generate(prompts, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in one_shot]


def test_string_prompt_roundtrips_through_the_checkpoint_tokenizer(qwen3_ckpt):
    llm = LLM(str(qwen3_ckpt), overrides=CPU)
    out = llm.generate("the quick brown fox", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("the quick brown fox")
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert len(out.token_ids) == 4
