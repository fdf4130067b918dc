"""One run of the CLI (no -m) from one composition of its config.

@hydra.main composes the config twice before a single job starts (once to read hydra.mode, once to run), and the
CLI's check of the job before any work composed it a third time: 0.1-0.2 s each. Here the command line is composed once,
the same way Hydra's run mode composes it (the main Hydra object, its config search path and job name, `hydra.mode`
added as Hydra adds it); the CLI checks that config, and Hydra's own run_job runs the job from it. Everything
@hydra.main gives a run is kept: the run directory (hydra.run.dir), .hydra/config.yaml, hydra.yaml and overrides.yaml,
the job's log file and logging config, HydraConfig inside the task, callbacks, and the report of a failed job (exit 1).

Anything else goes to @hydra.main unchanged: Hydra's flags (-m, --cfg, --help, --info, ...), an explicit hydra.mode, a
command line whose composition fails (the CLI's check then reports it as before, or Hydra in its own words), and any
Hydra other than 1.3, whose run path this follows."""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import hydra as hydra_package
from hydra._internal import hydra as hydra_internal
from hydra._internal.callbacks import Callbacks
from hydra._internal.hydra import Hydra
from hydra._internal.utils import (create_automatic_config_search_path,
                                   detect_calling_file_or_module_from_task_function, detect_task_name, run_and_report)
from hydra.core.global_hydra import GlobalHydra
from hydra.core.utils import configure_log, run_job
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import DictConfig, open_dict, read_write

MODE_OVERRIDE = "hydra.mode"
FOLLOWED_HYDRA = "1.3."  # the Hydra release whose run mode (Hydra.run, run_job) this reproduces


def single_run_overrides(argv: list[str]) -> list[str] | None:
    """The overrides of a command line that asks for one plain run, or None: any flag (-m, --cfg, --help, -p, ...)
    or a hydra.mode override leaves the command line to @hydra.main, as does a Hydra release this does not follow."""
    if not hydra_package.__version__.startswith(FOLLOWED_HYDRA) or any(arg.startswith("-") for arg in argv):
        return None
    if any(arg.split("=", 1)[0].lstrip("+~") == MODE_OVERRIDE for arg in argv):
        return None
    return list(argv)


@dataclass
class ComposedRun:
    """A single run's config, composed once with its Hydra node, and the Hydra object that composed it (registered
    as the GlobalHydra until `run` or `discard`)."""
    hydra: Hydra
    config_name: str
    overrides: list[str]  # as Hydra's run mode records them: the command line's, then hydra.mode=RUN
    config: DictConfig  # with the `hydra` node

    def job_config(self) -> DictConfig:
        """A copy of the job's part of the config (no `hydra` node): what the task would receive."""
        job = copy.deepcopy(self.config)
        with read_write(job), open_dict(job):
            del job["hydra"]
        return job

    def run(self, task_function: TaskFunction) -> None:
        """Hydra's run mode on this config; a failed job is reported as Hydra reports it (exit 1)."""
        try:
            run_and_report(lambda: self._run_job(task_function))
        finally:
            self.discard()

    def discard(self) -> None:
        GlobalHydra.instance().clear()

    def _run_job(self, task_function: TaskFunction) -> None:
        # what Hydra.run does after its composition (hydra/_internal/hydra.py): configure Hydra's own logging, print
        # the debug info that hydra.verbose asks for, run the job in hydra.run.dir, then re-raise a failed job's error
        cfg = self.config
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        hydra_internal.log = logging.getLogger(hydra_internal.__name__)  # _print_debug_info logs through it
        self.hydra._print_debug_info(self.config_name, self.overrides, RunMode.RUN)
        if cfg.hydra.mode is None:
            cfg.hydra.mode = RunMode.RUN
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name=self.config_name)
        result = run_job(hydra_context=HydraContext(config_loader=self.hydra.config_loader, callbacks=callbacks),
                         task_function=task_function, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None)
        callbacks.on_run_end(config=cfg, config_name=self.config_name, job_return=result)
        _ = result.return_value  # raises the job's exception, as Hydra.run does


def compose_run(task_function: TaskFunction, overrides: list[str], config_path: str,
                config_name: str) -> ComposedRun | None:
    """The run's config as @hydra.main(config_path, config_name) would compose it for `task_function` in run mode, or
    None when the composition fails (the caller then takes @hydra.main's path, which reports the error)."""
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name=detect_task_name(calling_file, calling_module),
                                     config_search_path=search_path)
    overrides = [*overrides, f"{MODE_OVERRIDE}=RUN"]  # _run_app adds it when no config sets hydra.mode
    try:
        cfg = hydra.compose_config(config_name=config_name, overrides=overrides, run_mode=RunMode.RUN)
    except Exception:  # noqa: BLE001 - reported by the path that reports it today
        GlobalHydra.instance().clear()
        return None
    return ComposedRun(hydra, config_name, overrides, cfg)
