"""vLLM's ``--config FILE``: a YAML mapping of flag names (``max-model-len`` or
``max_model_len``) to values, which become the command's defaults, so that a flag given on the
command line wins. ``true`` sets a switch, ``false`` clears one (``--no-...``, where the flag
has that form), a list gives a flag several values, and a mapping is passed as its JSON
(``override-generation-config: {temperature: 0.5}``). A name no flag has is an error naming
the file."""

from __future__ import annotations

import argparse
import json

import yaml


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Make ``path``'s settings ``parser``'s defaults."""
    given, unset = parser.parse_args(_words(parser, path)), parser.parse_args([])
    parser.set_defaults(**{name: value for name, value in vars(given).items()
                           if value != getattr(unset, name)})


def _words(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The file's settings as command-line words."""
    try:
        with open(path) as f:
            settings = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(settings, (dict, type(None))):
        raise ValueError(f"--config {path}: a mapping of flag names to values, got "
                         f"{type(settings).__name__}")
    known = parser._option_string_actions  # (argparse has no public index of its flags)
    words: list[str] = []
    for key, value in (settings or {}).items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known or flag == "--config":
            raise ValueError(f"--config {path}: no flag {flag} (from {key!r})")
        cleared = "--no-" + flag[2:]
        if value is True:
            words.append(flag)
        elif value is False:
            words += [cleared] if cleared in known else []
        elif isinstance(value, list) and known[flag].nargs in (None, "?"):  # repeated (append)
            for item in value:
                words += [flag, _word(item)]
        else:
            words += [flag, *map(_word, value if isinstance(value, list) else [value])]
    return words


def _word(value) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)
