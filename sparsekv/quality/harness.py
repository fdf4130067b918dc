"""Drive a SparsePolicy over one sequence through the real OffloadKVStore (run_offloaded: chunked prefill and
decode steps, the store's own loops) or on the device (run_resident: compute_prefill); see sparsekv.quality."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from sparsekv.engine.context import Context, PrefillChunk
from sparsekv.kvcache.host_pool import GIB
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.kvcache.offload_store import OffloadKVStore
from sparsekv.policies.base import SparsePolicy
from sparsekv.quality.planted import AttentionInputs


class RecordingOffloadEngine(OffloadEngine):
    """An OffloadEngine that records every (layer, host block) it loads into the ring. Loads are observed where
    the engine issues them (the copy-engine group loader and the device-side gather) and checked against
    transfer_stats["h2d_blocks"] by loaded_blocks()."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loads: list[tuple[int, int]] = []
        self._stats_mark = self.transfer_stats["h2d_blocks"]

    def _issue_group(self, layer: int, blocks: list[int], size: int) -> int:
        self.loads.extend((layer, int(b)) for b in blocks)
        return super()._issue_group(layer, blocks, size)

    def gather_block_groups(self, layer: int, block_ids: torch.Tensor):
        self.loads.extend((layer, int(b)) for b in block_ids.tolist())  # a host sync: fine for measuring
        return super().gather_block_groups(layer, block_ids)

    def start_recording(self) -> None:
        self.loads.clear()
        self._stats_mark = self.transfer_stats["h2d_blocks"]

    def loaded_blocks(self, layer: int) -> list[int]:
        """Host blocks of `layer` loaded since start_recording()."""
        moved = self.transfer_stats["h2d_blocks"] - self._stats_mark
        if moved != len(self.loads):
            raise RuntimeError(f"OffloadEngine moved {moved} blocks but {len(self.loads)} loads were observed: "
                               "sparsekv.quality.RecordingOffloadEngine no longer sees every load")
        return [b for (l, b) in self.loads if l == layer]


class RecordingOffloadStore(OffloadKVStore):
    """The OffloadKVStore, its ring engine a RecordingOffloadEngine."""
    engine_class = RecordingOffloadEngine


@dataclass
class PhaseRun:
    """What the policy produced in one phase: per layer the evaluated output rows, loaded host blocks and the
    density it reported."""
    outputs: list[torch.Tensor] = field(default_factory=list)  # per layer [n, H, D]
    loads: list[list[int]] = field(default_factory=list)  # per layer, host block ids in load order
    densities: list[float | None] = field(default_factory=list)
    seconds: float = 0.0


def _clear_density(policy) -> None:
    reset = getattr(policy, "reset_density", None)
    if callable(reset):
        reset()
    elif hasattr(policy, "last_density") and not isinstance(getattr(type(policy), "last_density", None), property):
        try:
            policy.last_density = None
        except AttributeError:
            pass


def _read_density(policy) -> float | None:
    value = getattr(policy, "last_density", None)
    if value is None:
        return None
    try:
        value = float(torch.as_tensor(value, dtype=torch.float64).mean())
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def block_table(num_blocks: int, shuffle: bool, seed: int = 0) -> list[int]:
    if not shuffle:
        return list(range(num_blocks))
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 7919)).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_offloaded(policy: SparsePolicy, inputs: AttentionInputs, values: torch.Tensor | None = None, *,
                  phases: Iterable[str] = ("decode", "prefill"), num_gpu_blocks: int = 4,
                  shuffle_blocks: bool = False, check_selections: bool = False,
                  host_dtype: torch.dtype | None = None) -> dict[str, PhaseRun]:
    """Prefill the prompt chunk by chunk, then decode to the last token, through OffloadKVStore.begin_step/attend
    with the inputs' per-layer Q/K/V standing in for the model. `values` replaces inputs.v (the needle probe).
    Returns the runs of the requested phases the policy supports: the last chunk (prefill), the last token (decode).
    `host_dtype` (default: the inputs' dtype) is the host blocks' dtype (offload.host_dtype: fp8)."""
    from sparsekv.engine.sequence import Sequence
    from sparsekv.plugins import registry
    from sparsekv.sampling_params import SamplingParams

    phases = set(phases)
    v_all = inputs.v if values is None else values
    device, lay, bs, chunk = inputs.device, inputs.layout, inputs.block_size, inputs.chunk
    L, S = inputs.num_layers, inputs.context
    full = registry().policies["full"]()
    table = block_table(lay.num_blocks, shuffle_blocks, inputs.meta.get("seed", 0))
    bytes_per_block = 2 * L * bs * inputs.num_kv_heads * inputs.head_dim * inputs.dtype.itemsize
    for p in {id(p): p for p in (policy, full)}.values():
        p.reset()
    store = RecordingOffloadStore(
        num_layers=L, num_kv_heads=inputs.num_kv_heads, head_dim=inputs.head_dim, block_size=bs,
        num_gpu_blocks=num_gpu_blocks, prefill_tokens=chunk, max_num_seqs=1,
        host_pool_gib=(max(table) + 2) * bytes_per_block / GIB, dtype=inputs.dtype, device=device,
        prefill_policy=policy if policy.supports_prefill else full,
        decode_policy=policy if policy.supports_decode else full, initial_prefill_buffer=chunk,
        check_selections=check_selections, host_dtype=host_dtype)
    engine = store.engine
    seq = Sequence([0] * lay.prompt_len, SamplingParams(), bs)
    seq.block_table = table[: -(-lay.prompt_len // bs)]
    runs = {phase: PhaseRun() for phase in phases & {"decode", "prefill"}
            if (policy.supports_prefill if phase == "prefill" else policy.supports_decode)}
    dev = (lambda x: x.to(device, non_blocking=True))

    def step(context: Context, rows: slice, evaluated: PhaseRun | None, phase_policy: SparsePolicy) -> None:
        store.begin_step(context)
        tic = time.perf_counter()
        for layer in range(L):
            q, k, v = (dev(x[layer, rows]) for x in (inputs.q, inputs.k, v_all))
            engine.start_recording()
            _clear_density(phase_policy)
            out = store.attend(layer, q, k, v, inputs.softmax_scale, context)
            if evaluated is not None:
                evaluated.outputs.append(out)
                evaluated.loads.append(engine.loaded_blocks(layer))
                evaluated.densities.append(_read_density(phase_policy))
        if evaluated is not None:
            _sync(device)
            evaluated.seconds = time.perf_counter() - tic

    for start in range(0, lay.prompt_len, chunk):  # chunked prefill of the prompt
        end = min(lay.prompt_len, start + chunk)
        table_t = torch.tensor(seq.block_table, dtype=torch.int32, device=device)
        context = Context(is_prefill=True, kv_store=store, seqs=[seq],
                          chunks=[PrefillChunk(seq, 0, end - start, start, table_t)])
        step(context, slice(start, end), runs.get("prefill") if end == lay.prompt_len else None,
             store.prefill_policy)
        seq.num_computed_tokens = end
    if "decode" in runs:  # decode steps up to the evaluated last token
        for pos in range(lay.prompt_len, S):
            seq.append_token(0)
            if len(seq.block_table) < -(-len(seq) // bs):
                seq.block_table.append(table[len(seq.block_table)])
            step(Context(is_prefill=False, kv_store=store, seqs=[seq]), slice(pos, pos + 1),
                 runs["decode"] if pos == S - 1 else None, store.decode_policy)
            seq.num_computed_tokens = pos + 1
    engine.synchronize()
    return runs


def run_resident(policy: SparsePolicy, inputs: AttentionInputs, values: torch.Tensor | None = None) -> PhaseRun | None:
    """compute_prefill (offload=none) on the whole prompt of every layer; None when the policy has no prefill."""
    if not policy.supports_prefill:
        return None
    v_all = inputs.v if values is None else values
    P, device = inputs.layout.prompt_len, inputs.device
    policy.reset()
    run = PhaseRun()
    tic = time.perf_counter()
    for layer in range(inputs.num_layers):
        q, k, v = (x[layer, :P].to(device) for x in (inputs.q, inputs.k, v_all))
        _clear_density(policy)
        run.outputs.append(policy.compute_prefill(q, k, v, layer, inputs.softmax_scale))
        run.loads.append([])
        run.densities.append(_read_density(policy))
    _sync(device)
    run.seconds = time.perf_counter() - tic
    return run
