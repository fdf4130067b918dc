"""Inputs of the quality harness: AttentionInputs (Q/K/V of one sequence for a few layers), where the phases fall
in it (Layout) and planted_inputs (seeded Q/K/V with sinks, local windows, vertical stripes and needle blocks)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence as Seq

import torch

@dataclass
class AttentionInputs:
    """Q/K/V of one sequence of `context` tokens for a few layers (any device; computation runs on `device`)."""
    q: torch.Tensor  # [L, S, H, D]
    k: torch.Tensor  # [L, S, KVH, D]
    v: torch.Tensor  # [L, S, KVH, D]
    block_size: int
    softmax_scale: float
    device: torch.device
    needle_blocks: list[int] = field(default_factory=list)  # logical block indices holding needles
    needle_queries: int = 1  # the last n positions' queries are the ones that look for the needles
    prefill_chunk: int | None = None  # tokens per chunked-prefill chunk (default: 4 blocks)
    decode_steps: int = 0  # tokens decoded (hooks, attention) before the evaluated last token
    layer_ids: list[int] | None = None  # the model's layer ids of the L layers (reporting only)
    name: str = "planted"
    meta: dict[str, Any] = field(default_factory=dict)  # depth, seed, ... (copied into the report)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.q.dim() != 4 or self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(f"expected q [L, S, H, D], k/v [L, S, KVH, D]; got q {tuple(self.q.shape)}, "
                             f"k {tuple(self.k.shape)}, v {tuple(self.v.shape)}")
        if self.q.shape[:2] != self.k.shape[:2] or self.q.shape[3] != self.k.shape[3]:
            raise ValueError(f"q {tuple(self.q.shape)} and k {tuple(self.k.shape)} disagree on layers, tokens or "
                             "head dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be positive")
        if self.context < 2 + self.decode_steps:
            raise ValueError(f"context={self.context} needs at least {2 + self.decode_steps} tokens (a prompt token, "
                             f"{self.decode_steps} decode steps and the evaluated token)")
        chunk = self.chunk
        if chunk < self.block_size or chunk % self.block_size:
            raise ValueError(f"prefill_chunk={chunk} must be a positive multiple of block_size={self.block_size}")

    @property
    def num_layers(self) -> int:
        return self.q.shape[0]

    @property
    def context(self) -> int:
        return self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def chunk(self) -> int:
        return self.prefill_chunk or 4 * self.block_size

    @property
    def layout(self) -> "Layout":
        return layout(self.context, self.block_size, self.chunk, self.decode_steps)


@dataclass(frozen=True)
class Layout:
    """Where the phases fall in a sequence of `context` tokens."""
    context: int
    block_size: int
    chunk: int
    prompt_len: int  # prefilled tokens; the rest are decoded one by one, the last one evaluated
    last_chunk_start: int  # first position of the prompt's last prefill chunk
    decode_full_blocks: int  # blocks before the evaluated decode token's block (selectable in decode)
    prefix_blocks: int  # blocks before the last prefill chunk (selectable in prefill)
    num_blocks: int


def layout(context: int, block_size: int, chunk: int, decode_steps: int = 0) -> Layout:
    prompt = context - 1 - decode_steps
    last_start = ((prompt - 1) // chunk) * chunk
    return Layout(context, block_size, chunk, prompt, last_start, (context - 1) // block_size,
                  last_start // block_size, -(-context // block_size))


def needle_block_indices(depths: Iterable[float], lay: Layout) -> list[int]:
    """Logical block of each needle depth in [0, 1], within the blocks both phases may select (the prefill prefix;
    the decode full blocks when the prompt is a single chunk), avoiding block 0 (sinks) when there is room."""
    selectable = lay.prefix_blocks if lay.prefix_blocks else lay.decode_full_blocks
    if selectable < 1:
        return []
    low = 1 if selectable > 1 else 0
    blocks = []
    for depth in depths:
        if not 0.0 <= float(depth) <= 1.0:
            raise ValueError(f"needle depth {depth} is outside [0, 1]")
        block = low + int(round(float(depth) * (selectable - 1 - low)))
        if block not in blocks:
            blocks.append(block)
    return blocks


def planted_inputs(context: int = 4096, block_size: int = 256, *, num_layers: int = 1, num_heads: int = 8,
                   num_kv_heads: int = 2, head_dim: int = 64, needle_depths: Seq[float] = (0.5,),
                   prefill_chunk: int | None = None, decode_steps: int = 0, needle_queries: int | None = None,
                   sink_tokens: int = 4, num_stripes: int = 8, local_window: int | None = None,
                   sink_logit: float = 8.0, stripe_logit: float = 5.0, local_logit: float = 4.0,
                   needle_logit: float = 6.0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   seed: int = 0) -> AttentionInputs:
    """Q/K/V with planted structure, seeded. The first half of each head's dims carries content, the second a
    positional code (sinusoids slower than the local window, so nearby queries and keys agree). Per KV head:

      sinks     the first `sink_tokens` keys have a large component along the heads' query direction u
      stripes   `num_stripes` random key positions with a component along u (every query likes them)
      local     queries and keys share the positional code: recent keys score up to `local_logit` more
      needles   the keys of each needle block lie along a second direction w that only the needle queries carry
                (the last `needle_queries` positions: by default the last prefill chunk and the decoded tokens)

    The *_logit parameters are the score (scaled q.k) each structure adds; the unstructured scores have a standard
    deviation of about 1.2.
    """
    if head_dim < 8 or head_dim % 4:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 4, at least 8")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    chunk = prefill_chunk or 4 * block_size
    lay = layout(context, block_size, chunk, decode_steps)
    if needle_queries is None:
        needle_queries = context - lay.last_chunk_start
    needle_blocks = needle_block_indices(needle_depths, lay)
    window = local_window or block_size
    scale = head_dim ** -0.5
    gen = torch.Generator().manual_seed(seed)
    content, pos = head_dim // 2, head_dim - head_dim // 2
    group = num_heads // num_kv_heads
    a = math.sqrt(head_dim)  # query norm along u and w
    positions = torch.arange(context, dtype=torch.float64)
    qs, ks, vs = [], [], []
    for _ in range(num_layers):
        q = torch.zeros(context, num_heads, head_dim)
        k = torch.zeros(context, num_kv_heads, head_dim)
        v = torch.randn(context, num_kv_heads, head_dim, generator=gen)
        stripes = torch.randperm(max(1, context - 1 - sink_tokens), generator=gen)[:num_stripes] + sink_tokens
        # positional code: r(i).r(j) = mean_m cos(w_m (i - j)), ~1 within the window, small beyond
        freqs = torch.rand(pos // 2, generator=gen, dtype=torch.float64) * (math.pi / (2 * window))
        angles = positions[:, None] * freqs[None, :]
        code = (torch.cat([angles.cos(), angles.sin()], dim=1) / math.sqrt(pos // 2)).float()  # [S, pos]
        gamma = math.sqrt(local_logit / scale)
        needle_rows = torch.zeros(context, dtype=torch.bool)
        needle_rows[context - needle_queries:] = True
        for g in range(num_kv_heads):
            basis, _ = torch.linalg.qr(torch.randn(content, 2, generator=gen))
            u, w = basis[:, 0], basis[:, 1]
            kc = torch.randn(context, content, generator=gen)
            kc[:sink_tokens] += (sink_logit / (scale * a)) * u
            kc[stripes] += (stripe_logit / (scale * a)) * u
            for block in needle_blocks:
                kc[block * block_size:(block + 1) * block_size] += (needle_logit / (scale * a)) * w
            k[:, g, :content] = kc
            k[:, g, content:] = gamma * code
            for h in range(g * group, (g + 1) * group):
                qc = torch.randn(context, content, generator=gen) + a * u
                qc[needle_rows] += a * w
                q[:, h, :content] = qc
                q[:, h, content:] = gamma * code
        qs.append(q), ks.append(k), vs.append(v)
    device = torch.device(device)
    stack = (lambda xs: torch.stack(xs).to(device=device, dtype=dtype))
    meta = {"context": context, "block_size": block_size, "depths": [float(d) for d in needle_depths], "seed": seed}
    return AttentionInputs(stack(qs), stack(ks), stack(vs), block_size, scale, device, needle_blocks, needle_queries,
                           prefill_chunk, decode_steps, None, "planted", meta)
