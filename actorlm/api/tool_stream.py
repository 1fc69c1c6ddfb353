"""One choice's output turned into content and tool-call deltas, as it streams.

Each kind of tool use has its stream: ``feed`` takes the text added since the last call and
returns (content to send, tool-call deltas); ``finish`` flushes what was held back. A complete
answer is the same stream fed once (``collect``), so streamed and whole answers cannot differ.

- ``NamedCallStream``: the output *is* the arguments of the named function (a grammar made sure
  of it): the first piece names the call, every piece extends its arguments.
- ``RequiredCallStream``: the output is a JSON array ``[{"name": ..., "parameters": {...}},
  ...]`` (also grammar-made); a small scanner streams each item's ``parameters`` text as the
  arguments of call *i* as soon as its name is known.
- ``ParsedCallStream`` (``auto``): free text read by a ``ToolParser``. Text is sent as it comes
  until a call may be starting; from there it is held back, and the calls are sent whole once
  the answer is complete. Streaming a half-written call would mean retracting it when the rest
  does not parse, which a stream cannot do.
"""

from __future__ import annotations

import json
import uuid

from actorlm.api.protocol_tools import (DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                        ToolCall)
from actorlm.api.tool_parsers import ToolParser

Deltas = list[DeltaToolCall]


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def header(index: int, name: str, arguments: str = "") -> DeltaToolCall:
    """The first delta of call ``index``: its id, type and name."""
    return DeltaToolCall(index, tool_call_id(), "function", DeltaFunctionCall(name, arguments))


def arguments(index: int, text: str) -> DeltaToolCall:
    return DeltaToolCall(index, function=DeltaFunctionCall(arguments=text))


class NamedCallStream:
    def __init__(self, name: str):
        self.name, self.started = name, False

    def feed(self, text: str) -> tuple[str, Deltas]:
        if not text:
            return "", []
        if self.started:
            return "", [arguments(0, text)]
        self.started = True
        return "", [header(0, self.name, text)]

    def finish(self) -> tuple[str, Deltas]:
        if self.started:
            return "", []
        self.started = True  # nothing was generated: the call still has a name
        return "", [header(0, self.name)]


class RequiredCallStream:
    """Scans ``[{"name": "f", "parameters": {...}}, ...]`` one character at a time: depth 1 is
    the array, depth 2 an item's keys, anything deeper belongs to a value."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False
        self.index = -1  # the item being read
        self.expect = ""  # at depth 2: "key", "colon", "value", or "" (inside a value)
        self.key = ""
        self.capture: list[str] | None = None  # the key or name string being read
        self.in_arguments = self.arguments_begun = False
        self.name: str | None = None
        self.pending: list[str] = []  # arguments read before the item's name

    def feed(self, text: str) -> tuple[str, Deltas]:
        out: Deltas = []
        for ch in text:
            self._step(ch, out)
        return "", _merged(out)

    def finish(self) -> tuple[str, Deltas]:
        return "", []

    def _step(self, ch: str, out: Deltas) -> None:
        if self.in_string:
            self._emit(ch, out)
            if self.capture is not None:
                self.capture.append(ch)
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self._string_done(out)
            return
        if self.in_arguments and self.depth == 2 and ch in ",}":
            self.in_arguments = False  # the parameters value is complete
        if self.in_arguments and (self.arguments_begun or not ch.isspace()):
            self.arguments_begun = True
            self._emit(ch, out)
        at_keys = self.depth == 2
        if ch == '"':
            self.in_string = True
            if at_keys and (self.expect == "key" or (self.expect == "value"
                                                     and self.key == "name")):
                self.capture = ['"']
        elif ch in "{[":
            if self.depth == 1 and ch == "{":
                self.index, self.name, self.pending, self.expect = self.index + 1, None, [], "key"
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
        elif at_keys and ch == ":" and self.expect == "colon":
            self.expect = "value"
            self.in_arguments, self.arguments_begun = self.key == "parameters", False
        elif at_keys and ch == ",":
            self.expect = "key"
        if at_keys and self.expect == "value" and not ch.isspace() and ch != ":":
            self.expect = ""  # the value has begun

    def _string_done(self, out: Deltas) -> None:
        if self.capture is None:
            return
        value = json.loads("".join(self.capture))
        self.capture = None
        if self.expect == "key":
            self.key, self.expect = value, "colon"
        elif self.key == "name" and self.name is None:
            self.name = value
            out.append(header(self.index, value, "".join(self.pending)))
            self.pending = []

    def _emit(self, ch: str, out: Deltas) -> None:
        if not self.in_arguments:
            return
        if self.name is None:
            self.pending.append(ch)
        else:
            out.append(arguments(self.index, ch))


class ParsedCallStream:
    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser, self.parallel = parser, parallel
        self.text, self.num_sent, self.holding = "", 0, False

    def feed(self, text: str) -> tuple[str, Deltas]:
        self.text += text
        if self.holding:
            return "", []
        start = self.parser.find_start(self.text)
        end = len(self.text) if start is None else start[0]
        self.holding = start is not None and start[1]
        content, self.num_sent = self.text[self.num_sent:end], max(self.num_sent, end)
        return content, []

    def finish(self) -> tuple[str, Deltas]:
        content, calls = self.parser.parse(self.text)  # (no calls: the text as the parser reads it)
        if not self.parallel:
            calls = calls[:1]  # the client runs one call at a time
        rest = content[self.num_sent:]
        self.num_sent = len(self.text)
        return rest, [header(i, name, args) for i, (name, args) in enumerate(calls)]


def collect(stream, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer through ``stream``: (content, the calls it made)."""
    content, deltas = stream.feed(text)
    more, last = stream.finish()
    calls: dict[int, ToolCall] = {}
    for delta in deltas + last:
        function = delta.function
        if delta.index not in calls:
            calls[delta.index] = ToolCall(id=delta.id, function=FunctionCall(function.name, ""))
        calls[delta.index].function.arguments += function.arguments or ""
    return content + more, [calls[i] for i in sorted(calls)]


def _merged(deltas: Deltas) -> Deltas:
    """Consecutive pieces of one call's arguments as one delta."""
    out: Deltas = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == delta.index and delta.id is None:
            merged = DeltaFunctionCall(last.function.name,
                                       (last.function.arguments or "") + delta.function.arguments)
            out[-1] = DeltaToolCall(last.index, last.id, last.type, merged)
        else:
            out.append(delta)
    return out
