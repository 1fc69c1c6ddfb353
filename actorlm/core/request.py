"""The scheduler's record of one request. Only the scheduler creates or changes these."""

from __future__ import annotations

from hashlib import blake2b
from typing import Iterable

from actorlm.fsm import REQUEST_LIFECYCLE, FinishReason, Machine, RequestEvent, RequestState
from actorlm.fsm.machine import Listener
from actorlm.lora_request import LoRARequest
from actorlm.pooling import PoolingParams
from actorlm.sampling_params import SamplingParams


class RequestRefused(ValueError):
    """A request the engine refuses for what the client put in one field (``field``), which
    the API answers with a 400 naming it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params", "seed",
                 "arrival_time", "num_computed_tokens", "num_blocks", "fsm", "finish_reason",
                 "stop_reason", "error", "error_field", "num_preemptions", "is_known_to_workers",
                 "bad_words_token_ids", "num_prompt_logprobs_sent", "num_faults",
                 "block_hashes", "num_cached_blocks", "num_cached_tokens", "grammar",
                 "awaiting_grammar", "spec_token_ids", "lora_request", "cache_salt",
                 "block_hash_keys", "priority", "pooling_params")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 seed: int, arrival_time: float, listeners: Iterable[Listener] = (),
                 bad_words_token_ids: list[list[int]] | None = None,
                 lora_request: LoRARequest | None = None, cache_salt: str | None = None,
                 priority: int = 0, pooling_params: PoolingParams | None = None,
                 long_rope_from: int | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.seed = seed
        self.arrival_time = arrival_time
        self.priority = priority  # under --scheduling-policy priority: smaller is served first
        self.num_computed_tokens = 0
        # table entries the allocator has granted it, in every KV-cache group (their ids travel
        # on; a sliding-window group's entries still count once it lets their blocks go)
        self.num_blocks = 0
        self.fsm = Machine(REQUEST_LIFECYCLE, name=request_id, listeners=listeners)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_field: str | None = None  # the request field the error names, if any
        self.num_preemptions = 0
        self.is_known_to_workers = False  # False: the next step sends it in full
        self.bad_words_token_ids = bad_words_token_ids or []
        self.num_prompt_logprobs_sent = 0  # prompt tokens 1..this have had their logprobs sent
        self.num_faults = 0  # faulted steps this request was part of
        self.block_hashes: list[int] = []  # of its full blocks, extended as tokens arrive
        self.num_cached_blocks = 0  # blocks the allocator has been told are computed
        self.num_cached_tokens: int | None = None  # prefix-cache hit at its first admission
        self.grammar = None  # structured outputs: its xgrammar matcher, once compiled
        self.awaiting_grammar = sampling_params.structured_outputs is not None
        # speculative decoding: drafts proposed to follow its tokens (once scheduled, the ones
        # its step verifies), computed with them but not yet its tokens
        self.spec_token_ids: list[int] = []
        self.lora_request = lora_request  # its adapter; None: the base model
        self.cache_salt = cache_salt  # its prefix-cache tenant; None: everyone's cache
        self.pooling_params = pooling_params  # an embedding's: it ends with its prompt pooled
        # what besides its tokens keys its KV blocks (``block_hash.extra_keys``), once: its
        # adapter, so no prefix cached under one adapter, or none, is served to another; and its
        # salt, so that a tenant can neither reuse nor time another's cached prompts (digested:
        # every block hashes the keys, and a salt may be megabytes long); and, in a LongRoPE
        # model, a prompt past its original context, whose every position turns by the long
        # factors (``CausalLM.rope_rows``)
        self.block_hash_keys: tuple = ()
        if long_rope_from is not None and len(self.prompt_token_ids) > long_rope_from:
            self.block_hash_keys += (("long_rope",),)
        if lora_request is not None:
            self.block_hash_keys += (("lora", lora_request.lora_int_id, lora_request.lora_path),)
        if cache_salt is not None:
            self.block_hash_keys += (("salt", blake2b(cache_salt.encode()).digest()),)

    @property
    def lora_id(self) -> int | None:
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def state(self) -> RequestState:
        return self.fsm.state

    @property
    def is_finished(self) -> bool:
        return self.fsm.is_terminal

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def fire(self, event: RequestEvent) -> None:
        self.fsm.fire(event)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.state.name}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={self.num_blocks})")
