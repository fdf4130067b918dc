"""parallel.tensor_parallel_size=2 against 1 on the tiny float32 checkpoints: the same tokens. On CPU the two ranks
are this process and one worker process on gloo (started once, shared by every test here and in
tests/unit/test_parallel_layers.py); the GPU test runs the ranks on two GPUs over NCCL with CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, SamplingParams
from tests.conftest import random_prompt
from tests.policies.test_streaming_plugin import install_streaming_plugin, plugin_site_on_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [random_prompt(120, seed=0), random_prompt(70, seed=1)]  # one batch: 7 and 4 full 16-token blocks
OFFLOAD = {"none": ["offload=none", "offload.block_size=16"],
           "cpu": ["offload=cpu", "offload.block_size=16", "offload.num_gpu_blocks=4"]}
# every layer keeps 2 of the full blocks (sink + newest): a choice no rank's heads can change, so TP=2 must give
# TP=1's tokens (with blocks to choose, each rank chooses by its own heads and the tokens may differ: design-notes)
POLICY = {"full": [], "quest": ["policy=quest", "policy.token_budget=32", "policy.dense_layers=0"]}
SLOW = pytest.mark.slow


def build(ckpt, size: int, *overrides: str, device: str = "cpu") -> LLM:
    return LLM(str(ckpt), [f"device={device}", "dtype=float32", f"parallel.tensor_parallel_size={size}", *overrides])


def tokens(llm: LLM, params: SamplingParams = GREEDY, prompts=PROMPTS) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, params, progress=False)]


@pytest.fixture(scope="module")
def checkpoints(qwen3_ckpt, llama_ckpt):
    return {"qwen3": qwen3_ckpt, "llama": llama_ckpt}


@pytest.mark.parametrize("arch, offload, policy", [
    ("qwen3", "none", "full"),
    ("qwen3", "cpu", "full"),
    ("llama", "none", "full"),
    ("llama", "cpu", "full"),
    ("qwen3", "cpu", "quest"),
    pytest.param("llama", "cpu", "quest", marks=SLOW),
    pytest.param("qwen3", "none", "quest", marks=SLOW),
    pytest.param("llama", "none", "quest", marks=SLOW),
])
def test_tp2_greedy_tokens_equal_tp1(checkpoints, one_thread, arch, offload, policy):
    overrides = [*OFFLOAD[offload], *POLICY[policy]]
    expected = tokens(build(checkpoints[arch], 1, *overrides))
    llm = build(checkpoints[arch], 2, *overrides)
    assert tokens(llm) == expected
    if policy == "quest" and offload == "cpu":  # the window, not every block, came over from the host
        full_loads = (GREEDY.max_tokens - 1) * 3 * (120 // 16 + 70 // 16)  # every full block, layer and decode step
        assert llm.engine.kv_store.transfer_stats["h2d_blocks"] < full_loads


# sparse prefill with budgets well under the prompts: MInference chooses per head, so a rank's heads choose what they
# choose on one GPU; XAttention's vote spans the KV heads a rank holds (here one), so its blocks are the rank's own
SPARSE_PREFILL = {
    "minference": ["policy=minference", "policy.vertical_size=8", "policy.slash_size=16", "policy.sink_tokens=4",
                   "policy.recent_diagonals=4", "policy.slash_granularity=1", "policy.last_q=16"],
    "xattn_bsa": ["policy=xattn_bsa", "policy.threshold=0.5", "policy.stride=4", "policy.block_size=16"],
}


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_tp2_minference_chooses_per_head_as_one_device_does(qwen3_ckpt, one_thread, offload):
    overrides = [*OFFLOAD[offload], *SPARSE_PREFILL["minference"]]
    expected = tokens(build(qwen3_ckpt, 1, *overrides))
    llm = build(qwen3_ckpt, 2, *overrides)
    assert tokens(llm) == expected
    assert llm.engine.kv_store.prefill_policy.mean_density < 0.9  # a real selection


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_tp2_xattn_selects_by_its_ranks_heads(qwen3_ckpt, one_thread, offload):
    overrides = [*OFFLOAD[offload], *SPARSE_PREFILL["xattn_bsa"]]
    llm = build(qwen3_ckpt, 2, *overrides)
    out = tokens(llm)
    assert [len(t) for t in out] == [GREEDY.max_tokens] * len(PROMPTS)
    assert llm.engine.kv_store.prefill_policy.mean_density < 1.0  # rank 0's heads chose among the blocks
    covering = [item for item in overrides if not item.startswith("policy.threshold")] + ["policy.threshold=1.0"]
    assert tokens(build(qwen3_ckpt, 2, *covering)) == tokens(build(qwen3_ckpt, 1, *OFFLOAD[offload]))


def test_tp2_runs_a_plugin_policy_installed_after_its_workers_started(qwen3_ckpt, one_thread, tmp_path):
    """Workers kept from an earlier engine cannot import a plugin put on the path since: new ones start."""
    overrides = [*OFFLOAD["cpu"], "policy=streaming_llm", "policy.block_size=16", "policy.recent_blocks=2"]
    tokens(build(qwen3_ckpt, 2, *OFFLOAD["cpu"]))  # workers started without the plugin
    with plugin_site_on_path(install_streaming_plugin(tmp_path)):
        expected = tokens(build(qwen3_ckpt, 1, *overrides))
        llm = build(qwen3_ckpt, 2, *overrides)
        assert tokens(llm) == expected
        assert llm.engine.kv_store.decode_policy.name == "streaming_llm"


def test_tp2_ruler_records_its_size_and_scores_as_one_rank(one_thread, tmp_path):
    from sparsekv.llm import compose_config
    from sparsekv.tasks import get_task

    def ruler(size: int) -> dict:
        return get_task("ruler")(compose_config([
            "task=ruler", "model=probe", "device=cpu", "dtype=float32", f"parallel.tensor_parallel_size={size}",
            "task.lengths=[1024]", "task.samples=2", "task.batch_size=2", "task.tasks=[niah_multikey]",
            "task.warmup=false", "task.progress=false", f"output_dir={tmp_path / str(size)}"]))

    one, two = ruler(1), ruler(2)
    assert (one["tensor_parallel_size"], two["tensor_parallel_size"]) == (1, 2)
    answers = [o["output"] for o in two["outputs"]]
    assert len(answers) == 2 and answers == [o["output"] for o in one["outputs"]]


def test_tp2_seeded_sampling_follows_rank0(qwen3_ckpt, one_thread):
    """Sampled rows are rank 0's tokens on every rank: a worker that sampled on its own would attend to other
    tokens and the shared hidden states would drift from the single-GPU run."""
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=8, ignore_eos=True)
    expected = tokens(build(qwen3_ckpt, 1), params)
    assert tokens(build(qwen3_ckpt, 2), params) == expected


def test_tp2_step_api_and_abort_are_mirrored(qwen3_ckpt, one_thread):
    """add_request / step / abort driven by hand reach the worker too: the request left after the abort finishes
    with the tokens it gets alone."""
    expected = tokens(build(qwen3_ckpt, 1), prompts=PROMPTS[1:])[0]
    engine = build(qwen3_ckpt, 2).engine
    kept = engine.add_request(PROMPTS[1], GREEDY)
    dropped = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort(dropped)
    while engine.scheduler.has_unfinished():
        engine.step()
    assert kept.completion_token_ids == expected
    assert engine.block_manager.num_free_blocks == engine.kv_store.num_blocks


def test_an_older_tp_engine_refuses_once_a_newer_one_is_built(qwen3_ckpt, one_thread):
    old = build(qwen3_ckpt, 2)
    build(qwen3_ckpt, 2)
    with pytest.raises(RuntimeError, match="one tensor-parallel engine is live per process"):
        old.generate(PROMPTS, GREEDY, progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_gpu_tp2_greedy_tokens_equal_tp1(qwen3_ckpt, offload):
    """Two GPUs over NCCL, decode through CUDA graphs (graph=auto) captured on each rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    overrides = [*OFFLOAD[offload], "graph=auto"]
    expected = tokens(build(qwen3_ckpt, 1, *overrides, device="cuda"))
    llm = build(qwen3_ckpt, 2, *overrides, device="cuda")
    assert tokens(llm) == expected
    assert llm.engine.graph_stats["mode"] != "eager"
