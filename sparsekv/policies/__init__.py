"""The policy plugin API (stable): subclass SparsePolicy or ScorerPolicy; see docs/plugins.md."""
from sparsekv.policies.base import SparsePolicy
from sparsekv.policies.context import (KVGroup, KVLayout, KVReader, PagedChoice, PagedDecodeContext, PolicyContext,
                                       PolicyOutputError, PolicySelectionError, Selection, check_attention_output,
                                       check_paged_choice, check_selection)
from sparsekv.policies.scorer import ScorerPolicy

__all__ = ["KVGroup", "KVLayout", "KVReader", "PagedChoice", "PagedDecodeContext", "PolicyContext",
           "PolicyOutputError", "PolicySelectionError", "ScorerPolicy", "Selection", "SparsePolicy",
           "check_attention_output", "check_paged_choice", "check_selection"]
