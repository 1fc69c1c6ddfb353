"""What a caller gets back: vLLM's RequestOutput / CompletionOutput shapes, and for a pooling
model's requests its EmbeddingRequestOutput, ClassificationRequestOutput and
ScoringRequestOutput; ``DeltaOutputs`` cuts a stream of cumulative outputs into deltas."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    """One candidate token at one position (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: token id -> Logprob, the token actually chosen first, then the top-k
PositionLogprobDict = dict[int, Logprob]


@dataclass
class RequestStateStats:
    """When a request's tokens came (vLLM's ``RequestStateStats``), on the frontend's monotonic
    clock: its arrival, its first and its latest generated token, and how many it has."""

    arrival_time: float
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    num_generation_tokens: int = 0

    @property
    def first_token_latency(self) -> float | None:
        return None if self.first_token_ts is None else self.first_token_ts - self.arrival_time

    def add_tokens(self, num_tokens: int, now: float) -> None:
        if num_tokens:
            if self.first_token_ts is None:
                self.first_token_ts = now
            self.last_token_ts = now
            self.num_generation_tokens += num_tokens


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobDict] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:  # (vLLM's CompletionOutput has it: scripts written for it call it)
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobDict | None] | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    error_field: str | None = None  # the request field at fault, where the client's was
    metrics: RequestStateStats | None = None


@dataclass
class PoolingRequestOutput:
    """A pooling model's answer to one prompt (vLLM's ``PoolingRequestOutput``): its
    ``outputs`` are empty when the request failed (``error``)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class PoolingOutput:
    data: Any  # a torch tensor: the vector (embed) or the probabilities (classify)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    @property
    def values(self) -> list[float]:  # what a task-blind caller (``LLM.encode``, /pooling) reads
        return self.embedding


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label (the logits with use_activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @property
    def values(self) -> list[float]:
        return self.probs


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """How well one pair matches (vLLM's ``ScoringRequestOutput``): a cross-encoder's
    probability, or the cosine similarity of an embedding model's two vectors."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the pair's (a cross-encoder's); the first text's otherwise
    finished: bool


class DeltaOutputs:
    """One request's cumulative outputs as what each adds (vLLM's ``DELTA`` kind): each
    completion's new text, tokens and logprobs; the prompt's logprobs with the first only."""

    def __init__(self):
        self._sent: dict[int, tuple[int, int]] = {}  # index -> (characters, tokens) given

    def __call__(self, output: RequestOutput) -> RequestOutput:
        first = not self._sent
        outputs = []
        for c in output.outputs:
            chars, tokens = self._sent.get(c.index, (0, 0))
            self._sent[c.index] = (len(c.text), len(c.token_ids))
            outputs.append(dataclasses.replace(
                c, text=c.text[chars:], token_ids=c.token_ids[tokens:],
                logprobs=None if c.logprobs is None else c.logprobs[tokens:]))
        return dataclasses.replace(output, outputs=outputs,
                                   prompt_logprobs=output.prompt_logprobs if first else None)
