"""A flag given as JSON text (the command line) or as a dict (``LLM(...)``): one reading of it
for every such flag (``--speculative-config``, ``--pooler-config``, ``--hf-overrides``)."""

from __future__ import annotations

import json


def json_object(value, flag: str) -> dict:
    """``value`` (JSON text or a dict) as a dict; a ValueError naming ``flag`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} must be JSON (this is not JSON: {e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    return value
