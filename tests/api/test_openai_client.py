"""The server through the official ``openai`` client: completions and chat, streamed and not."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from api_helpers import SERVED_NAME

MODEL = SERVED_NAME
PROMPTS = ["Once upon a time", "The quick brown fox", "The baker opened his last sack",
           "Machine learning models read text", "One winter the river froze",
           "Questions and answers, numbers like 1, 2, 3", "A journey of a thousand miles",
           "The people of the village loved his bread"]
MESSAGES = [{"role": "user", "content": "Tell me about the village and the baker."}]


def _complete(client, prompt=PROMPTS[0], **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0.0)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


def _chat(client, messages=MESSAGES, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0.0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def _streamed_completion(client, **kw) -> tuple[dict[int, str], dict[int, list], list]:
    """Texts and finish reasons per choice index, and every chunk."""
    chunks = list(_complete(client, stream=True, **kw))
    texts, finishes = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, chunks


def _streamed_chat(client, **kw) -> tuple[dict[int, str], dict[int, list], list]:
    chunks = list(_chat(client, stream=True, **kw))
    texts, finishes = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, chunks


def _finish_only_last(finishes: list) -> bool:
    return finishes[-1] is not None and all(f is None for f in finishes[:-1])


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/version").json()["version"]


def test_completion_stream_equals_non_stream(client):
    for prompt in PROMPTS[:4]:
        full = _complete(client, prompt)
        choice = full.choices[0]
        assert choice.finish_reason in ("length", "stop")
        assert 1 <= full.usage.completion_tokens <= 16
        assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
        texts, finishes, _ = _streamed_completion(client, prompt=prompt)
        assert texts == {0: choice.text}
        assert _finish_only_last(finishes[0]) and finishes[0][-1] == choice.finish_reason


def test_chat_stream_equals_non_stream(client):
    full = _chat(client)
    assert full.choices[0].message.role == "assistant"
    texts, finishes, chunks = _streamed_chat(client)
    assert chunks[0].choices[0].delta.role == "assistant"  # the role comes first
    assert texts == {0: full.choices[0].message.content}
    assert _finish_only_last(finishes[0]) and finishes[0][-1] == full.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


def test_include_usage(client):
    full = _chat(client, max_tokens=8)
    for stream in (_chat(client, max_tokens=8, stream=True, stream_options={"include_usage": True}),
                   _complete(client, max_tokens=8, stream=True,
                             stream_options={"include_usage": True})):
        chunks = list(stream)
        assert all(c.usage is None for c in chunks[:-1])
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert 1 <= last.usage.completion_tokens <= 8
        assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
        assert 0 <= last.usage.prompt_tokens_details.cached_tokens < last.usage.prompt_tokens
    assert 0 <= full.usage.prompt_tokens_details.cached_tokens < full.usage.prompt_tokens
    # without the option there is no usage chunk
    assert all(c.usage is None for c in _chat(client, max_tokens=4, stream=True))


def test_a_repeated_prompt_is_served_from_the_prefix_cache(client, server):
    prompt = " ".join(PROMPTS) + " -- a tail only this test sends"
    assert httpx.post(server + "/reset_prefix_cache").status_code == 200
    first = _complete(client, prompt=prompt, max_tokens=4)
    second = _complete(client, prompt=prompt, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # whole blocks of 16 tokens, never the last prompt token
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text
    metrics = httpx.get(server + "/metrics").text
    hits = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert hits and float(hits.group(1)) >= cached
    assert httpx.post(server + "/reset_prefix_cache").status_code == 200
    third = _complete(client, prompt=prompt, max_tokens=4)
    assert third.usage.prompt_tokens_details.cached_tokens == 0


def test_n_completions(client):
    kw = dict(max_tokens=12, temperature=1.0, seed=123, n=2, extra_body={"ignore_eos": True})
    first, again = _complete(client, **kw), _complete(client, **kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    by_index = {c.index: c.text for c in first.choices}
    assert by_index == {c.index: c.text for c in again.choices}  # seeded: reproducible
    assert by_index[0] != by_index[1]  # the children sample independently
    assert first.usage.completion_tokens == 24
    texts, finishes, _ = _streamed_completion(client, **kw)
    assert texts == by_index
    assert all(_finish_only_last(f) for f in finishes.values())
    chat = _chat(client, **kw)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    chat_texts, chat_finishes, _ = _streamed_chat(client, **kw)
    assert chat_texts == {c.index: c.message.content for c in chat.choices}
    assert all(_finish_only_last(f) for f in chat_finishes.values())


def _stop_string(text: str) -> tuple[str, int]:
    """A short stop string that first occurs a few characters into ``text``."""
    for k in range(3, len(text) - 2):
        stop = text[k:k + 2]
        if stop.isascii() and stop.strip() and text.find(stop) == k:
            return stop, k
    raise AssertionError(f"the greedy text holds no usable stop string: {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(client, include):
    kw = dict(max_tokens=24, extra_body={"ignore_eos": True})
    full = _complete(client, PROMPTS[1], **kw).choices[0].text
    stop, k = _stop_string(full)
    expected = full[:k + len(stop)] if include else full[:k]
    kw["extra_body"]["include_stop_str_in_output"] = include
    choice = _complete(client, PROMPTS[1], stop=[stop], **kw).choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert getattr(choice, "stop_reason", stop) == stop
    texts, finishes, _ = _streamed_completion(client, prompt=PROMPTS[1], stop=stop, **kw)
    assert texts == {0: expected} and finishes[0][-1] == "stop"


def test_chat_logprobs(client):
    full = _chat(client, logprobs=True, top_logprobs=3, max_tokens=8)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.logprob == pytest.approx(values[0])  # greedy: the best one
        assert entry.token == entry.top_logprobs[0].token
    chunks = list(_chat(client, logprobs=True, top_logprobs=3, max_tokens=8, stream=True))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]
    assert _chat(client, max_tokens=4).choices[0].logprobs is None


def test_completion_logprobs(client):
    full = _complete(client, logprobs=2, max_tokens=8)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens).startswith(full.choices[0].text[:1])
    assert lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen == pytest.approx(max(top.values()))


def test_seed_and_sampling_extras(client):
    kw = dict(temperature=1.0, max_tokens=12, seed=7)
    assert _complete(client, **kw).choices[0].text == _complete(client, **kw).choices[0].text
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
              "min_tokens": 2, "skip_special_tokens": False, "spaces_between_special_tokens": True}
    out = _complete(client, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.5,
                    top_p=0.9, temperature=0.7, extra_body=extras)
    assert out.usage.completion_tokens == 20
    chat = _chat(client, max_completion_tokens=7, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 7


def test_the_sampling_extras_reach_the_sampler(client):
    def text(**kw):
        kw.setdefault("extra_body", {})["ignore_eos"] = True
        return _complete(client, prompt=PROMPTS[2], max_tokens=16, **kw).choices[0].text

    greedy = text(temperature=0.0)
    # top_k 1 and min_p 1 leave only the most likely token: sampling becomes greedy
    assert text(temperature=1.0, seed=3, extra_body={"top_k": 1}) == greedy
    assert text(temperature=1.0, seed=3, extra_body={"min_p": 1.0}) == greedy
    assert text(temperature=1.0, seed=3) != greedy  # (without them it samples)
    # a repetition penalty steers even greedy decoding away from what it said
    assert text(temperature=0.0, extra_body={"repetition_penalty": 2.0}) != greedy


def test_logit_bias_stop_token_ids_min_tokens(server, client):
    token = httpx.post(server + "/tokenize", json={"prompt": " the"}).json()["tokens"][-1]
    forced = _complete(client, max_tokens=5, logit_bias={str(token): 100},
                       extra_body={"ignore_eos": True})
    piece = httpx.post(server + "/detokenize", json={"tokens": [token] * 5}).json()["prompt"]
    assert forced.choices[0].text == piece
    stopped = _complete(client, max_tokens=10, logit_bias={str(token): 100},
                        extra_body={"stop_token_ids": [token]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1
    assert getattr(stopped.choices[0], "stop_reason", token) == token
    held = _complete(client, max_tokens=10, logit_bias={str(token): 100},
                     extra_body={"stop_token_ids": [token], "min_tokens": 3})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4


def test_several_prompts_and_echo(client):
    singles = [_complete(client, p, max_tokens=6).choices[0].text for p in PROMPTS[:2]]
    batch = _complete(client, PROMPTS[:2], max_tokens=6)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == singles
    texts, _, _ = _streamed_completion(client, prompt=PROMPTS[:2], max_tokens=6)
    assert texts == {0: singles[0], 1: singles[1]}
    echoed = _complete(client, PROMPTS[0], max_tokens=6, echo=True).choices[0].text
    assert echoed == PROMPTS[0] + singles[0]


def test_tokenize_detokenize(server, client, tiny_llama_dir):
    tokens = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(server + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == PROMPTS[0]
    chat_tokens = httpx.post(server + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat_tokens["count"] == _chat(client, max_tokens=1).usage.prompt_tokens
    assert "token_strs" not in tokens  # (vLLM's answer leaves it out unless asked)
    # vLLM's return_token_strs: each token as the tokenizer writes it (byte-level BPE's)
    strings = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[0],
                                                     "return_token_strs": True}).json()
    from transformers import AutoTokenizer

    assert strings["tokens"] == tokens["tokens"] and strings["token_strs"] == \
        AutoTokenizer.from_pretrained(tiny_llama_dir).convert_ids_to_tokens(tokens["tokens"])


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, server,
                                                                  tiny_llama_dir):
    """lm-evaluation-harness's loglikelihood request (``echo``, ``logprobs`` 1, ``max_tokens``
    1): the prompt's tokens with their logprobs before the completion's, the first null,
    each against transformers' log-softmax over the same ids; and ``is_greedy`` as lm-eval
    reads it from the top logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"]
    choice = _complete(client, PROMPTS[1], max_tokens=1, echo=True, logprobs=1).choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPTS[1]) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [float(logits[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
    greedy = [int(logits[i - 1].argmax()) == ids[i] for i in range(1, len(ids))]
    assert [max(top, key=top.get) == token for token, top in
            zip(lp.tokens[1:len(ids)], lp.top_logprobs[1:len(ids)])] == greedy
    assert not all(greedy)  # (a random model's prompt: the check can tell)


def test_echo_without_generation_is_the_prompt_scored(client, server):
    """vLLM's echo with ``max_tokens`` 0 (HELM's and older harnesses' scoring request): the
    prompt alone, its logprobs those of the request that also generates, no completion."""
    ids = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"]
    scored = _complete(client, PROMPTS[1], max_tokens=0, echo=True, logprobs=2)
    generating = _complete(client, PROMPTS[1], max_tokens=1, echo=True, logprobs=2).choices[0]
    choice = scored.choices[0]
    assert choice.text == PROMPTS[1] and choice.finish_reason == "length"
    assert choice.logprobs.tokens == generating.logprobs.tokens[:len(ids)]
    assert choice.logprobs.token_logprobs == generating.logprobs.token_logprobs[:len(ids)]
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    texts, _, _ = _streamed_completion(client, prompt=PROMPTS[1], max_tokens=0, echo=True)
    assert texts == {0: PROMPTS[1]}
    with pytest.raises(openai.BadRequestError, match="max_tokens: must be at least 1"):
        _complete(client, PROMPTS[1], max_tokens=0)  # without echo: nothing to answer


def test_prompt_logprobs(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "prompt_logprobs": 1}
    choice = httpx.post(server + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    positions = choice["prompt_logprobs"]
    num_prompt = len(httpx.post(server + "/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"])
    assert len(positions) == num_prompt and positions[0] is None
    assert all(1 <= len(p) <= 2 for p in positions[1:])
    assert all(v["logprob"] <= 0 for p in positions[1:] for v in p.values())
    chat = httpx.post(server + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_return_token_ids_gives_the_prompts_and_the_answers_ids(server, client):
    """vLLM's return_token_ids (agent and RL frameworks read it): completions and chat, whole
    and streamed; the streamed pieces add up to the whole answer's ids, the prompt's come once
    (in the first chunk), and without the flag none of it is sent."""
    asked = {"extra_body": {"return_token_ids": True}}
    prompt_ids = httpx.post(server + "/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    whole = _complete(client, **asked).choices[0]
    extra = whole.model_extra
    assert extra["prompt_token_ids"] == prompt_ids and len(extra["token_ids"]) == 16
    text = httpx.post(server + "/detokenize", json={"tokens": extra["token_ids"]}).json()
    assert text["prompt"] == whole.text
    chunks = [c.choices[0].model_extra for c in _complete(client, stream=True, **asked)]
    assert sum((c["token_ids"] for c in chunks), []) == extra["token_ids"]
    assert chunks[0]["prompt_token_ids"] == prompt_ids and \
        all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert _complete(client).choices[0].model_extra["token_ids"] is None  # (null, as vLLM's)

    chat_ids = httpx.post(server + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    answer = _chat(client, **asked)
    ids = answer.choices[0].model_extra["token_ids"]
    assert answer.model_extra["prompt_token_ids"] == chat_ids and len(ids) == 16
    pieces = list(_chat(client, stream=True, **asked))
    assert pieces[0].model_extra["prompt_token_ids"] == chat_ids
    assert sum((c.choices[0].model_extra.get("token_ids", []) for c in pieces
                if c.choices), []) == ids
    plain = list(_chat(client, stream=True))
    assert all("token_ids" not in c.choices[0].model_extra and
               "prompt_token_ids" not in c.model_extra for c in plain if c.choices)


def test_stream_interval_sends_tokens_a_few_at_a_time(client):
    """vLLM's stream_interval: chunks of at least 4 new tokens but the first and the last,
    adding up to the unbatched stream's text and ids."""
    asked = {"extra_body": {"return_token_ids": True}}
    every = [c.choices[0] for c in _complete(client, stream=True, **asked)]
    batched = [c.choices[0] for c in _complete(client, stream=True, extra_body={
        "return_token_ids": True, "stream_interval": 4})]
    assert "".join(c.text for c in batched) == "".join(c.text for c in every)
    sizes = [len(c.model_extra["token_ids"]) for c in batched]
    assert sum(sizes) == 16 and len(batched) < len(every)
    assert all(size >= 4 for size in sizes[1:-1])
    chat = [c for c in _chat(client, stream=True, extra_body={"stream_interval": 5})]
    assert len(chat) < len(list(_chat(client, stream=True)))
    from actorlm.api.options import ServerOptions

    with pytest.raises(ValueError, match="--stream-interval must be a positive integer"):
        ServerOptions(stream_interval=0)
