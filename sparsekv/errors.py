"""Exceptions a user (or a plugin author) sees; each is shown by the CLI as one line, exit status 2."""
from __future__ import annotations


class PolicyConfigError(ValueError):
    """A policy hyperparameter out of range. Raise it from a policy's __post_init__ with the key, the value and
    the fix, e.g. `PolicyConfigError(f"token_budget={self.token_budget} must be at least block_size")`; the
    factory adds the policy's name and, for a plugin, its package. (A plain ValueError from __post_init__ is
    treated the same way.)"""
