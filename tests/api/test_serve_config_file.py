"""vLLM's ``--config FILE`` (a YAML file of flags, under the command line's) and
``--middleware`` (the operator's own ASGI middleware, a class or an async function): the
parser's reading of a file, and one server started from a file that names two middlewares."""

from __future__ import annotations

import os
import sys

import httpx
import pytest
from api_helpers import SERVED_NAME, openai_client, serving

from actorlm.api.cli import build_parser, main
from actorlm.api.config_file import apply_config_file
from actorlm.api.options import ServerOptions

# an operator's module: a class that stamps every answer, a function that refuses one path
MIDDLEWARE = '''
from starlette.responses import PlainTextResponse


class Stamp:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def stamped(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp", b"yes")]
            await send(message)
        await self.app(scope, receive, stamped)


async def no_trace(request, call_next):
    if request.url.path == "/trace":
        return PlainTextResponse("not here", status_code=403)
    return await call_next(request)
'''


def _serve_args(tmp_path, text: str, *command_line: str):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(config), *command_line])
    apply_config_file(args.command_parser, args.config)
    return parser.parse_args(["serve", "--config", str(config), *command_line])


def test_the_files_settings_apply_where_the_command_line_is_silent(tmp_path):
    args = _serve_args(tmp_path, """
max_model_len: 512
port: 8123
served-model-name: [a, b]
enable-prefix-caching: false
enforce_eager: true
override-generation-config: {temperature: 0.5}
middleware: [m.first, m.second]
""", "--port", "9000")
    assert (args.max_model_len, args.port, args.served_model_name) == (512, 9000, ["a", "b"])
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert args.override_generation_config == '{"temperature": 0.5}'
    assert args.middleware == ["m.first", "m.second"]
    assert build_parser().parse_args(["serve"]).port == 8000  # a fresh parser: no file


@pytest.mark.parametrize("text, said", [
    ("max-modle-len: 512\n", "no flag --max-modle-len"),
    ("- port\n", "a mapping of flag names to values, got list"),
    ("port: [8000\n", "--config .*config.yaml")])
def test_a_file_that_is_not_flags_stops_the_start_naming_it(tmp_path, text, said, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert main(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith("error: --config ")
    with pytest.raises(ValueError, match=said):
        _serve_args(tmp_path, text)


@pytest.mark.parametrize("path, said", [("json.nothing", "cannot import it"),
                                        ("no_such_module.f", "cannot import it"),
                                        ("json.loads", "not an ASGI middleware class")])
def test_middleware_that_is_none_stops_the_start(path, said):
    with pytest.raises(ValueError, match=f"--middleware {path}: {said}"):
        ServerOptions(middleware=(path,))


@pytest.fixture(scope="module")
def configured(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("configured")
    (folder / "operator_middleware.py").write_text(MIDDLEWARE)
    (folder / "config.yaml").write_text(
        f"served_model_name: {SERVED_NAME}\nnum-kv-blocks: 256\n"
        "middleware: [operator_middleware.Stamp, operator_middleware.no_trace]\n")
    path = os.pathsep.join([str(folder), *sys.path])
    with serving(tiny_llama_dir, folder / "server.log", "--config", str(folder / "config.yaml"),
                 env={"PYTHONPATH": path}) as (proc, base):
        yield base
        proc.terminate()
        proc.wait(timeout=20)


def test_a_server_from_a_file_runs_its_middleware(configured):
    base = configured
    assert httpx.get(base + "/health", timeout=10).headers["x-stamp"] == "yes"
    refused = httpx.get(base + "/trace", timeout=10)
    assert (refused.status_code, refused.text) == (403, "not here")
    with openai_client(base) as client:  # the served name came from the file
        stream = client.chat.completions.with_raw_response.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        assert stream.headers["x-stamp"] == "yes"
        chunks = list(stream.parse())
    assert sum(len(c.choices[0].delta.content or "") > 0 for c in chunks if c.choices) >= 1
    assert chunks[-1].choices[0].finish_reason == "length"
