"""Starting the ranks of a tensor-parallel engine and the command channel between them.

Two ways in, one shape afterwards: rank 0 drives, ranks 1..N-1 are workers waiting for commands.
  spawn     (the CLI and the Python API): the caller's process is rank 0 and starts N - 1 worker processes
            (`python -m sparsekv.distributed.worker`, fresh interpreters); they join a process group on 127.0.0.1.
            The workers outlive one engine: the next engine of the same size and device type (a sweep's next job,
            a test's next LLM) reuses them, unless the import path or the plugin settings changed since they started
            (a plugin they could not import): then new ones start. They exit with the caller (atexit, or on their
            own when it dies).
  torchrun  (RANK / WORLD_SIZE / LOCAL_RANK set, WORLD_SIZE = tensor_parallel_size): every process runs the same
            command; rank 0 goes on as the driver, the others turn into workers inside build_engine and exit when
            rank 0 does.
Shutdown (Ranks.close, at exit or when a group of another size is needed): every rank drops its engines' captured
CUDA graphs before destroy_process_group - a live graph that captured an NCCL collective keeps ncclCommDestroy waiting
forever - then rank 0 joins the workers with a timeout and kills, with a warning, one that does not exit.
Model collectives run on the default group (NCCL on CUDA, gloo on CPU). Commands run on a separate gloo group:
rank 0 broadcasts a pickled (name, engine id, args) tuple with broadcast_object_list; a worker blocks in the same
call until the next command comes. See sparsekv/distributed/worker.py for the commands.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sparsekv.distributed.state import TensorParallel
from sparsekv.plugins import ALLOW_LIST_ENV, DISABLE_AUTOLOAD_ENV

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = datetime.timedelta(days=30)  # workers wait this long for rank 0's next command
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TELL_SECONDS = 10.0  # the exit command reaches every worker (each waits in the command broadcast)
DESTROY_SECONDS = 20.0  # destroy_process_group on one rank
JOIN_SECONDS = 40.0  # a told worker's exit: its engine dropped, its group destroyed


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def check_launch(size: int, device_type: str) -> None:
    """ValueError before any process starts: more ranks than GPUs, no NCCL, a torchrun world of another size."""
    import torch.distributed as dist

    key = f"parallel.tensor_parallel_size={size}"
    if not dist.is_available():
        raise ValueError(f"{key} needs torch.distributed, which this torch build lacks; use "
                         "parallel.tensor_parallel_size=1")
    if device_type == "cuda":
        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(f"{key} needs one GPU per rank but {visible} CUDA device(s) are visible; lower it to at "
                             f"most {visible} (or expose more GPUs with CUDA_VISIBLE_DEVICES)")
        if not dist.is_nccl_available():
            raise ValueError(f"{key} on CUDA all-reduces through NCCL, which this torch build lacks; install a "
                             "torch build with NCCL or use parallel.tensor_parallel_size=1")
    elif not dist.is_gloo_available():
        raise ValueError(f"{key} on device=cpu all-reduces through gloo, which this torch build lacks")
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != size:
        raise ValueError(f"{key} but torchrun started {os.environ['WORLD_SIZE']} processes; run torchrun with "
                         f"--nproc-per-node {size} or set parallel.tensor_parallel_size={os.environ['WORLD_SIZE']}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_group(rank: int, size: int, local_rank: int, device_type: str, init_method: str
               ) -> tuple[TensorParallel, Any]:
    """Join the default process group (model collectives) and make the command group; returns (tp, command
    group). On CUDA the rank's device becomes current and NCCL's communicator is made now (before any graph
    capture records a collective)."""
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend_for(device_type), init_method=init_method, rank=rank, world_size=size, **kwargs)
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    tp = TensorParallel(rank=rank, size=size, group=dist.group.WORLD, local_rank=local_rank, control=commands)
    probe = torch.ones(1, device=torch.device("cuda", local_rank) if device_type == "cuda" else "cpu")
    tp.all_reduce(probe)
    if int(probe.item()) != size:
        raise RuntimeError(f"tensor-parallel group: an all-reduce of ones over {size} ranks gave {probe.item()}")
    return tp, commands


@dataclass
class Ranks:
    """Rank 0's handle on the group: the TensorParallel, the command group, the spawned workers (none under
    torchrun) and the engine id the workers now serve."""
    tp: TensorParallel
    device_type: str
    commands: Any
    processes: list = field(default_factory=list)
    engine_id: int = 0
    closed: bool = False
    engines: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # rank 0's live DistributedEngines
    launch: dict[str, str | None] = field(default_factory=dict)  # spawned workers: what they can import (launch_env)

    def send(self, name: str, *args: Any) -> None:
        import torch.distributed as dist

        if self.closed:
            raise RuntimeError("the tensor-parallel workers have exited; build a new engine")
        dist.broadcast_object_list([(name, self.engine_id, args)], src=0, group=self.commands)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(tp, *args) on every rank (fn importable by name, e.g. a module-level function); rank 0's result.
        fn must not raise on a worker (that ends the worker): reduce a check's outcome to rank 0 and raise there."""
        self.send("call", fn, args)
        return fn(self.tp, *args)

    def new_engine(self) -> int:
        self.engine_id += 1
        return self.engine_id

    def close(self, at_exit: bool = False) -> None:
        """Drop rank 0's graphs, tell the workers to exit, destroy the group, join the workers. Bounded: a worker
        stuck in a collective (rank 0 was interrupted mid-step) cannot take the command; it is killed with a
        warning after JOIN_SECONDS (1 s when the command did not go out), and rank 0 still exits. at_exit: also
        reset every CUDA graph still alive in the process (one the caller keeps a reference to)."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True  # before the workers exit: the watcher takes their exit as the expected one
        for engine in list(self.engines):
            engine.drop_graphs()
        release_device_memory(self.device_type, reset_graphs=at_exit)
        told = run_bounded(lambda: dist.broadcast_object_list([("exit", self.engine_id, ())], src=0,
                                                              group=self.commands), TELL_SECONDS)
        if told:  # the workers destroy theirs meanwhile; the ranks' communicators are gone together
            destroy_group(0)
        else:  # a collective may be pending: destroying would wait on it
            abort_group()
        deadline = time.monotonic() + (JOIN_SECONDS if told else 1.0)
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not exit %s; killing it", process.pid,
                            f"within {JOIN_SECONDS:.0f} s of the exit command" if told else
                            "(the exit command could not be sent: a rank is stuck in a collective)")
                process.kill()
                process.wait(timeout=10)


def run_bounded(fn: Callable[[], Any], seconds: float) -> bool:
    """fn() in a daemon thread; True when it returned within `seconds` (False: it raised or is still running)."""
    done = threading.Event()

    def target() -> None:
        try:
            fn()
            done.set()
        except Exception as exc:  # noqa: BLE001 - a peer already gone: the caller's fallback applies
            log.debug("tensor-parallel shutdown step failed: %s", exc)

    threading.Thread(target=target, name="sparsekv-tp-shutdown", daemon=True).start()
    return done.wait(seconds)


def release_device_memory(device_type: str, reset_graphs: bool = False) -> None:
    """Free what dropped engines and graphs held, and let their queued work finish, before the group goes.
    reset_graphs (the process is ending): reset every CUDA graph still alive, wherever it is referenced."""
    import gc

    gc.collect()
    if device_type == "cuda" and torch.cuda.is_initialized():
        if reset_graphs:
            for obj in gc.get_objects():
                if isinstance(obj, torch.cuda.CUDAGraph):
                    obj.reset()
        # a collective left pending by an interrupted step never completes: do not wait on it forever
        if not run_bounded(torch.cuda.synchronize, DESTROY_SECONDS):
            log.warning("tensor-parallel shutdown: the device's queued work did not finish within %.0f s (a "
                        "collective left pending?); going on", DESTROY_SECONDS)
            return
        torch.cuda.empty_cache()


def destroy_group(rank: int) -> bool:
    """destroy_process_group, bounded; on timeout abort the communicators (no wait on peers) and warn."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    if run_bounded(dist.destroy_process_group, DESTROY_SECONDS):
        return True
    log.warning("tensor-parallel rank %d: destroy_process_group did not return within %.0f s; aborting the "
                "process group instead", rank, DESTROY_SECONDS)
    return abort_group()


def abort_group() -> bool:
    """Abort the process group's communicators without waiting on peers or pending collectives (bounded)."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    return dist.is_initialized() and abort is not None and run_bounded(abort, DESTROY_SECONDS)


_RANKS: Ranks | None = None


def _watch(process, rank: int, ranks_ref: list) -> None:
    """A worker that dies leaves rank 0 waiting in a collective forever: say which one and end the process."""
    code = process.wait()
    ranks = ranks_ref[0]
    if ranks is not None and ranks.closed:
        return
    log.error("tensor-parallel worker rank %d exited with code %s (its error is above); ending rank 0", rank, code)
    os._exit(1)


def launch_env() -> dict[str, str | None]:
    """What decides the modules and plugins a spawned worker can load: this process's import path and plugin
    settings, as they are now."""
    return {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), DISABLE_AUTOLOAD_ENV:
            os.environ.get(DISABLE_AUTOLOAD_ENV), ALLOW_LIST_ENV: os.environ.get(ALLOW_LIST_ENV)}


def driver_ranks(size: int, device_type: str) -> Ranks:
    """Rank 0's group of `size` ranks on `device_type`: the running one when it matches (and, for spawned
    workers, when the import path and plugin settings are the ones they started with), else a new one (spawned
    workers, or torchrun's processes)."""
    global _RANKS
    if _RANKS is not None and not _RANKS.closed:
        if _RANKS.tp.size == size and _RANKS.device_type == device_type:
            if not _RANKS.processes or _RANKS.launch == launch_env():
                return _RANKS
            log.info("tensor parallelism: the import path or plugin settings changed since the workers started; "
                     "starting new ones")
        if under_torchrun():
            raise ValueError(f"parallel.tensor_parallel_size={size} on {device_type}: under torchrun every engine "
                             f"of the process uses the {_RANKS.tp.size} ranks on {_RANKS.device_type} it started with")
        _RANKS.close()
    if under_torchrun():
        tp, commands = init_group(0, size, int(os.environ["LOCAL_RANK"]), device_type, "env://")
        _RANKS = Ranks(tp, device_type, commands)
    else:
        _RANKS = _spawn(size, device_type)
    atexit.register(_RANKS.close, at_exit=True)  # before torch's own exit handlers (last registered runs first)
    return _RANKS


def _spawn(size: int, device_type: str) -> Ranks:
    """Workers are `python -m sparsekv.distributed.worker` processes with this process's sys.path: unlike
    multiprocessing's spawn they do not import the caller's __main__, so a script needs no main guard."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    launch = launch_env()
    env = {**os.environ, "PYTHONPATH": launch["PYTHONPATH"]}  # the plugin settings are os.environ's own
    ref: list[Ranks | None] = [None]
    processes = []
    for rank in range(1, size):
        command = [sys.executable, "-m", "sparsekv.distributed.worker", str(rank), str(size), device_type,
                   init_method, str(os.getpid())]
        process = subprocess.Popen(command, env=env)
        processes.append(process)
        threading.Thread(target=_watch, args=(process, rank, ref), name=f"sparsekv-tp-watch{rank}",
                         daemon=True).start()
    log.info("tensor parallelism: started %d worker process(es) for %d ranks on %s", size - 1, size, device_type)
    tp, commands = init_group(0, size, 0, device_type, init_method)
    ref[0] = Ranks(tp, device_type, commands, processes, launch=launch)
    return ref[0]
