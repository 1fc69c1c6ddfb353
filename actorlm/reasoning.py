"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reply's ``<think>…</think>`` apart
from its content.

One rule, followed at two levels. ``ReasoningStream`` splits *text* as it streams, for the
API's ``reasoning_content`` (a complete answer is the same stream fed once, so streamed and
whole answers cannot differ). ``ThinkGate`` follows the same phases over *token ids*, so that a
request's grammar constrains only what comes after the reasoning (``core/structured_output``:
vLLM applies the grammar once the end-of-think token is generated).

Both start where the prompt leaves them (``ThinkTokens.initial_phase``), reading its last turn
alone (from the parser's turn token on, where the tokenizer has one: an earlier answer's think
in the history says nothing of this one):

- the last think tag is ``<think>`` (the chat template opened it): reasoning;
- it is ``</think>`` (the template closed an empty think, as Qwen3's does for
  ``enable_thinking=False``): content;
- no tag: ``deepseek_r1`` reasons first (R1 may omit the opening tag); ``qwen3`` reasons only
  if the output opens with ``<think>``, and is all content otherwise.

The other parsers are these two rules under other tags (``seed_oss``'s ``<seed:think>``,
``mistral``'s ``[THINK]``), but ``openai_gptoss``: GPT-OSS's harmony channels (``harmony.py``). Where the tags are special tokens (Magistral's), a chat request
keeps special tokens in its text, or the tags would not be there to split on.

From there the reasoning ends at the first ``</think>``; an unterminated think is all
reasoning; an opening ``<think>`` at the very start of the reasoning (after whitespace, which
goes with it) is dropped; after ``</think>`` everything is content, tags included.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class Phase(enum.IntEnum):
    BEFORE = 0  # no think yet: content, unless the output opens with the start tag
    REASONING = 1
    CONTENT = 2


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    reasons_first: bool  # with no tag in the prompt, the output starts inside its think
    turn_tag: str | None = None  # the token that begins the turn the output continues
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    harmony: bool = False  # GPT-OSS's channels, not tags (``harmony.py``)


_DEEPSEEK_TURN, _CHATML_TURN = "<｜Assistant｜>", "<|im_start|>"
REASONING_PARSERS = {parser.name: parser for parser in (
    ReasoningParser("deepseek_r1", True, _DEEPSEEK_TURN),
    # V3.1's template opens the think (thinking: true) or closes it; V3 has none: all content
    ReasoningParser("deepseek_v3", False, _DEEPSEEK_TURN),
    ReasoningParser("glm45", False, "<|assistant|>"),
    ReasoningParser("mimo", False, _CHATML_TURN),
    ReasoningParser("minimax_m2", True),
    ReasoningParser("mistral", False, "[/INST]", "[THINK]", "[/THINK]"),
    ReasoningParser("openai_gptoss", True, harmony=True),
    ReasoningParser("qwen3", False, _CHATML_TURN),
    ReasoningParser("seed_oss", True, "<seed:bos>", "<seed:think>", "</seed:think>"),
    ReasoningParser("step3", True),
)}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; a ValueError naming the flag and the known ones otherwise."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} "
                         f"(known: {', '.join(REASONING_PARSERS)})")
    return parser


def reasoning_tokens(parser: ReasoningParser, tokenizer, model: str = ""):
    """The parser bound to a tokenizer: a ``ThinkTokens``, or for GPT-OSS's channels a
    ``harmony.HarmonyTokens`` (the same interface)."""
    if parser.harmony:
        from actorlm.harmony import HarmonyTokens

        return HarmonyTokens.for_tokenizer(tokenizer, model)
    return ThinkTokens.for_tokenizer(parser, tokenizer, model)


@dataclass(frozen=True)
class ThinkTokens:
    """A parser bound to a tokenizer: the ids of its two tags, which must be single tokens (as
    in vLLM), or the engine could not see in the token stream where a think ends; the id of its
    turn token if the tokenizer has it; whether the tags are special tokens, which a decode
    that skips special tokens would drop from the text."""

    parser: ReasoningParser
    start_token_id: int
    end_token_id: int
    turn_token_id: int | None = None
    tags_are_special: bool = False

    @classmethod
    def for_tokenizer(cls, parser: ReasoningParser, tokenizer, model: str = "") -> ThinkTokens:
        vocab = tokenizer.get_vocab()
        ids = []
        for tag in (parser.start_tag, parser.end_tag):
            if tag not in vocab:
                raise ValueError(f"--reasoning-parser {parser.name}: the tokenizer of "
                                 f"{model or 'the model'} has no {tag!r} token; this model does "
                                 f"not think in {parser.start_tag}…{parser.end_tag} (leave the "
                                 f"flag out)")
            ids.append(vocab[tag])
        special = any(tokenizer.decode([i], skip_special_tokens=True) == "" for i in ids)
        return cls(parser, *ids, vocab.get(parser.turn_tag), special)

    def initial_phase(self, prompt_token_ids: Sequence[int]) -> Phase:
        """Where the output starts: inside a think the prompt opened, after one it closed, or
        (no tag in the last turn) as the parser says."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.start_token_id:
                return Phase.REASONING
            if token_id == self.end_token_id:
                return Phase.CONTENT
            if token_id == self.turn_token_id:
                break
        return Phase.REASONING if self.parser.reasons_first else Phase.BEFORE

    def text_stream(self, prompt_token_ids: Sequence[int]) -> ReasoningStream:
        return ReasoningStream(self.parser, self.initial_phase(prompt_token_ids))

    def gate(self, phase: Phase) -> ThinkGate:
        return ThinkGate(self.start_token_id, self.end_token_id, phase)


class ReasoningStream:
    """One choice's text, split as it arrives: ``feed(text)`` returns the (reasoning, content)
    it can tell apart so far; text that may still turn out to be a tag (``"</thi"``) is held
    back until the next piece or ``finish()``."""

    def __init__(self, parser: ReasoningParser, phase: Phase):
        self.parser, self.phase = parser, phase
        self.has_reasoning = phase is Phase.REASONING  # a think was entered (maybe empty)
        # the start of a think (or of a BEFORE phase) may still bring an opening tag
        self._may_open = phase is not Phase.CONTENT
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        buffer, self._held = self._held + text, ""
        while buffer:
            if self.phase is Phase.CONTENT:
                content.append(buffer)
                break
            if self._may_open:
                head = buffer.lstrip()
                start = self.parser.start_tag
                if not head or (start.startswith(head) and head != start):
                    self._held = buffer  # whitespace or part of an opening tag: wait
                    break
                self._may_open = False
                if head.startswith(start):  # the opening tag goes, with what led to it
                    buffer, self.phase, self.has_reasoning = head[len(start):], \
                        Phase.REASONING, True
                elif self.phase is Phase.BEFORE:
                    self.phase = Phase.CONTENT  # no think at all
                continue
            end = self.parser.end_tag
            at = buffer.find(end)
            if at >= 0:
                reasoning.append(buffer[:at])
                buffer, self.phase = buffer[at + len(end):], Phase.CONTENT
                continue
            keep = partial_tag_length(buffer, end)
            reasoning.append(buffer[:len(buffer) - keep])
            self._held = buffer[len(buffer) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text held back, now that no more comes: a partial tag is plain text."""
        held, self._held = self._held, ""
        self._may_open = False
        if self.phase is Phase.REASONING:
            return held, ""
        return "", held


def split_reasoning(stream: ReasoningStream, text: str) -> tuple[str | None, str]:
    """A whole answer through ``stream``: (reasoning, or None if no think; content)."""
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning += more_reasoning
    return (reasoning if stream.has_reasoning else None), content + more_content


class ThinkGate:
    """The phases over token ids, for a grammar: ``on_token`` says whether a sampled token is
    content (the grammar takes it) or belongs to the think (the grammar does not see it, and
    every token is allowed there). In ``BEFORE`` the grammar applies from the first token,
    except that the start tag may open a think instead."""

    def __init__(self, start_token_id: int, end_token_id: int, phase: Phase):
        self.start_token_id, self.end_token_id, self.phase = start_token_id, end_token_id, phase

    @property
    def is_reasoning(self) -> bool:
        return self.phase is Phase.REASONING

    @property
    def may_open(self) -> bool:
        """Whether the next token may be the start tag besides what the grammar allows."""
        return self.phase is Phase.BEFORE

    def on_token(self, token_id: int) -> bool:
        """Advance over one sampled token; True when it is content."""
        if self.phase is Phase.CONTENT:
            return True
        if self.phase is Phase.REASONING:
            if token_id == self.end_token_id:
                self.phase = Phase.CONTENT
            return False
        if token_id == self.start_token_id:  # BEFORE: the output opens a think
            self.phase = Phase.REASONING
            return False
        self.phase = Phase.CONTENT
        return True


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and is shorter)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
