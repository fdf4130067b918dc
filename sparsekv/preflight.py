"""The CLI checks every job's config of a command line before Hydra starts the first job, so a wrong key or value
in a sweep fails at once, in one line, instead of aborting (or failing) the sweep midway."""
from __future__ import annotations

import itertools
import os
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException

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
            check_output_dir(compose_config(job).get("output_dir"))
        except (ConfigError, PolicyConfigError, MissingConfigException) as exc:
            message = str(exc).strip()
            return f"{message} (in the job {' '.join(job)})" if multirun and len(job_list) > 1 else message
    return None
