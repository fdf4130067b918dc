"""The CLI checks every job's config of a command line before Hydra starts the first job, so a wrong key or value
in a sweep fails at once, in one line, instead of aborting (or failing) the sweep midway. A single run's inputs
(the prompt's length, the task's settings) are checked too, before any weights load."""
from __future__ import annotations

import itertools
import os
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException
from omegaconf import DictConfig

from sparsekv.config import ConfigError
from sparsekv.errors import PolicyConfigError

# Hydra's own flags: these hand the command line to Hydra unchecked (help, shell completion, another config)
HANDS_OFF = {"--help", "-h", "--hydra-help", "--version", "--shell-completion", "-sc", "--config-path", "-cp",
             "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
TAKES_VALUE = {"--cfg", "-c", "--package", "-p"}
MULTIRUN = {"-m", "--multirun"}
MAX_JOBS_CHECKED = 256


def split_argv(argv: list[str]) -> tuple[list[str], bool] | None:
    """(overrides, multirun), or None when Hydra is asked for something other than running jobs."""
    overrides, multirun, skip = [], False, False
    for arg in argv:
        if skip:
            skip = False
        elif arg in HANDS_OFF or arg.split("=")[0] in HANDS_OFF:
            return None
        elif arg in TAKES_VALUE:
            skip = True
        elif arg in MULTIRUN:
            multirun = True
        elif not arg.startswith("-"):
            overrides.append(arg)
    return overrides, multirun


def jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands them (the cartesian product of the swept values);
    past MAX_JOBS_CHECKED jobs, every swept value once with the others at their first value."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override in parsed:
        if override.get_key_element().lstrip("+~").startswith("hydra"):
            continue
        if multirun and override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    total = 1
    for values in choices:
        total *= len(values)
    if total <= MAX_JOBS_CHECKED:
        return [list(job) for job in itertools.product(*choices)]
    first = [values[0] for values in choices]
    return [first[:i] + [value] + first[i + 1:] for i, values in enumerate(choices) for value in values]


def check_output_dir(output_dir: str | None) -> None:
    """A set output_dir must be a directory this process can create and write, before any weights load."""
    if not output_dir:
        return
    path = Path(output_dir).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fix = "choose a writable directory or leave output_dir unset (Hydra's run directory)"
    if not existing.is_dir():
        raise ConfigError(f"output_dir={output_dir} cannot be created: {existing} is not a directory; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir={output_dir} is not writable ({existing} denies writing); {fix}")


def check_task_inputs(cfg: DictConfig) -> None:
    """What a job's inputs need that the config schema cannot say, checked without the weights: the prompt of
    task=generate (tokenized with the model's tokenizer, which loads without them) against max_model_len, and the
    settings of task=bench, task=quality and task=ruler. Raises ValueError naming the value and the fix."""
    task = cfg.task.name
    if task == "generate":
        check_prompt(cfg)
    elif task == "bench":
        from sparsekv.models.loader import resolve_spec
        from sparsekv.tasks.bench.task import bench_config

        bench_config(cfg, resolve_spec(cfg.model))
    elif task == "quality":
        from sparsekv.tasks.quality import settings

        settings(cfg)
    elif task == "ruler":
        from sparsekv.tasks.ruler.settings import ruler_settings

        ruler_settings(cfg)


def check_prompt(cfg: DictConfig) -> None:
    """cfg.prompt is non-empty, tokenizable by the model's tokenizer and leaves room to generate."""
    from sparsekv.factory import resolve_device
    from sparsekv.kvcache.sizing import CPU_DEFAULT_MAX_MODEL_LEN
    from sparsekv.models.loader import resolve_spec
    from sparsekv.tokenizer import load_tokenizer

    prompt = cfg.prompt
    if not prompt:
        raise ValueError("prompt is empty: pass a non-empty prompt=\"...\"")
    spec = resolve_spec(cfg.model)
    tokenizer = load_tokenizer(cfg.model.path, spec.vocab_size)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model.name} has no tokenizer: give a checkpoint directory with tokenizer "
                         "files as model.path, or use the Python API with token-id lists")
    num_tokens = len(tokenizer.encode(str(prompt)))
    max_model_len = cfg.scheduler.max_model_len or spec.max_position_embeddings
    if not cfg.scheduler.max_model_len and resolve_device(cfg).type == "cpu":
        max_model_len = min(max_model_len, CPU_DEFAULT_MAX_MODEL_LEN)
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_tokens} tokens but max_model_len is {max_model_len}, which leaves no "
                         "room to generate: shorten the prompt, or raise scheduler.max_model_len (the model's "
                         f"maximum is {spec.max_position_embeddings})")


def job_error(cfg: DictConfig) -> str | None:
    """The first error of one run's composed config (no `hydra` node), or None: what preflight checks for a single
    run, on the composition sparsekv.single_run runs. check_config finishes `cfg` in place."""
    from sparsekv.config_check import check_config

    try:
        check_config(cfg)
        check_output_dir(cfg.get("output_dir"))
    except (ConfigError, PolicyConfigError, MissingConfigException) as exc:
        return str(exc).strip()
    try:
        check_task_inputs(cfg)
    except (ValueError, FileNotFoundError) as exc:
        return str(exc).strip()
    return None


def preflight(argv: list[str]) -> str | None:
    """The first config error of the command line's job(s), or None (also when Hydra should decide alone)."""
    from sparsekv.llm import compose_config

    split = split_argv(argv)
    if split is None:
        return None
    overrides, multirun = split
    try:
        job_list = jobs(overrides, multirun)
    except Exception:  # noqa: BLE001 - a malformed override: Hydra reports it in its own words
        return None
    for job in job_list:
        try:
            cfg = compose_config(job)
            check_output_dir(cfg.get("output_dir"))
        except (ConfigError, PolicyConfigError, MissingConfigException) as exc:
            message = str(exc).strip()
            return f"{message} (in the job {' '.join(job)})" if multirun and len(job_list) > 1 else message
    if not multirun:  # a sweep's job with a bad input fails alone and is recorded (sparsekv.__main__)
        try:
            check_task_inputs(cfg)
        except (ValueError, FileNotFoundError) as exc:
            return str(exc).strip()
    return None
