from sparsekv.policies.xattn.policy import XAttentionPolicy

__all__ = ["XAttentionPolicy"]
