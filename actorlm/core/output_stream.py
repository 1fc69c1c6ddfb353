"""One caller request's output as the frontend assembles it. Pure; the FrontendActor owns these.

A request with ``n`` completions runs as ``n`` engine requests (children); its stream fans them
back in. Each child's tokens are detokenized incrementally, checked for stop strings (the
engine cannot see text, so a hit here finishes the child and asks the scheduler to stop it),
and their logprobs turned into vLLM's shape. A pooling model's request (``pooling``: its task)
has one child, no tokens, and ends with its vector: an ``EmbeddingRequestOutput``, or a
classifier's ``ClassificationRequestOutput``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from actorlm.core.detokenizer import IncrementalDetokenizer, find_stop_string
from actorlm.messages import PositionLogprobs, RequestDelta, engine_request_ids
from actorlm.outputs import (ClassificationOutput, ClassificationRequestOutput,
                             CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                             RequestOutput, RequestStateStats)
from actorlm.sampling_params import SamplingParams


@dataclass
class _Sequence:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    engine_finished: bool = False  # the scheduler has released it (after a stop string, later)


class OutputStream:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer, sink, stream: bool,
                 pooling: str | None = None, arrival_time: float = 0.0):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.stats = RequestStateStats(arrival_time)  # the frontend notes when tokens come
        self.pooling = pooling
        self.pooled: bytes | None = None  # an embedding request's vector, once it finished
        self.params, self.tokenizer, self.sink, self.stream = params, tokenizer, sink, stream
        self.engine_ids = engine_request_ids(request_id, params.n)
        wants_logprobs = params.logprobs is not None
        self.sequences = [_Sequence(
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                   params.spaces_between_special_tokens),
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None) for _ in range(params.n)]
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.error: str | None = None
        self.error_field: str | None = None  # the request field the error names, if any
        self.num_cached_tokens = 0  # prompt tokens the first child found in the prefix cache
        # text is needed token by token only to stream it or to find stop strings; otherwise
        # one decode at the end gives the same text for a fraction of the work
        self._incremental = stream or bool(params.stop)
        # while streaming, hold back text that could still turn out to start a stop string
        self._holdback = (max(map(len, params.stop)) - 1
                          if params.stop and not params.include_stop_str_in_output else 0)

    @property
    def finished(self) -> bool:
        """Every child is done and its blocks are back: a caller woken by the final output
        never finds the engine still holding them."""
        return all(s.engine_finished for s in self.sequences)

    def apply(self, index: int, delta: RequestDelta) -> str | None:
        """Apply one child's delta; returns a stop string if one just finished the child."""
        seq = self.sequences[index]
        seq.engine_finished |= delta.finish_reason is not None
        if seq.finish_reason is not None:
            return None  # stopped here already; the engine's last words are moot
        if index == 0 and delta.new_token_ids:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.pooled is not None:
            self.pooled, self.num_cached_tokens = delta.pooled, delta.num_cached_tokens
        if delta.prompt_logprobs and index == 0 and self.prompt_logprobs is not None:
            self.prompt_logprobs += [self._logprob_dict(p) for p in delta.prompt_logprobs]
        new_logprobs = delta.new_logprobs or [None] * len(delta.new_token_ids)
        # vLLM's rule: the token that stopped the engine (EOS, a stop token id, the one that
        # ended a grammar) is the answer's last token but not part of its text, unless
        # include_stop_str_in_output (it shows with skip_special_tokens false, or when a stop
        # token id is a word's)
        stop_token = len(delta.new_token_ids) if delta.finish_reason == "stop" and \
            not self.params.include_stop_str_in_output else 0
        for j, (token_id, position) in enumerate(zip(delta.new_token_ids, new_logprobs), 1):
            seq.token_ids.append(token_id)
            if position is not None and seq.logprobs is not None:
                seq.logprobs.append(self._logprob_dict(position))
                seq.cumulative_logprob += position.logprobs[0]
            if not self._incremental or j == stop_token:
                continue
            new_text = seq.detokenizer.add(token_id)
            seq.text += new_text
            if self.params.stop and len(seq.token_ids) >= self.params.min_tokens:
                hit = find_stop_string(seq.text, len(new_text), self.params.stop,
                                       self.params.include_stop_str_in_output)
                if hit is not None:
                    seq.text = seq.text[:hit[1]]
                    seq.finish_reason, seq.stop_reason = "stop", hit[0]
                    return hit[0]
        if delta.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
            if self.error is None:
                self.error, self.error_field = delta.error, delta.error_field
            if not self._incremental:
                seq.text = seq.detokenizer.decode_all(
                    seq.token_ids[:-1] if stop_token else seq.token_ids)
        return None

    def fail(self, error: str) -> list[str]:
        """End every unfinished child with ``error``; returns the engine ids still running."""
        self.error = self.error or error
        for seq in self.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
        return [rid for rid, seq in zip(self.engine_ids, self.sequences) if not seq.engine_finished]

    def output(self) -> RequestOutput | EmbeddingRequestOutput:
        finished = self.finished
        if self.pooling:
            vector = [] if self.pooled is None else \
                np.frombuffer(self.pooled, dtype=np.float32).tolist()
            kind, output = (ClassificationRequestOutput, ClassificationOutput) \
                if self.pooling == "classify" else (EmbeddingRequestOutput, EmbeddingOutput)
            return kind(self.request_id, output(vector), self.prompt_token_ids, finished,
                        self.num_cached_tokens, self.error)
        completions = []
        for i, seq in enumerate(self.sequences):
            done = seq.finish_reason is not None
            text = seq.text if done or not self._holdback else seq.text[:max(0, len(seq.text) - self._holdback)]
            completions.append(CompletionOutput(
                i, text, list(seq.token_ids), seq.cumulative_logprob,
                list(seq.logprobs) if seq.logprobs is not None else None,
                seq.finish_reason, seq.stop_reason))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished, error=self.error, error_field=self.error_field,
                             num_cached_tokens=self.num_cached_tokens,
                             # copies: the list grows with later chunks, the caller's must not
                             prompt_logprobs=None if self.prompt_logprobs is None
                             else list(self.prompt_logprobs),
                             metrics=dataclasses.replace(self.stats))

    def _logprob_dict(self, position: PositionLogprobs) -> dict[int, Logprob]:
        ranks = [position.rank] + list(range(1, len(position.token_ids)))
        out: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(position.token_ids, position.logprobs, ranks):
            if token_id not in out:  # the chosen token may also be among the top-k
                out[token_id] = Logprob(logprob, rank, self.tokenizer.decode([token_id]))
        return out
