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


def reaches_length_limit(seq: Sequence, max_model_len: int, num_tokens: int | None = None) -> bool:
    """Do the first `num_tokens` tokens (default: all) fill max_tokens or max_model_len?"""
    num_tokens = len(seq) if num_tokens is None else num_tokens
    return num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens or num_tokens >= max_model_len


def stop_reason(seq: Sequence, token: int, eos_ids: set[int], max_model_len: int,
                num_tokens: int | None = None) -> str | None:
    """Why `seq` stops at `token`, its newest token once it holds `num_tokens` tokens (default: len(seq)); None
    when it goes on."""
    params = seq.sampling_params
    if (not params.ignore_eos and token in eos_ids) or token in params.stop_token_ids:
        return "stop"
    return "length" if reaches_length_limit(seq, max_model_len, num_tokens) else None


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

    def schedule_decode_ahead(self, max_model_len: int) -> ScheduledBatch | None:
        """The next decode step, scheduled while the previous one is in flight (overlapped decode: every running
        sequence ends in that step's placeholder token). It is the step synchronous scheduling would run after the
        previous one, plus the rows of sequences its tokens will stop (eos, stop_token_ids): their results are
        discarded. A sequence that surely ends at its placeholder (max_tokens, max_model_len) is left out and its
        blocks go back now, as they would in synchronous mode; the in-flight step still writes them, but anything
        that reuses them is launched after it, on the same stream.

        None - wait for the in-flight step, then schedule synchronously - when synchronous mode could schedule
        otherwise: a waiting request could be admitted (a prefill comes first; while max_num_seqs sequences run and
        none surely ends, only a stop token could make room, and its request is admitted a step later), or the
        blocks run short (it might preempt)."""
        if any(in_prefill(seq) for seq in self.running):
            return None
        seqs, ending = [], []
        for seq in self.running:
            (ending if reaches_length_limit(seq, max_model_len) else seqs).append(seq)
        if self.waiting and (ending or len(self.running) < self.max_num_seqs):
            return None
        needed = sum(seq.num_blocks_for(len(seq)) - len(seq.block_table) for seq in seqs)
        if not seqs or needed > self.block_manager.num_free_blocks + sum(len(e.block_table) for e in ending):
            return None
        for seq in ending:
            self.block_manager.deallocate(seq)
        for seq in seqs:
            self.block_manager.allocate(seq, len(seq))
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
            reason = stop_reason(seq, token, eos_ids, max_model_len)
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
