"""One request's latencies as its outputs arrive, told to a stats listener (the server's
metrics, ``api/metrics.py``): time to first token, each inter-token latency, the tokens
generated, and at its end its reason, its time since arrival and its time per output token;
or all of it at once from a finished output (``observe_finished_output``, the offline
``LLM``'s)."""

from __future__ import annotations

import time

from actorlm.outputs import RequestOutput


class RequestTiming:
    __slots__ = ("listener", "arrival", "first_token", "last_token", "num_tokens")

    def __init__(self, listener, arrival: float):
        self.listener = listener  # None: nobody listens, and only the token count is kept
        self.arrival = self.last_token = arrival
        self.first_token: float | None = None
        self.num_tokens = 0  # generated so far, over all n completions

    def on_output(self, output: RequestOutput) -> int:
        """Note a cumulative output; returns the tokens it adds."""
        now = time.monotonic()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        new = num_tokens - self.num_tokens
        if new > 0:
            if self.listener is not None:
                if self.first_token is None:
                    self.listener.observe_first_token(now - self.arrival)
                else:
                    self.listener.observe_inter_token(now - self.last_token)
                self.listener.add_generation_tokens(new)
            if self.first_token is None:
                self.first_token = now
            self.last_token, self.num_tokens = now, num_tokens
        if output.finished:
            tpot = None
            if self.first_token is not None and num_tokens > 1:
                tpot = (now - self.first_token) / (num_tokens - 1)
            self._end(finish_reason_of(output), tpot)
        return new

    def cut_short(self, reason: str) -> None:
        """The request ended without a finished output (aborted, or its engine failed)."""
        self._end(reason, None)

    def _end(self, reason: str, tpot: float | None) -> None:
        if self.listener is not None:
            self.listener.observe_finished(reason, time.monotonic() - self.arrival, tpot)


def finish_reason_of(output: RequestOutput) -> str:
    """The ``finished_reason`` label a finished output counts under."""
    reason = output.outputs[0].finish_reason if output.outputs else None
    return "error" if output.error else (reason or "abort")


def observe_finished_output(listener, output, now: float) -> None:
    """A finished output, received at ``now`` (``time.monotonic``, the frontend's clock): its
    counts and latencies, from the times its frontend noted (``RequestOutput.metrics``), told
    to ``listener`` at once. The offline ``LLM``'s way, which sees no output before the last
    (and so no inter-token latencies). A pooling model's answer counts its prompt alone."""
    listener.on_request_added(len(output.prompt_token_ids))
    stats = getattr(output, "metrics", None)
    if stats is None:
        return
    listener.add_generation_tokens(stats.num_generation_tokens)
    if stats.first_token_latency is not None:
        listener.observe_first_token(stats.first_token_latency)
    tpot = None
    if stats.num_generation_tokens > 1:
        tpot = (stats.last_token_ts - stats.first_token_ts) / (stats.num_generation_tokens - 1)
    listener.observe_finished(finish_reason_of(output), now - stats.arrival_time, tpot)
