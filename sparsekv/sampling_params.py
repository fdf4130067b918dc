from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy.

    The one definition of the sampling defaults: it is also the config's `sampling` node (sparsekv.config.Config),
    which `LLM.generate(prompts)` and task=generate use when no SamplingParams is passed."""
    temperature: float = 1.0
    top_k: int = -1  # -1: no limit
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) or not (
                math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} must be a finite number >= 0; use 0 "
                             "for greedy decoding or a positive value")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, numbers.Real) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r} is outside (0, 1]; use 1.0 to disable nucleus "
                             "sampling")
        self.top_k = _integer("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k} is invalid; use -1 (no limit) or a positive "
                             "number")
        self.max_tokens = _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens} must be at least 1")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise ValueError(f"SamplingParams.stop_token_ids={self.stop_token_ids!r} must be a list of token ids")
        self.stop_token_ids = [_integer("stop_token_ids", t) for t in self.stop_token_ids]
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _integer(name: str, value) -> int:
    """An integer (or an integral float such as 16.0); anything else is a ValueError naming the field."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"SamplingParams.{name}={value!r} must be an integer")
