"""actorlm: an LLM inference and serving engine built from actors exchanging typed messages."""

from actorlm.config import EngineConfig
from actorlm.outputs import CompletionOutput, RequestOutput
from actorlm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name):
    # LLM pulls in torch, transformers and the actors: import it only when asked for
    if name == "LLM":
        from actorlm.llm import LLM

        return LLM
    raise AttributeError(f"module 'actorlm' has no attribute {name!r}")
