"""Bad input is a clear error raised before any compute: before the weights are built for engine-level
mistakes, before the model runs for request-level ones, and without leaving anything queued.

One table, BAD_INPUT: each row is (id, how to run it, message fragments). A CLI row runs sparsekv's entry point in
this process and expects exit 2 with one `error: ` line on stderr and no traceback; an API row expects its
exception type with a one-line message. `{tmp}` in an argument or fragment is the row's scratch directory, `{file}`
a regular file in it. Every new option adds its rows here."""
from __future__ import annotations

import importlib
import json
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hydra.errors import MissingConfigException

import sparsekv.factory
from sparsekv import LLM, PolicyConfigError, SamplingParams, plugins
from sparsekv.kvcache.base import format_bytes
from sparsekv.plugins import registry
from tests.conftest import make_checkpoint

CPU = ["device=cpu"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@dataclass
class Scratch:
    """What a row may use: its directory, a regular file, the shared tiny LLM, checkpoint factories."""
    tmp: Path
    request: pytest.FixtureRequest
    monkeypatch: pytest.MonkeyPatch

    @property
    def llm(self) -> LLM:
        return self.request.getfixturevalue("llm")

    def checkpoint(self, edit: Callable[[Path], None] | None = None) -> Path:
        path = Path(shutil.copytree(self.request.getfixturevalue("pristine"), self.tmp / "ckpt"))
        if edit is not None:
            edit(path)
        return path

    def plugin(self, body: str, name: str = "bad_input_plugin") -> None:
        """A third-party plugin distribution on sys.path, loaded alone (the allow list names only it)."""
        site = self.tmp / "site"
        site.mkdir()
        (site / f"{name}.py").write_text(textwrap.dedent(body))
        info = site / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[sparsekv]\n{name} = {name}\n")
        self.monkeypatch.syspath_prepend(str(site))
        self.monkeypatch.delenv(plugins.DISABLE_AUTOLOAD_ENV, raising=False)
        self.monkeypatch.setenv(plugins.ALLOW_LIST_ENV, name)
        importlib.invalidate_caches()
        plugins.reset_for_tests()
        self.request.addfinalizer(lambda: (sys.modules.pop(name, None), plugins.reset_for_tests()))


@dataclass
class Cli:
    """`python -m sparsekv *args`, in process; `setup` prepares the scratch directory and may add arguments."""
    args: list[str]
    setup: Callable[[Scratch], list[str]] | None = None

    def run(self, scratch: Scratch, capsys) -> str:
        import hydra._internal.utils as hydra_utils

        from sparsekv.__main__ import main

        extra = self.setup(scratch) if self.setup is not None else []
        args = [fill(a, scratch) for a in [*self.args, *extra]]
        scratch.monkeypatch.chdir(scratch.tmp)
        scratch.monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
        scratch.monkeypatch.setattr(hydra_utils, "is_under_debugger", lambda: False)  # e.g. under coverage
        scratch.monkeypatch.setattr(sys, "argv", ["sparsekv", *args, "hydra/job_logging=none",
                                                  "hydra/hydra_logging=none", f"hydra.run.dir={scratch.tmp / 'run'}"])
        code: Any = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, err
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, err
        return err[err.index(lines[0]):]  # the error line and what it lists below (e.g. a group's options)


@dataclass
class Api:
    """A Python API call that must raise `error` (no traceback text in its message)."""
    error: type[BaseException] | tuple[type[BaseException], ...]
    call: Callable[[Scratch], Any]
    guard: bool = True  # the shared LLM's model must not run and nothing may stay queued

    def run(self, scratch: Scratch, capsys) -> str:
        if self.guard:
            llm = scratch.llm
            scratch.monkeypatch.setattr(llm.engine.runner, "run", lambda *a, **k: pytest.fail("the model ran"))
        with pytest.raises(self.error) as info:
            self.call(scratch)
        if self.guard:
            assert not scratch.llm.engine.scheduler.has_unfinished()
        message = str(info.value)
        assert "Traceback" not in message, message
        return message


def fill(text: str, scratch: Scratch) -> str:
    file = scratch.tmp / "a_file"
    if "{file}" in text and not file.exists():
        file.write_text("")
    return text.replace("{tmp}", str(scratch.tmp)).replace("{file}", str(file))


def cli(*args: str, setup: Callable[[Scratch], list[str]] | None = None) -> Cli:
    return Cli(list(args), setup)


def api(error, call: Callable[[Scratch], Any], *, guard: bool = True) -> Api:
    return Api(error, call, guard)


def gen(prompts, params=GREEDY) -> Callable[[Scratch], Any]:
    return lambda s: s.llm.generate(prompts, params)


def sampling(**kwargs) -> Callable[[Scratch], Any]:
    return lambda s: SamplingParams(**kwargs)


def engine(model: str | None, *overrides: str) -> Callable[[Scratch], Any]:
    return lambda s: LLM(fill(model, s) if model else model, overrides=CPU + [fill(o, s) for o in overrides])


def row(id: str, how: Cli | Api, *fragments: str, xfail: str | None = None):
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(how, fragments, id=id, marks=marks)


# ---- checkpoint edits (a copy of a small Qwen3 checkpoint written by transformers)

def drop_tensor(name: str) -> Callable[[Scratch], list[str]]:
    def setup(s: Scratch) -> list[str]:
        from safetensors.torch import load_file, save_file

        path = s.checkpoint()
        tensors = load_file(str(path / "model.safetensors"))
        del tensors[name]
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return [f"model.path={path}"]
    return setup


def write_file(name: str, text: str | bytes, *, keep: int | None = None) -> Callable[[Scratch], list[str]]:
    def setup(s: Scratch) -> list[str]:
        path = s.checkpoint()
        target = path / name
        if keep is not None:
            target.write_bytes(target.read_bytes()[:keep])
        elif isinstance(text, bytes):
            target.write_bytes(text)
        else:
            target.write_text(text)
        return [f"model.path={path}"]
    return setup


def plugin_policy(s: Scratch) -> list[str]:
    s.plugin('''
        from dataclasses import dataclass
        import sparsekv
        from sparsekv.policies.base import SparsePolicy

        @dataclass
        class WidthPolicy(SparsePolicy):
            name: str = "bad_input_width"
            width: int = 2

            def __post_init__(self):
                if self.width < 1:
                    raise ValueError(f"width={self.width} must be at least 1")

        @sparsekv.hookimpl
        def sparsekv_register_policies():
            return [WidthPolicy]
    ''')
    return []


HF = ["device=cpu", "model=hf"]
NEEDLE = ["device=cpu", "task=needle", "task.contexts=[64]", "task.depths=[0.5]", "task.num_samples=1"]

BAD_INPUT = [
    # ---- the CLI: config keys and values
    row("cli-unknown-top-level-key", cli("device=cpu", "colour=red"), "colour"),
    row("cli-device-enum", cli("device=gpu"), "device", "gpu", "cpu", "cuda"),
    row("cli-dtype-enum", cli("device=cpu", "dtype=float8"), "float8", "bfloat16"),
    row("cli-unknown-model", cli("device=cpu", "model=nope"), "nope", "tiny", "qwen3_4b"),
    row("cli-unknown-policy", cli("device=cpu", "policy=nope"), "nope", "quest"),
    row("cli-unknown-offload", cli("device=cpu", "offload=gpu"), "gpu", "cpu", "none"),
    row("cli-unknown-graph", cli("device=cpu", "graph=fast"), "fast", "eager"),
    row("cli-unknown-task", cli("device=cpu", "task=train"), "train", "generate", "needle"),
    row("cli-key-of-another-task", cli("device=cpu", "task.context=5"), "context"),
    row("cli-unknown-scheduler-key", cli("device=cpu", "scheduler.max_seqs=4"), "max_seqs", "max_num_seqs"),
    row("cli-unknown-policy-key", cli("device=cpu", "policy=quest", "policy.budget=5"), "budget"),
    row("cli-int-given-text", cli("device=cpu", "scheduler.max_num_seqs=many"), "max_num_seqs", "many"),
    row("cli-seed-negative", cli("device=cpu", "seed=-1"), "seed", "-1", ">= 0"),
    row("cli-vocab-zero", cli("device=cpu", "model.vocab_size=0"), "vocab_size", "0", ">= 1"),
    row("cli-load-format-enum", cli("device=cpu", "model.load_format=pickle"), "pickle", "dummy"),
    row("cli-max-model-len-one", cli("device=cpu", "scheduler.max_model_len=1"), "max_model_len", ">= 2"),
    row("cli-max-seqs-zero", cli("device=cpu", "scheduler.max_num_seqs=0"), "max_num_seqs", ">= 1"),
    row("cli-tp-zero", cli("device=cpu", "parallel.tensor_parallel_size=0"), "tensor_parallel_size", ">= 1"),
    row("cli-tp-not-dividing-heads", cli("device=cpu", "parallel.tensor_parallel_size=3"),
        "parallel.tensor_parallel_size=3", "4 attention heads"),
    row("api-tp-not-dividing-kv-heads", api(ValueError, engine(None, "parallel.tensor_parallel_size=2",
                                                               "model.num_attention_heads=6",
                                                               "model.num_key_value_heads=3")),
        "parallel.tensor_parallel_size=2", "3 KV heads"),
    row("cli-tp-checkpoint-missing-tensor",  # fails on both ranks: rank 0 reports it, the worker stays
        cli(*HF, "parallel.tensor_parallel_size=2", setup=drop_tensor("model.layers.1.mlp.up_proj.weight")),
        "model.layers.1.mlp.up_proj.weight"),
    row("cli-graph-batch-sizes", cli("device=cpu", "graph.batch_sizes=[0,4]"), "batch_sizes", ">= 1"),
    row("cli-sampling-top-p", cli("device=cpu", "sampling.top_p=1.5"), "top_p", "1.5"),
    row("cli-sampling-temperature", cli("device=cpu", "sampling.temperature=-1"), "temperature", "-1"),
    row("cli-sampling-max-tokens", cli("device=cpu", "sampling.max_tokens=0"), "max_tokens", "0"),
    row("cli-sampling-top-k", cli("device=cpu", "sampling.top_k=0"), "top_k", "0"),
    row("cli-policy-range", cli("device=cpu", "policy=quest", "policy.token_budget=-1"), "quest", "token_budget", "-1"),
    row("cli-sweep-one-bad-job", cli("-m", "device=cpu", "sampling.top_p=0.5,7"), "top_p", "7"),
    row("cli-empty-prompt", cli("device=cpu", "prompt=''"), "empty"),
    row("cli-unquoted-apostrophe", cli("device=cpu", "prompt=It's"), "prompt=It's", "Hydra quotes",
        "prompt=\"'It\\'s a test, ok'\""),
    row("cli-unclosed-bracket", cli("device=cpu", "task=needle", "task.contexts=[64,128"), "task.contexts=[64,128",
        "close every bracket"),
    row("cli-unquoted-comma", cli("device=cpu", "prompt=a,b"), "prompt=a,b", "quote the value"),
    row("cli-prompt-beyond-max-model-len", cli("device=cpu", "scheduler.max_model_len=16"), "max_model_len", "16"),
    # ---- the CLI: values beyond the machine fail before the weights load
    row("cli-host-pool-beyond-ram", cli("device=cpu", "offload=cpu", "offload.host_pool_gib=500000"),
        "host_pool_gib=500000", "available host memory", "leave it unset"),
    row("cli-host-pool-negative", cli("device=cpu", "offload=cpu", "offload.host_pool_gib=-1"), "host_pool_gib=-1",
        "> 0"),
    row("cli-gpu-util-above-1", cli("device=cpu", "offload.gpu_memory_utilization=5"), "gpu_memory_utilization=5",
        "<= 1"),
    row("cli-kv-blocks-negative", cli("device=cpu", "offload.num_kv_blocks=-3"), "num_kv_blocks=-3", ">= 1"),
    row("cli-kv-blocks-zero", cli("device=cpu", "offload.num_kv_blocks=0"), "num_kv_blocks=0", ">= 1"),
    row("cli-kv-blocks-beyond-ram", cli("device=cpu", "offload.num_kv_blocks=1000000000"),
        "num_kv_blocks=1000000000", "GiB", "leave it unset"),
    row("cli-max-model-len-beyond-ram", cli("device=cpu", "scheduler.max_model_len=100000000000"),
        "max_model_len=100000000000", "GiB", "lower scheduler.max_model_len"),
    row("cli-output-dir-unwritable", cli("device=cpu", "output_dir={file}/out"), "output_dir=", "not a directory",
        "writable directory"),
    row("cli-offload-ring-zero", cli("device=cpu", "offload=cpu", "offload.num_gpu_blocks=0"), "num_gpu_blocks",
        ">= 1"),
    row("cli-offload-block-size-zero", cli("device=cpu", "offload.block_size=0"), "block_size", ">= 1"),
    row("cli-host-dtype-unknown", cli("device=cpu", "offload=cpu", "offload.host_dtype=fp4"), "host_dtype", "fp4",
        "float8_e4m3fn"),
    row("cli-host-dtype-fp8-without-support", cli("device=cpu", "offload=cpu", "offload.host_dtype=float8_e4m3fn",
                                                  setup=lambda s: s.monkeypatch.delattr("torch.float8_e4m3fn") or []),
        "host_dtype=float8_e4m3fn", "float8_e4m3fn", "offload.host_dtype=auto"),
    row("cli-gpu-cache-negative", cli("device=cpu", "offload=cpu", "offload.gpu_cache_gib=-2"), "gpu_cache_gib=-2",
        "use auto, 0"),
    row("cli-gpu-cache-not-a-number", cli("device=cpu", "offload=cpu", "offload.gpu_cache_gib=lots"),
        "gpu_cache_gib='lots'", "size in GiB"),
    # ---- checkpoints
    row("cli-model-without-weights", cli("device=cpu", "model=qwen3_4b"), "model.path=", "model.load_format=dummy"),
    row("cli-hf-without-path", cli(*HF), "model.path"),
    row("cli-checkpoint-missing-dir", cli(*HF, "model.path={tmp}/nowhere"), "{tmp}/nowhere"),
    row("cli-checkpoint-without-config", cli(*HF, "model.path={tmp}"), "{tmp}", "config.json"),
    row("cli-checkpoint-missing-tensor", cli(*HF, setup=drop_tensor("model.layers.1.self_attn.k_proj.weight")),
        "model.layers.1.self_attn.k_proj.weight", "model.safetensors"),
    row("cli-checkpoint-garbage-file", cli(*HF, setup=write_file("model.safetensors", b"not a safetensors file")),
        "model.safetensors"),
    row("cli-checkpoint-truncated-file", cli(*HF, setup=write_file("model.safetensors", b"", keep=1000)),
        "model.safetensors"),
    row("cli-checkpoint-config-not-json", cli(*HF, setup=write_file("config.json", "{not json")), "config.json"),
    row("cli-checkpoint-unknown-architecture",
        cli(*HF, setup=write_file("config.json", json.dumps({
            "architectures": ["FooForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}))),
        "FooForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"),
    # ---- every task
    row("bench-context-zero", cli("device=cpu", "task=bench", "task.context=0"), "task.context", "0", ">= 1"),
    row("bench-batch-zero", cli("device=cpu", "task=bench", "task.batch_size=0"), "batch_size", ">= 1"),
    row("bench-decode-steps-negative", cli("device=cpu", "task=bench", "task.decode_steps=-2"), "decode_steps", ">= 0"),
    row("bench-unknown-key", cli("device=cpu", "task=bench", "task.contexts=[8]"), "contexts", "context"),
    row("quality-phase-enum", cli("device=cpu", "task=quality", "task.phase=sideways"), "sideways", "decode",
        "prefill"),
    row("quality-context-one", cli("device=cpu", "task=quality", "task.context=1"), "task.context", ">= 2"),
    row("quality-depth-above-one", cli("device=cpu", "task=quality", "task.depths=[1.5]"), "depths", "1.5", "<= 1"),
    row("needle-empty-contexts", cli(*NEEDLE[:2], "task.contexts=[]"), "task.contexts", "at least one"),
    row("needle-depth-above-one", cli(*NEEDLE[:3], "task.depths=[1.5]"), "depths", "1.5"),
    row("needle-samples-zero", cli(*NEEDLE, "task.num_samples=0"), "num_samples", "0"),
    row("needle-batch-zero", cli(*NEEDLE, "task.batch_size=0"), "batch_size", "0"),
    row("needle-without-tokenizer", cli(*NEEDLE, "model.vocab_size=200"), "task=needle", "tokenizer", "model.path"),
    row("ruler-unknown-task", cli("device=cpu", "task=ruler", "task.tasks=[niah_single,haystack]"), "'haystack'",
        "niah_multikey", "common_words"),
    row("ruler-empty-lengths", cli("device=cpu", "task=ruler", "task.lengths=[]"), "task.lengths", "at least one"),
    row("ruler-length-zero", cli("device=cpu", "task=ruler", "task.lengths=[0]"), "task.lengths", ">= 1"),
    row("ruler-chat-template-enum", cli("device=cpu", "task=ruler", "task.chat_template=yes"), "chat_template",
        "auto, true or false"),
    row("ruler-without-tokenizer", cli("device=cpu", "task=ruler"), "task=ruler", "tokenizer", "model.path"),
    row("ruler-length-beyond-max-model-len", cli(*HF, "task=ruler", "task.lengths=[512,4096]",
                                                 setup=lambda s: [f"model.path={s.checkpoint()}"]),
        "task.lengths has 4096", "2048 positions", "scheduler.max_model_len"),
    row("ruler-length-beyond-set-max-model-len", cli(*HF, "task=ruler", "task.lengths=[512]",
                                                     "scheduler.max_model_len=400",
                                                     setup=lambda s: [f"model.path={s.checkpoint()}"]),
        "task.lengths has 512", "scheduler.max_model_len=400", "raise scheduler.max_model_len"),
    row("ruler-chat-template-missing", cli(*HF, "task=ruler", "task.lengths=[512]", "task.chat_template=true",
                                           setup=lambda s: [f"model.path={s.checkpoint()}"]),
        "chat_template=true", "no chat template"),
    row("report-without-dir", cli("task=report"), "task.dir"),
    row("report-missing-dir", cli("task=report", "task.dir={tmp}/nowhere"), "{tmp}/nowhere"),
    row("report-dir-is-a-file", cli("task=report", "task.dir={file}"), "{tmp}/a_file"),
    row("plugins-unknown-key", cli("task=plugins", "task.verbose=true"), "verbose"),
    row("generate-unknown-key", cli("device=cpu", "task=generate", "task.progres=false"), "progres"),
    # ---- plugins
    row("plugin-policy-range", cli("device=cpu", "policy=bad_input_width", "policy.width=0", setup=plugin_policy),
        "policy=bad_input_width", "plugin 'bad_input_plugin'", "package bad-input-plugin", "width=0", "at least 1"),
    row("plugin-policy-unknown-key",
        cli("device=cpu", "policy=bad_input_width", "policy.height=3", setup=plugin_policy), "height", "width"),
    # ---- the Python API: LLM(...)
    row("api-unknown-model", api(MissingConfigException, engine("nope"), guard=False), "model/nope", "tiny",
        "qwen3_4b"),
    row("api-unknown-policy", api(MissingConfigException, engine("tiny", "policy=nope"), guard=False), "policy/nope",
        *registry().policies),
    row("api-model-without-weights", api(ValueError, engine("qwen3_4b"), guard=False), "model.path=",
        "model.load_format=dummy"),
    row("api-missing-checkpoint-dir", api((ValueError, FileNotFoundError), engine("{tmp}/nowhere"), guard=False),
        "{tmp}/nowhere"),
    row("api-dir-without-config-json", api((ValueError, FileNotFoundError), engine("{tmp}"), guard=False),
        "{tmp}", "config.json"),
    row("api-device-enum", api(ValueError, engine("tiny", "device=gpu"), guard=False), "device", "gpu", "cpu"),
    row("api-unknown-key", api(ValueError, engine("tiny", "colour=red"), guard=False), "colour"),
    row("api-sampling-override", api(ValueError, engine("tiny", "sampling.top_p=0"), guard=False), "top_p"),
    row("api-policy-range", api(PolicyConfigError, engine("tiny", "policy=quest", "policy.token_budget=-1"),
                                guard=False), "quest", "token_budget"),
    row("api-overrides-as-a-string", api((TypeError, ValueError), lambda s: LLM("tiny", overrides="device=cpu"),
                                         guard=False), "overrides", "list"),
    # ---- the Python API: generate(...)
    row("api-prompt-beyond-max-model-len", api(ValueError, gen([[5] * 5000])), "5000", "4096", "max_model_len"),
    row("api-text-prompt-beyond-max-model-len", api(ValueError, gen("x" * 4999)), "5000", "max_model_len"),
    row("api-empty-str", api(ValueError, gen("")), "empty"),
    row("api-empty-list", api(ValueError, gen([])), "empty"),
    row("api-empty-token-list", api(ValueError, gen([[]])), "empty"),
    row("api-batch-of-empty-str", api(ValueError, gen([""])), "empty"),
    row("api-prompt-none", api(TypeError, gen(None)), "NoneType"),
    row("api-prompt-int", api(TypeError, gen(42)), "int"),
    row("api-float-ids", api(TypeError, gen([[1.7, 2.0]])), "1.7"),
    row("api-str-ids", api(TypeError, gen([["a", "b"]])), "'a'"),
    row("api-bool-ids", api(TypeError, gen([[True, False]])), "True"),
    row("api-none-in-batch", api(TypeError, gen([[1, 2], None])), "prompt 1"),
    row("api-str-in-token-list", api(TypeError, gen([1, 2, "x"])), "'x'"),
    row("api-token-id-at-vocab", api(ValueError, gen([[1, 2, 512, 3]])), "512"),
    row("api-token-id-beyond-vocab", api(ValueError, gen([[1, 2, 100000, 3]])), "100000", "512"),
    row("api-token-id-negative", api(ValueError, gen([[1, 2, -1, 3]])), "-1", "512"),
    row("api-bad-prompt-first-in-batch", api(ValueError, gen([[1, 2, 999999], [5, 6, 7]])), "999999"),
    row("api-bad-prompt-last-in-batch", api(ValueError, gen(["good one", [5, 6, 7], [1, 999999]])), "999999"),
    row("api-sampling-params-dict", api(TypeError, gen([[1, 2]], {"max_tokens": 2})), "SamplingParams", "dict"),
    row("api-sampling-params-list-with-dict", api(TypeError, gen([[1], [2]], [GREEDY, {"max_tokens": 2}])),
        "SamplingParams"),
    row("api-sampling-params-count", api(ValueError, gen([[1], [2], [3]], [GREEDY, GREEDY])),
        "2 SamplingParams for 3 prompts"),
    # ---- SamplingParams(...)
    *[row(f"sampling-{key}={value}", api(ValueError, sampling(**{key: value}), guard=False), key,
          "'x'" if value == ["x"] else str(value))
      for key, value in [("max_tokens", -1), ("max_tokens", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
                         ("temperature", -0.5), ("top_k", 0), ("top_k", -2), ("temperature", float("nan")),
                         ("temperature", float("inf")), ("top_p", float("nan")), ("max_tokens", 2.5),
                         ("top_k", 1.5), ("stop_token_ids", ["x"]), ("stop_token_ids", 5), ("seed", "abc")]],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", overrides=CPU)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    # with a tokenizer: the CLI checks its prompt first
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=True)


@pytest.fixture
def no_weights(monkeypatch):
    """Engine-level input errors are raised before the weights are built."""
    def forbidden(*args, **kwargs):
        raise AssertionError("weights were built before the bad input was rejected")

    monkeypatch.setattr(sparsekv.factory, "build_model", forbidden)


@pytest.mark.parametrize("how,fragments", BAD_INPUT)
def test_bad_input(how: Cli | Api, fragments: tuple[str, ...], tmp_path, request, monkeypatch, capsys):
    scratch = Scratch(tmp_path, request, monkeypatch)
    message = how.run(scratch, capsys)
    for fragment in fragments:
        assert fill(fragment, scratch) in message, (fragment, message)


def test_the_table_covers_every_task_and_surface():
    ids = [p.id for p in BAD_INPUT]
    assert len(ids) == len(set(ids)) and len(ids) >= 60
    for prefix in ("cli-", "api-", "sampling-", "cli-checkpoint-", "plugin-", "bench-", "quality-", "needle-",
                   "report-", "plugins-", "generate-", "ruler-"):
        assert any(i.startswith(prefix) for i in ids), prefix


# ---- behaviour beside the error

def test_engine_level_errors_come_before_the_weights(no_weights):
    with pytest.raises(ValueError, match="model.path="):
        LLM("qwen3_4b", overrides=CPU)
    from sparsekv.llm import compose_config
    from sparsekv.tasks.generate import run

    with pytest.raises(ValueError, match="top_p"):
        run(compose_config(CPU + ["sampling.top_p=0"]))


def test_a_policy_layout_error_comes_before_the_weights(pristine, no_weights, monkeypatch):
    """SparsePolicy.check_layout runs before the weights load: MInference's last_q against the device's estimate
    tile (a device that fits 32 rows, faked here) fails with the setting and its bound."""
    from sparsekv.policies.minference import vertical_slash_estimate

    monkeypatch.setattr(vertical_slash_estimate, "max_estimate_rows", lambda *a: 32)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a small GPU")
    with pytest.raises(ValueError, match=r"^policy=minference: policy.last_q=64: .* a small GPU fits at most 32 .* "
                                         r"use policy.last_q <= 32"):
        LLM(overrides=CPU + [f"model.path={pristine}", "policy=minference", "policy.last_q=64"])


def test_integral_sampling_values_are_normalized():
    params = SamplingParams(max_tokens=16.0, top_k=4.0, stop_token_ids=(3.0, 4), seed=2.0)
    assert params.max_tokens == 16 and isinstance(params.max_tokens, int)
    assert params.top_k == 4 and params.stop_token_ids == [3, 4] and params.seed == 2


def test_a_rejected_batch_queues_nothing_and_the_engine_still_works(llm, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(llm.engine.runner, "run", lambda *a: pytest.fail("model ran"))
        with pytest.raises(ValueError, match="999999"):
            llm.generate(["good one", [5, 6, 7], [1, 2, 999999]], GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([[5, 6, 7], list(range(3, 500)) * 10], GREEDY)
    assert not llm.engine.scheduler.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.kv_store.num_blocks  # no blocks leaked
    outs = llm.generate(["good one", [5, 6, 7]], GREEDY)
    assert [len(o.token_ids) for o in outs] == [3, 3]
    assert all(o.finish_reason == "length" for o in outs)


def test_failed_run_writes_its_error_into_the_run_log(tmp_path):
    from tests.e2e.test_cli import run_cli

    result = run_cli(["device=cpu", "offload=cpu", "offload.host_pool_gib=500000"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    logs = list(tmp_path.glob("outputs/*/*/*.log"))
    assert len(logs) == 1, list(tmp_path.rglob("*"))
    text = logs[0].read_text()
    assert "host_pool_gib=500000" in text and "leave it unset" in text
    assert result.stderr.count("host_pool_gib=500000") == 1  # the terminal still shows the error once


def test_small_figures_are_shown_in_mib():
    assert format_bytes(3 << 20) == "3.00 MiB"
    assert format_bytes(3 << 30) == "3.00 GiB"
