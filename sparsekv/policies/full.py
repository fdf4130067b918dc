from __future__ import annotations

from dataclasses import dataclass

from sparsekv.policies.base import SparsePolicy


@dataclass
class FullAttentionPolicy(SparsePolicy):
    """Dense attention over every block: the reference every sparse policy is measured against."""
    name: str = "full"
