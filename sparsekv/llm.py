"""The Python API: `LLM(model, overrides=[...]).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import numbers
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf

from sparsekv.config import ConfigError, config_dir
from sparsekv.config_check import check_config, explain_composition_error
from sparsekv.engine.llm_engine import LLMEngine, RequestOutput
from sparsekv.factory import build_engine
from sparsekv.plugins import get_plugin_manager
from sparsekv.progress import GenerationProgress
from sparsekv.sampling_params import SamplingParams


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The same composition and validation as the CLI: plugins first, then conf/config.yaml with the overrides,
    then sparsekv.config_check.check_config.

    A wrong key or value (also one added with `+`/`++`) raises ConfigError (a ValueError) naming the key and
    listing the valid keys or values; an out-of-range policy hyperparameter raises PolicyConfigError; an unknown
    group option (`model=nope`) raises Hydra's MissingConfigException listing the available ones.
    """
    get_plugin_manager()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        try:
            cfg = compose(config_name="config", overrides=list(overrides or []))
        except (MissingConfigException, ConfigError):
            raise
        except ConfigCompositionException as exc:
            raise explain_composition_error(exc) from exc
    return check_config(cfg)


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
        if isinstance(overrides, str):
            raise TypeError(f"overrides must be a list of 'key=value' strings, e.g. [{overrides!r}]; got a str")
        if config is not None:
            self.config = check_config(config)
        else:
            self.config = compose_config(model_overrides(model) + list(overrides or []))
        self.engine: LLMEngine = build_engine(self.config)

    @classmethod
    def from_config(cls, config: DictConfig) -> "LLM":
        return cls(config=config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 progress=None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either (one output per prompt, in order).
        Without sampling_params, the config's `sampling` node (`overrides=["sampling.max_tokens=3"]`) applies."""
        prompts = normalize_prompts(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params]
        for p in params:
            if p is not None and not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams or a list of them, not {type(p).__name__}")
        if sampling_params is None:
            sampling_params = default_sampling_params(self.config)
        if callable(progress):
            return self.engine.generate(prompts, sampling_params, progress)
        # a bar on stderr after 2 s (prefilled prompt tokens, then decode steps); progress=False keeps it off
        steps = max(p.max_tokens for p in (sampling_params if isinstance(sampling_params, list) else [sampling_params]))
        bars = GenerationProgress(self.engine, None, steps, enabled=progress is not False)
        try:
            return self.engine.generate(prompts, sampling_params, bars)
        finally:
            bars.close()


def default_sampling_params(cfg: DictConfig) -> SamplingParams:
    return SamplingParams(**OmegaConf.to_container(cfg.sampling))


PROMPT_SHAPES = "a string, a list of token ids, or a list of strings / token-id lists"


def normalize_prompts(prompts) -> list[str | list[int]]:
    """Any accepted prompt shape as a list of prompts; a wrong shape or type is a clear error here rather than
    a TypeError from deep inside the engine."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be {PROMPT_SHAPES}; got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompt is empty: pass a non-empty string or list of token ids (or a list of them)")
    if _is_token_id(prompts[0]):
        return [_token_ids(prompts, None)]
    out: list[str | list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(prompt)
        elif isinstance(prompt, (list, tuple)):
            out.append(_token_ids(prompt, i))
        else:
            raise TypeError(f"prompt {i} is a {type(prompt).__name__}; prompts must be {PROMPT_SHAPES}")
    return out


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(prompt, index: int | None) -> list[int]:
    where = "prompt" if index is None else f"prompt {index}"
    for t in prompt:
        if not _is_token_id(t):
            raise TypeError(f"{where}: token ids must be integers, got {t!r} ({type(t).__name__}); pass text as a "
                            "string, not inside a token list")
    return [int(t) for t in prompt]
