"""Readiness, overload, a fatal fault and the stats log, on servers run in this process."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_helpers import running, wait_healthy
from processes import NEVER_LOADS, live_children

from actorlm.api.server import create_app
from actorlm.async_llm import AsyncLLM

FLAGS = dict(dtype="float32", num_kv_blocks=128)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    return error


def _events(response: httpx.Response) -> list:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_503_until_ready_then_fatal_fault(tiny_llama_dir):
    release = threading.Event()

    def build():
        release.wait(30)
        return AsyncLLM(str(tiny_llama_dir), **FLAGS)

    app = create_app(build, served_model_name="tiny")
    with running(app) as base:
        assert "loading" in _error(httpx.get(base + "/health"), 503)["message"]
        _error(httpx.post(base + "/v1/completions", json={"prompt": "Hi"}), 503)
        _error(httpx.get(base + "/v1/models"), 503)
        release.set()
        wait_healthy(base, 60)
        engine = app.state.actorlm.engine
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True}
        answers = []
        plain = threading.Thread(target=lambda: answers.append(
            httpx.post(base + "/v1/completions", json=body, timeout=30)))
        # a stream the engine's death left open would end in a read timeout, not [DONE]
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                          timeout=httpx.Timeout(30, read=10)) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            plain.start()
            while not engine.stats()["num_running"] == 2:
                time.sleep(0.005)
            engine.engine.scheduler.tell("no handler knows this")  # the scheduler raises
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]  # the error event, then [DONE]
        assert error["code"] == 500 and "scheduler" in error["message"]
        plain.join(5)
        assert "scheduler" in _error(answers[0], 500)["message"]
        assert "scheduler" in _error(httpx.get(base + "/health"), 503)["message"]
        _error(httpx.post(base + "/v1/completions", json={"prompt": "Hi"}), 503)


def test_a_server_stopped_while_its_core_loads_stops_the_load(tiny_llama_dir, monkeypatch):
    # a large model loads for minutes: the stop must not wait for it
    from actorlm.engine_core import client

    monkeypatch.setattr(client, "_BOOT", NEVER_LOADS)
    cancel, built = threading.Event(), threading.Event()

    def build():
        try:
            return AsyncLLM(str(tiny_llama_dir), engine_core_process=True, cancel_load=cancel,
                            **FLAGS)
        finally:
            built.set()

    with running(create_app(build, cancel_load=cancel)) as base:
        while not live_children("engine_core", "actorlm::engine-core"):
            time.sleep(0.05)
        assert "loading" in _error(httpx.get(base + "/health"), 503)["message"]
    assert cancel.is_set() and built.wait(5)
    assert live_children("engine_core", "actorlm::engine-core") == []


def test_max_num_waiting_answers_503(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), max_num_seqs=1, max_num_waiting=1, **FLAGS)
    try:
        with running(create_app(engine)) as base:
            name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            assert name == tiny_llama_dir.name  # the default served name
            body = {"model": name, "prompt": "Once upon a time", "max_tokens": 5}
            long = dict(body, max_tokens=490, ignore_eos=True, stream=True)
            with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=base, timeout=60) as http:
                with http.stream("POST", "/v1/completions", json=long) as first:
                    lines = first.iter_lines()  # kept: closing it would hang up
                    next(lines)  # its first token: it holds the one seat
                    second = pool.submit(httpx.post, base + "/v1/completions", json=body,
                                         timeout=60)
                    deadline = time.monotonic() + 10
                    while engine.stats()["num_waiting"] < 1:
                        assert time.monotonic() < deadline, "the second request never queued"
                        time.sleep(0.01)
                    refused = http.post("/v1/completions", json=body)
                # the first's client hung up: its request is aborted, the second gets the seat
                assert second.result().status_code == 200
        assert "overloaded" in _error(refused, 503)["message"]
        assert int(refused.headers["Retry-After"]) >= 1
    finally:
        engine.shutdown()


def test_periodic_stats_line(tiny_llama_dir, caplog):
    engine = AsyncLLM(str(tiny_llama_dir), **FLAGS)
    app = create_app(engine, log_stats_interval=0.2)
    try:
        with caplog.at_level(logging.INFO, logger="actorlm.api.metrics"):
            with running(app) as base:
                body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}
                response = httpx.post(base + "/v1/completions", json=body, timeout=30)
                assert response.status_code == 200
                deadline = time.monotonic() + 5
                while not any("Running:" in r.message for r in caplog.records):
                    assert time.monotonic() < deadline, "no stats line"
                    time.sleep(0.05)
                line = next(r.message for r in caplog.records if "Running:" in r.message)
                assert "Waiting:" in line and "KV cache usage" in line and "tokens/s" in line
                # idle: the logger parks on its event instead of logging; it alone clears the
                # event (a new request sets it), and only on its way to waiting for it
                activity = app.state.actorlm.metrics.activity
                deadline = time.monotonic() + 5
                while activity.is_set():
                    assert time.monotonic() < deadline, "the stats logger never went idle"
                    time.sleep(0.02)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_client_that_hangs_up_aborts(tiny_llama_dir, path):
    engine = AsyncLLM(str(tiny_llama_dir), **FLAGS)
    try:
        with running(create_app(engine)) as base:
            body = {"max_tokens": 490, "ignore_eos": True}
            body.update({"prompt": "Once upon a time"} if "chat" not in path else
                        {"messages": [{"role": "user", "content": "Hi"}]})
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base + path, json=body, timeout=httpx.Timeout(30, read=0.1))
            deadline = time.monotonic() + 2
            while (stats := engine.stats())["num_running"] or \
                    stats["num_free_blocks"] != stats["num_total_blocks"]:
                assert time.monotonic() < deadline, stats
                time.sleep(0.02)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("argv, model", [
    (["serve", "path/to/model"], "path/to/model"),  # vLLM's ``vllm serve MODEL``
    (["serve", "--model", "path/to/model"], "path/to/model"),
    (["serve", "path/to/model", "--model", "path/to/model"], "path/to/model"),
    (["serve"], None),  # the default model
    (["serve", ""], ""),  # refused as --model "" is, not taken for the default
])
def test_serve_takes_the_model_as_vllm_does(argv, model, monkeypatch):
    from actorlm.api import cli, launcher

    served = []
    monkeypatch.setattr(launcher, "serve", lambda model, *args, **kwargs: served.append(model))
    monkeypatch.setattr(cli.gc, "freeze", lambda: None)  # (it would freeze this test process)
    assert cli.main(argv) == 0
    assert served == [model]


def test_serve_refuses_two_different_models(capsys):
    from actorlm.api import cli

    assert cli.main(["serve", "a", "--model", "b"]) == 2
    assert "error: two models: a and --model b (give one)" in capsys.readouterr().err


def test_vllms_logging_and_compatibility_flags(tiny_llama_dir, tmp_path, capsys):
    """``--disable-log-stats`` (no stats lines, however short the interval),
    ``--uvicorn-log-level``, and vLLM's flags that ask for nothing here, each noted once in the
    log; an interval that would spin is refused."""
    from api_helpers import serving

    from actorlm.api import cli

    log_path = tmp_path / "server.log"
    flags = ("--trust-remote-code", "--enforce-eager", "--disable-log-stats",
             "--log-stats-interval", "0.1", "--uvicorn-log-level", "warning")
    with serving(tiny_llama_dir, log_path, *flags) as (proc, base):
        for _ in range(3):
            httpx.post(base + "/v1/completions", timeout=30,
                       json={"prompt": "Once upon a time", "max_tokens": 32})
        proc.terminate()
        proc.wait(timeout=30)
    text = log_path.read_text()
    assert "--trust-remote-code: nothing to do (no code from a model's repository" in text
    assert "--enforce-eager: nothing to do (no CUDA graphs" in text
    assert "Running:" not in text and "Uvicorn running on" not in text
    assert "serving" in text  # (the server's own lines stay)
    assert cli.main(["serve", "--log-stats-interval", "0"]) == 2
    assert "--log-stats-interval must be above 0 seconds" in capsys.readouterr().err
