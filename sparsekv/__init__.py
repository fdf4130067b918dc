"""sparsekv: long-context LLM inference with the KV cache in host memory and sparse-attention policies."""
from sparsekv.engine.llm_engine import RequestOutput
from sparsekv.errors import PolicyConfigError
from sparsekv.hookspecs import hookimpl
from sparsekv.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "hookimpl", "PolicyConfigError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing the package must not pull in Hydra and the models
        from sparsekv.llm import LLM

        return LLM
    raise AttributeError(name)
