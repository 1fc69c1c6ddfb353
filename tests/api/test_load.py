"""Many clients at once: hang-ups free everything, concurrent streams stay intact."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
from api_helpers import SERVED_NAME

from actorlm.bench.abuse import scrape

PROMPTS = ["Once upon a time", "The quick brown fox", "The baker opened his last sack",
           "Machine learning models read text", "One winter the river froze",
           "A journey of a thousand miles", "The people of the village loved his bread",
           "Questions and answers"]


def _wait_idle(base_url: str, within: float) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks; fail after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        values = scrape(base_url)
        idle = (values["vllm:num_requests_running"] == 0
                and values["vllm:num_requests_waiting"] == 0
                and values["vllm:kv_cache_usage_perc"] == 0.0)
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


async def _hang_up(http: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    """Stream a long request and leave at a random point: before the headers, after a few
    chunks, or right after the first."""
    chat = i % 2 == 0
    body = {"model": SERVED_NAME, "max_tokens": 400, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    else:
        body["prompt"] = PROMPTS[i % len(PROMPTS)]
    path = "/v1/chat/completions" if chat else "/v1/completions"

    async def read_some(num_events: int) -> str:
        async with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= num_events:
                    return "after-chunks"  # leaving the block closes the connection
        return "finished"

    if i % 3 == 0:  # hang up at a random moment, wherever the request is
        try:
            return await asyncio.wait_for(read_some(10_000), rng.uniform(0.001, 0.3))
        except asyncio.TimeoutError:
            return "timed-out"
    return await read_some(rng.randint(1, 12))


def test_disconnects_abort_and_free_everything(server):
    before = scrape(server)

    async def main():
        rng = random.Random(1234)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=server, timeout=30, limits=limits) as http:
            return await asyncio.wait_for(
                asyncio.gather(*(_hang_up(http, i, rng) for i in range(50))), 60)

    outcomes = asyncio.run(main())
    assert "finished" not in outcomes  # 400 tokens each: nobody got that far
    values = _wait_idle(server, within=2.0)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0.0
    assert values["actorlm:kv_cache_group_blocks"] == 0  # (the one group's, here)
    finished = "vllm:request_success_total"
    aborted = values.get(finished, 0) - before.get(finished, 0)
    assert aborted >= 25  # those that got past submission were counted as they left
    # the server still serves
    ok = httpx.post(server + "/v1/completions", json={"model": SERVED_NAME, "prompt": "Hi",
                                                       "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200


def test_64_concurrent_streams_are_intact(server):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    kw = dict(model=SERVED_NAME, max_tokens=16, temperature=0.0)

    async def main():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            references = []
            for prompt in prompts:  # one at a time: nothing else in the batch
                out = await client.completions.create(prompt=prompt, **kw)
                references.append(out.choices[0].text)

            async def stream(prompt: str) -> tuple[str, set, list]:
                text, ids, finishes = "", set(), []
                async for chunk in await client.completions.create(prompt=prompt, stream=True,
                                                                   **kw):
                    ids.add(chunk.id)
                    for choice in chunk.choices:
                        assert choice.index == 0
                        text += choice.text
                        finishes.append(choice.finish_reason)
                return text, ids, finishes

            results = await asyncio.gather(*(stream(p) for p in prompts))
            return references, results

    references, results = asyncio.run(main())
    all_ids = set()
    for reference, (text, ids, finishes) in zip(references, results):
        assert text == reference
        assert len(ids) == 1 and not ids & all_ids  # one id per stream, none shared
        all_ids |= ids
        assert finishes[-1] is not None and all(f is None for f in finishes[:-1])
    values = _wait_idle(server, within=2.0)
    assert values["vllm:kv_cache_usage_perc"] == 0.0


def test_metrics_after_load(server_process):
    server, log_path = server_process
    values = scrape(server)
    assert values["vllm:time_to_first_token_seconds_count"] > 0
    assert values["vllm:e2e_request_latency_seconds_count"] > 0
    assert values["vllm:inter_token_latency_seconds_count"] > 0
    assert values["vllm:prompt_tokens_total"] > 0 and values["vllm:generation_tokens_total"] > 0
    assert "vllm:num_preemptions_total" in values
    # the periodic stats line (every second here) appeared while the server had work
    assert "Running:" in log_path.read_text()
