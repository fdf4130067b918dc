"""Overlapped ("async") decode (scheduler.async_decode, sparsekv/engine/overlap.py): step N+1 is launched before step
N's tokens are read, its input ids taken on the device from step N's samples. Every case runs the same requests with
async_decode on and off and demands the same tokens and finish reasons: batches with different max_tokens, eos and
stop tokens mid-batch (the next step's row of a stopped sequence is discarded), seeded sampling, preemption in a tiny
KV pool, a queue longer than max_num_seqs, requests added and aborted while a step is in flight, max_model_len, and
the CUDA-graph runners in emulation. The GPU tests (marked gpu) compare real CUDA graphs and check that launching a
step does not sync."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.graphs.cuda_graph import attach_graph_runner
from sparsekv.engine.overlap import PENDING_TOKEN
from tests.conftest import random_prompt

# the tiny built-in model with a widened init (greedy output does not collapse), 16-token blocks
TINY = ["device=cpu", "dtype=float32", "model.dummy_init_std=0.2", "offload.block_size=16"]
PROMPTS = [[5, 9, 77, 300, 12, 44], [256, 72, 101, 108, 108, 111], [17, 400, 33, 2, 90, 91, 92, 93, 7, 8, 9],
           [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]

gpu = pytest.mark.gpu


def build(async_decode: bool, *overrides: str, model: str = "tiny", base: list[str] = TINY) -> LLM:
    return LLM(model, overrides=[*base, f"scheduler.async_decode={str(async_decode).lower()}", *overrides])


def results(llm: LLM, prompts, params) -> list[tuple[list[int], str | None]]:
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def check_same(sync: LLM, overlapped: LLM, prompts, params, discards: bool = False, same_steps: bool = True
               ) -> list[tuple[list[int], str | None]]:
    """Both engines give the same tokens, finish reasons and (`same_steps`) step counts; the overlapped one really
    overlapped, and computed rows it then discarded only if a token stopped a sequence (`discards`: it must have)."""
    discarded = overlapped.engine.overlap.discarded_rows
    want = results(sync, prompts, params)
    got = results(overlapped, prompts, params)
    assert got == want
    assert sync.engine.overlap is None and overlapped.engine.overlap.overlapped_steps > 0
    a, b = sync.engine.stats, overlapped.engine.stats
    assert (b.decode_tokens, b.prompt_tokens) == (a.decode_tokens, a.prompt_tokens)
    assert (b.decode_steps == a.decode_steps) == same_steps
    assert len(b.step_seconds) == b.decode_steps and all(s > 0 for s in b.step_seconds)
    assert b.decode_seconds == pytest.approx(sum(b.step_seconds))
    assert not overlapped.engine.overlap.busy  # generate leaves no step in flight
    assert (overlapped.engine.overlap.discarded_rows > discarded) == discards
    for seq_tokens, _ in got:
        assert PENDING_TOKEN not in seq_tokens
    return want


@pytest.fixture(scope="module")
def free_running() -> list[list[int]]:
    """Greedy tokens of each prompt, eos ignored (synchronous engine)."""
    llm = build(False)
    return [o.token_ids for o in llm.generate(PROMPTS, greedy(20, ignore_eos=True))]


# ---------------------------------------------------------------- configuration
def test_async_decode_is_on_by_default_and_can_be_switched_off():
    from sparsekv.llm import compose_config

    assert compose_config([]).scheduler.async_decode is True
    assert build(True).engine.overlap is not None
    assert build(False).engine.overlap is None


def test_offloaded_decode_stays_synchronous():
    offload = ["offload=cpu", "offload.host_pool_gib=0.05", "offload.num_gpu_blocks=2", "offload.prefill_chunk_size=32"]
    llm = build(True, *offload)
    assert not llm.engine.kv_store.overlapped_decode_safe and llm.engine.overlap is None
    out = llm.generate(PROMPTS[:2], greedy(6, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]


# ---------------------------------------------------------------- same tokens as synchronous decode
def test_batch_with_different_max_tokens():
    params = [greedy(n, ignore_eos=True) for n in (3, 17, 1, 9)]
    want = check_same(build(False), build(True), PROMPTS, params)
    assert [len(t) for t, _ in want] == [3, 17, 1, 9] and {r for _, r in want} == {"length"}


def test_eos_in_the_middle_of_a_batch(free_running):
    """The model's eos is the 4th greedy token of prompt 0: it stops there (its next row is discarded) while the
    others run on, one of them with ignore_eos."""
    eos = free_running[0][3]
    first = free_running[0].index(eos)
    extra = f"model.eos_token_id=[{eos}]"
    sync, overlapped = build(False, extra), build(True, extra)
    assert eos in overlapped.engine.eos_ids
    params = [greedy(20), greedy(14, ignore_eos=True), greedy(12), greedy(16, ignore_eos=True)]
    want = check_same(sync, overlapped, PROMPTS, params, discards=True)
    assert want[0] == (free_running[0][:first + 1], "stop")
    assert want[1] == (free_running[1][:14], "length")


def test_stop_token_ids(free_running):
    stops = [free_running[0][2], free_running[2][5]]
    params = [greedy(20, ignore_eos=True, stop_token_ids=[stops[0]]), greedy(20, ignore_eos=True),
              greedy(20, ignore_eos=True, stop_token_ids=[stops[1]]), greedy(7, ignore_eos=True)]
    want = check_same(build(False), build(True), PROMPTS, params, discards=True)
    assert want[0] == (free_running[0][:free_running[0].index(stops[0]) + 1], "stop")
    assert want[2] == (free_running[2][:free_running[2].index(stops[1]) + 1], "stop")


def test_every_sequence_stops_on_a_token_at_once(free_running):
    """Batch of one stopping on a token: the step launched behind it is dropped unread, and the next request
    starts clean."""
    stop = free_running[1][4]
    params = greedy(20, ignore_eos=True, stop_token_ids=[stop])
    sync, overlapped = build(False), build(True)
    for prompts in ([PROMPTS[1]], PROMPTS[:2]):
        check_same(sync, overlapped, prompts, params, discards=True)


def test_seeded_sampling():
    """Each sequence draws once per step from its own generator in both modes: the same samples, including
    around a sequence that a sampled stop token ends early."""
    run = dict(temperature=1.0, ignore_eos=True)
    params = [SamplingParams(max_tokens=15, seed=1, **run), SamplingParams(max_tokens=11, seed=2, top_k=20, **run),
              greedy(13, ignore_eos=True), SamplingParams(max_tokens=16, seed=3, top_p=0.9, **run)]
    sync, overlapped = build(False), build(True)
    want = check_same(sync, overlapped, PROMPTS, params)
    stop = want[0][0][4]
    first = want[0][0].index(stop)
    params[0] = SamplingParams(max_tokens=15, seed=1, stop_token_ids=[stop], **run)
    stopped = check_same(sync, overlapped, PROMPTS, params, discards=True)
    assert stopped[0] == (want[0][0][:first + 1], "stop") and stopped[1:] == want[1:]


def count_preemptions(llm: LLM) -> list[int]:
    scheduler, count = llm.engine.scheduler, [0]
    preempt = scheduler.preempt

    def counting(seq):
        count[0] += 1
        preempt(seq)

    scheduler.preempt = counting
    return count


def test_preemption_in_a_tiny_kv_pool():
    """7 blocks of 16 tokens for four sequences growing to 40-60 tokens: some are preempted and recomputed. The
    overlapped engine drains before a step that might preempt, so it preempts exactly as the synchronous one."""
    sync, overlapped = build(False, "offload.num_kv_blocks=7"), build(True, "offload.num_kv_blocks=7")
    counts = count_preemptions(sync), count_preemptions(overlapped)
    params = [greedy(n, ignore_eos=True) for n in (40, 28, 33, 36)]
    want = check_same(sync, overlapped, PROMPTS, params)
    assert counts[0][0] > 0 and counts[1][0] == counts[0][0]
    assert [len(t) for t, _ in want] == [40, 28, 33, 36]


def test_max_model_len():
    params = [greedy(64, ignore_eos=True), greedy(8, ignore_eos=True), greedy(64), greedy(64, ignore_eos=True)]
    want = check_same(build(False, "scheduler.max_model_len=24"), build(True, "scheduler.max_model_len=24"),
                      PROMPTS, params)
    assert [(len(p) + len(t), r) for p, (t, r) in zip(PROMPTS, want)][0] == (24, "length")
    assert len(want[1][0]) == 8 and len(PROMPTS[3]) + len(want[3][0]) == 24


def test_queue_longer_than_max_num_seqs(free_running):
    """Two sequences run at a time, the others wait: steps overlap while both slots are taken and neither surely
    ends; a request is admitted where synchronous mode admits it (after a stop token, one step later)."""
    sync, overlapped = build(False, "scheduler.max_num_seqs=2"), build(True, "scheduler.max_num_seqs=2")
    prompts = PROMPTS + PROMPTS[:2]
    params = [greedy(n, ignore_eos=True) for n in (9, 14, 6, 11, 7, 5)]
    check_same(sync, overlapped, prompts, params)
    steps, total = overlapped.engine.overlap.overlapped_steps, overlapped.engine.stats.decode_steps
    assert steps >= total - 6, (steps, total)  # only the step after each admission (a prefill) does not overlap
    stop = free_running[1][3]
    params[1] = greedy(14, ignore_eos=True, stop_token_ids=[stop])
    # the next request's prefill comes one step after the stop: one more decode step for the other slot's sequence
    want = check_same(sync, overlapped, prompts, params, discards=True, same_steps=False)
    assert want[1] == (free_running[1][:free_running[1].index(stop) + 1], "stop")


def drive(llm: LLM) -> list[tuple[list[int], str | None]]:
    """Requests added and aborted between engine.step() calls, while a decode step is in flight."""
    engine = llm.engine
    seqs = [engine.add_request(PROMPTS[0], greedy(18, ignore_eos=True)),
            engine.add_request(PROMPTS[1], greedy(12, ignore_eos=True))]
    for _ in range(4):
        engine.step()
    if engine.overlap is not None:
        assert engine.overlap.busy
    seqs.append(engine.add_request(PROMPTS[2], greedy(10, ignore_eos=True)))  # arrives mid-decode: a prefill
    for _ in range(3):
        engine.step()
    seqs.append(engine.add_request(PROMPTS[3], greedy(9, ignore_eos=True)))
    engine.step()
    engine.step()
    engine.abort(seqs[1])  # in flight: the engine drains first
    while engine.scheduler.has_unfinished():
        engine.step()
    return [(s.completion_token_ids, s.finish_reason) for s in seqs]


def test_requests_added_and_aborted_while_decoding():
    sync, overlapped = build(False), build(True)
    want = drive(sync)
    assert drive(overlapped) == want
    assert want[1][1] == "abort" and 0 < len(want[1][0]) < 12
    assert [r for _, r in want] == ["length", "abort", "length", "length"]
    assert overlapped.engine.overlap.overlapped_steps > 0


def test_placeholders_until_the_tokens_are_read():
    engine = build(True).engine
    seq = engine.add_request(PROMPTS[0], greedy(6, ignore_eos=True))
    engine.step()  # prefill: the first token
    assert len(seq.completion_token_ids) == 1 and not engine.overlap.busy
    engine.step()  # decode step 1 launched, nothing read
    assert seq.completion_token_ids[1:] == [PENDING_TOKEN] and seq.num_computed_tokens == len(seq) - 1
    engine.step()  # step 2 launched behind step 1, step 1 read
    assert PENDING_TOKEN not in seq.completion_token_ids[:2] and seq.completion_token_ids[2:] == [PENDING_TOKEN]
    assert engine.overlap.overlapped_steps == 1 and engine.stats.decode_steps == 1
    while engine.scheduler.has_unfinished():
        engine.step()
    assert len(seq.completion_token_ids) == 6 and PENDING_TOKEN not in seq.token_ids


def test_schedule_ahead_leaves_what_it_cannot_overlap_to_the_synchronous_scheduler():
    engine = build(True, "offload.num_kv_blocks=3").engine
    scheduler = engine.scheduler
    seq = engine.add_request(PROMPTS[0], greedy(60, ignore_eos=True))
    engine.step()
    engine.step()  # a decode step in flight
    assert scheduler.schedule_decode_ahead(engine.max_seq_len) is not None  # fits: allocated before the launch
    other = engine.add_request(PROMPTS[1], greedy(4))
    assert scheduler.schedule_decode_ahead(engine.max_seq_len) is None  # a request waits: prefill first
    engine.abort(other)
    engine.abort(seq)
    assert engine.block_manager.num_free_blocks == 3 and not engine.overlap.busy


# ---------------------------------------------------------------- graph runners, emulated
@pytest.mark.parametrize("mode", ["cudagraph", "segmented"])
def test_emulated_graph_runners(free_running, mode):
    """The static input-id buffer is filled on the device from the previous step's samples; batches of 4 and 3
    (a padding row), an eos mid-batch, seeded sampling."""
    eos = free_running[0][3]
    extra = ["scheduler.max_model_len=128", f"model.eos_token_id=[{eos}]"]
    sync = build(False, "graph=eager", *extra)
    overlapped = build(True, "graph=eager", *extra)
    attach_graph_runner(overlapped.engine, mode, overlapped.config.graph, emulate=True)
    params = [greedy(20), greedy(14, ignore_eos=True), SamplingParams(temperature=1.0, max_tokens=12, seed=4),
              greedy(16, ignore_eos=True)]
    want = check_same(sync, overlapped, PROMPTS, params, discards=True)
    assert want[0][1] == "stop"
    runner = overlapped.engine.runner.graph_runner
    assert runner.replayed_steps == overlapped.engine.stats.decode_steps and runner.eager_steps == 0
    check_same(sync, overlapped, PROMPTS[1:], params[1:], discards=False)


# ---------------------------------------------------------------- GPU: real CUDA graphs
GPU_PROMPTS = [random_prompt(n, seed=n) for n in (75, 33, 9, 120)]


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["cudagraph", "eager"])
def test_gpu_async_decode_tokens_equal_sync(qwen3_ckpt, dtype, mode):
    base = ["device=cuda", f"dtype={dtype}", "offload.block_size=16", f"graph={mode}"]
    params = [greedy(30, ignore_eos=True), greedy(12, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True), greedy(19, ignore_eos=True)]
    sync = build(False, model=str(qwen3_ckpt), base=base)
    want = [results(sync, GPU_PROMPTS, params), results(sync, GPU_PROMPTS[:1], params[:1])]
    del sync
    overlapped = build(True, model=str(qwen3_ckpt), base=base)
    assert results(overlapped, GPU_PROMPTS, params) == want[0], "batch of 4"
    assert results(overlapped, GPU_PROMPTS[:1], params[:1]) == want[1], "batch of 1"
    assert overlapped.engine.overlap.overlapped_steps > 0
    runner = overlapped.engine.runner.graph_runner
    if mode == "cudagraph":
        assert runner.replayed_steps == overlapped.engine.stats.decode_steps


@gpu
def test_gpu_async_decode_stop_tokens_equal_sync(qwen3_ckpt):
    """Stop tokens mid-batch: the step after each stop carries the stopped row (discarded), so batch sizes differ
    from synchronous decode for one step; float32, where that moves the other rows' logits by rounding at most."""
    base = ["device=cuda", "dtype=float32", "offload.block_size=16", "graph=cudagraph"]
    sync = build(False, model=str(qwen3_ckpt), base=base)
    free = results(sync, GPU_PROMPTS, greedy(24, ignore_eos=True))
    params = [greedy(24, ignore_eos=True, stop_token_ids=[free[0][0][5]]), greedy(24, ignore_eos=True),
              greedy(24, ignore_eos=True, stop_token_ids=[free[2][0][9]]), greedy(24, ignore_eos=True)]
    want = results(sync, GPU_PROMPTS, params)
    del sync
    overlapped = build(True, model=str(qwen3_ckpt), base=base)
    assert results(overlapped, GPU_PROMPTS, params) == want
    assert want[0][1] == "stop"


@gpu
def test_gpu_overlapped_launch_does_not_sync(qwen3_ckpt):
    """Scheduling and launching step N+1 behind step N issues no host sync (the graph replay, lm_head, sampling and
    the copy of the tokens to the host are all queued); only reading step N's tokens waits."""
    base = ["device=cuda", "dtype=bfloat16", "offload.block_size=16", "graph=cudagraph"]
    llm = build(True, model=str(qwen3_ckpt), base=base)
    engine = llm.engine
    seqs = [engine.add_request(p, greedy(16, ignore_eos=True)) for p in GPU_PROMPTS[:3]]
    engine.step()  # prefill
    engine.step()  # decode step 1 in flight
    assert engine.overlap.busy
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = engine.scheduler.schedule_decode_ahead(engine.max_seq_len)
        previous = engine.overlap.launch(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine._resolve(previous)
    while engine.scheduler.has_unfinished():
        engine.step()
    assert all(len(s.completion_token_ids) == 16 for s in seqs)
