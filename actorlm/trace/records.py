"""The trace's record types and their JSON-lines form.

A trace is a sequence of records, each a small frozen msgspec Struct tagged by ``kind``. In
JSON lines every record is one object; the first line is always the ``config`` record (what a
replay needs to rebuild the scheduler), the others follow in the order they were recorded.

Two meanings of ``step``:

- on ``arrival``, ``abort`` and ``stop`` it is the id of the first step the event can
  change: the next step the scheduler will plan when it receives the message. That is the key
  a replay feeds the event in at.
- on ``transition`` and ``message`` it is the step being planned, in flight or applied when
  the record was made; on ``step`` it is that step's id.

Times ``t`` are seconds on the monotonic clock; ``config.t0`` is the clock at start-up and
``config.wall_time`` the wall-clock time then.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Union

import msgspec

from actorlm.lora_request import LoRARequest

TRACE_VERSION = 2


class _Record(msgspec.Struct, frozen=True, gc=False, tag_field="kind"):
    pass


class TraceConfig(_Record, tag="config"):
    """The engine configuration a replay needs; always the first record of an export."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    enable_chunked_prefill: bool
    eos_token_ids: list[int]
    enable_prefix_caching: bool = False
    model: str = ""
    t0: float = 0.0
    wall_time: float = 0.0
    capacity: int = 0  # ring-buffer size; 0: unbounded (a trace file)
    num_dropped: int = 0  # records the ring buffer lost before this export
    version: int = TRACE_VERSION
    # the window of each KV-cache group the block pool served (None: full attention); empty:
    # one full-attention group (traces from before the groups)
    kv_cache_windows: list[int | None] = []
    num_speculative_tokens: int = 0  # drafts proposed per request and step at most; 0: none
    max_loras: int = 0  # distinct LoRA adapters a step holds at most; 0: LoRA off
    scheduling_policy: str = "fcfs"  # or "priority": the order of the queues
    long_rope_from: int | None = None  # a LongRoPE model's original context (block hash keys)
    long_prefill_token_threshold: int = 0  # a request's tokens in one step at most; 0: no cap


class Arrival(_Record, tag="arrival"):
    """A request reached the scheduler (with the sampling fields the scheduler reads)."""

    t: float
    step: int
    request_id: str
    num_prompt_tokens: int
    n: int
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    arrival_time: float = 0.0
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_int_id: int = 0
    priority: int = 0  # (under the priority policy)

    @property
    def lora_request(self) -> LoRARequest | None:
        """Its adapter as the scheduler saw it (the directory is not recorded)."""
        return None if self.lora_name is None else \
            LoRARequest(self.lora_name, self.lora_int_id, "")


class Abort(_Record, tag="abort"):
    t: float
    step: int
    request_ids: list[str]


class Stop(_Record, tag="stop"):
    """Stop strings found by the frontend: these requests finish as stopped."""

    t: float
    step: int
    request_ids: list[str]
    stop_reasons: list[str]


class StateChange(_Record, tag="transition"):
    """One state-machine transition, with the request's counts at that moment."""

    t: float
    step: int
    request_id: str
    source: str
    target: str
    event: str
    reason: str | None  # finish reason when target is "finished"
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_blocks: int
    stop_reason: int | str | None = None  # stop token id, or stop string (StopRequests)
    num_cached_tokens: int = 0  # into running: tokens this admission found in the prefix cache
    # into running or finished, with prefix caching: the content hashes of the request's full
    # blocks so far (what a replay needs to reproduce its cache hits)
    block_hashes: list[int] = []


class MessageSent(_Record, tag="message"):
    """One actor-to-actor message. ``num_bytes`` is its msgpack-encoded size (-1: unknown)."""

    t: float
    step: int
    type: str
    sender: str
    receiver: str
    num_bytes: int


class StepSummary(_Record, tag="step"):
    """One planned step: what ran, what was preempted, the KV pool after the grant.

    ``t_start`` is when the plan was made, ``t_end`` when its result was applied (equal for a
    plan that only returned blocks). ``is_prefill[i]`` is False when ``request_ids[i]``
    computed exactly its newest token (a decode); prompt chunks and recomputes are prefill.
    ``fault`` is set when a worker faulted instead (the step did not happen; ``blamed_ids``
    ran in it), ``failed_ids`` / ``error`` when the runner failed some requests alone.
    ``prepare_s``, ``forward_s`` and ``sample_s`` are the runner's own timings of the step
    (input preparation, the model's forward, logits and sampling); the rest of a step's period
    is the engine's own work (see ``trace/step_breakdown.py``). ``rank_timings[r]`` are the same three
    for worker rank ``r`` (rank 0's are the ones above). ``kv_blocks_per_group[g]``: the blocks
    KV-cache group ``g`` holds after the grant (they add up to ``kv_blocks_used``).
    ``router_s`` and ``experts_s`` are the parts of rank 0's forward spent in the routers and
    in the experts of a mixture-of-experts model (``StepResult``), None where not measured.

    Speculative decoding: ``draft_token_ids[i]`` are the draft tokens ``request_ids[i]``
    verified in this step (counted in its ``num_scheduled_tokens``; empty for a prefill) and
    ``num_accepted_tokens[i]`` how many of them the step accepted — always a prefix of the
    drafts, so the accepted ids are ``draft_token_ids[i][:num_accepted_tokens[i]]``. Both lists
    are empty when no request of the step had drafts (every step of a run without
    speculation, and traces from before drafts were recorded). A faulted step accepted none.
    """

    step: int
    t_start: float
    t_end: float
    duration_s: float
    request_ids: list[str]
    num_scheduled_tokens: list[int]
    is_prefill: list[bool]
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted_ids: list[str]
    failed_ids: list[str]
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    num_running: int
    num_waiting: int
    error: str | None = None
    fault: str | None = None
    blamed_ids: list[str] = []
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    num_cached_tokens: int = 0  # found in the prefix cache by the requests admitted here
    rank_timings: list[list[float]] = []
    kv_blocks_per_group: list[int] = []
    router_s: float | None = None
    experts_s: float | None = None
    draft_token_ids: list[list[int]] = []
    num_accepted_tokens: list[int] = []

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens this step verified, over its requests."""
        return sum(map(len, self.draft_token_ids))

    @property
    def num_accepted_drafts(self) -> int:
        """Draft tokens this step accepted, over its requests."""
        return sum(self.num_accepted_tokens)

    def drafts_per_request(self) -> list[tuple[int, int]]:
        """(drafts verified, drafts accepted) of each of ``request_ids``; (0, 0) for all
        where the step had no drafts."""
        if not self.draft_token_ids:
            return [(0, 0)] * len(self.request_ids)
        return list(zip(map(len, self.draft_token_ids), self.num_accepted_tokens))

    @property
    def num_verifications(self) -> int:
        """Requests that verified drafts in this step (the engine's ``spec_num_drafts``)."""
        return sum(1 for drafts in self.draft_token_ids if drafts)


Record = Union[TraceConfig, Arrival, Abort, Stop, StateChange, MessageSent, StepSummary]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def encode_line(record: Record) -> bytes:
    return _encoder.encode(record)


def encode_lines(records: list[Record]) -> bytes:
    """Newline-terminated JSON lines, one per record."""
    return _encoder.encode_lines(records)


def jsonl_lines(records: Iterable[Record]) -> Iterator[str]:
    """One JSON object per record, without newlines."""
    for record in records:
        yield _encoder.encode(record).decode()


def write_jsonl(path, records: Iterable[Record]) -> None:
    with open(path, "wb") as f:
        for record in records:
            f.write(_encoder.encode(record) + b"\n")


def parse_lines(lines: Iterable[str | bytes]) -> list[Record]:
    """Records from JSON lines (blank lines skipped); raises ValueError naming a bad line."""
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(_decoder.decode(line))
        except msgspec.DecodeError as exc:
            raise ValueError(f"trace line {number}: {exc}") from None
    return records


def read_jsonl(path) -> list[Record]:
    with open(path, "rb") as f:
        return parse_lines(f)
