"""``--speculative-config``: vLLM's JSON shape, validated when the engine's config is built.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max":
b}`` proposes up to k draft tokens per request and step by prompt lookup: the tokens that
followed the most recent earlier occurrence of the request's last n tokens (n from b down to
a), in its own prompt and output. No second model runs. When neither bound is given both are
5, as in vLLM; one bound alone sets the other.

``{"model": <directory or .gguf file>, "num_speculative_tokens": k}`` (``"method":
"draft_model"`` implied, as vLLM infers it) proposes the k tokens a smaller model with the
target's vocabulary would write greedily (``models/draft_proposer.py``); the vocabularies are
compared when the engine loads. vLLM's other methods (eagle, medusa, mtp, …) are refused by
name: they change what is proposed, not the output's distribution, and are not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from actorlm.json_flags import json_object

METHODS = ("ngram", "draft_model")
_DEFAULT_LOOKUP = 5
_KNOWN_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
               "model"}
_LOOKUP_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model only: the draft's directory or .gguf file

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict (``LLM(speculative_config={...})``) or an instance;
        None stays None. Anything else is a ValueError naming the key to change."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "--speculative-config")
        if unknown := sorted(set(value) - _KNOWN_KEYS):
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(_KNOWN_KEYS))}")
        method = value.get("method") or ("draft_model" if "model" in value else None)
        if method is None:
            raise ValueError("--speculative-config needs \"method\": \"ngram\" or a draft "
                             "\"model\"")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not implemented; "
                             f"this engine speculates with {' or '.join(map(repr, METHODS))}")
        k = _positive(value, "num_speculative_tokens", None)
        if method == "draft_model":
            return cls._draft_model(value, k)
        if "model" in value:
            raise ValueError("--speculative-config: method 'ngram' takes no \"model\" (a draft "
                             "model's method is 'draft_model')")
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

    @classmethod
    def _draft_model(cls, value: dict, k: int) -> SpeculativeConfig:
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("--speculative-config: method 'draft_model' needs \"model\", the "
                             "draft's directory or .gguf file")
        if lookup := [key for key in _LOOKUP_KEYS if key in value]:
            raise ValueError(f"--speculative-config: {', '.join(lookup)} belong to method "
                             f"'ngram', not to a draft model")
        return cls("draft_model", k, model=model)


class Proposer(Protocol):
    """What the model runner asks of a proposer, on rank 0, after each step's sampling."""

    def propose_all(self, request_ids: list[str], token_ids: list[list[int]]) -> list[list[int]]:
        """Up to k drafts to follow each request's tokens (prompt + output); [] for none."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop whatever is kept for it."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The target's KV pool is now ``num_blocks`` blocks: a proposer with a KV cache of its
        own sizes it alike and starts afresh."""


def _positive(value: dict, key: str, default: int | None) -> int:
    number = value.get(key, default)
    if number is None:
        raise ValueError(f"--speculative-config needs {key!r}, a positive integer")
    if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
        raise ValueError(f"--speculative-config: {key} must be a positive integer, got "
                         f"{number!r}")
    return number
