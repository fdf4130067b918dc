"""On CPU the resident KV pool is sized from the request (max_num_seqs sequences of max_model_len), not from RAM."""
from __future__ import annotations

import pytest
import torch

from sparsekv.factory import check_scheduler_config
from sparsekv.kvcache.sizing import kv_block_bytes, num_device_kv_blocks, prefill_activation_bytes
from sparsekv.llm import compose_config
from sparsekv.models.loader import resolve_spec

CPU = torch.device("cpu")


def pool_bytes(overrides: list[str]) -> tuple[int, int]:
    cfg = compose_config(["device=cpu", *overrides])
    spec = resolve_spec(cfg.model)
    max_model_len = check_scheduler_config(cfg, spec, CPU)
    blocks = num_device_kv_blocks(cfg, spec, torch.float32, CPU, max_model_len,
                                  cfg.scheduler.max_num_batched_tokens)
    return blocks * kv_block_bytes(cfg, spec, torch.float32), max_model_len


def test_tiny_model_with_defaults_gets_a_small_pool():
    size, max_model_len = pool_bytes([])
    assert size < 1 << 30
    assert max_model_len == 4096  # the tiny model's own maximum, below the CPU default


def test_large_model_on_cpu_defaults_to_a_modest_max_model_len_and_pool():
    size, max_model_len = pool_bytes(["model=qwen3_0_6b", "model.load_format=dummy"])
    assert max_model_len < 40960
    assert size < 4 << 30  # the whole-RAM-sized pool was half of MemAvailable


def test_a_set_max_model_len_is_kept():
    _, max_model_len = pool_bytes(["model=qwen3_0_6b", "model.load_format=dummy", "scheduler.max_model_len=16384"])
    assert max_model_len == 16384


def test_a_set_pool_that_leaves_no_room_for_the_prefill_step_is_refused_on_cuda(monkeypatch):
    """offload.num_kv_blocks is taken as it is, but on CUDA the blocks and the largest prefill step (a whole prompt
    for a whole-prompt policy) must fit the memory left after the weights: a clear error, not an out-of-memory
    error deep inside the first prefill."""

    cfg = compose_config(["device=cpu", "model=qwen3_0_6b", "model.load_format=dummy", "offload.num_kv_blocks=64"])
    spec = resolve_spec(cfg.model)
    kv = 64 * kv_block_bytes(cfg, spec, torch.bfloat16)
    step = prefill_activation_bytes(1 << 20, spec, torch.bfloat16)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (kv + step + 1, 1 << 40))
    assert num_device_kv_blocks(cfg, spec, torch.bfloat16, cuda, 1 << 20, 1 << 20) == 64
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (kv + step - 1, 1 << 40))
    with pytest.raises(ValueError, match=r"offload.num_kv_blocks=64 .* prefill step of 1048576 tokens"):
        num_device_kv_blocks(cfg, spec, torch.bfloat16, cuda, 1 << 20, 1 << 20)
    assert num_device_kv_blocks(cfg, spec, torch.bfloat16, CPU, 1 << 20, 1 << 20) == 64  # CPU: no such check
