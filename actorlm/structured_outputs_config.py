"""vLLM's ``--structured-outputs-config`` (JSON text or a dict), as this engine runs it: xgrammar
is the backend (``auto`` picks it; another is refused by name); its JSON Schemas keep fixed
separators (``", "``, ``": "``) unless ``disable_any_whitespace`` is false, when any whitespace
may stand between tokens as in vLLM's xgrammar grammars; a grammar applies after a think only
(``enable_in_reasoning`` true is refused); ``reasoning_parser`` is ``--reasoning-parser`` under
another name. ``disable_fallback`` (no other backend to fall back to) and
``disable_additional_properties`` (guidance's; xgrammar's schemas already read an unspecified
``additionalProperties`` as false) change nothing here."""

from __future__ import annotations

from dataclasses import dataclass

from actorlm.json_flags import json_object

BACKENDS = ("auto", "xgrammar")
_FLAG = "--structured-outputs-config"
_BOOLEANS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
             "enable_in_reasoning")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    any_whitespace: bool = False  # whitespace between a JSON Schema's tokens
    reasoning_parser: str | None = None

    @classmethod
    def parse(cls, value) -> StructuredOutputsConfig:
        """``value`` (JSON text, a dict, an instance or None) checked; a ValueError naming the
        flag and the field otherwise."""
        if value is None or isinstance(value, cls):
            return value or cls()
        fields = json_object(value, _FLAG)
        known = ("backend", "reasoning_parser", *_BOOLEANS)
        if unknown := sorted(set(fields) - set(known)):
            raise ValueError(f"{_FLAG}: unknown field {unknown[0]!r} (known: {', '.join(known)})")
        if fields.get("backend", "auto") not in BACKENDS:
            raise ValueError(f"{_FLAG}: backend {fields['backend']!r} is not implemented "
                             f"(structured outputs run on xgrammar: {', '.join(BACKENDS)})")
        for name in _BOOLEANS:
            if not isinstance(fields.get(name, False), bool):
                raise ValueError(f"{_FLAG}: {name} must be true or false, got {fields[name]!r}")
        if fields.get("enable_in_reasoning"):
            raise ValueError(f"{_FLAG}: enable_in_reasoning is not implemented (a grammar "
                             f"constrains what follows the think)")
        parser = fields.get("reasoning_parser")
        if parser is not None and not isinstance(parser, str):
            raise ValueError(f"{_FLAG}: reasoning_parser must be a parser's name, got {parser!r}")
        return cls(any_whitespace=fields.get("disable_any_whitespace") is False,
                   reasoning_parser=parser or None)
