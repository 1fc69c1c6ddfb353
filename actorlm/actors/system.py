"""EngineSystem: loads the model's parts (``models/parts.py``), starts the actors in order,
stops them cleanly.

Start order follows the replies: the scheduler first (everyone reports to it), then the
allocator and the executor (whose constructor loads the weights, so a bad model fails here,
in the caller's thread, with nothing left running), then the frontend; finally the scheduler
is told its peers. Stop order is the reverse of the data flow: no new input, then no new steps,
then the workers, then the block pool.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Iterable

import pykka

from actorlm.actors.executor import ExecutorActor
from actorlm.actors.frontend import FrontendActor
from actorlm.actors.kv_allocator import KVAllocatorActor
from actorlm.core.block_pool import BlockPool, max_blocks_per_sequence
from actorlm.core.structured_output import GrammarCompiler
from actorlm.actors.scheduler import SchedulerActor
from actorlm.actors.supervisor import Supervisor
from actorlm.chat_content import with_content_format
from actorlm.config import EngineConfig
from actorlm.core.scheduler import Scheduler, SchedulerConfig
from actorlm.fsm.machine import Listener
from actorlm.generation_config import load_sampling_defaults
from actorlm.messages import (Connect, ExecutorStats, GetStats, KVStats, ResetPrefixCache,
                              SchedulerStats)
from actorlm.models.lora_adapter import lora_checker
from actorlm.models.parts import ModelParts, load_model_parts
from actorlm.reasoning import reasoning_parser, reasoning_tokens
from actorlm.tokenizer import PerThreadTokenizer

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # per actor; a worker mid-step finishes the step first


def _check_pool_holds_a_sequence(config: EngineConfig, windows: list[int | None]) -> None:
    """With KV-cache groups a sequence holds blocks in each of them (the config checked one)."""
    if windows == [None]:
        return
    needed = max_blocks_per_sequence(windows, config.max_model_len, config.block_size,
                                     config.max_num_batched_tokens)
    if config.num_kv_blocks < needed:
        raise ValueError(
            f"the KV pool ({config.num_kv_blocks} blocks of {config.block_size} tokens) cannot "
            f"hold one {config.max_model_len}-token sequence in the model's {len(windows)} "
            f"KV-cache groups (windows {windows}), which takes up to {needed} blocks; raise "
            f"--num-kv-blocks or --kv-cache-memory-bytes, or lower --max-model-len")


def _direct(ref: pykka.ActorRef, sender: str, receiver: str):
    return ref


class EngineSystem:
    """Starts the engine's actors. The keyword arguments are seams for tests and tools:
    ``parts`` replaces model loading (``config`` must then be resolved already), ``clock`` is
    what the actors read time from, ``listeners`` observe every request's state machine, and
    ``peer(ref, sender, receiver)`` returns what actor ``sender`` is given to reach actor
    ``receiver`` (whose ref is ``ref``): a test harness returns a probe that relays, to control
    delivery. ``trace`` (an ``actorlm.trace.TraceRecorder``) records every transition, message
    and step, through the same seam: what it is given records what it carries.
    ``wrap_runner(runner)`` returns what the workers run in place of each runner built
    (``actorlm.testing.FaultInjector`` wraps them to make steps fault).

    ``supervisor`` hears of every core actor's death (see ``actors.supervisor``).

    ``frontend``: what the scheduler sends its outputs to in place of a ``FrontendActor`` of
    this process's own (an engine-core process's relay to the frontend in another process,
    ``actorlm.engine_core``); anything with ``tell``."""

    def __init__(self, config: EngineConfig, *, parts: ModelParts | None = None, clock=time,
                 listeners: Iterable[Listener] = (),
                 peer: Callable[[pykka.ActorRef, str, str], Any] = _direct, trace=None,
                 wrap_runner: Callable[[Any], Any] | None = None, frontend=None):
        self.model_path = self.hf_config = self.dtype = self.device = self.memory_profile = None
        if parts is None:
            parts = self._load_model(config)
        else:
            self.config = config
        self.tokenizer = PerThreadTokenizer(parts.tokenizer)
        self.eos_token_ids = parts.eos_token_ids  # the tokens that end a sequence
        # both checked before any actor starts: a bad file or a model that cannot think in the
        # parser's tags fails here, with nothing left running
        self.sampling_defaults = load_sampling_defaults(
            self.config.generation_config, self.model_path, self.hf_config,
            self.config.override_generation_config)
        self.reasoning = None
        if self.config.reasoning_parser is not None:
            self.reasoning = reasoning_tokens(
                reasoning_parser(self.config.reasoning_parser), parts.tokenizer, parts.name)
        make_runner = parts.make_runner
        config = self.config
        # one window per KV-cache group (None: full attention); no groups: one full group
        self.kv_cache_windows = [g.window for g in parts.kv_cache_groups] or [None]
        _check_pool_holds_a_sequence(config, self.kv_cache_windows)
        if wrap_runner is not None:
            if config.executor_backend != "uni":
                raise ValueError("wrap_runner wraps runners in this process: it needs "
                                 "--distributed-executor-backend uni")
            make_runner = lambda rank: wrap_runner(parts.make_runner(rank))  # noqa: E731
        self.supervisor = supervisor = Supervisor()

        def on_death(name: str):
            return functools.partial(supervisor.actor_died, name)

        policy = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            block_size=config.block_size, enable_chunked_prefill=config.enable_chunked_prefill,
            eos_token_ids=parts.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
            speculative=config.speculative_config is not None,
            max_loras=config.max_loras if config.enable_lora else 0,
            scheduling_policy=config.scheduling_policy, long_rope_from=parts.long_rope_from,
            long_prefill_token_threshold=config.long_prefill_token_threshold),
            listeners=[*listeners, trace.on_transition] if trace else listeners)
        self.trace = trace
        if trace is not None:
            trace.configure(config, parts.eos_token_ids, parts.name, self.kv_cache_windows,
                            parts.long_rope_from)
            trace.attach(policy)

        def reach(ref, sender: str, receiver: str):
            """What ``sender`` is given to reach ``receiver``: the caller's seam, then the
            trace's (a ref that records what it carries)."""
            ref = peer(ref, sender, receiver)
            return ref if trace is None else trace.wrap(ref, sender, receiver)

        self.frontend = self.allocator = self.executor = None
        grammars = GrammarCompiler(
            parts.tokenizer, parts.vocab_size, reasoning=self.reasoning,
            any_whitespace=self.config.structured_outputs_config.any_whitespace)
        self.scheduler = SchedulerActor.start(policy, trace, on_death("scheduler"), grammars)
        try:
            pool = BlockPool(config.num_kv_blocks, config.block_size,
                             config.enable_prefix_caching, self.kv_cache_windows)
            self.allocator = KVAllocatorActor.start(
                pool, reach(self.scheduler, "allocator", "scheduler"),
                on_death("allocator"))
            self.executor = ExecutorActor.start(
                make_runner, config.tensor_parallel_size,
                reach(self.scheduler, "executor", "scheduler"), on_death("executor"),
                backend=config.executor_backend,
                tensor_parallel=config.tensor_parallel_size > 1)
            self.frontend = frontend or FrontendActor.start(
                self.tokenizer, config.max_model_len, parts.vocab_size,
                reach(self.scheduler, "frontend", "scheduler"), config.seed, clock=clock,
                on_death=on_death("frontend"), lora_checker=lora_checker(config, self.hf_config),
                priority_scheduling=config.scheduling_policy == "priority",
                pooler=config.pooler_config if config.is_pooling else None,
                hidden_size=getattr(self.hf_config, "hidden_size", 0),
                max_logprobs=config.max_logprobs)
        except BaseException:
            self.stop()
            raise
        self.scheduler.tell(Connect(
            reach(self.frontend, "scheduler", "frontend"),
            reach(self.allocator, "scheduler", "allocator"),
            reach(self.executor, "scheduler", "executor")))
        log.info("engine ready: %s, %d KV blocks of %d tokens%s, max_model_len %d", parts.name,
                 config.num_kv_blocks, config.block_size,
                 "" if config.kv_cache_dtype == "auto" else f" ({config.kv_cache_dtype})",
                 config.max_model_len)
        if self.kv_cache_windows != [None]:
            log.info("KV-cache groups: %s (windows; None: full attention), %d layers a block",
                     self.kv_cache_windows, len(parts.kv_cache_groups[0].layers))
        log.info("%s", self.sampling_defaults.describe())

    def _load_model(self, config: EngineConfig) -> ModelParts:
        loaded = load_model_parts(config)
        self.config, self.model_path, self.hf_config = loaded.config, loaded.path, loaded.hf_config
        self.dtype, self.device = loaded.dtype, loaded.device
        self.backend_name = loaded.backend_name
        self.memory_profile = loaded.memory_profile
        return loaded.parts

    def scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.ask(GetStats())

    def kv_stats(self) -> KVStats:
        return self.allocator.ask(GetStats())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (requests in flight keep their blocks)."""
        return self.allocator.ask(ResetPrefixCache())

    def executor_stats(self) -> ExecutorStats:
        return self.executor.ask(GetStats())

    def worker_pids(self) -> list[int]:
        """The worker processes' ids (``mp`` and ``ray``; empty when the workers are threads)."""
        return self.executor_stats().worker_pids

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            content_format: str = "auto", **template_kwargs) -> list[int]:
        """The conversation rendered through the model's chat template (or the one
        ``template_kwargs`` names), as token ids; ``content_format``: the messages' content as
        the template reads it (``chat_content``)."""
        if not conversation:
            raise ValueError("messages: the conversation is empty")
        template = template_kwargs.get("chat_template") or \
            getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for index, message in enumerate(conversation):
            parts = message.get("content") if isinstance(message, dict) else None
            for part in parts if isinstance(parts, list) else ():
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":  # (a multimodal checkpoint runs its text decoder alone)
                    raise ValueError(f"messages[{index}].content: only text parts are "
                                     f"supported, got {kind!r}")
        conversation = with_content_format(conversation, content_format, template)
        ids = self.tokenizer.apply_chat_template(conversation, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def stats(self) -> dict:
        """Scheduler, KV pool and executor counters as one dict (blocking asks)."""
        return self.stats_of(self.scheduler_stats(), self.kv_stats(), self.executor_stats(),
                             self.num_core_restarts)

    def replica_stats(self) -> list[dict]:
        """``stats()`` per data-parallel replica: this engine is one."""
        return [self.stats()]

    def stats_of(self, s: SchedulerStats, kv: KVStats, ex: ExecutorStats,
                 num_core_restarts: int) -> dict:
        return {"num_running": s.num_running, "num_waiting": s.num_waiting,
                "num_preemptions": s.num_preemptions, "num_steps": s.num_steps,
                "num_finished": s.num_finished, "num_scheduled_tokens": s.num_scheduled_tokens,
                "num_prefill_tokens": s.num_prefill_tokens,
                "spec_num_drafts": s.spec_num_drafts,
                "spec_num_draft_tokens": s.spec_num_draft_tokens,
                "spec_num_accepted_tokens": s.spec_num_accepted_tokens,
                "spec_accepted_per_position": list(s.spec_accepted_per_position),
                "running_lora_adapters": list(s.running_lora_adapters),
                "waiting_lora_adapters": list(s.waiting_lora_adapters),
                "num_free_blocks": kv.num_free_blocks, "num_total_blocks": kv.num_total_blocks,
                "num_cached_blocks": kv.num_cached_blocks,
                "num_requests_holding_blocks": kv.num_requests_holding_blocks,
                "num_used_blocks_per_group": list(kv.num_used_blocks),
                "kv_cache_windows": list(self.kv_cache_windows),
                "prefix_cache_queries": kv.prefix_cache_queries,
                "prefix_cache_hits": kv.prefix_cache_hits,
                "num_worker_restarts": ex.num_worker_restarts,
                "num_engine_core_restarts": num_core_restarts}

    num_core_restarts = 0  # an engine core in a process of its own is restarted when it dies

    def stop(self) -> None:
        """Stop every actor this system started, frontend first; waits for their threads (a
        bounded time each: they are daemons, and a process exiting must not hang on one)."""
        self.supervisor.shutting_down()
        for ref in (self.frontend, self.scheduler, self.executor, self.allocator):
            if isinstance(ref, pykka.ActorRef) and ref.is_alive():
                try:
                    ref.stop(block=True, timeout=STOP_TIMEOUT_S)
                except pykka.Timeout:
                    log.warning("%s did not stop within %s s", ref, STOP_TIMEOUT_S)
