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

With a reasoning parser (``--reasoning-parser``) a request's grammar applies only after its
think: the compiler hands each request a ``GatedGrammar`` (the grammar and where the prompt
leaves the think, ``reasoning.ThinkTokens``), whose ``GatedMatcher`` allows every token and
feeds none to the grammar until the end-of-think token (vLLM's behaviour).

xgrammar is imported lazily: an engine that never sees a constrained request never loads it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from actorlm.messages import GrammarCompiled
from actorlm.reasoning import Phase, ThinkGate, ThinkTokens
from actorlm.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse: a server sees many schemas


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int,
                 notify: Callable[[GrammarCompiled], None] | None = None,
                 reasoning: ThinkTokens | None = None, any_whitespace: bool = False):
        self.tokenizer, self.vocab_size, self.notify = tokenizer, vocab_size, notify
        self.any_whitespace = any_whitespace  # between a JSON Schema's tokens (else compact)
        self.reasoning = reasoning  # grammars wait for the end of the think
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="actorlm-grammar")
        self._compiler = None  # built on the pool's thread at the first constraint

    def submit(self, request_id: str, params: StructuredOutputsParams,
               prompt_token_ids: Sequence[int] = ()) -> None:
        """Compile (or find) the request's grammar; ``notify`` hears when it is ready. With a
        reasoning parser the prompt says whether the output starts inside a think."""
        future = self._pool.submit(self._compile, params)
        phase = None if self.reasoning is None else self.reasoning.initial_phase(prompt_token_ids)

        def done(f: Future) -> None:
            error = f.exception()
            if error is not None:
                self.notify(GrammarCompiled(request_id, error=f"structured_outputs: {error}"))
            elif phase is None:
                self.notify(GrammarCompiled(request_id, grammar=f.result()))
            else:
                self.notify(GrammarCompiled(request_id, grammar=GatedGrammar(
                    f.result(), self.reasoning, phase)))

        future.add_done_callback(done)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar, here and now (tests and tools)."""
        return self._pool.submit(self._compile, params).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._compiler or self._build_compiler()
        if params.json is not None or params.json_object:
            return compiler.compile_grammar(json_schema_grammar(params.json or '{"type": "object"}',
                                                                self.any_whitespace))
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:  # JSON's string escapes are EBNF's
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        if params.structural_tag is not None:
            return compiler.compile_grammar(structural_tag_grammar(params.structural_tag))
        return compiler.compile_grammar(params.grammar)

    def _build_compiler(self):
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                  cache_limit_bytes=CACHE_BYTES)

        log.info("structured outputs: xgrammar %s ready", importlib.metadata.version("xgrammar"))
        return self._compiler


def structural_tag_grammar(spec: str):
    """The grammar of a structural tag (vLLM's ``structural_tag``): xgrammar's own format
    (``{"type": "structural_tag", "format": {...}}``), or vLLM's first one, ``structures``
    (``begin``, ``schema``, ``end``) and ``triggers``, read as the ``triggered_tags`` format it
    became: free text, in which a trigger opens the structure whose ``begin`` it starts, whose
    content then follows its JSON Schema up to its ``end``."""
    import xgrammar

    tag = json.loads(spec)
    if "structures" in tag:
        structures = tag["structures"]
        if not (isinstance(structures, list) and all(
                isinstance(s, dict) and {"begin", "schema", "end"} <= s.keys()
                for s in structures)):
            raise ValueError("structural_tag: each of its structures needs a begin, a schema "
                             "and an end")
        tags = [{"begin": s["begin"], "end": s["end"],
                 "content": {"type": "json_schema", "json_schema": s["schema"]}}
                for s in structures]
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}}
    return xgrammar.Grammar.from_structural_tag(json.dumps(tag))


def json_schema_grammar(schema: str, any_whitespace: bool = False) -> str:
    """The EBNF of a JSON Schema, its separators fixed (``", "``, ``": "``, no other whitespace
    between tokens, so a weak model cannot wander in it) unless ``any_whitespace`` (vLLM's
    xgrammar default, which ``--structured-outputs-config '{"disable_any_whitespace": false}'``
    asks for). xgrammar's
    rule for a string with a length bound admits raw control characters, which JSON forbids
    inside strings: they are excluded here."""
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return ebnf.replace(r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]')


@dataclass(frozen=True)
class GatedGrammar:
    """One request's compiled grammar that applies only after its think."""

    grammar: object  # xgrammar.CompiledGrammar
    tokens: ThinkTokens
    phase: Phase  # where the prompt leaves the think


class GatedMatcher:
    """An ``xgrammar.GrammarMatcher`` behind a ``ThinkGate``: inside the think every token is
    allowed and none reaches the grammar; before any think the grammar's tokens and the start
    tag are allowed; after it, the grammar's alone."""

    def __init__(self, matcher, gate: ThinkGate):
        self.matcher, self.gate = matcher, gate

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id) if self.gate.on_token(token_id) else True

    def is_terminated(self) -> bool:
        return not self.gate.is_reasoning and self.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        # bitmask: [rows, ceil(vocab / 32)] int32, bit t of a row set when token t is allowed
        if self.gate.is_reasoning:
            bitmask[row] = -1
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.gate.may_open:
            token_id = self.gate.start_token_id
            bit = 1 << (token_id & 31)
            bitmask[row, token_id >> 5] |= bit - (1 << 32) if bit >= 1 << 31 else bit


def new_matcher(grammar):
    import xgrammar

    if isinstance(grammar, GatedGrammar):
        return GatedMatcher(xgrammar.GrammarMatcher(grammar.grammar),
                            grammar.tokens.gate(grammar.phase))
    return xgrammar.GrammarMatcher(grammar)


def fill_bitmask(matchers: list, vocab_size: int) -> bytes:
    """One row of 32-bit words per matcher: bit t of a row is set when token t is allowed."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask.numpy().tobytes()
