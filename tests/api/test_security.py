"""Who may use the server: API keys, the Host check, CORS, JSON-only routes, X-Request-Id."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from api_helpers import SERVED_NAME
from conftest import API_KEY, ENV_API_KEY, ORIGIN

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 2}
CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
PROTECTED = [("POST", "/v1/completions", CMPL), ("POST", "/v1/chat/completions", CHAT),
             ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "Hi"}),
             ("POST", "/detokenize", {"tokens": [5, 6]}), ("GET", "/trace.json", None),
             ("POST", "/invocations", CHAT)]
WRONG = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
         {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"},
         {"Authorization": f"Bearer {API_KEY[:-1]}"}, {"Authorization": "Bearer"}]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
def test_routes_need_a_key(guarded, method, path, body):
    for headers in WRONG:
        response = httpx.request(method, guarded + path, json=body, headers=headers, timeout=30)
        assert "API key" in _error(response, 401)["message"], headers
        assert response.headers["WWW-Authenticate"] == "Bearer"
    for key in (API_KEY, ENV_API_KEY):  # from --api-key, from ACTORLM_API_KEY
        response = httpx.request(method, guarded + path, json=body, timeout=30,
                                 headers={"Authorization": f"bearer {key}"})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/health", "/ping", "/version", "/metrics", "/openapi.json"])
def test_open_routes_need_no_key(guarded, path):
    assert httpx.get(guarded + path, timeout=30).status_code == 200


def test_openai_client_with_and_without_the_key(guarded):
    with openai.OpenAI(base_url=guarded + "/v1", api_key=API_KEY, max_retries=0) as client:
        out = client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens >= 1
    with openai.OpenAI(base_url=guarded + "/v1", api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=SERVED_NAME, max_tokens=2,
                                           messages=[{"role": "user", "content": "Hi"}])


def test_keys_never_reach_the_log(guarded_process):
    _, base, log_path = guarded_process
    for headers in (AUTH, {"Authorization": f"Bearer {ENV_API_KEY}"}, {"Authorization": "x"}):
        httpx.post(base + "/v1/completions", json=CMPL, headers=headers, timeout=30)
    text = log_path.read_text()
    assert "POST /v1/completions" in text  # the access log is there, the keys are not
    assert API_KEY not in text and ENV_API_KEY not in text


@pytest.mark.parametrize("host,status", [("127.0.0.1:{port}", 200), ("localhost", 200),
                                         ("LOCALHOST:{port}", 200), ("[::1]:{port}", 200),
                                         ("rebind.attacker.example", 400),
                                         ("rebind.attacker.example:{port}", 400),
                                         ("127.0.0.1.attacker.example", 400)])
def test_host_header_checked_on_loopback(guarded, host, status):
    port = guarded.rsplit(":", 1)[1]
    response = httpx.get(guarded + "/health", headers={"Host": host.format(port=port)})
    if status == 200:
        assert response.status_code == 200, response.text
    else:
        assert "Host" in _error(response, status)["message"]


def test_cors_for_the_allowed_origin_only(guarded):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(guarded + "/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200
    assert ok.headers["Access-Control-Allow-Origin"] == ORIGIN
    foreign = httpx.options(guarded + "/v1/completions",
                            headers={"Origin": "https://evil.example", **preflight})
    assert foreign.status_code == 400
    assert "access-control-allow-origin" not in foreign.headers
    # the answer itself carries the headers a page needs to read it, errors included
    answer = httpx.post(guarded + "/v1/completions", json=CMPL, headers={"Origin": ORIGIN})
    assert answer.status_code == 401
    assert answer.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "x-request-id" in answer.headers["Access-Control-Expose-Headers"].lower()


def test_no_cors_by_default(server):
    preflight = httpx.options(server + "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405
    answer = httpx.post(server + "/v1/completions", json=CMPL, headers={"Origin": ORIGIN},
                        timeout=30)
    assert answer.status_code == 200
    assert not any(h.startswith("access-control-") for h in answer.headers)


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml"])
def test_json_routes_take_json_only(server, content_type):
    # what a page on any site may POST without a CORS preflight
    import json

    response = httpx.post(server + "/v1/completions", content=json.dumps(CMPL),
                          headers={"Content-Type": content_type, "Origin": "https://evil.example"})
    assert "Content-Type" in _error(response, 415)["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_content_types_accepted(server, content_type):
    import json

    response = httpx.post(server + "/v1/completions", content=json.dumps(CMPL),
                          headers={"Content-Type": content_type}, timeout=30)
    assert response.status_code == 200, response.text


def test_request_id_honoured_and_echoed(guarded):
    headers = {**AUTH, "X-Request-Id": "trace-42"}
    cmpl = httpx.post(guarded + "/v1/completions", json=CMPL, headers=headers, timeout=30)
    assert cmpl.headers["X-Request-Id"] == "trace-42"
    assert cmpl.json()["id"] == "cmpl-trace-42"
    chat = httpx.post(guarded + "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers=headers, timeout=30)
    assert chat.headers["X-Request-Id"] == "trace-42"
    assert '"id":"chatcmpl-trace-42"' in chat.text
    # without one the server makes one, and answers carry it, errors too
    plain = httpx.post(guarded + "/v1/completions", json=CMPL, headers=AUTH, timeout=30)
    assert plain.json()["id"] == "cmpl-" + plain.headers["X-Request-Id"]
    refused = httpx.get(guarded + "/v1/models")
    assert len(refused.headers["X-Request-Id"]) == 32
    assert httpx.get(guarded + "/health", headers={"X-Request-Id": "h"}).headers[
        "X-Request-Id"] == "h"


def test_clients_reusing_a_request_id_do_not_collide(guarded):
    # the engine's ids stay unique: both run, and each gets its own answer
    body = {**CMPL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=guarded, timeout=60,
                                     headers={**AUTH, "X-Request-Id": "same"}) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body)
                                          for _ in range(8)))

    answers = asyncio.run(main())
    assert [r.status_code for r in answers] == [200] * 8
    assert {r.json()["id"] for r in answers} == {"cmpl-same"}
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in answers)


@pytest.mark.parametrize("value", ["x" * 129, "has space", "tab\tinside"])
def test_malformed_request_id_refused(guarded, value):
    response = httpx.get(guarded + "/health", headers={"X-Request-Id": value})
    assert _error(response, 400)["param"] == "X-Request-Id"
