"""tools/analyze_minference_selection.py: the kept attention mass and the kernel's tile count it reports."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "analyze_minference_selection.py"
SPEC = importlib.util.spec_from_file_location("analyze_minference_selection", TOOL)
tool = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(tool)

SENTINEL = 1 << 30


def _qk(seq: int = 40, heads: int = 2, kv_heads: int = 1, dim: int = 8):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(seq, heads, dim, generator=gen), torch.randn(seq, kv_heads, dim, generator=gen)


def test_mass_kept_is_the_selected_keys_share_of_each_row():
    q, k = _qk()
    k = k.expand(-1, 2, -1)  # each KV head repeated for its query heads
    rows = torch.tensor([0, 7, 39])
    none = torch.full((2, 1), SENTINEL, dtype=torch.int32)
    every_offset = torch.arange(40, dtype=torch.int32).expand(2, -1)
    assert torch.allclose(tool.mass_kept(q, k, none, every_offset, rows, 0.5), torch.ones(3, 2))
    assert tool.mass_kept(q, k, none, none, rows, 0.5).abs().max().item() == 0.0
    # column 0 and diagonal 0: the first key and the row's own key (one key for row 0)
    kept = tool.mass_kept(q, k, torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), rows, 0.5)
    for i, p in enumerate(rows.tolist()):
        prob = (torch.einsum("hd,khd->hk", q[p], k[:p + 1]) * 0.5).softmax(-1)
        expected = prob[:, 0] + (prob[:, p] if p > 0 else 0)
        assert torch.allclose(kept[i], expected, atol=1e-6)


def test_tiles_grow_with_the_selection():
    seq = 256
    none = torch.full((2, 1), SENTINEL, dtype=torch.int32)
    band = torch.arange(64, dtype=torch.int32).expand(2, -1)
    two_bands = torch.cat([torch.arange(64), torch.arange(128, 192)]).to(torch.int32).expand(2, -1)
    slash_one, columns_none = tool.tiles(none, band, seq)
    slash_two, _ = tool.tiles(none, two_bands, seq)
    assert columns_none == 0 and 0 < slash_one < slash_two
    # columns 0..39, at or before every query block's last row: ceil(40 / 32) tiles per head and query block
    columns = torch.arange(40, dtype=torch.int32).expand(2, -1)
    _, column_tiles = tool.tiles(columns, none, seq)
    assert column_tiles == 2 * (seq // tool.TILES[0]) * 2
