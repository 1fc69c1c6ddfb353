"""Engine flags on the command line, derived from EngineConfig so the two never drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from actorlm.config import EngineConfig
from actorlm.reasoning import REASONING_PARSERS

_HELP = {
    "tokenizer": "a tokenizer's directory in place of the model's (e.g. a GGUF file's base "
                 "model's, with its chat template)",
    "generation_config": "sampling defaults for the fields a request leaves out: auto (the "
                         "model's generation_config.json), vllm (vLLM's own), or a directory "
                         "holding a generation_config.json (default: auto)",
    "override_generation_config": "JSON of sampling fields set over those, under the "
                                  "generation config's names (e.g. '{\"temperature\": 0.5}')",
    "revision": "with a Hub repository id as the model: its branch, tag or commit in the "
                "local Hugging Face cache (models are never downloaded)",
    "download_dir": "with a Hub repository id as the model: the Hugging Face cache holding it "
                    "(default: $HF_HUB_CACHE)",
    "long_prefill_token_threshold": "the most prompt tokens one request prefills in a step, so "
                                    "that a long prompt leaves room for the others' (default: "
                                    "0, no limit but the step's token budget)",
    "reasoning_parser": f"split chat answers' <think>...</think> into reasoning_content, and "
                        f"constrain only what follows it: {', '.join(REASONING_PARSERS)}",
}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        flag, hint = "--" + field.name.replace("_", "-"), hints[field.name]
        help_text = _HELP.get(field.name)
        if hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            kinds = {hint, *typing.get_args(hint)}
            kind = int if int in kinds else float if float in kinds else str
            parser.add_argument(flag, type=kind, default=None, help=help_text)


def engine_flags(args: argparse.Namespace) -> dict:
    """The engine flags the user set (others keep EngineConfig's defaults)."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
