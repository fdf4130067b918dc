"""A checkpoint's tokenizer is loaded once while its files are unchanged: the CLI checks the prompt with it before
the engine tokenizes with it, and a large one takes a good part of a second to load."""
from __future__ import annotations

import json
import os

from sparsekv.tokenizer import ByteTokenizer, load_tokenizer
from tests.conftest import save_tokenizer


def test_the_same_files_give_the_same_tokenizer(tmp_path):
    save_tokenizer(tmp_path / "a", 64)
    save_tokenizer(tmp_path / "b", 64)
    first = load_tokenizer(str(tmp_path / "a"), 64)
    assert load_tokenizer(str(tmp_path / "a"), 64) is first
    other = load_tokenizer(str(tmp_path / "b"), 64)  # another directory with the same files: loaded anew
    assert other is not first and other.encode("the fox") == first.encode("the fox")
    (tmp_path / "b" / "model.safetensors").write_bytes(b"weights are not read by the tokenizer")
    assert load_tokenizer(str(tmp_path / "b"), 64) is other


def test_a_changed_file_loads_the_tokenizer_again(tmp_path):
    save_tokenizer(tmp_path, 64)
    first = load_tokenizer(str(tmp_path), 64)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = "<s>"
    config_path.write_text(json.dumps(config))
    os.utime(config_path, ns=(1, 1))  # a different mtime even on a coarse clock
    again = load_tokenizer(str(tmp_path), 64)
    assert again is not first and again.eos_token_id == 1 and first.eos_token_id == 2


def test_without_a_path_the_byte_tokenizer_or_none():
    assert isinstance(load_tokenizer(None, 258), ByteTokenizer)
    assert load_tokenizer(None, 257) is None
