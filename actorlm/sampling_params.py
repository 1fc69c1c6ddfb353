"""SamplingParams: vLLM's field names, defaults, semantics and validation ranges.

Everything that can be checked without the model is checked on construction and raises a
``ValueError`` that names the field. Checks that need the model (a token id outside the
vocabulary, logprobs above the engine's cap) happen when the request is submitted.
"""

from __future__ import annotations

import enum
import math

import msgspec
from msgspec.structs import force_setattr

GREEDY_TEMPERATURE = 1e-5  # vLLM treats temperatures below this as greedy
# what logprobs report (vLLM's --logprobs-mode): raw or processed logits, as logprobs or as
# the logits themselves (``models/sampler.py``)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
SEED_RANGE = 1 << 63  # seeds travel as int64 to the sampling kernels
MAX_LOGPROBS = 20  # vLLM's default cap (max_logprobs) on logprobs and prompt_logprobs
# msgspec's JSON decoder returns ints of any size, but msgpack (the trace, worker processes)
# and torch tensors hold at most 64 bits: a bigger int would fail deep inside an actor
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_INT_LIST_FIELDS = ("stop_token_ids", "allowed_token_ids")
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p")


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Constrain the output (vLLM's ``StructuredOutputsParams``); exactly one field is set.

    ``json``: a JSON Schema (an object, or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression; ``choice``: one of these strings; ``grammar``: an EBNF
    (GBNF) grammar whose start rule is ``root``; ``structural_tag``: xgrammar's structural tag
    (an object, or its JSON text; ``core.structured_output.structural_tag_grammar``).
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        # a Struct built in Python is not type-checked (decoding is): check the shapes here
        _check(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs.json",
               f"must be a JSON Schema (an object or its JSON text), got {_show(self.json)}")
        _check(isinstance(self.json_object, bool), "structured_outputs.json_object",
               f"must be true or false, got {_show(self.json_object)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), f"structured_outputs.{name}",
                   f"must be a string, got {_show(value)}")
        _check(self.choice is None or (isinstance(self.choice, list)
                                       and all(isinstance(c, str) for c in self.choice)),
               "structured_outputs.choice", f"must be a list of strings, got {_show(self.choice)}")
        _check(self.structural_tag is None or isinstance(self.structural_tag, (str, dict)),
               "structured_outputs.structural_tag",
               f"must be an object or its JSON text, got {_show(self.structural_tag)}")
        for name in ("json", "structural_tag"):
            if isinstance(getattr(self, name), dict):
                force_setattr(self, name, _json_text(getattr(self, name)))
        kinds = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        _check(len(kinds) == 1, "structured_outputs",
               f"set exactly one of json, json_object, regex, choice, grammar, structural_tag; "
               f"got {kinds or 'none'}")
        for name in ("regex", "grammar", "structural_tag"):
            _check(getattr(self, name) != "", f"structured_outputs.{name}", "must not be empty")
        for name, types, what in (("json", (dict, bool), "a JSON Schema (an object)"),
                                  ("structural_tag", dict, "a JSON object")):
            text = getattr(self, name)
            if text is not None:
                _check(isinstance(_decoded(name, text), types), f"structured_outputs.{name}",
                       f"must be {what}")
        _check(self.choice is None or (len(self.choice) > 0 and all(self.choice)),
               "structured_outputs.choice", "must be a non-empty list of non-empty strings")


def _decoded(name: str, text: str):
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ValueError(f"structured_outputs.{name}: not valid JSON: {exc}") from None


def _json_text(value) -> str:
    return msgspec.json.encode(value).decode()


class RequestOutputKind(enum.IntEnum):
    """What ``AsyncLLM`` streams of a request (vLLM's): everything so far after each step, what
    each step added, or the final output alone."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# vLLM's older name of the class (``from vllm.sampling_params import GuidedDecodingParams``),
# which SamplingParams takes as ``guided_decoding``
GuidedDecodingParams = StructuredOutputsParams


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request (see vLLM's ``SamplingParams`` for each field's meaning)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # the older name: moved on
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what AsyncLLM streams

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None, "guided_decoding",
                   "give structured_outputs or its older name guided_decoding, not both")
            force_setattr(self, "structured_outputs", self.guided_decoding)
            force_setattr(self, "guided_decoding", None)
        # normalise: stop is always a list, absent lists are empty
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        force_setattr(self, "stop", stop)
        force_setattr(self, "stop_token_ids", list(self.stop_token_ids or []))
        force_setattr(self, "bad_words", list(self.bad_words or []))
        if self.logit_bias is not None:
            force_setattr(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        _check(self.output_kind in tuple(RequestOutputKind) and
               not isinstance(self.output_kind, bool), "output_kind",
               f"must be a RequestOutputKind, got {_show(self.output_kind)}")
        force_setattr(self, "output_kind", RequestOutputKind(self.output_kind))
        self._validate()

    def _validate(self) -> None:
        # representability first, so the range checks below compare plain numbers
        for name in _INT_FIELDS:
            _check_int64(name, getattr(self, name))
        for name in _INT_LIST_FIELDS:
            for value in getattr(self, name) or ():
                _check_int64(name, value)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(_is_finite(value), name, f"must be a finite number, got {_show(value)}")
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int64("logit_bias", token_id)
            _check(_is_finite(bias), "logit_bias",
                   f"bias for token {token_id} must be a finite number, got {_show(bias)}")
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(0.0 <= self.temperature <= 2.0, "temperature", f"must be in [0, 2], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be greater than 0, got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be at least 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, f"must be at least 0, got {value}")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               f"must be non-negative token ids, got {self.stop_token_ids}")
        _check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
               "allowed_token_ids", "must not be empty")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                _check(-100.0 <= bias <= 100.0, "logit_bias",
                       f"bias for token {token_id} must be in [-100, 100], got {bias}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


def _check_int64(field: str, value: int | None) -> None:
    _check(value is None or _INT64_MIN <= value <= _INT64_MAX, field,
           f"must fit in 64 bits (-2**63 .. 2**63-1), got {_show(value)}")


def _is_finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float is not a usable float either
        return False


def _show(value) -> str:
    # str() of an int past 4300 digits raises (CPython's limit); its size says enough
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)
