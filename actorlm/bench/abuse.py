"""Abuse a running server and report what is left: an abort storm and a memory soak.

``abort_storm``: hundreds of streams at once; half hang up at a random moment (before the
headers, mid-stream, or after a few events), half read to the end. Then the server must come
back to nothing running, nothing waiting, no KV block used, and ``/health`` 200.

``soak``: thousands of short requests (completions and chat, streamed and not) from a fixed
number of clients; the resident memory of every process of the server (the one listening on
the port and its descendants: the engine core, its workers) after a warm-up is compared with
the end, and sampled every tenth of the run so that a leak (a steady climb) is told from caches
filling up (a climb that flattens). A server on another machine is measured through
``process_resident_memory_bytes`` in ``/metrics`` (its frontend's process only).

``python -m actorlm.bench.abuse --base-url URL [--api-key KEY] [--soak]`` runs both and
prints one JSON object on its last line; ``--soak`` is the long variant (10,000 requests after
500 of warm-up, instead of the suite's few thousand).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
import psutil

PROMPTS = ["Once upon a time", "The quick brown fox", "The baker opened his last sack",
           "Machine learning models read text", "One winter the river froze"]


def scrape(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {sample name (labels dropped, summed): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_idle(base_url: str, within: float) -> tuple[bool, float]:
    """(whether nothing runs, waits or holds KV blocks, seconds it took to get there)."""
    start = time.monotonic()
    while True:
        values = scrape(base_url)
        idle = (values["vllm:num_requests_running"] == 0
                and values["vllm:num_requests_waiting"] == 0
                and values["vllm:kv_cache_usage_perc"] == 0.0)
        elapsed = time.monotonic() - start
        if idle or elapsed > within:
            return idle, elapsed
        time.sleep(0.05)


def _body(i: int, model: str | None, max_tokens: int, stream: bool) -> tuple[str, dict]:
    body = {"max_tokens": max_tokens, "stream": stream, "temperature": 0.8, "seed": i}
    if model is not None:
        body["model"] = model
    if i % 2:
        body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        return "/v1/chat/completions", body
    body["prompt"] = PROMPTS[i % len(PROMPTS)]
    return "/v1/completions", body


async def _storm_stream(http: httpx.AsyncClient, i: int, rng: random.Random, model, max_tokens,
                        hang_up: bool) -> str:
    path, body = _body(i, model, max_tokens, stream=True)
    body["ignore_eos"] = True
    leave_after = rng.randint(1, 8) if hang_up else None

    async def read() -> str:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return f"status {response.status_code}"
            seen = 0
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return "finished"
                seen += line.startswith("data: ")
                if leave_after is not None and seen >= leave_after:
                    return "hung-up"  # leaving the block closes the connection
        return "cut-short"

    if hang_up and rng.random() < 0.5:  # at a random moment, wherever the request is
        try:
            return await asyncio.wait_for(read(), rng.uniform(0.001, 0.5))
        except asyncio.TimeoutError:
            return "hung-up"
    return await read()


def abort_storm(base_url: str, num_streams: int = 300, *, headers: dict | None = None,
                model: str | None = None, max_tokens: int = 48, seed: int = 0) -> dict:
    rng = random.Random(seed)
    hang_ups = [i % 2 == 0 for i in range(num_streams)]
    rng.shuffle(hang_ups)

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120,
                                     limits=limits) as http:
            return await asyncio.gather(*(
                _storm_stream(http, i, rng, model, max_tokens, hang_ups[i])
                for i in range(num_streams)))

    start = time.monotonic()
    outcomes = asyncio.run(main())
    seconds = time.monotonic() - start
    idle, seconds_to_idle = wait_idle(base_url, within=10.0)
    values = scrape(base_url)
    return {"num_streams": num_streams, "num_hung_up": outcomes.count("hung-up"),
            "num_finished": outcomes.count("finished"),
            "num_other": len(outcomes) - outcomes.count("hung-up") - outcomes.count("finished"),
            "seconds": round(seconds, 2), "idle": idle,
            "seconds_to_idle": round(seconds_to_idle, 2),
            "num_running": values["vllm:num_requests_running"],
            "num_waiting": values["vllm:num_requests_waiting"],
            "kv_cache_usage": values["vllm:kv_cache_usage_perc"],
            "health": httpx.get(base_url + "/health", timeout=30).status_code}


def server_processes(base_url: str) -> list[psutil.Process]:
    """The process listening on ``base_url``'s port and its descendants; [] when none here."""
    port = httpx.URL(base_url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            server = psutil.Process(conn.pid)
            return [server, *server.children(recursive=True)]
    return []


def resident_mb(base_url: str, processes: list[psutil.Process]) -> dict[str, float]:
    """Resident MiB of each process, by its title (``ps``'s name) and pid."""
    if not processes:
        return {"server": round(scrape(base_url)["process_resident_memory_bytes"] / 2**20, 1)}
    sizes = {}
    for process in processes:
        try:
            sizes[f"{process.cmdline()[0]} ({process.pid})"] = \
                round(process.memory_info().rss / 2**20, 1)
        except (psutil.NoSuchProcess, IndexError):
            pass  # (a worker restarted under load: its successor is not followed)
    return sizes


def soak(base_url: str, num_requests: int = 3000, *, concurrency: int = 32,
         headers: dict | None = None, model: str | None = None, max_tokens: int = 4,
         num_warmup: int = 300, num_samples: int = 10) -> dict:
    async def worker(http, queue: asyncio.Queue, failures: list) -> None:
        while (i := queue.get_nowait() if not queue.empty() else None) is not None:
            path, body = _body(i, model, max_tokens, stream=i % 3 == 0)
            response = await http.post(path, json=body)
            if response.status_code != 200 or not response.text:
                failures.append(f"{response.status_code}: {response.text[:200]}")

    async def run(count: int, offset: int) -> list[str]:
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(offset, offset + count):
            queue.put_nowait(i)
        failures: list[str] = []
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as http:
            await asyncio.gather(*(worker(http, queue, failures) for _ in range(concurrency)))
        return failures

    processes = server_processes(base_url)
    asyncio.run(run(num_warmup, 0))  # caches, pools and allocator arenas fill up first
    curve = [resident_mb(base_url, processes)]
    start, failures, done = time.monotonic(), [], 0
    for part in range(1, num_samples + 1):
        count = num_requests * part // num_samples - done
        failures += asyncio.run(run(count, num_warmup + done))
        done += count
        curve.append(resident_mb(base_url, processes))
    seconds = time.monotonic() - start
    growth = {name: round(curve[-1].get(name, mb) - mb, 1) for name, mb in curve[0].items()}
    return {"num_requests": num_requests, "num_warmup": num_warmup, "concurrency": concurrency,
            "num_failed": len(failures), "first_failure": failures[0] if failures else None,
            "seconds": round(seconds, 2), "requests_per_s": round(num_requests / seconds, 1),
            "rss_mb_before": curve[0], "rss_mb_after": curve[-1], "rss_growth_mb": growth,
            "max_rss_growth_mb": max(growth.values()),
            "rss_mb_curve": [{"requests": num_requests * k // num_samples, **sizes}
                             for k, sizes in enumerate(curve)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="model name to send (default: none)")
    parser.add_argument("--num-streams", type=int, default=300)
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--num-warmup", type=int, default=300)
    parser.add_argument("--soak", action="store_true", help="the long run: 10,000 requests "
                        "after 500 of warm-up")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    storm = abort_storm(args.base_url, args.num_streams, headers=headers, model=args.model)
    print("abort storm:", storm)
    num_requests, num_warmup = (10_000, 500) if args.soak else (args.num_requests,
                                                                args.num_warmup)
    soaked = soak(args.base_url, num_requests, headers=headers, model=args.model,
                  num_warmup=num_warmup)
    print("soak:", soaked)
    print(json.dumps({"abort_storm": storm, "soak": soaked}))
    return 0 if storm["idle"] and storm["health"] == 200 and not soaked["num_failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
