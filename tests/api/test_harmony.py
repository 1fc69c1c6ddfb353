"""GPT-OSS's harmony format as a reasoning parser (``actorlm.harmony``, vLLM's
``--reasoning-parser openai_gptoss``): replies of analysis, commentary and final messages,
whole and streamed at every split (a special token cut across chunks included), cut short, or
not harmony at all; tool calls kept for the ``openai`` tool parser and read by it, through the
chat answer's whole and streamed paths; the gate over token ids that lets a grammar constrain
the final message alone, against a real xgrammar matcher; and a tokenizer without harmony's
tokens refused."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from test_reasoning_parsers import fed

from actorlm.api import protocol as p
from actorlm.api.options import ServerOptions
from actorlm.api.serving import _Generation
from actorlm.api.tool_choice import ToolUse
from actorlm.api.tool_parsers import PARSERS
from actorlm.harmony import HarmonyStream, HarmonyTokens, call_text
from actorlm.outputs import CompletionOutput, RequestOutput
from actorlm.reasoning import Phase, reasoning_parser, reasoning_tokens, split_reasoning

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]

# (the reply as text, special tokens kept; reasoning (None: no analysis); content)
CASES = [
    ("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hi there!<|return|>", "The user greets.", "Hi there!"),
    ("<|channel|>final<|message|>Just this.<|return|>", None, "Just this."),
    # two analysis messages, a preamble in commentary, then the answer
    ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis"
     "<|message|> Second.<|end|><|start|>assistant<|channel|>commentary<|message|>Looking it up."
     "<|end|><|start|>assistant<|channel|>final<|message|>42<|return|>", "First. Second.",
     "Looking it up.42"),
    # a tool call's arguments (commentary to a function) are content: no tool parser here
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary"
     " to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
     "Need weather.", "{\"city\": \"Paris\"}"),
    # cut short: inside the analysis, inside a header
    ("<|channel|>analysis<|message|>Still thinking", "Still thinking", ""),
    ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|chan", "Done.", ""),
    # text that merely looks like a token inside a body stays in it
    ("<|channel|>final<|message|>Use <| and |> freely, even <|end<|return|>", None,
     "Use <| and |> freely, even <|end"),
    # not harmony: all content
    ("Plain text, no header.", None, "Plain text, no header."),
    ("  <b>bold</b>", None, "  <b>bold</b>"),
    ("", None, ""),
]


def streamed(pieces):
    return fed(HarmonyStream(), pieces)


@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_whole_and_every_streamed_split_agree(text, reasoning, content):
    assert split_reasoning(HarmonyStream(), text) == (reasoning, content)
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]]) == (reasoning, content), i
    assert streamed(list(text)) == (reasoning, content)


def test_body_text_is_sent_as_soon_as_it_cannot_be_an_end():
    stream = HarmonyStream()
    assert stream.feed("<|channel|>analysis<|mes") == ("", "")  # a header: nothing yet
    assert stream.feed("sage|>Think") == ("Think", "")
    assert stream.feed("ing<|e") == ("ing", "")  # may be <|end|>: held
    assert stream.feed("nd|><|start|>assistant<|channel|>final<|message|>A") == ("", "A")


WEATHER = '{"city": "Paris"}'
TO_WEATHER = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
              "commentary to=functions.get_weather <|constrain|>json<|message|>" + WEATHER)
# (the reply; reasoning; content, where a call is kept as call_text writes it)
CALL_CASES = [
    # the reply stopped at <|call|> (a stop token: not in the text), or kept it
    (TO_WEATHER, "Need weather.", call_text("get_weather", WEATHER)),
    (TO_WEATHER + "<|call|>", "Need weather.", call_text("get_weather", WEATHER)),
    # a preamble first; the recipient in the header's role part
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time"
     "<|channel|>commentary json<|message|>{}<|call|>", None,
     "Checking." + call_text("get_time", "{}")),
    # a built-in tool's recipient is no function: its body stays where its channel puts it
    ("<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>", "{\"q\": 1}", ""),
]


@pytest.mark.parametrize("text, reasoning, content", CALL_CASES)
def test_calls_are_kept_whole_in_the_content_at_every_split(text, reasoning, content):
    assert split_reasoning(HarmonyStream(calls=True), text) == (reasoning, content)
    for i in range(len(text) + 1):
        assert fed(HarmonyStream(calls=True), [text[:i], text[i:]]) == (reasoning, content), i
    assert fed(HarmonyStream(calls=True), list(text)) == (reasoning, content)


def test_without_calls_a_calls_arguments_are_content():
    assert split_reasoning(HarmonyStream(), TO_WEATHER) == ("Need weather.", WEATHER)


def _generation(stream: bool, pieces: list[str]) -> _Generation:
    """A chat answer of ``pieces`` with the harmony parser and the ``openai`` tool parser."""
    request = types.SimpleNamespace(state=types.SimpleNamespace(request_id="r",
                                                                request_id_from_client=False))
    req = p.ChatCompletionRequest(messages=[p.ChatMessage("user", "hi")], stream=stream)
    tokens = HarmonyTokens(channel_id=1, message_id=2, final_ids=(3,))
    gen = _Generation(types.SimpleNamespace(decode=None), "m", "chatcmpl", request, req,
                      ServerOptions(), ToolUse("auto", parser=PARSERS["openai"]()), tokens)
    gen.prompt_token_ids = [[0]]

    async def outputs():
        text = ""
        for i, piece in enumerate(pieces):
            text, done = text + piece, i == len(pieces) - 1
            yield RequestOutput("r", None, [0], [CompletionOutput(
                0, text, list(range(i + 1)), finish_reason="stop" if done else None)], done)

    gen.streams = [outputs()]
    return gen


PREAMBLE_CALL = CALL_CASES[2][0]


@pytest.mark.parametrize("text, reasoning, content", [
    (TO_WEATHER, "Need weather.", None), (PREAMBLE_CALL, None, "Checking.")])
@pytest.mark.parametrize("cut", [1, 4, 1000])
def test_the_openai_tool_parser_reads_the_calls_whole_and_streamed(text, reasoning, content,
                                                                   cut):
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    message = _generation(False, pieces).chat_response(
        [RequestOutput("r", None, [0], [CompletionOutput(0, text, [0], finish_reason="stop")],
                       True)]).choices[0].message
    [call] = message.tool_calls
    name, arguments = call.function.name, json.loads(call.function.arguments)
    assert name in ("get_weather", "get_time") and arguments == json.loads(
        WEATHER if name == "get_weather" else "{}")
    assert (message.reasoning_content, message.content) == (reasoning, content)

    async def events():
        return [e async for e in _generation(True, pieces).chat_events()]

    chunks = [json.loads(e[len(b"data: "):]) for e in asyncio.run(events())[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (reasoning or "")
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    [streamed] = [t for d in deltas for t in d.get("tool_calls", [])]
    assert (streamed["function"]["name"], json.loads(streamed["function"]["arguments"])) == \
        (name, arguments)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_cut_short_is_content_without_its_marks():
    cut = TO_WEATHER[:-3]  # the arguments end early (max_tokens)
    message = _generation(False, [cut]).chat_response([RequestOutput(
        "r", None, [0], [CompletionOutput(0, cut, [0], finish_reason="length")], True)]
    ).choices[0].message
    assert (message.tool_calls, message.content) == ([], WEATHER[:-3])


def test_the_openai_tool_parser_implies_the_harmony_reasoning_parser():
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="openai")
    assert options.reasoning_parser_for(None) == "openai_gptoss"
    assert options.reasoning_parser_for("openai_gptoss") == "openai_gptoss"
    with pytest.raises(ValueError, match="--tool-call-parser openai .* needs --reasoning-parser "
                                         "openai_gptoss, not qwen3"):
        options.reasoning_parser_for("qwen3")
    assert ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"
                         ).reasoning_parser_for("qwen3") == "qwen3"


@pytest.fixture(scope="module")
def harmony_tokenizer(tiny_tokenizer_dir, tmp_path_factory):
    """The tiny tokenizer with harmony's special tokens added."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    return tokenizer


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_gate_lets_the_final_message_alone_be_content(harmony_tokenizer):
    tokens = reasoning_tokens(reasoning_parser("openai_gptoss"), harmony_tokenizer)
    assert isinstance(tokens, HarmonyTokens) and tokens.tags_are_special
    assert tokens.initial_phase(_ids(harmony_tokenizer, "<|start|>assistant")) is \
        Phase.REASONING
    header = _ids(harmony_tokenizer, "<|channel|>analysis<|message|>final words<|end|>"
                                     "<|start|>assistant<|channel|>commentary<|message|>x<|end|>"
                                     "<|start|>assistant<|channel|>final<|message|>")
    answer = _ids(harmony_tokenizer, "yes")
    gate = tokens.gate(Phase.REASONING)
    assert [gate.on_token(t) for t in header] == [False] * len(header)
    assert not gate.may_open and not gate.is_reasoning  # the final body begins
    assert all(gate.on_token(t) for t in answer)


def test_a_grammar_constrains_the_final_message_alone(harmony_tokenizer):
    import xgrammar

    from actorlm.core.structured_output import GatedGrammar, GrammarCompiler, new_matcher
    from actorlm.sampling_params import StructuredOutputsParams

    tokenizer = harmony_tokenizer
    vocab_size = len(tokenizer)
    tokens = reasoning_tokens(reasoning_parser("openai_gptoss"), tokenizer)
    compiled = GrammarCompiler(tokenizer, vocab_size).compile(
        StructuredOutputsParams(choice=["yes"]))

    def allowed(matcher) -> set[int]:
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return {t for t in range(vocab_size) if (int(bitmask[0, t >> 5]) >> (t & 31)) & 1}

    plain = allowed(xgrammar.GrammarMatcher(compiled))
    matcher = new_matcher(GatedGrammar(compiled, tokens, tokens.initial_phase([])))
    for t in _ids(tokenizer, "<|channel|>analysis<|message|>no no<|end|><|start|>assistant"
                             "<|channel|>final<|message|>"):
        assert allowed(matcher) == set(range(vocab_size))  # the analysis is free
        assert matcher.accept_token(t)
    assert allowed(matcher) == plain  # the final body: the grammar's tokens
    for t in _ids(tokenizer, "yes"):
        assert matcher.accept_token(t)
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


def test_a_tokenizer_without_harmonys_tokens_is_refused_by_name(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match=r"openai_gptoss: .*has no <\|channel\|>, <\|message\|>"):
        reasoning_tokens(reasoning_parser("openai_gptoss"),
                         AutoTokenizer.from_pretrained(tiny_tokenizer_dir), "tiny")


def test_an_engine_without_the_harmony_parser_is_refused_under_the_openai_tool_parser(
        tiny_llama_dir):
    # (the command line implies the parser; an engine built apart and handed to the app may
    # lack it: the app does not start)
    from starlette.testclient import TestClient

    from actorlm.api.server import create_app
    from actorlm.async_llm import AsyncLLM

    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    try:
        app = create_app(engine, options=ServerOptions(enable_auto_tool_choice=True,
                                                       tool_call_parser="openai"))
        with pytest.raises(ValueError, match="openai needs the engine's --reasoning-parser "
                                             "openai_gptoss"), TestClient(app):
            pass
    finally:
        engine.shutdown()
