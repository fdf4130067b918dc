"""Config schemas: dataclasses stored in Hydra's ConfigStore, selected and overridden by the YAML in conf/.

Every top-level key and every group is typed here, so a wrong key or value fails when Hydra composes the
config, naming the key (and, for enums, the allowed values).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.errors import ConfigCompositionException
from omegaconf import MISSING


class Device(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


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
    """How decode steps run (prefill is always eager). See sparsekv/engine/cuda_graph.py."""
    auto = "auto"  # CUDA: cudagraph for offload=none, segmented for offload=cpu; eager without CUDA
    eager = "eager"  # plain PyTorch, no CUDA graphs
    cudagraph = "cudagraph"  # whole decode forward captured per batch bucket (offload=none)
    segmented = "segmented"  # per layer: pre- and post-attention graphs, attention eager between (offload=cpu)


@dataclass
class ModelConfig:
    """Architecture and weights. With `path`, the checkpoint's config.json overrides the dimensions below."""
    name: str = "tiny"
    path: Optional[str] = None
    load_format: LoadFormat = LoadFormat.auto
    architecture: str = "Qwen3ForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[List[int]] = None
    dummy_init_std: float = 0.02


@dataclass
class OffloadConfig:
    mode: OffloadMode = OffloadMode.none
    block_size: int = 256  # tokens per KV block (paged cache and host blocks alike)
    gpu_memory_utilization: float = 0.9  # offload=none on CUDA: fraction of device memory for weights + KV
    num_kv_blocks: Optional[int] = None  # offload=none: fixed number of device blocks (overrides utilization)
    num_gpu_blocks: int = 4  # offload=cpu: ring slots on the GPU
    prefill_chunk_size: Optional[int] = None  # offload=cpu: tokens per prefill chunk (default: block_size)
    host_pool_gib: Optional[float] = None  # offload=cpu: host KV limit (default: free RAM less headroom)
    prefill_mode: PrefillMode = PrefillMode.chunked


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16  # sequences decoded together
    max_num_batched_tokens: int = 8192  # chunked-prefill token budget per step
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    # Overlapped decode (offload=none): the host schedules and launches decode step N+1, its input ids read on the
    # device from step N's sampled tokens, before it reads step N's tokens back; the GPU does not idle while the
    # host prepares a step. Same tokens as synchronous decode (overlap.py: the rounding caveat after stop tokens).
    # false: every step waits for its tokens. offload=cpu always decodes synchronously (overlap.py says why).
    async_decode: bool = True


@dataclass
class GraphConfig:
    mode: GraphMode = GraphMode.auto
    # Decode batches are padded up to the next captured size: 1, 2, 4, 8, then steps of 16, up to
    # max_batch_size (default: scheduler.max_num_seqs); a larger batch runs eagerly.
    max_batch_size: Optional[int] = None
    batch_sizes: Optional[List[int]] = None  # explicit capture sizes instead of the default ladder


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 32
    ignore_eos: bool = False
    stop_token_ids: List[int] = field(default_factory=list)
    seed: Optional[int] = None


@dataclass
class TaskConfig:
    name: str = "generate"


@dataclass
class BenchConfig:
    context: int = 8192  # prompt tokens
    decode_steps: int = 16
    batch_size: int = 1
    warmup: bool = True
    measure_floors: bool = True
    name: Optional[str] = None  # row label in records and summaries (default: "<model> <offload> <policy>")
    warmup_tokens: int = 256  # prompt tokens of each warm-up request (compilation/autotune stay out of the figures)
    fit_kv_cache: bool = True  # offload=none without offload.num_kv_blocks: size the device KV pool to the bench
    progress: bool = True  # tqdm bars over prefill and decode
    baseline: bool = False  # also time HF transformers on the same prompts (sparsekv.baseline) -> "hf_baseline"


@dataclass
class ReportConfig:
    """task=report: tables and plots of every JSON record below a run or sweep directory."""
    dir: Optional[str] = None  # the sweep (or run, or outputs/) directory to scan recursively; required
    out_dir: Optional[str] = None  # where report.csv, report.md and the PNGs go (default: `dir`)
    plots: bool = True  # draw the PNG plots (matplotlib, Agg backend)


class QualityPhase(str, enum.Enum):
    decode = "decode"  # compute_chunked_decode: the last token's query
    prefill = "prefill"  # compute_chunked_prefill (last chunk) and compute_prefill (offload=none, whole prompt)
    both = "both"


@dataclass
class QualityConfig:
    """task=quality: the configured policy's attention against dense attention, on planted Q/K/V and, when
    model.path is set, on the checkpoint's own Q/K/V of a needle-in-a-haystack prompt (sparsekv.quality)."""
    phase: QualityPhase = QualityPhase.both
    context: int = 8192  # tokens of the planted sequence (prompt + the decoded token)
    block_size: Optional[int] = None  # tokens per KV block (default: offload.block_size)
    prefill_chunk: Optional[int] = None  # chunked-prefill chunk (default: offload.prefill_chunk_size, else 4 blocks)
    num_gpu_blocks: Optional[int] = None  # ring slots (default: offload.num_gpu_blocks)
    decode_steps: int = 0  # tokens decoded before the evaluated one (exercises on_decode_offload)
    depths: List[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])  # needle depths, one input each
    seeds: List[int] = field(default_factory=lambda: [0])
    resident: bool = True  # with the prefill phase: also compute_prefill (offload=none) on the whole prompt
    probe: bool = True  # second run with needle-indicator values -> needle_recall / needle_hit
    shuffle_blocks: bool = False  # permute the host block ids (policies must not assume block id = position)
    planted: bool = True  # evaluate on planted inputs
    num_layers: int = 2  # planted shapes
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    sink_tokens: int = 4  # planted structure (scores each one adds; see sparsekv.quality.planted_inputs)
    num_stripes: int = 8
    local_window: Optional[int] = None  # default: block_size
    sink_logit: float = 8.0
    stripe_logit: float = 5.0
    local_logit: float = 4.0
    needle_logit: float = 6.0
    model_inputs: Optional[bool] = None  # capture the model's Q/K/V (default: when model.path is set)
    model_context: Optional[int] = None  # prompt tokens of the captured haystack prompt (default: context)
    layers: Optional[List[int]] = None  # model layers to evaluate (default: all)
    name: Optional[str] = None  # row label in records (default: "<model> <policy>")


@dataclass
class NeedleConfig:
    """task=needle: RULER-style needle in a haystack, greedy generation, exact match of the magic number."""
    contexts: List[int] = field(default_factory=lambda: [4096])  # prompt lengths in tokens
    depths: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # needle position in [0, 1]
    num_samples: int = 2  # prompts per (context, depth), each with its own key and number
    seed: int = 0
    max_tokens: int = 12
    batch_size: int = 4  # prompts generated together
    name: Optional[str] = None  # row label in records (default: "<model> <offload> <policy>")


@dataclass
class Config:
    model: ModelConfig = MISSING
    offload: OffloadConfig = MISSING
    graph: GraphConfig = MISSING
    policy: Any = MISSING  # a registered policy's dataclass (see sparsekv.policies)
    task: TaskConfig = MISSING
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    needle: NeedleConfig = field(default_factory=NeedleConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    device: Device = Device.auto
    dtype: DType = DType.auto
    seed: int = 0
    prompt: str = "The quick brown fox jumps over the lazy dog. Long context inference is"
    output_dir: Optional[str] = None  # where tasks write JSON; default: Hydra's run dir or ./outputs


SCHEMA_NAME = "sparsekv_schema"


class ConfigError(ConfigCompositionException, ValueError):
    """A config that does not compose: the message names the key and, where known, the allowed values."""


def explain_composition_error(exc: ConfigCompositionException) -> ConfigError:
    """Hydra's message ("Error merging override device=gpu") plus OmegaConf's reason, which Hydra keeps only
    in __cause__ ("Invalid value 'gpu', expected one of [auto, cpu, cuda]"), the key, and for an unknown key
    the keys that exist."""
    cause = exc.__cause__
    lines = [str(exc).strip()]
    if cause is not None:
        reason = str(getattr(cause, "msg", None) or cause).strip().splitlines()[0]
        key = getattr(cause, "full_key", None)
        lines.append(f"{reason} (key: {key})" if key else reason)
        object_type = getattr(cause, "object_type", None)
        if type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError") and object_type is not None:
            try:
                import dataclasses

                if dataclasses.is_dataclass(object_type):
                    names = [f.name for f in dataclasses.fields(object_type)]
                    lines.append(f"valid keys of {object_type.__name__}: {', '.join(names)}")
            except TypeError:
                pass
    return ConfigError("\n".join(lines))


def config_dir() -> Path:
    """conf/ ships inside the installed package (sparsekv/conf) and lives at the top of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"sparsekv's conf/ directory was not found next to {here}; reinstall sparsekv")


def store_schemas(config_store) -> None:
    config_store.store(name=SCHEMA_NAME, node=Config)
