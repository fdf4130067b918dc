"""Task settings: `task=<name>` selects one of these schemas as the `task` node (`task=bench task.context=32768`),
so a key of another task is an unknown key, not a silently ignored one."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, List, Optional

from sparsekv.config import bounded


@dataclass
class GenerateTask:
    """Generate from `prompt` with `sampling`, print the text and the run's figures."""
    name: str = "generate"
    progress: bool = True  # tqdm bars over prefill and decode on stderr (runs longer than a moment)


@dataclass
class PluginsTask:
    """List the loaded, failed and disallowed plugins: their package, entry point and what they registered."""
    name: str = "plugins"


@dataclass
class BenchTask:
    """Prefill and decode speed against the physical floors measured in the same run.
        python -m sparsekv task=bench model=qwen3_4b model.load_format=dummy task.context=32768 task.decode_steps=32
    """
    name: str = "bench"
    context: int = bounded(8192, ge=1)  # prompt tokens
    decode_steps: int = bounded(16, ge=0)
    batch_size: int = bounded(1, ge=1)
    # batch sizes of a decode curve from one prefill of batch_size sequences (its widest point), e.g. [1, 2, 4, 8]:
    # decode_steps at each, widest first (sparsekv.tasks.bench.decode); [] measures batch_size alone
    batch_curve: List[int] = bounded(factory=list, ge=1)
    warmup: bool = True
    measure_floors: bool = True
    label: Optional[str] = None  # row label in records and summaries (default: "<model> <offload> <policy>")
    warmup_tokens: int = bounded(256, ge=1)  # prompt tokens of each warm-up request (compilation stays out of figures)
    fit_kv_cache: bool = True  # offload=none without offload.num_kv_blocks: size the device KV pool to the bench
    progress: bool = True  # tqdm bars over prefill and decode
    # also time HF transformers on the same prompts (sparsekv.tasks.bench.baseline) -> "hf_baseline"
    baseline: bool = False


@dataclass
class ReportTask:
    """Tables (report.csv, report.md) and plots (PNG) of every JSON record below a sweep directory.
        python -m sparsekv task=report task.dir=outputs/multirun/2025-01-01/12-00-00
    """
    name: str = "report"
    dir: Optional[str] = None  # the sweep (or run, or outputs/) directory to scan recursively; required
    out_dir: Optional[str] = None  # where report.csv, report.md and the PNGs go (default: `dir`)
    plots: bool = True  # draw the PNG plots (matplotlib, Agg backend)


class QualityPhase(str, enum.Enum):
    decode = "decode"  # compute_chunked_decode: the last token's query
    prefill = "prefill"  # compute_chunked_prefill (last chunk) and compute_prefill (offload=none, whole prompt)
    both = "both"


@dataclass
class QualityTask:
    """The configured policy's attention against dense attention, on planted Q/K/V and, when model.path is set, on
    the checkpoint's own Q/K/V of a needle-in-a-haystack prompt (sparsekv.quality).
        python -m sparsekv -m task=quality policy=quest_2k,quest_4k task.context=32768
    """
    name: str = "quality"
    phase: QualityPhase = QualityPhase.both
    context: int = bounded(8192, ge=2)  # tokens of the planted sequence (prompt + the decoded token)
    block_size: Optional[int] = bounded(None, ge=1)  # tokens per KV block (default: offload.block_size)
    # chunked-prefill chunk (default: offload.prefill_chunk_size with offload=cpu, else 4 blocks)
    prefill_chunk: Optional[int] = bounded(None, ge=1)
    num_gpu_blocks: Optional[int] = bounded(None, ge=1)  # ring slots (default: offload.num_gpu_blocks, else 4)
    decode_steps: int = bounded(0, ge=0)  # tokens decoded before the evaluated one (exercises on_decode_offload)
    depths: List[float] = bounded(factory=lambda: [0.1, 0.5, 0.9], ge=0, le=1)  # needle depths, one input each
    seeds: List[int] = bounded(factory=lambda: [0], ge=0)
    resident: bool = True  # with the prefill phase: also compute_prefill (offload=none) on the whole prompt
    probe: bool = True  # second run with needle-indicator values -> needle_recall / needle_hit
    shuffle_blocks: bool = False  # permute the host block ids (policies must not assume block id = position)
    planted: bool = True  # evaluate on planted inputs
    num_layers: int = bounded(4, ge=1)  # planted shapes (more than quest's 2 dense layers, so it selects)
    num_heads: int = bounded(8, ge=1)
    num_kv_heads: int = bounded(2, ge=1)
    head_dim: int = bounded(128, ge=1)
    sink_tokens: int = bounded(4, ge=0)  # planted structure (scores each one adds; see sparsekv.quality.planted_inputs)
    num_stripes: int = bounded(8, ge=0)
    local_window: Optional[int] = bounded(None, ge=1)  # default: block_size
    sink_logit: float = bounded(8.0, ge=0)
    stripe_logit: float = bounded(5.0, ge=0)
    local_logit: float = bounded(4.0, ge=0)
    needle_logit: float = bounded(6.0, ge=0)
    model_inputs: Optional[bool] = None  # capture the model's Q/K/V (default: when model.path is set)
    # prompt tokens of the captured haystack prompt (default: context)
    model_context: Optional[int] = bounded(None, ge=2)
    layers: Optional[List[int]] = bounded(None, ge=0)  # model layers to evaluate (default: all)
    label: Optional[str] = None  # row label in records (default: "<model> <policy>")
    progress: bool = True  # a tqdm bar over the evaluated inputs, on stderr


@dataclass
class NeedleTask:
    """RULER-style needle in a haystack: greedy generation, exact match of the magic number.
        python -m sparsekv task=needle model=hf model.path=/ckpt offload=cpu policy=quest "task.contexts=[8192,32768]"
    """
    name: str = "needle"
    contexts: List[int] = bounded(factory=lambda: [4096], ge=1)  # prompt lengths in tokens
    depths: List[float] = bounded(factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0], ge=0, le=1)  # needle position
    num_samples: int = bounded(2, ge=1)  # prompts per (context, depth), each with its own key and number
    seed: int = bounded(0, ge=0)
    max_tokens: int = bounded(12, ge=1)
    batch_size: int = bounded(4, ge=1)  # prompts generated together
    progress: bool = True  # a tqdm bar over the samples on stderr (runs longer than a moment)
    label: Optional[str] = None  # row label in records (default: "<model> <offload> <policy>")


@dataclass
class RulerTask:
    """RULER-style long-context suite (sparsekv.tasks.ruler): needle retrieval, variable tracking and common-word
    counting at each context length, greedy generation through the engine, scored per task and length beside the
    policy's density and the run's speed.
        python -m sparsekv task=ruler model=hf model.path=/ckpt offload=cpu policy=quest "task.lengths=[4096,16384]"
    """
    name: str = "ruler"
    tasks: Any = "all"  # "all", a list of task names, or a comma string in quotes ('niah_single,common_words')
    lengths: List[int] = bounded(factory=lambda: [4096, 16384, 32768], ge=1)  # prompt lengths in tokens
    samples: int = bounded(10, ge=1)  # prompts per (task, length)
    seed: int = bounded(0, ge=0)
    batch_size: int = bounded(4, ge=1)  # prompts generated together
    chat_template: Any = "auto"  # auto: the tokenizer's chat template when it has one; true / false
    with_needles: bool = True  # false: the facts asked about are left out (the answers score at chance)
    needles: Optional[int] = None  # 2-32: needles of the multi-needle tasks, chains of variable_tracking (harder)
    warmup: bool = True  # the first prompt once, untimed, first: compilation stays out of the first cell's figures
    progress: bool = True  # a tqdm bar over the samples on stderr
    label: Optional[str] = None  # row label in records (default: "<model> <offload> <policy>")


TASK_SCHEMAS: dict[str, type] = {"generate": GenerateTask, "bench": BenchTask, "quality": QualityTask,
                                 "needle": NeedleTask, "ruler": RulerTask, "report": ReportTask, "plugins": PluginsTask}
