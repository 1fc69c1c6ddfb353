"""The server's Prometheus metrics: the engine's (``actorlm.engine_metrics``: vLLM's names, read
from the engine's actors at scrape time and observed as outputs reach the event loop, where
``AsyncLLM`` calls the listener methods) and the process's memory and CPU from /proc.
``StatsLogger`` writes vLLM's periodic INFO line while the server has work and sleeps on an
event while it has none.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import ProcessCollector, generate_latest

from actorlm.engine_metrics import RequestMetrics

log = logging.getLogger(__name__)


class ServerMetrics(RequestMetrics):
    """Every metric the server exports; also the ``stats_listener`` of its AsyncLLM."""

    def __init__(self, model_name: str, get_engine=lambda: None):
        super().__init__(model_name, lambda: _read(get_engine()))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, as vLLM has
        self.activity = asyncio.Event()  # set while there is work: wakes the stats logger

    def on_request_added(self, num_prompt_tokens: int) -> None:
        super().on_request_added(num_prompt_tokens)
        self.activity.set()

    def render(self) -> bytes:
        """The exposition text (blocking: reads engine stats)."""
        return generate_latest(self.registry)


def _read(engine):
    """(config, each replica's stats) of the AsyncLLM ``engine``, or None while it does not
    serve."""
    if engine is None or engine.check_health() is not None:
        return None
    try:
        return engine.config, engine.replica_stats()
    except Exception:  # an actor stopped between the check and the ask
        return None


class StatsLogger:
    """Logs running / waiting / KV usage / generation throughput every ``interval`` seconds
    while the server has work; sleeps on ``metrics.activity`` while it has none."""

    def __init__(self, get_engine, metrics: ServerMetrics, interval: float = 10.0):
        self.get_engine, self.metrics, self.interval = get_engine, metrics, interval

    async def run(self) -> None:
        last_tokens, last_time = 0, time.monotonic()
        while True:
            if self.metrics.num_unfinished == 0:
                self.metrics.activity.clear()
                await self.metrics.activity.wait()
                engine = self.get_engine()
                last_tokens = engine.num_generation_tokens if engine else 0
                last_time = time.monotonic()
            await asyncio.sleep(self.interval)
            engine = self.get_engine()
            if engine is None or engine.check_health() is not None:
                continue
            try:
                stats = await engine.get_stats()
            except Exception:  # the engine is going away; the health check will tell
                continue
            now = time.monotonic()
            rate = (stats["num_generation_tokens"] - last_tokens) / max(now - last_time, 1e-9)
            last_tokens, last_time = stats["num_generation_tokens"], now
            log.info("Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                     "Avg generation throughput: %.1f tokens/s", stats["num_running"],
                     stats["num_waiting"], 100.0 * stats["kv_cache_usage"], rate)
