"""Shared fixtures: tiny random Hugging Face checkpoints written with transformers, no downloads."""
from __future__ import annotations

import functools
import os
from pathlib import Path

# Triton decides at import whether kernels are interpreted: on a machine without CUDA, make the kernel tests able
# to run the Triton kernels on the CPU. Other tests still run the pure-torch backend (see kernels/_dispatch.py).
os.environ.setdefault("TRITON_INTERPRET", "0" if os.path.exists("/dev/nvidia0") else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

WORDS = ["the", "a", "fox", "dog", "jumps", "over", "lazy", "quick", "brown", "number", "magic", "is", "of",
         "one", "special", "key", "value", "context", "long", "cache"]


def save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.save_pretrained(str(path))


def make_checkpoint(path: Path, arch: str = "qwen3", *, tie: bool = True, dtype=torch.float32,
                    shard: bool = False, tokenizer: bool = True, seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(rope_theta=1e6, **common))
    else:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 256}
        model = LlamaForCausalLM(LlamaConfig(rope_theta=5e5, rope_scaling=scaling, **common))
    # widen the random init so that greedy decoding does not collapse onto one token
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.15)
    model = model.to(dtype)
    model.save_pretrained(str(path), max_shard_size="100KB" if shard else "2GB", safe_serialization=True)
    if tokenizer:
        save_tokenizer(path, common["vocab_size"])
    return path


def pytest_configure(config):
    """Under pytest-xdist each worker takes its share of the cores: workers that each start a thread per core
    oversubscribe the machine and run slower together than alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:  # GPU hosts too: most of the suite runs on the CPU there as well
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: without one they are skipped, so a test needs only the marker."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_kernel_choice(monkeypatch):
    """Each test starts with no active KernelChoice: kernels called without one resolve it from the test's own
    SPARSEKV_ATTN_BACKEND, and an engine a test builds activates its own."""
    from sparsekv.kernels import _dispatch

    monkeypatch.setattr(_dispatch, "_ACTIVE", {})


@pytest.fixture
def triton_kernels(monkeypatch):
    """The KernelChoice that runs the Triton kernels (interpreted off-GPU), for layers and kernels that take one;
    kernels called without one (as the KV stores and policies call them) and engines built in the test follow
    SPARSEKV_ATTN_BACKEND=triton.
    Every output buffer the launchers allocate is poisoned, so an element a kernel forgets to write fails."""
    from sparsekv.kernels import _dispatch
    from sparsekv.kernels.backend import resolve_kernels

    monkeypatch.setattr(_dispatch, "POISON_OUTPUTS", True)
    monkeypatch.setenv(_dispatch.ENV_BACKEND, "triton")
    choice = resolve_kernels("cuda" if torch.cuda.is_available() else "cpu", backend="triton")
    assert choice.triton
    return choice


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors on a loaded 2-core machine: extra threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=True)


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", tie=False)


@pytest.fixture(scope="session")
def qwen3_bf16_sharded_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_bf16"), "qwen3", tie=False, dtype=torch.bfloat16,
                           shard=True, seed=1)


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF transformers' greedy continuation and last-position logits, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
        out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist(), logits


@functools.lru_cache(maxsize=8)
def hf_model(path: str, device: str = "cpu"):
    """An HF transformers model in float32, loaded once per (checkpoint, device)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def hf_greedy_gaps(path: Path, prompt: list[int], max_new_tokens: int, device: str = "cpu"
                   ) -> tuple[list[int], list[float]]:
    """HF transformers' greedy continuation in float32 (argmax of the raw logits, eos not suppressed, as with
    ignore_eos) and, per generated token, the gap between its top-2 logits: a gap near 0 is a near-tie that
    rounding differences may flip."""
    import inspect

    model = hf_model(str(path), device)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt], device=device)
    tokens, gaps, past = [], [], None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(ids, use_cache=True, **{cache_kw: past})
            past = out.past_key_values
            logits = out.logits[0, -1].float()  # [V]
            top = torch.topk(logits, 2).values
            token = int(logits.argmax())
            tokens.append(token), gaps.append(float(top[0] - top[1]))
            ids = torch.tensor([[token]], device=device)
    return tokens, gaps


def random_prompt(length: int, vocab: int = 128, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=generator).tolist()


def growing_row_maxima(q: torch.Tensor, k: torch.Tensor, q_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q scaled up and k's norms rising 10x along the keys, in q's and k's dtypes: rows whose running max keeps
    growing along the keys, by more than the Gluon kernel's rescale threshold at some key blocks and not at others,
    so that the online softmax's rescaling is exercised (and, in the Gluon kernel, skipped) at different blocks."""
    rise = torch.linspace(0.2, 2.0, k.shape[0], device=k.device)[:, None, None]
    return (q.float() * q_scale).to(q.dtype), (k.float() * rise).to(k.dtype)


class CountLaunches:
    """Wraps a Triton kernel: counts `kernel[grid](...)` launches and passes them on."""

    def __init__(self, kernel):
        self.kernel, self.calls, self.grids = kernel, 0, []

    def __getitem__(self, grid):
        self.calls += 1
        self.grids.append(grid)
        return self.kernel[grid]

    def warmup(self, *args, **kwargs):  # compiles without launching: not counted
        return self.kernel.warmup(*args, **kwargs)


def compiled_variants(kernel) -> int:
    """Specializations of a Triton kernel compiled (or loaded from the disk cache) in this process."""
    caches = getattr(kernel, "device_caches", None)
    if not caches or not all(isinstance(entry[0], dict) for entry in caches.values()):
        pytest.skip("this Triton release keeps no per-device kernel cache")
    return sum(len(entry[0]) for entry in caches.values())


def host_sync_sites(fn) -> list[str]:
    """Synchronizing CUDA calls made by fn (torch's sync debug mode), as file:line."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
