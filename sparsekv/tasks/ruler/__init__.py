"""RULER-style synthetic long-context tasks built from any checkpoint's own tokenizer."""
