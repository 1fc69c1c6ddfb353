"""vLLM's metrics of one engine, on a Prometheus registry of their own (not the global one):
the server's ``/metrics`` (``api/metrics.py``) and the offline ``LLM.get_metrics()``.

Gauges (running, waiting, KV usage, the LoRA adapters running and waiting) and the
preemption, prefix-cache, speculative-decoding, worker- and engine-core-restart counters are
read from the engine's actors when the registry is read (``EngineCollector``), one sample per
data-parallel replica (vLLM's ``engine`` label); latencies and token counts are observed by
``RequestMetrics``'s listener methods as requests' outputs come (``metrics_reader`` reads a
registry back as records).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def with_kv_usage(stats: dict) -> dict:
    total, free = stats["num_total_blocks"], stats["num_free_blocks"]
    return {**stats, "kv_cache_usage": (total - free) / total if total else 0.0}


class EngineCollector:
    """Scrape-time values of an engine: ``read()`` gives its config and each data-parallel
    replica's stats (blocking asks: scrape off an event loop), or None when there is no engine
    to read (not yet loaded, dead, stopping)."""

    def __init__(self, read: Callable[[], tuple[Any, list[dict]] | None], model_name: str):
        self.read, self.model_name = read, model_name

    def collect(self):
        read = self.read()
        if read is None:
            return
        config, replicas = read
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        labels = ["model_name", "engine"]  # vLLM's: the data-parallel replica's index
        for family, name, doc, key in (
                (gauge, "vllm:num_requests_running",
                 "Number of requests in model execution batches.", "num_running"),
                (gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 "num_waiting"),
                (gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 "kv_cache_usage"),
                (counter, "vllm:num_preemptions", "Cumulative number of preemptions.",
                 "num_preemptions"),
                (counter, "vllm:prefix_cache_queries",
                 "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
                (counter, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 "prefix_cache_hits"),
                (counter, "vllm:spec_decode_num_drafts",
                 "Verifications of speculative drafts (a request's drafts in one step).",
                 "spec_num_drafts"),
                (counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                 "spec_num_draft_tokens"),
                (counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 "spec_num_accepted_tokens"),
                (counter, "actorlm:engine_requests_finished",
                 "Requests (sequences) this engine core has finished.", "num_finished"),
                (counter, "actorlm:worker_restarts", "Workers replaced after a fault or a death.",
                 "num_worker_restarts"),
                (counter, "actorlm:engine_core_restarts",
                 "Engine-core processes restarted after a death, their requests resumed.",
                 "num_engine_core_restarts")):
            metric = family(name, doc, labels=labels)
            for index, stats in enumerate(replicas):
                metric.add_metric([self.model_name, str(index)], stats[key])
            yield metric
        # blocks held per KV-cache group: a sliding-window group's stay near its window
        held = GaugeMetricFamily("actorlm:kv_cache_group_blocks",
                                 "KV blocks held by requests, per KV-cache group.",
                                 labels=labels + ["kv_cache_group", "window"])
        for index, stats in enumerate(replicas):
            for group, (window, blocks) in enumerate(zip(stats["kv_cache_windows"],
                                                         stats["num_used_blocks_per_group"])):
                held.add_metric([self.model_name, str(index), str(group),
                                 "full" if window is None else str(window)], blocks)
        yield held
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, per position among a step's drafts.",
            labels=labels + ["position"])
        for index, stats in enumerate(replicas):
            for position, count in enumerate(stats["spec_accepted_per_position"]):
                per_position.add_metric([self.model_name, str(index), str(position)], count)
        yield per_position
        if config.enable_lora:
            yield lora_requests_info(replicas, config.max_loras)
        yield cache_config_info(config)


def cache_config_info(config) -> GaugeMetricFamily:
    """vLLM's ``vllm:cache_config_info``: the KV cache's settings as the labels of a gauge of
    one (its pool as ``num_gpu_blocks``, vLLM's name on every device)."""
    fields = {"block_size": config.block_size, "cache_dtype": config.kv_cache_dtype,
              "enable_prefix_caching": config.enable_prefix_caching,
              "num_gpu_blocks": config.num_kv_blocks}
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                             labels=list(fields))
    info.add_metric([str(value) for value in fields.values()], 1)
    return info


def lora_requests_info(replicas: list[dict], max_loras: int) -> GaugeMetricFamily:
    """vLLM's ``vllm:lora_requests_info``: the adapters running and waiting, by name, joined
    with commas in its labels, and the wall-clock time as its value (readers take the sample
    with the latest time). vLLM sets it every step on a labelled gauge, so each set of
    adapters it ever saw stays exposed with its last time; read at scrape time here, only the
    current set is."""
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "waiting_lora_adapters",
                                     "running_lora_adapters"])
    running = sorted(set().union(*(stats["running_lora_adapters"] for stats in replicas)))
    waiting = sorted(set().union(*(stats["waiting_lora_adapters"] for stats in replicas)))
    info.add_metric([str(max_loras), ",".join(waiting), ",".join(running)], time.time())
    return info


class RequestMetrics:
    """The engine's metrics: its collector's, and the latencies and token counts of its
    requests, which the listener methods below observe."""

    def __init__(self, model_name: str, read: Callable[[], tuple[Any, list[dict]] | None]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.registry.register(EngineCollector(read, model_name))
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", labels,
                             buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", labels,
                                         registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Count of finished requests.",
                               labels + ["finished_reason"], registry=r)
        self.num_unfinished = 0

    # --- the listener: AsyncLLM's (on the event loop) or the LLM's -------------------------------

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.num_unfinished += 1

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def add_generation_tokens(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def observe_finished(self, reason: str, e2e_seconds: float, tpot_seconds: float | None) -> None:
        self.num_unfinished = max(0, self.num_unfinished - 1)
        self.success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e_seconds)
        if tpot_seconds is not None:
            self.tpot.observe(tpot_seconds)
