"""Randomized differential test: sparsekv's float32 greedy tokens equal HF transformers' across engine layouts.

Each layout is drawn from a seeded RNG (its index is the seed): offload mode, block size, ring slots, chunk sizes,
prefill mode, a batch of 1-4 prompts of different lengths, graph mode, async decode, max_num_seqs, a KV pool small
enough to force preemption, and the checkpoint. A mismatch after a step where HF's top-2 logit gap is below
NEAR_TIE is a near-tie (rounding may flip it): recorded and warned about, not a failure. A failure prints the
overrides and prompts that reproduce it.
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sparsekv import LLM, SamplingParams
from tests.conftest import hf_greedy_gaps, make_checkpoint, random_prompt

CPU_LAYOUTS = 16
GPU_LAYOUTS = 200
NEAR_TIE = 1e-4
# the checkpoints make_checkpoint builds: 3 layers, 2 kv heads of 16 dims, float32 K and V
KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4
CPU_CHECKPOINTS = ["qwen3-tied", "llama-untied"]  # one per arch keeps the CPU run short
GPU_CHECKPOINTS = ["qwen3-tied", "qwen3-untied", "llama-tied", "llama-untied"]


@dataclass(frozen=True)
class Layout:
    index: int
    checkpoint: str
    overrides: tuple[str, ...]
    prompts: tuple[tuple[int, int], ...]  # (length, seed) of each prompt: random_prompt(length, seed=seed)
    max_tokens: int

    def describe(self, path: Path) -> str:
        return (f"layout {self.index} ({self.checkpoint}): LLM({str(path)!r}, overrides={list(self.overrides)}), "
                f"prompts=[random_prompt(n, seed=s) for n, s in {list(self.prompts)}], "
                f"SamplingParams(temperature=0, max_tokens={self.max_tokens}, ignore_eos=True)")


def draw_layout(index: int, device: str) -> Layout:
    rng = random.Random(index)
    gpu = device == "cuda"
    checkpoint = rng.choice(GPU_CHECKPOINTS if gpu else CPU_CHECKPOINTS)
    block_size = rng.choice([16, 32, 64] if gpu else [16, 32])
    max_tokens = rng.randint(8, 40) if gpu else rng.randint(4, 10)
    preempt = rng.random() < 0.4  # a KV pool too small for every sequence at once
    lengths = rng.sample(range(1, 150 if gpu else 48), rng.randint(2 if preempt else 1, 4))  # distinct lengths
    prompts = tuple((n, rng.randrange(1000)) for n in lengths)
    offload = rng.choice(["none", "cpu"])
    graph = rng.choice(["eager", "segmented", "cudagraph", "auto"] if gpu else ["eager", "auto"])
    overrides = [f"device={device}", "dtype=float32", f"offload={offload}", f"offload.block_size={block_size}",
                 f"graph={graph}", f"scheduler.async_decode={str(rng.random() < 0.5).lower()}",
                 f"scheduler.max_num_seqs={16 if preempt else rng.choice([1, 2, 3, 16])}"]
    if offload == "cpu":
        overrides += [f"offload.num_gpu_blocks={rng.randint(1, 6)}",
                      f"offload.prefill_chunk_size={block_size * rng.randint(1, 4)}",
                      f"offload.prefill_mode={rng.choice(['chunked', 'layerwise'])}"]
    else:
        overrides.append(f"scheduler.max_num_batched_tokens={rng.choice([7, 16, 33, 64, 8192])}")
    # preemption: the smallest pool that holds the longest sequence and, where it can, admits every prompt, so that
    # sequences run short of blocks while they decode (else they queue for admission)
    need = [-(-(n + max_tokens) // block_size) for n, _ in prompts]
    admit = max(max(need), sum(-(-n // block_size) for n, _ in prompts))
    blocks = (admit if admit < sum(need) else max(need)) if preempt and sum(need) > max(need) else None
    if offload == "none" and blocks is not None:
        overrides.append(f"offload.num_kv_blocks={blocks}")
    elif offload == "cpu":
        gib = (blocks + 0.5) * KV_BYTES_PER_TOKEN * block_size / 2**30 if blocks else 0.05
        overrides.append(f"offload.host_pool_gib={gib:.12f}")
    return Layout(index, checkpoint, tuple(overrides), prompts, max_tokens)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("differential")
    names = GPU_CHECKPOINTS if torch.cuda.is_available() else CPU_CHECKPOINTS
    return {name: make_checkpoint(root / name, name.split("-")[0], tie=name.endswith("-tied")) for name in names}


@pytest.fixture(scope="module", autouse=True)
def exact_float32():
    """float32 means float32: no TF32 matmuls or convolutions on CUDA, for HF and sparsekv alike."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


NEAR_TIES: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def near_tie_summary():
    yield
    if NEAR_TIES:
        print("\nnear-tie mismatches (not failures):\n  " + "\n  ".join(NEAR_TIES))


def check_layout(layout: Layout, path: Path, device: str, record_property) -> None:
    prompts = [random_prompt(n, seed=s) for n, s in layout.prompts]
    expected = [hf_greedy_gaps(path, p, layout.max_tokens, device=device) for p in prompts]
    llm = LLM(str(path), overrides=list(layout.overrides))
    preempted = []
    preempt = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=layout.max_tokens, ignore_eos=True))
    failures = []
    for i, (out, (tokens, gaps)) in enumerate(zip(outputs, expected)):
        got = out.token_ids
        if got == tokens:
            continue
        step = next((t for t, (a, b) in enumerate(zip(got, tokens)) if a != b), min(len(got), len(tokens)))
        tie = next((t for t in range(min(step + 1, len(gaps))) if gaps[t] < NEAR_TIE), None)
        detail = (f"prompt {i} (length {len(prompts[i])}): first mismatch at token {step}, "
                  f"sparsekv {got[step:step + 4]} vs HF {tokens[step:step + 4]}")
        if tie is not None and len(got) == len(tokens):
            note = f"{layout.describe(path)}: {detail}; HF top-2 gap {gaps[tie]:.2e} at token {tie}"
            NEAR_TIES.append(note)
            record_property(f"near_tie_prompt_{i}", note)
            warnings.warn(f"near-tie mismatch, not a failure: {note}", stacklevel=1)
        else:
            failures.append(f"{detail}; HF top-2 gaps up to it {[f'{g:.1e}' for g in gaps[:step + 1]]}")
    record_property("preemptions", len(preempted))
    assert not failures, f"{layout.describe(path)}\n  " + "\n  ".join(failures)


def test_cpu_layouts_cover_every_axis():
    """The fast subset still draws each offload mode, prefill mode, graph mode, async setting, multi-prompt
    batches and a pool small enough to preempt under each offload mode."""
    drawn = [draw_layout(i, "cpu") for i in range(CPU_LAYOUTS)]
    keys = {o for layout in drawn for o in layout.overrides}
    for value in ["offload=none", "offload=cpu", "offload.prefill_mode=chunked", "offload.prefill_mode=layerwise",
                  "graph=eager", "graph=auto", "scheduler.async_decode=true", "scheduler.async_decode=false"]:
        assert value in keys, value
    assert any(len(layout.prompts) > 1 for layout in drawn)
    assert any(o.startswith("offload.num_kv_blocks=") for o in keys)
    assert any(o.startswith("offload.host_pool_gib=") and o != "offload.host_pool_gib=0.050000000000" for o in keys)
    assert {layout.checkpoint for layout in drawn} == set(CPU_CHECKPOINTS)


@pytest.mark.parametrize("index", range(CPU_LAYOUTS))
def test_cpu_layout_matches_hf(index, checkpoints, record_property, one_thread):
    layout = draw_layout(index, "cpu")
    check_layout(layout, checkpoints[layout.checkpoint], "cpu", record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(GPU_LAYOUTS))
def test_gpu_layout_matches_hf(index, checkpoints, record_property):
    layout = draw_layout(index, "cuda")
    check_layout(layout, checkpoints[layout.checkpoint], "cuda", record_property)
