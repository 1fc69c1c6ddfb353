"""A real server for the API tests: ``actorlm serve`` on the tiny Llama, in a subprocess.

The server runs in its own process (its own GIL: two cores serve and drive load in parallel)
on a free port of 127.0.0.1, once per session; tests talk to it over HTTP only.
"""

from __future__ import annotations

import pytest
from api_helpers import SERVED_NAME, serving

# the server behind a key: one from --api-key, one from the environment
API_KEY, ENV_API_KEY = "sk-flag-0123456789abcdef", "sk-env-fedcba9876543210"
ORIGIN = "https://app.example"


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


@pytest.fixture(scope="session")
def guarded_process(tiny_llama_dir, tmp_path_factory):
    """(process, base URL, log file) of a server with API keys, CORS for ORIGIN, a one-second
    client timeout and a 64-token context (so that generated requests stay short)."""
    log_path = tmp_path_factory.mktemp("guarded") / "server.log"
    with serving(tiny_llama_dir, log_path, "--api-key", API_KEY, "--allowed-origins", ORIGIN,
                 "--client-timeout", "1", "--max-model-len", "64", "--num-kv-blocks", "512",
                 "--max-num-seqs", "64", "--served-model-name", SERVED_NAME,
                 env={"ACTORLM_API_KEY": ENV_API_KEY}) as (proc, base):
        yield proc, base, log_path
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="session")
def guarded(guarded_process) -> str:
    return guarded_process[1]
