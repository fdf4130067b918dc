"""XAttention's offloaded chunked prefill when the GPU block cache holds the sequence: each chunk after the first gets
the prefix and itself as one device view (PolicyContext.sequence_kv) and runs compute_prefill on it, so its
selection, result and density are offload=none's in the same chunks, and no prefix block is chosen from the key
summaries (without the cache they choose, and on this prompt the tokens differ)."""
from __future__ import annotations

import pytest

from sparsekv import LLM, SamplingParams
from tests.conftest import random_prompt

# chunks of 32 tokens both ways; the first (no prefix) is dense both ways: two xattn blocks of 16
COMMON = ["device=cpu", "dtype=float32", "graph=eager", "offload.block_size=16", "policy=xattn_bsa",
          "policy.threshold=0.5", "policy.stride=4", "policy.block_size=16"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_offloaded_prefill_with_the_sequence_cached_is_offload_none(qwen3_ckpt):
    prompt = random_prompt(140, seed=21)
    resident = LLM(str(qwen3_ckpt), overrides=COMMON + ["offload=none", "scheduler.max_num_batched_tokens=32"])
    expected = resident.generate([prompt], GREEDY)[0].token_ids
    for cache_gib, cached in (("0.01", True), ("0", False)):
        llm = LLM(str(qwen3_ckpt), overrides=COMMON + ["offload=cpu", "offload.prefill_chunk_size=32",
                                                       f"offload.gpu_cache_gib={cache_gib}"])
        policy, selections = llm.engine.kv_store.prefill_policy, []
        select = policy.select_blocks

        def counted(ctx):
            selections.append(ctx.layer)
            return select(ctx)

        policy.select_blocks = counted
        tokens = llm.generate([prompt], GREEDY)[0].token_ids
        assert bool(selections) != cached
        if cached:  # last_density: the last chunk's computed block pairs / visible ones
            assert tokens == expected
            assert policy.last_density == pytest.approx(resident.engine.policy.last_density, rel=1e-6)
            assert policy.last_density < 1.0


def test_resident_prompt_in_one_step_selects_as_chunks_do(qwen3_ckpt):
    """offload=none with scheduler.max_num_batched_tokens >= the prompt: one prefill step for the whole prompt and the
    same tokens as 32-token chunks (each query block's estimate covers every key it sees either way)."""
    prompt = random_prompt(140, seed=21)
    runs = {}
    for budget in (32, 256):
        llm = LLM(str(qwen3_ckpt), overrides=COMMON + ["offload=none", f"scheduler.max_num_batched_tokens={budget}"])
        policy, steps = llm.engine.policy, []
        compute = policy.compute_prefill

        def counted(q, *args, **kwargs):
            steps.append(q.shape[0])
            return compute(q, *args, **kwargs)

        policy.compute_prefill = counted
        runs[budget] = llm.generate([prompt], GREEDY)[0].token_ids, policy.last_density, steps
    assert runs[256][2][0] == 140 and runs[32][2][0] == 32
    assert runs[256][0] == runs[32][0]
    assert runs[256][1] < 1.0
