"""task=ruler's settings, resolved and checked before any weights load (also by the CLI's preflight): the task
names, the lengths against scheduler.max_model_len, the tokenizer and whether its chat template applies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig

from sparsekv.tokenizer import HFTokenizer, Tokenizer


@dataclass(frozen=True)
class RulerSettings:
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]  # ascending, distinct
    chat_template: bool
    tokenizer: Any  # the checkpoint's transformers tokenizer (what the generators take)
    max_model_len: int  # scheduler.max_model_len, or unset the model's max_position_embeddings
    spec: Any  # the model's ModelSpec


def task_names(value: Any) -> tuple[str, ...]:
    """task.tasks as names: "all", a list, or a comma string; an unknown name lists the valid ones."""
    from sparsekv.tasks.ruler.generators import TASKS

    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    elif isinstance(value, (list, tuple, ListConfig)):
        items = [str(part).strip() for part in value]
    else:
        raise ValueError(f"task.tasks={value!r} must be 'all', a list of task names or a comma string; valid "
                         f"tasks: {', '.join(TASKS)}")
    items = [item for item in items if item]
    if not items:
        raise ValueError(f"task.tasks is empty: give 'all' or some of {', '.join(TASKS)}")
    if items == ["all"]:
        return tuple(TASKS)
    unknown = [item for item in items if item not in TASKS]
    if unknown:
        raise ValueError(f"task.tasks has unknown task {', '.join(map(repr, unknown))}; valid tasks: "
                         f"{', '.join(TASKS)} (or 'all')")
    return tuple(dict.fromkeys(items))


def chat_template_setting(value: Any) -> bool | None:
    """task.chat_template as True / False, or None for auto (Hydra hands `true` over as a bool, a str field as
    "True")."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("auto", "none", "null"):
        return None
    if text in ("true", "false"):
        return text == "true"
    raise ValueError(f"task.chat_template={value!r} must be auto, true or false")


def has_chat_template(tokenizer: Tokenizer | None) -> bool:
    return isinstance(tokenizer, HFTokenizer) and bool(tokenizer.inner.chat_template)


def check_ruler_config(task: DictConfig) -> tuple[tuple[str, ...], tuple[int, ...], bool | None]:
    """What the settings alone decide (sparsekv.config_check runs it when the config is composed): (task names,
    ascending distinct lengths, chat template wanted: True / False / None for auto)."""
    from sparsekv.tasks.ruler.generators import MAX_NEEDLES

    tasks = task_names(task.tasks)
    needles = task.get("needles")
    if needles is not None and (isinstance(needles, bool) or not isinstance(needles, int)
                                or not 2 <= needles <= MAX_NEEDLES):
        raise ValueError(f"task.needles={needles!r}: give 2 to {MAX_NEEDLES} (needles of niah_multikey, "
                         f"niah_multivalue and niah_multiquery, chains of variable_tracking), or null for the "
                         f"suite's own 4 and 2")
    if not task.lengths:
        raise ValueError("task.lengths is empty: give at least one context length in tokens, e.g. "
                         "task.lengths=[4096,16384]")
    return tasks, tuple(sorted({int(length) for length in task.lengths})), chat_template_setting(task.chat_template)


def ruler_settings(cfg: DictConfig) -> RulerSettings:
    """Every check task=ruler can make without the weights; raises ValueError naming the value and the fix."""
    from sparsekv.factory import check_scheduler_config, resolve_device
    from sparsekv.models.loader import resolve_spec
    from sparsekv.tokenizer import load_tokenizer

    tasks, lengths, wanted_template = check_ruler_config(cfg.task)
    spec = resolve_spec(cfg.model)
    tokenizer = load_tokenizer(cfg.model.path, spec.vocab_size)
    if not isinstance(tokenizer, HFTokenizer):  # the generators size prompts in the checkpoint's own tokens
        raise ValueError(f"task=ruler needs the checkpoint's tokenizer to write its prompts and read the answers: "
                         f"model {cfg.model.name} has {'none' if tokenizer is None else 'only a byte tokenizer'} "
                         "(give a checkpoint directory with tokenizer files as model.path, e.g. model=hf "
                         "model.path=/ckpt)")
    template = has_chat_template(tokenizer)
    if wanted_template and not template:
        raise ValueError(f"task.chat_template=true but the tokenizer of model {cfg.model.name} has no chat "
                         "template; use task.chat_template=auto or false")
    check_scheduler_config(cfg, spec, resolve_device(cfg))
    max_model_len = int(cfg.scheduler.max_model_len or spec.max_position_embeddings)
    too_long = [length for length in lengths if length >= max_model_len]
    if too_long and cfg.scheduler.max_model_len:
        raise ValueError(f"task.lengths has {too_long[0]} but scheduler.max_model_len={max_model_len}, which leaves no "
                         f"room for the answer: raise scheduler.max_model_len (to at least {too_long[-1]} + the "
                         "answer's tokens) or drop the length")
    if too_long:
        raise ValueError(f"task.lengths has {too_long[0]} but model {cfg.model.name} has {max_model_len} positions "
                         "(max_position_embeddings), which leaves no room for the answer: drop the length, or set "
                         "scheduler.max_model_len above it (positions past the trained range give unreliable answers)")
    return RulerSettings(tasks, lengths, template if wanted_template is None else wanted_template, tokenizer.inner,
                         max_model_len, spec)
