"""StreamingLLM for sparsekv: attention sinks plus a recent window, as block selection."""
from sparsekv_streamingllm.policy import StreamingLLMPolicy

__all__ = ["StreamingLLMPolicy"]
