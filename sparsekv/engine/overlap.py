"""Overlapped ("async") decode (scheduler.async_decode), as vLLM's async scheduling: the host schedules and launches
decode step N+1 while the device still runs step N, and only then waits for step N's tokens.

Why: a GPU-resident batch-1 decode step of Qwen3-4B at 4K context is ~4.3 ms of kernels, but the host spends ~0.9 ms
between steps (scheduling, prepare_decode and its pinned copies, the CUDA-graph launch, lm_head and sampling, the
.tolist() sync, postprocess). Synchronously the device idles for all of it; overlapped, that host work runs while
the device computes the previous step.

How a step goes:
- Launch: each sequence of the step gets a placeholder token (PENDING_TOKEN) and its computed count advances, so the
  scheduler, the block manager and prepare_decode see the lengths the step leaves behind. Step N+1 is scheduled and
  its blocks allocated before its launch, as synchronous mode would after step N (Scheduler.schedule_decode_ahead).
- Step N+1's input ids are step N's sampled tokens, copied (gathered) on the device into its inputs; positions, slot
  mapping, context lengths and block tables are known on the host one step ahead.
- Step N's tokens go to pinned host memory by a copy queued right after its sampling, with an event: the host waits
  for step N alone, not for step N+1 queued behind it (a .tolist() would wait for both).
- Resolve: step N's tokens replace the placeholders and the stop conditions are checked. A sequence that a token
  stops (eos, stop_token_ids) finishes there; its row of step N+1 is discarded and its blocks go back at once (step
  N+1 still writes them, but whatever reuses them is queued after it on the same stream). max_tokens and
  max_model_len are known ahead: such a sequence is left out of step N+1 altogether.
- The engine waits for the in-flight step ("drains") before anything it cannot overlap: a prefill (a request that
  arrived or was preempted and that could be admitted), a step whose blocks may run short (synchronous mode might
  preempt), an abort. While max_num_seqs sequences run and none surely ends, waiting requests do not stop the
  overlap: only a stop token could free a slot, and then its request is admitted one step later than synchronous
  mode would.
- Seeded sampling draws once per sequence and step from the sequence's own generator, as synchronous decode does.
  Each sequence computes exactly what it computes synchronously; only around a stop token do batches differ (a
  discarded row rides along for one step, an admission comes a step later), which on a GPU can move other rows'
  logits by rounding.

Timing: a step's seconds run from the previous step's completion (or its own launch, if later) to its completion
as the host sees it: in steady state the interval between consecutive completions, the real throughput.

offload=cpu decodes synchronously (KVStore.overlapped_decode_safe): its steps are not plain stream-ordered kernels
on paged blocks. Copies to and from host blocks run on the OffloadEngine's own streams, ordered by events rather
than by the compute stream, so a host block freed under an in-flight step is not safely reusable; the store keeps
host-side per-step state (decode rows, blocks that fill, KV layouts that pick a captured graph or an eager step);
block-selecting policies (Quest, XAttention) read scores on the host mid-step, which would wait for step N inside
step N+1's launch anyway; and an offloaded step is PCIe-bound (tens to hundreds of ms at long context), so ~1 ms of
host time is a small share of it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparsekv.engine.model_runner import ModelRunner
from sparsekv.engine.scheduler import ScheduledBatch, Scheduler, stop_reason
from sparsekv.engine.sequence import Sequence

PENDING_TOKEN = -1  # a sampled token not read back yet (an embedding lookup of it fails loudly)


@dataclass
class InFlightStep:
    seqs: list[Sequence]  # the batch, one row each
    token_index: list[int]  # where each row's token goes in its sequence's token_ids (its placeholder)
    tokens: torch.Tensor  # [B] int64 on the device: the sampled tokens, the next step's input ids
    host_tokens: torch.Tensor  # [B] int64 on the host (pinned on CUDA), valid once `ready` completed
    ready: torch.cuda.Event | None  # recorded after the device-to-host copy; None off CUDA
    launched_at: float  # time.perf_counter() when its launch began


@dataclass
class ResolvedStep:
    finished: list[Sequence]
    num_tokens: int  # tokens kept (rows of sequences that had not finished)
    seconds: float  # since the previous completion, or since its launch if later


class OverlappedDecoder:
    """Launches decode steps without waiting for them and resolves them one step later (see the module doc)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, eos_ids: set[int], max_seq_len: int,
                 device: torch.device):
        self.runner, self.scheduler, self.eos_ids = runner, scheduler, eos_ids
        self.max_seq_len, self.device = max_seq_len, device
        self.in_flight: InFlightStep | None = None
        self.last_completion = 0.0  # time.perf_counter() when the host last saw a step complete
        self.overlapped_steps = 0  # steps launched while the previous one was in flight
        self.discarded_rows = 0  # rows computed for sequences that a token of the step before had stopped

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def launch(self, batch: ScheduledBatch) -> InFlightStep | None:
        """Launch a decode step of `batch` without waiting; it becomes the in-flight step. Returns the step that was
        in flight before (its tokens are this one's input ids), for the caller to resolve next; None if none was.
        The batch's sequences are those of that step (any running ones when none was in flight)."""
        if batch.is_prefill:
            raise ValueError("overlapped decode launches decode steps only: run prefill steps synchronously")
        start = time.perf_counter()
        previous = self.in_flight
        input_ids = self._input_ids(batch.seqs, previous) if previous is not None else None
        seqs, tokens = self.runner.execute(batch, input_ids)  # tokens [B] int64 on the device
        if len(seqs) != len(batch.seqs):
            raise RuntimeError("a decode step sampled fewer sequences than it ran: a sequence was still in prefill")
        if self.device.type == "cuda":
            host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host_tokens.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host_tokens, ready = tokens, None
        index = []
        for seq in seqs:
            seq.num_computed_tokens += 1  # the step stores the KV of the newest token
            index.append(len(seq.token_ids))
            seq.append_token(PENDING_TOKEN)
        self.overlapped_steps += previous is not None
        self.in_flight = InFlightStep(seqs, index, tokens, host_tokens, ready, start)
        return previous

    def _input_ids(self, seqs: list[Sequence], previous: InFlightStep) -> torch.Tensor:
        """[B] int64 on the device: each sequence's token sampled by the previous step."""
        rows = {seq.seq_id: row for row, seq in enumerate(previous.seqs)}
        missing = [seq.seq_id for seq in seqs if seq.seq_id not in rows]
        if missing:
            raise RuntimeError(f"sequences {missing} have no token in the in-flight step: drain before scheduling them")
        index = [rows[seq.seq_id] for seq in seqs]
        if index == list(range(len(previous.seqs))):
            return previous.tokens
        index_t = torch.tensor(index, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return previous.tokens.index_select(0, index_t.to(self.device, non_blocking=True))

    def take(self) -> InFlightStep:
        step, self.in_flight = self.in_flight, None
        if step is None:
            raise RuntimeError("no decode step is in flight")
        return step

    def resolve(self, step: InFlightStep) -> ResolvedStep:
        """Wait for `step`, put its tokens in place of the placeholders, finish the sequences that stop."""
        if step.ready is not None:
            step.ready.synchronize()
        done = time.perf_counter()
        seconds = done - max(self.last_completion, step.launched_at)
        self.last_completion = done
        finished, kept = [], 0
        for seq, index, token in zip(step.seqs, step.token_index, step.host_tokens.tolist()):
            if seq.is_finished:  # stopped by the previous step's token: the row is discarded
                self.discarded_rows += 1
                continue
            seq.token_ids[index] = token
            kept += 1
            reason = stop_reason(seq, token, self.eos_ids, self.max_seq_len, num_tokens=index + 1)
            if reason is not None:
                del seq.token_ids[index + 1:]  # the placeholder of the step launched after this one
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        return ResolvedStep(finished, kept, seconds)

    def drop_if_discarded(self) -> bool:
        """Forget the in-flight step without waiting when every one of its rows is discarded (all its sequences
        finished): nothing needs its tokens, and the device finishes it before anything queued later."""
        if self.in_flight is not None and all(seq.is_finished for seq in self.in_flight.seqs):
            self.discarded_rows += len(self.in_flight.seqs)
            self.in_flight = None
            return True
        return False
