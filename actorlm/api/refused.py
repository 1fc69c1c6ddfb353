"""Fields that vLLM or OpenAI define and actorlm does not implement: refused, never dropped.

A client that asks for logits processors or the deprecated ``functions`` and silently gets
plain sampling draws wrong conclusions from a 200. These fields are declared (so the schema shows
them and they decode strictly) and a request that uses one gets a 400 naming it. Sent with
their "off" value (``null``, ``false``, ``0``, empty, ``function_call: "none"``, the one
grammar backend there is) they change nothing and pass. Fields nobody defines are another
matter: they are ignored and logged once (``request_body.RequestDecoder``).
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from actorlm.api.errors import ApiError

# fields a chat request may carry besides RefusedFields' (echo: vLLM's, the last message
# prepended to an answer of its role), and a completions request (prompts as embeddings)
CHAT_FIELDS = ("functions", "function_call", "documents", "echo")
COMPLETION_FIELDS = ("prompt_embeds",)
# "off" values that are not simply falsy
_OFF = {"function_call": lambda v: v == "none",
        "guided_decoding_backend": lambda v: v in ("xgrammar", "auto")}


class RefusedFields(Struct, kw_only=True):
    """Logits processors and the like, for completions and chat alike."""

    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None  # JSON is generated compact
    logits_processors: list[Any] | None = None
    # vLLM's later ones: a budget of think tokens, logprobs of chosen ids, stopping on
    # repeated n-grams, disaggregated prefill's KV hand-over, watermarks
    thinking_token_budget: int | None = None
    logprob_token_ids: list[int] | None = None
    repetition_detection: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    watermarking: bool | None = None

    def check_refused(self, extra: tuple[str, ...] = ()) -> None:
        """Raise a 400 naming the first unimplemented field this request turns on."""
        for name in (*RefusedFields.__struct_fields__, *extra):
            value = getattr(self, name)
            if value and not _OFF.get(name, _never)(value):
                hint = " (only xgrammar)" if name == "guided_decoding_backend" else ""
                raise ApiError(400, f"{name}: not supported by this server{hint}", name)


def _never(value) -> bool:
    return False
