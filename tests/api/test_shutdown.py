"""Graceful stop of ``actorlm serve``, run as a subprocess and stopped by signal.

On SIGTERM or SIGINT the server stops accepting, lets running requests finish for
``--shutdown-timeout`` seconds, then fails the rest (a stream ends with an error event and
``data: [DONE]``, a plain request with an error response) and exits 0, at most a couple of
seconds later.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_helpers import read_events, serving

from actorlm.bench.abuse import scrape

SHUTDOWN_TIMEOUT = 2.0
EXIT_MARGIN = 2.0  # the process must be gone this long after the grace period
# once its first chunk is out, a short request has at most three steps left: it finishes
# within the grace period even on a busy machine (steps then take up to ~100 ms here)
SHORT = {"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
# the tiny model decodes up to ~200 tokens/s here, its 512 tokens of context in ~2.5 s: too
# close to the grace period, so the long requests run on the copy with a longer context
LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}


def _wait_running(base_url: str, num_running: int) -> None:
    deadline = time.monotonic() + 30
    while scrape(base_url)["vllm:num_requests_running"] < num_running:
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.05)


def _check_shutdown_error(body: dict) -> None:
    error = body["error"]  # OpenAI's shape; 503: the client may retry elsewhere
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == 503 and "shutting down" in error["message"], error


def test_sigterm_finishes_short_requests_and_ends_long_ones(tiny_llama_long_dir, tmp_path):
    flags = ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--max-num-seqs", "32",
             "--num-kv-blocks", "4096"]
    # the pool outside: a failing test kills the server first, which ends every client
    with ThreadPoolExecutor(17) as pool, \
            serving(tiny_llama_long_dir, tmp_path / "server.log", *flags) as (proc, base):
        # a non-streaming request first, running before the streams start
        plain = pool.submit(httpx.post, base + "/v1/completions", json=LONG, timeout=30)
        _wait_running(base, 1)
        bodies = [SHORT] * 8 + [LONG] * 8
        started = [threading.Event() for _ in bodies]
        streams = [pool.submit(read_events, base, "/v1/completions", body, event)
                   for body, event in zip(bodies, started)]
        for event in started:
            assert event.wait(60), "a stream produced no first chunk"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=SHUTDOWN_TIMEOUT + EXIT_MARGIN) == 0
        # the grace period was honoured: the long requests ran on until it was over
        assert time.monotonic() - signalled >= SHUTDOWN_TIMEOUT
        results = [future.result(timeout=5) for future in streams]  # raises if dropped

    for events in results[:8]:  # finished within the grace period, as usual
        assert events[-1] == "[DONE]"
        assert not any('"error"' in event for event in events), events[-2:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    for events in results[8:]:  # ended by the shutdown: an error event, then [DONE]
        assert events[-1] == "[DONE]"
        assert len(events) > 3, "the stream did not run before the shutdown"
        _check_shutdown_error(json.loads(events[-2]))
        assert all("choices" in json.loads(event) for event in events[:-2])
    response = plain.result()
    _check_shutdown_error(response.json())
    assert response.status_code == response.json()["error"]["code"]


def test_sigint_stops_an_idle_server_at_once(tiny_llama_dir, tmp_path):
    # a grace period far longer than a loaded machine takes to stop the engine core (several
    # seconds while other tests run): gone well before it, the server did not wait it out
    grace = 60.0
    with serving(tiny_llama_dir, tmp_path / "server.log",
                 "--shutdown-timeout", str(grace)) as (proc, base):
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=grace / 4) == 0  # no grace period to wait out
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health", timeout=2)
