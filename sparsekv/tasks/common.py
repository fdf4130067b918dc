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
