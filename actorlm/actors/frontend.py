"""FrontendActor: the engine's edge. Owns the tokenizer and every request's output stream.

It refuses bad input with a ``ValueError`` before anything is allocated, tokenizes, gives each
request its sampling seed, and turns each step's ``EngineOutputs`` into ``RequestOutput``s
delivered to the request's sink (a queue the caller reads): after every step when streaming,
once at the end otherwise. Stop strings are found here, since only the frontend sees text.
A request whose output cannot be processed (its detokenization raises, say) fails alone.
After an engine core in a process of its own has been restarted, ``ResumeRequests`` gives
every live child back as an ``AddRequest`` with the tokens it has streamed. Blame narrows as
deaths repeat: a request live at a second death resumes as a suspect, which the new core runs
alone for a step (on probation); if the core dies in that step (the frontend was told,
``EngineOutputs.on_trial``) that request alone fails, and the others' counts stay as they
were. A request live at ``MAX_RESUMES + 1`` deaths that no trial explained fails anyway.
"""

from __future__ import annotations

import logging
import random
import time

import msgspec
import pykka

from actorlm.core.output_stream import OutputStream
from actorlm.engine_actor import EngineActor, tell
from actorlm.messages import (AbortRequests, AddRequest, EngineOutputs, Resumed, ResumeRequests,
                              StopRequests, SubmitRequest)
from actorlm.pooling import PoolerConfig, PoolingParams
from actorlm.prompt_rules import empty_prompt, outside_vocabulary
from actorlm.sampling_params import MAX_LOGPROBS, SEED_RANGE, SamplingParams

log = logging.getLogger(__name__)

SUSPECT_AFTER = 2  # engine-core deaths a request lived through before it runs alone a step
MAX_RESUMES = 4  # a request live at a fifth death that no trial explained fails


class FrontendActor(EngineActor):
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int,
                 scheduler: pykka.ActorRef, seed: int = 0, clock=time, on_death=None,
                 lora_checker=None, priority_scheduling: bool = False,
                 pooler: PoolerConfig | None = None, hidden_size: int = 0,
                 max_logprobs: int = MAX_LOGPROBS):
        super().__init__(on_death)
        # a pooling model's (``actorlm.pooling``): its requests are embeddings, and only;
        # None: a generating model's, which takes no embedding request
        self.pooler, self.hidden_size = pooler, hidden_size
        self.priority_scheduling = priority_scheduling  # False: every request's priority is 0
        # reads a request's adapter directory before it enters (``LoRAChecker``); None: LoRA
        # is off, and a request asking for an adapter is refused
        self.lora_checker = lora_checker
        self.clock = clock  # anything with monotonic(): the time module or a ManualClock
        self.tokenizer, self.scheduler = tokenizer, scheduler
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self._rng = random.Random(seed)  # seeds for requests that bring none
        self._streams: dict[str, OutputStream] = {}
        self._children: dict[str, tuple[OutputStream, int]] = {}  # engine id -> (stream, index)
        self._added: dict[str, AddRequest] = {}  # what each live request entered the engine as
        self._aborted: set[str] = set()  # live ones whose abort the engine has yet to report
        self._resumes: dict[str, int] = {}  # live ones resumed after an engine-core restart
        self._on_trial: set[str] = set()  # engine ids running alone in a step in flight

    def on_start(self):
        getattr(self.tokenizer, "for_this_thread", None)  # this thread's copy, made now

    def on_receive(self, message):
        if isinstance(message, SubmitRequest):
            return self.submit(message)
        if isinstance(message, EngineOutputs):
            self.deliver(message)
        elif isinstance(message, AbortRequests):
            self._aborted.update(rid for rid in message.request_ids if rid in self._streams)
            tell(self.scheduler, AbortRequests(self._engine_ids(message.request_ids)))
        elif isinstance(message, ResumeRequests):
            return self.resume(message.engine_ids)
        else:
            raise TypeError(f"FrontendActor cannot handle {type(message).__name__}")

    def submit(self, msg: SubmitRequest) -> list[int]:
        """Validate and start one request; returns its prompt token ids or raises ValueError."""
        if msg.request_id in self._streams:
            raise ValueError(f"request id {msg.request_id!r} is already in use")
        token_ids = self.tokenize(msg.prompt)
        params = msg.sampling_params
        self._validate(params)
        self._check_pooling(msg.pooling_params, params)
        if msg.lora_request is not None:
            if self.lora_checker is None:
                raise ValueError(f"LoRA adapter {msg.lora_request.lora_name!r}: LoRA is not "
                                 f"enabled (--enable-lora)")
            self.lora_checker.check(msg.lora_request)
        if msg.cache_salt is not None and not (isinstance(msg.cache_salt, str) and msg.cache_salt):
            raise ValueError("cache_salt: must be a non-empty string if given")
        self._check_priority(msg.priority)
        seed = self._rng.randrange(SEED_RANGE) if params.seed is None else params.seed % SEED_RANGE
        text = msg.prompt if isinstance(msg.prompt, str) else None
        arrival_time = self.clock.monotonic()
        stream = OutputStream(msg.request_id, text, token_ids, params, self.tokenizer, msg.sink,
                              msg.stream,
                              pooling=None if msg.pooling_params is None else self.pooler.task,
                              arrival_time=arrival_time)
        self._streams[msg.request_id] = stream
        for index, engine_id in enumerate(stream.engine_ids):
            self._children[engine_id] = (stream, index)
        added = AddRequest(msg.request_id, token_ids, params, seed, arrival_time,
                           self._bad_words(params.bad_words), lora_request=msg.lora_request,
                           cache_salt=msg.cache_salt, priority=msg.priority,
                           pooling_params=msg.pooling_params)
        self._added[msg.request_id] = added
        self.scheduler.tell(added)
        return token_ids

    def resume(self, engine_ids: list[str] | None = None) -> Resumed:
        """After an engine-core restart: every live child again (of those in ``engine_ids``,
        the restarted core's, if given), as the prompt and the tokens it has streamed, in
        arrival order; children already stopped (a stop string) or aborted are finished here,
        since the new core never knew them. Blame as the module says."""
        wanted = None if engine_ids is None else set(engine_ids)
        culprits = {eid for eid in self._on_trial if wanted is None or eid in wanted}
        self._on_trial -= culprits
        resumed, live = [], []
        for request_id, stream in list(self._streams.items()):
            if wanted is not None and wanted.isdisjoint(stream.engine_ids):
                continue  # another core runs it
            live.append(request_id)
            added, aborted = self._added[request_id], request_id in self._aborted
            if not culprits:  # a death no trial explains: everyone live is suspect
                self._resumes[request_id] = self._resumes.get(request_id, 0) + 1
            if aborted:
                pass  # (finished below)
            elif not culprits.isdisjoint(stream.engine_ids):
                stream.fail("the engine core died while this request ran alone (on probation "
                            "after earlier deaths): it is taken to be the cause, and is not "
                            "resumed again")
            elif self._resumes.get(request_id, 0) > MAX_RESUMES:
                stream.fail(f"the engine core died {MAX_RESUMES + 1} times while this request "
                            f"ran; it is not resumed again")
            suspect = self._resumes.get(request_id, 0) >= SUSPECT_AFTER
            for index, (engine_id, seq) in enumerate(zip(stream.engine_ids, stream.sequences)):
                if seq.finish_reason is None and not aborted:
                    resumed.append(_resumed(added, engine_id, index, seq.token_ids, suspect))
                elif aborted and seq.finish_reason is None:
                    seq.finish_reason = "abort"
                seq.engine_finished |= seq.finish_reason is not None
            self._deliver_if_finished(stream)
        return Resumed(resumed, live)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(empty_prompt("prompt"))
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if not token_ids:
                raise ValueError(empty_prompt("prompt_token_ids"))
            self._check_token_ids("prompt_token_ids", token_ids)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. "
                             f"However, your request has {len(token_ids)} input tokens. "
                             f"Please reduce the length of the input.")
        return token_ids

    def deliver(self, outputs: EngineOutputs) -> None:
        if outputs.on_trial or outputs.trial_over:
            self._on_trial.update(outputs.on_trial)
            self._on_trial.difference_update(outputs.trial_over)
        touched: dict[str, OutputStream] = {}
        stops: list[tuple[str, str]] = []
        to_abort: list[str] = []
        now = self.clock.monotonic()
        for delta in outputs.deltas:
            entry = self._children.get(delta.request_id)
            if entry is None:
                continue
            stream, index = entry
            touched[stream.request_id] = stream
            stream.stats.add_tokens(len(delta.new_token_ids), now)
            try:
                stop = stream.apply(index, delta)
            except Exception as exc:  # noqa: BLE001 — this request's data: it fails alone
                log.exception("request %s: its output could not be processed", stream.request_id)
                to_abort += stream.fail(f"{type(exc).__name__}: {exc}")
                continue
            if stop is not None and delta.finish_reason is None:
                stops.append((delta.request_id, stop))
        if stops:  # the engine is still running them: stop them and free their blocks
            tell(self.scheduler, StopRequests([rid for rid, _ in stops], [s for _, s in stops]))
        if to_abort:
            tell(self.scheduler, AbortRequests(to_abort))
        for stream in touched.values():
            self._deliver_if_finished(stream, streaming=True)

    def _deliver_if_finished(self, stream: OutputStream, streaming: bool = False) -> None:
        """Hand the stream's output to its caller if it has finished (or, ``streaming``, if
        it streams); a finished one is forgotten."""
        if stream.finished:
            del self._streams[stream.request_id]
            del self._added[stream.request_id]
            self._aborted.discard(stream.request_id)
            self._resumes.pop(stream.request_id, None)
            self._on_trial.difference_update(stream.engine_ids)
            for engine_id in stream.engine_ids:
                del self._children[engine_id]
        if stream.finished or (streaming and stream.stream):
            stream.sink.put(stream.output())

    def _validate(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}: at most {self.max_logprobs} are supported "
                                 f"(--max-logprobs), got {value}")
        if params.logit_bias:
            self._check_token_ids("logit_bias", list(params.logit_bias))
        if params.allowed_token_ids:
            self._check_token_ids("allowed_token_ids", params.allowed_token_ids)

    def _check_pooling(self, pooling: PoolingParams | None, params: SamplingParams) -> None:
        if pooling is None and self.pooler is not None:
            raise ValueError("this model runs for embeddings (--runner pooling): it does not "
                             "generate text (--runner generate runs a model with an LM head "
                             "to generate)")
        if pooling is None:
            return
        if self.pooler is None:
            raise ValueError("embeddings need a pooling model: this one runs to generate "
                             "(--runner pooling embeds with it)")
        if params.n != 1:
            raise ValueError(f"n: an embedding request has one output, got n={params.n}")
        self.pooler.check(pooling, self.hidden_size)

    def _check_priority(self, priority) -> None:
        # (64 bits: what the engine-core process's wire carries)
        if not isinstance(priority, int) or isinstance(priority, bool) or \
                not -2**63 <= priority < 2**63:
            raise ValueError(f"priority: must be a 64-bit integer, got {priority!r}")
        if priority and not self.priority_scheduling:
            raise ValueError(f"priority: {priority} needs --scheduling-policy priority (requests "
                             f"are served first come, first served)")

    def _check_token_ids(self, field: str, token_ids: list[int]) -> None:
        if refusal := outside_vocabulary(field, token_ids, self.vocab_size):
            raise ValueError(refusal)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (how it appears mid-text)."""
        found = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    def _engine_ids(self, request_ids: list[str]) -> list[str]:
        """Caller ids to engine ids: a request with n > 1 runs as n children."""
        out = []
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            out += stream.engine_ids if stream is not None else [request_id]
        return out


def _resumed(added: AddRequest, engine_id: str, index: int, token_ids: list[int],
             suspect: bool) -> AddRequest:
    """Child ``index`` of ``added`` as a request of its own, with the tokens it has made."""
    params = added.sampling_params
    if params.n > 1:
        params = msgspec.structs.replace(params, n=1)
    return AddRequest(engine_id, added.prompt_token_ids, params,
                      (added.seed + index) % SEED_RANGE, added.arrival_time,
                      added.bad_words_token_ids, list(token_ids), added.lora_request, suspect,
                      added.cache_salt, added.priority, added.pooling_params)
