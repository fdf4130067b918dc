"""A checkpoint that does not hold exactly the model's tensors fails with one line naming the file and the tensor,
before any generation: missing (packed shards too), unexpected, wrong shape or dtype, corrupt file, bad config."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparsekv.kernels.backend import resolve_kernels
from sparsekv.models.loader import ModelLoadError, build_model, model_class, resolve_spec
from sparsekv.plugins import registry
from tests.conftest import make_checkpoint
from tests.e2e.test_cli import run_cli


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    return {"qwen3": make_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=True, tokenizer=False),
            "llama": make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", tie=False, tokenizer=False)}


def copy_of(pristine: dict[str, Path], arch: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine[arch], tmp_path / arch))


class Cfg:
    """The model config fields the loader reads."""

    def __init__(self, path: Path):
        self.path, self.load_format, self.name, self.dummy_init_std = str(path), "auto", "hf", 0.02


def load(path: Path) -> torch.nn.Module:
    cfg = Cfg(path)
    spec = resolve_spec(cfg)
    kernels = resolve_kernels("cpu", backend="torch")
    return build_model(cfg, spec, model_class(spec, registry().models), torch.device("cpu"), torch.float32, 0,
                       kernels=kernels)


def rewrite(path: Path, edit) -> Path:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return file


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("arch,name", [
    ("qwen3", "model.layers.1.self_attn.k_proj.weight"),
    ("qwen3", "model.layers.0.mlp.gate_proj.weight"),
    ("llama", "model.layers.2.self_attn.q_proj.weight"),
    ("llama", "model.layers.0.mlp.up_proj.weight"),
    ("qwen3", "model.layers.1.self_attn.o_proj.weight"),
    ("llama", "lm_head.weight"),
])
def test_missing_tensor_is_named(pristine, tmp_path, arch, name):
    path = copy_of(pristine, arch, tmp_path)
    file = rewrite(path, lambda t: t.pop(name))
    message = load_error(path)
    assert str(file) in message and name in message and "lacks" in message


def test_wrong_shaped_packed_shard_is_named(pristine, tmp_path):
    path = copy_of(pristine, "qwen3", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-16].contiguous()

    file = rewrite(path, shrink)
    message = load_error(path)
    assert str(file) in message and name in message and "(16, 64)" in message and "(32, 64)" in message


def test_unexpected_tensor_is_named(pristine, tmp_path):
    path = copy_of(pristine, "llama", tmp_path)
    name = "model.layers.0.self_attn.k_proj.bias"
    file = rewrite(path, lambda t: t.update({name: torch.zeros(32)}))
    message = load_error(path)
    assert str(file) in message and name in message


def test_ignorable_tensors_are_skipped(pristine, tmp_path):
    path = copy_of(pristine, "qwen3", tmp_path)  # tied: a saved lm_head.weight is embed_tokens' copy
    rewrite(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
                                      "lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = load(path)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_integer_tensor_where_a_float_weight_is_expected(pristine, tmp_path):
    path = copy_of(pristine, "qwen3", tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    file = rewrite(path, lambda t: t.update({name: t[name].to(torch.int8)}))
    message = load_error(path)
    assert str(file) in message and name in message and "I8" in message


def test_half_precision_checkpoint_is_cast(pristine, tmp_path):
    path = copy_of(pristine, "llama", tmp_path)
    rewrite(path, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    model = load(path)
    reference = load_file(str(path / "model.safetensors"))["model.layers.1.self_attn.v_proj.weight"]
    qkv = model.layers[1].self_attn.qkv_proj.weight
    assert qkv.dtype == torch.float32
    torch.testing.assert_close(qkv[64 + 32:], reference.float(), rtol=0, atol=0)


def test_truncated_file_is_named(pristine, tmp_path):
    path = copy_of(pristine, "qwen3", tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])
    message = load_error(path)
    assert str(file) in message and "truncated" in message


def test_garbage_file_is_named(pristine, tmp_path):
    path = copy_of(pristine, "qwen3", tmp_path)
    file = path / "model.safetensors"
    file.write_bytes(b"\x00garbage, not a safetensors header" * 10)
    message = load_error(path)
    assert str(file) in message and "corrupt" in message


@pytest.mark.parametrize("text,needle", [('{"architectures": ["Qwen3ForCausalLM"], ', "not valid JSON"),
                                         ("[1, 2]", "list")])
def test_invalid_config_json_is_named(pristine, tmp_path, text, needle):
    path = copy_of(pristine, "qwen3", tmp_path)
    (path / "config.json").write_text(text)
    message = load_error(path)
    assert str(path / "config.json") in message and needle in message


def test_cli_shows_a_missing_packed_shard_as_a_one_line_error(pristine, tmp_path):
    path = copy_of(pristine, "qwen3", tmp_path)
    make_checkpoint(path, "qwen3", tie=True)  # with a tokenizer, as a user's checkpoint has
    name = "model.layers.1.self_attn.k_proj.weight"
    rewrite(path, lambda t: t.pop(name))
    result = run_cli(["model=hf", f"model.path={path}", "device=cpu"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and name in errors[0], result.stderr
    assert "output:" not in result.stdout


def test_missing_shard_tensor_of_a_sharded_checkpoint_names_the_index(tmp_path):
    path = make_checkpoint(tmp_path / "sharded", "qwen3", tie=False, shard=True, tokenizer=False)
    name = "model.layers.2.mlp.gate_proj.weight"
    file = next(f for f in sorted(path.glob("*.safetensors")) if name in load_file(str(f)))
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file), metadata={"format": "pt"})
    message = load_error(path)
    assert str(path / "model.safetensors.index.json") in message and name in message
