from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def write_record(cfg: DictConfig, name: str, figures: dict[str, Any]) -> Path:
    """`<run dir>/<name>.json` = {"config": resolved config, "status": "ok", **figures}; a failed multirun job
    passes {"status": "failed", "error": ..., "traceback": ...} (sparsekv.__main__)."""
    record = {"config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "status": "ok", **figures}
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
        "dtype": str(engine.dtype).replace("torch.", ""),
    }
