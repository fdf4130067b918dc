"""Turns a scheduled batch into tensors and a Context, runs the model, samples."""
from __future__ import annotations

import torch
from torch import nn

from sparsekv.engine.context import Context, PrefillChunk, set_context
from sparsekv.engine.sampler import Sampler
from sparsekv.engine.scheduler import ScheduledBatch
from sparsekv.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: nn.Module, kv_store, device: torch.device):
        self.model = model
        self.kv_store = kv_store
        self.device = device
        self.block_size = kv_store.block_size
        self.sampler = Sampler()
        self.graph_runner = None  # sparsekv.graphs.cuda_graph: replays captured decode steps (graph.mode)

    def _tensor(self, values, dtype) -> torch.Tensor:
        return self._to_device(torch.tensor(values, dtype=dtype))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def prepare_prefill(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, Context, list[int]]:
        # a long prompt's ids, positions and slots as whole tensors: no per-token Python work
        input_ids, positions, slots, chunks, sample_rows = [], [], [], [], []
        rows = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            table = seq.block_table
            block_ids = torch.tensor(table, dtype=torch.int64)  # [num_blocks]
            pos = torch.arange(start, start + n)  # [n]
            input_ids.append(torch.tensor(seq.token_ids[start:start + n], dtype=torch.int64))
            positions.append(pos)
            slots.append(block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            one_run = bool(table) and table == list(range(table[0], table[0] + len(table)))
            chunks.append(PrefillChunk(seq, rows, rows + n, start, self._to_device(block_ids.to(torch.int32)),
                                       table[0] if one_run else None))
            rows += n
            if start + n == len(seq):
                sample_rows.append(rows - 1)
        context = Context(is_prefill=True, kv_store=self.kv_store, seqs=batch.seqs,
                          slot_mapping=self._to_device(torch.cat(slots)), chunks=chunks)
        return self._to_device(torch.cat(input_ids)), self._to_device(torch.cat(positions)), context, sample_rows

    def prepare_decode(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, Context, list[int]]:
        seqs = batch.seqs
        positions = [len(seq) - 1 for seq in seqs]
        slots = [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                 for seq, p in zip(seqs, positions)]
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
        context_lens = [len(seq) for seq in seqs]
        context = Context(is_prefill=False, kv_store=self.kv_store, seqs=seqs,
                          slot_mapping=self._tensor(slots, torch.int64),
                          block_tables=self._tensor(tables, torch.int32),
                          context_lens=self._tensor(context_lens, torch.int32),
                          max_context_len=max(context_lens))
        input_ids = self._tensor([seq.token_ids[-1] for seq in seqs], torch.int64)
        return input_ids, self._tensor(positions, torch.int64), context, list(range(len(seqs)))

    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """Returns {seq_id: sampled token} for the sequences whose step ends at their newest token."""
        seqs, tokens = self.execute(batch)
        return {seq.seq_id: token for seq, token in zip(seqs, tokens.tolist())} if seqs else {}

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
                ) -> tuple[list[Sequence], torch.Tensor | None]:
        """Launches one step without waiting for it: (the sequences whose step ends at their newest token, their
        sampled tokens [S] int64 on the device, None when S = 0). `input_ids` [B] int64 on the device (decode only)
        replace the newest token ids of the batch's sequences: overlapped decode passes the previous step's sampled
        tokens, which the host does not know yet."""
        graph = self.graph_runner
        if graph is not None and (batch.is_prefill or not graph.can_run(batch.seqs)):
            graph = None  # prefill, and decode batches larger than the largest captured one, run eagerly
        prepared = graph.prepare_decode(batch) if graph is not None else None
        if prepared is None:
            prepare = self.prepare_prefill if batch.is_prefill else self.prepare_decode
            prepared = prepare(batch)
        ids, positions, context, sample_rows = prepared
        if input_ids is not None:
            if batch.is_prefill or input_ids.shape != ids.shape:
                raise ValueError(f"input_ids {tuple(input_ids.shape)} on the device replace the ids of a decode step "
                                 f"of {len(batch.seqs)} sequences only; this step is a "
                                 f"{'prefill' if batch.is_prefill else 'decode'} of {tuple(ids.shape)} ids")
            ids.copy_(input_ids)  # after the host ids in stream order (a graph's static buffer, or a fresh tensor)
        set_context(context)
        try:
            self.kv_store.begin_step(context)
            if graph is not None:
                hidden = graph.forward(ids, positions, context)  # [N, hidden]
            else:
                hidden = self.model(ids, positions)  # [N, hidden]
            self.kv_store.end_step(context)
        finally:
            set_context(None)
        if not sample_rows:
            return [], None
        # every row (decode): a slice, not an index list, whose host-to-device copy would wait for the device
        rows = hidden if sample_rows == list(range(hidden.shape[0])) else hidden[sample_rows]
        logits = self.model.compute_logits(rows)  # [S, vocab]
        sampled_seqs = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens)
                        if seq.num_computed_tokens + n == len(seq)]
        tokens = self.sampler.sample(logits, [s.sampling_params for s in sampled_seqs],
                                     [s.seq_id for s in sampled_seqs])  # [S] int64
        self.last_logits = logits
        return sampled_seqs, tokens
