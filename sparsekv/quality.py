"""Attention quality of any SparsePolicy against dense attention, on tensors, without a model.

    from sparsekv.quality import planted_inputs, evaluate
    inputs = planted_inputs(context=8192, block_size=256, needle_depths=[0.5], device="cuda", dtype=torch.bfloat16)
    report = evaluate(policy, inputs)          # {"phases": {"decode": {...}, "prefill": {...}, "resident": {...}}}

Inputs (AttentionInputs) are Q/K/V of one sequence for a few layers: planted ones (planted_inputs: attention
sinks, local windows, vertical stripes and needle blocks the final queries look for) or a checkpoint's real ones
(task=quality captures them). The harness (run_policy) drives the policy exactly as OffloadKVStore does, through
a real HostPool + OffloadEngine: the prompt (all tokens but the last) is prefilled chunk by chunk, every layer's
chunk written to the prefill buffer and offloaded block by block (the policy's on_prefill_offload hook sees the
keys on the device), then compute_chunked_prefill runs; then the last token is one decode step through
compute_chunked_decode (a block that fills is offloaded afterwards, firing on_decode_offload). compute_prefill
(offload=none) is evaluated on the whole prompt. Loaded blocks are observed at OffloadEngine.load_to_slot_layer.

Phases and what is evaluated:
  decode    the last token's query (compute_chunked_decode); selectable = full blocks before its block
  prefill   the last prefill chunk's queries (compute_chunked_prefill); selectable = blocks before the chunk
  resident  every prompt query through compute_prefill (offload=none; keys on the device)
A policy that does not support a phase is reported as skipped for it (the engine pairs it with full attention).

Metrics per phase (means over layers, heads and query rows):
  recall        dense attention mass on the blocks the policy attended: the loaded blocks plus those it always
                computes (decode tail block, current prefill chunk). None for a policy that reports a
                `last_density` below its block density (it computes only part of what it loads; see rel_error
                and the needle metrics); block_recall keeps the loaded-block figure.
  oracle_recall the recall of the best choice of as many blocks (dense top mass), for reference
  density       the policy's own `last_density` when it records one, else loaded / selectable blocks
  rel_error     ||o - o_dense|| / ||o_dense|| over every layer's output rows
  needle_loaded fraction of (layer, needle block) pairs whose block was loaded
  needle_recall from a second "probe" run whose values are needle indicators: the policy's output is then the
                attention mass it put on the needle (renormalised over what it computed); the fraction of the
                dense needle mass kept, min(policy, dense) / dense, summed over layers, heads, needle queries
  needle_hit    fraction of needle-attending (layer, head, query, needle) whose probe mass reaches half the
                dense one. Works for compute policies (MInference) as well as for selection policies.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence as Seq

import torch

from sparsekv.kernels import flash_attn_with_lse_reference
from sparsekv.kvcache.host_pool import HostPool
from sparsekv.kvcache.offload_engine import OffloadEngine
from sparsekv.policies.base import SparsePolicy

PHASES = ("decode", "prefill", "resident")
_SCORE_ELEMENTS = 1 << 25  # fp32 scores materialised at once by the dense reference and the mass computation


# ---------------------------------------------------------------------------------------------- inputs


@dataclass
class AttentionInputs:
    """Q/K/V of one sequence of `context` tokens for a few layers (any device; computation runs on `device`)."""
    q: torch.Tensor  # [L, S, H, D]
    k: torch.Tensor  # [L, S, KVH, D]
    v: torch.Tensor  # [L, S, KVH, D]
    block_size: int
    softmax_scale: float
    device: torch.device
    needle_blocks: list[int] = field(default_factory=list)  # logical block indices holding needles
    needle_queries: int = 1  # the last n positions' queries are the ones that look for the needles
    prefill_chunk: int | None = None  # tokens per chunked-prefill chunk (default: 4 blocks)
    decode_steps: int = 0  # tokens decoded (hooks, attention) before the evaluated last token
    layer_ids: list[int] | None = None  # the model's layer ids of the L layers (reporting only)
    name: str = "planted"
    meta: dict[str, Any] = field(default_factory=dict)  # depth, seed, ... (copied into the report)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.q.dim() != 4 or self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(f"expected q [L, S, H, D], k/v [L, S, KVH, D]; got q {tuple(self.q.shape)}, "
                             f"k {tuple(self.k.shape)}, v {tuple(self.v.shape)}")
        if self.q.shape[:2] != self.k.shape[:2] or self.q.shape[3] != self.k.shape[3]:
            raise ValueError(f"q {tuple(self.q.shape)} and k {tuple(self.k.shape)} disagree on layers, tokens or "
                             "head dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be positive")
        if self.context < 2 + self.decode_steps:
            raise ValueError(f"context={self.context} needs at least {2 + self.decode_steps} tokens (a prompt token, "
                             f"{self.decode_steps} decode steps and the evaluated token)")
        chunk = self.chunk
        if chunk < self.block_size or chunk % self.block_size:
            raise ValueError(f"prefill_chunk={chunk} must be a positive multiple of block_size={self.block_size}")

    @property
    def num_layers(self) -> int:
        return self.q.shape[0]

    @property
    def context(self) -> int:
        return self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def chunk(self) -> int:
        return self.prefill_chunk or 4 * self.block_size

    @property
    def layout(self) -> "Layout":
        return layout(self.context, self.block_size, self.chunk, self.decode_steps)


@dataclass(frozen=True)
class Layout:
    """Where the phases fall in a sequence of `context` tokens."""
    context: int
    block_size: int
    chunk: int
    prompt_len: int  # prefilled tokens; the rest are decoded one by one, the last one evaluated
    last_chunk_start: int  # first position of the prompt's last prefill chunk
    decode_full_blocks: int  # blocks before the evaluated decode token's block (selectable in decode)
    prefix_blocks: int  # blocks before the last prefill chunk (selectable in prefill)
    num_blocks: int


def layout(context: int, block_size: int, chunk: int, decode_steps: int = 0) -> Layout:
    prompt = context - 1 - decode_steps
    last_start = ((prompt - 1) // chunk) * chunk
    return Layout(context, block_size, chunk, prompt, last_start, (context - 1) // block_size,
                  last_start // block_size, -(-context // block_size))


def needle_block_indices(depths: Iterable[float], lay: Layout) -> list[int]:
    """Logical block of each needle depth in [0, 1], within the blocks both phases may select (the prefill prefix;
    the decode full blocks when the prompt is a single chunk), avoiding block 0 (sinks) when there is room."""
    selectable = lay.prefix_blocks if lay.prefix_blocks else lay.decode_full_blocks
    if selectable < 1:
        return []
    low = 1 if selectable > 1 else 0
    blocks = []
    for depth in depths:
        if not 0.0 <= float(depth) <= 1.0:
            raise ValueError(f"needle depth {depth} is outside [0, 1]")
        block = low + int(round(float(depth) * (selectable - 1 - low)))
        if block not in blocks:
            blocks.append(block)
    return blocks


def planted_inputs(context: int = 4096, block_size: int = 256, *, num_layers: int = 1, num_heads: int = 8,
                   num_kv_heads: int = 2, head_dim: int = 64, needle_depths: Seq[float] = (0.5,),
                   prefill_chunk: int | None = None, decode_steps: int = 0, needle_queries: int | None = None,
                   sink_tokens: int = 4, num_stripes: int = 8, local_window: int | None = None,
                   sink_logit: float = 8.0, stripe_logit: float = 5.0, local_logit: float = 4.0,
                   needle_logit: float = 6.0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   seed: int = 0) -> AttentionInputs:
    """Q/K/V with planted structure, seeded. The first half of each head's dims carries content, the second a
    positional code (sinusoids slower than the local window, so nearby queries and keys agree). Per KV head:

      sinks     the first `sink_tokens` keys have a large component along the heads' query direction u
      stripes   `num_stripes` random key positions with a component along u (every query likes them)
      local     queries and keys share the positional code: recent keys score up to `local_logit` more
      needles   the keys of each needle block lie along a second direction w that only the needle queries carry
                (the last `needle_queries` positions: by default the last prefill chunk and the decoded tokens)

    The *_logit parameters are the score (scaled q.k) each structure adds; the unstructured scores have a standard
    deviation of about 1.2.
    """
    if head_dim < 8 or head_dim % 4:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 4, at least 8")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    chunk = prefill_chunk or 4 * block_size
    lay = layout(context, block_size, chunk, decode_steps)
    if needle_queries is None:
        needle_queries = context - lay.last_chunk_start
    needle_blocks = needle_block_indices(needle_depths, lay)
    window = local_window or block_size
    scale = head_dim ** -0.5
    gen = torch.Generator().manual_seed(seed)
    content, pos = head_dim // 2, head_dim - head_dim // 2
    group = num_heads // num_kv_heads
    a = math.sqrt(head_dim)  # query norm along u and w
    positions = torch.arange(context, dtype=torch.float64)
    qs, ks, vs = [], [], []
    for _ in range(num_layers):
        q = torch.zeros(context, num_heads, head_dim)
        k = torch.zeros(context, num_kv_heads, head_dim)
        v = torch.randn(context, num_kv_heads, head_dim, generator=gen)
        stripes = torch.randperm(max(1, context - 1 - sink_tokens), generator=gen)[:num_stripes] + sink_tokens
        # positional code: r(i).r(j) = mean_m cos(w_m (i - j)), ~1 within the window, small beyond
        freqs = torch.rand(pos // 2, generator=gen, dtype=torch.float64) * (math.pi / (2 * window))
        angles = positions[:, None] * freqs[None, :]
        code = (torch.cat([angles.cos(), angles.sin()], dim=1) / math.sqrt(pos // 2)).float()  # [S, pos]
        gamma = math.sqrt(local_logit / scale)
        needle_rows = torch.zeros(context, dtype=torch.bool)
        needle_rows[context - needle_queries:] = True
        for g in range(num_kv_heads):
            basis, _ = torch.linalg.qr(torch.randn(content, 2, generator=gen))
            u, w = basis[:, 0], basis[:, 1]
            kc = torch.randn(context, content, generator=gen)
            kc[:sink_tokens] += (sink_logit / (scale * a)) * u
            kc[stripes] += (stripe_logit / (scale * a)) * u
            for block in needle_blocks:
                kc[block * block_size:(block + 1) * block_size] += (needle_logit / (scale * a)) * w
            k[:, g, :content] = kc
            k[:, g, content:] = gamma * code
            for h in range(g * group, (g + 1) * group):
                qc = torch.randn(context, content, generator=gen) + a * u
                qc[needle_rows] += a * w
                q[:, h, :content] = qc
                q[:, h, content:] = gamma * code
        qs.append(q), ks.append(k), vs.append(v)
    device = torch.device(device)
    stack = (lambda xs: torch.stack(xs).to(device=device, dtype=dtype))
    meta = {"context": context, "block_size": block_size, "depths": [float(d) for d in needle_depths], "seed": seed}
    return AttentionInputs(stack(qs), stack(ks), stack(vs), block_size, scale, device, needle_blocks, needle_queries,
                           prefill_chunk, decode_steps, None, "planted", meta)


# ---------------------------------------------------------------------------------------------- harness


class RecordingOffloadEngine(OffloadEngine):
    """An OffloadEngine that records every (layer, host block) it loads into the ring. Loads are observed where
    the engine issues them (the group loader when it has one, else load_to_slot_layer) and checked against
    transfer_stats["h2d_blocks"] by loaded_blocks()."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loads: list[tuple[int, int]] = []
        self._stats_mark = self.transfer_stats["h2d_blocks"]

    if hasattr(OffloadEngine, "_issue_group"):
        def _issue_group(self, layer: int, blocks: list[int], size: int) -> int:
            self.loads.extend((layer, int(b)) for b in blocks)
            return super()._issue_group(layer, blocks, size)
    else:  # pragma: no cover - the engine before grouped loads
        def load_to_slot_layer(self, slot: int, layer: int, cpu_block: int) -> None:
            self.loads.append((layer, int(cpu_block)))
            super().load_to_slot_layer(slot, layer, cpu_block)

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

    def decode_tail(self, seq, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.engine.get_decode_layer_kv(self.row, layer, (len(seq) - 1) % self.block_size + 1)


@dataclass
class PhaseRun:
    """What the policy produced in one phase: per layer the evaluated output rows, loaded host blocks and the
    density it reported."""
    outputs: list[torch.Tensor] = field(default_factory=list)  # per layer [n, H, D]
    loads: list[list[int]] = field(default_factory=list)  # per layer, host block ids in load order
    densities: list[float | None] = field(default_factory=list)
    seconds: float = 0.0


def _clear_density(policy) -> None:
    if hasattr(policy, "last_density") and not isinstance(getattr(type(policy), "last_density", None), property):
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
        rows = torch.tensor([views.row], dtype=torch.int64, device=device)
        offsets = torch.tensor([pos % bs], dtype=torch.int64, device=device)
        tic = time.perf_counter()
        for layer in range(L):
            engine.write_decode_tokens(layer, rows, offsets, dev(inputs.k[layer, pos:pos + 1]),
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


# ---------------------------------------------------------------------------------------------- metrics


def _row_chunks(num_rows: int, heads: int, keys: int) -> Iterable[tuple[int, int]]:
    step = max(1, _SCORE_ELEMENTS // max(1, heads * keys))
    for a in range(0, num_rows, step):
        yield a, min(num_rows, a + step)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Causal dense attention of q [n, H, D], the last n positions of k/v [S, KVH, D], in fp32 (reference kernel)."""
    n, S = q.shape[0], k.shape[0]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for a, b in _row_chunks(n, q.shape[1], S):
        end = S - n + b
        out[a:b] = flash_attn_with_lse_reference(q[a:b].float(), k[:end].float(), v[:end].float(), softmax_scale,
                                                 causal=True)[0]
    return out


def block_mass(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, block_size: int) -> torch.Tensor:
    """Dense causal attention probability mass per key block: q [n, H, D] are the last n positions of k [S, KVH, D]
    -> [H, n, num_blocks] fp32 (rows sum to 1)."""
    n, H, _ = q.shape
    S, KVH, _ = k.shape
    nb = -(-S // block_size)
    kf = k.float().transpose(0, 1).repeat_interleave(H // KVH, dim=0)  # [H, S, D]
    mass = torch.empty(H, n, nb, dtype=torch.float32, device=q.device)
    for a, b in _row_chunks(n, H, S):
        s = torch.matmul(q[a:b].float().transpose(0, 1), kf.transpose(1, 2)) * softmax_scale  # [H, r, S]
        i = torch.arange(S - n + a, S - n + b, device=q.device)[:, None]
        j = torch.arange(S, device=q.device)[None, :]
        p = torch.softmax(s.masked_fill(j > i, float("-inf")), dim=-1)
        p = torch.nn.functional.pad(p, (0, nb * block_size - S))
        mass[:, a:b] = p.view(H, b - a, nb, block_size).sum(-1)
    return mass


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(sum of squared differences, sum of squared reference): combine over layers, then sqrt(a / b)."""
    diff = out.float() - ref.float()
    return float((diff * diff).sum()), float((ref.float() ** 2).sum())


def recall_of(mass: torch.Tensor, blocks: Iterable[int]) -> float:
    """Mean over heads and rows of the mass [H, n, nb] on `blocks`."""
    index = sorted({int(b) for b in blocks if 0 <= int(b) < mass.shape[-1]})
    if not index:
        return 0.0
    return float(mass[..., index].sum(-1).mean())


def oracle_blocks(mass: torch.Tensor, selectable: int, count: int) -> list[int]:
    """The `count` selectable blocks (0 .. selectable-1) with the most dense mass over heads and rows."""
    if count <= 0 or selectable <= 0:
        return []
    totals = mass[..., :selectable].sum(dim=(0, 1))
    return torch.topk(totals, min(count, selectable)).indices.tolist()


def needle_probe_values(inputs: AttentionInputs) -> torch.Tensor:
    """Values whose dim i is 1 on the tokens of needle block i, 0 elsewhere: attention output = mass on the needle."""
    v = torch.zeros_like(inputs.v)
    for i, block in enumerate(inputs.needle_blocks[: inputs.head_dim]):
        v[:, block * inputs.block_size:(block + 1) * inputs.block_size, :, i] = 1
    return v


def needle_scores(probe_out: torch.Tensor, dense_probe: torch.Tensor, num_needles: int,
                  threshold: float) -> tuple[float, float, int, int]:
    """probe outputs [n, H, D] (dims < num_needles = needle mass). Returns (kept mass, dense mass, hits, counted)
    where counted are (row, head, needle) whose dense needle mass exceeds `threshold`."""
    pol = probe_out[..., :num_needles].float().clamp_min(0)
    ref = dense_probe[..., :num_needles].float()
    kept = float(torch.minimum(pol, ref).sum())
    attending = ref > threshold
    hits = int(((pol >= 0.5 * ref) & attending).sum())
    return kept, float(ref.sum()), hits, int(attending.sum())


def _is_overridden(policy, name: str) -> bool:
    return getattr(type(policy), name, None) is not getattr(SparsePolicy, name)


def _phase_rows(phase: str, inputs: AttentionInputs) -> tuple[int, int]:
    """(first position, one past the last) of the query rows a phase evaluates."""
    lay = inputs.layout
    if phase == "decode":
        return inputs.context - 1, inputs.context
    if phase == "prefill":
        return lay.last_chunk_start, lay.prompt_len
    return 0, lay.prompt_len


def phase_metrics(phase: str, inputs: AttentionInputs, run: PhaseRun, probe: PhaseRun | None,
                  table: list[int], policy: SparsePolicy) -> dict[str, Any]:
    lay, bs = inputs.layout, inputs.block_size
    first, end = _phase_rows(phase, inputs)
    resident = phase == "resident"
    host_to_logical = {host: logical for logical, host in enumerate(table)}
    if phase == "decode":
        selectable = lay.decode_full_blocks
    elif phase == "prefill":
        selectable = lay.prefix_blocks
    else:
        selectable = 0
    always = set(range(selectable, -(-end // bs)))  # decode tail block / current chunk: always computed
    needles = [b for b in inputs.needle_blocks if b < selectable]
    needle_rows_from = max(first, inputs.context - inputs.needle_queries)
    probe_values = needle_probe_values(inputs) if probe is not None else None
    num_needles = min(len(inputs.needle_blocks), inputs.head_dim)

    err_num = err_den = 0.0
    max_abs = 0.0
    block_recalls, oracle_recalls, block_densities, needle_loaded, loaded_counts = [], [], [], [], []
    kept = dense_needle = 0.0
    hits = counted = 0
    for layer in range(inputs.num_layers):
        q = inputs.q[layer, first:end].to(inputs.device)
        k, v = inputs.k[layer, :end].to(inputs.device), inputs.v[layer, :end].to(inputs.device)
        out = run.outputs[layer]
        ref = dense_attention(q, k, v, inputs.softmax_scale)
        a, b = relative_error(out, ref)
        err_num, err_den = err_num + a, err_den + b
        max_abs = max(max_abs, float((out.float() - ref).abs().max()))
        del ref
        if not resident:
            loaded = [host_to_logical.get(h, -1) for h in run.loads[layer]]
            loaded_counts.append(len(loaded))
            chosen = {x for x in loaded if 0 <= x < selectable}
            block_densities.append(len(chosen) / selectable if selectable else 1.0)
            mass = block_mass(q, k, inputs.softmax_scale, bs)
            block_recalls.append(recall_of(mass, chosen | always))
            oracle_recalls.append(recall_of(mass, set(oracle_blocks(mass, selectable, len(chosen))) | always))
            del mass
            if needles:
                needle_loaded.append(sum(n in chosen for n in needles) / len(needles))
        if probe is not None and num_needles and end > needle_rows_from:
            rows = slice(needle_rows_from - first, end - first)
            dense_probe = dense_attention(q[rows], k, probe_values[layer, :end].to(inputs.device),
                                          inputs.softmax_scale)
            uniform = 1.0 / max(1, -(-end // bs))  # a needle-attending head beats a uniform block share
            a, b, h, c = needle_scores(probe.outputs[layer][rows], dense_probe, num_needles, uniform)
            kept, dense_needle, hits, counted = kept + a, dense_needle + b, hits + h, counted + c

    mean = (lambda xs: float(statistics.fmean(xs)) if xs else None)
    reported = mean([d for d in run.densities if d is not None])
    if resident:
        dense = not _is_overridden(policy, "compute_prefill") or (reported is not None and reported >= 1 - 1e-9)
        block_recall = block_density = 1.0 if dense else None
        density = reported if reported is not None else block_density
        recall = block_recall
    else:
        block_recall, block_density = mean(block_recalls), mean(block_densities)
        density = reported if reported is not None else block_density
        sparse_compute = reported is not None and reported < block_density - 1e-6
        recall = None if sparse_compute else block_recall
    return {
        "recall": recall,
        "block_recall": block_recall,
        "oracle_recall": mean(oracle_recalls),
        "density": density,
        "block_density": block_density,
        "reported_density": reported,
        "rel_error": math.sqrt(err_num / err_den) if err_den > 0 else 0.0,
        "max_abs_error": max_abs,
        "needle_loaded": mean(needle_loaded),
        "needle_recall": kept / dense_needle if dense_needle > 0 else None,
        "needle_hit": hits / counted if counted else None,
        "selectable_blocks": selectable,
        "loaded_blocks_per_layer": mean(loaded_counts),
        "query_rows": end - first,
        "seconds": run.seconds,
    }


def evaluate(policy: SparsePolicy, inputs: AttentionInputs, *, phases: Iterable[str] = PHASES,
             num_gpu_blocks: int = 4, shuffle_blocks: bool = False, probe: bool = True) -> dict[str, Any]:
    """Run `policy` on `inputs` in each requested phase (decode, prefill, resident) and compare it with dense
    attention. Returns {"policy", "inputs", <inputs.meta>, "phases": {phase: metrics or {"skipped": reason}}}."""
    phases = list(dict.fromkeys(phases))
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; choose from {', '.join(PHASES)}")
    table = block_table(inputs.layout.num_blocks, shuffle_blocks, inputs.meta.get("seed", 0))
    probe_values = needle_probe_values(inputs) if probe and inputs.needle_blocks else None
    offloaded = [p for p in phases if p != "resident"]
    runs: dict[str, PhaseRun] = {}
    probes: dict[str, PhaseRun] = {}
    if offloaded:
        kwargs = dict(phases=offloaded, num_gpu_blocks=num_gpu_blocks, shuffle_blocks=shuffle_blocks)
        runs.update(run_offloaded(policy, inputs, **kwargs))
        if probe_values is not None:
            probes.update(run_offloaded(policy, inputs, probe_values, **kwargs))
    if "resident" in phases:
        run = run_resident(policy, inputs)
        if run is not None:
            runs["resident"] = run
            if probe_values is not None:
                probes["resident"] = run_resident(policy, inputs, probe_values)
    report: dict[str, Any] = {"policy": getattr(policy, "name", type(policy).__name__), "inputs": inputs.name,
                              **inputs.meta, "needle_blocks": list(inputs.needle_blocks), "phases": {}}
    for phase in phases:
        if phase not in runs:
            which = "prefill" if phase in ("prefill", "resident") else "decode"
            report["phases"][phase] = {"skipped": f"policy {report['policy']} does not support {which} "
                                                  "(the engine pairs it with full attention)"}
            continue
        report["phases"][phase] = phase_metrics(phase, inputs, runs[phase], probes.get(phase), table, policy)
    return report


# ---------------------------------------------------------------------------------------------- sweeps, tables


def rows(reports: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per (report, phase): the report's fields without "phases", plus phase and its metrics."""
    flat = []
    for report in reports:
        base = {k: v for k, v in report.items() if k != "phases"}
        for phase, metrics in report["phases"].items():
            flat.append({**base, "phase": phase, **metrics})
    return flat


def sweep(policies: Iterable[SparsePolicy], inputs: Iterable[AttentionInputs], **kwargs) -> list[dict[str, Any]]:
    """evaluate() every policy on every input; flat rows (see rows())."""
    inputs = list(inputs)
    return rows(evaluate(policy, x, **kwargs) for policy in policies for x in inputs)


def sweep_field(policy_cls: type, field_name: str, values: Iterable[Any], inputs: Iterable[AttentionInputs],
                **kwargs) -> list[dict[str, Any]]:
    """One policy class at several values of one hyperparameter (e.g. Quest's token_budget); each row carries it."""
    inputs = list(inputs)
    out = []
    for value in values:
        for row in sweep([policy_cls(**{field_name: value})], inputs, **kwargs):
            out.append({field_name: value, **row})
    return out


def planted_grid(depths: Iterable[float], seeds: Iterable[int], **kwargs) -> list[AttentionInputs]:
    """planted_inputs for one needle at each depth and each seed."""
    return [planted_inputs(needle_depths=[d], seed=s, **kwargs) for s in seeds for d in depths]


def summarize(flat: list[dict[str, Any]], keys: Seq[str] = ("recall", "oracle_recall", "density", "rel_error",
                                                                "needle_loaded", "needle_recall", "needle_hit")
              ) -> dict[str, dict[str, float | None]]:
    """Mean of each metric per phase over the rows (skipped phases ignored)."""
    out: dict[str, dict[str, float | None]] = {}
    for phase in dict.fromkeys(r["phase"] for r in flat):
        phase_rows = [r for r in flat if r["phase"] == phase and "skipped" not in r]
        if not phase_rows:
            out[phase] = {"skipped": next(r["skipped"] for r in flat if r["phase"] == phase)}
            continue
        out[phase] = {}
        for key in keys:
            values = [r[key] for r in phase_rows if r.get(key) is not None]
            out[phase][key] = float(statistics.fmean(values)) if values else None
    return out


TABLE_COLUMNS = [("inputs", "inputs", None), ("depth", "depths", None), ("seed", "seed", None),
                 ("phase", "phase", None), ("recall", "recall", ".3f"), ("oracle", "oracle_recall", ".3f"),
                 ("density", "density", ".3f"), ("rel_err", "rel_error", ".2e"),
                 ("needle_ld", "needle_loaded", ".2f"), ("needle_rc", "needle_recall", ".3f"),
                 ("needle_hit", "needle_hit", ".2f"), ("ms", "seconds", None)]


def format_table(flat: list[dict[str, Any]], columns=TABLE_COLUMNS) -> str:
    def cell(row, key, spec):
        if "skipped" in row and key not in ("inputs", "depths", "seed", "phase"):
            return "skipped" if key == "recall" else ""
        value = row.get(key)
        if value is None:
            return "-"
        if key == "seconds":
            return f"{1e3 * value:.1f}"
        if isinstance(value, list):
            return ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in value)
        return f"{value:{spec}}" if spec else str(value)

    table = [[c[0] for c in columns]] + [[cell(r, key, spec) for _, key, spec in columns] for r in flat]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in table)
