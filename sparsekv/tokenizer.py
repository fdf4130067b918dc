"""Tokenizers: a checkpoint's own (through transformers, offline), or bytes for the built-in tiny model."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, then BOS and EOS; ids past 257 decode to nothing."""
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        self.inner = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.eos_token_id = self.inner.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.inner.decode(token_ids, skip_special_tokens=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_last_loaded: tuple[tuple, HFTokenizer] | None = None  # (checkpoint_files_key(path), its tokenizer)


def load_tokenizer(model_path: str | None, vocab_size: int) -> Tokenizer | None:
    if model_path:
        path = Path(model_path).expanduser()
        if any((path / name).is_file() for name in TOKENIZER_FILES):
            return checkpoint_tokenizer(path)
        return None  # token ids in, token ids out
    return ByteTokenizer() if vocab_size >= 258 else None


def checkpoint_files_key(path: Path) -> tuple:
    """The directory and the name, size and mtime of each file in it but the weights: what the tokenizer reads."""
    files = sorted((entry.name, stat.st_size, stat.st_mtime_ns) for entry in path.iterdir()
                   if not entry.name.endswith(WEIGHT_SUFFIXES) and entry.is_file() and (stat := entry.stat()))
    return str(path.resolve()), tuple(files)


def checkpoint_tokenizer(path: Path) -> HFTokenizer:
    """The CLI checks the prompt with the checkpoint's tokenizer, then the engine tokenizes with it: loading a large
    tokenizer takes a good part of a second, so the last one loaded is reused while its directory's files are
    unchanged. Callers only encode and decode with it."""
    global _last_loaded
    key = checkpoint_files_key(path)
    if _last_loaded is None or _last_loaded[0] != key:
        _last_loaded = (key, HFTokenizer(path))
    return _last_loaded[1]
