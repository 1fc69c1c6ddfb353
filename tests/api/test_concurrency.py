"""200 concurrent streams with ~3,000-character prompts through a real server: the tokenizer is
used at once by the submit thread (encoding, chat templates), the frontend (detokenizing) and
the event loop (logprob text), and no request may fail for it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
from api_helpers import read_events, serving

TEXT = ("The baker opened his last sack and shared it with every family until spring came. "
        "Machine learning models read text as tokens, one piece at a time. ") * 40


def _body(i: int) -> tuple[str, dict]:
    prompt = TEXT[i % 97:][:3000]
    body = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    if i % 4 == 1:
        body["logprobs"] = 2 if i % 2 else True
    if i % 2:
        return "/v1/completions", {**body, "prompt": prompt}
    if "logprobs" in body:
        body["top_logprobs"] = 2
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


def _tokenize_round_trip(base: str, i: int) -> bool:
    text = TEXT[i:i + 3000]
    tokens = httpx.post(base + "/tokenize", json={"prompt": text}, timeout=120).json()["tokens"]
    back = httpx.post(base + "/detokenize", json={"tokens": tokens}, timeout=120).json()
    return back["prompt"] == text


def test_200_concurrent_long_streams_without_an_error(tiny_llama_long_dir, tmp_path):
    flags = ["--max-num-seqs", "256", "--num-kv-blocks", "8192"]
    with serving(tiny_llama_long_dir, tmp_path / "server.log", *flags) as (_, base), \
            ThreadPoolExecutor(220) as pool:
        streams = [pool.submit(read_events, base, *_body(i)) for i in range(200)]
        round_trips = [pool.submit(_tokenize_round_trip, base, i) for i in range(20)]
        results = [future.result(timeout=300) for future in streams]
        assert all(future.result(timeout=300) for future in round_trips)
        assert httpx.get(base + "/health").status_code == 200

    for i, events in enumerate(results):
        assert events[-1] == "[DONE]", events[-2:]
        chunks = [json.loads(event) for event in events[:-1]]
        assert not any("error" in chunk for chunk in chunks), (i, chunks[-1])
        finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
        assert finishes[-1] == "length", (i, finishes)
