"""What a compute policy's prefill hands back is checked before the engine uses it: a wrong shape, dtype or type
raises PolicyOutputError naming the policy, resident (compute_prefill) and offloaded (compute_chunked_prefill)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.policies import PolicyOutputError, check_attention_output
from sparsekv.policies.full import FullAttentionPolicy

PROMPT = [[5, 6, 7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)
OFFLOAD = {"none": ["offload=none"],
           "cpu": ["offload=cpu", "offload.host_pool_gib=0.05", "offload.num_gpu_blocks=2"]}


@dataclass
class BadOutput(FullAttentionPolicy):
    name: str = "bad_output"

    def compute_prefill(self, q, k, v, layer_id, softmax_scale):
        return super().compute_prefill(q, k, v, layer_id, softmax_scale)[: q.shape[0] // 2]  # rows lost

    def compute_chunked_prefill(self, q, k, v, ctx, reader):
        return super().compute_chunked_prefill(q, k, v, ctx, reader).double()  # another dtype


@pytest.mark.parametrize("offload,method,got", [("none", "compute_prefill", "(3, "),
                                                ("cpu", "compute_chunked_prefill", "torch.float64")])
def test_a_bad_prefill_output_names_the_policy(offload, method, got):
    llm = LLM("tiny", overrides=["device=cpu", *OFFLOAD[offload]])
    good = llm.generate(PROMPT, GREEDY)[0].token_ids
    llm.engine.kv_store.prefill_policy = BadOutput()
    with pytest.raises(PolicyOutputError) as err:
        llm.generate(PROMPT, GREEDY)
    message = str(err.value)
    assert f"BadOutput.{method}" in message and "'bad_output'" in message and "layer 0" in message
    assert got in message and "(7, " in message  # what it returned, and what it must return
    assert not llm.engine.scheduler.has_unfinished()  # the failed request left, its blocks back in the pool
    assert llm.engine.block_manager.num_free_blocks == llm.engine.kv_store.num_blocks
    llm.engine.kv_store.prefill_policy = FullAttentionPolicy()
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == good  # the engine still works


@pytest.mark.parametrize("out", [None, torch.zeros(4, 2, 8, dtype=torch.float16), torch.zeros(4, 2, 8)[:, :1]])
def test_check_attention_output_rejects(out):
    q = torch.zeros(4, 2, 8)
    with pytest.raises(PolicyOutputError, match="FullAttentionPolicy.compute_prefill"):
        check_attention_output(FullAttentionPolicy(), "compute_prefill", 3, q, out)
    assert check_attention_output(FullAttentionPolicy(), "compute_prefill", 3, q, q) is q
