"""EngineSystem: resolves the model and config, starts the actors in order, stops them cleanly.

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
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pykka
import torch
from transformers import AutoTokenizer, GenerationConfig

from actorlm.actors.executor import ExecutorActor
from actorlm.actors.frontend import FrontendActor
from actorlm.actors.kv_allocator import KVAllocatorActor
from actorlm.actors.scheduler import SchedulerActor
from actorlm.actors.supervisor import Supervisor
from actorlm.config import EngineConfig
from actorlm.core.scheduler import Scheduler, SchedulerConfig
from actorlm.fsm.machine import Listener
from actorlm.kernels import select_backend
from actorlm.messages import Connect, ExecutorStats, GetStats, KVStats, SchedulerStats
from actorlm.models.loader import load_hf_config, load_model, resolve_model
from actorlm.models.profile import kv_cache_budget, largest_step, load_and_profile
from actorlm.models.runner import ModelRunner
from actorlm.openmp import on_passing_thread
from actorlm.tokenizer import PerThreadTokenizer

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0  # per actor; a worker mid-step finishes the step first


def model_geometry(hf_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) as the KV cache sees them."""
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return hf_config.num_hidden_layers, num_kv_heads, head_dim


def eos_token_ids(path, tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


@dataclass(frozen=True)
class ModelParts:
    """A model as the actors see it. ``EngineSystem`` loads one from ``config.model``; tests and
    tools may pass their own (``actorlm.testing`` brings a fake runner and a toy tokenizer)."""

    name: str
    tokenizer: Any
    make_runner: Callable[[int], Any]  # rank -> an object with execute(ScheduleStep) -> StepResult
    vocab_size: int
    eos_token_ids: frozenset[int] = frozenset()


def _direct(name: str, ref: pykka.ActorRef) -> pykka.ActorRef:
    return ref


def _direct_link(ref, sender: str, receiver: str):
    return ref


class EngineSystem:
    """Starts the engine's actors. The keyword arguments are seams for tests and tools:
    ``parts`` replaces model loading (``config`` must then be resolved already), ``clock`` is
    what the actors read time from, ``listeners`` observe every request's state machine, and
    ``route(name, ref)`` returns what an actor's peers are given in place of actor ``name``'s
    ref (a test harness returns a probe that relays, to control delivery). ``trace`` (an
    ``actorlm.trace.TraceRecorder``) records every transition, message and step.
    ``wrap_runner(runner)`` returns what the workers run in place of each runner built
    (``actorlm.testing.FaultInjector`` wraps them to make steps fault).

    ``supervisor`` hears of every core actor's death (see ``actors.supervisor``)."""

    def __init__(self, config: EngineConfig, *, parts: ModelParts | None = None, clock=time,
                 listeners: Iterable[Listener] = (),
                 route: Callable[[str, pykka.ActorRef], Any] = _direct, trace=None,
                 wrap_runner: Callable[[Any], Any] | None = None):
        self.model_path = self.hf_config = self.dtype = self.device = None
        if parts is None:
            parts = self._load_model(config)
        else:
            self.config = config
        self.tokenizer = PerThreadTokenizer(parts.tokenizer)
        make_runner = parts.make_runner
        if wrap_runner is not None:
            make_runner = lambda rank: wrap_runner(parts.make_runner(rank))  # noqa: E731
        config = self.config
        self.supervisor = supervisor = Supervisor()

        def on_death(name: str):
            return functools.partial(supervisor.actor_died, name)

        policy = Scheduler(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            block_size=config.block_size, enable_chunked_prefill=config.enable_chunked_prefill,
            eos_token_ids=parts.eos_token_ids), num_total_blocks=config.num_kv_blocks,
            listeners=[*listeners, trace.on_transition] if trace else listeners)
        self.trace = trace
        link = _direct_link
        if trace is not None:
            trace.configure(config, parts.eos_token_ids, parts.name)
            trace.attach(policy)
            link = trace.wrap  # (ref, sender, receiver) -> a ref that records what it carries
        self.frontend = self.allocator = self.executor = None
        self.scheduler = SchedulerActor.start(policy, trace, on_death("scheduler"))
        to_scheduler = route("scheduler", self.scheduler)
        try:
            self.allocator = KVAllocatorActor.start(
                config.num_kv_blocks, link(to_scheduler, "allocator", "scheduler"),
                on_death("allocator"))
            self.executor = ExecutorActor.start(make_runner, 1,
                                                link(to_scheduler, "executor", "scheduler"),
                                                on_death("executor"))
            self.frontend = FrontendActor.start(self.tokenizer, config.max_model_len,
                                                parts.vocab_size,
                                                link(to_scheduler, "frontend", "scheduler"),
                                                config.seed, clock=clock,
                                                on_death=on_death("frontend"))
        except BaseException:
            self.stop()
            raise
        self.scheduler.tell(Connect(
            link(route("frontend", self.frontend), "scheduler", "frontend"),
            link(route("allocator", self.allocator), "scheduler", "allocator"),
            link(route("executor", self.executor), "scheduler", "executor")))
        log.info("engine ready: %s, %d KV blocks of %d tokens, max_model_len %d", parts.name,
                 config.num_kv_blocks, config.block_size, config.max_model_len)

    def _load_model(self, config: EngineConfig) -> ModelParts:
        """Resolve the model and the config against it; the weights load in ``make_runner``,
        except on a GPU with no KV pool size given: there they load here, so that the largest
        step can be profiled and the pool given what is left (see ``actorlm.models.profile``),
        and that model becomes rank 0's first runner."""
        self.model_path = resolve_model(config.model)
        self.hf_config = load_hf_config(self.model_path)
        device = config.torch_device
        dtype = config.torch_dtype(self.hf_config)
        if config.dtype == "auto":
            log.info("--dtype auto: %s on this %s", str(dtype).removeprefix("torch."),
                     "CPU (native bf16)" if device.type == "cpu" and dtype == torch.bfloat16
                     else device.type.upper())
        num_layers, num_kv_heads, head_dim = model_geometry(self.hf_config)
        bytes_per_block = 2 * num_layers * config.block_size * num_kv_heads * head_dim * \
            torch.empty((), dtype=dtype).element_size()
        profile_gpu = device.type == "cuda" and not config.is_kv_pool_sized_by_user
        # flags are checked against the model before anything heavy loads
        resolved = config.resolve_lengths(self.hf_config) if profile_gpu else \
            config.resolve(self.hf_config, bytes_per_block)
        self.dtype, self.device = dtype, device
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        backend = select_backend(device)
        self.backend_name = backend.name
        eos_ids = eos_token_ids(self.model_path, self.tokenizer)

        block_size = config.block_size

        def build_runner(model, num_blocks: int) -> ModelRunner:
            return ModelRunner(model, backend, num_blocks, block_size, dtype, device, eos_ids)

        profiled: list[ModelRunner] = []  # the runner whose model was loaded to profile
        self.memory_profile = None  # a MemoryProfile where the KV pool was sized by profiling
        if profile_gpu:
            step = largest_step(resolved.max_num_batched_tokens, resolved.max_num_seqs,
                                block_size, resolved.max_model_len)
            runner, profile = on_passing_thread(  # off this thread, as make_runner (see openmp)
                load_and_profile, lambda: load_model(self.model_path, dtype, device, backend),
                build_runner, step, device)
            budget = kv_cache_budget(profile.total_bytes, profile.used_bytes,
                                     profile.peak_activation_bytes,
                                     config.gpu_memory_utilization)
            log.info("GPU memory: %.2f GiB total, %.2f GiB in use after loading the weights, "
                     "%.2f GiB peak activations; %.2f GiB for the KV cache "
                     "(--gpu-memory-utilization %s)", profile.total_bytes / 2**30,
                     profile.used_bytes / 2**30, profile.peak_activation_bytes / 2**30,
                     budget / 2**30, config.gpu_memory_utilization)
            profiled.append(runner)
            self.memory_profile = profile
            resolved = config.resolve(self.hf_config, bytes_per_block, budget)
        self.config = config = resolved

        def make_runner(rank: int) -> ModelRunner:
            if rank == 0 and profiled:  # once: a restarted worker loads afresh
                runner = profiled.pop()
                runner.allocate_kv_cache(config.num_kv_blocks)
                return runner
            model = load_model(self.model_path, dtype, device, backend)
            return build_runner(model, config.num_kv_blocks)

        return ModelParts(f"{self.model_path.name} ({dtype}, {backend.name})", self.tokenizer,
                          make_runner, self.hf_config.vocab_size, eos_ids)

    def scheduler_stats(self) -> SchedulerStats:
        return self.scheduler.ask(GetStats())

    def kv_stats(self) -> KVStats:
        return self.allocator.ask(GetStats())

    def executor_stats(self) -> ExecutorStats:
        return self.executor.ask(GetStats())

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """The conversation rendered through the model's chat template, as token ids."""
        if not conversation:
            raise ValueError("messages: the conversation is empty")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        ids = self.tokenizer.apply_chat_template(conversation, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def stats(self) -> dict:
        """Scheduler, KV pool and executor counters as one dict (blocking asks)."""
        s, kv, ex = self.scheduler_stats(), self.kv_stats(), self.executor_stats()
        return {"num_running": s.num_running, "num_waiting": s.num_waiting,
                "num_preemptions": s.num_preemptions, "num_steps": s.num_steps,
                "num_finished": s.num_finished, "num_scheduled_tokens": s.num_scheduled_tokens,
                "num_free_blocks": kv.num_free_blocks, "num_total_blocks": kv.num_total_blocks,
                "num_requests_holding_blocks": kv.num_requests_holding_blocks,
                "num_worker_restarts": ex.num_worker_restarts}

    def stop(self) -> None:
        """Stop every actor this system started, frontend first; waits for their threads (a
        bounded time each: they are daemons, and a process exiting must not hang on one)."""
        self.supervisor.shutting_down()
        for ref in (self.frontend, self.scheduler, self.executor, self.allocator):
            if ref is not None and ref.is_alive():
                try:
                    ref.stop(block=True, timeout=STOP_TIMEOUT_S)
                except pykka.Timeout:
                    log.warning("%s did not stop within %s s", ref, STOP_TIMEOUT_S)
