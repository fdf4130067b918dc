"""CLI: python -m sparsekv [group=option ...] [key=value ...]   (Hydra; add -m for a multirun sweep)."""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from sparsekv.config import config_dir
from sparsekv.plugins import get_plugin_manager
from sparsekv.tasks import get_task

get_plugin_manager()  # plugins register their configs before Hydra composes

USER_ERROR_EXIT_CODE = 2


def is_user_error(exc: BaseException) -> bool:
    """A ValueError / FileNotFoundError raised by sparsekv's own validation (bad config value, missing
    checkpoint, prompt too long, ...): the message says what to change, a traceback adds nothing. The same
    exception types raised from inside torch, transformers etc. are bugs or surprises and keep their
    traceback."""
    if not isinstance(exc, (ValueError, FileNotFoundError)):
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return module == "sparsekv" or module.startswith("sparsekv.")


@hydra.main(version_base=None, config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        get_task(cfg.task.name)(cfg)
    except Exception as exc:  # noqa: BLE001 - sorted into user errors and the rest just below
        if not is_user_error(exc):
            raise
        sys.stdout.flush()
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)


if __name__ == "__main__":
    main()
