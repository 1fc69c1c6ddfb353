"""Structured outputs: grammars compiled by xgrammar (vLLM's default backend), token bitmasks.

``GrammarCompiler`` turns a request's ``StructuredOutputsParams`` into a compiled grammar on a
thread of its own — compiling a large schema takes a while, and the scheduler's thread must
keep stepping the other requests meanwhile. xgrammar's compiler caches what it compiled
(bounded by ``CACHE_BYTES``), and the one thread takes requests in turn, so each distinct
schema compiles once and a repeat finds it in microseconds. It reports through ``notify(GrammarCompiled)``, a message to the
scheduler. The scheduler holds each request's matcher (``xgrammar.GrammarMatcher``): it fills
the request's row of the step's token bitmask while the worker runs the forward, and advances
the matcher with every token sampled. A preempted request is recomputed, not resampled: its
output tokens stay and its matcher stays where they left it.

xgrammar is imported lazily: an engine that never sees a constrained request never loads it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from actorlm.messages import GrammarCompiled
from actorlm.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse: a server sees many schemas


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int,
                 notify: Callable[[GrammarCompiled], None] | None = None):
        self.tokenizer, self.vocab_size, self.notify = tokenizer, vocab_size, notify
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="actorlm-grammar")
        self._compiler = None  # built on the pool's thread at the first constraint

    def submit(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Compile (or find) the request's grammar; ``notify`` hears when it is ready."""
        future = self._pool.submit(self._compile, params)

        def done(f: Future) -> None:
            error = f.exception()
            if error is not None:
                self.notify(GrammarCompiled(request_id, error=f"structured_outputs: {error}"))
            else:
                self.notify(GrammarCompiled(request_id, grammar=f.result()))

        future.add_done_callback(done)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, here and now (tests and tools)."""
        return self._pool.submit(self._compile, params).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._compiler or self._build_compiler()
        if params.json is not None or params.json_object:
            return compiler.compile_grammar(json_schema_grammar(params.json or '{"type": "object"}'))
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:  # JSON's string escapes are EBNF's
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        return compiler.compile_grammar(params.grammar)

    def _build_compiler(self):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                  cache_limit_bytes=CACHE_BYTES)

        log.info("structured outputs: xgrammar %s ready", importlib.metadata.version("xgrammar"))
        return self._compiler


def json_schema_grammar(schema: str) -> str:
    """The EBNF of a JSON Schema, compact (no whitespace between tokens, so a weak model cannot
    wander in it). xgrammar's rule for a string with a length bound admits raw control
    characters, which JSON forbids inside strings: they are excluded here."""
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]')


def new_matcher(grammar):
    import xgrammar

    return xgrammar.GrammarMatcher(grammar)


def fill_bitmask(matchers: list, vocab_size: int) -> bytes:
    """One row of 32-bit words per matcher: bit t of a row is set when token t is allowed."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask.numpy().tobytes()
