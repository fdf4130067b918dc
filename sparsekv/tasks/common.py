from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from omegaconf import DictConfig, OmegaConf


def output_dir(cfg: DictConfig) -> Path:
    """Hydra's run directory when running under the CLI, else cfg.output_dir or ./outputs."""
    if cfg.get("output_dir"):
        path = Path(cfg.output_dir)
    else:
        try:
            from hydra.core.hydra_config import HydraConfig

            path = Path(HydraConfig.get().runtime.output_dir)
        except ValueError:
            path = Path("outputs")
    path.mkdir(parents=True, exist_ok=True)
    return path


MODEL_DIMS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def write_record(cfg: DictConfig, name: str, figures: dict[str, Any], spec=None) -> Path:
    """`<run dir>/<name>.json` = {"config": resolved config, "status": "ok", **figures}; a failed multirun job
    passes {"status": "failed", "error": ..., "traceback": ...} (sparsekv.__main__). `spec`: the ModelSpec the
    run built, whose dimensions replace config.model's (a checkpoint's config.json overrides the config's)."""
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if spec is not None:
        config["model"].update({key: getattr(spec, key) for key in MODEL_DIMS})
    record = {"config": config, "status": "ok", **figures}
    path = output_dir(cfg) / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, default=str))
    return path


def enum_value(value: Any) -> Any:
    """An enum config value as its plain value (OffloadMode.cpu -> "cpu")."""
    return getattr(value, "value", value)


def run_identity(cfg: DictConfig, engine, name: str | None) -> dict[str, Any]:
    """The fields every task record starts with: what ran, where."""
    return {
        "name": name or f"{cfg.model.name} {enum_value(cfg.offload.mode)} {cfg.policy.name}",
        "model": cfg.model.name,
        "load_format": enum_value(cfg.model.load_format),
        "offload": enum_value(cfg.offload.mode),
        "policy": cfg.policy.name,
        "device": str(engine.device),
        "gpu_name": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "tensor_parallel_size": int(OmegaConf.select(cfg, "parallel.tensor_parallel_size", default=1)),
    }


@runtime_checkable
class BudgetedSelection(Protocol):
    """A block-selecting policy with a per-step budget, dense first layers and a short-sequence threshold (quest)."""
    dense_layers: int
    threshold_blocks: int

    def budget_blocks(self, block_size: int) -> int: ...


def policy_warnings(policy, layers: Sequence[int], block_size: int, context: int) -> list[str]:
    """Why `policy` selects nothing or everything on this run's shape (evaluated `layers`, `block_size`-token
    blocks, a `context`-token sequence), each a sentence with the setting to change; [] when its figures mean
    something. The dense policy ("full") computes everything by design and gets none."""
    from sparsekv.policies.full import FullAttentionPolicy

    if isinstance(policy, FullAttentionPolicy):
        return []
    blocks = context // block_size  # full blocks: the candidates a selection chooses from
    if blocks == 0:
        return [f"block size {block_size} >= context {context}: no full block to select, the policy loads 0 "
                "blocks and its figures measure nothing; use smaller blocks or a longer context"]
    out = []
    if isinstance(policy, BudgetedSelection):
        if layers and min(layers) >= 0 and max(layers) < policy.dense_layers:
            out.append(f"policy.dense_layers={policy.dense_layers} covers all {len(layers)} evaluated layers: every "
                       "block loads (density 1); set policy.dense_layers lower or evaluate more layers")
        if blocks <= policy.threshold_blocks:
            out.append(f"policy.threshold_blocks={policy.threshold_blocks} >= the {blocks} blocks of the context: "
                       "every block loads; lower policy.threshold_blocks or lengthen the context")
        budget = policy.budget_blocks(block_size)
        if blocks <= budget:
            out.append(f"the budget of {budget} blocks covers all {blocks} blocks of the context: every block loads; "
                       "lower policy.token_budget / policy.topk_blocks or lengthen the context")
    return out


def print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"warning: {warning}")


def reserve_largest_batch(engine, batches: Sequence[Sequence[int]], block_size: int) -> float:
    """Pin the host KV of the largest batch (each batch: its sequences' token counts, prompt and output) before the
    timed work, kept while idle: with offload=cpu every batch after an idle store would otherwise pin its KV again
    inside its prefill. A no-op for stores allocated up front. Returns the seconds spent."""
    tokens = max((sum(-(-n // block_size) * block_size for n in batch) for batch in batches), default=0)
    return engine.reserve(tokens) if tokens else 0.0
