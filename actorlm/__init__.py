"""actorlm: an LLM inference and serving engine built from actors exchanging typed messages."""

from actorlm.beam_search import BeamSearchParams
from actorlm.config import EngineConfig
from actorlm.lora_request import LoRARequest
from actorlm.outputs import (ClassificationRequestOutput, CompletionOutput,
                             EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                             ScoringRequestOutput)
from actorlm.pooling import PoolingParams
from actorlm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "EngineDeadError", "EngineShutdownError", "EngineConfig",
           "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest", "PoolingParams",
           "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput",
           "PoolingRequestOutput", "BeamSearchParams", "RequestOutputKind"]

_LAZY = {"LLM": "actorlm.llm", "AsyncLLM": "actorlm.async_llm",
         "EngineDeadError": "actorlm.actors.supervisor",
         "EngineShutdownError": "actorlm.actors.supervisor"}


def __getattr__(name):
    # these pull in torch, transformers and the actors: import them only when asked for
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'actorlm' has no attribute {name!r}")
