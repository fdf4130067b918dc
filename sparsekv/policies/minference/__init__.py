from sparsekv.policies.minference.policy import MInferencePolicy

__all__ = ["MInferencePolicy"]
