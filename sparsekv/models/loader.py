"""Build a registered model class and fill it from safetensors, or with seeded random (dummy) weights."""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from sparsekv.config import LoadFormat
from sparsekv.distributed.sharding import Shard
from sparsekv.kernels.backend import KernelChoice
from sparsekv.layers.linear import ShardedParameters
from sparsekv.models.structured_dummy import init_structured_dummy
from sparsekv.models.spec import ModelLoadError, ModelSpec, spec_from_hf_config, spec_from_model_config


def resolve_spec(model_cfg) -> ModelSpec:
    if model_cfg.path:
        path = Path(model_cfg.path).expanduser()
        if not path.is_dir():
            raise ModelLoadError(f"model.path={model_cfg.path} is not a directory; pass a local Hugging Face "
                                 "checkpoint directory (config.json + *.safetensors)")
        return spec_from_hf_config(path)
    if not LoadFormat(model_cfg.load_format).is_dummy:
        raise ModelLoadError(f"model={model_cfg.name} has no weights: pass model.path=/dir/of/checkpoint, or "
                             "model.load_format=dummy for random weights at the same dimensions")
    return spec_from_model_config(model_cfg)


def model_class(spec: ModelSpec, models: dict[str, type]) -> type:
    if spec.architecture not in models:
        raise ModelLoadError(f"architecture {spec.architecture!r} is provided by no plugin; registered: "
                             f"{', '.join(sorted(models))}. Install a plugin that registers it.")
    return models[spec.architecture]


def build_model(model_cfg, spec: ModelSpec, cls: type, device: torch.device, dtype: torch.dtype,
                seed: int, *, kernels: KernelChoice) -> nn.Module:
    """cls(spec, kernels=kernels) on `device` in `dtype`, with its weights (or dummy ones)."""
    with _default_dtype(dtype), torch.device(device), SkipInit():  # each weight: one uninitialized allocation
        model = cls(spec, kernels=kernels)
    model = model.to(dtype)  # tensors built in an explicit dtype (fp32 buffers), as every float tensor is `dtype`
    model.rotary.inv_freq = model.rotary.__class__(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                                                   kernels=kernels).inv_freq.to(device)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_format = LoadFormat(model_cfg.load_format)
    if model_cfg.path and not load_format.is_dummy:
        load_safetensors(model, Path(model_cfg.path).expanduser())
    else:
        init_dummy(model, seed, model_cfg.dummy_init_std)
        if load_format == LoadFormat.dummy_structured:
            init_structured_dummy(model, seed)
    return model.eval().requires_grad_(False)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class SkipInit(TorchFunctionMode):
    """Leaves out torch.nn.init's fills (the reset_parameters of nn.Linear / nn.Embedding) while a model is built:
    its weights are overwritten by the checkpoint or init_dummy anyway. The model is built on its device rather
    than on meta: meta ops without a C++ kernel run torch._refs, whose first call imports torch._dynamo (seconds)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {}).get("tensor")
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int, std: float) -> None:
    """Seeded random weights drawn on the weights' device (the same seed gives the same weights on one device)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, std, generator=generator)


# Checkpoint tensors the model has no parameter for and that are safe to skip: rotary tables that older exports
# saved as buffers (recomputed from config.json here). A tied lm_head.weight is skipped too (see _is_ignorable).
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached")

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors dtype names, cast to the model's dtype on load
REDOWNLOAD = "download or export the checkpoint again"


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: a model parameter, whole or one row block of a packed parameter. `shape` is
    the checkpoint tensor's; with tensor parallelism `shard` names the part of it this rank's parameter holds."""
    param: str
    start: int
    shape: tuple[int, ...]
    shard: Shard | None = None


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({type(exc).__name__}: {exc}); it "
                                 f"must be JSON with a \"weight_map\" of tensor -> file; {REDOWNLOAD}") from None
        files = [path / str(name) for name in names]
        absent = [file.name for file in files if not file.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names {', '.join(absent)}, which {path} lacks; {REDOWNLOAD}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model.path={path} holds no *.safetensors files")
    return files


def expected_tensors(model: nn.Module) -> dict[str, Slot]:
    """Every checkpoint tensor the model needs, by name without the `model.` prefix: one per parameter, or one
    per shard of a packed parameter (q/k/v_proj for qkv_proj). A tied lm_head shares embed_tokens' tensor."""
    packed_to_shards: dict[str, list[tuple[int, str]]] = {}
    for original, (packed, index) in model.packed_modules.items():
        packed_to_shards.setdefault(packed, []).append((index, original))
    expected: dict[str, Slot] = {}
    for name, param in model.named_parameters():  # duplicates (tied weights) listed once
        module, _, leaf = name.rpartition(".")
        parent, _, module_leaf = module.rpartition(".")
        owner = model.get_submodule(module)
        sharded = owner if isinstance(owner, ShardedParameters) else None
        shards = packed_to_shards.get(module_leaf)
        if shards is None:
            shard = sharded.checkpoint_shard(leaf, 0) if sharded is not None else None
            shape = tuple(param.shape)
            expected[name] = Slot(name, 0, shard.full_shape(shape) if shard else shape, shard)
            continue
        sizes = model.shard_sizes(module_leaf)
        for index, original in sorted(shards):
            shard_name = f"{parent}.{original}.{leaf}" if parent else f"{original}.{leaf}"
            shard = sharded.checkpoint_shard(leaf, index) if sharded is not None else None
            shape = (sizes[index], *param.shape[1:])
            expected[shard_name] = Slot(name, sum(sizes[:index]), shard.full_shape(shape) if shard else shape, shard)
    return expected


def _is_ignorable(name: str, model: nn.Module) -> bool:
    if name.endswith(IGNORABLE_SUFFIXES):
        return True
    return name == "lm_head.weight" and model.lm_head.weight is model.embed_tokens.weight


def _checkpoint_name(name: str) -> str:
    """Our tensor name as Hugging Face checkpoints spell it."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def _listed(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(_checkpoint_name(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


@contextmanager
def _open(file: Path):
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            yield reader
    except (SafetensorError, OSError) as exc:
        detail = " ".join(str(exc).split())
        raise ModelLoadError(f"{file} is not a readable safetensors file ({detail}); it may be truncated or "
                             f"corrupt: {REDOWNLOAD}") from None


def _check_header(file: Path, reader, model: nn.Module, expected: dict[str, Slot],
                  params: dict[str, nn.Parameter], found: dict[str, Path]) -> None:
    """Names, shapes and dtypes from the file's header alone (no tensor data read yet)."""
    unexpected = []
    for raw_name in reader.keys():
        name = raw_name.removeprefix("model.")
        if name in found:
            raise ModelLoadError(f"{raw_name} is in both {found[name]} and {file}; keep one copy "
                                 f"({REDOWNLOAD})")
        slot = expected.get(name)
        if slot is None:
            if not _is_ignorable(name, model):
                unexpected.append(raw_name)
            continue
        found[name] = file
        info = reader.get_slice(raw_name)
        shape = tuple(info.get_shape())
        if shape != slot.shape:
            raise ModelLoadError(f"{file}: {raw_name} has shape {shape}, the model built from config.json expects "
                                 f"{slot.shape}; config.json does not match the weights ({REDOWNLOAD})")
        dtype = info.get_dtype()
        if params[slot.param].is_floating_point() and dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"{file}: {raw_name} holds {dtype} values where a float weight is expected; "
                                 "quantized or non-float checkpoints are not supported: use a float "
                                 "(F32/F16/BF16) checkpoint")
    if unexpected:
        raise ModelLoadError(f"{file} holds tensors the model has no parameter for: {', '.join(unexpected[:6])}"
                             f"{' ...' if len(unexpected) > 6 else ''}; config.json does not match the weights "
                             f"(architecture, num_hidden_layers, attention_bias?) or the file is not this model's")


@torch.no_grad()
def load_safetensors(model: nn.Module, path: Path) -> None:
    """Check every file's header against the model (missing, unexpected, wrong shape or dtype: one-line
    ModelLoadError), then copy the tensors, packed ones into their row block."""
    files = checkpoint_files(path)
    params = dict(model.named_parameters())
    expected = expected_tensors(model)
    found: dict[str, Path] = {}
    for file in files:
        with _open(file) as reader:
            _check_header(file, reader, model, expected, params, found)
    missing = [name for name in expected if name not in found]
    if missing:
        where = files[0] if len(files) == 1 else path / "model.safetensors.index.json"
        where = where if where.exists() else path
        raise ModelLoadError(f"{where} lacks {_listed(missing)} ({len(missing)} of {len(expected)} tensors the "
                             f"model built from config.json needs); the checkpoint is incomplete: {REDOWNLOAD}")
    for file in files:
        with _open(file) as reader:
            for raw_name in reader.keys():
                slot = expected.get(raw_name.removeprefix("model."))
                if slot is None:
                    continue
                try:
                    tensor = (reader.get_tensor(raw_name) if slot.shard is None
                              else slot.shard.read(reader.get_slice(raw_name)))
                except Exception as exc:  # noqa: BLE001 - the file's bytes, whatever the decoder says
                    raise ModelLoadError(f"{file}: {raw_name} cannot be read ({' '.join(str(exc).split())}); "
                                         f"the file is corrupt: {REDOWNLOAD}") from None
                param = params[slot.param]
                (param.narrow(0, slot.start, tensor.shape[0]) if param.dim() else param).copy_(tensor)
