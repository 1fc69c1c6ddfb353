"""One request's latencies as its outputs arrive, told to a stats listener (the server's
metrics, ``api/metrics.py``): time to first token, each inter-token latency, the tokens
generated, and at its end its reason, its time since arrival and its time per output token."""

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
            reason = output.outputs[0].finish_reason if output.outputs else None
            tpot = None
            if self.first_token is not None and num_tokens > 1:
                tpot = (now - self.first_token) / (num_tokens - 1)
            self._end("error" if output.error else (reason or "abort"), tpot)
        return new

    def cut_short(self, reason: str) -> None:
        """The request ended without a finished output (aborted, or its engine failed)."""
        self._end(reason, None)

    def _end(self, reason: str, tpot: float | None) -> None:
        if self.listener is not None:
            self.listener.observe_finished(reason, time.monotonic() - self.arrival, tpot)
