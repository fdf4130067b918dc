"""CUDA graphs for decode (graph.mode): mode resolution and refusals, capture sizes, and tokens that never change
with the mode. CPU tests run the graph runners in emulation (a "replay" re-runs the captured function on the same
static buffers), which checks the static-input plumbing, padding rows and the segment split without CUDA; the
GPU tests (marked gpu) capture real graphs and compare greedy tokens with eager decode exactly."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.config import GraphMode, OffloadMode
from sparsekv.graphs.cuda_graph import CudaGraphRunner, attach_graph_runner
from sparsekv.graphs.graph_config import capture_batch_sizes, resolve_graph_mode
from sparsekv.graphs.offload_graph import OffloadGraphRunner
from sparsekv.graphs.segmented_graph import SegmentedGraphRunner
from sparsekv.policies.full import FullAttentionPolicy
from tests.conftest import random_prompt

CPU = ["device=cpu", "dtype=float32"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ONE = [random_prompt(41, seed=5)]
THREE = [random_prompt(n, seed=n) for n in (75, 33, 9)]  # bucket 4: one padding row
NONE = ["offload.block_size=16"]
OFFLOAD = ["offload=cpu", "offload.host_pool_gib=0.05", "offload.block_size=16", "offload.num_gpu_blocks=2",
           "offload.prefill_chunk_size=32"]
DECODE_STEPS = GREEDY.max_tokens - 1  # the first token comes from the prefill step

gpu = pytest.mark.gpu
CUDA = torch.device("cuda")


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@dataclass
class TopHalfPolicy(FullAttentionPolicy):
    """A Quest-like block-selecting decode policy for tests: keeps the half of the host blocks whose mean key
    scores highest against the query (a host sync per selection), plus the newest block."""
    name: str = "test_top_half"
    requires_block_selection: ClassVar[bool] = True
    decode_graph_safe: ClassVar[bool] = False  # its choice is a host list made from the query

    def initialize(self, layout) -> None:
        self.means: dict[tuple[int, int], torch.Tensor] = {}

    def on_prefill_offload(self, block_id, layer, keys, n) -> None:
        self.means[(layer, block_id)] = keys[:n].float().mean(0)  # [KVH, D]

    def reset(self) -> None:
        self.means = {}

    def select_blocks(self, ctx):
        available_blocks = list(ctx.candidates)
        if ctx.is_prefill or len(available_blocks) <= 2:
            return None
        q = ctx.query.float()[0]  # [H, D]
        means = torch.stack([self.means[(ctx.layer, b)] for b in available_blocks])  # [n, KVH, D]
        group = q.shape[0] // means.shape[1]
        scores = (means.repeat_interleave(group, dim=1) * q).sum((1, 2)).tolist()  # host sync, like Quest
        keep = sorted(range(len(available_blocks) - 1), key=lambda i: -scores[i])[: len(available_blocks) // 2]
        return [available_blocks[i] for i in sorted(keep)] + available_blocks[-1:]


def use_decode_policy(llm: LLM, policy) -> None:
    """Swap the offload store's decode policy (before any request) for one this test defines."""
    store = llm.engine.kv_store
    store.decode_policy = policy
    store.policies = [store.prefill_policy, policy]
    policy.initialize(store.layout)


# ---------------------------------------------------------------- CPU: configuration
@pytest.mark.parametrize("max_batch, expected", [
    (1, [1]), (5, [1, 2, 4, 5]), (16, [1, 2, 4, 8, 16]), (40, [1, 2, 4, 8, 16, 32, 40]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]),
])
def test_capture_batch_sizes_ladder(max_batch, expected):
    assert capture_batch_sizes(max_batch) == expected


def test_explicit_batch_sizes_and_bad_values():
    assert capture_batch_sizes(16, [8, 1, 3, 3]) == [1, 3, 8]
    with pytest.raises(ValueError, match="graph.batch_sizes"):
        capture_batch_sizes(16, [0, 4])
    with pytest.raises(ValueError, match="graph.max_batch_size=0"):
        LLM("tiny", overrides=CPU + ["graph=eager", "graph.max_batch_size=0"])


@pytest.mark.parametrize("max_batch", [16, 20, 64, 100])
def test_paged_split_plan_is_the_same_for_a_batch_and_its_padded_bucket(max_batch):
    """Eager decode plans the paged kernel's splits from max_model_len and the batch rounded up to a power of
    two, which every default capture size keeps: a padded graph replay attends exactly like the eager step."""
    from sparsekv.kvcache.paged import PagedKVStore

    store = PagedKVStore(2, 4, 16, 8, 16, torch.float32, torch.device("cpu"), FullAttentionPolicy(), 40960)
    sizes = capture_batch_sizes(max_batch)
    for n in range(1, max_batch + 1):
        bucket = next(b for b in sizes if b >= n)
        assert store.decode_plan(n) == store.decode_plan(bucket), (n, bucket)
    assert store.decode_plan(1)[0] == 40960 and store.decode_plan(1)[1] > 1  # long max_model_len: split
    unplanned = PagedKVStore(2, 4, 16, 8, 16, torch.float32, torch.device("cpu"), FullAttentionPolicy())
    assert unplanned.decode_plan(3) is None  # without max_model_len: the kernel plans from the step's lengths


def test_auto_is_the_default_and_every_mode_composes():
    from sparsekv.llm import compose_config

    assert compose_config([]).graph.mode == GraphMode.auto
    for mode in GraphMode:
        assert compose_config([f"graph={mode.value}"]).graph.mode == mode
    with pytest.raises(ValueError, match="graph.mode"):
        compose_config(["graph.mode=fast"])


@pytest.mark.parametrize("offload", list(OffloadMode))
def test_resolution_on_cuda(offload, monkeypatch):
    monkeypatch.delenv("SPARSEKV_ATTN_BACKEND", raising=False)
    assert resolve_graph_mode("auto", offload, CUDA) == GraphMode.cudagraph
    assert resolve_graph_mode("cudagraph", offload, CUDA) == GraphMode.cudagraph
    assert resolve_graph_mode("segmented", offload, CUDA) == GraphMode.segmented
    assert resolve_graph_mode("eager", offload, CUDA) == GraphMode.eager
    # a decode policy whose block choice needs per-token host state cannot have its steps captured offloaded
    unsafe = TopHalfPolicy()
    if offload == OffloadMode.cpu:
        assert resolve_graph_mode("auto", offload, CUDA, unsafe) == GraphMode.segmented
        with pytest.raises(ValueError, match=r"policy=test_top_half sets decode_graph_safe=False.*graph=segmented"):
            resolve_graph_mode("cudagraph", offload, CUDA, unsafe)
    else:  # offload=none: a selecting decode policy builds each step's block table on the host
        assert resolve_graph_mode("auto", offload, CUDA, unsafe) == GraphMode.segmented
        with pytest.raises(ValueError, match=r"policy=test_top_half selects blocks per step on the host"):
            resolve_graph_mode("cudagraph", offload, CUDA, unsafe)


@pytest.mark.parametrize("offload", list(OffloadMode))
def test_cudagraph_needs_the_capturable_triton_kernels(offload, monkeypatch):
    monkeypatch.setenv("SPARSEKV_ATTN_BACKEND", "torch")  # the decode references sync with the host
    with pytest.raises(ValueError, match=r"graph.mode=cudagraph needs the Triton decode kernels"):
        resolve_graph_mode("cudagraph", offload, CUDA)
    assert resolve_graph_mode("auto", offload, CUDA) == GraphMode.segmented


def test_auto_is_eager_without_cuda():
    for offload in OffloadMode:
        assert resolve_graph_mode(GraphMode.auto, offload, torch.device("cpu")) == GraphMode.eager
    llm = LLM("tiny", overrides=CPU)  # graph=auto by default
    assert llm.engine.graph_stats["mode"] == "eager" and llm.engine.runner.graph_runner is None
    assert llm.engine.graph_stats["capture_seconds"] == 0.0 and llm.engine.graph_stats["graph_pool_bytes"] == 0


@pytest.mark.parametrize("mode", ["cudagraph", "segmented"])
@pytest.mark.parametrize("offload", [[], ["offload=cpu"]])
def test_graph_modes_are_refused_without_cuda_before_any_compute(mode, offload, monkeypatch):
    import sparsekv.factory

    monkeypatch.setattr(sparsekv.factory, "build_model", lambda *a, **k: pytest.fail("built before the error"))
    with pytest.raises(ValueError, match=rf"graph.mode={mode} needs a CUDA device.*graph=eager"):
        LLM("tiny", overrides=CPU + offload + [f"graph={mode}"])


# ---------------------------------------------------------------- CPU: the runners, emulated
@pytest.fixture(scope="module")
def eager_tokens(qwen3_ckpt):
    out = {}
    for name, store in (("none", NONE), ("cpu", OFFLOAD)):
        llm = LLM(str(qwen3_ckpt), overrides=CPU + store + ["graph=eager"])
        out[name] = (tokens(llm, ONE), tokens(llm, THREE))
    return out


def emulated(path, store: list[str], mode: str, *extra: str) -> LLM:
    llm = LLM(str(path), overrides=CPU + store + ["graph=eager", *extra])
    attach_graph_runner(llm.engine, mode, llm.config.graph, emulate=True)
    return llm


@pytest.mark.parametrize("store, mode", [("none", "cudagraph"), ("none", "segmented"), ("cpu", "segmented")])
def test_emulated_graphs_give_the_eager_tokens(qwen3_ckpt, eager_tokens, store, mode):
    llm = emulated(qwen3_ckpt, NONE if store == "none" else OFFLOAD, mode)
    runner = llm.engine.runner.graph_runner
    assert isinstance(runner, CudaGraphRunner if mode == "cudagraph" else SegmentedGraphRunner)
    assert runner.batch_sizes == [1, 2, 4, 8, 16]  # scheduler.max_num_seqs=16
    stats = llm.engine.graph_stats
    assert stats["capturable_batch_sizes"] == [1, 2, 4, 8, 16]
    assert stats["batch_sizes"] == [] and stats["num_graphs"] == 0  # captured when first due, not at build
    layers = llm.engine.spec.num_hidden_layers
    per_size = 1 if mode == "cudagraph" else 2 * layers + 2  # embed, pre/post per layer, final norm
    assert tokens(llm, ONE) == eager_tokens[store][0]
    assert stats["batch_sizes"] == [1] and stats["num_graphs"] == per_size and stats["capture_seconds"] > 0
    first_capture = stats["capture_seconds"]
    # three requests: every size the shrinking batch can reach is captured before generate's steps run
    assert tokens(llm, THREE) == eager_tokens[store][1]
    assert stats["batch_sizes"] == [1, 2, 4] and stats["num_graphs"] == 3 * per_size
    assert stats["capture_seconds"] > first_capture and stats["mode"] == mode
    assert runner.replayed_steps == 2 * DECODE_STEPS and runner.eager_steps == 0


def test_a_step_outside_generate_captures_its_size_when_due(qwen3_ckpt, eager_tokens):
    """Requests added straight to the engine: the first decode step of a size without a graph captures that size
    (only it) before it runs, and replays it."""
    llm = emulated(qwen3_ckpt, NONE, "cudagraph")
    engine, runner = llm.engine, llm.engine.runner.graph_runner
    seqs = [engine.add_request(p, GREEDY) for p in THREE]
    while engine.scheduler.has_unfinished():
        engine.step()
    assert engine.graph_stats["batch_sizes"] == [4]  # the batch of 3 ran in the size-4 graph; 1 and 2 not needed
    assert [s.completion_token_ids for s in seqs] == eager_tokens["none"][1]
    assert runner.replayed_steps == DECODE_STEPS and runner.eager_steps == 0


def test_cudagraph_padding_rows_write_only_the_scratch_slot(qwen3_ckpt, eager_tokens):
    llm = emulated(qwen3_ckpt, NONE, "cudagraph")
    store = llm.engine.kv_store
    scratch_block = store.scratch_slot // store.block_size
    assert scratch_block == store.num_blocks == llm.engine.block_manager.num_blocks  # never handed out
    store.k_cache[:, scratch_block].fill_(float("nan"))  # a read of it would poison the tokens
    assert tokens(llm, THREE) == eager_tokens["none"][1]  # batch of 3 runs in the size-4 graph
    assert not store.k_cache[:, scratch_block].isnan().all()  # the padding row wrote there


def test_segmented_padding_rows_never_read_another_sizes_positions_as_ids(qwen3_ckpt):
    """Buckets share one static input buffer (ids, then positions): a size-8 step puts its positions where a
    size-16 step's padding ids sit. Positions past the vocabulary there used to reach the embedding (a device
    assert on CUDA, an IndexError here); padding rows now embed id 0."""
    five = [random_prompt(150 + n, seed=n) for n in range(5)]  # bucket 8: positions >= 150 > vocab 128
    nine = [random_prompt(20 + n, seed=50 + n) for n in range(9)]  # bucket 16: rows 9-15 are padding
    eager = LLM(str(qwen3_ckpt), overrides=CPU + NONE + ["graph=eager"])
    expected = tokens(eager, nine), tokens(eager, five), tokens(eager, nine)
    llm = emulated(qwen3_ckpt, NONE, "segmented")  # sizes 1-16 captured by the first batch, then none again
    assert (tokens(llm, nine), tokens(llm, five), tokens(llm, nine)) == expected
    assert llm.engine.runner.graph_runner.replayed_steps == 3 * DECODE_STEPS


def test_larger_batches_fall_back_to_eager(qwen3_ckpt, eager_tokens):
    llm = emulated(qwen3_ckpt, OFFLOAD, "segmented", "graph.max_batch_size=2")
    runner = llm.engine.runner.graph_runner
    assert runner.batch_sizes == [1, 2]
    assert tokens(llm, THREE) == eager_tokens["cpu"][1]
    assert runner.replayed_steps == 0 and runner.eager_steps == DECODE_STEPS


def policy_overrides(policy: str) -> list[str]:
    """test_top_half is swapped in after the build (use_decode_policy); a registered policy (quest) is selected
    with settings that make it drop blocks of these short prompts. Skips when the policy is not registered."""
    from sparsekv.plugins import registry

    if policy == "test_top_half":
        return []
    policies = registry().policies
    if policy not in policies:
        pytest.skip(f"policy {policy} is not registered")
    fields = {f.name for f in dataclasses.fields(policies[policy])}
    wanted = {"topk_blocks": 3, "dense_layers": 0, "token_budget": "null"}
    return [f"policy={policy}"] + [f"policy.{k}={v}" for k, v in wanted.items() if k in fields]


def with_policy(llm: LLM, policy: str) -> LLM:
    if policy == "test_top_half":
        use_decode_policy(llm, TopHalfPolicy())
    return llm


SELECTING_PROMPTS = [random_prompt(n, seed=n) for n in (90, 70, 140)]  # 4-8 full host blocks: some are dropped


@pytest.mark.parametrize("policy", ["test_top_half", "quest"])
def test_emulated_segmented_with_a_block_selecting_policy(qwen3_ckpt, policy):
    extra = policy_overrides(policy)
    dense = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + ["graph=eager"])
    dense_tokens = tokens(dense, SELECTING_PROMPTS)
    expected = with_policy(LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + extra + ["graph=eager"]), policy)
    want = tokens(expected, SELECTING_PROMPTS)
    llm = with_policy(emulated(qwen3_ckpt, OFFLOAD, "segmented", *extra), policy)
    assert tokens(llm, SELECTING_PROMPTS) == want
    runner = llm.engine.runner.graph_runner
    assert runner.replayed_steps == DECODE_STEPS
    # each layer's attention is captured per KV layout too, unless the policy's choice needs the host
    assert (runner.stats["layout_captures"] >= 2) == (policy == "quest")
    loads = [x.engine.kv_store.transfer_stats["h2d_blocks"] for x in (dense, expected, llm)]
    assert loads[2] == loads[1] < loads[0], loads  # the same selection, fewer loads than dense
    assert want != dense_tokens or policy != "test_top_half"  # the selection matters for the tokens


# ---------------------------------------------------------------- offload=cpu, graph=cudagraph: per-layout graphs
@pytest.mark.parametrize("policy", ["full", "quest"])
def test_emulated_offload_cudagraph_gives_the_eager_tokens_and_loads(qwen3_ckpt, policy):
    """The whole offloaded step captured per layout and replayed: the eager tokens and h2d counts, for a batch whose
    sequences fill blocks at different steps (the layout changes, a filling step runs eagerly), and at batch 1."""
    extra = [] if policy == "full" else policy_overrides(policy)
    eager = LLM(str(qwen3_ckpt), overrides=CPU + OFFLOAD + extra + ["graph=eager"])
    want = (tokens(eager, SELECTING_PROMPTS), tokens(eager, ONE))
    llm = emulated(qwen3_ckpt, OFFLOAD, "cudagraph", *extra)
    runner = llm.engine.runner.graph_runner
    assert isinstance(runner, OffloadGraphRunner) and llm.engine.kv_store.static_decode_inputs is runner.decode_inputs
    assert tokens(llm, SELECTING_PROMPTS) == want[0]
    assert runner.replayed_steps + runner.eager_steps == DECODE_STEPS
    assert runner.replayed_steps >= DECODE_STEPS // 2 and runner.stats["layout_captures"] >= 2
    assert len(runner.layouts.graphs) <= runner.layouts.MAX_LAYOUTS
    assert tokens(llm, ONE) == want[1]
    assert llm.engine.kv_store.transfer_stats == eager.engine.kv_store.transfer_stats  # replays count their loads

    # a graph reads the device-side id lists it was captured with: once they are forgotten (a block filled, the
    # engine went idle, or too many lists), the same sequences and blocks make a new layout, never an old graph's
    engine = llm.engine
    seq = engine.add_request(ONE[0], GREEDY)
    engine.step()  # prefill
    engine.step()  # a decode step: the sequence has a decode row now
    store = engine.kv_store
    layout = store.decode_layout([seq])
    assert store.decode_layout([seq]) == layout
    store.engine.forget_device_ids()
    assert store.decode_layout([seq]) != layout
    engine.abort(seq)


def test_offload_cudagraph_falls_back_to_eager_when_a_capture_fails(qwen3_ckpt, eager_tokens, caplog):
    llm = emulated(qwen3_ckpt, OFFLOAD, "cudagraph")
    runner = llm.engine.runner.graph_runner

    def failing_capture(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner.capturer.capture = failing_capture
    with caplog.at_level("WARNING"):
        assert tokens(llm, ONE) == eager_tokens["cpu"][0]
    assert runner.layouts.disabled and runner.replayed_steps == 0 and runner.eager_steps == DECODE_STEPS
    assert "decode_graph_safe=False" in caplog.text


# ---------------------------------------------------------------- GPU: real graphs, exact tokens
@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("store, mode", [("none", "cudagraph"), ("cpu", "segmented"), ("none", "segmented")])
def test_gpu_graph_tokens_equal_eager(qwen3_ckpt, dtype, store, mode):
    overrides = ["device=cuda", f"dtype={dtype}", *(NONE if store == "none" else OFFLOAD)]
    eager = LLM(str(qwen3_ckpt), overrides=overrides + ["graph=eager"])
    want = (tokens(eager, ONE), tokens(eager, THREE))
    del eager
    llm = LLM(str(qwen3_ckpt), overrides=overrides + [f"graph={mode}"])
    stats = llm.engine.graph_stats
    assert stats["mode"] == mode and stats["capture_seconds"] > 0 and stats["graph_pool_bytes"] > 0
    got = (tokens(llm, ONE), tokens(llm, THREE))
    assert got[0] == want[0], "batch of 1"
    assert got[1] == want[1], "batch of 3 (padded to 4)"
    runner = llm.engine.runner.graph_runner
    assert runner.replayed_steps == 2 * DECODE_STEPS and runner.eager_steps == 0
    if store == "cpu":  # offloaded: each layer's attention was captured per KV layout too, and replayed
        assert not runner.layouts.disabled and stats["layout_captures"] >= 2


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["full", "quest"])
def test_gpu_offload_cudagraph_tokens_equal_eager(qwen3_ckpt, policy, dtype):
    """Real per-layout graphs over the offloaded store (copy-engine loads on a branch of the graph, Quest's gathers
    from pinned memory, copy streams and events around the replays): eager tokens and loads, batches whose blocks
    fill at different steps, and batch 1."""
    extra = [] if policy == "full" else policy_overrides(policy)
    overrides = ["device=cuda", f"dtype={dtype}", *OFFLOAD, *extra]
    eager = LLM(str(qwen3_ckpt), overrides=overrides + ["graph=eager"])
    want = (tokens(eager, SELECTING_PROMPTS), tokens(eager, ONE))
    loads = dict(eager.engine.kv_store.transfer_stats)
    del eager
    llm = LLM(str(qwen3_ckpt), overrides=overrides)  # graph=auto: cudagraph
    runner = llm.engine.runner.graph_runner
    assert isinstance(runner, OffloadGraphRunner)
    assert tokens(llm, SELECTING_PROMPTS) == want[0], "batch of 3"
    assert tokens(llm, ONE) == want[1], "batch of 1"
    assert not runner.layouts.disabled and runner.replayed_steps >= DECODE_STEPS
    assert llm.engine.kv_store.transfer_stats == loads


@gpu
def test_gpu_offload_cudagraph_memory_does_not_creep_with_layouts(qwen3_ckpt):
    """Every block that fills makes a new layout and a capture with a memory pool of its own: dozens per run here.
    The pools of dropped graphs go back to the device, so the memory the caching allocator holds after a second
    run is what it held after the first (each pool takes at least a 2 MiB segment: a leak would show)."""
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    llm = LLM(str(qwen3_ckpt), overrides=["device=cuda", "dtype=bfloat16", *OFFLOAD, "graph=cudagraph"])
    prompts = SELECTING_PROMPTS[:2]
    first = [o.token_ids for o in llm.generate(prompts, params)]
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    captures = llm.engine.graph_stats["layout_captures"]
    assert captures >= 10
    assert [o.token_ids for o in llm.generate(prompts, params)] == first
    assert llm.engine.graph_stats["layout_captures"] >= 2 * captures - 2
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() <= reserved + 4 * 2**20


@gpu
def test_gpu_cudagraph_long_contexts_equal_eager(qwen3_ckpt):
    """With a long max_model_len the captured split plan (from max_model_len) differs from the one the kernel's
    heuristic would pick from a step's lengths; the store plans eager steps the same way, so bf16 tokens of
    contexts of hundreds to thousands of tokens stay equal."""
    prompts = [random_prompt(n, seed=n) for n in (700, 1500, 1900)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    overrides = ["device=cuda", "dtype=bfloat16", *NONE, "scheduler.max_model_len=131072", "offload.num_kv_blocks=1024"]
    eager = LLM(str(qwen3_ckpt), overrides=overrides + ["graph=eager"])
    llm = LLM(str(qwen3_ckpt), overrides=overrides + ["graph=cudagraph"])
    for batch in (prompts[2:], prompts):
        want = [o.token_ids for o in eager.generate(batch, params)]
        assert [o.token_ids for o in llm.generate(batch, params)] == want, f"batch of {len(batch)}"


@gpu
@pytest.mark.parametrize("policy", ["test_top_half", "quest"])
def test_gpu_segmented_with_a_block_selecting_policy(qwen3_ckpt, policy):
    overrides = ["device=cuda", "dtype=bfloat16", *OFFLOAD, *policy_overrides(policy)]
    expected = with_policy(LLM(str(qwen3_ckpt), overrides=overrides + ["graph=eager"]), policy)
    want = tokens(expected, SELECTING_PROMPTS)
    llm = with_policy(LLM(str(qwen3_ckpt), overrides=overrides + ["graph=segmented"]), policy)
    assert tokens(llm, SELECTING_PROMPTS) == want
    assert llm.engine.runner.graph_runner.replayed_steps == DECODE_STEPS
    assert llm.engine.kv_store.transfer_stats["h2d_blocks"] == expected.engine.kv_store.transfer_stats["h2d_blocks"]


@gpu
@pytest.mark.parametrize("store, mode", [("none", "cudagraph"), ("cpu", "cudagraph")])
def test_gpu_auto_picks_the_mode_and_large_batches_fall_back(qwen3_ckpt, store, mode):
    overrides = ["device=cuda", "dtype=bfloat16", *(NONE if store == "none" else OFFLOAD)]
    eager = tokens(LLM(str(qwen3_ckpt), overrides=overrides + ["graph=eager"]), THREE)
    llm = LLM(str(qwen3_ckpt), overrides=overrides + ["graph.max_batch_size=2"])  # graph=auto
    assert llm.engine.graph_stats["mode"] == mode and llm.engine.runner.graph_runner.max_batch_size == 2
    assert tokens(llm, THREE) == eager
    runner = llm.engine.runner.graph_runner
    assert runner.eager_steps == DECODE_STEPS and runner.replayed_steps == 0


@gpu
def test_gpu_cudagraph_replay_does_not_sync(qwen3_ckpt):
    """A replay issues no host sync, and it computes what the eager forward computes for the same step."""
    from sparsekv.engine.context import set_context

    llm = LLM(str(qwen3_ckpt), overrides=["device=cuda", "dtype=float32", *NONE, "graph=cudagraph"])
    engine = llm.engine
    seqs = [engine.add_request(p, GREEDY) for p in THREE]
    engine.step()  # prefill of all three
    batch = engine.scheduler.schedule()
    assert not batch.is_prefill and len(batch.seqs) == 3
    runner = engine.runner.graph_runner
    with torch.inference_mode():
        ids, positions, context, _ = runner.prepare_decode(batch)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            hidden = runner.forward(ids, positions, context).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ids, positions, context, _ = engine.runner.prepare_decode(batch)
        set_context(context)
        try:
            eager = engine.model(ids, positions)
        finally:
            set_context(None)
    assert hidden.shape == eager.shape == (3, engine.spec.hidden_size)
    torch.testing.assert_close(hidden, eager, rtol=1e-4, atol=1e-4)
    for seq in seqs:
        engine.abort(seq)
