"""ModelSpec: the architecture numbers a model class needs, from a checkpoint's config.json or the config."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Prompt tokens one MLP call takes at a time (GatedMLP): a whole-prompt prefill step (policy.whole_prompt_prefill)
# of 1M tokens would otherwise hold a [1M, 2 * intermediate_size] activation (38 GiB for Qwen3-4B) at once.
MLP_SLICE_TOKENS = 65536


class ModelLoadError(ValueError):
    """A checkpoint (config.json, index, safetensors) that cannot be loaded as it is: the message names the file,
    the key or tensor, and what to do."""


@dataclass
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]

    @property
    def kv_bytes_per_token(self) -> int:
        """Per token, all layers, K and V, in 2-byte elements scaled later by the dtype size."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, (int, str)) else [int(v) for v in value]


def spec_from_model_config(model_cfg) -> ModelSpec:
    """The dimensions written in the model config (used for dummy weights)."""
    values = {f.name: getattr(model_cfg, f.name) for f in fields(ModelSpec) if hasattr(model_cfg, f.name)}
    values["rope_scaling"] = dict(model_cfg.rope_scaling) if model_cfg.rope_scaling else None
    values["eos_token_ids"] = _eos_list(model_cfg.eos_token_id)
    return ModelSpec(**values)


REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config_json(config_file: Path) -> dict[str, Any]:
    """config.json as a dict, or a one-line ModelLoadError naming the file and what is wrong with it."""
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"{config_file} cannot be read ({exc.strerror or exc}); check its permissions or "
                             "download the checkpoint again") from None
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not UTF-8 text (byte {exc.start}); download the checkpoint's "
                             "config.json again") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno});"
                             " fix the file or download the checkpoint's config.json again") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} holds a JSON {type(raw).__name__}, not an object of config keys; "
                             "download the checkpoint's config.json again")
    return raw


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model.path={path}: no config.json there; point model.path at a Hugging Face "
                                "checkpoint directory (config.json + *.safetensors)")
    raw = read_config_json(config_file)
    if "text_config" in raw and "num_hidden_layers" not in raw:
        raw = {**raw, **raw["text_config"]}
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{config_file} names no `architectures`; cannot tell which model class to build")
    missing = [key for key in REQUIRED_KEYS if key not in raw]
    if missing:
        raise ModelLoadError(f"{config_file} (architecture {architectures[0]}) lacks {', '.join(missing)}: sparsekv "
                         "reads Llama/Qwen-style config keys; a plugin must provide other architectures")
    num_heads = raw["num_attention_heads"]
    rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    rope_theta = raw.get("rope_theta")
    if rope_theta is None and isinstance(rope_scaling, dict):
        rope_theta = rope_scaling.get("rope_theta")
    if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
        rope_scaling = None
    return ModelSpec(
        architecture=architectures[0],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_list(raw.get("eos_token_id")),
    )
