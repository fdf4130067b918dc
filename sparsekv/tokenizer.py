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


def load_tokenizer(model_path: str | None, vocab_size: int) -> Tokenizer | None:
    if model_path:
        path = Path(model_path).expanduser()
        if any((path / name).is_file() for name in TOKENIZER_FILES):
            return HFTokenizer(path)
        return None  # token ids in, token ids out
    return ByteTokenizer() if vocab_size >= 258 else None
