from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy."""
    temperature: float = 1.0
    top_k: int = -1  # -1: no limit
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} is negative; use 0 for greedy "
                             "decoding or a positive value")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} is outside (0, 1]; use 1.0 to disable "
                             "nucleus sampling")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k} is invalid; use -1 (no limit) or a positive "
                             "number")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens} must be at least 1")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
