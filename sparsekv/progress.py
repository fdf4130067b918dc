"""tqdm bars on stderr for long work: a run shorter than DELAY_S seconds prints nothing."""
from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

DELAY_S = 2.0  # tqdm's `delay`: a bar appears only once its work has run this long


def bar(total: int | None, desc: str, unit: str, enabled: bool = True) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, mininterval=0.5, delay=DELAY_S,
                disable=not enabled, file=sys.stderr, leave=False)


class GenerationProgress:
    """engine.generate's per-step callback: a bar over the prompt tokens prefilled, then one over the decode steps
    (at most `max_decode_steps`; fewer when every sequence stops early). Counts start at the engine's figures when
    the callback is made, so one engine may serve several runs."""

    def __init__(self, engine: Any, prompt_tokens: int | None, max_decode_steps: int, enabled: bool = True):
        self.enabled = enabled
        self.prompt_base, self.decode_base = engine.stats.prompt_tokens, engine.stats.decode_steps
        self.prefill = bar(prompt_tokens, "prefill", "tok", enabled)
        self.max_decode_steps = max_decode_steps
        self.decode: tqdm | None = None

    def __call__(self, engine: Any) -> None:
        stats = engine.stats
        self.prefill.update(stats.prompt_tokens - self.prompt_base - self.prefill.n)
        steps = stats.decode_steps - self.decode_base
        if steps == 0:
            return
        if self.decode is None:
            self.prefill.close()
            self.decode = bar(self.max_decode_steps, "decode", "step", self.enabled)
        self.decode.update(steps - self.decode.n)

    def close(self) -> None:
        self.prefill.close()
        if self.decode is not None:
            self.decode.close()
