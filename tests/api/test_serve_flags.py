"""vLLM's serve flags a deployment script passes, on one server: HTTPS (--ssl-keyfile,
--ssl-certfile), --max-logprobs, --return-tokens-as-token-ids, --response-role, and the flags
that ask for what this server already does (--enable-prompt-tokens-details, --swap-space,
--pipeline-parallel-size 1) or leave out a log line (--disable-uvicorn-access-log); driven by
the official openai client over TLS. A value the server does not run stops the start."""

from __future__ import annotations

import subprocess

import httpx
import pytest
from api_helpers import SERVED_NAME, serving

from actorlm.api.cli import build_parser, main
from actorlm.api.flags import engine_flags
from actorlm.api.options import ServerOptions

MAX_LOGPROBS = 30


@pytest.fixture(scope="module")
def tls_server(tiny_llama_dir, tmp_path_factory):
    """(base URL, certificate, log file) of a server on HTTPS with a self-signed certificate."""
    where = tmp_path_factory.mktemp("tls")
    key, cert, log_path = where / "key.pem", where / "cert.pem", where / "server.log"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    with serving(tiny_llama_dir, log_path, "--served-model-name", SERVED_NAME,
                 "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                 "--max-logprobs", str(MAX_LOGPROBS), "--return-tokens-as-token-ids",
                 "--response-role", "bot", "--enable-prompt-tokens-details",
                 "--disable-uvicorn-access-log", "--swap-space", "4",
                 "--pipeline-parallel-size", "1", "--guided-decoding-backend", "xgrammar",
                 "--num-kv-blocks", "256",
                 https_cert=str(cert)) as (proc, base):
        yield base, str(cert), log_path
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def tls_client(tls_server):
    import openai

    base, cert, _ = tls_server
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60,
                       http_client=httpx.Client(verify=cert)) as client:
        yield client


def _chat(client, **kw):
    return client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Say something."}],
        max_tokens=3, temperature=0.0, **kw)


def test_https_serves_and_plain_http_is_refused(tls_server, tls_client):
    base, _, log_path = tls_server
    assert tls_client.models.list().data[0].id == SERVED_NAME
    with pytest.raises(httpx.TransportError):
        httpx.get(base.replace("https://", "http://") + "/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(base + "/health", timeout=5)  # (the system's CAs do not know it)
    # no access-log line per request, and the no-op flag said why it has nothing to do
    log = log_path.read_text()
    assert '"GET /v1/models HTTP/1.1" 200' not in log
    assert "--enable-prompt-tokens-details: nothing to do" in log
    assert "--swap-space 4: nothing to do" in log
    assert "--pipeline-parallel-size 1: nothing to do" in log
    assert "--guided-decoding-backend xgrammar: nothing to do" in log


def test_logprobs_up_to_the_servers_cap_and_tokens_as_their_ids(tls_client):
    answer = _chat(tls_client, logprobs=True, top_logprobs=MAX_LOGPROBS)
    positions = answer.choices[0].logprobs.content
    assert len(positions) == 3 and all(len(lp.top_logprobs) == MAX_LOGPROBS for lp in positions)
    assert all(lp.token.startswith("token_id:") and int(lp.token[9:]) >= 0 for lp in positions)
    assert answer.usage.prompt_tokens_details.cached_tokens >= 0
    # a request may ask for its tokens' text instead
    texts = _chat(tls_client, logprobs=True, top_logprobs=1,
                  extra_body={"return_tokens_as_token_ids": False}).choices[0]
    assert "".join(lp.token for lp in texts.logprobs.content) == texts.message.content
    completion = tls_client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=2,
                                               logprobs=2, temperature=0.0)
    assert all(t.startswith("token_id:") for t in completion.choices[0].logprobs.tokens)
    import openai
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_LOGPROBS}") as refused:
        _chat(tls_client, logprobs=True, top_logprobs=MAX_LOGPROBS + 1)
    assert refused.value.body["param"] == "top_logprobs"


def test_the_answer_carries_the_servers_role_unless_it_continues_a_message(tls_client):
    assert _chat(tls_client).choices[0].message.role == "bot"
    chunks = list(tls_client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        stream=True))
    assert chunks[0].choices[0].delta.role == "bot"
    continued = tls_client.chat.completions.create(
        model=SERVED_NAME, max_tokens=2, messages=[{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Well"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert continued.choices[0].message.role == "assistant"


@pytest.mark.parametrize("fields, said", [
    ({"ssl_keyfile": "/nonexistent.pem", "ssl_certfile": "/nonexistent.pem"},
     "--ssl-keyfile: no such file"),
    ({"ssl_certfile": "/etc/hostname"}, "go together"),
    ({"response_role": " "}, "--response-role must not be empty"),
])
def test_bad_values_stop_the_start_naming_the_flag(fields, said):
    with pytest.raises(ValueError, match=said):
        ServerOptions(**fields)


@pytest.mark.parametrize("flag, value, said", [
    ("--pipeline-parallel-size", "2", "pipeline parallelism is not implemented"),
    ("--cpu-offload-gb", "4", "weights are not offloaded")])
def test_a_vllm_value_this_server_does_not_run_stops_the_start(flag, value, said, capsys):
    assert main(["serve", flag, value]) == 2
    assert f"{flag} {value}: {said}" in capsys.readouterr().err


def test_another_structured_outputs_backend_stops_the_start(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--guided-decoding-backend", "outlines"])
    assert stop.value.code == 2
    assert "--guided-decoding-backend: invalid choice: 'outlines'" in capsys.readouterr().err


@pytest.mark.parametrize("value, count", [("4096", 4096), ("32k", 32_000), ("32K", 32_768),
                                          ("25.6k", 25_600), ("1M", 1_048_576)])
def test_lengths_take_vllms_human_readable_counts(value, count):
    args = build_parser().parse_args(["serve", "--max-model-len", value,
                                      "--max-num-batched-tokens", value])
    assert engine_flags(args)["max_model_len"] == count
    assert engine_flags(args)["max_num_batched_tokens"] == count


@pytest.mark.parametrize("value", ["1.5K", "2.5", "0.0005k", "lots"])
def test_a_count_that_is_none_stops_the_start_naming_it(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", value])
    assert f"argument --max-model-len: {value!r} is not a count" in capsys.readouterr().err
