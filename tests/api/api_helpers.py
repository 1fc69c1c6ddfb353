"""Helpers shared by the API tests: ports, readiness, servers in a subprocess, SSE, /metrics."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import uvicorn

from actorlm.api.connection import GuardedH11Protocol

SERVED_NAME = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float, proc: subprocess.Popen | None = None,
                 verify: bool | str = True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not healthy after {timeout} s")


@contextlib.contextmanager
def serving(model_dir, log_path, *flags: str, env: dict[str, str] | None = None,
            https_cert: str | None = None):
    """(process, base URL) of ``actorlm serve`` on ``model_dir`` (``https_cert``: over HTTPS,
    the server's certificate); the log is printed if the block fails, and the process is
    killed if it is still running at the end."""
    port = free_port()
    cmd = [sys.executable, "-m", "actorlm.api.cli", "serve", "--model", str(model_dir),
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"{'https' if https_cert else 'http'}://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, 120, proc, https_cert or True)
        yield proc, base_url
    except BaseException:
        print(log_path.read_text()[-5000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@contextlib.contextmanager
def openai_client(base_url: str):
    """The official client on a server, without retries (a test sees every refusal)."""
    import openai

    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def rss_bytes(pid: int) -> int:
    """The resident memory of a process now."""
    with open(f"/proc/{pid}/status") as status:
        kib = next(line.split()[1] for line in status if line.startswith("VmRSS:"))
    return int(kib) * 1024


@contextlib.contextmanager
def running(app, client_timeout: float = 10.0):
    """``app`` under uvicorn (with actorlm's connections, as ``actorlm serve`` runs it) on a
    free port, in a thread; stopped (lifespan and all) on exit."""
    port = free_port()
    protocol = functools.partial(GuardedH11Protocol, client_timeout=client_timeout)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=protocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def read_events(base_url: str, path: str, body: dict,
                started: threading.Event | None = None) -> list[str]:
    """The data of each event of one streaming request (comments skipped); ``started`` is set at the first (or
    when the request fails, so that nobody waits for it). A dropped connection raises."""
    events, pending = [], b""
    try:
        with httpx.stream("POST", base_url + path, json={**body, "stream": True},
                          timeout=120) as response:
            assert response.status_code == 200, response.read()
            # split on the blank line, not with iter_lines: that also splits at U+2028 and
            # friends, which the random model emits and JSON leaves unescaped
            for chunk in response.iter_bytes():
                *complete, pending = (pending + chunk).split(b"\n\n")
                for event in complete:
                    if event.startswith(b":"):  # a comment (keep-alive): SSE skips it
                        continue
                    assert event.startswith(b"data: "), event
                    events.append(event[len(b"data: "):].decode())
                    if started is not None:
                        started.set()
    finally:
        if started is not None:
            started.set()
    assert pending == b"", f"the stream ended inside an event: {pending!r}"
    return events
