"""The vocabulary-parallel token embedding (tensor_parallel_size > 1; a single GPU uses nn.Embedding)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsekv.distributed.sharding import Shard, vocab_rows
from sparsekv.distributed.state import TensorParallel


class VocabParallelEmbedding(nn.Embedding):
    """Rank r holds rows [r * rows, (r + 1) * rows) of the table (the last slice padded); a token outside its slice
    embeds to zeros there, and the sum over the ranks is the whole table's row."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TensorParallel):
        rows = vocab_rows(vocab_size, tp.size)
        super().__init__(rows, hidden_size)
        self.shard = Shard(0, tp.rank * rows, rows, vocab_size)
        self.tp = tp

    def checkpoint_shard(self, leaf: str, index: int) -> Shard | None:
        return self.shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [N] -> [N, hidden]
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [N, hidden]
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))
