"""A worker rank (1..N-1) of a tensor-parallel engine: it builds the same engine as rank 0 (with its own heads) and
runs the same engine calls, in the same order, as rank 0's DistributedEngine sends them.

Every rank runs the whole engine - scheduler, block manager, KV store, graph runner - on the same requests. The
scheduler is a function of the requests and the sampled tokens, and the tokens are the same on every rank (the
logits are all-gathered, so a greedy argmax agrees; sampled rows are broadcast from rank 0), so every rank
schedules the same steps and the model's collectives pair up. No per-step traffic goes over the command channel:
one `generate` command runs a whole batch of requests.

Commands (name, engine id, args):
    build (cfg,)                  drop the engine held, build cfg's engine (factory.build_engine with this rank)
    generate (token_lists, params) LLMEngine.run_requests
    add_request (number, token_ids, params) / step () / abort (number,) / drain () / reserve (num_tokens,)
    release ()                    drop the engine (its GPU memory) until the next build
    call (fn, args)               fn(tp, *args), outside any engine (Ranks.call: collectives checked on every rank)
    exit ()                       drop the engine and its graphs, destroy the process group, end the process
A build that fails on any rank before its collectives (bad config on this machine, a checkpoint that does not
load) is reported on the command group: rank 0 raises the error, the workers stay for the next command. Any other
exception in a worker is printed with its traceback and ends the worker: rank 0 would otherwise wait in a
collective forever (the launcher's watcher ends rank 0 with a message; torchrun ends the other ranks).
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch

from sparsekv.distributed.state import BuildAborted


def _threads(size: int) -> None:
    """CPU ranks share the machine's cores."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def _exit_with(parent: int) -> None:
    """End this worker when rank 0's process is gone (killed: no exit command comes)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def worker_main(rank: int, size: int, device_type: str, init_method: str, parent: int) -> None:
    """Entry of a spawned worker process (`python -m sparsekv.distributed.worker RANK SIZE DEVICE INIT PARENT`)."""
    from sparsekv.distributed.launch import init_group

    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    if device_type == "cpu":
        _threads(size)
    try:
        tp, commands = init_group(rank, size, rank, device_type, init_method)
        serve(tp, commands)
    except BaseException:  # noqa: BLE001 - printed, then the process ends with an error code
        print(f"sparsekv tensor-parallel rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    code = 0
    try:
        finish(rank, device_type)
    except BaseException:  # noqa: BLE001 - the process ends either way
        print(f"sparsekv tensor-parallel rank {rank} failed to shut down cleanly:\n{traceback.format_exc()}",
              file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: nothing of torch's is left to destroy, and nothing can block


def finish(rank: int, device_type: str) -> None:
    """After `exit`: the engine is gone (serve returned); its memory and queued work are released before the
    process group is destroyed (bounded; see launch.destroy_group)."""
    from sparsekv.distributed.launch import destroy_group, release_device_memory

    release_device_memory(device_type, reset_graphs=True)
    destroy_group(rank)


def serve(tp, commands) -> None:
    """Run rank 0's commands until `exit`."""
    import torch.distributed as dist

    from sparsekv.distributed.engine import drop_graphs
    from sparsekv.plugins import get_plugin_manager

    get_plugin_manager()  # plugins' models and policies, as in rank 0's process
    engine, engine_id, requests = None, None, {}
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=commands)
        name, sent_id, args = box[0]
        if name == "exit":
            if engine is not None:
                drop_graphs(engine)
            return
        if name == "call":  # Ranks.call: a function on every rank, outside any engine
            args[0](tp, *args[1])
            continue
        if name in ("build", "release"):
            engine, requests = None, {}
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            if name == "build":
                from sparsekv.factory import build_engine

                try:
                    engine, engine_id = build_engine(args[0], tp=tp), sent_id
                except BuildAborted:  # rank 0 raised the failure (its own, or this rank's)
                    engine, engine_id = None, None
            continue
        if engine is None or sent_id != engine_id:
            raise RuntimeError(f"rank {tp.rank}: command {name} for engine {sent_id}, but this rank holds engine "
                               f"{engine_id}")
        if name == "generate":
            engine.run_requests(*args)
        elif name == "add_request":
            number, token_ids, params = args
            requests = {n: s for n, s in requests.items() if not s.is_finished}
            requests[number] = engine.add_request(token_ids, params)
        elif name == "step":
            engine.step()
        elif name == "abort":
            seq = requests.pop(args[0], None)
            engine.abort(seq) if seq is not None else engine.drain()
        elif name == "drain":
            engine.drain()
        elif name == "reserve":
            engine.reserve(*args)
        else:
            raise RuntimeError(f"rank {tp.rank}: unknown command {name!r}")


def run_torchrun_worker(size: int, device_type: str) -> None:
    """Under torchrun, ranks 1..N-1 serve rank 0 from inside build_engine, then the process ends."""
    from sparsekv.distributed.launch import init_group

    if device_type == "cpu":
        _threads(size)
    tp, commands = init_group(int(os.environ["RANK"]), size, int(os.environ["LOCAL_RANK"]), device_type, "env://")
    serve(tp, commands)
    finish(tp.rank, device_type)
    sys.exit(0)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
