"""Config schemas: dataclasses stored in Hydra's ConfigStore, selected and overridden by the YAML in conf/.

Every top-level key and every group is typed here (task settings: sparsekv.tasks.config); a wrong key or value
fails when the config is composed, naming the key and listing the valid keys or values (sparsekv.config_check).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, OmegaConf

from sparsekv.sampling_params import SamplingParams


class Device(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class HostDType(str, enum.Enum):
    auto = "auto"  # the model's dtype (bit-exact)
    float8_e4m3fn = "float8_e4m3fn"  # fp8 with a float32 scale per (block, KV head): half the host bytes and PCIe


class DType(str, enum.Enum):
    auto = "auto"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class LoadFormat(str, enum.Enum):
    auto = "auto"  # safetensors from model.path
    dummy = "dummy"  # random weights at the configured dimensions, no files
    # random weights plus planted attention structure (distance decay, vertical stripes) for sparse-policy
    # benchmarks: sparsekv/models/structured_dummy.py
    dummy_structured = "dummy_structured"

    @property
    def is_dummy(self) -> bool:
        return self in (LoadFormat.dummy, LoadFormat.dummy_structured)


class OffloadMode(str, enum.Enum):
    none = "none"  # paged KV cache resident on the device
    cpu = "cpu"  # KV blocks in pinned host memory, a ring of GPU slots


class PrefillMode(str, enum.Enum):
    chunked = "chunked"
    layerwise = "layerwise"


class GraphMode(str, enum.Enum):
    """How decode steps run (prefill is always eager). See sparsekv/graphs/cuda_graph.py."""
    auto = "auto"  # CUDA: cudagraph for offload=none, segmented for offload=cpu; eager without CUDA
    eager = "eager"  # plain PyTorch, no CUDA graphs
    cudagraph = "cudagraph"  # whole decode forward captured per batch bucket (offload=none)
    segmented = "segmented"  # per layer: pre- and post-attention graphs, attention eager between (offload=cpu)


def bounded(default: Any = MISSING, *, factory: Any = None, ge: float | None = None, gt: float | None = None,
            le: float | None = None) -> Any:
    """A numeric field with its range (for a list: each element's), checked when the config is composed
    (sparsekv.config_check) before anything is built."""
    metadata = {"range": (ge, gt, le)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    """Architecture and weights. With `path`, the checkpoint's config.json overrides the dimensions below."""
    name: str = "tiny"
    path: Optional[str] = None
    load_format: LoadFormat = LoadFormat.auto
    architecture: str = "Qwen3ForCausalLM"
    vocab_size: int = bounded(512, ge=1)
    hidden_size: int = bounded(64, ge=1)
    intermediate_size: int = bounded(128, ge=1)
    num_hidden_layers: int = bounded(2, ge=1)
    num_attention_heads: int = bounded(4, ge=1)
    num_key_value_heads: int = bounded(2, ge=1)
    head_dim: int = bounded(16, ge=1)
    rms_norm_eps: float = bounded(1e-6, gt=0)
    rope_theta: float = bounded(1000000.0, gt=0)
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = bounded(4096, ge=2)
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: Optional[int] = bounded(None, ge=0)
    eos_token_id: Optional[List[int]] = bounded(None, ge=0)
    dummy_init_std: float = bounded(0.02, ge=0)


@dataclass
class ResidentOffloadConfig:
    """offload=none: a paged KV cache resident on the device (block tables, continuous batching)."""
    mode: OffloadMode = OffloadMode.none
    block_size: int = bounded(256, ge=1)  # tokens per KV block
    # CUDA: the fraction of device memory that weights, activations and the KV pool may use together
    gpu_memory_utilization: float = bounded(0.9, gt=0, le=1)
    # a fixed number of KV blocks; null: room for scheduler.max_num_seqs sequences of max_model_len tokens, capped
    # by gpu_memory_utilization on CUDA (on a CPU device by 2 GiB, or one max_model_len sequence if that is more)
    num_kv_blocks: Optional[int] = bounded(None, ge=1)


@dataclass
class HostOffloadConfig:
    """offload=cpu: KV blocks in pinned host memory, a ring of GPU slots; GPU memory is fixed by this layout."""
    mode: OffloadMode = OffloadMode.cpu
    block_size: int = bounded(1024, ge=1)  # tokens per host block
    num_gpu_blocks: int = bounded(8, ge=1)  # ring slots on the GPU (2 or more let loads overlap compute)
    # tokens per prefill chunk, a multiple of block_size; null: scheduler.max_num_batched_tokens rounded down to one
    prefill_chunk_size: Optional[int] = bounded(8192, ge=1)
    host_pool_gib: Optional[float] = bounded(None, gt=0)  # host KV limit; null: 90% of MemAvailable less 4 GiB
    # tokens of host KV pinned when the engine is built and kept pinned while idle (KVStore.reserve). 0: slabs are
    # pinned as requests grow and released when the store goes idle, so every long request after an idle spell pins
    # its KV again inside its prefill (pinning runs at a few GB/s)
    reserve_tokens: int = bounded(0, ge=0)
    prefill_mode: PrefillMode = PrefillMode.chunked  # layerwise: the whole prompt per layer, then offload
    host_dtype: HostDType = HostDType.auto  # KV in host memory (and over PCIe): the model dtype or fp8 + scales
    # GPU block cache of host blocks, held as the host holds them (fp8 + scales with host_dtype fp8;
    # sparsekv/kvcache/gpu_block_cache.py): "auto" (CUDA: the device memory left after weights, ring, buffers and
    # graphs, less a margin; CPU devices: off), 0 (off), or a size in GiB
    gpu_cache_gib: Any = "auto"


def parse_gpu_cache_gib(value: Any) -> float | None:
    """offload.gpu_cache_gib as GiB, None for "auto"; a clear error for anything else."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        gib = float(value)
    except (TypeError, ValueError):
        gib = float("nan")
    if isinstance(value, bool) or not gib >= 0 or gib == float("inf"):
        raise ConfigError(f"offload.gpu_cache_gib={value!r} is not valid; use auto, 0 (no GPU block cache) or a "
                          "size in GiB >= 0")
    return gib


OFFLOAD_SCHEMAS: dict[str, type] = {"none": ResidentOffloadConfig, "cpu": HostOffloadConfig}


@dataclass
class SchedulerConfig:
    max_num_seqs: int = bounded(16, ge=1)  # sequences decoded together
    max_num_batched_tokens: int = bounded(8192, ge=1)  # chunked-prefill token budget per step
    max_model_len: Optional[int] = bounded(None, ge=2)  # null: the model's max_position_embeddings (CPU: <= 8192)
    # Overlapped decode (offload=none): the host schedules and launches decode step N+1, its input ids read on the
    # device from step N's sampled tokens, before it reads step N's tokens back; the GPU does not idle while the
    # host prepares a step. Same tokens as synchronous decode (overlap.py: the rounding caveat after stop tokens).
    # false: every step waits for its tokens. offload=cpu always decodes synchronously (overlap.py says why).
    async_decode: bool = True


@dataclass
class GraphConfig:
    mode: GraphMode = GraphMode.auto
    # Decode batches are padded up to the next captured size: 1, 2, 4, 8, then steps of 16, up to
    # max_batch_size (null: scheduler.max_num_seqs); a larger batch runs eagerly.
    max_batch_size: Optional[int] = bounded(None, ge=1)
    batch_sizes: Optional[List[int]] = bounded(None, ge=1)  # explicit capture sizes instead of the default ladder


@dataclass
class ParallelConfig:
    """Tensor parallelism over the GPUs of one host (sparsekv/distributed): each rank holds 1/N of the attention
    heads, KV heads and MLP columns (KV heads replicated when there are fewer than ranks) and a vocabulary slice.
    N > 1 starts N - 1 worker processes (or runs under torchrun); device=cpu runs the ranks on gloo (tests)."""
    tensor_parallel_size: int = bounded(1, ge=1)


@dataclass
class Config:
    model: ModelConfig = MISSING
    offload: Any = MISSING  # ResidentOffloadConfig (offload=none) or HostOffloadConfig (offload=cpu)
    graph: GraphConfig = MISSING
    policy: Any = MISSING  # a registered policy's dataclass (see sparsekv.policies)
    task: Any = MISSING  # the selected task's settings (sparsekv.tasks.config)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # the default when none is passed
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # {policy name: {key: value}}: applied to `policy` only when that policy is selected, so one multirun can sweep
    # hyperparameters of several policies (sparsekv.config_check.apply_per_policy)
    per_policy: Any = None
    device: Device = Device.auto
    dtype: DType = DType.auto
    seed: int = bounded(0, ge=0)
    prompt: str = "The quick brown fox jumps over the lazy dog. Long context inference is"
    output_dir: Optional[str] = None  # where tasks write JSON; default: Hydra's run dir or ./outputs
    # validate policies' device-tensor selections too (ids, duplicates, length): one host sync per layer and step;
    # list selections are always validated
    check_selections: bool = False
    # processes that compile a cold process's Triton kernels in parallel before the CUDA warm-up
    # (sparsekv/kernels/compile_ahead.py); null: one per CPU core; 0: each kernel compiles when first launched
    compile_workers: Optional[int] = bounded(None, ge=0)


SCHEMA_NAME = "sparsekv_schema"


class ConfigError(ConfigCompositionException, ValueError):
    """A config that does not compose: the message names the key and, where known, the allowed values."""


def config_dir() -> Path:
    """conf/ ships inside the installed package (sparsekv/conf) and lives at the top of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"sparsekv's conf/ directory was not found next to {here}; reinstall sparsekv")


def package_path(relative: str) -> str:
    """`${sparsekv_package:checkpoints/probe}` in a config: that path inside the sparsekv package, from any cwd."""
    return str(Path(__file__).resolve().parent / relative)


OmegaConf.register_new_resolver("sparsekv_package", package_path, replace=True)


def per_policy_schema(policies: dict[str, type]) -> Any:
    """One node per registered policy with that policy's hyperparameters, each unset (MISSING): Hydra type-checks
    `per_policy.quest.token_budget=1024` and rejects a key the policy lacks, and only what is set is applied."""
    import dataclasses
    import typing

    nodes = []
    for name, cls in sorted(policies.items()):
        hints = typing.get_type_hints(cls)
        fields = [(f.name, hints[f.name], field(default=MISSING)) for f in dataclasses.fields(cls)
                  if f.name != "name" and f.init]
        node = dataclasses.make_dataclass(f"{cls.__name__}Settings", fields)
        nodes.append((name, node, field(default_factory=node)))
    return dataclasses.make_dataclass("PerPolicy", nodes)()


def store_schemas(config_store, policies: dict[str, type]) -> None:
    from sparsekv.tasks.config import TASK_SCHEMAS

    config_store.store(name=SCHEMA_NAME, node=Config(per_policy=per_policy_schema(policies)))
    for name, schema in OFFLOAD_SCHEMAS.items():
        config_store.store(group="offload", name=name, node=schema)
    for name, schema in TASK_SCHEMAS.items():
        config_store.store(group="task", name=name, node=schema)
