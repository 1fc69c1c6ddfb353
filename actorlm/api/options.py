"""What the operator decides about who may talk to the server and how much: ``ServerOptions``.

Validated when built, with messages that name the flag to change; ``add_server_flags`` puts
them on the command line, and ``ServerOptions.from_args`` reads them back (API keys also come
from ``ACTORLM_API_KEY`` or vLLM's ``VLLM_API_KEY``, which keeps them out of ``ps``).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import pathlib

from actorlm.api.tool_parsers import PARSERS
from actorlm.api.user_middleware import user_middleware
from actorlm.chat_content import CONTENT_FORMATS, check_content_format

_HARMONY = "openai_gptoss"  # the reasoning parser of GPT-OSS's harmony format

API_KEY_ENV_VARS = ("ACTORLM_API_KEY", "VLLM_API_KEY")
LOCAL_HOST_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    api_keys: tuple[str, ...] = ()
    # a long prompt (the whole context) or a batch of token ids fits in a few MiB
    max_request_body_bytes: int = 4 * 1024 * 1024
    # how long a client may take to send a request's headers, and the longest pause in its body
    client_timeout: float = 10.0
    allowed_origins: tuple[str, ...] = ()  # none: no CORS headers at all
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides the local ones
    trust_request_chat_template: bool = False
    chat_template: str | None = None  # the server's, in place of the model's (--chat-template)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": read calls out of free text
    tool_call_parser: str | None = None  # how (a name in tool_parsers.PARSERS)
    host: str = "127.0.0.1"  # the address the server is bound to
    response_role: str = "assistant"  # the role of chat answers (vLLM's --response-role)
    # logprobs' tokens as vLLM's "token_id:<id>" (a token's text may not be valid UTF-8 on
    # its own); a request's return_tokens_as_token_ids decides for itself
    return_tokens_as_token_ids: bool = False
    ssl_keyfile: str | None = None  # HTTPS, with this key and the certificate below
    ssl_certfile: str | None = None
    access_log: bool = True  # uvicorn's line per request
    # the prefix a proxy serves the routes under, stripping it (vLLM's --root-path)
    root_path: str = ""
    # every stream ends with a usage chunk, as if it asked (stream_options.include_usage)
    force_include_usage: bool = False
    openapi: bool = True  # /openapi.json served (vLLM's --disable-fastapi-docs turns it off)
    log_requests: bool = False  # a line per request (request_log), and per answer
    log_outputs: bool = False
    max_log_len: int | None = None  # the characters or ids of a prompt or answer logged
    # a message's content as the chat template reads it (chat_content: auto, string, openai)
    chat_template_content_format: str = "auto"
    middleware: tuple[str, ...] = ()  # the operator's own, by import path (user_middleware)
    # a stream's chunks each carry this many new tokens at least (vLLM's --stream-interval:
    # fewer, larger writes), but its first and its last; a request may ask for more
    stream_interval: int = 1

    def __post_init__(self):
        for key in self.api_keys:
            if not key or key != key.strip() or any(c.isspace() for c in key):
                raise ValueError("--api-key: a key must be non-empty and contain no whitespace")
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes must be at least 1024, "
                             f"got {self.max_request_body_bytes}")
        if not self.client_timeout > 0:  # also refuses nan
            raise ValueError(f"--client-timeout must be above 0 seconds, got {self.client_timeout}")
        if "*" in self.allowed_origins and len(self.allowed_origins) > 1:
            raise ValueError("--allowed-origins: '*' already allows every origin; give it alone")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser: unknown parser {self.tool_call_parser!r} "
                             f"(known: {', '.join(PARSERS)})")
        if self.chat_template is not None:
            _check_template(self.chat_template)
        if not self.response_role.strip():
            raise ValueError("--response-role must not be empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-certfile", self.ssl_certfile)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file: {path}")
        if self.root_path and (not self.root_path.startswith("/") or
                               self.root_path.endswith("/")):
            raise ValueError(f"--root-path: a path such as /api (a leading slash, no trailing "
                             f"one), got {self.root_path!r}")
        check_content_format(self.chat_template_content_format, "--chat-template-content-format")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) \
                or self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be a positive integer, got "
                             f"{self.stream_interval!r}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be at least 0, got {self.max_log_len}")
        for path in self.middleware:
            user_middleware(path)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (which format "
                             "the model writes its calls in)")

    def reasoning_parser_for(self, given: str | None) -> str | None:
        """The reasoning parser the server runs, ``given`` that of the flags: GPT-OSS's calls
        (``--tool-call-parser openai``) are harmony messages, which the harmony parser alone
        keeps apart, so that one is implied (vLLM's gpt-oss serving always splits them)."""
        if self.tool_call_parser is None or not PARSERS[self.tool_call_parser].reads_harmony:
            return given
        if given not in (None, _HARMONY):
            raise ValueError(f"--tool-call-parser {self.tool_call_parser} reads GPT-OSS's "
                             f"harmony messages: it needs --reasoning-parser {_HARMONY}, not "
                             f"{given}")
        return _HARMONY

    @property
    def binds_loopback(self) -> bool:
        return _is_loopback(self.host)

    @property
    def checks_host(self) -> bool:
        """Bound to loopback, a browser page can reach the server only by DNS rebinding, which
        shows in the Host header; elsewhere, only when the operator lists the names."""
        return bool(self.allowed_hosts) or self.binds_loopback

    def host_names(self) -> frozenset[str]:
        return frozenset(n.lower() for n in (*LOCAL_HOST_NAMES, self.host, *self.allowed_hosts))

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ=os.environ) -> ServerOptions:
        keys = list(args.api_key or [])
        keys += [environ[name] for name in API_KEY_ENV_VARS if environ.get(name)]
        return cls(api_keys=tuple(dict.fromkeys(keys)),
                   max_request_body_bytes=args.max_request_body_bytes,
                   client_timeout=args.client_timeout,
                   allowed_origins=tuple(args.allowed_origins or ()),
                   allowed_methods=tuple(args.allowed_methods or ("*",)),
                   allowed_headers=tuple(args.allowed_headers or ("*",)),
                   allowed_hosts=tuple(args.allowed_hosts or ()),
                   trust_request_chat_template=args.trust_request_chat_template,
                   chat_template=read_chat_template(args.chat_template),
                   enable_auto_tool_choice=args.enable_auto_tool_choice,
                   tool_call_parser=args.tool_call_parser,
                   host=args.host, response_role=args.response_role,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                   access_log=not args.disable_uvicorn_access_log,
                   root_path=args.root_path,
                   force_include_usage=args.enable_force_include_usage,
                   openapi=not args.disable_fastapi_docs,
                   log_requests=args.enable_log_requests, log_outputs=args.enable_log_outputs,
                   max_log_len=args.max_log_len,
                   chat_template_content_format=args.chat_template_content_format,
                   middleware=tuple(args.middleware or ()),
                   stream_interval=args.stream_interval)


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template: the file it names, or the template itself (as vLLM
    reads the flag); a name of no file that holds no template markup is refused as the
    missing file it most likely is."""
    if value is None:
        return None
    try:
        path = pathlib.Path(value)
        if path.is_file():
            return path.read_text()
    except (OSError, ValueError):  # a template too long, or too odd, to be a path
        pass
    if not any(mark in value for mark in ("{{", "{%")):
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def _check_template(template: str) -> None:
    """Compile the template as transformers will, so that a broken one stops the start."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: not a valid Jinja template: {exc.message} "
                         f"(line {exc.lineno})") from None


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: resolved by the operator's resolver, not ours to guess
        return False


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    defaults = ServerOptions()
    parser.add_argument("--api-key", action="append", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health, "
                             "/version, /metrics and /openapi.json (repeatable; also from "
                             "ACTORLM_API_KEY or VLLM_API_KEY, which ps does not show)")
    parser.add_argument("--max-request-body-bytes", type=int,
                        default=defaults.max_request_body_bytes,
                        help="refuse larger request bodies with 413 before reading them")
    parser.add_argument("--client-timeout", type=float, default=defaults.client_timeout,
                        metavar="SECONDS",
                        help="close connections whose request headers take longer than this, "
                             "or whose body pauses longer (408)")
    parser.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                        help="answer CORS for these origins ('*' for any); default: no CORS")
    parser.add_argument("--allowed-methods", nargs="+", metavar="METHOD",
                        help="methods CORS allows (default: *)")
    parser.add_argument("--allowed-headers", nargs="+", metavar="HEADER",
                        help="request headers CORS allows (default: *)")
    parser.add_argument("--allowed-hosts", nargs="+", metavar="NAME",
                        help="Host names accepted besides localhost and the bound address "
                             "(checked when bound to loopback, or whenever this is given)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat template (a Jinja program the "
                             "server runs); refused by default")
    parser.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                        help="the chat template for chat requests in place of the model's: a "
                             "file holding a Jinja template, or the template itself")
    parser.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS,
                        default=defaults.chat_template_content_format,
                        help="hand the template each message's content as a string (text parts "
                             "joined by newlines) or as OpenAI's list of parts; auto: the form "
                             "the template reads (a list where it loops over the content)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice 'auto' (the default when a request has tools): "
                             "calls are read out of the model's text with --tool-call-parser")
    parser.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                        help="the format the model writes tool calls in, by its vLLM name: "
                             "hermes (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1/3.2), "
                             "mistral (Mistral, Ministral, Mistral Small), pythonic (Llama 3.2), "
                             "llama4_pythonic, granite (Granite 3.x), phi4_mini_json, "
                             "qwen3_coder (Qwen3-Coder), seed_oss, deepseek_v3, deepseek_v31, "
                             "kimi_k2, glm45, internlm, hunyuan_a13b, jamba, minimax, ernie45, "
                             "longcat, olmo3 (each model's own)")
    parser.add_argument("--response-role", default=defaults.response_role, metavar="ROLE",
                        help="the role chat answers carry when the request adds the generation "
                             "prompt (default: assistant)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="write logprobs' tokens as 'token_id:<id>' (a request's "
                             "return_tokens_as_token_ids decides for itself)")
    parser.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                        help="serve HTTPS with this private key (and --ssl-certfile)")
    parser.add_argument("--ssl-certfile", default=None, metavar="FILE",
                        help="serve HTTPS with this certificate (and --ssl-keyfile)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no log line per HTTP request")
    parser.add_argument("--root-path", default="", metavar="PATH",
                        help="the prefix a proxy serves the routes under and strips before "
                             "forwarding (the OpenAPI document names it as its server)")
    parser.add_argument("--enable-force-include-usage", action="store_true",
                        help="end every stream with a usage chunk, as if it had asked "
                             "(stream_options.include_usage)")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="do not serve /openapi.json (vLLM's name for the flag)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each completions or chat request's prompt, token ids and "
                             "sampling parameters")
    parser.add_argument("--enable-log-outputs", action="store_true",
                        help="log each finished answer's text, token ids and finish reason")
    parser.add_argument("--max-log-len", type=int, default=None, metavar="N",
                        help="log at most N characters or token ids of each (default: all)")
    parser.add_argument("--stream-interval", type=int, default=defaults.stream_interval,
                        metavar="N",
                        help="send a stream's tokens N at a time (its first and last chunks at "
                             "once; a request's stream_interval may raise it): fewer writes "
                             "per token (default: 1, each token)")
    parser.add_argument("--middleware", action="append", metavar="MODULE.NAME",
                        help="wrap the server in this ASGI middleware class or async "
                             "(request, call_next) function; repeatable, the first outermost")
