"""GPT-OSS's harmony format as a reasoning parser (vLLM's ``--reasoning-parser openai_gptoss``):
the reply's ``analysis`` channel apart from its ``final`` one.

A harmony reply is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>The user asks…<|end|>
    <|start|>assistant<|channel|>final<|message|>Hi!<|return|>      (one line, no break)

(the prompt's last turn ends with ``<|start|>assistant``, so the reply opens on a header). The
bodies of ``analysis`` messages are the reasoning; those of ``final`` and ``commentary``
messages (a preamble to the user; a tool call's arguments) are the content; headers and the
tokens between messages are neither. A reply that opens on anything but a header is all
content (a model not speaking harmony).

A tool call is a message to a function, its arguments the body:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>      (one line)

With ``calls`` (the ``openai`` tool parser reads them), such a message goes into the content
as ``call_text`` writes it, the header's name kept, so that the tool parser, which sees the
content alone, can take it apart; without, its arguments are content like any body.

The same rule at two levels, as ``reasoning.py``'s: ``HarmonyStream`` splits the text (special
tokens kept in it) as it streams; ``HarmonyGate`` follows the token ids, so that a grammar
constrains the final message's body alone (a header's tokens and every other body are free).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from actorlm.reasoning import Phase, partial_tag_length

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
# what ends a body: a message's end, the reply's, a tool call's
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_REASONING_CHANNEL, _FINAL_CHANNEL = "analysis", "final"
# a call in the content: CALL_START, the function's name, MESSAGE, its arguments, CALL_END
CALL_START, CALL_END, FUNCTIONS = "<|start|>functions.", "<|call|>", "functions."
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")


def call_text(name: str, arguments: str) -> str:
    """A call as the content holds it (``HarmonyStream(calls=True)``)."""
    return f"{CALL_START}{name}{MESSAGE}{arguments}{CALL_END}"


def _function(header: str) -> str | None:
    """The function a header addresses (``to=functions.get_weather``, in the role's part or
    the channel's); None for none, or another recipient (a built-in tool's)."""
    found = _RECIPIENT.search(header)
    return found[1][len(FUNCTIONS):] if found and found[1].startswith(FUNCTIONS) else None


def _channel(header: str) -> str:
    """The channel a header names (``<|channel|>final``, ``…<|channel|>commentary
    to=functions.f <|constrain|>json``); "" for none."""
    words = header.rpartition(CHANNEL)[2].split("<|", 1)[0].split()
    return words[0] if words else ""


class HarmonyStream:
    """``reasoning.ReasoningStream``'s interface over a harmony reply's text."""

    def __init__(self, calls: bool = False):
        self.has_reasoning = False  # an analysis message was entered
        self._calls = calls  # calls into the content as call_text writes them
        self._in_call = False  # the body is a call's arguments (with calls)
        self._header: str | None = ""  # the header read so far; None: inside a body
        self._channel: str | None = None  # the body's; None: no header read yet
        self._plain = False  # the reply opened on no header: all content
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        buffer, self._held = self._held + text, ""
        while buffer:
            if self._plain:
                content.append(buffer)
                break
            if self._header is not None:  # a header, or what leads to one
                header = self._header + buffer
                if self._channel is None and not _may_open(header):
                    self._plain, buffer = True, header
                    continue
                at = header.find(MESSAGE)
                if at < 0:
                    self._header = header
                    break
                self._channel = _channel(header[:at])
                self._header, buffer = None, header[at + len(MESSAGE):]
                self.has_reasoning |= self._channel == _REASONING_CHANNEL
                function = _function(header[:at]) if self._calls else None
                if function is not None:
                    self._in_call = True
                    content.append(f"{CALL_START}{function}{MESSAGE}")
                continue
            ends = [(at, end) for end in BODY_ENDS if (at := buffer.find(end)) >= 0]
            if ends:
                at, end = min(ends)
                self._body(buffer[:at], reasoning, content)
                self._end_call(content)
                self._header, buffer = "", buffer[at + len(end):]
                continue
            keep = max(partial_tag_length(buffer, end) for end in BODY_ENDS)
            self._body(buffer[:len(buffer) - keep], reasoning, content)
            self._held = buffer[len(buffer) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text held back, now that no more comes (a reply cut short inside a body: the
        rest of it; a header cut short says nothing)."""
        held, self._held = self._held, ""
        reasoning, content = [], []
        if self._plain or self._header is None:
            self._body(held, reasoning, content)
            self._end_call(content)  # (the reply stopped at <|call|>, which the text lacks)
        elif self._channel is None:  # nothing but whitespace or a partial header: as it is
            content.append(self._header)
        return "".join(reasoning), "".join(content)

    def _body(self, text: str, reasoning: list, content: list) -> None:
        in_reasoning = self._channel == _REASONING_CHANNEL and not self._in_call
        (reasoning if in_reasoning else content).append(text)

    def _end_call(self, content: list) -> None:
        if self._in_call:
            self._in_call = False
            content.append(CALL_END)


def _may_open(header: str) -> bool:
    """Whether the reply's first text may still be (or is) a harmony header."""
    head = header.lstrip()
    return any(head.startswith(tag) or tag.startswith(head) for tag in (CHANNEL, START))


class HarmonyGate:
    """``reasoning.ThinkGate``'s interface over a harmony reply's token ids: content from the
    token after a ``final`` header's ``<|message|>`` on (the reply's last message)."""

    def __init__(self, tokens: HarmonyTokens, phase: Phase):
        self.tokens, self.phase = tokens, phase
        self._header: list[int] = []  # the ids since the last <|channel|>

    @property
    def is_reasoning(self) -> bool:
        return self.phase is not Phase.CONTENT

    @property
    def may_open(self) -> bool:
        return False  # (a harmony reply is never before its messages)

    def on_token(self, token_id: int) -> bool:
        """Advance over one sampled token; True when it is content."""
        t = self.tokens
        if self.phase is Phase.CONTENT:
            return True
        if token_id == t.channel_id:
            self._header = []
        elif token_id == t.message_id:
            if self._header[:len(t.final_ids)] == list(t.final_ids):
                self.phase = Phase.CONTENT
            self._header = []
        else:
            self._header.append(token_id)
        return False


@dataclass(frozen=True)
class HarmonyTokens:
    """The harmony parser bound to a tokenizer: ``reasoning.ThinkTokens``' interface."""

    channel_id: int
    message_id: int
    final_ids: tuple[int, ...]  # "final" as the tokenizer writes it after <|channel|>
    tags_are_special: bool = True  # (the text must keep them to be split)

    @classmethod
    def for_tokenizer(cls, tokenizer, model: str = "") -> HarmonyTokens:
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in (CHANNEL, MESSAGE, *BODY_ENDS) if tag not in vocab]
        if missing:
            raise ValueError(f"--reasoning-parser openai_gptoss: the tokenizer of "
                             f"{model or 'the model'} has no {', '.join(missing)} token(s); "
                             f"this model does not speak GPT-OSS's harmony format (leave the "
                             f"flag out)")
        return cls(vocab[CHANNEL], vocab[MESSAGE],
                   tuple(tokenizer.encode(_FINAL_CHANNEL, add_special_tokens=False)))

    def initial_phase(self, prompt_token_ids: Sequence[int]) -> Phase:
        """A harmony reply opens on a header: outside the final message's body."""
        return Phase.REASONING

    def text_stream(self, prompt_token_ids: Sequence[int], calls: bool = False
                    ) -> HarmonyStream:
        return HarmonyStream(calls)

    def gate(self, phase: Phase) -> HarmonyGate:
        return HarmonyGate(self, phase)
