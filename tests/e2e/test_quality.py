"""sparsekv.quality (policies against dense attention on planted tensors) and task=quality, on CPU."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest
import torch

from sparsekv import quality as ql
from sparsekv.llm import compose_config
from sparsekv.plugins import registry
from sparsekv.policies.base import SparsePolicy
from sparsekv.tasks import get_task

SMALL = dict(context=512, block_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, prefill_chunk=128)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def planted():
    return ql.planted_inputs(**SMALL, needle_depths=[0.5], seed=3)


@dataclass
class KeepBlocks(SparsePolicy):
    """Selection policy for the tests: keeps the given logical block positions (of the available ones) and
    records what its hooks saw."""
    name: str = "keep_blocks"
    keep: list = field(default_factory=list)
    hook_calls: list = field(default_factory=list)
    requires_block_selection = True

    def select_blocks(self, ctx):
        return [ctx.candidates[i] for i in self.keep if i < len(ctx.candidates)]

    def on_prefill_offload(self, block_id, layer, keys, n):
        self.hook_calls.append(("prefill", block_id, layer, keys.device.type, keys.shape[0], n))

    def on_decode_offload(self, block_id, layer, keys, n):
        self.hook_calls.append(("decode", block_id, layer, keys.device.type, keys.shape[0], n))


# ---------------------------------------------------------------------------------------------- planted inputs


def test_planted_structure(planted):
    lay = planted.layout
    assert planted.q.shape == (2, 512, 4, 16) and planted.k.shape == planted.v.shape == (2, 512, 2, 16)
    assert lay.prompt_len == 511 and lay.last_chunk_start == 384 and lay.prefix_blocks == 12
    assert planted.needle_blocks == [1 + round(0.5 * 10)]  # block 0 (sinks) avoided, within the prefix
    assert planted.needle_queries == 512 - 384
    # the decode query puts most of its mass on the needle block; an early query on the sinks and its window
    mass = ql.block_mass(planted.q[0, -1:], planted.k[0], planted.softmax_scale, 32)[:, 0]  # [H, nb]
    assert (mass.argmax(-1) == planted.needle_blocks[0]).all()
    early = ql.block_mass(planted.q[0, 300:301], planted.k[0, :301], planted.softmax_scale, 32)[:, 0]
    assert early[:, planted.needle_blocks[0]].max() < 0.05  # not a needle query
    assert (early[:, 0] + early[:, 8:10].sum(-1) > 0.5).all()  # sinks + local window
    again = ql.planted_inputs(**SMALL, needle_depths=[0.5], seed=3)
    assert torch.equal(again.k, planted.k) and torch.equal(again.q, planted.q)


def test_needle_depths_map_to_prefix_blocks():
    lay = ql.layout(512, 32, 128)
    assert ql.needle_block_indices([0.0, 0.5, 1.0], lay) == [1, 6, 11]
    with pytest.raises(ValueError, match="outside"):
        ql.needle_block_indices([1.5], lay)


# ---------------------------------------------------------------------------------------------- dense policy


@pytest.mark.parametrize("shuffle", [False, True])
def test_full_policy_is_dense(planted, shuffle):
    report = ql.evaluate(registry().policies["full"](), planted, shuffle_blocks=shuffle)
    assert set(report["phases"]) == {"decode", "prefill", "resident"}
    for phase, m in report["phases"].items():
        assert m["recall"] == pytest.approx(1.0, abs=1e-5), phase
        assert m["density"] == 1.0, phase
        assert m["rel_error"] < 1e-5, phase
        assert m["needle_recall"] == pytest.approx(1.0, abs=1e-5) and m["needle_hit"] == 1.0, phase
    assert report["phases"]["decode"]["selectable_blocks"] == 15
    assert report["phases"]["decode"]["loaded_blocks_per_layer"] == 15
    assert report["phases"]["prefill"]["selectable_blocks"] == 12
    assert report["phases"]["prefill"]["needle_loaded"] == 1.0


# ---------------------------------------------------------------------------------------------- selection


def test_selection_policy_reaches_needle_sparsely(planted):
    needle = planted.needle_blocks[0]
    policy = KeepBlocks(keep=[0, needle])
    report = ql.evaluate(policy, planted, phases=["decode", "prefill"], shuffle_blocks=True)
    for phase in ("decode", "prefill"):
        m = report["phases"][phase]
        assert m["needle_loaded"] == 1.0 and m["needle_hit"] == 1.0, phase
        assert m["loaded_blocks_per_layer"] == 2
        assert m["density"] == pytest.approx(2 / m["selectable_blocks"]) and m["density"] < 1
        assert 0.0 < m["rel_error"] < 1.0
        assert 0.5 < m["recall"] < 1.0
        assert m["oracle_recall"] >= m["recall"] - 1e-6
    # a policy that misses the needle loses it
    missing = ql.evaluate(KeepBlocks(keep=[0, needle + 2]), planted, phases=["decode"])["phases"]["decode"]
    assert missing["needle_loaded"] == 0.0 and missing["needle_hit"] == 0.0 and missing["needle_recall"] < 0.01
    assert missing["recall"] < report["phases"]["decode"]["recall"]


def test_hooks_fire_like_the_engine():
    x = ql.planted_inputs(context=160, block_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                          prefill_chunk=64, decode_steps=30)
    policy = KeepBlocks(keep=[0])
    ql.run_offloaded(policy, x, phases=["decode"])
    # prompt 129 tokens -> prefill blocks 0..3 full and block 4 holding 1 token, per layer, keys on the device;
    # the decode steps fill block 4 (position 159 is the last of it) -> one decode offload per layer
    prefill = [c for c in policy.hook_calls if c[0] == "prefill"]
    decode = [c for c in policy.hook_calls if c[0] == "decode"]
    assert [(c[1], c[2], c[4], c[5]) for c in prefill if c[2] == 0] == [(0, 0, 32, 32), (1, 0, 32, 32),
                                                                        (2, 0, 32, 32), (3, 0, 32, 32),
                                                                        (4, 0, 1, 1)]
    assert len(prefill) == 10 and {c[3] for c in prefill} == {"cpu"}
    assert [(c[1], c[2], c[5]) for c in decode] == [(4, 0, 32), (4, 1, 32)]


def test_unknown_phase_and_unsupported_phase(planted):
    with pytest.raises(ValueError, match="unknown phase"):
        ql.evaluate(registry().policies["full"](), planted, phases=["decoding"])

    @dataclass
    class DecodeOnly(KeepBlocks):
        name: str = "decode_only"
        supports_prefill = False

    report = ql.evaluate(DecodeOnly(keep=[0]), planted, probe=False)
    assert "skipped" in report["phases"]["prefill"] and "skipped" in report["phases"]["resident"]
    assert report["phases"]["decode"]["needle_hit"] is None  # no probe run
    flat = ql.rows([report])
    assert [r["phase"] for r in flat] == ["decode", "prefill", "resident"]
    assert "skipped" in ql.format_table(flat)
    assert "skipped" in ql.summarize(flat)["prefill"]


# ---------------------------------------------------------------------------------------------- metrics by hand


def test_metrics_on_a_hand_made_case():
    # one query, 4 keys in 2 blocks of 2: scores 0, ln 3 | ln 2, ln 2 -> p = [1, 3, 2, 2] / 8
    q = torch.tensor([[[1.0, 0.0]]])  # [1, H=1, D=2]
    k = torch.tensor([[0.0, 0.0], [math.log(3), 0.0], [math.log(2), 5.0], [math.log(2), -5.0]])[:, None, :]
    mass = ql.block_mass(q, k, 1.0, 2)
    assert mass.shape == (1, 1, 2)
    assert mass[0, 0].tolist() == pytest.approx([0.5, 0.5])
    assert ql.recall_of(mass, [1]) == pytest.approx(0.5)
    # causal: the last 2 of 4 positions; the first of them sees keys 0..2 only
    mass2 = ql.block_mass(torch.cat([q, q]), k, 1.0, 2)
    assert mass2[0, 0].tolist() == pytest.approx([4 / 6, 2 / 6])
    assert ql.recall_of(mass2, [0, 1]) == pytest.approx(1.0)
    assert ql.oracle_blocks(mass2, 2, 1) == [0]
    num, den = ql.relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0]))
    assert (num, den) == (4.0, 1.0)
    # needle probe: dense needle mass 0.4 and 0.02 (below the 0.1 threshold); the policy kept 0.5 and 0
    probe = torch.tensor([[[0.5], [0.0]]])
    dense = torch.tensor([[[0.4], [0.02]]])
    kept, total, hits, counted = ql.needle_scores(probe, dense, 1, 0.1)
    assert (kept, total, hits, counted) == (pytest.approx(0.4), pytest.approx(0.42), 1, 1)


def test_uniform_attention_recall_density_and_error():
    """q = 0: every visible key gets the same weight, so recall = attended tokens / visible tokens."""
    S, bs = 64, 8
    q = torch.zeros(1, S, 2, 4)
    k = torch.randn(1, S, 1, 4)
    v = torch.randn(1, S, 1, 4)
    x = ql.AttentionInputs(q, k, v, bs, 0.5, "cpu", needle_blocks=[3], needle_queries=1, prefill_chunk=32)
    report = ql.evaluate(KeepBlocks(keep=[0, 3]), x, phases=["decode", "prefill"])
    d = report["phases"]["decode"]  # query 63; full blocks 0..6 selectable, block 7 (tail) always
    assert d["recall"] == pytest.approx((2 * bs + bs) / S)
    assert d["oracle_recall"] == pytest.approx(d["recall"])
    assert d["density"] == pytest.approx(2 / 7) and d["block_density"] == pytest.approx(2 / 7)
    kept = torch.cat([v[0, 0:8], v[0, 24:32], v[0, 56:64]])[:, 0].mean(0)
    dense = v[0, :, 0].mean(0)
    assert d["rel_error"] == pytest.approx(float((kept - dense).norm() / dense.norm()), rel=1e-4)
    assert d["needle_loaded"] == 1.0 and d["needle_recall"] == pytest.approx(1.0)
    assert d["needle_hit"] is None  # uniform attention: no head attends to the needle more than to anything
    p = report["phases"]["prefill"]  # prompt 63 tokens, last chunk 32..62, prefix blocks 0..3
    assert p["selectable_blocks"] == 4 and p["density"] == pytest.approx(0.5)
    rows = torch.arange(32, 63)  # row at position i sees i + 1 keys: 16 kept + (i - 31) chunk keys
    assert p["recall"] == pytest.approx(float(((16 + rows - 31) / (rows + 1)).mean()), rel=1e-5)
    assert p["query_rows"] == 31


# ---------------------------------------------------------------------------------------------- registered policies


SPARSE_SETTINGS = {"quest": {"token_budget": 64, "dense_layers": 0}, "xattn_bsa": {"threshold": 0.9},
                   "minference": {"vertical_size": 64, "slash_size": 64}}


@pytest.mark.parametrize("sparse", [False, True], ids=["defaults", "sparse"])
@pytest.mark.parametrize("name", ["quest", "xattn_bsa", "minference"])
def test_registered_policy_runs_through_evaluate(name, sparse, planted):
    policies = registry().policies
    if name not in policies:
        pytest.skip(f"policy {name} is not registered")
    policy = policies[name](**(SPARSE_SETTINGS[name] if sparse else {}))
    report = ql.evaluate(policy, planted, shuffle_blocks=sparse)
    ran = [m for m in report["phases"].values() if "skipped" not in m]
    assert ran, report
    for m in ran:
        assert math.isfinite(m["rel_error"])
        assert m["density"] is None or 0.0 <= m["density"] <= 1.0 + 1e-6
        assert m["recall"] is None or 0.0 <= m["recall"] <= 1.0 + 1e-5
        assert m["needle_recall"] is None or 0.0 <= m["needle_recall"] <= 1.0 + 1e-5
    if sparse and name == "quest":  # 2 blocks of 32 tokens out of 15 selectable, observed at the ring
        assert report["phases"]["decode"]["loaded_blocks_per_layer"] == 2


# ---------------------------------------------------------------------------------------------- task


QUALITY_SMALL = ["task=quality", "device=cpu", "task.context=384", "offload.block_size=32", "task.num_layers=1",
                 "task.num_heads=4", "task.head_dim=16", "task.depths=[0.2,0.8]"]


def test_task_quality_end_to_end(tmp_path, capsys):
    cfg = compose_config([*QUALITY_SMALL, f"output_dir={tmp_path}"])
    figures = get_task(cfg.task.name)(cfg)
    record = json.loads((tmp_path / "quality.json").read_text())
    assert record["status"] == "ok" and record["policy"] == "full" and record["primary_phase"] == "decode"
    assert record["phases"] == ["decode", "prefill", "resident"]
    assert record["block_size"] == 32 and record["prefill_chunk"] == 128 and record["num_gpu_blocks"] == 4
    assert record["recall"] == pytest.approx(1.0) and record["density"] == 1.0 and record["rel_error"] < 1e-5
    assert len(record["rows"]) == 2 * 3 and {r["inputs"] for r in record["rows"]} == {"planted"}
    assert set(record["summary"]) == {"decode", "prefill", "resident"}
    assert figures["needle_hit"] == 1.0
    out = capsys.readouterr().out
    assert "needle_hit" in out and "decode mean" in out


def test_task_quality_on_checkpoint(tmp_path, qwen3_ckpt):
    ckpt = qwen3_ckpt
    cfg = compose_config([*QUALITY_SMALL, f"output_dir={tmp_path}", "model=hf", f"model.path={ckpt}",
                          "task.planted=false", "task.depths=[0.5]", "task.phase=decode",
                          "task.layers=[0,2]", "task.model_context=200"])
    get_task(cfg.task.name)(cfg)
    record = json.loads((tmp_path / "quality.json").read_text())
    assert [r["inputs"] for r in record["rows"]] == ["model"]
    row = record["rows"][0]
    assert row["phase"] == "decode" and 150 <= row["context"] <= 200 and row["needle_blocks"]
    assert row["recall"] == pytest.approx(1.0) and row["rel_error"] < 1e-5
    with pytest.raises(ValueError, match="do not exist"):
        bad = compose_config([*QUALITY_SMALL, f"output_dir={tmp_path}", "model=hf", f"model.path={ckpt}",
                              "task.planted=false", "task.layers=[7]", "task.model_context=64"])
        get_task(bad.task.name)(bad)


def test_task_quality_rejects_bad_settings(tmp_path):
    for override, message in [("task.depths=[1.5]", "depths"), ("task.prefill_chunk=40", "multiple"),
                              ("task.phase=both task.seeds=[]", "seeds")]:
        with pytest.raises(ValueError, match=message):
            cfg = compose_config([*QUALITY_SMALL, f"output_dir={tmp_path}", *override.split()])
            get_task(cfg.task.name)(cfg)
