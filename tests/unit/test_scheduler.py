"""Scheduler: chunked prefill under the token budget, admission order and limits, decode steps, preemption when
KV blocks run short, and retiring finished sequences."""
from __future__ import annotations

from sparsekv.engine.block_manager import BlockManager
from sparsekv.engine.scheduler import ScheduledBatch, Scheduler
from sparsekv.engine.sequence import Sequence, SequenceStatus
from sparsekv.sampling_params import SamplingParams

BLOCK = 4
EOS = 2
MAX_LEN = 1024


def make(num_blocks: int = 16, max_num_seqs: int = 4, budget: int = 64, alignment: int = 1) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=num_blocks, block_size=BLOCK), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, chunk_alignment=alignment)


def seq(num_tokens: int, max_tokens: int = 8) -> Sequence:
    return Sequence([5] * num_tokens, SamplingParams(max_tokens=max_tokens), block_size=BLOCK)


def run_step(scheduler: Scheduler, token: int = 7) -> tuple[ScheduledBatch, list[Sequence]]:
    """One engine step: schedule, then sample `token` for every sequence whose KV is complete after it."""
    batch = scheduler.schedule()
    sampled = {s.seq_id: token for s, n in zip(batch.seqs, batch.num_new_tokens)
               if s.num_computed_tokens + n == len(s)}
    return batch, scheduler.postprocess(batch, sampled, {EOS}, MAX_LEN)


def test_prefill_comes_before_decode_and_admits_in_arrival_order():
    scheduler = make()
    a, b = seq(6), seq(3)
    scheduler.add(a), scheduler.add(b)
    batch, _ = run_step(scheduler)
    assert batch.is_prefill
    assert batch.seqs == [a, b] and batch.num_new_tokens == [6, 3]
    assert a.status == b.status == SequenceStatus.RUNNING
    batch, _ = run_step(scheduler)
    assert not batch.is_prefill
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 1]


def test_a_long_prompt_is_chunked_under_the_token_budget():
    scheduler = make(budget=4)
    s = seq(10)
    scheduler.add(s)
    chunks = []
    while not s.completion_token_ids:
        batch, _ = run_step(scheduler)
        assert batch.is_prefill
        chunks.append(batch.num_new_tokens[0])
    assert chunks == [4, 4, 2]
    assert s.num_computed_tokens == 10 and len(s) == 11


def test_unfinished_chunks_end_on_the_alignment_and_a_later_prompt_shares_the_budget():
    scheduler = make(budget=10, alignment=4)
    a, b = seq(12), seq(3)
    scheduler.add(a), scheduler.add(b)
    batch, _ = run_step(scheduler)
    assert batch.seqs == [a] and batch.num_new_tokens == [8]  # 10 rounded down to a block boundary
    batch, _ = run_step(scheduler)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [4, 3]  # the unfinished prefill goes first


def test_admission_stops_at_max_num_seqs():
    scheduler = make(max_num_seqs=2)
    seqs = [seq(2) for _ in range(3)]
    for s in seqs:
        scheduler.add(s)
    batch, _ = run_step(scheduler)
    assert batch.seqs == seqs[:2]
    assert list(scheduler.waiting) == seqs[2:]


def test_a_prompt_that_does_not_fit_the_free_blocks_waits():
    scheduler = make(num_blocks=3)
    a, b = seq(8), seq(8)  # two blocks each
    scheduler.add(a), scheduler.add(b)
    batch, _ = run_step(scheduler)
    assert batch.seqs == [a]
    assert list(scheduler.waiting) == [b] and b.block_table == []


def test_decode_grows_the_block_table_at_a_block_boundary():
    scheduler = make()
    s = seq(4)
    scheduler.add(s)
    run_step(scheduler)  # prefill: 4 tokens in one block, 5th token sampled
    assert s.block_table == [0]
    run_step(scheduler)  # decode writes the 5th token's KV
    assert len(s.block_table) == 2


def test_decode_preempts_the_newest_sequence_when_blocks_run_short():
    scheduler = make(num_blocks=2)
    a, b = seq(4), seq(4)
    scheduler.add(a), scheduler.add(b)
    run_step(scheduler)  # both prefilled, one block each, the pool is full
    assert scheduler.block_manager.num_free_blocks == 0
    batch, _ = run_step(scheduler)  # a needs a second block: b goes back to waiting
    assert batch.seqs == [a]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(scheduler.waiting) == [b] and list(scheduler.running) == [a]


def test_a_preempted_sequence_is_recomputed_with_its_generated_tokens():
    scheduler = make(num_blocks=2)
    a, b = seq(4, max_tokens=2), seq(4)
    scheduler.add(a), scheduler.add(b)
    run_step(scheduler)
    run_step(scheduler)  # b preempted, a decodes its second token and finishes on max_tokens
    assert a.is_finished and a.block_table == []
    batch, _ = run_step(scheduler)
    assert batch.is_prefill and batch.seqs == [b]
    assert batch.num_new_tokens == [5]  # the prompt and the token generated before preemption


def test_the_only_running_sequence_is_preempted_when_it_cannot_grow():
    scheduler = make(num_blocks=1)
    s = seq(4)
    scheduler.add(s)
    run_step(scheduler)
    batch, _ = run_step(scheduler)
    assert batch.seqs == [] and list(scheduler.waiting) == [s]


def test_finished_sequences_leave_and_free_their_blocks():
    scheduler = make()
    stop, go = seq(3), seq(3)
    scheduler.add(stop), scheduler.add(go)
    batch = scheduler.schedule()
    finished = scheduler.postprocess(batch, {stop.seq_id: EOS, go.seq_id: 7}, {EOS}, MAX_LEN)
    assert finished == [stop]
    assert stop.is_finished and stop.finish_reason == "stop" and stop.block_table == []
    assert list(scheduler.running) == [go]
    assert scheduler.has_unfinished()


def test_max_tokens_ends_a_sequence_with_reason_length():
    scheduler = make()
    s = seq(3, max_tokens=2)
    scheduler.add(s)
    run_step(scheduler)
    _, finished = run_step(scheduler)
    assert finished == [s] and s.finish_reason == "length" and s.completion_token_ids == [7, 7]
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 16
