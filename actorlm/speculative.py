"""``--speculative-config``: vLLM's JSON shape, validated when the engine's config is built.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max":
b}`` proposes up to k draft tokens per request and step by prompt lookup: the tokens that
followed the most recent earlier occurrence of the request's last n tokens (n from b down to
a), in its own prompt and output. No second model runs. When neither bound is given both are
5, as in vLLM; one bound alone sets the other.

A draft model (``{"model": …}``) and vLLM's other methods (eagle, medusa, mtp, …) change what
is proposed, not the output's distribution; they are refused by name until they are built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

METHODS = ("ngram",)
_DEFAULT_LOOKUP = 5
_KNOWN_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
               "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (``LLM(speculative_config={...})``) or an instance;
        None stays None. Anything else is a ValueError naming the key to change."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config must be JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r}")
        if unknown := sorted(set(value) - _KNOWN_KEYS):
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(_KNOWN_KEYS))}")
        method = value.get("method")
        if "model" in value or method not in (None, *METHODS):
            what = f"method {method!r}" if method not in (None, "draft_model") else \
                "a draft model"
            raise ValueError(f"--speculative-config: {what} is not implemented; this engine "
                             f"speculates with method 'ngram' (prompt lookup)")
        if method is None:
            raise ValueError("--speculative-config needs \"method\": \"ngram\"")
        k = _positive(value, "num_speculative_tokens", None)
        low = value.get("prompt_lookup_min")
        high = value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = _DEFAULT_LOOKUP
        low = _positive(value, "prompt_lookup_min", high)
        high = _positive(value, "prompt_lookup_max", low)
        if low > high:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({low}) exceeds "
                             f"prompt_lookup_max ({high})")
        return cls(method, k, low, high)


class Proposer(Protocol):
    """What the model runner asks of a proposer, on rank 0, after each step's sampling."""

    def propose_all(self, request_ids: list[str], token_ids: list[list[int]]) -> list[list[int]]:
        """Up to k drafts to follow each request's tokens (prompt + output); [] for none."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop whatever is kept for it."""


def _positive(value: dict, key: str, default: int | None) -> int:
    number = value.get(key, default)
    if number is None:
        raise ValueError(f"--speculative-config needs {key!r}, a positive integer")
    if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
        raise ValueError(f"--speculative-config: {key} must be a positive integer, got "
                         f"{number!r}")
    return number
