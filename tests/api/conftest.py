"""A real server for the API tests: ``actorlm serve`` on the tiny Llama, in a subprocess.

The server runs in its own process (its own GIL: two cores serve and drive load in parallel)
on a free port of 127.0.0.1, once per session; tests talk to it over HTTP only.
"""

from __future__ import annotations

import pytest
from api_helpers import SERVED_NAME, serving


@pytest.fixture(scope="session")
def server_process(tiny_llama_dir, tmp_path_factory):
    """(base URL, log file) of a running server; the log is printed if start-up fails."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with serving(tiny_llama_dir, log_path, "--num-kv-blocks", "1024", "--max-num-seqs", "128",
                 "--served-model-name", SERVED_NAME, "--log-stats-interval", "1") as (proc, base):
        yield base, log_path
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="session")
def server(server_process) -> str:
    return server_process[0]


@pytest.fixture(scope="session")
def client(server):
    import openai

    with openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c
