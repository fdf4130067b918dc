"""offload=cpu gives the same greedy tokens as offload=none and HF, across layouts; capacity errors and aborts."""
from __future__ import annotations

import pytest

from sparsekv import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompt

CPU = ["device=cpu", "dtype=float32"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# prompts spanning many blocks, with partial last blocks, one shorter than a block
PROMPTS = [random_prompt(n, seed=n) for n in (75, 33, 9, 48)]


def offload(*extra: str) -> list[str]:
    return CPU + ["offload=cpu", "offload.host_pool_gib=0.05", *extra]


@pytest.fixture(scope="module")
def resident_tokens(qwen3_ckpt) -> list[list[int]]:
    llm = LLM(str(qwen3_ckpt), overrides=CPU + ["offload.block_size=16"])
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("layout", [
    ["offload.block_size=16", "offload.num_gpu_blocks=2", "offload.prefill_chunk_size=16"],
    ["offload.block_size=16", "offload.num_gpu_blocks=3", "offload.prefill_chunk_size=48"],
    ["offload.block_size=32", "offload.num_gpu_blocks=4", "offload.prefill_chunk_size=32"],
    ["offload.block_size=16", "offload.num_gpu_blocks=1", "offload.prefill_mode=layerwise"],
])
def test_offloaded_batch_equals_resident(qwen3_ckpt, resident_tokens, layout):
    llm = LLM(str(qwen3_ckpt), overrides=offload(*layout))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == resident_tokens
    stats = llm.engine.kv_store.transfer_stats
    assert stats["h2d_blocks"] > 0 and stats["d2h_blocks"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [
    ["offload.block_size=16", "offload.num_gpu_blocks=2", "offload.prefill_chunk_size=16"],
    ["offload.block_size=16", "offload.num_gpu_blocks=4", "offload.prefill_chunk_size=48"],
])
def test_gpu_offloaded_batch_equals_resident(qwen3_ckpt, layout, monkeypatch):
    """On CUDA the ring loads and the offloads run on their own copy streams, ordered by events alone: with the same
    reference attention on both sides (float32), offloaded greedy tokens equal resident ones exactly, while blocks
    fill and leave during decode. A missing or skipped wait would let a load read a block not yet offloaded."""
    monkeypatch.setenv("SPARSEKV_ATTN_BACKEND", "torch")
    cuda = ["device=cuda", "dtype=float32", "graph=eager"]
    resident = LLM(str(qwen3_ckpt), overrides=cuda + ["offload.block_size=16"]).generate(PROMPTS, GREEDY)
    llm = LLM(str(qwen3_ckpt), overrides=cuda + ["offload=cpu", "offload.host_pool_gib=0.05", *layout])
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in resident]
    prompt_blocks = sum(-(-len(p) // 16) for p in PROMPTS) * llm.engine.spec.num_hidden_layers
    assert llm.engine.kv_store.transfer_stats["d2h_blocks"] > prompt_blocks  # blocks filled in decode left too


def test_offloaded_equals_hf(llama_ckpt):
    prompt = random_prompt(70, seed=11)
    expected, _ = hf_greedy(llama_ckpt, prompt, 24)
    llm = LLM(str(llama_ckpt), overrides=offload("offload.block_size=16", "offload.num_gpu_blocks=2",
                                                   "offload.prefill_chunk_size=32"))
    assert llm.generate([prompt], GREEDY)[0].token_ids == expected


def test_decode_loads_every_full_block_once_per_layer(qwen3_ckpt):
    llm = LLM(str(qwen3_ckpt), overrides=offload("offload.block_size=16", "offload.prefill_chunk_size=64"))
    prompt = random_prompt(64, seed=2)  # 4 full blocks, one prefill chunk: no prefill loads
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    before = dict(llm.engine.kv_store.transfer_stats)
    assert before["h2d_blocks"] == 0 and before["d2h_blocks"] == 4 * 3  # 4 blocks x 3 layers offloaded
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    # second request: its prefill loads nothing; its one decode step loads the 4 full blocks of each layer
    assert llm.engine.kv_store.transfer_stats["h2d_blocks"] - before["h2d_blocks"] == 4 * 3


def test_prompt_larger_than_host_pool_fails_before_compute(qwen3_ckpt, monkeypatch):
    llm = LLM(str(qwen3_ckpt), overrides=CPU + ["offload=cpu", "offload.block_size=16",
                                                 "offload.host_pool_gib=0.0001"])
    monkeypatch.setattr(llm.engine.runner, "run", lambda batch: pytest.fail("computed before the error"))
    with pytest.raises(ValueError, match=r"needs \d+\.\d+ [MG]iB of KV cache but only \d+\.\d+ [MG]iB"):
        llm.generate([random_prompt(1500)], GREEDY)
    assert not llm.engine.scheduler.has_unfinished()


def test_abort_returns_all_blocks(qwen3_ckpt):
    llm = LLM(str(qwen3_ckpt), overrides=offload("offload.block_size=16"))
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    seq = engine.add_request(random_prompt(50), GREEDY)
    engine.step()  # prefill: blocks allocated
    assert engine.block_manager.num_free_blocks < free_before
    engine.abort(seq)
    assert engine.block_manager.num_free_blocks == free_before
    assert not engine.scheduler.has_unfinished() and seq.finish_reason == "abort"
    assert not engine.kv_store.decode_rows


@pytest.mark.parametrize("bad, message", [
    (["offload.num_gpu_blocks=0"], "num_gpu_blocks=0"),
    (["offload.prefill_chunk_size=24"], "prefill_chunk_size=24 must be a positive multiple"),
    (["offload.block_size=0"], "block_size=0"),
])
def test_bad_layout_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny", overrides=CPU + ["offload=cpu", "offload.block_size=16", *bad])


@pytest.mark.parametrize("store", ["resident", "offloaded", "offloaded-graphs"])
def test_preemption_under_block_pressure_keeps_greedy_tokens(qwen3_ckpt, resident_tokens, store):
    """Too few blocks for every sequence to grow: the newest is preempted, recomputed later, same tokens (also with
    the offloaded decode steps captured per KV layout, emulated: rows and layouts change under preemption)."""
    llm = LLM(str(qwen3_ckpt), overrides=CPU + ["offload.block_size=16"])
    block_bytes = llm.engine.kv_store.bytes_per_block
    blocks = 9  # the longest prompt needs 5 full-length blocks (75 + 24 tokens -> 7); all four together need 17
    layout = (["offload.num_kv_blocks=%d" % blocks] if store == "resident" else
              ["offload=cpu", "offload.host_pool_gib=%.12f" % ((blocks + 0.5) * block_bytes / 2**30)])
    llm = LLM(str(qwen3_ckpt), overrides=CPU + ["offload.block_size=16", *layout])
    if store == "offloaded-graphs":
        from sparsekv.graphs.cuda_graph import attach_graph_runner

        attach_graph_runner(llm.engine, "cudagraph", llm.config.graph, emulate=True)
    assert llm.engine.kv_store.num_blocks == blocks
    preempted = []
    original = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), original(seq))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == resident_tokens
    assert preempted, "the pool was meant to be too small for all sequences at once"
    if store == "offloaded-graphs":
        assert llm.engine.runner.graph_runner.replayed_steps > 0


def test_a_sequence_that_fills_the_pool_stops_with_length(qwen3_ckpt):
    """Growing past every block of the pool ends that sequence ("length"), not the whole batch."""
    llm = LLM(str(qwen3_ckpt), overrides=CPU + ["offload.block_size=16", "offload.num_kv_blocks=4"])
    long, short = llm.generate([random_prompt(40, seed=1), random_prompt(10, seed=2)],
                               SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    assert long.finish_reason == "length" and len(long.prompt_token_ids) + len(long.token_ids) == 4 * 16
    assert short.finish_reason == "length" and len(short.token_ids) == 64 - 10
