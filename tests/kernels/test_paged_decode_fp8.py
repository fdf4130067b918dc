"""Paged decode attention over fp8 pages with per-(page, KV head) scales (the GPU block cache of the fp8 host tier):
the kernel dequantizes on load and must equal the same kernel over the pages dequantized first, and the reference
(which dequantizes explicitly). On CPU the kernel runs under the Triton interpreter (float32, small sizes)."""
from __future__ import annotations

import pytest
import torch

from sparsekv.kernels import paged_decode_attention, paged_decode_attention_reference
from sparsekv.kernels.fp8_kv import FP8_DTYPE, quantize_block

pytestmark = pytest.mark.usefixtures("triton_kernels")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGES, PAGE, KVH, H, D = 7, 16, 2, 4, 16


def _fp8_pages(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k8, v8 [PAGES, PAGE, KVH, D] fp8, k_scale, v_scale [PAGES, KVH]); head 1 of every page 100x larger."""
    g = torch.Generator().manual_seed(seed)
    pages, scales = [], []
    for _ in range(2):
        x = torch.randn(PAGES, PAGE, KVH, D, generator=g)
        x[:, :, 1] *= 100.0
        x8 = torch.empty(PAGES, PAGE, KVH, D, dtype=FP8_DTYPE)
        s = torch.empty(PAGES, KVH)
        for p in range(PAGES):
            quantize_block(x[p], x8[p], s[p])
        pages.append(x8.to(DEV))
        scales.append(s.to(DEV))
    return pages[0], pages[1], scales[0], scales[1]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_pages_equal_their_dequantized_pages(num_splits):
    k8, v8, ks, vs = _fp8_pages()
    q = torch.randn(3, H, D, generator=torch.Generator().manual_seed(1)).to(DEV)
    tables = torch.tensor([[5, 0, 3, 0], [1, 2, 6, 4], [0, 0, 0, 0]], device=DEV)
    lens = torch.tensor([3 * PAGE, 4 * PAGE - 5, 0], device=DEV)  # a partial last page; an empty sequence
    k, v = (x.float() * s[:, None, :, None] for x, s in ((k8, ks), (v8, vs)))
    o, lse = paged_decode_attention(q, k8, v8, tables, lens, 0.25, num_splits=num_splits, scales=(ks, vs))
    want_o, want_lse = paged_decode_attention(q, k, v, tables, lens, 0.25, num_splits=num_splits)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    ref_o, ref_lse = paged_decode_attention_reference(q, k8, v8, tables, lens, 0.25, scales=(ks, vs))
    torch.testing.assert_close(o[:2], ref_o[:2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse[:, :2], ref_lse[:, :2], rtol=1e-4, atol=1e-4)
    assert o.abs().amax() > 1.0  # the large head's values came through their scale


def test_scales_must_match_the_pages():
    k8, v8, ks, vs = _fp8_pages()
    q = torch.randn(1, H, D).to(DEV)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64, device=DEV), torch.tensor([PAGE], device=DEV)
    with pytest.raises(ValueError, match=r"k_scale/v_scale \[7, 2\] float32"):
        paged_decode_attention(q, k8, v8, tables, lens, scales=(ks[:3], vs[:3]))
    with pytest.raises(ValueError, match="expected k_cache/v_cache"):
        paged_decode_attention(q, k8.float(), v8.float(), tables, lens, scales=(ks, vs))
