"""Build a registered model class and fill it from safetensors, or with seeded random (dummy) weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from sparsekv.config import LoadFormat
from sparsekv.kernels.backend import KernelChoice
from sparsekv.models.structured_dummy import init_structured_dummy
from sparsekv.models.spec import ModelSpec, spec_from_hf_config, spec_from_model_config


class ModelLoadError(ValueError):
    pass


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
    with torch.device("meta"):
        model = cls(spec, kernels=kernels)
    model = model.to_empty(device=device).to(dtype)
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


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model.path={path} holds no *.safetensors files")
    return files


@torch.no_grad()
def load_safetensors(model: nn.Module, path: Path) -> None:
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(dict(model.named_parameters()).keys())
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                target, shard = _target_param(model, name)
                if target is None or target not in params:
                    continue  # e.g. rotary inv_freq buffers saved by old checkpoints
                tensor = reader.get_tensor(name)
                param = params[target]
                if shard is None:
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ModelLoadError(f"{file.name}: {name} has shape {tuple(tensor.shape)}, model expects "
                                             f"{tuple(param.shape)}; config.json does not match the weights")
                    param.copy_(tensor)
                else:
                    packed_name, index = shard
                    sizes = model.shard_sizes(packed_name)
                    start = sum(sizes[:index])
                    param.narrow(0, start, sizes[index]).copy_(tensor)
                missing.discard(target)
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks weights for: {', '.join(sorted(missing)[:8])}"
                             f"{' ...' if len(missing) > 8 else ''}")


def _target_param(model: nn.Module, checkpoint_name: str) -> tuple[str | None, tuple[str, int] | None]:
    """Map an HF checkpoint name to (our parameter name, packed shard)."""
    name = checkpoint_name.removeprefix("model.")
    for original, (packed, index) in model.packed_modules.items():
        if f".{original}." in name:
            return name.replace(f".{original}.", f".{packed}."), (packed, index)
    return name, None
