"""The fp8 host tier through the ring engine on CPU: blocks leave quantized with per-(block, KV head) scales, come
back through the copy path and the gather kernel with their scales, dequantized for groups() and as fp8 + scales
for scaled_groups(); the host pool is sized by fp8 bytes plus scales."""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels.fp8_kv import FP8_DTYPE
from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.host_quant import host_block_bytes, resolve_host_dtype
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.kvcache.reader import RingReader

BS, KVH, D, LAYERS, BLOCKS = 4, 2, 8, 2, 6
CPU = torch.device("cpu")


def _filled_engine(num_slots: int = 4) -> tuple[OffloadEngine, torch.Tensor, torch.Tensor]:
    """An engine over an fp8 host pool whose blocks were offloaded from float32 K/V [L, BLOCKS * BS, KVH, D]: one
    head of each block 1000x larger than the other, block 3 all zero."""
    host = HostPool(LAYERS, BLOCKS, BS, KVH, D, FP8_DTYPE, pin_memory=False)
    host.ensure_capacity(BLOCKS)
    engine = OffloadEngine(host, num_slots, BLOCKS * BS, 1, CPU, model_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(LAYERS, BLOCKS * BS, KVH, D, generator=g) for _ in range(2))
    k[:, :, 1] *= 1000.0
    k[:, 3 * BS:4 * BS] = v[:, 3 * BS:4 * BS] = 0
    for layer in range(LAYERS):
        engine.write_prefill_buffer(layer, k[layer], v[layer])
        for block in range(BLOCKS):
            engine.offload_prefill_buffer_async(layer, block, BS, block * BS)
    return engine, k, v


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within fp8 (e4m3) rounding of each (block, head): 2^-4 of the value, or half a subnormal step of its scale."""
    scale = want.unflatten(0, (-1, BS)).abs().amax(dim=(1, 3), keepdim=True) / 448  # [nb, 1, KVH, 1]
    bound = (2 ** -4 * want.abs() + 2 ** -10 * scale.expand(-1, BS, -1, -1).flatten(0, 1)) * (1 + 1e-6)
    assert torch.all((got.float() - want).abs() <= bound)


@pytest.mark.parametrize("device_ids", [False, True])
def test_groups_come_back_dequantized(device_ids, request):
    if device_ids:
        request.getfixturevalue("triton_kernels")  # the gather kernel (blocks and scales) and the dequantize kernel
    engine, k, v = _filled_engine()
    blocks = [5, 0, 3, 1]
    chosen = torch.tensor(blocks) if device_ids else blocks
    seen = []
    for ids, gk, gv in RingReader(engine, layer=1).groups(chosen):
        ids = ids.tolist() if device_ids else ids
        rows = torch.cat([torch.arange(b * BS, (b + 1) * BS) for b in ids])
        assert gk.dtype == torch.float32
        _close(gk, k[1, rows])
        _close(gv, v[1, rows])
        seen += ids
    assert seen == blocks
    assert engine.transfer_stats["h2d_bytes"] == len(blocks) * 2 * (BS * KVH * D + 4 * KVH)


def test_scaled_groups_are_fp8_with_their_scales():
    engine, k, _ = _filled_engine()
    zero_seen = False
    for (ids, gk, _), (k_scale, v_scale) in RingReader(engine, layer=0).scaled_groups([2, 3, 4]):
        assert gk.dtype == FP8_DTYPE and k_scale.shape == v_scale.shape == (len(ids), KVH)
        want = k[0, ids[0] * BS:(ids[-1] + 1) * BS]
        torch.testing.assert_close(k_scale, want.unflatten(0, (-1, BS)).abs().amax(dim=(1, 3)) / 448)
        _close(gk.float().unflatten(0, (-1, BS)).mul(k_scale[:, None, :, None]).flatten(0, 1), want)
        if 3 in ids:  # the all-zero block
            assert k_scale[ids.index(3)].eq(0).all() and v_scale[ids.index(3)].eq(0).all()
            zero_seen = True
    assert zero_seen


def test_model_dtype_pool_has_no_fp8_state():
    host = HostPool(LAYERS, BLOCKS, BS, KVH, D, torch.bfloat16, pin_memory=False)
    engine = OffloadEngine(host, 2, BS, 1, CPU)
    assert engine.fp8 is None and engine.kv_slots.dtype == engine.prefill_k.dtype == torch.bfloat16


def test_host_pool_counts_fp8_bytes_and_scales():
    bf16 = host_block_bytes(36, 1024, 8, 128, torch.bfloat16)
    fp8 = host_block_bytes(36, 1024, 8, 128, resolve_host_dtype("float8_e4m3fn", torch.bfloat16, CPU))
    assert bf16 == 36 * 2 * 1024 * 8 * 128 * 2
    assert fp8 == bf16 // 2 + 36 * 2 * 8 * 4
    assert resolve_host_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
