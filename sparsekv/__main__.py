"""CLI: python -m sparsekv [group=option ...] [key=value ...]   (Hydra; add -m for a multirun sweep).

Every job's config, and before a sweep starts every job's config of the sweep, goes through
sparsekv.config_check.check_config: a bad key or value fails at once with one line (exit 2), not at job 7.
A single run composes its config once (sparsekv.single_run); a sweep and Hydra's flags go through @hydra.main."""
from __future__ import annotations

import gc
import logging
import sys
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

from sparsekv.config import ConfigError, config_dir
from sparsekv.config_check import check_config
from sparsekv.errors import PolicyConfigError
from sparsekv.plugins import get_plugin_manager
from sparsekv.preflight import job_error, preflight, split_argv
from sparsekv.single_run import compose_run, single_run_overrides
from sparsekv.tasks import get_task

get_plugin_manager()  # plugins register their configs before Hydra composes

USER_ERROR_EXIT_CODE = 2
CONFIG_NAME = "config"
log = logging.getLogger("sparsekv")


def is_user_error(exc: BaseException) -> bool:
    """A ValueError / FileNotFoundError raised by sparsekv's own validation (bad config value, missing
    checkpoint, prompt too long, ...): the message says what to change, a traceback adds nothing. The same
    exception types raised from inside torch, transformers etc. are bugs or surprises and keep their
    traceback. A config or policy hyperparameter error is always a user error, wherever it was raised."""
    if isinstance(exc, (ConfigError, PolicyConfigError)):
        return True
    if not isinstance(exc, (ValueError, FileNotFoundError)):
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return module == "sparsekv" or module.startswith("sparsekv.")


def in_multirun() -> bool:
    """True inside a job of a Hydra multirun sweep (`python -m sparsekv -m ...`)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:  # HydraConfig not set: the Python API or a test calling main's body directly
        return False


def record_failed_job(cfg: DictConfig, exc: BaseException) -> Path | None:
    """A failed job of a sweep leaves `<job dir>/<task name>.json` = {"config", "status": "failed", "error":
    "<type>: <message>", "traceback"} (sparsekv.tasks.report lists it as a failed row) and the sweep goes on."""
    from sparsekv.tasks.common import write_record

    error = f"{type(exc).__name__}: {exc}"
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if is_user_error(exc):
        log.error("job failed: %s", exc)
    else:
        log.error("job failed: %s\n%s", error, trace.rstrip())
    name = str(cfg.task.get("name") or "task") if cfg.get("task") is not None else "task"
    try:
        path = write_record(cfg, name, {"status": "failed", "error": error, "traceback": trace})
    except Exception as write_exc:  # noqa: BLE001 - the sweep goes on even when the record cannot be written
        log.error("could not write the failed record: %s: %s", type(write_exc).__name__, write_exc)
        return None
    log.error("failed record: %s", path)
    return path


def log_to_run_dir(message: str) -> None:
    """`message` into the run directory's log file (Hydra's file handler) only: the terminal has its own line."""
    record = logging.LogRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers + log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def release_memory() -> None:
    """After a failed job: drop the frames the traceback kept alive (the engine, its KV pool) and hand the cached
    device memory back, so the next job of the sweep starts with the memory the failed one held."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_one_job(cfg: DictConfig) -> None:
    """One job (of a single run or of a sweep) on its composed config; Hydra has set up its directory and logging."""
    failed = False
    try:
        check_config(cfg)
        get_task(cfg.task.name)(cfg)
    except Exception as exc:  # noqa: BLE001 - sorted into sweep failures, user errors and the rest just below
        # (torch.cuda.OutOfMemoryError is a RuntimeError, so an OOM job is recorded like any other failure)
        if in_multirun():
            sys.stdout.flush()
            record_failed_job(cfg, exc)
            failed = True
        else:
            if not is_user_error(exc):
                trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                log_to_run_dir(f"error: {type(exc).__name__}: {exc}\n{trace.rstrip()}")
                raise
            log_to_run_dir(f"error: {exc}")
            sys.stdout.flush()
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(USER_ERROR_EXIT_CODE)
    if failed:
        release_memory()


hydra_main = hydra.main(version_base=None, config_path=str(config_dir()), config_name=CONFIG_NAME)(run_one_job)


def override_syntax_error(argv: list[str]) -> str | None:
    """A command-line override Hydra cannot parse (an unquoted apostrophe, an unclosed bracket), as one line naming
    it and the quoting that works; Hydra alone would exit 1 with a lexer message."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    split = split_argv(argv)
    for override in split[0] if split is not None else []:
        try:
            OverridesParser.create().parse_overrides([override])
        except OverrideParseException as exc:
            reason = str(exc).splitlines()[0]
            return (f"cannot parse the override {override!r} ({reason}): close every bracket and quote, and put a "
                    "string with spaces, commas or apostrophes in Hydra quotes inside shell quotes, e.g. "
                    "prompt=\"'It\\'s a test, ok'\"")
    return None


def exit_with_user_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT_CODE)


def run_single(argv: list[str]) -> bool:
    """A plain single run from one composition of its config: the config is checked (a bad value or input exits 2
    before any work), then Hydra's run_job runs it. False, having done nothing, when the command line is not a plain
    run or does not compose: main's general path decides then."""
    overrides = single_run_overrides(argv)
    composed = compose_run(run_one_job, overrides, str(config_dir()), CONFIG_NAME) if overrides is not None else None
    if composed is None:
        return False
    try:
        error = job_error(composed.job_config())
        if error is not None:
            exit_with_user_error(error)
    except BaseException:
        composed.discard()
        raise
    composed.run(run_one_job)
    return True


def main() -> None:
    """The `sparsekv` command: the whole sweep's configs are checked, then Hydra runs the job(s)."""
    argv = sys.argv[1:]
    error = override_syntax_error(argv)
    if error is None and run_single(argv):
        return
    error = error or preflight(argv)
    if error is not None:
        exit_with_user_error(error)
    hydra_main()


if __name__ == "__main__":
    main()
