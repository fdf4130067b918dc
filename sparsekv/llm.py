"""The Python API: `LLM(model, overrides=[...]).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig

from sparsekv.config import ConfigError, config_dir, explain_composition_error
from sparsekv.engine.llm_engine import LLMEngine, RequestOutput
from sparsekv.factory import build_engine
from sparsekv.plugins import get_plugin_manager
from sparsekv.sampling_params import SamplingParams


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The same composition as the CLI: plugins first, then conf/config.yaml with the overrides.

    A wrong key or value raises ConfigError (a ValueError) naming the key and, for enums, the allowed values;
    an unknown group option (`model=nope`) raises Hydra's MissingConfigException listing the available ones.
    """
    get_plugin_manager()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        try:
            return compose(config_name="config", overrides=list(overrides or []))
        except (MissingConfigException, ConfigError):
            raise
        except ConfigCompositionException as exc:
            raise explain_composition_error(exc) from exc


def model_overrides(model: str | None) -> list[str]:
    """A checkpoint directory, or the name of a model config (`tiny`, `qwen3_4b`, ...)."""
    if model is None:
        return []
    if Path(model).expanduser().is_dir() or "/" in model:
        return ["model=hf", f"model.path={_override_value(model)}"]
    return [f"model={model}"]


def _override_value(value: str) -> str:
    """Quote a value for Hydra's override grammar when it holds characters the grammar treats specially
    (spaces, commas, brackets, quotes, `=`, ...), so any directory name works as model.path."""
    if all(c.isalnum() or c in "/._-~+" for c in value):
        return value
    # inside quotes only backslashes before a quote or at the end are escapes; `${` would interpolate
    value = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return "'" + value.replace("${", "\\${") + "'"


class LLM:
    def __init__(self, model: str | None = None, overrides: list[str] | None = None,
                 config: DictConfig | None = None):
        self.config = config if config is not None else compose_config(model_overrides(model) + list(overrides or []))
        self.engine: LLMEngine = build_engine(self.config)

    @classmethod
    def from_config(cls, config: DictConfig) -> "LLM":
        return cls(config=config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 progress=None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either."""
        if not isinstance(prompts, str) and len(prompts) == 0:
            raise ValueError("prompt is empty: pass a non-empty string or list of token ids (or a list of them)")
        return self.engine.generate(prompts, sampling_params, progress)
