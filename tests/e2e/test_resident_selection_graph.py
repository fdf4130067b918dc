"""offload=none with Quest: the whole decode step, its batched device-side selection included, captured in one CUDA
graph per batch size (graph.mode=auto resolves to cudagraph). CPU tests replay emulated graphs; the GPU tests
(marked gpu) capture real ones. Tokens equal the eager step's, the per-sequence selection path's and offload=cpu's,
and the policy's decode hooks see the same blocks."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM
from sparsekv.graphs.cuda_graph import CudaGraphRunner
from sparsekv.kvcache.paged import PagedKVStore
from tests.conftest import random_prompt
from tests.e2e.test_cuda_graph import CPU, DECODE_STEPS, NONE, OFFLOAD, ONE, emulated, gpu, policy_overrides, tokens
from tests.unit.test_paged_store import HostQuest

# 5, 2 and 8 full blocks of 16: with 3 kept, the first and last sequences select, the second keeps its blocks; a
# batch of 3 runs in the size-4 graph (one padding row)
MIXED = [random_prompt(n, seed=n) for n in (90, 40, 140)]


def per_sequence(llm: LLM) -> LLM:
    """The same engine choosing per sequence (select_blocks), as policies without paged_device_selection do."""
    llm.engine.kv_store.selection.batched = False
    return llm


def record_decode_hooks(llm: LLM) -> list:
    policy, calls = llm.engine.kv_store.selection.policy, []
    hook = policy.on_decode_offload

    def spy(block_id, layer, keys, n):
        calls.append((block_id, layer, n, keys.float().sum().item()))
        hook(block_id, layer, keys, n)

    policy.on_decode_offload = spy
    return calls


def test_emulated_resident_quest_graph_equals_eager_and_the_per_sequence_path(qwen3_ckpt):
    quest = policy_overrides("quest")
    eager = LLM(str(qwen3_ckpt), overrides=CPU + NONE + quest + ["graph=eager"])
    want = (tokens(eager, MIXED), tokens(eager, ONE))
    legacy = per_sequence(LLM(str(qwen3_ckpt), overrides=CPU + NONE + quest + ["graph=eager"]))
    legacy_hooks = record_decode_hooks(legacy)
    assert (tokens(legacy, MIXED), tokens(legacy, ONE)) == want
    llm = emulated(qwen3_ckpt, NONE, "cudagraph", *quest)
    runner = llm.engine.runner.graph_runner
    assert isinstance(runner, CudaGraphRunner) and llm.engine.kv_store.selection.batched
    hooks = record_decode_hooks(llm)
    assert tokens(llm, MIXED) == want[0], "batch of 3 (padded to 4)"
    assert tokens(llm, ONE) == want[1], "batch of 1"
    assert runner.replayed_steps == 2 * DECODE_STEPS and runner.eager_steps == 0
    assert [h[:3] for h in hooks] == [h[:3] for h in legacy_hooks] and len(hooks) > 0  # fed after the replays
    assert [h[3] for h in hooks] == pytest.approx([h[3] for h in legacy_hooks], rel=1e-4)
    dense = LLM(str(qwen3_ckpt), overrides=CPU + NONE + ["graph=eager"])
    assert tokens(dense, MIXED) != want[0]  # the selection matters


# ---------------------------------------------------------------- GPU: real graphs, exact tokens
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_resident_quest_cudagraph_tokens_equal_eager(qwen3_ckpt, dtype):
    quest = policy_overrides("quest")
    overrides = ["device=cuda", f"dtype={dtype}", *NONE, *quest]
    eager = LLM(str(qwen3_ckpt), overrides=overrides + ["graph=eager"])
    want = (tokens(eager, MIXED), tokens(eager, ONE))
    if dtype == "float32":  # the per-sequence path and offload=cpu choose the same blocks
        legacy = per_sequence(LLM(str(qwen3_ckpt), overrides=overrides + ["graph=segmented"]))
        assert (tokens(legacy, MIXED), tokens(legacy, ONE)) == want, "per-sequence selection"
        del legacy
        offloaded = LLM(str(qwen3_ckpt), overrides=["device=cuda", f"dtype={dtype}", *OFFLOAD, *quest])
        assert (tokens(offloaded, MIXED), tokens(offloaded, ONE)) == want, "offload=cpu"
        del offloaded
    del eager
    llm = LLM(str(qwen3_ckpt), overrides=overrides)  # graph=auto
    stats, runner = llm.engine.graph_stats, llm.engine.runner.graph_runner
    assert stats["mode"] == "cudagraph" and isinstance(runner, CudaGraphRunner)
    got = (tokens(llm, MIXED), tokens(llm, ONE))
    assert got[0] == want[0], "batch of 3 (padded to 4)"
    assert got[1] == want[1], "batch of 1"
    assert runner.replayed_steps == 2 * DECODE_STEPS and runner.eager_steps == 0
    assert stats["batch_sizes"] == [1, 2, 4] and stats["graph_pool_bytes"] > 0


@gpu
def test_gpu_resident_quest_long_context_graph_equals_eager(qwen3_ckpt):
    """Contexts of thousands of tokens under a long max_model_len (a wide static block table): the captured
    selection over every column of the table chooses what the eager step chooses."""
    quest = ["policy=quest", "policy.token_budget=256", "policy.dense_layers=1"]
    prompts = [random_prompt(n, seed=n) for n in (700, 1500, 3000)]
    overrides = ["device=cuda", "dtype=bfloat16", *NONE, *quest, "scheduler.max_model_len=65536",
                 "offload.num_kv_blocks=1024"]
    from sparsekv import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eager = LLM(str(qwen3_ckpt), overrides=overrides + ["graph=eager"])
    want = [o.token_ids for o in eager.generate(prompts, params)]
    del eager
    torch.cuda.empty_cache()
    llm = LLM(str(qwen3_ckpt), overrides=overrides)
    assert llm.engine.graph_stats["mode"] == "cudagraph"
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_overlapped_decode_with_the_batched_selection(qwen3_ckpt):
    """The batched choice and the decode hooks are stream-ordered kernels: overlapped decode (scheduler.async_decode)
    stays on and gives the synchronous tokens, sequences leaving the batch at different steps; the per-sequence
    path decodes synchronously."""
    from sparsekv import SamplingParams

    quest = CPU + NONE + policy_overrides("quest") + ["graph=eager"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 20, 14)]
    sync = LLM(str(qwen3_ckpt), overrides=quest + ["scheduler.async_decode=false"])
    overlapped = LLM(str(qwen3_ckpt), overrides=quest)
    assert overlapped.engine.overlap is not None and sync.engine.overlap is None
    want = [o.token_ids for o in sync.generate(MIXED, params)]
    assert [o.token_ids for o in overlapped.generate(MIXED, params)] == want
    assert overlapped.engine.overlap.overlapped_steps > 0
    host = PagedKVStore(1, 4, 16, 2, 16, torch.float32, torch.device("cpu"), overlapped.engine.kv_store.prefill_policy,
                        decode_policy=HostQuest())
    assert overlapped.engine.kv_store.overlapped_decode_safe and not host.overlapped_decode_safe


@gpu
def test_gpu_resident_quest_eager_step_does_not_sync(qwen3_ckpt):
    """The batched selection path issues no host sync (an eager decode forward under sync debug mode "error")."""
    from sparsekv.engine.context import set_context
    from tests.e2e.test_cuda_graph import GREEDY

    llm = LLM(str(qwen3_ckpt), overrides=["device=cuda", "dtype=bfloat16", *NONE, *policy_overrides("quest"),
                                          "graph=eager"])
    engine = llm.engine
    seqs = [engine.add_request(p, GREEDY) for p in MIXED]
    engine.step()  # prefill
    engine.step()  # a first decode step: kernels compiled, Quest's tables grown
    engine.drain()  # that step was launched ahead (async decode): its tokens replace the pending ids first
    batch = engine.scheduler.schedule()
    assert not batch.is_prefill and len(batch.seqs) == 3
    with torch.inference_mode():
        ids, positions, context, _ = engine.runner.prepare_decode(batch)
        torch.cuda.synchronize()
        set_context(context)
        torch.cuda.set_sync_debug_mode("error")
        try:
            engine.model(ids, positions)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            set_context(None)
    for seq in seqs:
        engine.abort(seq)
