"""HF transformers baseline: the same model dimensions, dtype, device and prompts as a sparsekv bench, run by
transformers in the same process, so the report can put sparsekv's figures beside HF's.

    python -m sparsekv task=bench task.baseline=true model=qwen3_4b model.load_format=dummy task.context=32768

Two KV placements are timed:
  hf            transformers' default DynamicCache, resident on the device
  hf-offloaded  transformers' offloaded cache (layers moved to host memory after use, prefetched one layer
                ahead). Which API provides it depends on the transformers version and is found by
                introspection at run time; the one used is recorded as `cache_api`:
                  DynamicCache(offloading=True)              (transformers >= 4.56 / 5.x)
                  OffloadedCache()                           (older 4.x)
                  generate(cache_implementation='offloaded') (fallback: timed through generate())

The model: with model.path and real weights, AutoModelForCausalLM.from_pretrained; otherwise (dummy weights)
AutoModelForCausalLM.from_config with the transformers config equivalent to sparsekv's model config, random
weights (std model.dummy_init_std), built directly on the device. HF's weights are not sparsekv's weights in
the dummy case; the timings depend on the dimensions only.

Timing, after a warm-up pass identical to the timed one (bench.warmup): prefill = time to first token (the
prompt's forward with logits of the last position only, plus the argmax), decode = one forward of one new
token per sequence per step, each synchronised (CUDA) before the clock is read; the median step is
`decode_ms_per_token`, as in the bench record. On CUDA, `gpu_peak_gib` is the peak device memory HF allocated on top of
what the process held before HF's model was built (HF's weights + KV cache + activations; other objects in the process,
like a sparsekv engine, are not counted).
"""
from __future__ import annotations

import gc
import inspect
import statistics
import time
from typing import Any, Callable, Sequence

import torch

GIB = 1 << 30
PLACEMENTS = {"gpu": "hf", "offloaded": "hf-offloaded"}  # placement -> system name in records and reports
_PLACEMENT_ALIASES = {"gpu": "gpu", "device": "gpu", "dynamic": "gpu", "offloaded": "offloaded", "cpu": "offloaded"}


def _name(value: Any) -> Any:
    return getattr(value, "value", value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- the model


def hf_config_from_spec(spec, model_cfg) -> Any:
    """transformers' config equivalent to a sparsekv ModelSpec (dummy weights)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_types = {arch: model_type for model_type, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    if spec.architecture not in model_types:
        raise ValueError(f"the HF baseline cannot build architecture {spec.architecture!r}: transformers maps no "
                         "model type to it")
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, attention_bias=spec.attention_bias,
        bos_token_id=spec.bos_token_id, eos_token_id=(spec.eos_token_ids or [None])[0],
        initializer_range=float(getattr(model_cfg, "dummy_init_std", 0.02)), use_cache=True,
    )
    if spec.rope_scaling:
        kwargs["rope_scaling"] = dict(spec.rope_scaling)
    return AutoConfig.for_model(model_types[spec.architecture], **kwargs)


def _with_dtype(fn: Callable, *args, dtype: torch.dtype, **kwargs):
    """transformers 5.x takes `dtype=`, 4.x `torch_dtype=`."""
    try:
        return fn(*args, dtype=dtype, **kwargs)
    except TypeError as err:
        if "dtype" not in str(err):
            raise
        return fn(*args, torch_dtype=dtype, **kwargs)


def build_hf_model(cfg) -> tuple[torch.nn.Module, str]:
    """(model in eval mode on cfg's device and dtype, how it was built)."""
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from sparsekv.config import LoadFormat
    from sparsekv.factory import resolve_device, resolve_dtype
    from sparsekv.models.loader import resolve_spec

    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    model_cfg = cfg.model
    path = Path(model_cfg.path).expanduser() if model_cfg.path else None
    if path is not None and not LoadFormat(model_cfg.load_format).is_dummy:
        model = _with_dtype(AutoModelForCausalLM.from_pretrained, str(path), dtype=dtype).to(device)
        source = f"from_pretrained({path})"
    else:
        hf_config = (AutoConfig.from_pretrained(str(path)) if path is not None
                     else hf_config_from_spec(resolve_spec(model_cfg), model_cfg))
        torch.manual_seed(int(cfg.seed))
        with torch.device(device):  # random init directly on the device (a 4B model initialises in seconds)
            model = _with_dtype(AutoModelForCausalLM.from_config, hf_config, dtype=dtype)
        model = model.to(device=device, dtype=dtype)
        source = "from_config (random weights)"
    return model.eval().requires_grad_(False), source


# ---------------------------------------------------------------------------------------------- caches


def offloaded_cache_api() -> tuple[str, Callable[[Any], Any] | None]:
    """(name of the API, factory(model_config) -> cache) for transformers' offloaded KV cache in the installed
    version; the factory is None when only generate(cache_implementation="offloaded") offers it."""
    from transformers import cache_utils

    dynamic = getattr(cache_utils, "DynamicCache", None)
    if dynamic is not None and "offloading" in inspect.signature(dynamic.__init__).parameters:
        params = inspect.signature(dynamic.__init__).parameters
        if "config" in params:
            return "DynamicCache(offloading=True)", lambda config: dynamic(config=config, offloading=True)
        return "DynamicCache(offloading=True)", lambda config: dynamic(offloading=True)
    offloaded = getattr(cache_utils, "OffloadedCache", None)
    if offloaded is not None:
        return "OffloadedCache()", lambda config: offloaded()
    return "generate(cache_implementation='offloaded')", None


def device_cache_api() -> tuple[str, Callable[[Any], Any]]:
    from transformers import DynamicCache

    if "config" in inspect.signature(DynamicCache.__init__).parameters:
        return "DynamicCache()", lambda config: DynamicCache(config=config)
    return "DynamicCache()", lambda config: DynamicCache()


# ---------------------------------------------------------------------------------------------- timing


def _forward_kwargs(model) -> dict[str, Any]:
    """Logits of the last position only (a 128K prompt's full logits would take tens of GB)."""
    params = inspect.signature(model.forward).parameters
    for key in ("logits_to_keep", "num_logits_to_keep"):
        if key in params:
            return {key: 1}
    return {}


@torch.inference_mode()
def time_manual(model, input_ids: torch.Tensor, steps: int, cache) -> tuple[float, list[float], list[int]]:
    """(seconds to the first token, seconds of each decode step, the first sequence's tokens) with `cache`."""
    device = input_ids.device
    extra = _forward_kwargs(model)
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, **extra)
    next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    prefill = time.perf_counter() - start
    cache = out.past_key_values
    del out
    tokens = [int(next_ids[0, 0])]
    step_seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=next_ids, past_key_values=cache, use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        step_seconds.append(time.perf_counter() - start)
        cache = out.past_key_values
        tokens.append(int(next_ids[0, 0]))
    return prefill, step_seconds, tokens


def time_generate(model, input_ids: torch.Tensor, steps: int,
                  cache_implementation: str) -> tuple[float, list[float], list[int]]:
    """The same figures timed through generate(): a logits processor reads the clock (after a sync) at each
    step, so the first reading is the time to first token and the differences are the decode steps."""
    from transformers import LogitsProcessor, LogitsProcessorList

    device = input_ids.device

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, ids, scores):
            _sync(device)
            self.times.append(time.perf_counter())
            return scores

    clock = StepClock()
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                             cache_implementation=cache_implementation, logits_processor=LogitsProcessorList([clock]),
                             pad_token_id=0, attention_mask=torch.ones_like(input_ids))
    prefill = clock.times[0] - start  # the first token's logits (its argmax is the next, negligible, step)
    steps_s = [b - a for a, b in zip(clock.times[:-1], clock.times[1:])][:steps]
    return prefill, steps_s, out[0, input_ids.shape[1]:].tolist()


# ---------------------------------------------------------------------------------------------- runs


def _prompt_tensor(prompt_ids: Sequence, device: torch.device) -> torch.Tensor:
    if len(prompt_ids) and isinstance(prompt_ids[0], int):
        prompt_ids = [prompt_ids]
    lengths = {len(p) for p in prompt_ids}
    if len(lengths) != 1:
        raise ValueError(f"the HF baseline needs prompts of one length (no padding); got lengths {sorted(lengths)}")
    return torch.tensor([list(p) for p in prompt_ids], dtype=torch.long, device=device)


def _skip(reason: str, **extra) -> dict[str, Any]:
    return {**extra, "status": "skipped", "error": reason}


def run_hf_baseline(cfg, prompt_ids: Sequence, decode_steps: int, placement: str = "gpu",
                    model: torch.nn.Module | None = None, held_before: int | None = None) -> dict[str, Any]:
    """Time HF transformers' prefill (time to first token) and decode on `prompt_ids` (one list of token ids, or
    a batch of equal-length lists) for `decode_steps` steps, with the KV cache `placement`: "gpu" (the default
    DynamicCache, resident on the device; on a CPU device it stays in host memory) or "offloaded"
    (transformers' offloaded cache; needs CUDA). `model` reuses an already built HF model; then `held_before`
    (bytes of device memory allocated before that model was built) makes `gpu_peak_gib` count its weights.
    Exceptions propagate (baseline_figures records them)."""
    from transformers import __version__ as transformers_version

    from sparsekv.factory import resolve_device, resolve_dtype

    if placement not in _PLACEMENT_ALIASES:
        raise ValueError(f"placement={placement!r}: use one of {', '.join(PLACEMENTS)}")
    placement = _PLACEMENT_ALIASES[placement]
    system = PLACEMENTS[placement]
    device = resolve_device(cfg)
    dtype = resolve_dtype(cfg, device)
    base = {"system": system, "placement": placement, "transformers_version": transformers_version,
            "device": str(device), "dtype": str(dtype).replace("torch.", "")}
    if placement == "offloaded" and device.type != "cuda":
        api, _ = offloaded_cache_api()
        return _skip(f"transformers' offloaded cache needs CUDA (it prefetches on CUDA streams); device is "
                     f"{device.type}", cache_api=api, **base)

    built_here = model is None
    if built_here or held_before is None:
        held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    source = None
    if built_here:
        model, source = build_hf_model(cfg)
    try:
        ids = _prompt_tensor(prompt_ids, device)
        batch, context = ids.shape
        api, factory = device_cache_api() if placement == "gpu" else offloaded_cache_api()

        def timed(input_ids: torch.Tensor, steps: int):
            if factory is None:
                return time_generate(model, input_ids, steps, "offloaded")
            return time_manual(model, input_ids, steps, factory(model.config))

        bench = cfg.get("task")  # task=bench settings
        warmup_seconds = None
        if bench is None or bench.get("warmup", True):
            # The warm-up repeats the timed run, same prompt length and steps: PyTorch's SDPA (cuDNN backend on
            # Hopper) prepares its kernels per sequence length, and on an H200 a first pass at new lengths decoded
            # 2-3x slower (60 vs 22 ms/token, qwen3_0_6b at 4K) even after a short warm-up of 256 tokens + 16 steps.
            start = time.perf_counter()
            timed(ids, decode_steps)
            warmup_seconds = time.perf_counter() - start
        gc.collect()  # no collection of the warm-up's garbage inside the timed steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        prefill_s, step_s, tokens = timed(ids, decode_steps)
        wall = time.perf_counter() - start
        median = statistics.median(step_s) if step_s else None
        mean = statistics.mean(step_s) if step_s else None
        figures: dict[str, Any] = {
            **base, "status": "ok", "error": None, "cache_api": api,
            "model_source": source, "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "batch_size": batch, "context": context, "prompt_tokens": batch * context, "decode_steps": len(step_s),
            "warmup_seconds": warmup_seconds, "wall_seconds": wall,
            "prefill_seconds": prefill_s, "ttft_ms": 1e3 * prefill_s,
            "prefill_tok_s": batch * context / prefill_s if prefill_s > 0 else None,
            "decode_ms_per_token": 1e3 * median if median is not None else None,  # median step, as in bench.json
            "decode_ms_per_token_mean": 1e3 * mean if mean is not None else None,
            "decode_tok_s": batch / median if median else None,
            "decode_tok_s_mean": batch / mean if mean else None,
            "gpu_peak_gib": ((torch.cuda.max_memory_allocated(device) - held_before) / GIB
                             if device.type == "cuda" else None),
            "token_ids": tokens,
        }
        return figures
    finally:
        if built_here:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


def baseline_figures(cfg, prompt_ids: Sequence) -> dict[str, Any]:
    """The bench task's `hf_baseline` entry: both placements on the bench's prompts and decode steps. A failure
    (an OOM at a long context, an architecture transformers lacks) is recorded per system, never raised, so
    the sparsekv figures of the bench run are kept:
        {"transformers_version", "model_source", "attn_implementation",
         "systems": {"hf": {...}, "hf-offloaded": {...}}}   each with "status": ok | failed | skipped
    """
    import transformers

    from sparsekv.factory import resolve_device

    steps = int(cfg.task.get("decode_steps", 16)) if cfg.get("task") is not None else 16
    device = resolve_device(cfg)
    result: dict[str, Any] = {"transformers_version": transformers.__version__, "model_source": None,
                              "attn_implementation": None, "systems": {}}
    held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        model, source = build_hf_model(cfg)
    except Exception as exc:  # noqa: BLE001 - recorded, the bench's own figures stand
        error = f"{type(exc).__name__}: {exc}"
        result["systems"] = {system: {"system": system, "placement": placement, "status": "failed", "error": error}
                             for placement, system in PLACEMENTS.items()}
        _release(device)
        return result
    result["model_source"] = source
    result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    try:
        for placement, system in PLACEMENTS.items():
            try:
                figures = run_hf_baseline(cfg, prompt_ids, steps, placement, model=model, held_before=held_before)
                figures["model_source"] = source
            except Exception as exc:  # noqa: BLE001 - e.g. torch.cuda.OutOfMemoryError at a long context
                figures = {"system": system, "placement": placement, "status": "failed",
                           "error": f"{type(exc).__name__}: {exc}"}
                _release(device)
            result["systems"][system] = figures
    finally:
        del model
        _release(device)
    print(f"HF transformers {result['transformers_version']} baseline ({result['model_source']}, "
          f"{result['attn_implementation']} attention):")
    print("\n".join(summary_lines(result)))
    return result


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per system, for the bench's printout."""
    lines = []
    for system, f in (result.get("systems") or {}).items():
        if f.get("status") != "ok":
            lines.append(f"  {system}: {f.get('status')} ({f.get('error')})")
            continue
        peak = f" , GPU peak {f['gpu_peak_gib']:.2f} GiB" if f.get("gpu_peak_gib") is not None else ""
        decode = (f"{f['decode_ms_per_token']:.2f} ms/token" if f.get("decode_ms_per_token") is not None
                  else "no decode steps")
        lines.append(f"  {system} [{f.get('cache_api')}]: prefill (TTFT) {f['prefill_seconds']:.3f} s = "
                     f"{f['prefill_tok_s']:,.0f} tok/s, decode {decode}{peak.replace(' ,', ',')}")
    return lines
