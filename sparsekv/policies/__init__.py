"""The policy plugin API (stable): subclass SparsePolicy or ScorerPolicy; see docs/plugins.md."""
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import (KVGroup, KVLayout, KVReader, PagedChoice, PagedDecodeContext, PolicyContext,
                                       PolicySelectionError, Selection, check_paged_choice, check_selection)
from sparsekv.policies.scorer import ScorerPolicy

__all__ = ["KVGroup", "KVLayout", "KVReader", "PagedChoice", "PagedDecodeContext", "PolicyContext",
           "PolicySelectionError", "ScorerPolicy", "Selection", "SparsePolicy", "check_paged_choice",
           "check_selection"]
