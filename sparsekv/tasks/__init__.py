"""Tasks selected with `task=<name>`: each is a function taking the composed config."""
from __future__ import annotations

import importlib
from typing import Callable

TASKS = {"generate": "sparsekv.tasks.generate:run",
         "bench": "sparsekv.tasks.bench.task:run",
         "report": "sparsekv.tasks.report:run",
         "quality": "sparsekv.tasks.quality:run",
         "needle": "sparsekv.tasks.needle:run",
         "ruler": "sparsekv.tasks.ruler.task:run",
         "plugins": "sparsekv.tasks.list_plugins:run"}


def get_task(name: str) -> Callable:
    if name not in TASKS:
        raise ValueError(f"task={name} is unknown; available: {', '.join(sorted(TASKS))}")
    module, func = TASKS[name].split(":")
    return getattr(importlib.import_module(module), func)
