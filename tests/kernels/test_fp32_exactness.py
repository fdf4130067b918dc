"""float32 means float32 on the GPU: every kernel of the decode and prefill path, at the shapes of the tiny checkpoints
the differential test compares with HF, against the same math in float64 (on CUDA when present; on CPU through
Triton's interpreter, whose float32 is numpy's).

Float32 rounding leaves a relative error near 1e-7 per operation; a TF32 dot, a bf16 cast or the GPU's approximate
sin/cos on unreduced angles leaves 1e-4 to 1e-3, which flips greedy tokens against HF. The bound here (2e-6)
separates the two by two orders of magnitude.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sparsekv.kernels.attention import flash_attn_with_lse
from sparsekv.kernels.gemv import silu_mul_linear, skinny_linear
from sparsekv.kernels.paged_attention import paged_decode_attention
from sparsekv.kernels.rmsnorm import rms_norm

pytestmark = pytest.mark.usefixtures("triton_kernels")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the Triton interpreter
BOUND = 2e-6
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 16  # tests/conftest.py make_checkpoint


def _rel(out: torch.Tensor, truth: torch.Tensor) -> float:
    return ((out.double() - truth).norm() / truth.norm()).item()


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV)


def _attention_truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [Sq, H, D], k/v [Sk, KVH, D] -> [Sq, H, D] float64; causal rows end at Sk - Sq + row."""
    sq, h, d = q.shape
    sk, kvh = k.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(h // kvh, dim=1)  # [Sk, H, D]
    vv = v.double().repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) / math.sqrt(d)
    if causal:
        mask = torch.arange(sk, device=q.device)[None, :] > (torch.arange(sq, device=q.device)[:, None] + sk - sq)
        s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


@pytest.mark.parametrize("m", [1, 3, 16, 150])
def test_linear_layers(m):
    x, w = _randn(m, HIDDEN, seed=1), _randn(INTER * 2, HIDDEN, seed=2, scale=0.15)
    assert _rel(skinny_linear(x, w), x.double() @ w.double().T) < BOUND
    gate_up, down = _randn(m, 2 * INTER, seed=3, scale=2.0), _randn(HIDDEN, INTER, seed=4, scale=0.15)
    act = F.silu(gate_up[:, :INTER].double()) * gate_up[:, INTER:].double()
    assert _rel(silu_mul_linear(gate_up, down), act @ down.double().T) < BOUND


def test_rms_norm():
    x, w = _randn(150, HIDDEN, seed=5, scale=3.0), _randn(HIDDEN, seed=6)
    xd = x.double()
    assert _rel(rms_norm(x, w, 1e-6), xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()) < BOUND


@pytest.mark.parametrize("sq, sk", [(150, 150), (64, 200), (1, 150)])
def test_prefill_attention(sq, sk):
    q, k, v = _randn(sq, HEADS, HEAD_DIM, seed=7), _randn(sk, KV_HEADS, HEAD_DIM, seed=8), _randn(sk, KV_HEADS,
                                                                                                HEAD_DIM, seed=9)
    out, _ = flash_attn_with_lse(q, k, v, causal=True)
    assert _rel(out, _attention_truth(q, k, v, causal=True)) < BOUND


@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_decode_attention(block_size):
    lens = [150, 37, 1, 64]
    blocks = [-(-n // block_size) for n in lens]
    k_cache = _randn(sum(blocks) + 1, block_size, KV_HEADS, HEAD_DIM, seed=10)
    v_cache = _randn(sum(blocks) + 1, block_size, KV_HEADS, HEAD_DIM, seed=11)
    order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(12)) + 1  # scattered blocks
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = order[start:start + n]
        start += n
    q = _randn(len(lens), HEADS, HEAD_DIM, seed=13)
    out, _ = paged_decode_attention(q, k_cache, v_cache, table.to(DEV), torch.tensor(lens, dtype=torch.int32).to(DEV),
                                    max_context_len=max(lens))
    for b, n in enumerate(lens):
        ids = table[b, :blocks[b]].long().to(DEV)
        k = k_cache[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:n]
        v = v_cache[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:n]
        assert _rel(out[b:b + 1], _attention_truth(q[b:b + 1], k, v, causal=False)) < BOUND, (block_size, n)
