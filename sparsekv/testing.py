"""The policy conformance kit: the checks every built-in policy passes, for plugin authors to run in their pytest.

    from sparsekv.testing import CHECKS, check_policy, run_check

    def test_my_policy():                                   # everything at once
        check_policy(MyPolicy, covering={"token_budget": 10**9}, token_budget=32)

    @pytest.mark.parametrize("check", CHECKS)               # or one test per check
    def test_my_policy_conforms(check):
        run_check(check, MyPolicy, covering={"token_budget": 10**9}, token_budget=32)

`fields` build the policy for the selection checks (pick small budgets, so that it really selects); `covering`
overrides them so that the budget covers every block (ScorerPolicy subclasses default to a huge token_budget;
other policies must pass it, or the checks needing it use `fields` as they are). Every check runs the policy on a
tiny model: a few layers of planted Q/K/V (sparsekv.quality.planted_inputs) through the real OffloadKVStore, on CPU
in a few seconds.

  full_budget      with a covering budget the policy computes what `full` computes (offloaded prefill and decode,
                   and compute_prefill on the device)
  valid_selections every selection passes the engine's validator, device tensors included (check_selections),
                   with shuffled host block ids
  offload_resident with a covering budget, offload=cpu gives what offload=none gives (chunked prefill through the
                   ring against compute_prefill with every key on the device; decode against dense attention)
  graph_safe       a policy declaring decode_graph_safe selects the same blocks when only host-side per-token state
                   (ctx.kv_len, ctx.query_start) changes
  paged_selection  a policy declaring paged_device_selection chooses in select_blocks_paged, row by row of a
                   batch (short rows, a padding row and stale table entries included), what select_blocks chooses
                   for each row, and passes the validator (check_paged_choice, synced)
  metadata_bytes   device_bytes_per_block returns an int >= 0, and the tensors the policy holds grow by at most
                   that much per host block recorded (what offload=cpu reserves before it sizes the GPU block cache)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import (KVLayout, PagedDecodeContext, PolicyContext, check_paged_choice,
                                       check_selection)
from sparsekv.policies.scorer import ScorerPolicy

TINY = dict(context=192, block_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, prefill_chunk=64,
            decode_steps=4)  # the last decode step fills a block: on_decode_offload runs
ATOL = 2e-5  # fp32 outputs of the same kernels in another order
RESIDENT_ATOL = 2e-4  # fp32 outputs of different kernels (ring groups merged by LSE against one pass)


def _inputs(seed: int = 0):
    from sparsekv.quality.planted import planted_inputs
    return planted_inputs(**TINY, needle_depths=(0.3,), seed=seed)


def _covering(policy_cls: type, covering: dict | None, fields: dict) -> dict:
    if covering is None and issubclass(policy_cls, ScorerPolicy):
        covering = {"token_budget": 1 << 30}
    return {**fields, **(covering or {})}


def _close(name: str, got: list[torch.Tensor], want: list[torch.Tensor], atol: float) -> None:
    assert len(got) == len(want), f"{name}: {len(got)} layers against {len(want)}"
    for layer, (a, b) in enumerate(zip(got, want)):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= atol, f"{name}, layer {layer}: max abs difference {err:.3g} > {atol:g}"


def check_full_budget(policy_cls: type[SparsePolicy], covering: dict | None = None, **fields: Any) -> None:
    """With a budget covering every block the policy equals full attention."""
    from sparsekv.policies.full import FullAttentionPolicy
    from sparsekv.quality.harness import run_offloaded, run_resident
    inputs = _inputs()
    policy = policy_cls(**_covering(policy_cls, covering, fields))
    got, want = run_offloaded(policy, inputs), run_offloaded(FullAttentionPolicy(), inputs)
    for phase, run in got.items():
        _close(f"{policy_cls.__name__} {phase} (offload=cpu)", run.outputs, want[phase].outputs, ATOL)
    resident = run_resident(policy, inputs)
    if resident is not None:
        _close(f"{policy_cls.__name__} compute_prefill (offload=none)", resident.outputs,
               run_resident(FullAttentionPolicy(), inputs).outputs, ATOL)


def check_valid_selections(policy_cls: type[SparsePolicy], covering: dict | None = None, **fields: Any) -> None:
    """Every selection the policy makes on the tiny model passes the validator (device tensors synced and checked),
    with host block ids out of position order."""
    from sparsekv.quality.harness import run_offloaded
    policy = policy_cls(**fields)
    seen = _spy(policy, lambda ctx, selection: check_selection(policy, ctx, selection, check_device=True))
    run_offloaded(policy, _inputs(seed=1), shuffle_blocks=True, check_selections=True, num_gpu_blocks=3)
    if policy.requires_block_selection:
        assert seen, f"{policy_cls.__name__} declares requires_block_selection but select_blocks never ran"


def check_offload_resident(policy_cls: type[SparsePolicy], covering: dict | None = None, **fields: Any) -> None:
    """With a covering budget, offload=cpu computes what offload=none computes."""
    from sparsekv.quality.harness import run_offloaded, run_resident
    from sparsekv.quality.metrics import dense_attention
    inputs = _inputs(seed=2)
    policy = policy_cls(**_covering(policy_cls, covering, fields))
    runs = run_offloaded(policy, inputs)
    resident = run_resident(policy_cls(**_covering(policy_cls, covering, fields)), inputs)
    lay, P = inputs.layout, inputs.layout.prompt_len
    if "prefill" in runs and resident is not None:
        rows = slice(lay.last_chunk_start, P)
        _close(f"{policy_cls.__name__} last prefill chunk, offload=cpu against offload=none", runs["prefill"].outputs,
               [out[rows] for out in resident.outputs], RESIDENT_ATOL)
    if "decode" in runs:
        S = inputs.context
        want = [dense_attention(inputs.q[layer, S - 1:S], inputs.k[layer, :S], inputs.v[layer, :S],
                                inputs.softmax_scale) for layer in range(inputs.num_layers)]
        _close(f"{policy_cls.__name__} decode, offload=cpu against dense", runs["decode"].outputs, want,
               RESIDENT_ATOL)


def check_graph_safe(policy_cls: type[SparsePolicy], covering: dict | None = None, **fields: Any) -> None:
    """decode_graph_safe: the decode selection depends only on candidates, layer and device tensors."""
    from sparsekv.quality.harness import run_offloaded
    if not policy_cls.decode_graph_safe or not policy_cls.supports_decode:
        return
    policy = policy_cls(**fields)
    select = policy.select_blocks

    def same_when_moved(ctx: PolicyContext, selection) -> None:
        if ctx.phase != "decode":
            return
        moved = dataclasses.replace(ctx, kv_len=ctx.kv_len + 7 * ctx.block_size,
                                    query_start=ctx.query_start + 7 * ctx.block_size)
        again = select(moved)
        assert _same(selection, again), (f"{policy_cls.__name__} declares decode_graph_safe but its selection changed "
                                         f"with ctx.kv_len alone (layer {ctx.layer}): {selection} -> {again}")
    _spy(policy, same_when_moved)
    run_offloaded(policy, _inputs(seed=3), phases=("decode",))


PAGED_ROWS = (11, 3, 0, 7, 1, 2)  # full blocks per row of the batch; 0: a padding row of a captured batch


def check_paged_selection(policy_cls: type[SparsePolicy], covering: dict | None = None, **fields: Any) -> None:
    """paged_device_selection: select_blocks_paged agrees with select_blocks on every row of a batch."""
    if not policy_cls.paged_device_selection or not policy_cls.supports_decode:
        return
    policy = policy_cls(**fields)
    lay, gen = TINY, torch.Generator().manual_seed(4)
    bs, kv_heads, dim, heads = lay["block_size"], lay["num_kv_heads"], lay["head_dim"], lay["num_heads"]
    num_blocks = sum(PAGED_ROWS) + len(PAGED_ROWS)
    policy.initialize(KVLayout(num_layers=lay["num_layers"], num_kv_heads=kv_heads, head_dim=dim, block_size=bs,
                               max_blocks=num_blocks, dtype=torch.float32, device=torch.device("cpu")))
    keys = torch.randn(num_blocks, bs, kv_heads, dim, generator=gen)
    for layer in range(lay["num_layers"]):
        for block in range(num_blocks):
            policy.on_prefill_offload(block, layer, keys[block], bs)
    order = torch.randperm(num_blocks, generator=gen)  # block ids out of position order
    width = max(PAGED_ROWS) + 1
    tables = order[torch.randint(0, num_blocks, (len(PAGED_ROWS), width), generator=gen)]  # stale entries
    start = 0
    for row, n in enumerate(PAGED_ROWS):
        tables[row, :n + 1] = order[start:start + n + 1]  # the row's full blocks and its unfinished one
        start += n + 1
    counts = torch.tensor(PAGED_ROWS)
    query = torch.randn(len(PAGED_ROWS), heads, dim, generator=gen)
    for layer in range(lay["num_layers"]):
        ctx = PagedDecodeContext(layer=layer, query=query, candidates=tables.to(torch.int32), num_candidates=counts,
                                 block_size=bs, softmax_scale=dim ** -0.5)
        choice = check_paged_choice(policy, ctx, policy.select_blocks_paged(ctx), check_device=True)
        for row, n in enumerate(PAGED_ROWS):
            candidates = tables[row, :n].tolist()
            got = set(candidates) if choice is None else set(choice.blocks[row, :choice.counts[row]].tolist())
            want = set(candidates)
            if n:
                one = PolicyContext(phase="decode", layer=layer, query=query[row:row + 1], candidates=candidates,
                                    block_size=bs, query_start=(n + 1) * bs - 1, kv_len=(n + 1) * bs,
                                    softmax_scale=dim ** -0.5)
                selection = check_selection(policy, one, policy.select_blocks(one), check_device=True)
                want = want if selection is None else set(_ids(selection))
            assert got == want, (f"{policy_cls.__name__} declares paged_device_selection but select_blocks_paged "
                                 f"chose {sorted(got)} for row {row} (layer {layer}, {n} candidates) where "
                                 f"select_blocks chose {sorted(want)}")


def check_metadata_bytes(policy_cls: type[SparsePolicy], covering: dict | None = None, **fields: Any) -> None:
    """The tensors a policy holds grow per recorded host block by at most what device_bytes_per_block declares."""
    lay = TINY
    bs, kv_heads, dim = lay["block_size"], lay["num_kv_heads"], lay["head_dim"]

    def held(blocks: int) -> tuple[int, int]:
        policy = policy_cls(**fields)
        layout = KVLayout(num_layers=lay["num_layers"], num_kv_heads=kv_heads, head_dim=dim, block_size=bs,
                          max_blocks=64, dtype=torch.float32, device=torch.device("cpu"), expected_blocks=blocks)
        declared = policy.device_bytes_per_block(layout)
        assert isinstance(declared, int) and not isinstance(declared, bool) and declared >= 0, (
            f"{policy_cls.__name__}.device_bytes_per_block returned {declared!r}; expected an int >= 0")
        policy.initialize(layout)
        keys = torch.randn(blocks, bs, kv_heads, dim, generator=torch.Generator().manual_seed(5))
        for layer in range(lay["num_layers"]):
            for block in range(blocks):
                policy.on_prefill_offload(block, layer, keys[block], bs)
        return declared, _tensor_bytes(policy)

    declared, few = held(4)
    _, many = held(12)
    grown = (many - few) / 8
    assert grown <= declared, (f"{policy_cls.__name__} holds {grown:g} more bytes of tensors per recorded host block "
                               f"than device_bytes_per_block declares ({declared}); declare what the metadata takes, "
                               "so that offload=cpu leaves room for it")


def _tensor_bytes(obj: Any, seen: set | None = None, depth: int = 0) -> int:
    """Bytes of the distinct tensor storages an object holds in its attributes, lists, tuples and dicts (3 deep)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if depth > 3:
        return 0
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = list(vars(obj).values())
    else:
        return 0
    return sum(_tensor_bytes(child, seen, depth + 1) for child in children)


def _ids(selection) -> list[int]:
    return selection.tolist() if isinstance(selection, torch.Tensor) else list(selection)


def _spy(policy: SparsePolicy, inspect: Callable[[PolicyContext, Any], None]) -> list:
    """Make policy.select_blocks call inspect(ctx, selection) on everything it returns; returns the list of those."""
    select, seen = policy.select_blocks, []

    def spy(ctx: PolicyContext):
        selection = select(ctx)
        inspect(ctx, selection)
        seen.append(selection)
        return selection
    policy.select_blocks = spy
    return seen


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a.sort().values, b.sort().values)
    return a == b


CHECKS: dict[str, Callable[..., None]] = {
    "full_budget": check_full_budget,
    "valid_selections": check_valid_selections,
    "offload_resident": check_offload_resident,
    "graph_safe": check_graph_safe,
    "paged_selection": check_paged_selection,
    "metadata_bytes": check_metadata_bytes,
}


def run_check(check: str, policy_cls: type[SparsePolicy], covering: dict | None = None, **fields: Any) -> None:
    """One check by name (a key of CHECKS)."""
    if check not in CHECKS:
        raise ValueError(f"check={check!r} is not a conformance check; choose from {', '.join(CHECKS)}")
    CHECKS[check](policy_cls, covering, **fields)


def check_policy(policy_cls: type[SparsePolicy], covering: dict | None = None, **fields: Any) -> None:
    """Every conformance check; raises AssertionError (or PolicySelectionError) naming the first that fails."""
    for check in CHECKS.values():
        check(policy_cls, covering, **fields)
