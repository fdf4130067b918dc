"""Greedy, temperature, top-k and top-p sampling over a batch, each row with its own parameters."""
from __future__ import annotations

import torch

from sparsekv.sampling_params import SamplingParams


class Sampler:
    def __init__(self):
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> seeded generator

    def forget(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> torch.Tensor:
        """logits [B, V] fp32 -> tokens [B] int64 on the logits' device, without a host sync (overlapped decode
        feeds them to the next step on the device). A seeded row draws from its sequence's own generator."""
        greedy = logits.argmax(dim=-1)  # [B] int64
        if all(p.greedy for p in params):
            return greedy
        tokens = greedy.clone()
        for row, (p, seq_id) in enumerate(zip(params, seq_ids)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, seq_id)
        return tokens

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, seq_id: int) -> torch.Tensor:
        logits = logits / p.temperature  # [V]
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        probs = logits.softmax(-1)
        generator = None
        if p.seed is not None:
            if seq_id not in self.generators:
                self.generators[seq_id] = torch.Generator(device=logits.device).manual_seed(p.seed)
            generator = self.generators[seq_id]
        return torch.multinomial(probs, 1, generator=generator)[0]
