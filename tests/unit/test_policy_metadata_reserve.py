"""offload=cpu reserves the device memory that the policies' block metadata declares (device_bytes_per_block) before
it sizes the GPU block cache, allocates those tables once at build time, refuses a configuration whose metadata
cannot fit, and checks what a policy declares."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.errors import PolicyConfigError
from sparsekv.kvcache.sizing import GPU_CACHE_MARGIN, gpu_cache_slots, policy_metadata_bytes, sequence_blocks
from sparsekv.llm import compose_config
from sparsekv.policies.context import KVLayout
from sparsekv.policies.quest import QuestPolicy
from sparsekv.policies.xattn.policy import XAttentionPolicy

GIB = 1 << 30
# Qwen3-4B's KV dimensions: 36 layers, 8 KV heads of 128
SPEC = SimpleNamespace(num_hidden_layers=36, num_key_value_heads=8, head_dim=128, kv_bytes_per_token=36 * 2 * 8 * 128,
                       intermediate_size=9728, hidden_size=2560, num_attention_heads=32)
LAYOUT = KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, block_size=1024, max_blocks=4096,
                  dtype=torch.bfloat16, device=torch.device("cpu"))


def offload_config(context: int):
    return compose_config(["model=qwen3_4b", "model.load_format=dummy", "offload=cpu",
                           f"scheduler.max_model_len={context}", "scheduler.max_num_seqs=1"])


def test_xattention_summaries_are_reserved_before_the_cache_takes_the_device(monkeypatch):
    free = 40 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    cfg, cuda = offload_config(524288), torch.device("cuda")
    metadata = policy_metadata_bytes([XAttentionPolicy()], LAYOUT)
    assert metadata == (36 * (128 * 8 * 128 * 2 + 4), "policy=xattn_bsa")  # 9 MiB per 1,024-token block
    bare = gpu_cache_slots(cfg, SPEC, torch.bfloat16, cuda, 524288, 4096, metadata=(0, ""))
    reserved = gpu_cache_slots(cfg, SPEC, torch.bfloat16, cuda, 524288, 4096, metadata=metadata)
    blocks = sequence_blocks(cfg, 524288, 4096)
    assert blocks == 512
    layer_block_bytes = 2 * 1024 * 8 * 128 * 2
    held = blocks * metadata[0]  # 4.5 GiB
    assert bare - reserved == pytest.approx(held / (36 * layer_block_bytes), abs=1)

    free = held + GPU_CACHE_MARGIN - 1  # the summaries alone do not fit: refused, naming the policy and the fix
    with pytest.raises(ValueError, match=r"policy=xattn_bsa keeps 4.5\d* GiB of block metadata on the device for 512 "
                                         r"host blocks .*lower scheduler.max_model_len"):
        gpu_cache_slots(cfg, SPEC, torch.bfloat16, cuda, 524288, 4096, metadata=metadata)
    free = held + 4 * GIB  # an explicit cache size that only fits without the reserve
    cfg.offload.gpu_cache_gib = 5
    with pytest.raises(ValueError, match=r"gpu_cache_gib=5 exceeds the 4.00 GiB .* and the policies' block metadata"):
        gpu_cache_slots(cfg, SPEC, torch.bfloat16, cuda, 524288, 4096, metadata=metadata)


@dataclass
class BadDeclaration(QuestPolicy):
    name: str = "quest"
    declared: object = "a lot"

    def device_bytes_per_block(self, layout):
        return self.declared


@pytest.mark.parametrize("declared", ["a lot", -4, 2.0, True])
def test_a_bad_declaration_names_the_policy(declared):
    with pytest.raises(PolicyConfigError, match=f"policy=quest: BadDeclaration.device_bytes_per_block returned "
                                                f"{declared!r}.*int >= 0"):
        policy_metadata_bytes([BadDeclaration(declared=declared)], LAYOUT)


def test_one_policy_for_both_phases_is_counted_once():
    quest = QuestPolicy()
    assert policy_metadata_bytes([quest, quest], LAYOUT) == (2 * 36 * 8 * 128 * 2, "policy=quest")
    assert policy_metadata_bytes([QuestPolicy(), XAttentionPolicy()], LAYOUT)[1] == "policy=quest, policy=xattn_bsa"


@pytest.mark.parametrize("policy", ["quest", "xattn_bsa"])
def test_offloaded_tables_are_allocated_once_for_every_block_the_sequences_hold(qwen3_ckpt, policy):
    llm = LLM(str(qwen3_ckpt), overrides=["device=cpu", "offload=cpu", "offload.block_size=16",
                                          "scheduler.max_model_len=256", "scheduler.max_num_seqs=2",
                                          f"policy={policy}"])
    store = llm.engine.kv_store
    tables = [t for p in store.policies for t in vars(p).values() if hasattr(t, "capacity")]
    assert tables and {t.capacity for t in tables} == {2 * 256 // 16}  # max_num_seqs full-length sequences
    before = [t.data for t in tables]
    llm.generate([[5 + i % 100 for i in range(195)], [7 + i % 90 for i in range(173)]], SamplingParams(max_tokens=8))
    assert all(t.data is b for t, b in zip(tables, before))  # recorded in place: nothing grew or moved
