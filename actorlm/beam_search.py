"""Beam search over the engine's one-token steps (vLLM's ``LLM.beam_search`` and
``use_beam_search``).

A search keeps ``beam_width`` live beams. Each step asks the engine for one token of every
live beam (the beam's tokens as the prompt, prefix caching recomputing only its tail) with
``2 * beam_width`` logprobs; every candidate becomes a beam of the next step, scored by its
cumulative logprob over its generated length to the ``length_penalty``; a candidate
that is an end token finishes (unless ``ignore_eos``), the best ``beam_width`` of the others
live on. After ``max_tokens`` steps the finished and the live beams together give the best
``beam_width``. Without end tokens this is transformers' beam search (every beam has one
length, so the best stay the best by cumulative logprob).

Pure logic: the callers (``LLM``, ``AsyncLLM``) run the steps.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from actorlm.outputs import CompletionOutput, Logprob, RequestOutput
from actorlm.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be at least 0, got {self.temperature!r}")

    def step_params(self, max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        """What each beam's one-token step asks the engine for: 2 x beam_width logprobs, which
        the engine's ``max_logprobs`` must allow (-1: any number)."""
        if max_logprobs != -1 and 2 * self.beam_width > max_logprobs:
            raise ValueError(f"beam_width {self.beam_width}: each step reads 2 x beam_width "
                             f"candidates, at most {max_logprobs} (--max-logprobs)")
        return SamplingParams(max_tokens=1, temperature=self.temperature,
                              logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's and the generated ones (vLLM's)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: its live beams and the finished ones."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: frozenset[int], max_model_len: int):
        if len(prompt_token_ids) >= max_model_len:
            raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) leaves no room to "
                             f"generate within max_model_len {max_model_len}")
        self.prompt_token_ids, self.params = list(prompt_token_ids), params
        self.prompt_len = len(prompt_token_ids)
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.steps_left = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return not self.beams or self.steps_left == 0

    def advance(self, outputs: list[RequestOutput]) -> None:
        """One step: ``outputs[i]``, the output of the live beam i's one-token request, whose
        logprobs are the beam's next tokens."""
        grown = []
        for beam, output in zip(self.beams, outputs, strict=True):
            position = output.outputs[0].logprobs[0]
            for token, logprob in position.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [position],
                                           beam.cum_logprob + logprob.logprob)
                if token in self.eos_token_ids:
                    child.finish_reason = "stop"
                    self.finished.append(child)
                else:
                    grown.append(child)
        self.beams = sorted(grown, key=self.score, reverse=True)[:self.params.beam_width]
        self.steps_left -= 1

    def score(self, beam: BeamSearchSequence) -> float:
        """The cumulative logprob over the generated length (an end token not counted) to
        the length penalty, as transformers ranks hypotheses (vLLM counts the prompt in the
        length too)."""
        length = len(beam.tokens) - self.prompt_len - (beam.finish_reason == "stop")
        try:
            return beam.cum_logprob / max(length, 1) ** self.params.length_penalty
        except OverflowError:  # an extreme penalty: the longer beam always ranks first
            return -0.0
        except ZeroDivisionError:  # ... or always last
            return -math.inf

    def best(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` of the finished and the live beams, best first."""
        for beam in self.beams:
            beam.finish_reason = "length"
        ranked = sorted(self.finished + self.beams, key=self.score, reverse=True)
        return ranked[:self.params.beam_width]

    def request_output(self, request_id: str, decode) -> RequestOutput:
        """The best beams as one request's ``n`` outputs (``decode``: token ids -> text, the
        end token left out unless ``include_stop_str_in_output``)."""
        outputs = []
        for index, beam in enumerate(self.best()):
            generated = beam.tokens[self.prompt_len:]
            shown = generated if beam.finish_reason != "stop" or \
                self.params.include_stop_str_in_output else generated[:-1]
            outputs.append(CompletionOutput(index, decode(shown), generated, beam.cum_logprob,
                                            beam.logprobs, beam.finish_reason))
        return RequestOutput(request_id, None, self.prompt_token_ids, outputs, True)


class BeamSearchStream:
    """A search running on the event loop, as a request's stream: its one output, the final;
    ``abort()`` cancels it (and the step in flight)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], task: asyncio.Task):
        self.request_id, self.prompt_token_ids, self._task = request_id, prompt_token_ids, task
        self.finished = False

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            return await self._task
        finally:
            self.finished = True

    def abort(self) -> None:
        self._task.cancel()
