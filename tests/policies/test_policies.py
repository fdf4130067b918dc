"""Every registered sparse policy, checked the same way (the bundled plugin's streaming_llm included: it is
pip-installed for this module).

(a) with a budget that covers every block, greedy tokens and final logits equal `full` (offload=cpu and
    offload=none; a decode-only policy runs there with full prefill and dense decode);
(b) planted inputs: a needle block whose keys align with the queries is selected under a small budget;
(c) Quest loads only the blocks it selects (the store's transfer counters and the streamed block lists);
(d) bad hyperparameters fail at construction, naming the field;
(e) phase pairing: a prefill-only policy runs with `full` decode and a decode-only one with `full` prefill.
GPU-marked tests (run on a GPU host): no host sync in the metadata hooks and one per selection; bf16 exactness.
A policy that is not meant for a check says why through its case's parameters; a registered policy without a
case fails test_every_registered_policy_has_a_case.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from sparsekv import LLM, SamplingParams, plugins
from sparsekv.factory import build_policy
from sparsekv.llm import compose_config
from sparsekv.policies.context import KVLayout, PolicyContext
from sparsekv.policies.quest import QuestPolicy
from sparsekv.policies.scorer import top_blocks
from sparsekv.policies.xattn.block_select import threshold_keep
from sparsekv.policies.xattn.policy import XAttentionPolicy
from tests.conftest import host_sync_sites, make_checkpoint, random_prompt
from tests.policies.test_streaming_plugin import install_streaming_plugin, plugin_site_on_path

BASE = ["device=cpu", "dtype=float32", "offload.block_size=16"]
OFFLOAD = {
    # chunks of 4 blocks: every prefill chunk after the first selects among prefix host blocks
    "cpu": ["offload=cpu", "offload.prefill_chunk_size=64", "offload.num_gpu_blocks=8"],
    # a scheduler budget of 64 tokens: compute_prefill sees both a prefix and fresh queries
    "none": ["offload=none", "scheduler.max_num_batched_tokens=64"],
}
PROMPTS = [random_prompt(200, seed=11), random_prompt(150, seed=12)]  # 12 and 9 full blocks of 16 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_ctx(phase: str, layer: int, query: torch.Tensor, candidates: list[int], block_size: int, kv_len: int,
             chunk_keys: torch.Tensor | None = None) -> PolicyContext:
    return PolicyContext(phase=phase, layer=layer, query=query, candidates=candidates, block_size=block_size,
                         query_start=kv_len - query.shape[0], kv_len=kv_len, softmax_scale=query.shape[-1] ** -0.5,
                         chunk_keys=chunk_keys)


def make_layout(layers: int, kv_heads: int, dim: int, block_size: int, dtype=torch.float32, device="cpu") -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=dim, block_size=block_size,
                    max_blocks=10 ** 9, dtype=dtype, device=torch.device(device))


@dataclass
class Case:
    covering: list[str]  # overrides under which the policy keeps every block (must equal full)
    planted: str | None = None  # name of the planted-input check below, or None with `why`
    bad: list[tuple[str, object]] = field(default_factory=list)  # (field, value) that must be refused
    why: dict[str, str] = field(default_factory=dict)  # check -> why it does not apply


CASES: dict[str, Case] = {
    "full": Case(covering=[], planted="dense",
                 why={"bad": "full has no hyperparameters; an unknown key is refused when the config composes"}),
    "minference": Case(covering=["policy.vertical_size=100000", "policy.slash_size=100000"],
                       bad=[("last_q", 0), ("vertical_size", -1), ("adaptive_budget", 1.5), ("slash_granularity", 8)],
                       why={"planted": "minference picks vertical/slash lines inside the attention matrix and loads "
                                       "every block; its planted patterns are in tests/policies/test_minference.py"}),
    "quest": Case(covering=["policy.token_budget=1000000", "policy.threshold_blocks=0", "policy.dense_layers=0"],
                  planted="quest",
                  bad=[("token_budget", -1), ("token_budget", 0), ("topk_blocks", 0), ("threshold_blocks", -1),
                       ("dense_layers", -2), ("token_budget", 1.5)]),
    "xattn_bsa": Case(covering=["policy.threshold=1.0"], planted="xattn_bsa",
                      bad=[("threshold", 1.5), ("threshold", 0.0), ("stride", 0), ("block_size", 100),
                           ("vote_fraction", 0.0), ("summary_stride", 0)]),
    "streaming_llm": Case(covering=["policy.recent_blocks=1000"], planted="streaming_llm",
                          bad=[("sink_blocks", -1), ("recent_blocks", -1), ("block_size", 0)]),
}
BUNDLED_PLUGIN_POLICIES = {"streaming_llm"}  # plugins/sparsekv-streamingllm, installed by the fixture below
NAMES = sorted(set(plugins.registry().plugins["builtin"].policies) | BUNDLED_PLUGIN_POLICIES)  # not others' plugins


@pytest.fixture(scope="module", autouse=True)
def registry(tmp_path_factory):
    """The built-ins plus the bundled plugin, pip-installed into a temporary site; restored afterwards."""
    site = install_streaming_plugin(tmp_path_factory.mktemp("streamingllm"))
    with plugin_site_on_path(site):
        yield plugins.registry()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


def case(name: str) -> Case:
    assert name in CASES, (f"policy {name!r} is registered but tests/policies/test_policies.py has no Case for it: "
                           "add one")
    return CASES[name]


def test_every_registered_policy_has_a_case(registry):
    ours = set(registry.plugins["builtin"].policies) | BUNDLED_PLUGIN_POLICIES  # third-party plugins: their own kit
    assert ours <= set(CASES), sorted(ours - set(CASES))
    assert BUNDLED_PLUGIN_POLICIES <= set(registry.policies)


# ---------------------------------------------------------------------------------------------- (a) + (e)
def generate(ckpt: Path, overrides: list[str]) -> tuple[LLM, list[list[int]], torch.Tensor]:
    llm = LLM(str(ckpt), overrides=BASE + overrides)
    outputs = llm.generate(PROMPTS, GREEDY)
    return llm, [o.token_ids for o in outputs], llm.engine.runner.last_logits.clone()


@pytest.fixture(scope="module")
def full_reference(ckpt) -> dict[str, tuple[list[list[int]], torch.Tensor]]:
    cache: dict[str, tuple[list[list[int]], torch.Tensor]] = {}

    def get(offload: str):
        if offload not in cache:
            _, tokens, logits = generate(ckpt, OFFLOAD[offload] + ["policy=full"])
            cache[offload] = tokens, logits
        return cache[offload]

    return get


@pytest.mark.parametrize("offload", ["cpu", "none"])
@pytest.mark.parametrize("name", NAMES)
def test_covering_budget_equals_full(name, offload, ckpt, full_reference, registry):
    cls = registry.policies[name]  # (decode-only policies run with offload=none too: full prefill, dense decode)
    llm, tokens, logits = generate(ckpt, OFFLOAD[offload] + [f"policy={name}"] + case(name).covering)
    expected_tokens, expected_logits = full_reference(offload)
    assert tokens == expected_tokens
    assert torch.allclose(logits, expected_logits, atol=1e-4, rtol=0), (logits - expected_logits).abs().max()
    store = llm.engine.kv_store
    assert isinstance(store.prefill_policy, cls if cls.supports_prefill else registry.policies["full"])
    if offload == "cpu":  # (e) the phase a policy does not support runs `full`
        assert isinstance(store.decode_policy, cls if cls.supports_decode else registry.policies["full"])


@pytest.mark.parametrize("name, prefill, decode", [("xattn_bsa", "xattn_bsa", "full"), ("quest", "full", "quest")])
def test_phase_pairing_with_small_budgets(name, prefill, decode, ckpt):
    sparse = {"xattn_bsa": ["policy.threshold=0.5", "policy.stride=4"],
              "quest": ["policy.token_budget=32", "policy.dense_layers=0"]}[name]
    llm = LLM(str(ckpt), overrides=BASE + OFFLOAD["cpu"] + [f"policy={name}"] + sparse)
    store = llm.engine.kv_store
    assert (store.prefill_policy.name, store.decode_policy.name) == (prefill, decode)
    if name == "xattn_bsa":  # prefill loads exactly the blocks its selections keep
        policy, chosen = store.prefill_policy, []
        select = policy.select_blocks

        def spy(ctx):
            selection = select(ctx)
            chosen.append(ctx.candidates if selection is None else selection)
            return selection

        policy.select_blocks = spy
        before = store.transfer_stats["h2d_blocks"]
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        assert store.transfer_stats["h2d_blocks"] - before == sum(map(len, chosen)) > 0
        assert 0.0 < policy.last_density <= 1.0 and 0.0 < policy.mean_density <= 1.0
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


# ---------------------------------------------------------------------------------------------- (b)
def planted_dense(policy_cls) -> None:
    """full selects every block, in order."""
    blocks = [4, 9, 2, 30]
    ctx = make_ctx("decode", 0, torch.randn(1, 4, 16), blocks, 16, 64)
    assert policy_cls().select_blocks(ctx) is None  # None: every candidate


def _unit(dim: int, gen: torch.Generator) -> torch.Tensor:
    u = torch.randn(dim, generator=gen)
    return u / u.norm()


def planted_quest(policy_cls) -> None:
    layers, kv_heads, heads, dim, bs = 2, 2, 4, 16, 16
    gen = torch.Generator().manual_seed(0)
    blocks = [3, 5, 8, 9, 17, 40, 41, 42, 100, 250]  # sparse ids: the tables grow to 251 rows, lazily
    needle = 41
    policy = policy_cls(token_budget=3 * bs, dense_layers=1)
    policy.initialize(make_layout(layers, kv_heads, dim, bs))
    query = torch.randn(1, heads, dim, generator=gen)
    group_query = query.view(kv_heads, heads // kv_heads, dim).mean(dim=1)  # [KVH, D]
    keys = {}
    for block in blocks:
        k = 0.3 * torch.randn(bs, kv_heads, dim, generator=gen)
        if block == needle:
            k[7] = 3.0 * group_query  # one token per KV head aligned with its query heads
        keys[block] = k
        for layer in range(layers):
            policy.on_prefill_offload(block, layer, k, bs)
    assert policy._kmax.capacity < 10 ** 6  # allocated by use, not by the host pool's bound

    ctx = make_ctx("decode", 1, query, blocks, bs, len(blocks) * bs + 1)
    chosen = sorted(policy.select_blocks(ctx).tolist())  # a device tensor, any order
    assert chosen == [blocks[0], needle, blocks[-1]]  # sink, needle, newest
    assert sorted(top_blocks(ctx.candidate_ids, policy.score_blocks(ctx), 3, 1, 1).tolist()) == chosen  # reference
    dense_ctx = make_ctx("decode", 0, query, blocks, bs, len(blocks) * bs + 1)
    assert policy.select_blocks(dense_ctx) is None  # layer 0 < dense_layers: every block

    # the per-channel bound is an upper bound of every q.k in the block, and tighter than max(q.kmax, q.kmin)
    ids = torch.tensor(blocks)
    bound = policy.upper_bounds(query, ids, 1)  # [n, 1, KVH, G]
    for i, block in enumerate(blocks):
        k = keys[block].repeat_interleave(heads // kv_heads, dim=1)  # [bs, H, D]
        true_max = torch.einsum("hd,thd->th", query[0], k).amax(dim=0)  # [H]
        assert torch.all(bound[i, 0].flatten() >= true_max - 1e-5)

    # a partly filled block is bounded by its valid rows only; decode rewrites it when full
    partial = 0.3 * torch.randn(bs, kv_heads, dim, generator=gen)
    partial[5:] = 100.0
    policy.on_prefill_offload(7, 1, partial, 5)
    assert torch.equal(policy._kmax.data[1, 7], partial[:5].amax(dim=0))
    policy.on_decode_offload(7, 1, partial, bs)
    assert torch.equal(policy._kmax.data[1, 7], partial.amax(dim=0))


def planted_xattn_bsa(policy_cls) -> None:
    _planted_xattn_offload(policy_cls)
    _planted_xattn_device(policy_cls)


def _planted_xattn_offload(policy_cls) -> None:
    """offload=cpu: select_blocks decides from the key summaries alone (no block is loaded: the engine is None)."""
    kv_heads, heads, dim, bs = 2, 4, 16, 16
    gen = torch.Generator().manual_seed(1)
    u = _unit(dim, gen)
    blocks = list(range(20, 32))  # 12 prefix host blocks
    needle = blocks[5]
    policy = policy_cls(threshold=0.6, stride=4)
    policy.initialize(make_layout(1, kv_heads, dim, bs))
    for block in blocks:
        k = 0.3 * torch.randn(bs, kv_heads, dim, generator=gen)
        if block == needle:
            k += 4.0 * u  # every key of the needle block points along u
        policy.on_prefill_offload(block, 0, k, bs)
    layout = make_layout(1, kv_heads, dim, bs)
    table_bytes = policy._summary.bytes_per_block() + policy._groups.bytes_per_block()
    assert policy.device_bytes_per_block(layout) == table_bytes == (bs // 4) * kv_heads * dim * 4 + 4  # 1/stride
    query = 4.0 * u + 0.3 * torch.randn(32, heads, dim, generator=gen)  # a 2-block chunk asking for u
    ctx = make_ctx("prefill", 0, query, blocks, bs, (len(blocks) + 2) * bs)
    chosen = policy.select_blocks(ctx)
    assert needle in chosen and chosen[0] == blocks[0] and chosen[-1] == blocks[-1]
    assert chosen == sorted(chosen) and len(chosen) <= 4
    assert policy.last_density == len(chosen) / len(blocks) < 0.5


def _reference_block_sparse(q, k, v, scale, allowed) -> torch.Tensor:
    """Dense attention with an explicit [n, S] mask of allowed (query, key) pairs, GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vv)


def _kept_pairs(keep: torch.Tensor, qb0: int, q_start: int, seq: int, bs: int) -> torch.Tensor:
    """[n, S] (query, key) pairs that attending to exactly each query block's kept blocks computes."""
    pos = torch.arange(q_start, seq, device=keep.device)[:, None]
    key = torch.arange(seq, device=keep.device)[None, :]
    return (key <= pos) & keep[pos // bs - qb0, key // bs]


def _planted_xattn_device(policy_cls) -> None:
    """offload=none: antidiagonal scoring on the real keys finds the needle; the block-sparse result is exact."""
    kv_heads, heads, dim, bs = 2, 4, 16, 16
    gen = torch.Generator().manual_seed(2)
    u = _unit(dim, gen)
    seq = 12 * bs + 5  # a partial last block
    k = 0.3 * torch.randn(seq, kv_heads, dim, generator=gen)
    k[3 * bs:4 * bs] += 4.0 * u  # needle block 3
    v = torch.randn(seq, kv_heads, dim, generator=gen)
    q_all = 4.0 * u + 0.3 * torch.randn(seq, heads, dim, generator=gen)
    scale = dim ** -0.5
    policy = policy_cls(threshold=0.6, stride=4, block_size=bs)
    for n in (seq, seq - 3 * bs - 7):  # the whole prompt, then a chunk after an unaligned prefix
        q = q_all[seq - n:]
        keep, qb0 = policy.select_prefill_blocks(q, k)
        for row, qb in enumerate(range(qb0, keep.shape[1])):
            assert keep[row, 0] and keep[row, qb] and not keep[row, qb + 1:].any()
            if qb > 3:
                assert keep[row, 3], (qb, keep[row])
        out = policy.compute_prefill(q, k, v, 0, scale)
        visible = sum(qb + 1 for qb in range(qb0, keep.shape[1]))
        assert policy.last_density == pytest.approx(keep.sum().item() / visible)  # exactly the computed pairs
        assert policy.last_density < 0.8  # the sparse path ran
        expected = _reference_block_sparse(q, k, v, scale, _kept_pairs(keep, qb0, seq - n, seq, bs))
        assert torch.allclose(out, expected, atol=1e-5), (out - expected).abs().max()


def test_xattn_block_mass_is_the_antidiagonal_definition():
    """block_mass against the definition, loop by loop: strided rows i, columns j,
    score = sum_t q[i*s + s-1-t] . k[j*s + t] / sqrt(D) / s (zeros outside the queries / keys), causal j <= i,
    softmax over j, rows without a real query dropped, summed over the GQA group and into blocks."""
    gen = torch.Generator().manual_seed(4)
    kv_heads, heads, dim, bs, stride = 2, 4, 8, 8, 4
    policy = XAttentionPolicy(stride=stride, block_size=bs)
    seq = 5 * bs + 3
    k = torch.randn(seq, kv_heads, dim, generator=gen, dtype=torch.float64)
    for n in (seq, seq - 2 * bs - 3):
        q = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)
        q_start, nkb = seq - n, -(-seq // bs)
        qb0 = q_start // bs
        expected = torch.zeros(kv_heads, nkb - qb0, nkb, dtype=torch.float64)
        for h in range(heads):
            for i in range(qb0 * bs // stride, nkb * bs // stride):
                if not any(q_start <= i * stride + t < seq for t in range(stride)):
                    continue
                scores = torch.full((nkb * bs // stride,), float("-inf"), dtype=torch.float64)
                for j in range(i + 1):
                    total = 0.0
                    for t in range(stride):
                        qi, kj = i * stride + stride - 1 - t, j * stride + t
                        if q_start <= qi < seq and kj < seq:
                            total += float(q[qi - q_start, h] @ k[kj, h // (heads // kv_heads)])
                    scores[j] = total / dim ** 0.5 / stride
                p = torch.softmax(scores, dim=0)
                for j in range(i + 1):
                    expected[h // (heads // kv_heads), i * stride // bs - qb0, j * stride // bs] += p[j]
        assert torch.allclose(policy.block_mass(q, k).double(), expected, atol=1e-5)


def planted_streaming_llm(policy_cls) -> None:
    """Position-based, not content-based: sinks + recent window, here checked on both paths."""
    policy = policy_cls(sink_blocks=1, recent_blocks=2, block_size=16)
    blocks = list(range(10, 20))
    ctx = make_ctx("decode", 0, torch.randn(1, 4, 16), blocks, 16, 161)
    assert policy.select_blocks(ctx) == [10, 18, 19]
    gen = torch.Generator().manual_seed(3)
    seq, bs = 100, 16
    q = torch.randn(seq, 4, 16, generator=gen)
    k, v = torch.randn(seq, 2, 16, generator=gen), torch.randn(seq, 2, 16, generator=gen)
    for n in (seq, 37):
        out = policy.compute_prefill(q[seq - n:], k, v, 0, 0.25)
        pos = torch.arange(seq - n, seq)[:, None]
        key = torch.arange(seq)[None, :]
        allowed = (key <= pos) & ((key < bs) | (key >= (pos // bs - 2).clamp(min=0) * bs))
        expected = _reference_block_sparse(q[seq - n:], k, v, 0.25, allowed)
        assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_planted_needle_is_selected(name, registry):
    check = case(name).planted
    if check is None:
        pytest.skip(case(name).why["planted"])
    globals()[f"planted_{check}"](registry.policies[name])


def test_threshold_keep_keeps_the_heaviest_until_the_threshold():
    mass = torch.tensor([[[0.1, 0.5, 0.3, 0.1]]])
    assert threshold_keep(mass, 0.5).tolist() == [[[False, True, False, False]]]
    assert threshold_keep(mass, 0.6).tolist() == [[[False, True, True, False]]]
    assert threshold_keep(mass, 1.0).tolist() == [[[True, True, True, True]]]
    visible = torch.tensor([[True, True, False, False]])
    assert threshold_keep(mass, 0.9, visible).tolist() == [[[True, True, False, False]]]
    # mass kept anyway (the chunk's own keys) counts toward the threshold and the total: (1 + 0.5) / 2 >= 0.7
    assert threshold_keep(mass, 0.7, kept=torch.tensor([[1.0]])).tolist() == [[[False, True, False, False]]]
    assert threshold_keep(mass, 0.5, kept=torch.tensor([[1.0]])).tolist() == [[[False, False, False, False]]]


def test_majority_vote_across_kv_heads():
    keep = torch.tensor([[True, True, False], [True, False, False], [False, True, True], [True, False, False]])
    assert XAttentionPolicy(vote_fraction=0.5)._vote(keep).tolist() == [True, True, False]
    assert XAttentionPolicy(vote_fraction=1.0)._vote(keep).tolist() == [False, False, False]
    assert XAttentionPolicy(vote_fraction=0.25)._vote(keep).tolist() == [True, True, True]


# ---------------------------------------------------------------------------------------------- (c)
def test_quest_small_budget_loads_only_the_selected_blocks(ckpt):
    llm = LLM(str(ckpt), overrides=BASE + ["offload=cpu", "offload.num_gpu_blocks=4", "policy=quest",
                                           "policy.token_budget=48", "policy.dense_layers=1"])
    store, engine = llm.engine.kv_store, llm.engine.kv_store.engine
    policy = store.decode_policy
    layers = llm.engine.spec.num_hidden_layers
    prompt = random_prompt(200, seed=5)  # 12 full blocks + 8 tokens
    full_blocks = 200 // 16

    selections: list[tuple[int, list[int], list[int]]] = []
    streamed: list[list[int]] = []
    select, stream, gather = policy.select_blocks, engine.stream_block_groups, engine.gather_block_groups

    def spy_select(ctx):
        chosen = select(ctx)
        available = list(ctx.candidates)
        selections.append((ctx.layer, available, available if chosen is None else sorted(chosen.tolist())))
        return chosen

    def spy_stream(layer, cpu_blocks, *args, **kwargs):
        streamed.append(list(cpu_blocks))
        return stream(layer, cpu_blocks, *args, **kwargs)

    def spy_gather(layer, block_ids):
        streamed.append(sorted(block_ids.tolist()))
        return gather(layer, block_ids)

    policy.select_blocks = spy_select
    engine.stream_block_groups, engine.gather_block_groups = spy_stream, spy_gather

    def h2d_blocks(max_tokens: int) -> int:
        before = store.transfer_stats["h2d_blocks"]
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return store.transfer_stats["h2d_blocks"] - before

    prefill_only = h2d_blocks(1)
    selections.clear()
    streamed.clear()
    one_decode_step = h2d_blocks(2) - prefill_only
    # layer 0 is dense (12 blocks), the others load sink + newest + 1 best = 3 of 12
    assert one_decode_step == full_blocks + (layers - 1) * 3 < layers * full_blocks
    assert [layer for layer, _, _ in selections] == list(range(layers))
    for layer, available, chosen in selections:
        assert len(available) == full_blocks
        assert len(chosen) == (full_blocks if layer == 0 else 3)
        assert chosen[0] == available[0] and chosen[-1] == available[-1] and chosen == sorted(chosen)
    assert streamed == [chosen for _, _, chosen in selections]  # exactly the chosen blocks crossed PCIe


# ---------------------------------------------------------------------------------------------- (d)
@pytest.mark.parametrize("name", NAMES)
def test_bad_hyperparameters_name_the_field(name, registry):
    cls = registry.policies[name]
    if not case(name).bad:  # nothing to validate beyond the schema: check that instead, and say why
        assert case(name).why["bad"]
        with pytest.raises(ConfigCompositionException, match="no_such_field"):
            compose_config([f"policy={name}", "policy.no_such_field=1"])
        return
    for key, value in case(name).bad:
        with pytest.raises(ValueError, match=f"policy.{key}="):
            cls(**{key: value})


def test_bad_hyperparameter_fails_when_the_engine_is_built(ckpt):
    with pytest.raises(ValueError, match="token_budget"):
        LLM(str(ckpt), overrides=BASE + ["offload=cpu", "policy=quest", "policy.token_budget=-5"])


# ---------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("preset, cls, values, extra", [
    ("quest_4k", QuestPolicy, {"token_budget": 4096}, ("dense_layers", 0)),
    ("quest_2k", QuestPolicy, {"token_budget": 2048}, ("dense_layers", 0)),
    ("xattn_bsa_090", XAttentionPolicy, {"threshold": 0.9}, ("stride", 4)),
])
def test_presets_compose_onto_their_policy(preset, cls, values, extra):
    policy = build_policy(compose_config([f"policy={preset}"]).policy)
    assert type(policy) is cls
    assert {key: getattr(policy, key) for key in values} == values
    key, value = extra  # and the preset's policy keys stay overridable on top of it
    tuned = build_policy(compose_config([f"policy={preset}", f"policy.{key}={value}"]).policy)
    assert {k: getattr(tuned, k) for k in values} == values and getattr(tuned, key) == value


def test_quest_budget_rules():
    assert QuestPolicy().budget_blocks(256) == 8  # neither set: 2048 tokens
    assert QuestPolicy().budget_blocks(128) == 16
    assert QuestPolicy().budget_blocks(1024) == 7  # ... and at least 7 blocks, so it still chooses 5
    assert QuestPolicy().budget_blocks(2048) == 7
    assert QuestPolicy(topk_blocks=8).budget_blocks(1024) == 8
    assert QuestPolicy(token_budget=2048, topk_blocks=8).budget_blocks(1024) == 2  # token_budget wins
    assert QuestPolicy(token_budget=100).budget_blocks(16) == 6


@pytest.mark.parametrize("fields, block_size, warns", [
    ({"token_budget": 2048}, 1024, True),  # the offload=cpu default block: 2 blocks, sink and newest only
    ({"topk_blocks": 2}, 16, True),
    ({"token_budget": 4096}, 1024, False),
    ({"token_budget": 2048}, 256, False)])
def test_quest_warns_when_its_budget_leaves_nothing_to_choose(caplog, fields, block_size, warns):
    with caplog.at_level("WARNING", logger="sparsekv.policies.quest.policy"):
        QuestPolicy(**fields).initialize(make_layout(2, 1, 8, block_size))
    text = caplog.text
    assert ("chooses nothing" in text) == warns
    if warns:
        assert f"blocks of {block_size} tokens" in text and f"token_budget >= {3 * block_size}" in text

# ---------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_gpu_bf16_hooks_do_not_sync_and_only_host_selection_syncs():
    dev, dt = torch.device("cuda"), torch.bfloat16
    kv_heads, heads, dim, bs = 8, 32, 128, 1024
    gen = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(bs, kv_heads, dim, device=dev, dtype=dt, generator=gen)
    quest, xattn = QuestPolicy(token_budget=4096, dense_layers=0), XAttentionPolicy(threshold=0.9)
    for policy in (quest, xattn):
        policy.initialize(make_layout(4, kv_heads, dim, bs, dt, dev))
        for block in range(40):
            policy.on_prefill_offload(block, 2, keys.roll(block, 0), bs)
        assert host_sync_sites(lambda: policy.on_prefill_offload(40, 2, keys, 700)) == []  # a partial block too
        assert host_sync_sites(lambda: policy.on_decode_offload(40, 2, keys, bs)) == []
    blocks = list(range(41))
    q1 = torch.randn(1, heads, dim, device=dev, dtype=dt, generator=gen)
    ctx = make_ctx("decode", 2, q1, blocks, bs, 42 * bs)
    on_device = quest.select_blocks(ctx)
    assert host_sync_sites(lambda: quest.select_blocks(make_ctx("decode", 2, q1, blocks, bs, 42 * bs))) == []
    assert on_device.shape == (4,) and on_device.device.type == "cuda"  # 4096 tokens of 1024-token blocks
    chunk = torch.randn(4096, heads, dim, device=dev, dtype=dt, generator=gen)
    syncs = host_sync_sites(lambda: xattn.select_blocks(make_ctx("prefill", 2, chunk, blocks, bs, 45 * bs)))
    assert len(syncs) == 1, syncs


@pytest.mark.gpu
def test_gpu_bf16_xattn_block_sparse_prefill_is_exact():
    dev, dt = torch.device("cuda"), torch.bfloat16
    kv_heads, heads, dim, seq = 8, 32, 128, 8192 + 77
    gen = torch.Generator(device=dev).manual_seed(1)
    u = torch.randn(dim, device=dev, generator=gen)
    u /= u.norm()
    k = 0.5 * torch.randn(seq, kv_heads, dim, device=dev, generator=gen)
    k[2048:2176] += 3.0 * u  # a needle block
    q = (3.0 * u + 0.5 * torch.randn(seq, heads, dim, device=dev, generator=gen)).to(dt)
    k, v = k.to(dt), torch.randn(seq, kv_heads, dim, device=dev, generator=gen).to(dt)
    policy = XAttentionPolicy(threshold=0.3)
    scale = dim ** -0.5
    for n in (seq, 3000):
        out = policy.compute_prefill(q[seq - n:], k, v, 0, scale)
        assert policy.last_density < 1.0
        keep, qb0 = policy.select_prefill_blocks(q[seq - n:], k)
        rows = slice(n - 1000, n)  # check the last 1000 rows against a masked fp32 reference
        allowed = _kept_pairs(keep, qb0, seq - n, seq, 128)[rows]
        assert keep[-8:, 16].all()  # the needle block is attended by the checked query blocks
        expected = _reference_block_sparse(q[seq - n:][rows].float(), k.float(), v.float(), scale, allowed)
        err = (out[rows].float() - expected).norm() / expected.norm()
        assert err < 2e-2, err
