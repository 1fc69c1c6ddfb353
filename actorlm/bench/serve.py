"""``actorlm bench serve``: online serving benchmark against a running OpenAI-compatible server.

Like ``vllm bench serve``: requests arrive as a Poisson process of rate ``request_rate``
(seeded, so runs are repeatable; ``inf`` sends them all at once), each one streams, and the
client measures per request the time to first token (TTFT), the time per output token after
the first (TPOT), the gaps between streamed chunks (ITL) and the end-to-end latency (E2E).
Token counts come from the server's usage chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np

from actorlm.bench.throughput import bench_prompts

_PERCENTILES = (50, 90, 99)


async def _one_request(client, url: str, payload: dict, is_chat: bool) -> dict:
    result = {"ok": False, "ttft": None, "itl": [], "e2e": None, "prompt_tokens": 0,
              "output_tokens": 0, "error": None}
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result["error"] = chunk["error"].get("message", str(chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    result["output_tokens"] = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content") if is_chat else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if result["ttft"] is None:
                            result["ttft"] = now - start
                        else:
                            result["itl"].append(now - last)
                        last = now
                        num_chunks += 1
    except Exception as exc:  # a refused connection, a reset: the request failed
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    result["e2e"] = time.perf_counter() - start
    result["output_tokens"] = result["output_tokens"] or num_chunks
    result["ok"] = result["ttft"] is not None
    if not result["ok"]:
        result["error"] = "the stream carried no text"
    return result


def _payload(endpoint: str, model: str, conversation: list[dict], max_tokens: int,
             ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint.endswith("/chat/completions"):
        body["messages"] = conversation
    else:
        body["prompt"] = conversation[0]["content"]
    return body


async def _run(base_url: str, num_prompts: int, request_rate: float, endpoint: str,
               max_tokens: int, model: str | None, max_concurrency: int | None, seed: int,
               ignore_eos: bool) -> dict:
    import httpx

    base_url = base_url.rstrip("/")
    is_chat = endpoint.endswith("/chat/completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if model is None:
            listing = (await client.get(base_url + "/v1/models")).raise_for_status().json()
            model = listing["data"][0]["id"]
        conversations = bench_prompts(num_prompts)
        url = base_url + endpoint
        probe = await _one_request(client, url, _payload(endpoint, model, conversations[0], 4,
                                                         ignore_eos), is_chat)
        if not probe["ok"]:
            raise RuntimeError(f"the test request to {url} failed: {probe['error']}")

        rng = random.Random(seed)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(payload: dict) -> dict:
            if semaphore is None:
                return await _one_request(client, url, payload, is_chat)
            async with semaphore:
                return await _one_request(client, url, payload, is_chat)

        tasks = []
        start = time.perf_counter()
        for i, conversation in enumerate(conversations):
            payload = _payload(endpoint, model, conversation, max_tokens, ignore_eos)
            tasks.append(asyncio.create_task(limited(payload)))
            if request_rate != float("inf") and i < num_prompts - 1:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return _summarize(results, duration, model, endpoint, request_rate, max_tokens)


def _summarize(results: list[dict], duration: float, model: str, endpoint: str,
               request_rate: float, max_tokens: int) -> dict:
    ok = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    input_tokens = sum(r["prompt_tokens"] for r in ok)
    output_tokens = sum(r["output_tokens"] for r in ok)
    out = {
        "model": model, "endpoint": endpoint,
        "request_rate": request_rate if request_rate != float("inf") else "inf",
        "max_tokens": max_tokens, "num_prompts": len(results), "completed": len(ok),
        "failed": len(errors), "duration_s": round(duration, 3),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((input_tokens + output_tokens) / duration, 2),
    }
    series = {
        "ttft": [r["ttft"] for r in ok],
        "tpot": [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1)
                 for r in ok if r["output_tokens"] > 1],
        "itl": [gap for r in ok for gap in r["itl"]],
        "e2el": [r["e2e"] for r in ok],
    }
    for name, values in series.items():
        ms = np.asarray(values, dtype=float) * 1000.0
        out[f"mean_{name}_ms"] = round(float(ms.mean()), 3) if ms.size else None
        for q in _PERCENTILES:
            key = f"median_{name}_ms" if q == 50 else f"p{q}_{name}_ms"
            out[key] = round(float(np.percentile(ms, q)), 3) if ms.size else None
    if errors:
        out["errors"] = sorted(set(errors))[:5]
    return out


def run_serve_benchmark(base_url: str, num_prompts: int, request_rate: float = float("inf"), *,
                        endpoint: str = "/v1/completions", max_tokens: int = 128,
                        model: str | None = None, max_concurrency: int | None = None,
                        seed: int = 0, ignore_eos: bool = False) -> dict:
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    return asyncio.run(_run(base_url, num_prompts, request_rate, endpoint, max_tokens, model,
                            max_concurrency, seed, ignore_eos))


def print_report(result: dict) -> None:
    """The human-readable table, laid out like ``vllm bench serve``'s."""
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
            ("Benchmark duration (s)", result["duration_s"]),
            ("Total input tokens", result["total_input_tokens"]),
            ("Total generated tokens", result["total_output_tokens"]),
            ("Request throughput (req/s)", result["request_throughput"]),
            ("Output token throughput (tok/s)", result["output_throughput"]),
            ("Total token throughput (tok/s)", result["total_token_throughput"])]
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    for label, value in rows:
        print(f"{label + ':':<40}{value:<10}")
    for name, title in (("ttft", "Time to First Token"),
                        ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^50}".format(s=title, c="-"))
        upper = name.upper()
        for prefix, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"),
                              ("p99", "P99")):
            print(f"{f'{label} {upper} (ms):':<40}{result[f'{prefix}_{name}_ms']}")
    print("=" * 50)
    for error in result.get("errors", []):
        print(f"error: {error}")
