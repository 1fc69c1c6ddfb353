"""GPT-OSS's harmony format as a reasoning parser (``actorlm.harmony``, vLLM's
``--reasoning-parser openai_gptoss``): replies of analysis, commentary and final messages,
whole and streamed at every split (a special token cut across chunks included), cut short, or
not harmony at all; the gate over token ids that lets a grammar constrain the final message
alone, against a real xgrammar matcher; and a tokenizer without harmony's tokens refused."""

from __future__ import annotations

import pytest
from test_reasoning_parsers import fed

from actorlm.harmony import HarmonyStream, HarmonyTokens
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
