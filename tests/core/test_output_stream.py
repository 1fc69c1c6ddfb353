"""Incremental detokenization and stop strings, token by token as the engine delivers them.

Expected texts follow vLLM's rules: the text ends just before the first stop string to
complete (just after it with include_stop_str_in_output), stops are tried in the order given,
and the stop string is the stop_reason.
"""

import pytest
from transformers import AutoTokenizer

from actorlm.core.output_stream import OutputStream
from actorlm.messages import RequestDelta
from actorlm.sampling_params import SamplingParams

ENGLISH = "Hello world, this is a test of stop strings."  # Hello| world|,| this| is| a| test|…
UNICODE = "Café crème 你好世界 🙂 done"  # the CJK characters span nine byte-level tokens


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


class ListSink(list):
    put = list.append


def feed(tokenizer, text, stream=False, **params):
    """Deliver ``text``'s tokens one per step; returns (stream, sink, tokens consumed)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Repeat after me:", add_special_tokens=False)
    sink = ListSink()
    out = OutputStream("r", None, prompt, SamplingParams(max_tokens=64, **params), tokenizer,
                       sink, stream)
    for used, token_id in enumerate(ids, start=1):
        if out.apply(0, RequestDelta("r", [token_id])) is not None:
            return out, sink, used
        sink.put(out.output())
    return out, sink, len(ids)


@pytest.mark.parametrize("text,stop,include,expected", [
    (ENGLISH, ["orl"], False, "Hello w"),  # inside one token
    (ENGLISH, ["orl"], True, "Hello worl"),
    (ENGLISH, ["lo wo"], False, "Hel"),  # across two tokens
    (ENGLISH, ["lo wo"], True, "Hello wo"),
    (ENGLISH, ["d, th"], False, "Hello worl"),  # across three tokens
    (ENGLISH, ["d, th"], True, "Hello world, th"),
    (ENGLISH, ["Hell"], False, ""),  # at the very first token
    (ENGLISH, ["Hell"], True, "Hell"),
    (ENGLISH, ["is", "world"], False, "Hello "),  # the stop that completes first wins
    (ENGLISH, ["test", "is"], False, "Hello world, th"),
    (ENGLISH, [" a test", "a t"], False, "Hello world, this is"),  # same step: list order
    (UNICODE, ["好世"], False, "Café crème 你"),
    (UNICODE, ["🙂"], False, "Café crème 你好世界 "),
    (UNICODE, ["🙂"], True, "Café crème 你好世界 🙂"),
    (UNICODE, ["è"], False, "Café cr"),
])
def test_stop_strings(tokenizer, text, stop, include, expected):
    out, _, _ = feed(tokenizer, text, stop=stop, include_stop_str_in_output=include)
    completion = out.output().outputs[0]
    assert completion.text == expected
    assert completion.finish_reason == "stop"
    assert completion.stop_reason in stop and (text.find(completion.stop_reason) >= 0)


def test_stop_finishes_at_the_token_that_completes_it(tokenizer):
    _, _, used = feed(tokenizer, ENGLISH, stop=["d, th"])
    assert used == 4  # Hello| world|,| this


def test_min_tokens_defers_stop_strings(tokenizer):
    out, _, used = feed(tokenizer, ENGLISH, stop=["world"], min_tokens=4)
    assert used == 11 and out.output().outputs[0].finish_reason is None


@pytest.mark.parametrize("text", [ENGLISH, UNICODE, "naïve façade — “quotes” ½ ∑ 😀😃"])
def test_streamed_text_is_clean_and_ends_as_a_full_decode(tokenizer, text):
    out, sink, _ = feed(tokenizer, text, stream=True)
    partials = [o.outputs[0].text for o in sink]
    assert all("\ufffd" not in p for p in partials)
    assert all(b.startswith(a) for a, b in zip(partials, partials[1:]))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert out.sequences[0].text == tokenizer.decode(ids) == text


def test_streaming_holds_back_what_could_start_a_stop_string(tokenizer):
    _, sink, _ = feed(tokenizer, ENGLISH, stream=True, stop=["is a test"])
    assert all("is a" not in o.outputs[0].text for o in sink)
    _, sink, _ = feed(tokenizer, ENGLISH, stream=True, stop=["zzz"])
    assert sink[-1].outputs[0].text == ENGLISH[:-2]  # the last len("zzz") - 1 chars wait


@pytest.mark.parametrize("text", [ENGLISH, UNICODE])
def test_text_decoded_once_at_the_end_equals_the_incremental_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Repeat after me:", add_special_tokens=False)
    texts = []
    for stream in (False, True):
        out = OutputStream("r", None, prompt, SamplingParams(max_tokens=64), tokenizer,
                           ListSink(), stream)
        for token_id in ids[:-1]:
            out.apply(0, RequestDelta("r", [token_id]))
        out.apply(0, RequestDelta("r", [ids[-1]], finish_reason="length"))
        texts.append(out.output().outputs[0].text)
    assert texts[0] == texts[1] == text
