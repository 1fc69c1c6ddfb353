"""The reasoning parsers (``actorlm.reasoning``) on fixed texts and token streams: both rules
(and their other tags), whole and streamed (every split of the text, so a tag cut across chunks
is covered), an unterminated think, no think, and the phase the prompt's last turn leaves them
in. Then the token-level gate that holds a grammar back until the think ends, against a real
xgrammar matcher."""

from __future__ import annotations

import pytest

from actorlm.reasoning import (REASONING_PARSERS, Phase, ReasoningStream, ThinkGate, ThinkTokens,
                               reasoning_parser, split_reasoning)

DEEPSEEK, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
SEED, MISTRAL = REASONING_PARSERS["seed_oss"], REASONING_PARSERS["mistral"]
START, END, TURN = 7, 8, 9  # token ids of <think>, </think> and a turn's start


def whole(parser, phase, text):
    return split_reasoning(ReasoningStream(parser, phase), text)


def streamed(parser, phase, pieces):
    return fed(ReasoningStream(parser, phase), pieces)


def fed(stream, pieces):
    """(reasoning or None, content) from feeding ``pieces`` one by one to ``stream``, plus
    every piece's output (nothing may come back that a later piece would have to retract)."""
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return (reasoning + r if stream.has_reasoning else None), content + c


def every_split(text):
    """The text cut in two at every position, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


# (parser, initial phase, model output, reasoning, content)
CASES = [
    # deepseek_r1: the think is open from the start (the template may have opened it)
    (DEEPSEEK, Phase.REASONING, "Let me see.</think>The answer is 4.", "Let me see.",
     "The answer is 4."),
    (DEEPSEEK, Phase.REASONING, "<think>\nLet me see.\n</think>\n\nFour.", "\nLet me see.\n",
     "\n\nFour."),
    (DEEPSEEK, Phase.REASONING, "  <think>hmm</think>ok", "hmm", "ok"),
    (DEEPSEEK, Phase.REASONING, "still thinking, never closed", "still thinking, never closed",
     ""),
    (DEEPSEEK, Phase.REASONING, "</think>", "", ""),
    (DEEPSEEK, Phase.REASONING, "", "", ""),
    (DEEPSEEK, Phase.REASONING, "a </th b", "a </th b", ""),  # half a tag is text
    (DEEPSEEK, Phase.REASONING, "x</think>y</think><think>z", "x", "y</think><think>z"),
    (DEEPSEEK, Phase.REASONING, "plan <think> inner</think>done", "plan <think> inner", "done"),
    # qwen3: a think only where the output opens with one
    (QWEN3, Phase.BEFORE, "<think>\nI think.\n</think>\n\nHello!", "\nI think.\n",
     "\n\nHello!"),
    (QWEN3, Phase.BEFORE, "Hello, no thinking here.", None, "Hello, no thinking here."),
    (QWEN3, Phase.BEFORE, "Hello </think> there", None, "Hello </think> there"),
    (QWEN3, Phase.BEFORE, "Use <think> tags", None, "Use <think> tags"),
    (QWEN3, Phase.BEFORE, "\n<think>unterminated", "unterminated", ""),
    (QWEN3, Phase.BEFORE, "<thin", None, "<thin"),
    (QWEN3, Phase.BEFORE, "  ", None, "  "),
    (QWEN3, Phase.BEFORE, "", None, ""),
    # qwen3 after a prompt that opened the think, or closed it (enable_thinking=False)
    (QWEN3, Phase.REASONING, "reasons</think>answer", "reasons", "answer"),
    (QWEN3, Phase.CONTENT, "<think>a</think>b", None, "<think>a</think>b"),
    # the same rules under other tags: Seed-OSS reasons first, Magistral only in [THINK]
    (SEED, Phase.REASONING, "<seed:think>hm</seed:think>ok", "hm", "ok"),
    (SEED, Phase.REASONING, "a </think> b</seed:think>c", "a </think> b", "c"),
    (MISTRAL, Phase.BEFORE, "[THINK]why[/THINK]Because.", "why", "Because."),
    (MISTRAL, Phase.BEFORE, "No think. [THINK]x[/THINK]", None, "No think. [THINK]x[/THINK]"),
    (MISTRAL, Phase.BEFORE, "[THINK]unterminated </think>", "unterminated </think>", ""),
]


@pytest.mark.parametrize("parser, phase, text, reasoning, content", CASES)
def test_whole_and_every_streamed_split_agree(parser, phase, text, reasoning, content):
    assert whole(parser, phase, text) == (reasoning, content)
    for pieces in every_split(text):
        assert streamed(parser, phase, pieces) == (reasoning, content), pieces


def test_text_is_sent_as_soon_as_it_cannot_be_a_tag():
    stream = ReasoningStream(DEEPSEEK, Phase.REASONING)
    assert stream.feed("I wonder") == ("I wonder", "")
    assert stream.feed(" </thi") == (" ", "")  # "</thi" may begin the end tag: held
    assert stream.feed("s is no tag") == ("</this is no tag", "")
    assert stream.feed("</think>Yes") == ("", "Yes")
    assert stream.feed(" <") == ("", " <")  # content: nothing is held back any more
    assert stream.finish() == ("", "")


def test_qwen3_holds_leading_whitespace_until_it_knows():
    stream = ReasoningStream(QWEN3, Phase.BEFORE)
    assert stream.feed("\n") == ("", "")
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>why") == ("why", "")
    assert stream.has_reasoning
    other = ReasoningStream(QWEN3, Phase.BEFORE)
    assert other.feed("\n") == ("", "")
    assert other.feed("Hi") == ("", "\nHi")
    assert not other.has_reasoning


class FakeTokenizer:
    def __init__(self, vocab, special=()):
        self.vocab, self.special = vocab, set(special)

    def get_vocab(self):
        return self.vocab

    def decode(self, ids, skip_special_tokens=False):
        names = {i: t for t, i in self.vocab.items()}
        return "".join(names[i] for i in ids if not (skip_special_tokens and i in self.special))


def test_the_prompt_decides_where_the_output_starts():
    ds = ThinkTokens.for_tokenizer(DEEPSEEK, FakeTokenizer({"<think>": START, "</think>": END}))
    qw = ThinkTokens(QWEN3, START, END)
    assert (ds.start_token_id, ds.end_token_id) == (START, END)
    opened, closed, neither = [1, 2, START, 3], [1, START, 3, END, 4], [1, 2, 3]
    assert qw.initial_phase(opened) is Phase.REASONING  # the chat template opened the think
    assert qw.initial_phase(closed) is Phase.CONTENT  # ... or closed an empty one
    assert qw.initial_phase(neither) is Phase.BEFORE
    assert ds.initial_phase(neither) is Phase.REASONING
    assert ds.initial_phase(closed) is Phase.CONTENT
    # an earlier turn's think, closed, then a new one opened by the template
    assert qw.initial_phase([START, 5, END, 6, START]) is Phase.REASONING
    assert split_reasoning(qw.text_stream(opened), "r</think>c") == ("r", "c")
    assert split_reasoning(qw.text_stream(closed), "r</think>c") == (None, "r</think>c")


def test_only_the_last_turn_of_the_prompt_counts():
    """An earlier answer's closed think in the history says nothing of this answer's: the scan
    stops at the parser's turn token, where the tokenizer has one."""
    vocab = {"<think>": START, "</think>": END, "<|im_start|>": TURN}
    qw = ThinkTokens.for_tokenizer(QWEN3, FakeTokenizer(vocab))
    assert qw.turn_token_id == TURN and not qw.tags_are_special
    history = [TURN, 1, START, 2, END, 3, TURN, 4]  # a past answer's think, then a new turn
    assert qw.initial_phase(history) is Phase.BEFORE
    assert qw.initial_phase(history + [START]) is Phase.REASONING  # this turn's own tags
    assert qw.initial_phase(history + [START, END]) is Phase.CONTENT
    assert ThinkTokens(QWEN3, START, END).initial_phase(history) is Phase.CONTENT  # no turn token
    seed_vocab = {"<seed:think>": START, "</seed:think>": END, "<seed:bos>": TURN}
    seed = ThinkTokens.for_tokenizer(SEED, FakeTokenizer(seed_vocab))
    assert seed.initial_phase(history) is Phase.REASONING  # Seed-OSS reasons first
    # Magistral's system prompt writes [THINK]...[/THINK] as special tokens, before [/INST]
    magistral = ThinkTokens.for_tokenizer(MISTRAL, FakeTokenizer(
        {"[THINK]": START, "[/THINK]": END, "[/INST]": TURN}, special=(START, END, TURN)))
    assert magistral.tags_are_special
    assert magistral.initial_phase([START, 1, END, 2, TURN]) is Phase.BEFORE


def test_unknown_parser_and_missing_tags_are_clear_errors():
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown parser 'r1' \(known: "
                                         r"deepseek_r1, deepseek_v3, glm45, mimo, minimax_m2, "
                                         r"mistral, openai_gptoss, qwen3, seed_oss, step3\)"):
        reasoning_parser("r1")
    with pytest.raises(ValueError, match="tokenizer of tiny has no '</think>' token"):
        ThinkTokens.for_tokenizer(QWEN3, FakeTokenizer({"<think>": START}), "tiny")


@pytest.mark.parametrize("phase, tokens, content_mask, phases", [
    # inside the think until </think>; the end tag itself is not content
    (Phase.REASONING, [1, START, 2, END, 3, END],
     [False, False, False, False, True, True], "RRRCCC"),
    # BEFORE: the start tag opens a think ...
    (Phase.BEFORE, [START, 1, END, 2], [False, False, False, True], "RRCC"),
    # ... anything else is content at once (a later <think> too)
    (Phase.BEFORE, [1, START, 2], [True, True, True], "CCC"),
    (Phase.CONTENT, [START, END, 1], [True, True, True], "CCC"),
])
def test_gate_follows_the_same_phases_over_token_ids(phase, tokens, content_mask, phases):
    gate = ThinkGate(START, END, phase)
    seen = []
    for token_id, is_content in zip(tokens, content_mask):
        assert gate.on_token(token_id) is is_content
        seen.append("R" if gate.is_reasoning else "C")
    assert "".join(seen) == phases


def test_gated_matcher_holds_the_grammar_until_the_think_ends(tiny_tokenizer_dir):
    """A real xgrammar choice grammar behind the gate: free tokens inside the think, the
    grammar's after it; in BEFORE the grammar's plus the start tag."""
    import xgrammar
    from transformers import AutoTokenizer

    from actorlm.core.structured_output import GatedGrammar, GrammarCompiler, new_matcher
    from actorlm.sampling_params import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    vocab_size = len(tokenizer)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    start, end = tokenizer.convert_tokens_to_ids(["<s>", "</s>"])  # stand-ins for the tags
    think = ThinkTokens(QWEN3, start, end)
    compiled = GrammarCompiler(tokenizer, vocab_size).compile(
        StructuredOutputsParams(choice=["yes"]))

    def allowed(matcher) -> set[int]:
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        bits = [(int(bitmask[0, t >> 5]) >> (t & 31)) & 1 for t in range(vocab_size)]
        return {t for t, bit in enumerate(bits) if bit}

    plain = allowed(xgrammar.GrammarMatcher(compiled))
    assert yes[0] in plain and len(plain) < vocab_size // 2

    matcher = new_matcher(GatedGrammar(compiled, think, Phase.REASONING))
    assert allowed(matcher) == set(range(vocab_size))  # the think is free
    off_grammar = next(t for t in range(vocab_size) if t not in plain and t != end)
    assert matcher.accept_token(off_grammar) and not matcher.is_terminated()
    assert matcher.accept_token(end)  # the think ends: the grammar starts from its beginning
    assert allowed(matcher) == plain
    assert not matcher.accept_token(off_grammar)
    for token_id in yes:
        assert matcher.accept_token(token_id)
    assert allowed(matcher) == {tokenizer.eos_token_id}  # the grammar is complete
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()

    before = new_matcher(GatedGrammar(compiled, think, Phase.BEFORE))
    assert allowed(before) == plain | {start}
    assert before.accept_token(start) and allowed(before) == set(range(vocab_size))
    top_bit = ThinkTokens(QWEN3, 63, end)  # bit 31 of its word: the sign of an int32
    assert allowed(new_matcher(GatedGrammar(compiled, top_bit, Phase.BEFORE))) == plain | {63}
    content_first = new_matcher(GatedGrammar(compiled, think, Phase.BEFORE))
    assert content_first.accept_token(yes[0])  # content at once: the grammar took it
    assert start not in allowed(content_first)
