"""EngineCoreSystem: ``EngineSystem``'s interface with its core in a process of its own.

Here run the FrontendActor (tokenizing, detokenizing, stop strings, every output stream) and
the supervisor; the scheduler, the KV allocator and the executor run in the engine-core
process (``core_main``), reached through ``EngineCoreClient``. With ``--data-parallel-size N``
there are N cores, each with its own workers and KV pool, and the FrontendActor's scheduler
is a ``ReplicaRouter`` that balances requests over them (with one, it passes everything to
the one). The model is loaded there first: this side then reads only what the frontend
needs of it (the config the cores resolved, the tokenizer, the sampling defaults). A core
that dies is restarted and its requests resumed (``client``), the other replicas untouched;
the engine is dead only when a restart fails. Stats are the replicas' summed
(``replica_stats`` keeps them apart, for /metrics' ``engine`` label).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import pathlib
import threading

import torch

from actorlm.actors.frontend import FrontendActor
from actorlm.actors.supervisor import Supervisor
from actorlm.actors.system import EngineSystem
from actorlm.config import EngineConfig
from actorlm.engine_core.client import EngineCoreClient
from actorlm.engine_core.router import ReplicaRouter
from actorlm.engine_core.wire import CoreReady
from actorlm.generation_config import load_sampling_defaults
from actorlm.messages import ExecutorStats, KVStats, SchedulerStats
from actorlm.models.loader import load_hf_config
from actorlm.models.parts import eos_token_ids
from actorlm.models.lora_adapter import lora_checker
from actorlm.reasoning import reasoning_parser, reasoning_tokens
from actorlm.tokenizer import PerThreadTokenizer, load_tokenizer

log = logging.getLogger(__name__)


class EngineCoreSystem(EngineSystem):
    def __init__(self, config: EngineConfig, *, trace=None,
                 cancel_load: threading.Event | None = None):
        self.trace, self.supervisor = trace, Supervisor()
        self.scheduler = self.allocator = self.executor = self.frontend = None
        self.clients = [EngineCoreClient(config, trace=trace, index=index,
                                         cancel_load=cancel_load)
                        for index in range(config.data_parallel_size)]
        self.router = ReplicaRouter(self.clients)
        try:
            ready = start_all(self.clients)  # the weights load there; a load error raises here
            self.config, self.model_path = ready.config, pathlib.Path(ready.model_path)
            self.hf_config = load_hf_config(self.model_path, self.config.hf_overrides)
            self.dtype, self.device = getattr(torch, ready.dtype), torch.device(ready.device)
            self.backend_name, self.memory_profile = ready.backend_name, None
            self.kv_cache_windows = ready.kv_cache_windows
            tokenizer = load_tokenizer(self.model_path, self.config.tokenizer,
                                       self.hf_config.vocab_size)
            self.tokenizer = PerThreadTokenizer(tokenizer)
            self.eos_token_ids = eos_token_ids(self.model_path, tokenizer)
            self.sampling_defaults = load_sampling_defaults(
                self.config.generation_config, self.model_path, self.hf_config,
                self.config.override_generation_config)
            self.reasoning = None if self.config.reasoning_parser is None else \
                reasoning_tokens(reasoning_parser(self.config.reasoning_parser), tokenizer,
                                 self.model_path.name)
            to_core = trace.wrap(self.router, "frontend", "scheduler") if trace else self.router
            self.frontend = FrontendActor.start(
                self.tokenizer, self.config.max_model_len, ready.vocab_size, to_core,
                self.config.seed, on_death=functools.partial(self.supervisor.actor_died,
                                                             "frontend"),
                lora_checker=lora_checker(self.config, self.hf_config),
                priority_scheduling=self.config.scheduling_policy == "priority",
                pooler=self.config.pooler_config if self.config.is_pooling else None,
                hidden_size=self.hf_config.hidden_size, max_logprobs=self.config.max_logprobs)
        except BaseException:
            self.stop()
            raise
        self.router.attach(self.frontend, self.supervisor.engine_died)
        log.info("%d engine core(s) ready in process(es) %s: %s, %d KV blocks of %d tokens "
                 "each", len(self.clients), self.core_pids, self.model_path.name,
                 self.config.num_kv_blocks, self.config.block_size)

    @property
    def num_core_restarts(self) -> int:
        return sum(client.num_restarts for client in self.clients)

    @property
    def core_pid(self) -> int | None:
        return self.clients[0].pid

    @property
    def core_pids(self) -> list[int | None]:
        return [client.pid for client in self.clients]

    def scheduler_stats(self) -> SchedulerStats:
        return merge_stats(self._ask_all("scheduler_stats"))

    def kv_stats(self) -> KVStats:
        return merge_stats(self._ask_all("kv_stats"))

    def executor_stats(self) -> ExecutorStats:
        return merge_stats(self._ask_all("executor_stats"))

    def reset_prefix_cache(self) -> bool:
        return all(self._ask_all("reset_prefix_cache"))

    def replica_stats(self) -> list[dict]:
        """``stats()`` of each replica, in index order (the ``engine`` label of /metrics)."""
        return [self.stats_of(s, kv, ex, client.num_restarts) for s, kv, ex, client in zip(
            self._ask_all("scheduler_stats"), self._ask_all("kv_stats"),
            self._ask_all("executor_stats"), self.clients)]

    def _ask_all(self, query: str) -> list:
        return [getattr(client.ask(query), query) for client in self.clients]

    def stop(self) -> None:
        """The frontend first (no new input), then the core, which stops its own actors."""
        self.supervisor.shutting_down()
        if self.frontend is not None and self.frontend.is_alive():
            self.frontend.stop(block=True, timeout=5.0)
        stopping = [threading.Thread(target=client.stop) for client in self.clients]
        for thread in stopping:  # together: each may wait its grace period (a plain thread,
            thread.start()  # as this may run at interpreter exit, when pools are refused)
        for thread in stopping:
            thread.join()


def start_all(clients: list[EngineCoreClient]) -> CoreReady:
    """Start every replica's core at once (each loads the weights) and wait for all; the
    first's ready. One that cannot load fails them all, the others stopped."""
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        starts = [pool.submit(client.start) for client in clients]
        concurrent.futures.wait(starts)
    for start in starts:
        start.result()  # raises the first load error
    return starts[0].result()


def merge_stats(per_replica: list):
    """The replicas' counters as one: numbers summed, lists summed position by position
    (blocks per KV-cache group, drafts accepted per position) or joined (worker pids; the
    LoRA adapters running and waiting, each name once)."""
    first, merged = per_replica[0], {}
    for field in first.__struct_fields__:
        values = [getattr(stats, field) for stats in per_replica]
        if field == "worker_pids":
            merged[field] = [pid for pids in values for pid in pids]
        elif field == "step_running_s":  # the replica that waits longest
            merged[field] = max(values)
        elif field.endswith("_lora_adapters"):
            merged[field] = sorted(set().union(*values))
        elif isinstance(values[0], list):
            merged[field] = [sum(column) for column in itertools.zip_longest(*values,
                                                                             fillvalue=0)]
        else:
            merged[field] = sum(values)
    return type(first)(**merged)


def start_engine(config: EngineConfig, *, trace=None,
                 cancel_load: threading.Event | None = None) -> EngineSystem:
    """The engine ``config`` asks for: its core in this process, or in processes of its own
    (one a data-parallel replica). Setting ``cancel_load`` while the cores load kills them
    (``LoadCancelled`` raises here); a core in this process loads to the end."""
    if config.engine_core_process or config.data_parallel_size > 1:
        return EngineCoreSystem(config, trace=trace, cancel_load=cancel_load)
    return EngineSystem(config, trace=trace)
