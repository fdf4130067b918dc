"""offload.host_dtype: `auto` keeps the model dtype (tokens identical to resident KV); float8_e4m3fn stores host
KV as fp8 with per-(block, KV head) scales and decodes close to it. Tiny float32 model on CPU; fp8 quantization
from float32 works as from bf16."""
from __future__ import annotations

import pytest
import torch

from sparsekv import LLM, SamplingParams
from sparsekv.kernels import _dispatch
from sparsekv.kernels.fp8_kv import FP8_DTYPE
from tests.conftest import random_prompt

CPU = ["device=cpu", "dtype=float32"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=n) for n in (75, 33, 48)]
# small blocks and chunks: every prefill chunk after the first and every decode step read fp8 blocks from the host
LAYOUT = ["offload=cpu", "offload.host_pool_gib=0.05", "offload.block_size=16", "offload.num_gpu_blocks=2",
          "offload.prefill_chunk_size=16"]


def _generate(ckpt, host_dtype: str, prompt: list[int], run: list[str] = CPU, layout: list[str] = LAYOUT,
              params: SamplingParams = GREEDY) -> tuple[LLM, list[int], list[torch.Tensor]]:
    """Greedy tokens of one prompt (`run`: device, dtype, policy) and the logits each step sampled from."""
    llm = LLM(str(ckpt), overrides=[*run, *layout, f"offload.host_dtype={host_dtype}"])
    sampler, logits = llm.engine.runner.sampler, []
    sample = sampler.sample

    def recording(step_logits, *args, **kwargs):
        logits.append(step_logits[0].clone())
        return sample(step_logits, *args, **kwargs)

    sampler.sample = recording
    tokens = llm.generate([prompt], params)[0].token_ids
    return llm, tokens, logits


def test_auto_keeps_model_dtype_and_tokens(qwen3_ckpt):
    resident = LLM(str(qwen3_ckpt), overrides=CPU + ["offload.block_size=16"]).generate(PROMPTS, GREEDY)
    llm = LLM(str(qwen3_ckpt), overrides=CPU + LAYOUT + ["offload.host_dtype=auto"])
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in resident]
    store = llm.engine.kv_store
    assert store.host.dtype == torch.float32 and store.engine.fp8 is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_greedy_decode_stays_close(qwen3_ckpt, backend, request):
    """Until the first token where the two runs differ they see the same inputs, so their logits compare directly.
    fp8 rounds each K/V element by up to 2^-4 of itself (about 3.6% rms); this random tiny model's attention is
    peaked, so little of that averages out, and its logits move by 3-8% (measured); 0.15 leaves room for other
    seeds yet fails at once if the scales were wrong (errors of order 1). Tokens mostly agree: a near tie may flip
    one, and the runs then part."""
    if backend == "triton":
        request.getfixturevalue("triton_kernels")  # the decode kernel dequantizes on load, under the interpreter
    prompts = PROMPTS[:1] if backend == "triton" else PROMPTS
    same = total = 0
    for prompt in prompts:
        _, want, want_logits = _generate(qwen3_ckpt, "auto", prompt)
        llm, got, got_logits = _generate(qwen3_ckpt, "float8_e4m3fn", prompt)
        store = llm.engine.kv_store
        assert store.host.dtype == FP8_DTYPE and store.engine.kv_slots.dtype == FP8_DTYPE
        assert store.engine.prefill_k.dtype == torch.float32  # the chunk being written stays in the model dtype
        assert store.engine.fp8._scratch is None  # prefill and decode dequantize in their kernels, on load
        diverged = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        for a, b in zip(want_logits[:diverged + 1], got_logits[:diverged + 1]):
            assert (a - b).norm() / a.norm() < 0.15
        same += sum(a == b for a, b in zip(want, got))
        total += len(want)
    assert same >= 0.75 * total


def _dequantize_then_attend(self, q, k, v, ctx, reader):
    """The base policy's chunked prefill as it ran before the prefill kernel read fp8: every ring group dequantized
    to the model dtype (RingReader.groups, one dequantize launch per group), then dense attention."""
    from sparsekv.kernels import flash_attn_with_lse, merge_attention_outputs

    out, lse = flash_attn_with_lse(q, k, v, ctx.softmax_scale, causal=True)
    for group in reader.groups(self.checked_selection(ctx, reader)) if ctx.candidates else ():
        group_out, group_lse = flash_attn_with_lse(q, group.k, group.v, ctx.softmax_scale, causal=False)
        out, lse = merge_attention_outputs(group_out, group_lse, out, lse)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_prefill_dequantizes_on_load(qwen3_ckpt, backend, request, monkeypatch):
    """Offloaded prefill over fp8 host blocks reads the fp8 ring slots and their scales in the attention kernel:
    no separate dequantize launch runs (prefill or decode), and the tokens and logits equal those of dequantizing
    each ring group first and attending in the model dtype: bit for bit on the torch path (the same dequantized
    values, the same attention), within float32 rounding on the Triton path. Chunks of 32 keys (two blocks) run the
    prefill kernel, not the few-row split kernel."""
    from sparsekv.kernels import fp8_attention
    from sparsekv.kvcache import host_quant
    from sparsekv.policies.base import SparsePolicy

    if backend == "triton":
        if not _dispatch.triton_interpret():
            pytest.skip("the model runs on the CPU, where Triton runs only under TRITON_INTERPRET=1 (off-GPU hosts); "
                        "the CUDA kernel's checks: tests/kernels/test_fp8_attention.py")
        request.getfixturevalue("triton_kernels")
    calls = {"dequantize": 0, "fp8_prefill_kernel": 0}

    def counted(module, name: str, key: str) -> None:
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(host_quant, "dequantize_blocks", "dequantize")
    counted(fp8_attention, "_launch_fp8", "fp8_prefill_kernel")
    layout = ["offload=cpu", "offload.host_pool_gib=0.05", "offload.block_size=16", "offload.num_gpu_blocks=4",
              "offload.prefill_chunk_size=32"]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = {}
    for path in ("on_load", "dequantize_first"):
        if path == "dequantize_first":
            monkeypatch.setattr(SparsePolicy, "compute_chunked_prefill", _dequantize_then_attend)
        calls.update(dequantize=0, fp8_prefill_kernel=0)  # building the engine on CPU runs no prefill
        _, tokens, logits = _generate(qwen3_ckpt, "float8_e4m3fn", PROMPTS[0], layout=layout, params=greedy)
        runs[path] = (tokens, logits, dict(calls))
    (got, got_logits, got_calls), (want, want_logits, want_calls) = runs["on_load"], runs["dequantize_first"]
    assert got_calls["dequantize"] == 0 and want_calls["dequantize"] > 0  # the counter sees the old path's launches
    assert (got_calls["fp8_prefill_kernel"] > 0) == (backend == "triton")
    assert got == want
    for a, b in zip(want_logits, got_logits):
        if backend == "torch":
            assert torch.equal(a, b)
        else:
            assert (a - b).norm() / a.norm() < 1e-4


def test_bench_counts_fp8_bytes(tmp_path, monkeypatch):
    """task=bench with fp8 host KV: bytes per token, the PCIe floor and the bytes loaded per decode step are about
    half of bf16's (one byte per element plus a float32 scale per block and KV head)."""
    from sparsekv.tasks.bench import floors
    from tests.e2e.test_bench import run_bench

    ceilings = {"gpu_name": "fake", "matmul_dtype": "bfloat16", "matmul_tflops": 100.0, "hbm_gbps": 1000.0,
                "h2d_gbps": 0.05, "d2h_gbps": 0.05, "h2d_pageable_gbps": None}
    monkeypatch.setattr(floors, "measure_floors", lambda *a, **k: dict(ceilings))
    records = {}
    for host_dtype in ("auto", "float8_e4m3fn"):
        out = tmp_path / host_dtype
        out.mkdir()
        _, records[host_dtype] = run_bench(out, "device=cpu", "dtype=bfloat16", "offload=cpu", "offload.block_size=16",
                                           "offload.prefill_chunk_size=64", f"offload.host_dtype={host_dtype}",
                                           "task.context=160", "task.decode_steps=3", "task.warmup=false")
    bf16, fp8 = records["auto"], records["float8_e4m3fn"]
    assert bf16["host_dtype"] == "auto" and fp8["host_dtype"] == "float8_e4m3fn"
    head_dim = 16  # the tiny model's
    ratio = (1 + 4 / (16 * head_dim)) / 2  # fp8 + scales over bf16, per element
    assert fp8["kv_bytes_per_token"] == pytest.approx(bf16["kv_bytes_per_token"] * ratio, abs=1)
    assert fp8["decode_pcie_floor_ms"] == pytest.approx(bf16["decode_pcie_floor_ms"] * ratio, rel=1e-3)
    loaded = (fp8["decode_h2d_bytes_per_step"], bf16["decode_h2d_bytes_per_step"])
    assert loaded[1] > 0 and loaded[0] == pytest.approx(loaded[1] * ratio)


def test_quality_reports_the_fp8_host_error(tmp_path, capsys):
    """task=quality with offload.host_dtype=float8_e4m3fn: the offloaded phases read fp8 host blocks and report
    host_kv_rel_error, the output against the same policy with model-dtype host blocks: nonzero where host blocks
    are read (decode; the last prefill chunk reads its prefix too), fp8-sized, and none for the resident phase."""
    import json

    from sparsekv.llm import compose_config
    from sparsekv.tasks import get_task

    cfg = compose_config(["task=quality", "device=cpu", "task.context=384", "offload=cpu", "offload.block_size=32",
                          "offload.prefill_chunk_size=128", "offload.host_dtype=float8_e4m3fn", "task.num_layers=1",
                          "task.num_heads=4", "task.head_dim=16", "task.depths=[0.5]", "task.progress=false",
                          f"output_dir={tmp_path}"])
    get_task(cfg.task.name)(cfg)
    record = json.loads((tmp_path / "quality.json").read_text())
    assert record["host_dtype"] == "float8_e4m3fn"
    for phase in ("decode", "prefill"):
        error = record["summary"][phase]["host_kv_rel_error"]
        assert 0 < error < 0.15
        assert record["summary"][phase]["rel_error"] == pytest.approx(error, rel=0.5)  # full: fp8 is the error
    assert record["summary"]["resident"].get("host_kv_rel_error") is None  # no host blocks there
    assert "kv_err" in capsys.readouterr().out


def test_quest_metadata_comes_from_unquantized_keys(qwen3_ckpt):
    """Quest's per-block key bounds are taken before the block is quantized: layer 0's keys depend on the tokens
    alone, so its bounds with fp8 host KV equal those with model-dtype host KV bit for bit (bounds of dequantized
    keys would be off by fp8 rounding)."""
    bounds = {}
    for host_dtype in ("auto", "float8_e4m3fn"):
        llm = LLM(str(qwen3_ckpt), overrides=CPU + LAYOUT + [f"offload.host_dtype={host_dtype}", "policy=quest",
                                                            "policy.dense_layers=0", "policy.topk_blocks=2"])
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        policy = llm.engine.policy
        blocks = len(PROMPTS[0]) // 16
        bounds[host_dtype] = (policy._kmax.data[0, :blocks].clone(), policy._kmin.data[0, :blocks].clone())
    assert torch.equal(bounds["auto"][0], bounds["float8_e4m3fn"][0])
    assert torch.equal(bounds["auto"][1], bounds["float8_e4m3fn"][1])
    assert not torch.equal(bounds["auto"][0], bounds["auto"][1])  # real bounds, not an untouched table


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [["policy=full"], ["policy=quest", "policy.dense_layers=0", "policy.topk_blocks=2"]])
def test_gpu_fp8_decode_stays_close(qwen3_ckpt, policy):
    """On CUDA in bf16 with captured decode steps (graph=auto): fp8 blocks and their scales reach the ring through
    the copy engines (full) and the gather kernel (quest's device-side selection), the decode kernel dequantizes
    them on load, and the logits stay as close to bf16 host KV as on CPU."""
    cuda = ["device=cuda", "dtype=bfloat16", *policy]
    for prompt in PROMPTS:
        _, want, want_logits = _generate(qwen3_ckpt, "auto", prompt, cuda)
        llm, got, got_logits = _generate(qwen3_ckpt, "float8_e4m3fn", prompt, cuda)
        assert llm.engine.kv_store.engine.kv_slots.dtype == FP8_DTYPE
        diverged = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        # after the first differing token the two continuations are different texts: compare up to it
        for a, b in zip(want_logits[:diverged + 1], got_logits[:diverged + 1]):
            assert (a.float() - b.float()).norm() / a.float().norm() < 0.15
