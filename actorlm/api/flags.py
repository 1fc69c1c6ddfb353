"""Engine flags on the command line, derived from EngineConfig so the two never drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from actorlm.config import EngineConfig


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        flag, hint = "--" + field.name.replace("_", "-"), hints[field.name]
        if hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kinds = {hint, *typing.get_args(hint)}
            kind = int if int in kinds else float if float in kinds else str
            parser.add_argument(flag, type=kind, default=None)


def engine_flags(args: argparse.Namespace) -> dict:
    """The engine flags the user set (others keep EngineConfig's defaults)."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "model"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
