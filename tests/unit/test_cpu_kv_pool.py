"""On CPU the resident KV pool is sized from the request (max_num_seqs sequences of max_model_len), not from RAM."""
from __future__ import annotations

import torch

from sparsekv.factory import check_scheduler_config
from sparsekv.kvcache.sizing import kv_block_bytes, num_device_kv_blocks
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
