"""A tensor-parallel run's process exits on its own, in bounded time, and leaves no worker behind; a worker that
does not take the exit command is killed with a warning instead of holding rank 0."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sparsekv.distributed import launch
from tests.e2e.test_cli import cli_env
from sparsekv.distributed.launch import Ranks
from sparsekv.distributed.state import TensorParallel

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from sparsekv import LLM, SamplingParams
from sparsekv.distributed import launch
from tests.e2e.test_cli import cli_env
llm = LLM(sys.argv[1], ["dtype=float32", "parallel.tensor_parallel_size=2", "offload=none", "offload.block_size=16",
                        *sys.argv[2:]])
out = llm.generate([[5, 6, 7, 8] * 10], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), progress=False)
assert len(out[0].token_ids) == 4
print("WORKERS", *[p.pid for p in launch._RANKS.processes], flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_and_exit(ckpt: Path, *overrides: str, bound: float) -> None:
    env = {**cli_env(), "OMP_NUM_THREADS": "1"}  # the caller's PYTHONPATH kept (dependencies installed there)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt), *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=bound)
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - start < bound
    pids = [int(p) for line in done.stdout.splitlines() if line.startswith("WORKERS") for p in line.split()[1:]]
    assert len(pids) == 1
    deadline = time.monotonic() + 5  # an exited child is reaped by its parent's exit
    while _alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids[0]), f"worker pid {pids[0]} outlived rank 0"


def test_cpu_tp2_run_exits_and_leaves_no_worker(qwen3_ckpt):
    run_and_exit(qwen3_ckpt, "device=cpu", "graph=eager", bound=240)


@pytest.mark.gpu
def test_gpu_tp2_cudagraph_run_exits(qwen3_ckpt):
    """Captured decode graphs hold NCCL collectives: they are dropped before the group is destroyed."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    run_and_exit(qwen3_ckpt, "device=cuda", "graph=cudagraph", bound=240)


def test_close_kills_a_worker_that_cannot_take_the_exit_command(caplog, monkeypatch):
    """The exit command cannot go out (a rank is stuck in a collective): the worker gets about a second, then is
    killed, and the process group is left alone."""
    import torch.distributed as dist

    def stuck_rank(*args, **kwargs):
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(dist, "broadcast_object_list", stuck_rank)
    ended = []  # this test process's own group (other tests' workers) stays as it is
    monkeypatch.setattr(launch, "abort_group", lambda: ended.append("abort"))
    monkeypatch.setattr(launch, "destroy_group", lambda rank: ended.append("destroy"))
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ranks = Ranks(TensorParallel(rank=0, size=2), "cpu", commands=None, processes=[stuck])
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sparsekv.distributed.launch"):
        ranks.close()
    assert time.monotonic() - start < 15
    assert stuck.poll() is not None
    assert f"worker pid {stuck.pid} did not exit" in caplog.text
    assert ended == ["abort"]  # a pending collective would keep destroy_process_group waiting
