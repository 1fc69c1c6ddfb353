"""The ``actorlm`` command: generate, serve, the clients of a running server (``chat``,
``complete``: ``api/client_cli.py``), and the commands of ``bench`` (``bench/cli.py``) and
``trace`` (``trace/cli.py``)."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from actorlm.api.client_cli import add_client_commands
from actorlm.api.config_file import apply_config_file
from actorlm.api.flags import add_engine_flags, engine_flags
from actorlm.api.lora_models import lora_module
from actorlm.api.options import ServerOptions, add_server_flags
from actorlm.bench.cli import add_bench_commands
from actorlm.trace.cli import add_trace_commands


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM serve flags that ask for nothing this server does otherwise (noted in the log when given)
NOTHING_TO_DO = {
    "--trust-remote-code": "no code from a model's repository runs here, only its config, "
                           "tokenizer and weights are read",
    "--enforce-eager": "no CUDA graphs are captured here",
    "--disable-log-requests": "requests are logged one by one only with "
                              "--enable-log-requests (the trace has them)",
    "--enable-request-id-headers": "every answer carries X-Request-Id (the client's, or one "
                                   "made here)",
    "--enable-server-load-tracking": "/load always counts the requests in progress",
    "--enable-prompt-tokens-details": "usage.prompt_tokens_details.cached_tokens (the prompt "
                                      "tokens the prefix cache served) is always reported, as "
                                      "OpenAI's API reports it",
}
# vLLM serve flags with a value: (type, the value this server runs, why); the value is
# accepted (noted in the log), any other stops the start naming the flag
ONE_VALUE = {
    "--swap-space": (float, None, "preempted requests are recomputed, as in vLLM V1: nothing "
                                  "is swapped"),
    "--max-seq-len-to-capture": (int, None, "no CUDA graphs are captured here"),
    "--pipeline-parallel-size": (int, 1, "pipeline parallelism is not implemented (the layers "
                                         "split by --tensor-parallel-size)"),
    "--cpu-offload-gb": (float, 0.0, "weights are not offloaded (on a CPU they are there "
                                     "already)"),
}

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "config", None):  # the file's settings under the command line's
            apply_config_file(args.command_parser, args.config)
            args = parser.parse_args(argv)
        return args.run(args) or 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: each command's flags come from its own builder below."""
    parser = argparse.ArgumentParser(prog="actorlm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands)
    _add_serve(commands)
    add_client_commands(commands)
    add_bench_commands(commands)
    add_trace_commands(commands)
    return parser


def _add_generate(commands) -> None:
    """``actorlm generate``."""
    gen = commands.add_parser("generate", help="generate completions for prompts")
    add_engine_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(run=_generate)


def _add_serve(commands) -> None:
    """``actorlm serve``: vLLM's serve flags that apply here."""
    srv = commands.add_parser("serve", help="the OpenAI-compatible HTTP server")
    # vLLM's form, ``vllm serve MODEL``, as well as --model
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="HF directory or .gguf file (the same as --model)")
    add_engine_flags(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model name(s) clients use; answers carry the first (default: "
                          "the model directory's name)")
    srv.add_argument("--max-num-waiting", type=int, default=None,
                     help="answer 503 while this many requests already wait (default: no limit)")
    srv.add_argument("--log-stats-interval", type=float, default=10.0,
                     help="seconds between the periodic stats lines while busy")
    srv.add_argument("--disable-log-stats", action="store_true",
                     help="no periodic stats lines (/metrics still counts)")
    srv.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                     help="the HTTP server's own log level")
    for flag, why in NOTHING_TO_DO.items():
        srv.add_argument(flag, action="store_true", help=f"accepted for vLLM's scripts: {why}")
    for flag, (kind, value, why) in ONE_VALUE.items():
        only = "" if value is None else f" as {value:g}"
        srv.add_argument(flag, type=kind, default=None,
                         help=f"accepted for vLLM's scripts{only}: {why}")
    srv.add_argument("--guided-decoding-backend", choices=("auto", "xgrammar"), default=None,
                     help="accepted for vLLM's scripts: structured outputs run on xgrammar "
                          "(other backends are refused)")
    srv.add_argument("--trace-file", default=None,
                     help="also write the engine trace there as JSON lines (see /trace)")
    srv.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="SECONDS",
                     help="on SIGTERM or SIGINT, let running requests finish for this long, "
                          "then end them with an error (streams with an error event and [DONE])")
    srv.add_argument("--lora-modules", nargs="+", type=lora_module, default=[],
                     metavar="NAME=PATH",
                     help="LoRA adapters served by name (needs --enable-lora): name=path, or "
                          "vLLM's JSON {\"name\": ..., \"path\": ..., \"base_model_name\": "
                          "...}; a request picks one with its model field")
    add_server_flags(srv)
    srv.add_argument("--config", default=None, metavar="FILE",
                     help="a YAML file of flag names and values (vLLM's): they apply where the "
                          "command line does not set the flag")
    srv.set_defaults(run=_serve, command_parser=srv)


def _generate(args) -> int:
    from actorlm.llm import LLM
    from actorlm.sampling_params import SamplingParams

    with LLM(args.model, **engine_flags(args)) as llm:
        # the model's other sampling defaults (top_p, top_k, ...) apply under the flags
        params = SamplingParams(**{**llm.engine.sampling_defaults.values,
                                   "max_tokens": args.max_tokens,
                                   "temperature": args.temperature})
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                               use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        print(f"--- {prompt}\n{output.outputs[0].text}")
    return 0


def _serve(args) -> int:
    from actorlm.api.launcher import serve

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models: {args.model_tag} and --model {args.model} (give one)")
    model = args.model if args.model_tag is None else args.model_tag  # ("" is not the default)
    for flag, why in NOTHING_TO_DO.items():
        if getattr(args, flag[2:].replace("-", "_")):
            log.info("%s: nothing to do (%s)", flag, why)
    for flag, (_, value, why) in ONE_VALUE.items():
        given = getattr(args, flag[2:].replace("-", "_"))
        if given is not None and value is not None and given != value:
            raise ValueError(f"{flag} {given:g}: {why}")
        if given is not None:
            log.info("%s %g: nothing to do (%s)", flag, given, why)
    if args.guided_decoding_backend is not None:
        log.info("--guided-decoding-backend %s: nothing to do (structured outputs run on "
                 "xgrammar)", args.guided_decoding_backend)
    options = ServerOptions.from_args(args)
    flags = engine_flags(args)
    reasoning = options.reasoning_parser_for(args.reasoning_parser)
    if reasoning != args.reasoning_parser:
        log.info("--tool-call-parser %s: --reasoning-parser %s (its calls are harmony "
                 "messages)", options.tool_call_parser, reasoning)
        flags["reasoning_parser"] = reasoning
    status = serve(model, flags, host=args.host, port=args.port,
                   served_model_name=args.served_model_name,
                   max_num_waiting=args.max_num_waiting,
                   log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
                   uvicorn_log_level=args.uvicorn_log_level, trace_file=args.trace_file,
                   shutdown_timeout=args.shutdown_timeout, options=options,
                   lora_modules=args.lora_modules)
    # the process ends now: spare it the interpreter's final collection over torch's and
    # transformers' objects (over a second), which would stretch a graceful stop
    gc.freeze()
    return status


if __name__ == "__main__":
    sys.exit(main())
