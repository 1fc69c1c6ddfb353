"""A log line per request and per answer, as vLLM's ``--enable-log-requests`` and
``--enable-log-outputs`` write them (``RequestLog``): what came in (the prompt, its token ids,
the sampling parameters, the adapter) and what went out (the text, its token ids, why it
stopped), each clipped to ``--max-log-len`` characters or ids. Off by default, as in vLLM:
prompts are the users' data, and the trace already records every request's lifecycle."""

from __future__ import annotations

import logging
from typing import Callable

from actorlm.outputs import RequestOutput

log = logging.getLogger("actorlm.requests")


class RequestLog:
    def __init__(self, inputs: bool, outputs: bool, max_len: int | None,
                 decode: Callable[[list[int]], str]):
        self.inputs, self.outputs, self.max_len, self.decode = inputs, outputs, max_len, decode

    def received(self, request_id: str, prompt_ids: list[int], params, lora) -> None:
        if self.inputs:
            ids = self._clipped(prompt_ids)
            log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, "
                     "lora_request: %s", request_id, self._clipped(self.decode(ids)), params,
                     ids, lora)

    def answered(self, out: RequestOutput) -> None:
        if self.outputs and out.finished:
            for c in out.outputs:
                log.info("Generated response %s (choice %d): output: %r, output_token_ids: "
                         "%s, finish_reason: %s", out.request_id, c.index,
                         self._clipped(c.text), self._clipped(c.token_ids), c.finish_reason)

    def _clipped(self, items):
        return items if self.max_len is None else items[:self.max_len]
