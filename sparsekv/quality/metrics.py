"""Dense reference, per-phase metrics and evaluate(): a policy's attention against dense attention.

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
from typing import Any, Iterable

import torch

from sparsekv.kernels import flash_attn_with_lse_reference
from sparsekv.policies.base import SparsePolicy
from sparsekv.quality.harness import PhaseRun, block_table, run_offloaded, run_resident
from sparsekv.quality.planted import AttentionInputs

PHASES = ("decode", "prefill", "resident")
_SCORE_ELEMENTS = 1 << 25  # fp32 scores materialised at once by the dense reference and the mass computation


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
             num_gpu_blocks: int = 4, shuffle_blocks: bool = False, probe: bool = True,
             host_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Run `policy` on `inputs` in each requested phase (decode, prefill, resident) and compare it with dense
    attention. Returns {"policy", "inputs", <inputs.meta>, "phases": {phase: metrics or {"skipped": reason}}}.
    `host_dtype` other than the inputs' dtype (fp8, offload.host_dtype): the offloaded phases keep their host
    blocks in it, and their metrics gain host_kv_rel_error, the relative error of the policy's output against the
    same policy with host blocks in the inputs' dtype (the error of the host tier alone)."""
    phases = list(dict.fromkeys(phases))
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; choose from {', '.join(PHASES)}")
    table = block_table(inputs.layout.num_blocks, shuffle_blocks, inputs.meta.get("seed", 0))
    probe_values = needle_probe_values(inputs) if probe and inputs.needle_blocks else None
    offloaded = [p for p in phases if p != "resident"]
    runs: dict[str, PhaseRun] = {}
    probes: dict[str, PhaseRun] = {}
    same_dtype: dict[str, PhaseRun] = {}  # fp8 host blocks: the same runs with model-dtype ones
    if offloaded:
        kwargs = dict(phases=offloaded, num_gpu_blocks=num_gpu_blocks, shuffle_blocks=shuffle_blocks)
        runs.update(run_offloaded(policy, inputs, host_dtype=host_dtype, **kwargs))
        if host_dtype not in (None, inputs.dtype):
            same_dtype = run_offloaded(policy, inputs, **kwargs)
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
        if host_dtype not in (None, inputs.dtype) and phase in same_dtype:
            pairs = [relative_error(a, b) for a, b in zip(runs[phase].outputs, same_dtype[phase].outputs)]
            num, den = sum(a for a, _ in pairs), sum(b for _, b in pairs)
            report["phases"][phase]["host_kv_rel_error"] = math.sqrt(num / den) if den > 0 else 0.0
    return report
