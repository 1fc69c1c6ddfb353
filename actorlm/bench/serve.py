"""``actorlm bench serve``: online serving benchmark against a running OpenAI-compatible server.

Measured as ``vllm bench serve`` measures, so the two compare directly: the prompts come from
one of vLLM's datasets (``bench.datasets``); requests arrive at ``request_rate`` per second
with gamma-distributed gaps (``burstiness`` 1: a Poisson process; ``inf`` sends them all at
once), scaled so the last one arrives at ``num_prompts / request_rate`` seconds; each streams,
and the client times the first chunk (TTFT), the gaps between chunks (ITL) and the last chunk
(E2EL); TPOT is ``(E2EL - TTFT) / (output tokens - 1)``. Token counts come from the server's
usage chunk (``stream_options.include_usage``). The result carries vLLM's key names; goodput
counts the requests that meet every ``--goodput`` objective (DistServe's definition).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp
import numpy as np

from actorlm.bench.datasets import (BUILTIN_OUTPUT_LEN, DatasetOptions, SampleRequest,
                                    load_tokenizer, sample_requests)

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
_TITLES = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
_PROBE_TOKENS = 4


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    metrics = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown or not metrics:
        raise ValueError(f"--percentile-metrics takes a comma-separated list of "
                         f"{', '.join(PERCENTILE_METRICS)}, got {text!r}")
    return metrics


def parse_metric_percentiles(text: str) -> tuple[float, ...]:
    try:
        percentiles = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        percentiles = ()
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in [0, 100], "
                         f"got {text!r}")
    return percentiles


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    objectives = {}
    for pair in pairs or ():
        name, _, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in GOODPUT_METRICS or ms < 0:
            raise ValueError(f"--goodput takes METRIC:MILLISECONDS pairs with a metric of "
                             f"{', '.join(GOODPUT_METRICS)} and a value of at least 0, "
                             f"got {pair!r}")
        objectives[name] = ms
    return objectives


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start: gaps drawn from a gamma
    distribution of shape ``burstiness`` and mean ``1 / request_rate``, then scaled so the
    last arrival falls at ``num_requests / request_rate`` (as vLLM does: without it, the sum
    of the random gaps drifts by a few percent from seed to seed, and so would throughput)."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if burstiness == float("inf"):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        # a stream of its own: drawing prompts from the same seed does not shift the arrivals
        rng = np.random.default_rng([seed, 1])
        gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    return (times * (num_requests / request_rate / times[-1])).tolist()


@dataclasses.dataclass
class RequestOutcome:
    """What the client saw of one request (times in seconds)."""

    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0

    @property
    def tpot(self) -> float:
        """0 for a request of one token, as vLLM counts it for goodput."""
        if self.output_tokens < 2:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def _send(session, url: str, payload: dict, outcome: RequestOutcome) -> RequestOutcome:
    """Streams one request. As in vLLM, every chunk that carries a choice counts as a token
    chunk (the first is TTFT, the others ITL gaps) and the last one ends the request."""
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return outcome
            async for data in _events(response):
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = chunk["error"].get("message", str(chunk["error"]))
                    return outcome
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    last = now
                    num_chunks += 1
                elif chunk.get("usage"):
                    outcome.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    outcome.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # a refused connection, a reset: the request failed
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
    if num_chunks == 0:
        outcome.error = "the stream carried no token"
        return outcome
    outcome.ok, outcome.latency = True, last - start
    outcome.output_tokens = outcome.output_tokens or num_chunks
    return outcome


async def _events(response):
    """The ``data:`` payloads of a server-sent event stream, up to ``[DONE]`` (lines of any
    length: the body is read as it comes and split here)."""
    pending = b""
    async for piece in response.content.iter_any():
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                data = line[len(b"data: "):].rstrip(b"\r")
                if data == b"[DONE]":
                    return
                yield data


def compute_metrics(outcomes: list[RequestOutcome], duration: float,
                    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
                    percentiles: tuple[float, ...] = (99.0,),
                    goodput: dict[str, float] | None = None) -> dict:
    """vLLM's figures of a run that took ``duration`` seconds, under vLLM's key names."""
    done = [o for o in outcomes if o.ok]
    output_lens = [o.output_tokens if o.ok else 0 for o in outcomes]
    total_input = sum(o.prompt_tokens for o in done)
    total_output = sum(output_lens)
    series = {"ttft": [o.ttft for o in done],
              "tpot": [o.tpot for o in done if o.output_tokens > 1],
              "itl": [gap for o in done for gap in o.itl], "e2el": [o.latency for o in done]}
    out = {
        "duration": duration, "duration_s": duration, "completed": len(done),
        "failed": len(outcomes) - len(done), "total_input_tokens": total_input,
        "total_output_tokens": total_output, "request_throughput": len(done) / duration,
        "request_goodput": _num_good(done, goodput) / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [o.prompt_tokens for o in outcomes], "output_lens": output_lens,
    }
    for name in percentile_metrics:
        ms = np.asarray(series[name] or [0.0], dtype=float) * 1000.0  # none: 0, as vLLM's
        out[f"mean_{name}_ms"] = float(ms.mean())
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"p{_percentile_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    errors = [o.error for o in outcomes if not o.ok]
    if errors:
        out["errors"] = sorted(set(errors))[:5]
    return out


def _num_good(done: list[RequestOutcome], goodput: dict[str, float]) -> int:
    def meets(o: RequestOutcome) -> bool:
        values = {"ttft": o.ttft, "tpot": o.tpot, "e2el": o.latency}
        return all(values[name] <= ms / 1000.0 for name, ms in goodput.items())

    return sum(map(meets, done))


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


class ServeBenchmark:
    """One run's settings, checked when built; ``run()`` measures and returns the result."""

    def __init__(self, base_url: str, num_prompts: int, request_rate: float = float("inf"), *,
                 endpoint: str = "/v1/completions", max_tokens: int | None = None,
                 model: str | None = None, max_concurrency: int | None = None, seed: int = 0,
                 ignore_eos: bool = False, dataset: DatasetOptions | None = None,
                 tokenizer: str | None = None, burstiness: float = 1.0,
                 percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
                 metric_percentiles: tuple[float, ...] = (99.0,),
                 goodput: dict[str, float] | None = None):
        self.dataset = dataset or DatasetOptions()
        if num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
        if not request_rate > 0:
            raise ValueError(f"--request-rate must be positive, got {request_rate}")
        if not burstiness > 0:
            raise ValueError(f"--burstiness must be positive, got {burstiness}")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {max_concurrency}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
        if max_tokens is not None and self.dataset.name is not None:
            raise ValueError(f"--max-tokens sizes the built-in prompts; --dataset-name "
                             f"{self.dataset.name} sets the output lengths with its own flags")
        parse_percentile_metrics(",".join(percentile_metrics))
        parse_metric_percentiles(",".join(map(str, metric_percentiles)))
        parse_goodput([f"{name}:{ms}" for name, ms in (goodput or {}).items()])
        self.base_url, self.endpoint = base_url.rstrip("/"), endpoint
        self.is_chat = endpoint.endswith("/chat/completions")
        self.num_prompts, self.request_rate, self.burstiness = num_prompts, request_rate, burstiness
        self.builtin_output_len = max_tokens or BUILTIN_OUTPUT_LEN
        self.model, self.max_concurrency = model, max_concurrency
        self.seed, self.ignore_eos, self.tokenizer = seed, ignore_eos, tokenizer
        self.percentile_metrics, self.metric_percentiles = percentile_metrics, metric_percentiles
        self.goodput = goodput or {}

    def run(self) -> dict:
        return asyncio.run(self._run())

    async def _run(self) -> dict:
        # vLLM's client library: the load generator shares the machine with the server, and
        # aiohttp reads a stream for about half the CPU that httpx takes
        connector = aiohttp.TCPConnector(limit=0)  # no cap: max_concurrency is the cap
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            model, root = await self._served_model(session)
            tokenizer = load_tokenizer(self.tokenizer or root) \
                if self.dataset.needs_tokenizer else None
            requests = sample_requests(self.dataset, self.num_prompts, tokenizer, self.seed,
                                       self.builtin_output_len)
            url = self.base_url + self.endpoint
            probe = await _send(session, url, self._payload(model, requests[0].prompt,
                                                           _PROBE_TOKENS), RequestOutcome())
            if not probe.ok:
                raise RuntimeError(f"the test request to {url} failed: {probe.error}")
            outcomes, duration = await self._measure(session, url, model, requests)
        rate = self.request_rate if self.request_rate != float("inf") else "inf"
        return {"model": model, "endpoint": self.endpoint,
                "dataset_name": self.dataset.name or "builtin", "request_rate": rate,
                "burstiness": self.burstiness, "max_concurrency": self.max_concurrency,
                "max_tokens": None if self.dataset.name else self.builtin_output_len,
                "num_prompts": self.num_prompts,
                **compute_metrics(outcomes, duration, self.percentile_metrics,
                                  self.metric_percentiles, self.goodput)}

    async def _measure(self, session, url: str, model: str,
                       requests: list[SampleRequest]) -> tuple[list[RequestOutcome], float]:
        """Sends every request at its arrival time; their outcomes and the seconds it took."""
        payloads = [self._payload(model, r.prompt, r.expected_output_len) for r in requests]
        arrivals = arrival_times(len(requests), self.request_rate, self.burstiness, self.seed)
        semaphore = asyncio.Semaphore(self.max_concurrency or len(requests))

        async def limited(payload: dict, request: SampleRequest) -> RequestOutcome:
            async with semaphore:  # the request's clock starts once it is sent
                return await _send(session, url, payload,
                                   RequestOutcome(prompt_tokens=request.prompt_len or 0))

        tasks = []
        start = time.perf_counter()
        for payload, request, at in zip(payloads, requests, arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(payload, request)))
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start

    async def _served_model(self, session) -> tuple[str, str]:
        """The model name to send and the directory it was loaded from (``root``)."""
        try:
            async with session.get(self.base_url + "/v1/models",
                                   raise_for_status=True) as response:
                cards = (await response.json())["data"]
        except aiohttp.ClientError as exc:
            raise ValueError(f"--base-url {self.base_url}: no OpenAI-compatible server answers "
                             f"there ({type(exc).__name__}: {exc})") from exc
        card = next((c for c in cards if c["id"] == self.model), cards[0])
        return self.model or card["id"], card.get("root") or card["id"]

    def _payload(self, model: str, prompt: str, max_tokens: int) -> dict:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": self.ignore_eos}
        if self.is_chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


def run_serve_benchmark(base_url: str, num_prompts: int, request_rate: float = float("inf"),
                        **settings) -> dict:
    """One run of ``ServeBenchmark`` (its keyword arguments are the settings)."""
    return ServeBenchmark(base_url, num_prompts, request_rate, **settings).run()


def print_report(result: dict) -> None:
    """The human-readable table, laid out like ``vllm bench serve``'s."""
    rows = [("Successful requests", result["completed"]), ("Failed requests", result["failed"])]
    if result.get("max_concurrency") is not None:
        rows.append(("Maximum request concurrency", result["max_concurrency"]))
    if result.get("request_rate", "inf") != "inf":
        rows.append(("Request rate configured (RPS)", f"{result['request_rate']:.2f}"))
    rows += [("Benchmark duration (s)", f"{result['duration']:.2f}"),
             ("Total input tokens", result["total_input_tokens"]),
             ("Total generated tokens", result["total_output_tokens"]),
             ("Request throughput (req/s)", f"{result['request_throughput']:.2f}")]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
             ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}")]
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    for label, value in rows:
        print(f"{label + ':':<40} {value:<10}")
    for name, (short, title) in _TITLES.items():
        if f"mean_{name}_ms" not in result:
            continue  # not among --percentile-metrics
        print("{s:{c}^50}".format(s=title, c="-"))
        keys = [("Mean", f"mean_{name}_ms"), ("Median", f"median_{name}_ms")] + \
            [(key.split("_")[0].upper(), key) for key in result
             if key.startswith("p") and key.endswith(f"_{name}_ms")]
        for label, key in keys:
            print(f"{f'{label} {short} (ms):':<40} {result[key]:<10.2f}")
    print("=" * 50)
    for error in result.get("errors", []):
        print(f"error: {error}")
