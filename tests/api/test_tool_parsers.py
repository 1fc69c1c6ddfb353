"""Tool calls read out of text: the Hermes, Llama 3 JSON, Mistral, pythonic, Granite,
Phi-4-mini, Qwen3-Coder and Seed-OSS parsers, vLLM's other formats (Llama 4, Hunyuan, Jamba,
MiniMax, InternLM, DeepSeek V3/V3.1, Kimi K2, GLM-4.5, ERNIE 4.5, LongCat, GPT-OSS's), and the
streams that turn a choice's text into content and call deltas (pieces fed one by one add up to
the whole)."""

from __future__ import annotations

import json

import pytest

from actorlm import SamplingParams
from actorlm.harmony import call_text
from actorlm.api.options import ServerOptions
from actorlm.api.protocol_tools import FunctionDefinition, Tool
from actorlm.api.tool_choice import ToolUse, tool_use
from actorlm.api.tool_parsers import (PARSERS, DeepSeekV3ToolParser, DeepSeekV31ToolParser,
                                      Ernie45ToolParser, Glm45ToolParser, GraniteToolParser,
                                      HermesToolParser, HunyuanA13BToolParser, InternLMToolParser,
                                      JambaToolParser, KimiK2ToolParser, Llama3JsonToolParser,
                                      Llama4JsonToolParser, Llama4PythonicToolParser,
                                      LongcatToolParser, MinimaxToolParser, MistralToolParser,
                                      Olmo3ToolParser, OpenAIToolParser, Phi4MiniJsonToolParser,
                                      PythonicToolParser, Qwen3CoderToolParser, Qwen3XmlToolParser,
                                      SeedOssToolParser)
from actorlm.api.tool_stream import (NamedCallStream, ParsedCallStream, RequiredCallStream,
                                     collect)

HERMES_TWO = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
              '"arguments": {}}\n</tool_call>')
LLAMA_TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_time", "parameters": {"tz": "utc"}}')
MISTRAL_V3_TWO = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                  '{"name": "get_time", "arguments": {}}]')
MISTRAL_V11_TWO = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                   '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}')
PYTHONIC_TWO = ('[get_weather(city="San Francisco", days=[1, 2], metric=True, unit=None), '
                'get_time()]')
TWO_CALLS_JSON = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                  '{"name": "get_time", "arguments": {}}]')
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]
QWEN3_CODER_TWO = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
                   "</tool_call>")

# vLLM's other formats, each writing get_weather(city="Paris") and then get_time()
LLAMA4_PYTHONIC_TWO = '<|python_start|>[get_weather(city="Paris"), get_time()]<|python_end|>'
TAGGED_JSON_TWO = f"<tool_calls>{TWO_CALLS_JSON}</tool_calls>"
MINIMAX_TWO = ('<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '{"name": "get_time", "arguments": {}}\n</tool_calls>')
INTERNLM_TWO = ('<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": '
                '"Paris"}}<|action_end|>\n<|action_start|><|plugin|>\n{"name": "get_time", '
                '"parameters": {}}<|action_end|>')
DEEPSEEK_V3_TWO = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                   '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
                   '<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31_TWO = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": '
                    '"Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
                    '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
KIMI_K2_TWO = ('<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0'
               '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>\n'
               '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}'
               '<|tool_call_end|>\n<|tool_calls_section_end|>')
GLM45_TWO = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "</tool_call>\n<tool_call>get_time\n</tool_call>")
ERNIE45_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LONGCAT_TWO = ERNIE45_TWO.replace("tool_call>", "longcat_tool_call>")
OLMO3_TWO = '<function_calls>\nget_weather(city="Paris")\nget_time()\n</function_calls>'
MORE_FORMATS = [  # (parser, two calls, whether its markers are special tokens)
    (Llama4JsonToolParser(), LLAMA_TWO.replace('{"tz": "utc"}', "{}"), False),
    (Qwen3XmlToolParser(), QWEN3_CODER_TWO, False),
    (Llama4PythonicToolParser(), LLAMA4_PYTHONIC_TWO, True),
    (HunyuanA13BToolParser(), TAGGED_JSON_TWO, False),
    (JambaToolParser(), TAGGED_JSON_TWO, True),
    (MinimaxToolParser(), MINIMAX_TWO, False),
    (InternLMToolParser(), INTERNLM_TWO, True),
    (DeepSeekV3ToolParser(), DEEPSEEK_V3_TWO, True),
    (DeepSeekV31ToolParser(), DEEPSEEK_V31_TWO, True),
    (KimiK2ToolParser(), KIMI_K2_TWO, True),
    (Glm45ToolParser(), GLM45_TWO, False),
    (Ernie45ToolParser(), ERNIE45_TWO, False),
    (LongcatToolParser(), LONGCAT_TWO, False),
    (Olmo3ToolParser(), OLMO3_TWO, False)]
MORE_IDS = [parser.name for parser, _, _ in MORE_FORMATS]
# GPT-OSS's calls as the harmony reasoning parser leaves them in the content
OPENAI_TWO = call_text("get_weather", '{"city": "Paris"}') + call_text("get_time", "{}")


def _calls(parsed):
    content, calls = parsed
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


def test_hermes_reads_several_calls_and_the_text_before_them():
    assert _calls(HermesToolParser().parse(HERMES_TWO)) == (
        "Let me look that up.\n",
        [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})])


def test_hermes_edge_cases():
    parser = HermesToolParser()
    # the model stopped right after the JSON, before the closing tag
    assert _calls(parser.parse('<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}')) == (
        "", [("f", {"a": [1, 2]})])
    assert parser.parse("no call here") == ("no call here", [])
    # half a call, or one without a name, is not a call: all of it stays content
    for text in ('<tool_call>{"name": "f", "argu', '<tool_call>{"arguments": {}}</tool_call>',
                 'ok <tool_call>{"name": "f", "arguments": "x"}</tool_call>'):
        assert parser.parse(text) == (text, [])


def test_llama3_json_reads_calls_with_and_without_the_python_tag():
    parser = Llama3JsonToolParser()
    assert _calls(parser.parse(LLAMA_TWO)) == (
        "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "utc"})])
    assert _calls(parser.parse('{"name": "f", "parameters": {"x": 1}}')) == ("", [("f", {"x": 1})])
    # "arguments" is accepted too, and text may come first
    assert _calls(parser.parse('Calling it: {"name": "f", "arguments": {"x": 1}}')) == (
        "Calling it: ", [("f", {"x": 1})])


def test_llama3_json_leaves_other_text_alone():
    parser = Llama3JsonToolParser()
    for text in ('{"a": 1}', "plain words", '{"name": "f", "parameters": {"x": 1}} and more',
                 '{"name": "f", "parameters": [1]}', '<|python_tag|>{"name": "f", "param'):
        assert parser.parse(text) == (text, [])


@pytest.mark.parametrize("text", [MISTRAL_V3_TWO, MISTRAL_V11_TWO], ids=["v3", "v11"])
def test_mistral_reads_both_of_its_formats(text):
    parser = MistralToolParser()
    assert _calls(parser.parse("Let me check. " + text)) == (
        "Let me check. ", [("get_weather", {"city": "Paris"}), ("get_time", {})])


def test_mistral_leaves_other_text_alone_and_keeps_its_markers():
    parser = MistralToolParser()
    for text in ("[TOOL_CALLS] [{\"name\": \"f\", \"argu", "[TOOL_CALLS] []",
                 "[TOOL_CALLS]f[ARGS]{\"x\": ", "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS] not json",
                 "plain [TOOL words"):
        assert parser.parse(text) == (text, [])
    assert parser.find_start("sure [TOOL_CA") == (5, False)
    # its markers are special tokens: a request it reads keeps them in its text
    auto = ToolUse("auto", parser=parser)
    assert auto.sampling_params(SamplingParams()).skip_special_tokens is False
    assert ToolUse("auto", parser=HermesToolParser()).sampling_params(
        SamplingParams()).skip_special_tokens is True


def test_pythonic_reads_a_list_of_calls_with_literal_arguments():
    parser = PythonicToolParser()
    assert _calls(parser.parse(PYTHONIC_TWO)) == ("", [
        ("get_weather", {"city": "San Francisco", "days": [1, 2], "metric": True, "unit": None}),
        ("get_time", {})])
    assert _calls(parser.parse("Checking.\n[f(x='a]b', y=(1, 2))]")) == (
        "Checking.\n", [("f", {"x": "a]b", "y": [1, 2]})])


def test_pythonic_leaves_other_text_alone():
    """Anything but literals (a name, an expression, a call inside), positional arguments,
    text after the list, half a list: no call, all of it content; nothing is evaluated."""
    parser = PythonicToolParser()
    for text in ("see [1] and [2]", "[f(x=open('/etc/passwd'))]", "[f(x=y)]", "[f(1)]",
                 "[f(**kw)]", "[f(x=1)] and then", "[f(x=1), g(", "[f(x={1, 2})]",
                 "[os.system(x='ls')]", "plain"):
        assert parser.parse(text) == (text, [])
    assert parser.find_start("a [get_wea") == (2, False)  # a call may be starting


@pytest.mark.parametrize("parser, marker, before", [
    (GraniteToolParser(), "<|tool_call|>", ""),  # Granite 3.0: its special token, kept
    (GraniteToolParser(), "<tool_call>", "Checking.\n"),  # 3.1 and later
    (Phi4MiniJsonToolParser(), "functools", "")])
def test_granite_and_phi4_mini_read_a_json_list_after_their_marker(parser, marker, before):
    two = before + marker + TWO_CALLS_JSON
    assert _calls(parser.parse(two)) == (before, TWO_CALLS)
    one = before + marker + '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert _calls(parser.parse(one)) == (before, TWO_CALLS[:1])  # (not in a list)
    # half a call, a marker alone, or no call, is content
    for other in (two[:-12], before + marker, "no call here"):
        assert parser.parse(other) == (other, [])
    assert parser.keeps_special_tokens == isinstance(parser, GraniteToolParser)


def _qwen3_coder_parameters(*pairs: tuple[str, str]) -> str:
    return "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in pairs)


def test_qwen3_coder_types_each_argument_by_the_requests_tools():
    properties = {"city": {"type": "string"}, "code": {"type": "string"},
                  "days": {"type": "integer"}, "scale": {"type": ["number", "null"]},
                  "metric": {"type": "boolean"}, "hours": {"type": "array"},
                  "where": {"type": "object"}, "fallback": {"type": "integer"}}
    tools = [Tool(function=FunctionDefinition(name="get_weather", parameters={
        "type": "object", "properties": properties}))]
    use = tool_use(tools, "auto", None, ServerOptions(enable_auto_tool_choice=True,
                                                      tool_call_parser="qwen3_coder"))
    body = _qwen3_coder_parameters(
        ("city", "New York"), ("code", "007"), ("days", "3"), ("scale", "0.5"),
        ("metric", "True"), ("hours", "[6, 18]"), ("where", "{'lat': 1.5}"),
        ("fallback", "three"), ("unknown", " 12 "))
    text = ("Let me check.\n<tool_call>\n<function=get_weather>\n" + body +
            "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
            "<parameter=tz>\nutc\n</function>\n</tool_call>")
    content, calls = collect(use.new_stream(), text)
    assert content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "New York", "code": "007", "days": 3, "scale": 0.5,
                         "metric": True, "hours": [6, 18], "where": {"lat": 1.5},
                         "fallback": "three",  # not what its type says: left as it was
                         "unknown": " 12 "}),  # no schema: text, one newline either side off
        ("get_time", {"tz": "utc"})]  # (a parameter may end where the function does)
    null = _qwen3_coder_parameters(("scale", "null"), ("city", "null"))
    assert json.loads(use.parser.parse(f"<function=get_weather>\n{null}</function>")[1][0][1]) \
        == {"scale": None, "city": "null"}  # a string parameter's "null" is text


def test_seed_oss_reads_qwen3_coders_calls_between_its_own_tags():
    seed = QWEN3_CODER_TWO.replace("tool_call>", "seed:tool_call>")
    assert _calls(SeedOssToolParser().parse("Sure.\n" + seed)) == ("Sure.\n", TWO_CALLS)
    assert SeedOssToolParser().parse(QWEN3_CODER_TWO) == (QWEN3_CODER_TWO, [])  # not its tags
    assert SeedOssToolParser.keeps_special_tokens


def test_qwen3_coder_leaves_a_cut_off_call_and_other_text_alone():
    parser = Qwen3CoderToolParser()
    assert _calls(parser.parse(QWEN3_CODER_TWO)) == ("", TWO_CALLS)
    for text in (QWEN3_CODER_TWO[:60],  # cut off inside the first call
                 QWEN3_CODER_TWO[:-30],  # inside the second
                 QWEN3_CODER_TWO + " and then", "<function=f>", "no call here"):
        assert parser.parse(text) == (text, [])


@pytest.mark.parametrize("parser, text, keeps", MORE_FORMATS, ids=MORE_IDS)
def test_more_formats_read_two_calls_and_the_text_before_them(parser, text, keeps):
    assert _calls(parser.parse("Let me check.\n" + text)) == ("Let me check.\n", TWO_CALLS)
    assert _calls(parser.parse(text)) == ("", TWO_CALLS)
    assert PARSERS[parser.name] is type(parser)  # --tool-call-parser knows it by vLLM's name
    assert parser.keeps_special_tokens is keeps


@pytest.mark.parametrize("parser, text, keeps", MORE_FORMATS, ids=MORE_IDS)
def test_more_formats_leave_cut_off_calls_and_plain_text_alone(parser, text, keeps):
    for other in (text[:-1], text[:len(text) // 2], "Sure. " + text[:len(text) // 3],
                  "no call here", ""):
        assert parser.parse(other) == (other, [])
    assert parser.find_start("Sure. " + text[:3]) == (6, False)  # a marker may be arriving


@pytest.mark.parametrize("parser, text", [
    (Llama4PythonicToolParser(), "<|python_start|>[get_weather('Paris')]<|python_end|>"),
    (HunyuanA13BToolParser(), '<tool_calls>[{"arguments": {}}]</tool_calls>'),
    (JambaToolParser(), '<tool_calls>[{"name": "f", "arguments": [1]}]</tool_calls>'),
    (JambaToolParser(), TAGGED_JSON_TWO + " and more"),
    (MinimaxToolParser(), '<tool_calls>\n{"name": "f", "arguments": "x"}\n</tool_calls>'),
    (MinimaxToolParser(), MINIMAX_TWO.replace("}\n{", "} {")),  # two on a line
    (InternLMToolParser(), '<|action_start|><|plugin|>{"parameters": {}}<|action_end|>'),
    (DeepSeekV3ToolParser(), DEEPSEEK_V3_TWO.replace('{"city": "Paris"}', '"Paris"')),
    (DeepSeekV3ToolParser(), DEEPSEEK_V31_TWO),  # V3.1's calls are not V3's
    (DeepSeekV31ToolParser(), DEEPSEEK_V31_TWO.replace("get_weather", "")),
    (KimiK2ToolParser(), KIMI_K2_TWO.replace(":0", "")),  # not a call id
    (KimiK2ToolParser(), KIMI_K2_TWO.replace("{}", "[]")),
    (Glm45ToolParser(), GLM45_TWO.replace("get_weather", "")),
    (Glm45ToolParser(), GLM45_TWO.replace("<arg_value>Paris</arg_value>", "Paris")),
    (Ernie45ToolParser(), ERNIE45_TWO.replace('"get_time"', "1")),
    (LongcatToolParser(), ERNIE45_TWO)])  # Hermes' tags are not LongCat's
def test_more_formats_leave_malformed_calls_alone(parser, text):
    """A call without a name, arguments that are not an object, text where the format has none:
    no call, all of it content."""
    assert parser.parse(text) == (text, [])


def test_openai_reads_the_calls_the_harmony_parser_kept():
    parser = OpenAIToolParser()
    assert _calls(parser.parse("Checking. " + OPENAI_TWO)) == ("Checking. ", TWO_CALLS)
    assert PARSERS["openai"] is OpenAIToolParser and parser.keeps_special_tokens
    assert parser.find_start("Sure. " + OPENAI_TWO[:3]) == (6, False)  # a mark may be arriving
    # a call that does not parse, or is not closed: no calls, the arguments as content
    for text, content in ((OPENAI_TWO.replace('{"city": "Paris"}', '{"city'), '{"city{}'),
                          (OPENAI_TWO[:-len("<|call|>")], '{"city": "Paris"}{}'),
                          (call_text("", "{}"), "{}"), ("no call here", "no call here")):
        assert parser.parse(text) == (content, []), text


def test_more_formats_read_their_variants():
    weather = [TWO_CALLS[0]]
    # Llama 4's list without its tags, or without the closing one
    assert _calls(Llama4PythonicToolParser().parse('Sure. [get_weather(city="Paris")]')) == (
        "Sure. ", weather)
    assert _calls(Llama4PythonicToolParser().parse(LLAMA4_PYTHONIC_TWO[:-14])) == ("", TWO_CALLS)
    # the model stopped before the closing tag or section end
    assert _calls(JambaToolParser().parse(TAGGED_JSON_TWO[:-13])) == ("", TWO_CALLS)
    assert _calls(DeepSeekV3ToolParser().parse(DEEPSEEK_V3_TWO[:-18])) == ("", TWO_CALLS)
    # InternLM also writes "arguments"; Kimi K2 a section tag in the singular, a bare name, dots
    assert _calls(InternLMToolParser().parse(
        '<|action_start|><|plugin|>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        "<|action_end|>")) == ("", weather)
    kimi = KIMI_K2_TWO.replace("calls_section", "call_section").replace(
        "functions.get_weather", "get_weather").replace("functions.get_time", "functions.a.b")
    assert _calls(KimiK2ToolParser().parse(kimi)) == ("", [weather[0], ("a.b", {})])


def test_olmo3_reads_json_literals_and_nothing_else_that_is_not_python():
    parser = Olmo3ToolParser()
    text = ('<function_calls>\nsearch(query="x", exact=true, page=null, tags=["a", false])\n'
            '</function_calls>')
    assert _calls(parser.parse(text)) == ("", [("search", {"query": "x", "exact": True,
                                                           "page": None,
                                                           "tags": ["a", False]})])
    for other in ('<function_calls>\nsearch(query=x)\n</function_calls>',  # a name: no literal
                  '<function_calls>\nsearch("x")\n</function_calls>',  # positional
                  '<function_calls>\nsearch(query="x"', PYTHONIC_TWO):  # cut off; not its tags
        assert parser.parse(other) == (other, [])
    # the plain pythonic parser reads no JSON names
    assert PythonicToolParser().parse("[f(x=true)]") == ("[f(x=true)]", [])


def test_glm45_types_each_argument_by_the_requests_tools():
    properties = {"city": {"type": "string"}, "days": {"type": "integer"},
                  "hours": {"type": "array"}, "metric": {"type": "boolean"}}
    parser = Glm45ToolParser((Tool(function=FunctionDefinition(name="get_weather", parameters={
        "type": "object", "properties": properties})),))
    # (GLM-4.7 writes no newline after the name)
    text = ("Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>007</arg_value>"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value><arg_key>hours</arg_key>"
            "<arg_value>[6, 18]</arg_value><arg_key>metric</arg_key><arg_value>false</arg_value>"
            "<arg_key>other</arg_key><arg_value>12</arg_value></tool_call>")
    assert _calls(parser.parse(text)) == ("Sure.", [("get_weather", {
        "city": "007", "days": 3, "hours": [6, 18], "metric": False,
        "other": "12"})])  # (no schema: text, as Qwen3-Coder's)


@pytest.mark.parametrize("parser,text", [(HermesToolParser(), HERMES_TWO),
                                         (Llama3JsonToolParser(), "Sure. " + LLAMA_TWO),
                                         (PythonicToolParser(), "Sure. " + PYTHONIC_TWO),
                                         (MistralToolParser(), "Sure. " + MISTRAL_V3_TWO),
                                         (MistralToolParser(), "Sure. " + MISTRAL_V11_TWO),
                                         (GraniteToolParser(),
                                          "Sure. <|tool_call|>" + TWO_CALLS_JSON),
                                         (Phi4MiniJsonToolParser(),
                                          "Sure. functools" + TWO_CALLS_JSON),
                                         (Qwen3CoderToolParser(), "Sure. " + QWEN3_CODER_TWO),
                                         (SeedOssToolParser(), "Sure. " + QWEN3_CODER_TWO.replace(
                                             "tool_call>", "seed:tool_call>"))] +
                         [(parser, "Sure. " + text) for parser, text, _ in MORE_FORMATS] +
                         [(OpenAIToolParser(), "Sure. " + OPENAI_TWO)])
def test_parsed_stream_holds_back_only_the_call(parser, text):
    whole = collect(ParsedCallStream(parser), text)
    stream = ParsedCallStream(parser)
    sent, deltas = "", []
    for i in range(0, len(text), 3):  # three characters at a time: markers arrive cut up
        content, more = stream.feed(text[i:i + 3])
        sent, deltas = sent + content, deltas + more
    assert deltas == []  # nothing of a call goes out before the answer is complete
    assert sent == whole[0]  # the text before the call went out as it came, and no more
    rest, calls = stream.finish()
    assert rest == ""
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(whole[1])]
    assert all(d.id.startswith("chatcmpl-tool-") and d.type == "function" for d in calls)


def test_parsed_stream_sends_a_false_start_as_content():
    stream = ParsedCallStream(HermesToolParser())
    assert stream.feed("a <tool") == ("a ", [])  # could be a call starting
    assert stream.feed("box> b") == ("<toolbox> b", [])  # it was not
    assert stream.feed(" <tool_call>{oops") == (" ", [])
    assert stream.finish() == ("<tool_call>{oops", [])  # never became a call


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris", "days": [1, 2]}}, '
            '{"name": "get_time", "parameters": {}}]')


def test_required_stream_streams_each_calls_arguments():
    content, calls = collect(RequiredCallStream(), REQUIRED)
    assert content == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris', "days": [1, 2]}), ("get_time", {})]
    stream, pieces = RequiredCallStream(), []
    for ch in REQUIRED:
        pieces += stream.feed(ch)[1]
    headers = [d for d in pieces if d.id is not None]
    assert [(d.index, d.function.name) for d in headers] == [(0, "get_weather"), (1, "get_time")]
    assert len(pieces) > 10  # the arguments came in pieces, not at the end
    for index, call in enumerate(calls):
        assert "".join(d.function.arguments or "" for d in pieces
                       if d.index == index) == call.function.arguments


def test_required_stream_waits_for_a_name_given_after_the_arguments():
    content, calls = collect(RequiredCallStream(), '[{"parameters": {"x": 1}, "name": "f"}]')
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"x": 1}')]


def test_named_stream_is_the_arguments():
    _, calls = collect(NamedCallStream("f"), '{"x": 1}')
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"x": 1}')]
    stream = NamedCallStream("f")
    first, second = stream.feed('{"x"')[1], stream.feed(": 1}")[1]
    assert (first[0].id is not None, first[0].function.name) == (True, "f")
    assert (second[0].id, second[0].function.arguments) == (None, ": 1}")


def test_auto_tool_choice_flags_are_checked():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown parser 'no_such_format'"):
        ServerOptions(enable_auto_tool_choice=True, tool_call_parser="no_such_format")
    assert ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
