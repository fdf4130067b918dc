"""Compiling Triton kernels ahead (sparsekv/kernels/compile_ahead.py) on the CPU: a stand-in driver gives Triton a
Hopper target, so the record pass, the forked compiles (Triton ships ptxas) and the on-disk cache are the real ones.
The whole path on a GPU (tokens equal to a serial compile's, nothing left to the warm-up):
tests/e2e/test_gpu_compile_ahead.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime.jit import JITFunction  # noqa: E402

from sparsekv.kernels import compile_ahead  # noqa: E402
from sparsekv.kernels.backend import KernelChoice  # noqa: E402

pytestmark = pytest.mark.skipif(not compile_ahead.supported(), reason="Triton without knobs.runtime.jit_cache_hook")


def _scale(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


scale_kernel = JITFunction(_scale)  # a JITFunction even under TRITON_INTERPRET=1, which the conftest may set


class HopperDriver:
    """What Triton's launch path asks the active driver before it compiles (a launch would need a GPU)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        return ty


@pytest.fixture
def hopper(monkeypatch, tmp_path):
    from triton.runtime.driver import driver

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(driver, "_active", HopperDriver())
    monkeypatch.setattr(scale_kernel, "device_caches", type(scale_kernel.device_caches)(scale_kernel.create_binder))
    return tmp_path / "triton"


def launches(x, y):
    def run():
        scale_kernel[(4,)](x, y, 1000, 2.0, BLOCK=256)
        scale_kernel[(4,)](x, y, 1024, 2.0, BLOCK=256)  # n % 16 == 0: a second specialization
        scale_kernel[(4,)](x, y, 1000, 2.0, BLOCK=256)
    return run


def test_record_launches_nothing_and_lists_each_specialization_once(hopper):
    x, y = torch.ones(1024), torch.zeros(1024)
    specs, error = compile_ahead.record(launches(x, y))
    assert error is None
    assert [json.loads(s)["name"].rpartition(".")[2] for s in specs] == ["_scale", "_scale"]
    assert torch.equal(y, torch.zeros(1024))  # nothing ran
    assert not hopper.exists() or not any(hopper.iterdir())  # nothing compiled
    assert triton.knobs.runtime.jit_cache_hook is None and scale_kernel.run.__name__ == "run"  # restored


def test_record_returns_what_it_saw_before_an_error(hopper):
    x, y = torch.ones(1024), torch.zeros(1024)

    def fails():
        scale_kernel[(4,)](x, y, 1000, 2.0, BLOCK=256)
        raise RuntimeError("boom")

    specs, error = compile_ahead.record(fails)
    assert len(specs) == 1 and isinstance(error, RuntimeError)
    assert triton.knobs.runtime.jit_cache_hook is None


# Real compiles run in a fresh interpreter: the Triton interpreter that the kernel tests use in this process leaves
# triton.language patched, which breaks compiling a kernel for a GPU here (and in forks of here).
def in_fresh_process(scenario: str, cache, module: str = "tests.unit.test_compile_ahead") -> None:
    """Run `scenario` (a function of `module` taking the cache directory) in a new Python process whose Triton
    driver is HopperDriver."""
    code = ("import sys; from pathlib import Path; from triton.runtime.driver import driver; "
            f"import tests.unit.test_compile_ahead as hopper, {module} as m; "
            "driver.set_active(hopper.HopperDriver()); "
            f"m.{scenario}(Path(sys.argv[1]))")
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "TRITON_INTERPRET": "0"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code, str(cache)], env=env, cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def forked_compiles_fill_the_cache(cache) -> None:
    x, y = torch.ones(1024), torch.zeros(1024)
    specs, _ = compile_ahead.record(launches(x, y))
    figures = compile_ahead.compile_all(specs, workers=2)
    assert figures["failed"] == [] and figures["compiled"] == 2 and figures["workers"] == 2, figures
    entries = sorted(os.listdir(cache))
    assert len(entries) >= 2
    # the launch path's own compile (Triton's warm-up call: compile, no launch) finds both in the cache
    scale_kernel.run(x, y, 1000, 2.0, BLOCK=256, grid=(4,), warmup=True)
    scale_kernel.run(x, y, 1024, 2.0, BLOCK=256, grid=(4,), warmup=True)
    assert sorted(os.listdir(cache)) == entries


def failed_compile_is_reported(cache) -> None:
    x, y = torch.ones(1024), torch.zeros(1024)
    specs, _ = compile_ahead.record(launches(x, y))
    missing = json.loads(specs[0])
    missing["name"] = f"{__name__}._no_such_kernel"
    figures = compile_ahead.compile_all([json.dumps(missing), specs[1]], workers=2)
    assert figures["compiled"] == 1, figures["failed"]
    assert [name for name, _ in figures["failed"]] == [missing["name"]]
    assert "AttributeError" in figures["failed"][0][1]


def manifest_skips_the_record_pass(cache) -> None:
    x, y = torch.ones(1024), torch.zeros(1024)
    calls = []

    def warm_up():
        calls.append(1)
        launches(x, y)()

    key = {"config": {"model": {"hidden_size": 64}}}
    first = compile_ahead.compile_ahead(key, warm_up, workers=2)
    assert first["failed"] == [] and first["recorded"] and first["compiled"] == 2 and len(calls) == 1, first
    assert len(compile_ahead.read_manifest(compile_ahead.manifest_path(key))) == 2
    second = compile_ahead.compile_ahead(key, warm_up, workers=2)
    assert not second["recorded"] and second["compiled"] == 0 and len(calls) == 1
    other = compile_ahead.compile_ahead({"config": {"model": {"hidden_size": 128}}}, warm_up, workers=2)
    assert other["recorded"] and len(calls) == 2


def gluon_kernel_compiles_ahead(cache) -> None:
    from sparsekv.kernels import attention_sm90

    launches = []
    for dtype, causal in ((torch.bfloat16, True), (torch.float16, False)):  # causal prefill, a chunk's partial
        q, k, v = (torch.zeros(300, heads, 128, dtype=dtype) for heads in (8, 2, 2))
        launches.append(attention_sm90.kernel_launch(q, k, v, torch.zeros_like(q), torch.zeros(8, 300), 0.1, causal))
    kernel = attention_sm90._flash_fwd_sm90_kernel
    specs, error = compile_ahead.record(lambda: [kernel[grid](*args, **kw) for grid, args, kw in launches])
    assert error is None and [json.loads(s)["name"].rpartition(".")[2] for s in specs] == ["_flash_fwd_sm90_kernel"] * 2
    figures = compile_ahead.compile_all(specs, workers=2)
    assert figures["failed"] == [] and figures["compiled"] == 2, figures
    entries = sorted(os.listdir(cache))
    for grid, args, constants in launches:  # the launch path's compile is a cache load
        kernel.run(*args, grid=grid, warmup=True, **constants)
    assert sorted(os.listdir(cache)) == entries


def test_forked_compiles_fill_the_cache_that_the_launch_path_reads(tmp_path):
    in_fresh_process("forked_compiles_fill_the_cache", tmp_path / "triton")


def test_a_kernel_that_cannot_compile_is_reported_not_raised(tmp_path):
    in_fresh_process("failed_compile_is_reported", tmp_path / "triton")


def test_the_gluon_kernel_compiles_ahead_too(tmp_path):
    from sparsekv.kernels import attention_sm90

    if not attention_sm90.HAS_GLUON:
        pytest.skip("Triton without Gluon's Hopper layer")
    in_fresh_process("gluon_kernel_compiles_ahead", tmp_path / "triton")


def test_the_manifest_skips_the_record_pass_next_time(tmp_path):
    in_fresh_process("manifest_skips_the_record_pass", tmp_path / "triton")


def test_a_failed_record_pass_writes_no_manifest(hopper):
    def fails():
        raise RuntimeError("boom")

    key = {"config": "failing"}
    figures = compile_ahead.compile_ahead(key, fails, workers=2)
    assert isinstance(figures["record_error"], RuntimeError) and figures["compiled"] == 0
    assert compile_ahead.read_manifest(compile_ahead.manifest_path(key)) is None


def test_manifest_key_ignores_what_does_not_change_the_kernels():
    from sparsekv.engine.warm_start import manifest_key
    from sparsekv.llm import compose_config

    kernels = KernelChoice.torch_reference()
    gpu = {"name": "H100", "capability": [9, 0]}

    def key(*overrides):
        return manifest_key(compose_config(["model=qwen3_4b", *overrides]), kernels, gpu)

    base = key()
    assert key("prompt=hello", "sampling.max_tokens=3", "seed=7", "model.load_format=dummy",
               "compile_workers=4") == base
    assert key("policy=quest") != base
    assert key("offload=cpu") != base
    assert key("model.num_hidden_layers=2") != base
    assert manifest_key(compose_config(["model=qwen3_4b"]), kernels, {"name": "H200", "capability": [9, 0]}) != base


def test_compile_workers_is_validated():
    from sparsekv.config import ConfigError
    from sparsekv.llm import compose_config

    assert compose_config(["compile_workers=0"]).compile_workers == 0
    with pytest.raises(ConfigError, match="compile_workers"):
        compose_config(["compile_workers=-1"])


def test_only_sparsekv_parts_are_recorded():
    from types import SimpleNamespace

    from sparsekv.engine.warm_start import built_in
    from sparsekv.policies.full import FullAttentionPolicy

    class PluginPolicy(FullAttentionPolicy):
        pass

    PluginPolicy.__module__ = "some_plugin.policy"
    model = torch.nn.Linear(1, 1)
    model.__class__ = type("Model", (torch.nn.Linear,), {"__module__": "sparsekv.models.qwen3"})
    ours = SimpleNamespace(model=model, policy=FullAttentionPolicy(),
                           kv_store=SimpleNamespace(prefill_policy=FullAttentionPolicy()))
    assert built_in(ours)
    theirs = SimpleNamespace(model=model, policy=PluginPolicy(), kv_store=ours.kv_store)
    assert not built_in(theirs)
