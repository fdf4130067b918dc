"""Drive a SparsePolicy over one sequence as OffloadKVStore does, through a real HostPool + OffloadEngine
(run_offloaded: chunked prefill and decode) or on the device (run_resident: compute_prefill); see sparsekv.quality."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch

from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.offload_engine import OffloadEngine
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


class SequenceKVViews:
    """Stand-in for the `kvcache_manager` policies receive (OffloadKVStore): the same views over one sequence
    whose unfinished block lives in decode-buffer row `row`."""

    def __init__(self, engine: OffloadEngine, chunk_tokens: int, row: int = 0):
        self.engine = engine
        self.host = engine.host
        self.block_size = engine.block_size
        self.chunk_tokens = chunk_tokens
        self.prefill_token_budget = chunk_tokens
        self.device = engine.device
        self.row = row

    @property
    def transfer_stats(self) -> dict[str, int]:
        return self.engine.transfer_stats

    def prefix_blocks(self, seq) -> list[int]:
        return seq.block_table[: seq.num_computed_tokens // self.block_size]

    def num_chunks(self, seq) -> int:
        return -(-len(seq) // self.chunk_tokens)

    def full_blocks(self, seq) -> list[int]:
        return seq.block_table[: (len(seq) - 1) // self.block_size]

    def decode_tail(self, seq, layer: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        return (*self.engine.get_decode_layer_kv(self.row, layer, (len(seq) - 1) % self.block_size + 1), None)


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
                  shuffle_blocks: bool = False) -> dict[str, PhaseRun]:
    """Drive `policy` over the sequence as OffloadKVStore does (see the module doc). `values` replaces inputs.v
    (the needle probe). Returns the runs of the requested phases the policy supports."""
    from sparsekv.engine.sequence import Sequence
    from sparsekv.plugins import registry
    from sparsekv.sampling_params import SamplingParams

    phases = set(phases)
    v_all = inputs.v if values is None else values
    device, lay, bs, chunk = inputs.device, inputs.layout, inputs.block_size, inputs.chunk
    L, S = inputs.num_layers, inputs.context
    full = registry().policies["full"]()
    prefill_policy = policy if policy.supports_prefill else full
    decode_policy = policy if policy.supports_decode else full
    hooked = [prefill_policy] if prefill_policy is decode_policy else [prefill_policy, decode_policy]
    table = block_table(lay.num_blocks, shuffle_blocks, inputs.meta.get("seed", 0))
    host = HostPool(L, max(table) + 1, bs, inputs.num_kv_heads, inputs.head_dim, inputs.dtype,
                    pin_memory=device.type == "cuda")
    host.ensure_capacity(max(table) + 1)
    engine = RecordingOffloadEngine(host, num_gpu_blocks, chunk, 1, device, hooked)
    for p in hooked:
        p.reset()
        p.initialize(L, inputs.num_kv_heads, inputs.head_dim, host.max_blocks, inputs.dtype, device)
    views = SequenceKVViews(engine, chunk)
    seq = Sequence([0] * lay.prompt_len, SamplingParams(), bs)
    seq.block_table = table[: -(-lay.prompt_len // bs)]
    runs = {phase: PhaseRun() for phase in phases & {"decode", "prefill"}}
    if "prefill" in runs and not policy.supports_prefill:
        del runs["prefill"]
    if "decode" in runs and not policy.supports_decode:
        del runs["decode"]
    dev = (lambda x: x.to(device, non_blocking=True))
    compute_prefill = "prefill" in runs

    # ---- chunked prefill of the prompt
    for start in range(0, lay.prompt_len, chunk):
        end = min(lay.prompt_len, start + chunk)
        n = end - start
        last = end == lay.prompt_len
        tic = time.perf_counter()
        for layer in range(L):
            q_c, k_c, v_c = (dev(x[layer, start:end]) for x in (inputs.q, inputs.k, v_all))
            engine.write_prefill_buffer(layer, k_c, v_c)
            first = start // bs
            for i, row in enumerate(range(0, n, bs)):
                engine.offload_prefill_buffer_async(layer, seq.block_table[first + i], min(bs, n - row), row)
            tail = end % bs
            if tail and last:
                engine.copy_prefill_tail_to_decode(layer, views.row, n - tail, tail)
            if compute_prefill:
                engine.start_recording()
                _clear_density(prefill_policy)
                out = prefill_policy.compute_chunked_prefill(q_c, k_c, v_c, layer, inputs.softmax_scale, engine,
                                                             views, start // chunk, seq, n)
                if last:
                    run = runs["prefill"]
                    run.outputs.append(out)
                    run.loads.append(engine.loaded_blocks(layer))
                    run.densities.append(_read_density(prefill_policy))
        if compute_prefill and last:
            _sync(device)
            runs["prefill"].seconds = time.perf_counter() - tic
        seq.num_computed_tokens = end

    if "decode" not in runs:
        engine.synchronize()
        return runs
    # ---- decode: decode_steps tokens, then the evaluated last token
    for pos in range(lay.prompt_len, S):
        seq.append_token(0)
        needed = -(-len(seq) // bs)
        if len(seq.block_table) < needed:
            seq.block_table.append(table[len(seq.block_table)])
        evaluated = pos == S - 1
        slots = engine.decode_slots([views.row], [pos % bs])  # [L, 1]
        tic = time.perf_counter()
        for layer in range(L):
            engine.write_decode_tokens(layer, slots[layer], dev(inputs.k[layer, pos:pos + 1]),
                                       dev(v_all[layer, pos:pos + 1]))
            engine.start_recording()
            _clear_density(decode_policy)
            out = decode_policy.compute_chunked_decode(dev(inputs.q[layer, pos:pos + 1]), layer,
                                                       inputs.softmax_scale, engine, views, seq)
            if evaluated and "decode" in runs:
                run = runs["decode"]
                run.outputs.append(out)
                run.loads.append(engine.loaded_blocks(layer))
                run.densities.append(_read_density(decode_policy))
            if len(seq) % bs == 0:
                engine.offload_decode_buffer_async(layer, views.row, seq.block_table[pos // bs])
        if evaluated and "decode" in runs:
            _sync(device)
            runs["decode"].seconds = time.perf_counter() - tic
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
