"""FrontendActor: the engine's edge. Owns the tokenizer and every request's output stream.

It refuses bad input with a ``ValueError`` before anything is allocated, tokenizes, gives each
request its sampling seed, and turns each step's ``EngineOutputs`` into ``RequestOutput``s
delivered to the request's sink (a queue the caller reads).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pykka

from actorlm.messages import AbortRequests, AddRequest, EngineOutputs, SubmitRequest
from actorlm.outputs import CompletionOutput, RequestOutput
from actorlm.sampling_params import SamplingParams

_SEED_RANGE = 1 << 63  # seeds travel as int64 to the sampling kernels


@dataclass
class _Stream:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: object
    stream: bool
    token_ids: list[int] = field(default_factory=list)


class FrontendActor(pykka.ThreadingActor):
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int,
                 scheduler: pykka.ActorRef, seed: int = 0):
        super().__init__()
        self.tokenizer, self.scheduler = tokenizer, scheduler
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self._rng = random.Random(seed)  # seeds for requests that bring none
        self._streams: dict[str, _Stream] = {}

    def on_receive(self, message):
        if isinstance(message, SubmitRequest):
            return self.submit(message)
        if isinstance(message, EngineOutputs):
            self.deliver(message)
        elif isinstance(message, AbortRequests):
            self.scheduler.tell(message)
        else:
            raise TypeError(f"FrontendActor cannot handle {type(message).__name__}")

    def submit(self, msg: SubmitRequest) -> list[int]:
        """Validate and start one request; returns its prompt token ids or raises ValueError."""
        if msg.request_id in self._streams:
            raise ValueError(f"request id {msg.request_id!r} is already in use")
        token_ids = self.tokenize(msg.prompt)
        params = msg.sampling_params
        seed = self._rng.randrange(_SEED_RANGE) if params.seed is None else params.seed % _SEED_RANGE
        text = msg.prompt if isinstance(msg.prompt, str) else None
        self._streams[msg.request_id] = _Stream(text, token_ids, params, msg.sink, msg.stream)
        self.scheduler.tell(AddRequest(msg.request_id, token_ids, params, seed, time.monotonic()))
        return token_ids

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: the prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if not token_ids:
                raise ValueError("prompt_token_ids: the prompt is empty")
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids: token id {bad[0]!r} is outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. "
                             f"However, your request has {len(token_ids)} input tokens. "
                             f"Please reduce the length of the input.")
        return token_ids

    def deliver(self, outputs: EngineOutputs) -> None:
        for delta in outputs.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            stream.token_ids.extend(delta.new_token_ids)
            finished = delta.finish_reason is not None
            if finished:
                del self._streams[delta.request_id]
            if finished or stream.stream:
                stream.sink.put(self._output(delta.request_id, stream, delta, finished))

    def _output(self, request_id: str, stream: _Stream, delta, finished: bool) -> RequestOutput:
        text = self.tokenizer.decode(stream.token_ids,
                                     skip_special_tokens=stream.params.skip_special_tokens)
        completion = CompletionOutput(0, text, list(stream.token_ids),
                                      finish_reason=delta.finish_reason,
                                      stop_reason=delta.stop_reason)
        return RequestOutput(request_id, stream.prompt, stream.prompt_token_ids, [completion],
                             finished, delta.num_cached_tokens, error=delta.error)
