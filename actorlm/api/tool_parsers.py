"""Tool calls in a model's free text (``tool_choice: auto``), one parser per model family.

``--tool-call-parser`` picks one, as in vLLM:

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block per call; the last block may lack its closing tag (the model
  stopped at its end-of-turn token right after the JSON).
- ``llama3_json`` (Llama 3.1/3.2): ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``. vLLM looks only at an answer that begins with
  the call; here text may come first, as with Hermes.
- ``mistral`` (Mistral 7B v0.3, Mistral NeMo, Ministral, Mistral Small): ``[TOOL_CALLS]`` and
  then, as the v3 tokenizers' models write them, a JSON list of ``{"name", "arguments"}``, or,
  as the v11 ones' (Mistral Small 3.2, Magistral, Devstral), each call as
  ``[TOOL_CALLS]name[ARGS]{...}`` (a ``[CALL_ID]`` after the name is read past). The markers
  are special tokens, which the request then keeps in its text (``keeps_special_tokens``).
- ``pythonic`` (Llama 3.2's and Llama 4's other format, ToolACE): a Python list of calls with
  literal keyword arguments, ``[get_weather(city="Paris"), get_time()]``, read by Python's own
  parser (``ast``: nothing is evaluated but literals), the list ending the answer.
- ``granite`` (Granite 3.x): a JSON list of ``{"name", "arguments"}`` after ``<|tool_call|>``
  (3.0's special token, kept in the text) or ``<tool_call>`` (3.1 and later).
- ``phi4_mini_json`` (Phi-4-mini): ``functools[{"name": ..., "arguments": {...}}, ...]``.
- ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=name><parameter=key>value</parameter>
  ...</function></tool_call>``, each argument as bare text, which the tool's schema types (an
  ``integer`` parameter's ``3`` is the number 3, a ``string`` one's stays text), as vLLM does.
- ``seed_oss`` (Seed-OSS): Qwen3-Coder's calls between ``<seed:tool_call>`` tags (added tokens,
  kept in the text).
- ``llama4_json`` and ``qwen3_xml``: vLLM's other names for ``llama3_json`` and ``qwen3_coder``.
- ``llama4_pythonic`` (Llama 4): ``pythonic``'s list, optionally between ``<|python_start|>`` and
  ``<|python_end|>`` (special tokens, kept in the text; not content).
- ``hunyuan_a13b`` (Hunyuan-A13B) and ``jamba`` (Jamba): a JSON list of ``{"name",
  "arguments"}`` between ``<tool_calls>`` and ``</tool_calls>`` (Jamba's are special tokens).
- ``minimax`` (MiniMax-M1): one ``{"name", "arguments"}`` a line between the same tags.
- ``internlm`` (InternLM 2.5): ``<|action_start|><|plugin|>{"name": ..., "parameters": {...}}
  <|action_end|>`` per call (special tokens).
- ``deepseek_v3`` (DeepSeek-V3, R1): ``<｜tool▁calls▁begin｜>`` and per call ``<｜tool▁call▁begin｜>
  function<｜tool▁sep｜>name`` and the arguments in a json code fence, ``<｜tool▁call▁end｜>``;
  ``deepseek_v31`` (DeepSeek-V3.1): ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
  (special tokens).
- ``kimi_k2`` (Kimi K2): ``<|tool_calls_section_begin|>`` and per call ``<|tool_call_begin|>
  functions.name:0<|tool_call_argument_begin|>{...}<|tool_call_end|>`` (special tokens).
- ``glm45`` (GLM-4.5/4.6): ``<tool_call>name`` then ``<arg_key>k</arg_key><arg_value>v
  </arg_value>`` pairs, ``</tool_call>``, each value typed by its schema as Qwen3-Coder's are.
- ``olmo3`` (OLMo 3): pythonic calls, one a line, between ``<function_calls>`` tags, their values
  Python's literals or JSON's ``null``, ``true``, ``false``.
- ``ernie45`` (ERNIE 4.5) is Hermes' format; ``longcat`` (LongCat-Flash) is Hermes' format in
  ``<longcat_tool_call>`` tags.
- ``openai`` (GPT-OSS): harmony messages to ``functions.<name>``, their bodies the arguments.
  The harmony reasoning parser, which this one needs (``--reasoning-parser openai_gptoss``,
  implied), leaves them in the content as ``harmony.call_text`` writes them.

A parser finds where a call begins (``find_start``, which also reports a marker cut off at the
end of streamed text, so that it is not sent as content) and reads the calls (``parse``). Text
before the first call is the message's content. An answer whose calls do not parse is content
as a whole: a model that writes half a call has not called anything.
"""

from __future__ import annotations

import ast
import json
import re

from actorlm import harmony
from actorlm.api.protocol_tools import Tool
from actorlm.api.tool_text import (Call, cut_marker, find_marker, first_start, json_calls,
                                   json_object, named_call, python_calls, read_call, skip,
                                   typed)


class ToolParser:
    name = ""
    keeps_special_tokens = False  # its markers are special tokens: the text must keep them
    reads_harmony = False  # its calls are harmony messages (the reasoning parser keeps them)

    def __init__(self, tools: tuple[Tool, ...] = ()):
        # each tool's parameter schemas, for a format whose arguments are untyped text
        self.parameters = {t.function.name: (t.function.parameters or {}).get("properties", {})
                           for t in tools}

    def find_start(self, text: str) -> tuple[int, bool] | None:
        """(where a call begins, whether its marker is complete), or None: no call so far. An
        incomplete marker is a cut-off prefix at the end of ``text``."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[Call]]:
        """(content before the first call, the calls); no calls: the whole text is content."""
        raise NotImplementedError


class _MarkedToolParser(ToolParser):
    """A format whose calls begin at a marker of their own (the first of ``STARTS``)."""

    STARTS: tuple[str, ...] = ()

    def find_start(self, text: str) -> tuple[int, bool] | None:
        return find_marker(text, self.STARTS)


class _PatternToolParser(_MarkedToolParser):
    """Calls one after another from the first marker on, each a match of ``_CALL``, with only
    ``_BETWEEN`` (blanks, a section's tags) around them, to the end of the answer."""

    _CALL: re.Pattern
    _BETWEEN = re.compile(r"\s*")

    def parse(self, text: str) -> tuple[str, list[Call]]:
        found = self.find_start(text)
        if found is None or not found[1]:
            return text, []
        start = at = found[0]
        calls = []
        while (match := self._CALL.match(text, self._BETWEEN.match(text, at).end())):
            call = self._read(match)
            if call is None:
                return text, []
            calls.append(call)
            at = match.end()
        if not calls or self._BETWEEN.match(text, at).end() != len(text):
            return text, []
        return text[:start], calls

    def _read(self, match: re.Match) -> Call | None:
        """The call ``match`` writes (its ``name`` and ``arguments`` groups); None: not one."""
        return named_call(match["name"], match["arguments"])

    def _typed_call(self, name: str, pairs) -> Call | None:
        """A call whose arguments are (key, bare text) pairs, typed by the tool's schema."""
        name = name.strip()
        schemas = self.parameters.get(name, {})
        arguments = {key.strip(): typed(value, schemas.get(key.strip())) for key, value in pairs}
        return (name, json.dumps(arguments, ensure_ascii=False)) if name else None


class HermesToolParser(_MarkedToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    STARTS = (START,)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text, start):
            call = read_call(json_object(block.strip()), "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return text[:start], calls


class Ernie45ToolParser(HermesToolParser):
    name = "ernie45"


class LongcatToolParser(HermesToolParser):
    name = "longcat"
    START, END = "<longcat_tool_call>", "</longcat_tool_call>"
    STARTS = (START,)
    _BLOCK = re.compile(r"<longcat_tool_call>(.*?)(?:</longcat_tool_call>|\Z)", re.DOTALL)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    _CALL = re.compile(r'\{\s*"name"\s*:')
    # what the start of a call looks like while it is still arriving: `{`, `{"na`, `{"name" `
    _CALL_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?')

    def find_start(self, text: str) -> tuple[int, bool] | None:
        call, tag = self._CALL.search(text), text.find(self.PYTHON_TAG)
        found = [at for at in (call.start() if call else -1, tag) if at >= 0]
        if found:
            return min(found), True
        cut = cut_marker(text, self.PYTHON_TAG)
        brace = text.rfind("{")
        if brace >= 0 and self._CALL_PREFIX.fullmatch(text, brace):
            cut = brace if cut is None else min(cut, brace)
        return None if cut is None else (cut, False)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        found = self.find_start(text)
        if found is None or not found[1]:
            return text, []
        start = at = found[0]
        if text.startswith(self.PYTHON_TAG, at):
            at += len(self.PYTHON_TAG)
        decoder, calls = json.JSONDecoder(), []
        while True:
            at = skip(text, at, " \t\r\n;")
            if at == len(text):
                break
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:
                return text, []
            call = read_call(obj, "parameters", "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return (text[:start], calls) if calls else (text, [])


class Llama4JsonToolParser(Llama3JsonToolParser):
    name = "llama4_json"


class MistralToolParser(_MarkedToolParser):
    name = "mistral"
    keeps_special_tokens = True
    START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    STARTS = (START,)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        body = text[start:]
        calls = self._named_calls(body) if self.ARGS in body else \
            json_calls(json_object(body[len(self.START):].strip()))
        return (text[:start], calls) if calls else (text, [])

    def _named_calls(self, body: str) -> list[Call]:
        """``[TOOL_CALLS]name[ARGS]{...}`` each; none if any piece is not one."""
        calls = []
        for piece in body.split(self.START)[1:]:
            head, marked, arguments = piece.partition(self.ARGS)
            call = named_call(head.partition(self.CALL_ID)[0], arguments) if marked else None
            if call is None:
                return []
            calls.append(call)
        return calls


class _JsonListToolParser(_MarkedToolParser):
    """A JSON list of ``{"name", "arguments"}`` (or one such object) after its marker, and
    ``END`` after it if the format closes the list (a model may stop before it)."""

    END = ""

    def parse(self, text: str) -> tuple[str, list[Call]]:
        found = self.find_start(text)
        if found is None or not found[1]:
            return text, []
        start = found[0]
        marker = next(s for s in self.STARTS if text.startswith(s, start))
        items = json_object(text[start + len(marker):].strip().removesuffix(self.END))
        calls = json_calls([items] if isinstance(items, dict) else items)
        return (text[:start], calls) if calls else (text, [])


class GraniteToolParser(_JsonListToolParser):
    name = "granite"
    keeps_special_tokens = True
    STARTS = ("<|tool_call|>", "<tool_call>")


class Phi4MiniJsonToolParser(_JsonListToolParser):
    name = "phi4_mini_json"
    STARTS = ("functools",)


class HunyuanA13BToolParser(_JsonListToolParser):
    name = "hunyuan_a13b"
    STARTS, END = ("<tool_calls>",), "</tool_calls>"


class JambaToolParser(HunyuanA13BToolParser):
    name = "jamba"
    keeps_special_tokens = True  # Jamba's <tool_calls> tags are special tokens


class Qwen3CoderToolParser(_PatternToolParser):
    name = "qwen3_coder"
    STARTS = ("<tool_call>", "<function=")
    # (a function's closing tag is required: without it the answer was cut off mid-call)
    _CALL = re.compile(r"<function=(?P<name>[^>\n]+)>(?P<arguments>.*?)</function>", re.DOTALL)
    # a parameter ends at its closing tag, or where the next one or the function's end begins
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)",
                            re.DOTALL)
    _BETWEEN = re.compile(r"(?:\s|</?tool_call>)*")

    def _read(self, match: re.Match) -> Call | None:
        return self._typed_call(match["name"], self._PARAMETER.findall(match["arguments"]))


class Qwen3XmlToolParser(Qwen3CoderToolParser):
    name = "qwen3_xml"


class SeedOssToolParser(Qwen3CoderToolParser):
    name = "seed_oss"
    keeps_special_tokens = True
    STARTS = ("<seed:tool_call>", "<function=")
    _BETWEEN = re.compile(r"(?:\s|</?seed:tool_call>)*")


class PythonicToolParser(ToolParser):
    name = "pythonic"
    json_names = False  # JSON's null, true and false taken for Python's None, True, False
    _CALL = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
    # what the start of a call looks like while it is still arriving: `[`, `[get_wea`, `[f `
    _CALL_PREFIX = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")

    def find_start(self, text: str) -> tuple[int, bool] | None:
        call = self._CALL.search(text)
        if call is not None:
            return call.start(), True
        bracket = text.rfind("[")
        if bracket >= 0 and self._CALL_PREFIX.fullmatch(text, bracket):
            return bracket, False
        return None

    def parse(self, text: str) -> tuple[str, list[Call]]:
        found = self.find_start(text)
        if found is None or not found[1]:
            return text, []
        try:
            calls = python_calls(ast.parse(self._list(text[found[0]:]), mode="eval").body,
                                  self.json_names)
        except (SyntaxError, ValueError, TypeError):  # not Python, not literals, not JSON
            return text, []
        return (text[:found[0]], calls) if calls else (text, [])

    def _list(self, calls: str) -> str:
        """The Python list in the text from where the calls begin."""
        return calls.strip()


class Llama4PythonicToolParser(PythonicToolParser):
    name = "llama4_pythonic"
    keeps_special_tokens = True  # <|python_start|> and <|python_end|> are Llama 4's special tokens
    START, END = "<|python_start|>", "<|python_end|>"

    def find_start(self, text: str) -> tuple[int, bool] | None:
        return first_start(super().find_start(text), find_marker(text, (self.START,)))

    def _list(self, calls: str) -> str:
        return calls.removeprefix(self.START).strip().removesuffix(self.END)


class Olmo3ToolParser(PythonicToolParser):
    """OLMo 3's calls between ``<function_calls>`` tags, one a line, Python's keyword calls
    whose values may be written as JSON's (``null``, ``true``, ``false``)."""

    name = "olmo3"
    json_names = True
    START, END = "<function_calls>", "</function_calls>"

    def find_start(self, text: str) -> tuple[int, bool] | None:
        return find_marker(text, (self.START,))

    def _list(self, calls: str) -> str:
        lines = calls.removeprefix(self.START).strip().removesuffix(self.END).splitlines()
        return "[" + ", ".join(line.strip() for line in lines if line.strip()) + "]"


class InternLMToolParser(_PatternToolParser):
    name = "internlm"
    keeps_special_tokens = True  # InternLM's action tags are special tokens
    STARTS = ("<|action_start|><|plugin|>",)
    _CALL = re.compile(r"<\|action_start\|><\|plugin\|>(?P<call>.*?)(?:<\|action_end\|>|\Z)",
                       re.DOTALL)

    def _read(self, match: re.Match) -> Call | None:
        return read_call(json_object(match["call"].strip()), "parameters", "arguments")


class MinimaxToolParser(_PatternToolParser):
    name = "minimax"
    STARTS = ("<tool_calls>",)
    _CALL = re.compile(r"(?P<call>\{[^\n]*\})")  # a call a line
    _BETWEEN = re.compile(r"(?:\s|</?tool_calls>)*")

    def _read(self, match: re.Match) -> Call | None:
        return read_call(json_object(match["call"]), "arguments")


class DeepSeekV3ToolParser(_PatternToolParser):
    name = "deepseek_v3"
    keeps_special_tokens = True  # DeepSeek's tool markers are special tokens
    STARTS = ("<｜tool▁calls▁begin｜>",)
    _CALL = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>(?P<name>[^\n]*)\n"
                       r"```(?:json)?\n(?P<arguments>.*?)\n```\s*<｜tool▁call▁end｜>", re.DOTALL)
    _BETWEEN = re.compile(r"(?:\s|<｜tool▁calls▁begin｜>|<｜tool▁calls▁end｜>)*")


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<name>[^\n]*?)<｜tool▁sep｜>(?P<arguments>.*?)"
                       r"<｜tool▁call▁end｜>", re.DOTALL)


class KimiK2ToolParser(_PatternToolParser):
    name = "kimi_k2"
    keeps_special_tokens = True  # Kimi's tool markers are special tokens
    # (Kimi K2 sometimes writes "tool_call_section" for "tool_calls_section", as vLLM notes)
    STARTS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    _CALL = re.compile(r"<\|tool_call_begin\|>(?P<id>[^<]*)<\|tool_call_argument_begin\|>"
                       r"(?P<arguments>.*?)<\|tool_call_end\|>", re.DOTALL)
    _BETWEEN = re.compile(r"(?:\s|<\|tool_calls?_section_(?:begin|end)\|>)*")
    _ID = re.compile(r"(?:functions\.)?(?P<name>.+):\d+")  # functions.get_weather:0

    def _read(self, match: re.Match) -> Call | None:
        call_id = self._ID.fullmatch(match["id"].strip())
        return named_call(call_id["name"], match["arguments"]) if call_id else None


class Glm45ToolParser(_PatternToolParser):
    name = "glm45"
    STARTS = ("<tool_call>",)
    # the name ends at a newline (GLM-4.5) or at the first argument (GLM-4.7 writes no newline)
    _CALL = re.compile(r"<tool_call>(?P<name>[^\n<]*)(?P<arguments>.*?)</tool_call>", re.DOTALL)
    _ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _read(self, match: re.Match) -> Call | None:
        if self._ARGUMENT.sub("", match["arguments"]).strip():
            return None  # something other than argument pairs
        return self._typed_call(match["name"], self._ARGUMENT.findall(match["arguments"]))


class OpenAIToolParser(_MarkedToolParser):
    name = "openai"
    keeps_special_tokens = reads_harmony = True
    STARTS = (harmony.CALL_START,)
    _OPEN = re.compile(re.escape(harmony.CALL_START) + r"(?P<name>.*?)" +
                       re.escape(harmony.MESSAGE), re.DOTALL)  # a call's start, its name
    _CALL = re.compile(_OPEN.pattern + r"(?P<arguments>.*?)" + re.escape(harmony.CALL_END),
                       re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        """The calls wherever they sit (a preamble may come first). If one does not parse (its
        arguments cut short), no calls, and the text as it is without them: their arguments
        as content, their marks gone."""
        calls = [named_call(m["name"], m["arguments"]) for m in self._CALL.finditer(text)]
        rest = self._CALL.sub("", text)
        if calls and None not in calls and not self._OPEN.search(rest):
            return rest, calls
        return self._OPEN.sub("", self._CALL.sub(lambda m: m["arguments"], text)), []


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
    GraniteToolParser, Phi4MiniJsonToolParser, Qwen3CoderToolParser, SeedOssToolParser,
    Llama4JsonToolParser, Qwen3XmlToolParser, Llama4PythonicToolParser, HunyuanA13BToolParser,
    JambaToolParser, InternLMToolParser, DeepSeekV3ToolParser, DeepSeekV31ToolParser,
    KimiK2ToolParser, Glm45ToolParser, MinimaxToolParser, LongcatToolParser, Ernie45ToolParser,
    Olmo3ToolParser, OpenAIToolParser)}
