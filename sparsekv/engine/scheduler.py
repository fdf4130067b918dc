"""Continuous batching with chunked prefill: prefill chunks under a token budget first, then one decode step
for every running sequence."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sparsekv.engine.block_manager import BlockManager
from sparsekv.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed for each sequence this step
    is_prefill: bool


def in_prefill(seq: Sequence) -> bool:
    return seq.num_computed_tokens == 0 or seq.num_uncomputed_tokens > 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunk_alignment: int = 1):
        self.block_manager = block_manager
        self.chunk_alignment = chunk_alignment  # offload: unfinished chunks end on a block boundary
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill()
        return batch if batch.seqs else self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs, counts = [], []
        for seq in self.running:  # unfinished chunked prefills go first
            if in_prefill(seq):
                n = self._chunk(seq, budget)
                if n:
                    seqs.append(seq), counts.append(n)
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq, budget)
            if not n or not self.block_manager.can_allocate(seq, len(seq)):
                break
            self.block_manager.allocate(seq, len(seq))
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            seqs.append(seq), counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, is_prefill=True)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of this sequence to prefill within the budget; an unfinished chunk ends on an aligned boundary."""
        remaining = seq.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        return budget - budget % self.chunk_alignment

    def _schedule_decode(self) -> ScheduledBatch:
        seqs = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_allocate(seq, len(seq)):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.allocate(seq, len(seq))
                seqs.append(seq)
        self.running.extend(seqs)
        return ScheduledBatch(seqs, [1] * len(seqs), is_prefill=False)

    def preempt(self, seq: Sequence) -> None:
        """Free its KV; it is recomputed (prompt and generated tokens) when blocks free up."""
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int], eos_ids: set[int],
                    max_model_len: int) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, retire finished sequences."""
        finished = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.seq_id not in sampled:
                continue
            token = sampled[seq.seq_id]
            seq.append_token(token)
            params = seq.sampling_params
            reason = None
            if not params.ignore_eos and token in eos_ids:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason = "stop"
            elif seq.num_completion_tokens >= params.max_tokens or len(seq) >= max_model_len:
                reason = "length"
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
