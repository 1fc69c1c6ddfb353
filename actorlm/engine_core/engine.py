"""EngineCoreSystem: ``EngineSystem``'s interface with its core in a process of its own.

Here run the FrontendActor (tokenizing, detokenizing, stop strings, every output stream) and
the supervisor; the scheduler, the KV allocator and the executor run in the engine-core
process (``core_main``), reached through ``EngineCoreClient``, which the FrontendActor takes
for its scheduler. The model is loaded there first: this side then reads only what the
frontend needs of it (the config the core resolved, the tokenizer, the sampling defaults).
A core that dies is restarted and its requests resumed (``client``); the engine is dead only
when a restart fails.
"""

from __future__ import annotations

import functools
import logging
import pathlib

import torch
from transformers import AutoTokenizer

from actorlm.actors.frontend import FrontendActor
from actorlm.actors.supervisor import Supervisor
from actorlm.actors.system import EngineSystem
from actorlm.config import EngineConfig
from actorlm.engine_core.client import EngineCoreClient
from actorlm.generation_config import load_sampling_defaults
from actorlm.messages import ExecutorStats, KVStats, SchedulerStats
from actorlm.models.loader import load_hf_config
from actorlm.reasoning import ThinkTokens, reasoning_parser
from actorlm.tokenizer import PerThreadTokenizer

log = logging.getLogger(__name__)


class EngineCoreSystem(EngineSystem):
    def __init__(self, config: EngineConfig, *, trace=None):
        self.trace, self.supervisor = trace, Supervisor()
        self.scheduler = self.allocator = self.executor = self.frontend = None
        self.client = EngineCoreClient(config, trace=trace)
        try:
            ready = self.client.start()  # the weights load there, and a load error raises here
            self.config, self.model_path = ready.config, pathlib.Path(ready.model_path)
            self.hf_config = load_hf_config(self.model_path)
            self.dtype, self.device = getattr(torch, ready.dtype), torch.device(ready.device)
            self.backend_name, self.memory_profile = ready.backend_name, None
            self.kv_cache_windows = ready.kv_cache_windows
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self.tokenizer = PerThreadTokenizer(tokenizer)
            self.sampling_defaults = load_sampling_defaults(self.config.generation_config,
                                                            self.model_path, self.hf_config)
            self.reasoning = None if self.config.reasoning_parser is None else \
                ThinkTokens.for_tokenizer(reasoning_parser(self.config.reasoning_parser),
                                          tokenizer, self.model_path.name)
            to_core = trace.wrap(self.client, "frontend", "scheduler") if trace else self.client
            self.frontend = FrontendActor.start(
                self.tokenizer, self.config.max_model_len, ready.vocab_size, to_core,
                self.config.seed, on_death=functools.partial(self.supervisor.actor_died,
                                                             "frontend"))
        except BaseException:
            self.stop()
            raise
        self.client.attach(self.frontend, self.supervisor.engine_died)
        log.info("engine core ready in process %d: %s, %d KV blocks of %d tokens",
                 ready.pid, self.model_path.name, self.config.num_kv_blocks,
                 self.config.block_size)

    @property
    def num_core_restarts(self) -> int:
        return self.client.num_restarts

    @property
    def core_pid(self) -> int | None:
        return self.client.pid

    def scheduler_stats(self) -> SchedulerStats:
        return self.client.ask("scheduler_stats").scheduler_stats

    def kv_stats(self) -> KVStats:
        return self.client.ask("kv_stats").kv_stats

    def executor_stats(self) -> ExecutorStats:
        return self.client.ask("executor_stats").executor_stats

    def reset_prefix_cache(self) -> bool:
        return self.client.ask("reset_prefix_cache").reset

    def stop(self) -> None:
        """The frontend first (no new input), then the core, which stops its own actors."""
        self.supervisor.shutting_down()
        if self.frontend is not None and self.frontend.is_alive():
            self.frontend.stop(block=True, timeout=5.0)
        self.client.stop()


def start_engine(config: EngineConfig, *, trace=None) -> EngineSystem:
    """The engine ``config`` asks for: its core in this process, or in one of its own."""
    if config.engine_core_process:
        return EngineCoreSystem(config, trace=trace)
    return EngineSystem(config, trace=trace)
