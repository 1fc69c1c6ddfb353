"""A real server for the API tests: ``actorlm serve`` on the tiny Llama, in a subprocess.

The server runs in its own process (its own GIL: two cores serve and drive load in parallel)
on a free port of 127.0.0.1, once per session; tests talk to it over HTTP only.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from api_helpers import SERVED_NAME, free_port, wait_healthy


@pytest.fixture(scope="session")
def server_process(tiny_llama_dir, tmp_path_factory):
    """(base URL, log file) of a running server; the log is printed if start-up fails."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "actorlm.api.cli", "serve", "--model", str(tiny_llama_dir),
           "--dtype", "float32", "--num-kv-blocks", "1024", "--max-num-seqs", "128",
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
           "--log-stats-interval", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, 120, proc)
    except Exception:
        proc.kill()
        proc.wait()
        print(log_path.read_text()[-5000:])
        raise
    yield base_url, log_path
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def server(server_process) -> str:
    return server_process[0]


@pytest.fixture(scope="session")
def client(server):
    import openai

    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c
