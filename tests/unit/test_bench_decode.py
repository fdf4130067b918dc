"""task=bench's decode figures: batch curve bookkeeping and the floors of a selecting policy whose budget the bench
cannot compute (a plugin's), measured from the blocks the store loaded."""
from types import SimpleNamespace

import pytest
import torch

from sparsekv.tasks.bench.decode import DecodeWork, curve_max_tokens, curve_sizes, settled, steps_at

SPEC = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=4, num_attention_heads=4,
                       hidden_size=16)


class WindowPolicy:  # a plugin-style selection: no budget the bench knows
    requires_block_selection = True


def work(policy) -> DecodeWork:
    return DecodeWork(gpu_spec=SPEC, context=1024, block_size=64, num_layers=2, policy=policy, dtype_bytes=2,
                      kv_bytes_per_token=2 * 2 * 2 * 4 * 2, weight_bytes=1e6, engine_dtype=torch.bfloat16,
                      hbm_gbps=1.0, h2d_gbps=1.0, offloaded=True)


def snapshots(h2d_blocks_per_step: int, steps: int, **cache) -> list[dict]:
    return [{"h2d_blocks": h2d_blocks_per_step * (i + 1), "h2d_bytes": 4096.0 * h2d_blocks_per_step * (i + 1),
             **{k: v * (i + 1) for k, v in cache.items()}} for i in range(steps)]


def test_curve_sizes_and_max_tokens():
    assert curve_sizes([1, 4, 2], 4) == [4, 2, 1]
    # four sequences, 3 steps per point: all four decode 3 steps, two of them 3 more, one 3 more still
    assert curve_max_tokens([4, 2, 1], 3) == [10, 7, 4, 4]
    assert steps_at([4, 4, 2, 2, 1], 2) == [2, 3]
    assert settled([2, 3, 4]) == [3, 4] and settled([5]) == [5]  # a point's first step is left out when it has more
    with pytest.raises(ValueError, match="task.batch_size=4"):
        curve_sizes([1, 4], 2)


def test_plugin_selection_density_comes_from_the_loaded_blocks():
    # 2 sequences x 2 layers x 3 full blocks loaded per step; the step at index 1 attends 1025 + 1 tokens
    figures = work(WindowPolicy()).figures(2, [0.01] * 4, [0, 1, 2, 3], snapshots(12, 4), None)
    context = figures["decode_context"]
    full = (context - 1) // 64
    assert figures["decode_kv_density"] == pytest.approx((3 * 64 + context - full * 64) / context)
    dense = work(None).figures(2, [0.01] * 4, [0, 1, 2, 3], snapshots(12, 4), None)
    assert dense["decode_kv_density"] == 1.0
    assert figures["decode_hbm_floor_ms"] < dense["decode_hbm_floor_ms"]


def test_plugin_selection_through_a_gpu_cache_claims_no_hbm_floor():
    # cached blocks do not cross PCIe: the loads no longer tell what the step attended
    figures = work(WindowPolicy()).figures(1, [0.01] * 2, [0, 1], snapshots(2, 2, cache_hit_blocks=4), None)
    assert figures["decode_kv_density"] is None and figures["decode_hbm_floor_ms"] is None
    assert figures["decode_floor_ms"] == pytest.approx(figures["decode_loaded_floor_ms"])
