"""LoRA adapters through ``actorlm serve``, driven by the ``openai`` client: adapters from
``--lora-modules`` are listed with their parent and picked by ``model`` (completions and chat,
streamed or not, each request the tokens offline ``LLM.generate(lora_request=)`` gives); with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` one is loaded, used, unloaded, then a 404; an unknown name
is a 404 and a malformed directory a 400 naming what is wrong, in OpenAI's shape, and the
server keeps serving; ``vllm:lora_requests_info`` follows the adapters running and waiting."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from api_helpers import SERVED_NAME, openai_client, serving

from actorlm import LLM, LoRARequest, SamplingParams
from actorlm.api.cli import main
from actorlm.api.server import create_app

PROMPT = "Once upon a time there was a small village"
CHAT = [{"role": "user", "content": "Tell me about the baker."}]
NUM_TOKENS = 12
MAX_LORAS = 2
LONG = 8000  # tokens (of an 8192-token context): a request that runs until it is cancelled


@pytest.fixture(scope="module")
def lora_server(tiny_llama_long_dir, tiny_llama_adapters, tmp_path_factory):
    """A server with alpha (name=path) and beta (vLLM's JSON) from the start, runtime updating
    on, and room for three long requests."""
    log_path = tmp_path_factory.mktemp("lora") / "server.log"
    beta = json.dumps({"name": "beta", "path": str(tiny_llama_adapters["beta"]),
                       "base_model_name": SERVED_NAME})
    with serving(tiny_llama_long_dir, log_path, "--served-model-name", SERVED_NAME,
                 "--num-kv-blocks", "1600", "--enable-lora", "--max-loras", str(MAX_LORAS),
                 "--max-lora-rank", "16", "--lora-modules",
                 f"alpha={tiny_llama_adapters['alpha']}", beta,
                 env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as (proc, base):
        yield base
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(lora_server):
    with openai_client(lora_server) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama_long_dir, tiny_llama_adapters):
    """name -> the greedy tokens of PROMPT's completion and of the chat answer offline, each
    as (its text alone, its logprob) as the server reports them; "base": no adapter."""
    loras = {name: LoRARequest(name, i, str(path))
             for i, (name, path) in enumerate(sorted(tiny_llama_adapters.items()), 1)}
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    with LLM(str(tiny_llama_long_dir), enable_lora=True, max_loras=4, max_lora_rank=16,
             dtype="float32") as llm:
        chat_ids = {"prompt_token_ids": llm.apply_chat_template(CHAT)}
        names = ["base", *loras]
        outputs = llm.generate([PROMPT] * len(names) + [chat_ids] * len(names), params,
                               use_tqdm=False, lora_request=[loras.get(n) for n in names] * 2)
    tokens = [[(lp[t].decoded_token, lp[t].logprob)
               for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
              for o in outputs]
    return {name: (tokens[i], tokens[len(names) + i]) for i, name in enumerate(names)}


def _complete(client, model: str, stream: bool = False) -> list[tuple[str, float]]:
    """The greedy tokens of PROMPT's completion: (text, logprob) each."""
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0.0,
                  logprobs=0, extra_body={"ignore_eos": True})
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    else:
        chunks = [client.completions.create(**kwargs)]
    assert {c.model for c in chunks} == {model}  # the answer names the adapter, as vLLM's
    return [pair for c in chunks for pair in zip(c.choices[0].logprobs.tokens,
                                                 c.choices[0].logprobs.token_logprobs)]


def _chat(client, model: str, stream: bool = False) -> list[tuple[str, float]]:
    """The greedy tokens of the chat answer: (text, logprob) each."""
    kwargs = dict(model=model, messages=CHAT, max_tokens=NUM_TOKENS, temperature=0.0,
                  logprobs=True, top_logprobs=0, extra_body={"ignore_eos": True})
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs)
                  if c.choices and c.choices[0].logprobs]
    else:
        chunks = [client.chat.completions.create(**kwargs)]
    assert {c.model for c in chunks} == {model}
    return [(t.token, t.logprob) for c in chunks for t in c.choices[0].logprobs.content]


def _assert_same_tokens(got: list[tuple[str, float]], expected: list[tuple[str, float]]):
    assert [text for text, _ in got] == [text for text, _ in expected]
    # tokens of one text (the lone bytes of byte-level BPE) are told apart by their logprobs
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-3)


def _assert_error(reply: httpx.Response, status: int, error_type: str, *words: str) -> str:
    """OpenAI's error shape with this status and type; the message holds ``words``."""
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["type"] == error_type
    for word in words:
        assert word in body["error"]["message"], body["error"]["message"]
    return body["error"]["message"]


def _load(base: str, name: str, path, **extra) -> httpx.Response:
    return httpx.post(base + "/v1/load_lora_adapter",
                      json={"lora_name": name, "lora_path": str(path), **extra}, timeout=60)


def _unload(base: str, name: str) -> httpx.Response:
    return httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def _models(base: str) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(base + "/v1/models").json()["data"]}


def test_adapters_are_listed_with_their_parent(lora_server, client, tiny_llama_adapters):
    cards = {model.id: model.model_dump() for model in client.models.list()}
    assert list(cards) == [SERVED_NAME, "alpha", "beta"]
    assert cards[SERVED_NAME]["parent"] is None
    for name in ("alpha", "beta"):
        assert cards[name]["parent"] == SERVED_NAME
        assert cards[name]["root"] == str(tiny_llama_adapters[name])


def test_model_picks_the_adapter_and_gives_the_offline_tokens(client, offline):
    # the adapters change the output, so matching each is not matching the base model's
    assert len({json.dumps(completion) for completion, _ in offline.values()}) == len(offline)
    for name in ("alpha", "beta", SERVED_NAME):
        completion, chat = offline["base" if name == SERVED_NAME else name]
        _assert_same_tokens(_complete(client, name), completion)
        _assert_same_tokens(_complete(client, name, stream=True), completion)
        _assert_same_tokens(_chat(client, name), chat)
        _assert_same_tokens(_chat(client, name, stream=True), chat)


def test_an_adapter_is_loaded_used_and_unloaded_at_run_time(lora_server, client, offline,
                                                            tiny_llama_adapters):
    gamma = tiny_llama_adapters["gamma"]
    reply = _load(lora_server, "gamma", gamma)
    assert reply.status_code == 200 and reply.text == \
        "Success: LoRA adapter 'gamma' added successfully."
    assert _models(lora_server)["gamma"]["parent"] == SERVED_NAME
    _assert_same_tokens(_complete(client, "gamma"), offline["gamma"][0])
    _assert_error(_load(lora_server, "gamma", gamma), 400, "InvalidUserInput",
                  "'gamma' has already been loaded")

    reply = _unload(lora_server, "gamma")
    assert reply.status_code == 200 and reply.text == \
        "Success: LoRA adapter 'gamma' removed successfully."
    assert "gamma" not in _models(lora_server)
    with pytest.raises(openai.NotFoundError) as raised:
        _complete(client, "gamma")
    assert raised.value.body["message"] == "The model `gamma` does not exist."
    _assert_error(_unload(lora_server, "gamma"), 404, "NotFoundError",
                  "The lora adapter 'gamma' cannot be found.")

    # loaded again (a new id, in place of the old one's), it serves the same adapter
    assert _load(lora_server, "gamma", gamma).status_code == 200
    assert _load(lora_server, "gamma", gamma, load_inplace=True).status_code == 200
    _assert_same_tokens(_complete(client, "gamma", stream=True), offline["gamma"][0])
    assert _unload(lora_server, "gamma").status_code == 200


def test_an_unknown_model_is_a_404_in_openais_shape(lora_server, client):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        reply = httpx.post(lora_server + path, json={"model": "delta", "max_tokens": 2, **body})
        _assert_error(reply, 404, "NotFoundError", "The model `delta` does not exist.")
        assert reply.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="delta", messages=CHAT, stream=True)


def test_a_malformed_adapter_is_a_400_naming_what_is_wrong(lora_server, client, offline,
                                                          tiny_llama_adapters, tmp_path):
    empty_config = tmp_path / "empty_config"
    empty_config.mkdir()
    (empty_config / "adapter_config.json").write_text("{}")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(
        (tiny_llama_adapters["alpha"] / "adapter_config.json").read_text())
    _assert_error(_load(lora_server, "broken", empty_config), 400, "BadRequestError",
                  "adapter_config.json", "r must be a positive number")
    _assert_error(_load(lora_server, "broken", no_weights), 400, "BadRequestError",
                  "no adapter_model.safetensors")
    _assert_error(_load(lora_server, "broken", tmp_path / "nowhere"), 404, "NotFoundError",
                  "No adapter found")
    _assert_error(_load(lora_server, "", empty_config), 400, "InvalidUserInput",
                  "Both 'lora_name' and 'lora_path' must be provided.")
    _assert_error(_load(lora_server, SERVED_NAME, tiny_llama_adapters["gamma"]), 400,
                  "InvalidUserInput", "served base model")
    assert "broken" not in _models(lora_server)
    # and the engine keeps serving, adapters and base model alike
    assert httpx.get(lora_server + "/health").status_code == 200
    _assert_same_tokens(_complete(client, "alpha"), offline["alpha"][0])
    _assert_same_tokens(_complete(client, SERVED_NAME), offline["base"][0])


def _lora_info(base: str) -> dict[str, str]:
    """The labels of vllm:lora_requests_info (its one sample), checking its value is now."""
    metrics = httpx.get(base + "/metrics").text
    found = re.findall(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", metrics, re.M)
    assert len(found) == 1, metrics
    labels, value = found[0]
    assert abs(float(value) - time.time()) < 60  # a wall-clock timestamp, as vLLM's
    return dict(re.findall(r'(\w+)="([^"]*)"', labels))


def _wait_for_info(base: str, running: str, waiting: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (info := _lora_info(base)) != {"max_lora": str(MAX_LORAS), "running_lora_adapters":
                                         running, "waiting_lora_adapters": waiting}:
        assert time.monotonic() < deadline, f"still {info}, not running {running!r}, " \
                                            f"waiting {waiting!r}"
        time.sleep(0.05)


def test_lora_requests_info_follows_the_adapters_running_and_waiting(lora_server,
                                                                     tiny_llama_adapters):
    assert _load(lora_server, "gamma", tiny_llama_adapters["gamma"]).status_code == 200
    _wait_for_info(lora_server, "", "")

    async def hold(client, model: str, started: asyncio.Event) -> None:
        stream = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=LONG, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True})
        async with stream:  # cancelled: the connection closes, and the request is aborted
            async for _ in stream:
                started.set()

    async def scenario() -> None:
        async with openai.AsyncOpenAI(base_url=lora_server + "/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            tasks, started = {}, {}
            try:
                for name in ("alpha", "beta"):
                    started[name] = asyncio.Event()
                    tasks[name] = asyncio.create_task(hold(client, name, started[name]))
                    await asyncio.wait_for(started[name].wait(), 60)
                await asyncio.to_thread(_wait_for_info, lora_server, "alpha,beta", "")
                # a third adapter waits: a step holds --max-loras 2
                started["gamma"] = asyncio.Event()
                tasks["gamma"] = asyncio.create_task(hold(client, "gamma", started["gamma"]))
                await asyncio.to_thread(_wait_for_info, lora_server, "alpha,beta", "gamma")
                assert not started["gamma"].is_set()
                tasks["alpha"].cancel()  # its slot frees, and gamma gets in
                await asyncio.wait_for(started["gamma"].wait(), 60)
                await asyncio.to_thread(_wait_for_info, lora_server, "beta,gamma", "")
            finally:
                for task in tasks.values():
                    task.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)

    asyncio.run(scenario())
    _wait_for_info(lora_server, "", "")
    assert _unload(lora_server, "gamma").status_code == 200


def test_the_runtime_routes_exist_only_behind_vllms_switch(monkeypatch):
    from starlette.testclient import TestClient

    def paths() -> set[str]:
        return {route.path for route in create_app(lambda: None).routes}

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert "/v1/load_lora_adapter" not in paths()
    reply = TestClient(create_app(lambda: None), base_url="http://127.0.0.1").post(
        "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/"})
    _assert_error(reply, 404, "NotFoundError")  # an unknown route, as vLLM's without it
    for value, expected in (("0", False), ("false", False), ("1", True), ("TRUE", True)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert ({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths()) is expected


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "alpha=/a"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "alpha=/a", "alpha=/b"],
     "--lora-modules names 'alpha' more than once"),
    (["--enable-lora", "--lora-modules", "alpha"], "expected name=path or a JSON object"),
    (["--enable-lora", "--lora-modules", '{"name": "alpha"}'], '"path"'),
    (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/a", "rank": 4}'], '"path"'),
    (["--enable-lora", "--lora-modules", "{nope"], "not valid JSON"),
])
def test_bad_lora_modules_are_refused_before_the_model_loads(flags, message, capsys):
    try:
        status = main(["serve", "--model", "/nonexistent", *flags])
    except SystemExit as exit_:  # argparse's refusal
        status = exit_.code
    assert status == 2
    assert message in capsys.readouterr().err
