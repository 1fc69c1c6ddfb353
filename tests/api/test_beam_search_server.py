"""``use_beam_search`` (vLLM's) on the real server, driven by the official ``openai`` client:
``n`` beams as ``n`` choices, best first, equal to transformers' ``generate(num_beams=n)`` on
the same prompt (end tokens ignored: every beam runs its ``max_tokens``); streamed alike; the
fields a beam search does not combine with refused by name; a client that hangs up aborts
the search, every step's requests with it.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from api_helpers import SERVED_NAME

PROMPT = [5, 17, 33, 9, 41, 12]
WIDTH, STEPS = 3, 8
BEAMS = {"use_beam_search": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_llama_dir))


def _their_beams(hf, prompt: list[int]) -> list[str]:
    model, tokenizer = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), num_beams=WIDTH,
                             num_return_sequences=WIDTH, max_new_tokens=STEPS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return [tokenizer.decode(seq[len(prompt):], skip_special_tokens=True) for seq in out]


def test_completion_beams_are_transformers_beams(client, hf):
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=STEPS,
                                    n=WIDTH, extra_body=BEAMS)
    assert [c.index for c in out.choices] == list(range(WIDTH))
    assert [c.text for c in out.choices] == _their_beams(hf, PROMPT)
    assert {c.finish_reason for c in out.choices} == {"length"}
    assert out.usage.completion_tokens == WIDTH * STEPS
    assert out.usage.prompt_tokens == len(PROMPT)


def test_streamed_beams_arrive_whole(client, hf):
    texts = [""] * WIDTH
    reasons = [None] * WIDTH
    for chunk in client.completions.create(model=SERVED_NAME, prompt=PROMPT,
                                           max_tokens=STEPS, n=WIDTH, stream=True,
                                           extra_body=BEAMS):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == _their_beams(hf, PROMPT)
    assert reasons == ["length"] * WIDTH


def test_chat_beams_are_transformers_beams_on_the_templated_prompt(client, hf):
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    out = client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                         max_tokens=STEPS, n=WIDTH, extra_body=BEAMS)
    ids = hf[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert [c.message.content for c in out.choices] == _their_beams(hf, ids)


@pytest.mark.parametrize("extra, param", [
    ({"top_p": 0.5}, "top_p"), ({"top_k": 5}, "top_k"), ({"repetition_penalty": 1.2},
                                                           "repetition_penalty"),
    ({"stop": ["x"]}, "stop"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "use_beam_search"),
    ({"n": 11}, "use_beam_search"), ({"length_penalty": "1e999"}, "length_penalty"),
], ids=["top-p", "top-k", "repetition-penalty", "stop", "logit-bias", "json", "too-wide",
        "infinite-penalty"])
def test_what_beams_do_not_combine_with_is_a_400_naming_it(server, extra, param):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 4, "n": 2,
            "use_beam_search": True, **extra}
    # (1e999, past a float's range, reads as infinity: sent as the number it spells)
    content = json.dumps(body).replace('"1e999"', "1e999")
    reply = httpx.post(server + "/v1/completions", content=content, timeout=30,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    body = {k: v for k, v in body.items() if k not in extra or k == "n"}
    body["n"] = 2
    assert httpx.post(server + "/v1/completions", json=body, timeout=30).status_code == 200


def test_a_client_that_hangs_up_aborts_the_search(server_process, client):
    base, log_path = server_process
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 400, "n": 4, **BEAMS}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/completions", json=body, timeout=1.0)
    _wait_for(lambda: "client disconnected; aborted" in log_path.read_text(), "the abort")
    # (between two steps of a search nothing runs: idle once is not enough)
    generated = _metric(base, "vllm:generation_tokens_total")
    time.sleep(0.5)
    assert _metric(base, "vllm:generation_tokens_total") == generated  # no step since
    assert _metric(base, "vllm:num_requests_running") == 0
    assert _metric(base, "vllm:kv_cache_usage_perc") == 0
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def _metric(base: str, name: str) -> float:
    metrics = httpx.get(base + "/metrics").text.splitlines()
    return float(next(line for line in metrics if line.startswith(name)).split()[-1])


def _wait_for(condition, what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"waited {within} s for {what}"
        time.sleep(0.02)



def test_a_streaming_client_that_hangs_up_aborts_the_search(server):
    # a search streams nothing until it ends: a client that leaves after the headers sends
    # nothing more, so only the server's own bytes (a keep-alive comment) reveal it has gone
    width, max_tokens = 10, 480
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "n": width,
            "stream": True, **BEAMS}
    before = _metric(server, "vllm:generation_tokens_total")
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200  # leaving the block unread hangs up
    _wait_for(lambda: _no_step_in(server, 0.3), "the search to stop", 10.0)
    assert _metric(server, "vllm:generation_tokens_total") - before < 0.7 * width * max_tokens
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0


def _no_step_in(base: str, seconds: float) -> bool:
    generated = _metric(base, "vllm:generation_tokens_total")
    time.sleep(seconds)
    return _metric(base, "vllm:generation_tokens_total") == generated
