"""The typed boundary between a policy and the KV store: what a policy is told, what it may read, what it returns.

A policy receives
  KVLayout       once, in initialize(layout): the shape of the KV it will see
  PolicyContext  per attention call (layer, phase, query, candidate host blocks, positions): read-only
  PagedDecodeContext  offload=none, per layer of a decode step: the whole batch's query and block tables on the
                 device (select_blocks_paged, answered by a PagedChoice)
  KVReader       compute policies only: yields groups of host blocks loaded into GPU ring slots as K/V views
and returns a selection (select_blocks), scores (ScorerPolicy.score_blocks) or an attention output. It never
receives the store, the ring engine or an engine Sequence, and never copies KV itself.

Every selection goes through check_selection (a PagedChoice through check_paged_choice) before anything loads; a
bad one raises PolicySelectionError naming the policy class, the layer and the bad value. An attention output goes
through check_attention_output: a bad one raises PolicyOutputError.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Iterator, Literal, NamedTuple, Protocol, Sequence, Union

import torch

if TYPE_CHECKING:
    from sparsekv.policies.base import SparsePolicy

Selection = Union[list[int], torch.Tensor, None]  # None: every candidate


class PolicySelectionError(ValueError):
    """A policy returned a selection the engine cannot load."""


class PolicyOutputError(ValueError):
    """A compute policy returned an attention output the engine cannot use."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per host block
    max_blocks: int  # upper bound on host block ids (the host pool's size)
    dtype: torch.dtype
    device: torch.device
    # host blocks the scheduler's sequences can hold at once (0: not known). Ids are handed out lowest first, so a
    # table allocated with this many rows at initialize() never grows while the engine runs
    expected_blocks: int = 0


@dataclass(frozen=True)
class PolicyContext:
    """One attention call as a policy sees it. Read-only; built by the store."""
    phase: Literal["prefill", "decode"]
    layer: int
    query: torch.Tensor  # [Nq, H, D] on the device
    candidates: Sequence[int]  # host block ids the query may attend to, in position order (all full blocks)
    block_size: int
    query_start: int  # position of the first query
    kv_len: int  # keys visible to the last query, this chunk / token included
    softmax_scale: float
    chunk_keys: torch.Tensor | None = None  # prefill: the chunk's own keys [Nq, KVH, D]; decode: None
    prompt_len: int | None = None  # prefill: the sequence's prompt tokens (None: not known)
    # prefill, with a GPU block cache that holds the prefix blocks in one run of slots and can take the chunk's
    # blocks right after it: the prefix and this chunk's own K and V as one device view each, [kv_len, KVH, D]
    # (the query is the last Nq positions), read in place and valid for the step. A policy may then compute exactly
    # as offload=none does: compute_prefill(q, *ctx.sequence_kv, ctx.layer, ctx.softmax_scale). None otherwise
    # (decode, the first chunk, no cache, fp8 host blocks, a prefix the cache does not hold in one run, ...)
    sequence_kv: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    # makes candidate_ids; the store passes its per-list cache so graph replays read the tensor they captured
    ids_source: Callable[[Sequence[int]], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def candidate_ids(self) -> torch.Tensor:
        """The candidates as [n] int64 on the device (made on first use: policies that never read it cost nothing)."""
        if self.ids_source is not None:
            return self.ids_source(self.candidates)
        return torch.tensor(list(self.candidates), dtype=torch.int64).to(self.query.device, non_blocking=True)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def ends_prompt(self) -> bool:
        """Prefill: this chunk's last query is the prompt's last token (its question), known from prompt_len."""
        return self.prompt_len is not None and self.query_start + self.query.shape[0] >= self.prompt_len


@dataclass(frozen=True)
class PagedDecodeContext:
    """offload=none: one layer's decode step of a whole batch, for SparsePolicy.select_blocks_paged. Everything
    is a device tensor of a shape fixed by the batch (a captured step replays it), nothing needs the host."""
    layer: int
    query: torch.Tensor  # [B, H, D]
    # [B, W] int32 block ids: row b's full blocks in position order are its first num_candidates[b] entries; the
    # entries after them are ids of other blocks of the cache (not candidates; never choose them)
    candidates: torch.Tensor
    num_candidates: torch.Tensor  # [B] int64; 0 for the padding rows of a captured batch
    block_size: int
    softmax_scale: float


class PagedChoice(NamedTuple):
    """What select_blocks_paged returns: row b attends blocks[b, :counts[b]] (distinct candidates of row b, any
    order), then its unfinished block. The width C of `blocks` is fixed by the policy's settings and the candidates'
    width, never by their values: the store plans its kernel for (C + 1) * block_size keys, so keep C small."""
    blocks: torch.Tensor  # [B, C] int32 or int64
    counts: torch.Tensor  # [B] int64, at most num_candidates


class KVGroup(NamedTuple):
    """Consecutive ring slots holding host blocks `ids` (a list, or a device tensor for device selections)."""
    ids: list[int] | torch.Tensor
    k: torch.Tensor  # [len(ids) * block_size, KVH, D], a view of the ring
    v: torch.Tensor


class KVReader(Protocol):
    """Read access to host blocks of one layer through the GPU ring. groups() loads ahead, waits for each group
    before yielding it, and frees a group's slots when the caller advances to the next group (the caller's kernels
    reading it are enqueued on the compute stream by then). Views are valid only until the caller advances.
    group_size (default: half the ring, so two groups are in flight) applies to id lists; a device tensor of ids is
    gathered in groups of up to ring_capacity blocks."""
    block_size: int
    ring_capacity: int  # slots in the ring: a group holds at most this many blocks
    check_selections: bool  # validate device-tensor selections too (one host sync per layer and step)

    def groups(self, blocks: Sequence[int] | torch.Tensor, group_size: int | None = None) -> Iterator[KVGroup]: ...

    def scaled_groups(self, blocks: Sequence[int] | torch.Tensor, group_size: int | None = None
                      ) -> Iterator[tuple[KVGroup, tuple[torch.Tensor, torch.Tensor] | None]]:
        """groups() with each group's fp8 scales: with fp8 host blocks (offload.host_dtype) the group's K/V are
        fp8 and come with their K and V scales [n, KVH] float32, for kernels that dequantize on load; model-dtype
        blocks come with None."""
        ...

    def num_groups(self, num_blocks: int, group_size: int | None = None) -> int: ...

    def resident(self, blocks: Sequence[int]) -> KVGroup | None:
        """The longest leading run of `blocks` already on the device in one piece, in this order (the GPU block cache),
        as one group read in place and valid for the step; None when the first block is not (read with groups())."""
        ...


def check_attention_output(policy: "SparsePolicy", method: str, layer: int, q: torch.Tensor, out: object
                           ) -> torch.Tensor:
    """What a compute policy's `method` returned for the query rows q [n, H, D] of `layer`: it must be [n, H, D] in
    q's dtype on q's device (the engine uses it as it is: no cast, no broadcast)."""
    if isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype and out.device == q.device:
        return out
    got = (f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor)
           else type(out).__name__)
    raise PolicyOutputError(f"{type(policy).__name__}.{method} (policy {policy.name!r}, layer {layer}) returned {got}; "
                            f"it must return the attention of the q it was given: {q.dtype} {tuple(q.shape)} on "
                            f"{q.device}")


def _fail(policy: "SparsePolicy", ctx: PolicyContext, what: str) -> PolicySelectionError:
    return PolicySelectionError(f"{type(policy).__name__}.select_blocks (layer {ctx.layer}, {ctx.phase}, "
                                f"{len(ctx.candidates)} candidates): {what}")


def check_selection(policy: "SparsePolicy", ctx: PolicyContext, selection: object,
                    check_device: bool = False) -> list[int] | torch.Tensor | None:
    """Validate what select_blocks returned. The rules:
      None                      every candidate
      a list/tuple of int       a subset of ctx.candidates, no duplicates, any order (loaded in the order given)
      a 1-D integer tensor      on the query's device, at most len(candidates) long; its values are checked only
                                with check_device (one host sync per layer and step)
      empty                     an error, unless the policy sets allow_empty_selection: then only the chunk's own
                                keys (prefill) or the unfinished block (decode) are attended
    Returns the selection (a list for list/tuple input)."""
    if selection is None:
        return None
    if isinstance(selection, torch.Tensor):
        if selection.dim() != 1 or selection.dtype not in (torch.int64, torch.int32):
            raise _fail(policy, ctx, f"a device selection must be a 1-D int64 tensor of block ids, got shape "
                                     f"{tuple(selection.shape)} dtype {selection.dtype}")
        if selection.device != ctx.query.device:
            raise _fail(policy, ctx, f"the selection is on {selection.device}, the query on {ctx.query.device}")
        if selection.shape[0] > len(ctx.candidates):
            raise _fail(policy, ctx, f"selected {selection.shape[0]} blocks of {len(ctx.candidates)} candidates")
        if selection.shape[0] == 0 and not policy.allow_empty_selection:
            raise _fail(policy, ctx, "empty selection; return None for every candidate, or set "
                                     "allow_empty_selection = True to attend only to the newest keys")
        if check_device:
            _check_ids(policy, ctx, selection.tolist())
        return selection
    if not isinstance(selection, (list, tuple)):
        raise _fail(policy, ctx, f"returned {type(selection).__name__}; expected None, a list of block ids or a "
                                 "device tensor")
    ids = list(selection)
    _check_ids(policy, ctx, ids)
    return ids


def _check_ids(policy: "SparsePolicy", ctx: PolicyContext, ids: list) -> None:
    if not ids and not policy.allow_empty_selection:
        raise _fail(policy, ctx, "empty selection; return None for every candidate, or set "
                                 "allow_empty_selection = True to attend only to the newest keys")
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(policy, ctx, f"block id {value!r} is not an int")
    allowed = set(ctx.candidates)
    for value in ids:
        if value not in allowed:
            raise _fail(policy, ctx, f"block id {value} is not a candidate (candidates: {_short(ctx.candidates)})")
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        duplicate = next(value for value in ids if value in seen or seen.add(value))
        raise _fail(policy, ctx, f"block id {duplicate} is selected twice")


def _short(ids: Sequence[int], limit: int = 8) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= limit else f"[{', '.join(map(str, ids[:limit]))}, ... {len(ids)} in all]"


def check_paged_choice(policy: "SparsePolicy", ctx: PagedDecodeContext, choice: object,
                       check_device: bool = False) -> PagedChoice | None:
    """Validate what select_blocks_paged returned: None, or a PagedChoice of [B, C] int ids and [B] int counts on
    the query's device. With check_device (one host sync per layer and step) each row's chosen blocks must also be
    distinct candidates of the row, at most num_candidates of them."""
    where = f"{type(policy).__name__}.select_blocks_paged (layer {ctx.layer}, batch {ctx.query.shape[0]})"
    if choice is None:
        return None
    if not isinstance(choice, tuple) or len(choice) != 2:
        raise PolicySelectionError(f"{where}: returned {type(choice).__name__}; expected None or a PagedChoice")
    blocks, counts = choice
    rows = ctx.query.shape[0]
    for name, value, dim in (("blocks", blocks, 2), ("counts", counts, 1)):
        if not isinstance(value, torch.Tensor) or value.dim() != dim or value.shape[0] != rows \
                or value.dtype not in (torch.int64, torch.int32) or value.device != ctx.query.device:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise PolicySelectionError(f"{where}: {name} must be a {dim}-D integer tensor of {rows} rows on "
                                       f"{ctx.query.device}, got {shape}")
    if check_device:
        candidates, numbers = ctx.candidates.tolist(), ctx.num_candidates.tolist()
        for row, (ids, count) in enumerate(zip(blocks.tolist(), counts.tolist())):
            allowed = set(candidates[row][:numbers[row]])
            chosen = ids[:count]
            if count > numbers[row] or not set(chosen) <= allowed or len(set(chosen)) != len(chosen):
                raise PolicySelectionError(f"{where}: row {row} chose {_short(chosen)} (count {count}); it must "
                                           f"choose distinct blocks among its {numbers[row]} candidates "
                                           f"{_short(candidates[row][:numbers[row]])}")
    return PagedChoice(blocks, counts)
