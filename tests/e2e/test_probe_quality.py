"""The suite tells a good policy from a bad one on the trained probe checkpoint (model=probe), on the CPU at 2K tokens:
full attention retrieves single needles, Quest keeping a quarter of the blocks stays with it, and StreamingLLM at
the same budget (the first block and the newest ones) loses the needles in between. The checkpoint matches keys:
it answers the asked needle among distractors, also with its KV offloaded to an fp8 host tier."""
from __future__ import annotations

import pytest

from sparsekv.llm import compose_config
from sparsekv.tasks import get_task
from tests.policies.test_streaming_plugin import install_streaming_plugin, plugin_site_on_path

CONTEXT, BLOCK, SAMPLES = 2048, 64, 10
BUDGET = CONTEXT // 4  # tokens: 8 of the 32 blocks
SETTINGS = ["task=ruler", "model=probe", "device=cpu", "dtype=float32", "offload=none",
            f"offload.block_size={BLOCK}", f"task.lengths=[{CONTEXT}]", f"task.samples={SAMPLES}",
            "task.batch_size=10", "task.warmup=false", "task.progress=false"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_streaming_plugin(tmp_path_factory.mktemp("streamingllm"))


def needle_accuracy(tmp_path, *policy: str, task: str = "niah_single") -> tuple[float, float]:
    figures = get_task("ruler")(compose_config([*SETTINGS, *policy, f"task.tasks=[{task}]", f"output_dir={tmp_path}"]))
    return figures["accuracy_by_task"][task], figures["density"]


def test_probe_answers_the_asked_key_among_distractors(tmp_path):
    multikey, _ = needle_accuracy(tmp_path, "policy=full", task="niah_multikey")
    assert multikey >= 0.9, f"full attention: {multikey:.0%} of multi-key needles at {CONTEXT} tokens (chance: 25%)"


def test_probe_separates_quest_from_streaming_llm(tmp_path, site):
    full, _ = needle_accuracy(tmp_path / "full", "policy=full")
    quest, quest_density = needle_accuracy(tmp_path / "quest", "policy=quest", f"policy.token_budget={BUDGET}",
                                           "policy.dense_layers=0")
    with plugin_site_on_path(site):
        streaming, _ = needle_accuracy(tmp_path / "streaming", "policy=streaming_llm", f"policy.block_size={BLOCK}",
                                       f"policy.recent_blocks={BUDGET // BLOCK - 1}")
    assert full >= 0.95, f"full attention: {full:.0%} of single needles at {CONTEXT} tokens"
    assert quest_density < 0.5 and quest >= full - 0.05, f"quest at {BUDGET} tokens: {quest:.0%} vs full {full:.0%}"
    assert streaming <= full - 0.3, f"streaming_llm at {BUDGET} tokens: {streaming:.0%} vs full {full:.0%}"


def test_probe_matches_keys_from_the_fp8_host_tier(tmp_path):
    settings = [item for item in SETTINGS if not item.startswith("offload")]
    figures = get_task("ruler")(compose_config([
        *settings, "offload=cpu", "offload.block_size=256", "offload.host_dtype=float8_e4m3fn", "policy=full",
        "task.tasks=[niah_multikey]", f"output_dir={tmp_path}"]))
    multikey = figures["accuracy_by_task"]["niah_multikey"]
    assert multikey >= 0.9, f"fp8 host KV: {multikey:.0%} of multi-key needles at {CONTEXT} tokens (chance: 25%)"
