"""Engine flags on the command line, derived from EngineConfig so the two never drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import decimal
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
    "kv_cache_dtype": "what the KV cache stores: auto (the model's dtype), fp8 (E4M3, as "
                      "vLLM's), fp8_e4m3 or fp8_e5m2 (one byte a value)",
    "reasoning_parser": f"split chat answers' think (<think>...</think>, or the model's own "
                        f"tags) into reasoning_content, and constrain only what follows it: "
                        f"{', '.join(REASONING_PARSERS)}",
}


# flags that take vLLM's human-readable counts: 32k (32,000), 1.5m, 32K (32,768), 1M
_HUMAN_COUNTS = ("max_model_len", "max_num_batched_tokens")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def human_count(text: str) -> int:
    """vLLM's human-readable integer: a plain one, or a number and a suffix, k/m/g decimal
    (``25.6k`` is 25,600) or K/M/G binary (whole numbers only: ``32K`` is 32,768)."""
    try:
        if text[-1:] in _DECIMAL:
            value = decimal.Decimal(text[:-1]) * _DECIMAL[text[-1]]
            if not value.is_finite() or value != int(value):
                raise ValueError
            return int(value)
        if text[-1:] in _BINARY:
            return int(text[:-1]) * _BINARY[text[-1]]
        return int(text)
    except (ValueError, decimal.InvalidOperation):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count (an integer, or one with k/m/g or K/M/G: 32k, 32K)") \
            from None


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
            kind = human_count if field.name in _HUMAN_COUNTS else \
                int if int in kinds else float if float in kinds else str
            parser.add_argument(flag, type=kind, default=None, help=help_text)


def engine_flags(args: argparse.Namespace) -> dict:
    """The engine flags the user set (others keep EngineConfig's defaults)."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
