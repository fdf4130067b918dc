"""Decode figures of task=bench over a set of decode steps at one batch size, against the floors of that batch.

A plain run measures every decode step of its batch. `task.batch_curve=[1, 2, 4, 8]` (with task.batch_size=8)
measures a batch curve from one prefill: sequence i is given max_tokens so that it decodes through the curve's
points wider than i (with 16 decode steps: all eight sequences decode 16 steps together, four of them 16 more, two
16 more, one the last 16). The engine records each step's batch (RunStats.step_batch_sizes), and a point's figures
come from the steps that ran at its batch size after the first (settled), its KV transfer counters from those
steps' deltas.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from sparsekv.tasks.bench import floors as fl


def curve_sizes(batch_curve, batch_size: int) -> list[int]:
    """The curve's batch sizes, widest first ([] without a curve); its widest must be task.batch_size."""
    sizes = sorted({int(b) for b in batch_curve or []}, reverse=True)
    if sizes and len(sizes) != len(batch_curve):
        raise ValueError(f"task.batch_curve={list(batch_curve)} repeats a batch size; list each size once")
    if sizes and sizes[0] != batch_size:
        raise ValueError(f"task.batch_curve={list(batch_curve)} needs task.batch_size={sizes[0]} (its widest point), "
                         f"got task.batch_size={batch_size}; set task.batch_size={sizes[0]}")
    return sizes


def curve_max_tokens(sizes: list[int], steps: int) -> list[int]:
    """max_tokens of each of the widest batch's sequences: one from the prefill, then `steps` decode steps for
    every curve point wider than the sequence's index."""
    return [1 + steps * sum(size > i for size in sizes) for i in range(sizes[0])]


def steps_at(step_batch_sizes: list[int], batch: int) -> list[int]:
    """Indices of the decode steps that ran `batch` sequences."""
    return [i for i, size in enumerate(step_batch_sizes) if size == batch]


def settled(indices: list[int]) -> list[int]:
    """A curve point's steps after its first (which captures the new batch's graphs and loads what the GPU block
    cache lacks for it): the steady state its figures describe; all of them when it has one."""
    return indices[1:] if len(indices) > 1 else indices


def _summed_delta(snapshots: list[dict], before: dict | None, indices: list[int]) -> dict:
    """The numeric counters the KV store moved during the decode steps `indices` (snapshots[i]: after step i)."""
    total: dict[str, float] = {}
    for i in indices:
        prev = (snapshots[i - 1] if i > 0 else before) or {}
        for key, value in snapshots[i].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value - prev.get(key, 0)
    return total


@dataclass
class DecodeWork:
    """What a decode step must move, for the floors of any batch: the model, its KV layout and the ceilings."""
    gpu_spec: Any  # one rank's share of the model (floors.per_gpu_spec)
    context: int
    block_size: int
    num_layers: int
    policy: Any  # the engine's policy when it decodes, else None
    dtype_bytes: float  # bytes per KV element as stored (fp8 host tier: its bytes and scales)
    kv_bytes_per_token: int  # all ranks' KV heads
    weight_bytes: float
    engine_dtype: Any
    hbm_gbps: float | None
    h2d_gbps: float | None
    offloaded: bool
    tp_size: int = 1

    def figures(self, batch: int, step_seconds: list[float], indices: list[int], snapshots: list[dict] | None,
                before: dict | None) -> dict[str, Any]:
        """Figures of the decode steps `indices` (all ran `batch` sequences) against that batch's floors;
        snapshots: the KV store's transfer counters after each decode step (None: a store that counts nothing)."""
        from sparsekv.tasks.common import BudgetedSelection

        times = [step_seconds[i] for i in indices]
        median = statistics.median(times) if times else None
        # the KV length at the median step: step i attends context + i + 1 tokens
        decode_context = self.context + (indices[len(indices) // 2] if indices else 0)
        moved = _summed_delta(snapshots, before, indices) if snapshots is not None else None
        per_step = {k: v / len(indices) for k, v in moved.items()} if moved is not None and indices else None
        kv_density, selecting = 1.0, 0
        if isinstance(self.policy, BudgetedSelection):
            attended, selecting = fl.budgeted_selection(
                decode_context, self.block_size, self.num_layers, self.policy.budget_blocks(self.block_size),
                self.policy.dense_layers, self.policy.threshold_blocks)
            kv_density = attended / decode_context
        elif getattr(self.policy, "requires_block_selection", False):
            kv_density = self._measured_density(batch, decode_context, per_step)
        metadata = fl.block_bounds_bytes(self.gpu_spec, decode_context, self.block_size, batch, selecting,
                                         self.engine_dtype)
        dbytes = None if kv_density is None else fl.decode_bytes(
            self.gpu_spec, decode_context, batch, self.dtype_bytes, self.weight_bytes, kv_density, metadata)
        hbm_floor = dbytes / (self.hbm_gbps * 1e9) if self.hbm_gbps and dbytes is not None else None
        pcie_floor = (batch * decode_context * self.kv_bytes_per_token / (self.h2d_gbps * 1e9)
                      if self.offloaded and self.h2d_gbps else None)
        out: dict[str, Any] = {
            "batch_size": batch,
            "decode_steps": len(times),
            "decode_ms_per_token": _ms(median),  # median step
            "decode_ms_per_token_mean": _ms(statistics.mean(times) if times else None),
            "decode_tok_s": batch / median if median else None,  # all sequences, median step
            "decode_context": decode_context,
            "decode_kv_density": kv_density,  # share of the context's KV a step attends (HBM floor)
            "decode_metadata_bytes_per_step": metadata,  # a selection's key bounds read per step (HBM floor)
            "decode_bytes_per_step": dbytes,
            "decode_gbps": dbytes / median / 1e9 if median and dbytes is not None else None,
            "decode_hbm_floor_ms": _ms(hbm_floor),
            "decode_pcie_floor_ms": _ms(pcie_floor),
        }
        loaded_floor = None  # offloaded: the bytes the store loaded per step over the measured H2D rate
        if moved is not None:
            out["kv_transfer"] = {"decode": moved, "decode_per_step": per_step}
            h2d_keys = [k for k in (per_step or {}) if "h2d" in k.lower() and "byte" in k.lower()]
            if h2d_keys and self.h2d_gbps:
                loaded = sum(per_step[k] for k in h2d_keys) * self.tp_size  # rank 0 counts its heads' share
                loaded_floor = loaded / (self.h2d_gbps * 1e9)
                out.update({"decode_h2d_bytes_per_step": loaded, "decode_loaded_floor_ms": _ms(loaded_floor),
                            "decode_loaded_ratio": ratio(median, loaded_floor)})
            looked_up = sum(moved.get(f"cache_{k}_blocks", 0) for k in ("hit", "miss", "overflow"))
            if looked_up:  # GPU block cache: the share of looked-up blocks it held
                out["gpu_cache_hit_rate"] = moved.get("cache_hit_blocks", 0) / looked_up
        # a block-selecting policy (or a GPU block cache) loads less than the whole context: its floor is what it
        # loaded; the decode ratio is held against the larger (binding) floor
        binding = [f for f in (hbm_floor, pcie_floor if loaded_floor is None else loaded_floor) if f]
        floor = max(binding) if binding else None
        out.update({"decode_floor_ms": _ms(floor), "decode_ratio": ratio(median, floor)})
        return out


    def _measured_density(self, batch: int, decode_context: int, per_step: dict | None) -> float | None:
        """The share of the context's KV a selecting policy of unknown budget (a plugin's) attended per step: the
        full blocks the store loaded (every block crosses PCIe once per step without a GPU block cache) and the
        unfinished block; None where the store cannot tell (a cache serves some blocks, or nothing was counted)."""
        if not per_step or "h2d_blocks" not in per_step or any(
                per_step.get(f"cache_{k}_blocks") for k in ("hit", "miss", "overflow")):
            return None
        full = (decode_context - 1) // self.block_size
        loaded = per_step["h2d_blocks"] / (batch * self.num_layers)  # full blocks per sequence and layer
        return min(1.0, (loaded * self.block_size + decode_context - full * self.block_size) / decode_context)


def _ms(seconds: float | None) -> float | None:
    return 1e3 * seconds if seconds is not None else None


def ratio(seconds: float | None, floor_seconds: float | None) -> float | None:
    return seconds / floor_seconds if seconds and floor_seconds else None
