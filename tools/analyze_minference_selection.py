"""MInference's selection on structured dummy weights, counted on the CPU: the vertical-slash kernel's tiles and the
attention mass the selection keeps, with and without slash_excludes_vertical.

    python tools/analyze_minference_selection.py [--context 131072] [--layers 4] [--rows 96]

Qwen3-4B's dimensions with `model.load_format=dummy_structured` and --layers layers (their peak logits spread over
the structured weights' range), on the CPU. Each layer's q and k are its projections of the token embeddings (the
structured weights keep the embeddings' shared direction the main part of the residual stream, so this is close to
the layer's own input, without running the attention of the layers before it). Per layer and setting it prints:
  * the vertical-slash kernel's key tiles summed over heads and query blocks at its 64 x 32 tiles (bf16 D=128 on
    sm_90): slash tiles and column tiles. The kernel's time follows its tiles;
  * the attention mass the selection keeps, per head, for --rows query positions spread over the prompt's second
    half (exact softmax over every visible key): mean over rows and heads, and the worst head's mean.
No GPU; about 7 minutes and 18 GB of memory at 128K and 4 layers on two cores.
"""
from __future__ import annotations

import argparse

import torch

from sparsekv.llm import LLM
from sparsekv.policies.minference.policy import MInferencePolicy
from sparsekv.policies.minference.vertical_slash_index import vertical_slash_index_reference
from sparsekv.tasks.bench.task import random_prompts

TILES = (64, 32)  # the vertical-slash kernel's (BLOCK_M, BLOCK_N) for bf16 D=128


def tiles(vertical: torch.Tensor, slash: torch.Tensor, seq: int) -> tuple[int, int]:
    """(slash tiles, column tiles) the kernel visits for a whole-prompt call, summed over heads and query blocks."""
    ranges = vertical_slash_index_reference(vertical, slash, seq, seq, 0, *TILES).ranges.long()  # [H, blocks, 5]
    slash_tiles = (ranges[..., 1] - ranges[..., 0] + ranges[..., 3] - ranges[..., 2]).sum().item()
    return slash_tiles, ((ranges[..., 4] + TILES[1] - 1) // TILES[1]).sum().item()


def mass_kept(q: torch.Tensor, keys: torch.Tensor, vertical: torch.Tensor, slash: torch.Tensor, rows: torch.Tensor,
              scale: float) -> torch.Tensor:
    """[rows, H]: each row's softmax mass on the selected keys (columns at or before it, keys on a selected
    diagonal); keys [S, H, D] are k with each KV head repeated for its query heads."""
    heads = q.shape[1]
    kept = []
    for p in rows.tolist():
        prob = (torch.einsum("hd,khd->hk", q[p], keys[:p + 1]) * scale).softmax(-1)  # [H, p + 1]
        hits = torch.zeros(heads, p + 1, dtype=torch.int32)  # selections per key; out-of-range ones add 0
        for picked in (vertical.long(), p - slash.long()):  # the columns, the keys on the diagonals
            hits.scatter_add_(1, picked.clamp(0, p), ((picked >= 0) & (picked <= p)).to(torch.int32))
        kept.append((prob * (hits > 0)).sum(-1))
    return torch.stack(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=96, help="query positions whose kept mass is measured")
    args = parser.parse_args()
    seq = args.context
    llm = LLM(overrides=["model=qwen3_4b", "model.load_format=dummy_structured",
                         f"model.num_hidden_layers={args.layers}", "device=cpu", f"scheduler.max_model_len={seq + 8}",
                         "graph=eager", "offload.num_kv_blocks=8"])
    model = llm.engine.model
    ids = torch.tensor(random_prompts(1, seq, llm.engine.spec.vocab_size, 0)[0])
    rows = torch.linspace(seq // 2, seq - 1, args.rows).long()
    with torch.no_grad():
        hidden, rope = model.embed(ids, torch.arange(seq))
        for layer_id, layer in enumerate(model.layers):
            q, k, _ = layer.pre_attention(hidden, rope)
            q, k = q.float(), k.float()  # [S, H, D], [S, KVH, D]
            scale = q.shape[2] ** -0.5
            keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [S, H, D]
            for exclude in (False, True):
                vertical, slash = MInferencePolicy(slash_excludes_vertical=exclude).estimate_pattern(q, k, scale)
                slash_tiles, column_tiles = tiles(vertical, slash, seq)
                kept = mass_kept(q, keys, vertical, slash, rows, scale)
                print(f"layer {layer_id} slash_excludes_vertical={exclude}: slash tiles {slash_tiles:,}, column "
                      f"tiles {column_tiles:,}, all {slash_tiles + column_tiles:,}; mass kept "
                      f"{kept.mean().item():.3f} (worst head {kept.mean(0).min().item():.3f})", flush=True)
            del q, k, keys  # the next layer's projections need the room (two cores, 24 GB)


if __name__ == "__main__":
    main()
